"""The set-up every training script shares, written once (as nanochat's `compute_init`): options in, the run's
distributed context, run record, tokenizer and placed models out. A script's main() reads, in order:

    opts, world, run, files = launch.start(Options, argv, __doc__, check_options, "dpo", run_record,
                                           load=data_files)
    tok = launch.tokenizer(opts, run)
    ... the script's own models and data, in its own order ...
    launch.place(opts, world, {"policy": policy}, {"reference model": ref})   # device, same weights, seeds
    ref = launch.frozen(opts, ref)                                             # --fsdp / --frozen / --offload_frozen
    ddp, optimizer = launch.wrap(opts, policy, opts.lr)                        # compile, DDP / FSDP, AdamW
    launch.plan(opts, {"policy": policy, "ref": ref})                          # the memory plan
    launch.resume(opts, run, {"policy": policy}, {"policy": optimizer}, data={"data": batches})
    ... the loop: run.end_of_step(..., save=...) with launch.save(...) inside save ...
    launch.finish(run, {"policy": policy}, {"reference": ref}, saved="saved out/dpo ...")

So --fsdp, --lora_* (only the adapters in the state), --report_to, --resume / --overwrite, the same-weights
check, the seeding, the memory plan and train_config.json are the same code in every script. What differs stays
visible in the script: which inputs it reads and in what order (that order decides which bad input a user is
told about first: train_sft.py and train_rm.py validate every data line before the run starts, through
start's `load`), what it computes between placing and wrapping (train_dpo.py's precomputed reference log-probs,
train_unpaired.py's D2O samples), and its loop.
"""
import os

import torch

from . import dist, lora, parallel
from . import run as run_mod
from .checkpoint import save_state
from .builtin import default_data
from .common import adamw, input_errors, load_tokenizer
from .config import parse_args, save_config
from .jsonl import load_train_eval


def start(Options, argv, doc, check, script, record, load=None):
    """Parse the command line into Options (ranges checked), apply the script's cross-field rules
    (check(opts): one line and exit on a bad combination, and the defaults that depend on other options),
    start the distributed context, then — when the script reads inputs that must be valid before anything is
    written — load(opts) (called on every rank; it raises or exits with one line on bad input), and last start
    the run (out_dir checks, its lock, --report_to, --resume's record; nano_rlhf.run.start).
    record(opts, data) -> {"identity": ..., "inputs": ..., "data_files": ...}: what defines the run.
    Returns (opts, the distributed context, the run, load's result or None)."""
    opts = parse_args(Options, argv, doc)
    check(opts)
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    data = load(opts) if load is not None else None
    run = run_mod.start(opts, script=script, **record(opts, data))
    return opts, world, run, data


def train_eval_records(opts, kind):
    """(train records, eval records, training file, eval file description) of a data kind ("sft",
    "preference"): --data and --eval_data, else the built-in task's files; with --data and no --eval_data,
    --eval_fraction of it is split off (seeded). Every line is validated here, before anything is written or
    built: a bad line is one line and exit 1. A `load` for start() (train_sft.py, train_rm.py)."""
    with input_errors():
        data_path = opts.data or default_data(kind)
        eval_path = opts.eval_data or ("" if opts.data else default_data(kind, "eval"))
        records, eval_records = load_train_eval(kind, data=data_path, eval_data=eval_path,
                                                eval_fraction=opts.eval_fraction, seed=opts.seed)
    return records, eval_records, data_path, eval_path or f"the --eval_fraction split of {data_path}"


def tokenizer(opts, run, train=None, policy=True):
    """The tokenizer --tokenizer names (else --init's tokenizer.json), with --eos_token, --pad_token,
    --chat_template and --date_string applied; train() makes one instead when neither is given (train_sft.py
    trains one on its data); policy=False lets --init be a reward model (train_rm.py). What it resolved ("auto"
    to a template, an empty --date_string to a date) enters
    the run's identity: a --resume must render the data to the same tokens."""
    if train is not None and not (opts.tokenizer or getattr(opts, "init", "")):
        tok = train()
    else:
        tok = load_tokenizer(opts.tokenizer, getattr(opts, "init", ""), opts.eos_token, opts.pad_token,
                             opts.chat_template, opts.date_string, policy)
    run.identity.update(chat_template=tok.chat_template, date_string=tok.date_string)
    return tok


def place(opts, world, trained, frozen=None):
    """The run's models on this rank's device, each the same on every rank (checked: DDP would average the
    gradients of different models), then every RNG seeded for this rank (from here on ranks differ: dropout,
    sampling). trained / frozen: {name (as errors print it): model or None}; --grad_checkpoint applies to the
    trained ones (the frozen ones run without gradients: nothing to recompute)."""
    for m in trained.values():
        if m is not None and opts.grad_checkpoint:
            m.set_grad_checkpointing(True)
    models = {k: m for k, m in {**trained, **(frozen or {})}.items() if m is not None}
    for m in models.values():
        m.to(world.device)
    for name, m in models.items():
        dist.check_same_weights(m, name)
    dist.seed_everything(opts.seed, world.rank)


def wrap(opts, model, lr):
    """A trained model ready to train -> (what its forward/backward go through, its optimizer): torch.compile'd
    with --compile, sharded with --fsdp under torchrun (FSDP2), else DDP under torchrun, else the model itself;
    AdamW (weight decay on matrices only) at peak learning rate lr with the script's --weight_decay, --beta1,
    --beta2 and --adam_eps where it has them (else 0.9, 0.95, 1e-8), built after the sharding. The model itself
    stays what is saved and evaluated."""
    wrapped = parallel.wrap(torch.compile(model) if getattr(opts, "compile", False) else model, opts.fsdp,
                            dtype=opts.dtype)
    betas = (getattr(opts, "beta1", 0.9), getattr(opts, "beta2", 0.95))
    return wrapped, adamw(model, lr, opts.weight_decay, betas, eps=getattr(opts, "adam_eps", 1e-8))


def frozen(opts, model):
    """A frozen model (a reference, a reward model) placed by --fsdp / --frozen / --offload_frozen; None and
    LoRA's adapters-off view of the policy pass through. Its checksum is taken for finish()'s check."""
    return parallel.prepare_frozen(model, opts.fsdp, getattr(opts, "frozen", "shard"),
                                   getattr(opts, "offload_frozen", False), opts.dtype)


def plan(opts, models):
    """Print (rank 0) the memory plan of the run's live models {name: model or None}; the first one is the
    trained model whose sharding names the strategy."""
    first = next(m for m in models.values() if m is not None)
    strategy = "fsdp" if parallel.is_sharded(first) else "ddp"
    if hasattr(opts, "frozen"):
        dist.print0(parallel.startup_plan(models, strategy, opts.frozen, opts.offload_frozen))
    else:
        dist.print0(parallel.startup_plan(models, strategy))


def resume(opts, run, models, optimizers, data=None, generators=None, **config):
    """--resume: the saved run checked to be this one, then models ({name: model}; under LoRA only the adapters
    are in the state), optimizers, generators and each data order in `data` ({meta key: object with
    load_state_dict}) restored; returns the saved meta ({} on a fresh start). Then rank 0 writes
    out_dir/train_config.json: the resolved options, the world size and `config`."""
    meta = {}
    if opts.resume:
        meta = run.resume({k: lora.checkpointed(m) for k, m in models.items()}, optimizers, generators)
        for key, order in (data or {}).items():
            order.load_state_dict(meta[key])
    world = dist.world()
    if world.is_main:
        save_config(opts, os.path.join(opts.out_dir, "train_config.json"), world_size=world.world_size, **config)
    return meta


def save(opts, step, models, optimizers, data=None, generators=None, **meta):
    """The training state at `step` into out_dir/state (collective): models (LoRA: the adapters), optimizers,
    generators, each data order's state_dict() under its key in `data`, and any other meta."""
    meta = {"step": step, **{k: order.state_dict() for k, order in (data or {}).items()}, **meta}
    save_state(opts.out_dir, {k: lora.checkpointed(m) for k, m in models.items()}, optimizers, meta, generators)


def finish(run, trained, frozen=None, saved=""):
    """The end of a run: every trained model still the same on every rank (DDP kept them in lock-step: proven),
    every frozen model bit-identical to its start (those frozen() placed), the `saved` line printed, the run
    closed."""
    for name, m in trained.items():
        if m is not None:
            dist.check_same_weights(m, name)
    if frozen:
        parallel.check_frozen(frozen)
    if saved:
        dist.print0(saved)
    run.finish()
