"""Plumbing the scripts share and that is not algorithm: input errors, optimizer groups, the LR schedule,
tokenizer loading, precision contexts. (A run's log and progress line: nano_rlhf/reporting.py.)"""
import contextlib
import json
import math
import os
import sys

import torch

from . import dist
from .data import DataError, split_off  # noqa: F401  (split_off re-exported: it lived here)
from .model import GPT
from .run import check_finite, fail  # noqa: F401  (re-exported: they lived here)


@contextlib.contextmanager
def input_errors():
    """Turn bad-input exceptions (DataError, missing files, bad model dirs) into a one-line exit."""
    try:
        yield
    except (DataError, FileNotFoundError, ValueError) as e:
        fail(str(e))


def adamw(model, lr, weight_decay, betas=(0.9, 0.95), eps=1e-8):
    """AdamW with weight decay on matrices only: biases, norm weights and the embeddings (GPT-2's wte, also the
    tied output layer, and wpe; the Llama family's embed_tokens) are not decayed (nanoGPT / GPT-2 practice)."""
    decay, no_decay = [], []
    for name, p in dist.unwrap(model).named_parameters():
        if not p.requires_grad:
            continue
        embedding = name.endswith(("wte.weight", "wpe.weight", "embed_tokens.weight"))
        (decay if p.dim() >= 2 and not embedding else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=True: one fused kernel per group instead of a Python loop over 50 tensors
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)


def lr_at(step, max_steps, lr, warmup_steps, schedule="cosine", min_lr_ratio=0.1):
    """Linear warm-up over warmup_steps, then cosine decay to min_lr_ratio * lr (or linear to 0, or constant)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    frac = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return lr * (1.0 - frac)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def set_lr(optimizer, lr):
    for g in optimizer.param_groups:
        g["lr"] = lr


def autocast(device, dtype: str):
    """bfloat16 autocast when asked (weights stay float32); a no-op for float32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


def load_tokenizer(tokenizer_path: str, model_dir: str, eos_token: str = "", pad_token: str = "",
                   chat_template: str = "auto", date_string: str = "", policy: bool = False):
    """--tokenizer if given, else the tokenizer.json saved beside the model; --eos_token / --pad_token name
    the special tokens when neither a tokenizer_config.json nor the usual names give them; --chat_template
    names the template variant (auto: recognised from the tokenizer's own template text), --date_string fixes
    Llama 3's "Today Date" (empty: the one saved with the tokenizer, else the template's default). policy=True: the
    model directory must hold a language model, not a reward model (whose trunk would load and be sampled)."""
    from .tokenizer import Tokenizer
    path = tokenizer_path or os.path.join(model_dir, "tokenizer.json")
    if not tokenizer_path and not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir}: " + ("a file, not a model directory (an HF directory with config.json"
                                                    " and the weights)" if os.path.exists(model_dir) else
                                                    "no such model directory"))
    if not tokenizer_path and os.path.isfile(os.path.join(model_dir, "adapter_config.json")) \
            and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir}: a LoRA adapter directory, not a model: a run's merged model is the "
                                f"directory above its adapter/; or pass the base model with --lora_r")
    score = score_architecture(model_dir) if policy and model_dir else ""
    if score:
        raise ValueError(f"{model_dir}: a reward model ({score}), not a language model; a policy starts from a "
                         f"*ForCausalLM directory")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing; pass --tokenizer (the tokenizer.json the model was trained with)")
    return Tokenizer.from_file(path, eos_token or None, pad_token or None, chat_template, date_string or None)


def score_architecture(model_dir: str) -> str:
    """The *ForSequenceClassification architecture a model directory's config.json names ('' for anything else,
    an unreadable config included: reading the model reports that)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return ""
    return next((a for a in archs if isinstance(a, str) and a.endswith("ForSequenceClassification")), "")


def check_vocab(tok, cfg, where: str):
    """Stop with one line if the tokenizer makes ids the model has no embedding for (a tokenizer.json from
    another model): an id >= vocab_size would index past wte (an IndexError on CPU, a device assert on
    CUDA) long after start-up. A pad id outside the tokenizer's vocabulary is fine: the model masks it.
    When `where` is the model's directory and holds a tokenizer.json, that must be the same tokenizer
    (tokenizer.mismatch): a model trained with another tokenizer of the same size reads every id as another
    token, silently."""
    if tok.vocab_size > cfg.vocab_size:
        fail(f"{where}: the tokenizer has {tok.vocab_size} tokens but the model's vocabulary only "
             f"{cfg.vocab_size}; pass the tokenizer.json the model was trained with (--tokenizer)")
    if where and os.path.isdir(where):       # a model directory: the same size is not the same tokenizer
        from .tokenizer import mismatch
        msg = mismatch(tok, where)
        if msg:
            fail(msg)


def load_reference(ref_dir: str, tok, length: int, what: str):
    """A frozen reference policy (no dropout, no gradient, eval mode) read with the tokenizer's vocabulary checked
    and room for `length` tokens; `what` names that length in the error (e.g. "policy's 1024")."""
    ref = GPT.from_pretrained(ref_dir, dropout=0.0).requires_grad_(False).eval()
    check_vocab(tok, ref.cfg, ref_dir)
    if ref.cfg.block_size < length:
        raise ValueError(f"{ref_dir}: the reference's block_size {ref.cfg.block_size} is smaller than the {what}")
    return ref


def check_output_file(flag, path, input_files=(), input_dirs=()):
    """One line, before any work, if writing `path` would destroy an input: the same file as one of input_files
    (compared after resolving links, so a symlink to the prompts counts), or a file of a run in one of
    input_dirs (model directories: their weights, config, tokenizer, metrics, samples, state). A missing or
    unwritable directory is refused too."""
    from .checkpoint import RUN_FILES
    if os.path.isdir(path):
        fail(f"{flag} {path}: is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        fail(f"{flag} {path}: cannot be written (its directory {folder} does not exist or is not writable)")
    target = os.path.realpath(path)
    for f in input_files:
        if f and os.path.exists(f) and os.path.realpath(f) == target:
            fail(f"{flag} {path}: is an input of this command ({f}); write elsewhere")
    for d in input_dirs:
        if d and os.path.isdir(d) and os.path.dirname(target) == os.path.realpath(d):
            name = os.path.basename(target)
            if name in RUN_FILES or name.endswith((".safetensors", ".json", ".jsonl")) and os.path.exists(target):
                fail(f"{flag} {path}: would replace {name} of the model directory {d}; write elsewhere")


def check_device(device: str):
    """--device must name something this machine has: one line otherwise (before any work)."""
    bad = dist.device_problem(device)
    if bad:
        fail(bad, 2)


def derive_max_steps(opts, steps_per_epoch):
    """--max_steps, or (when it is 0) as many steps as --epochs takes; a warning when the run is shorter than
    its warm-up (a small data set at --epochs 1: the learning rate would never reach --lr; a reward model on a
    one-word preference was measured to stay at 0.67-0.80 held-out accuracy after 9 such steps)."""
    max_steps = opts.max_steps or max(1, int(opts.epochs * steps_per_epoch))
    warn_short_warmup(max_steps, opts.warmup_steps, "raise --epochs or --max_steps")
    return max_steps


def warn_short_warmup(max_steps, warmup_steps, fix="raise --max_steps"):
    """One warning (rank 0) when the run ends before its warm-up does: the learning rate never reaches --lr."""
    if max_steps < warmup_steps and dist.world().is_main:
        print(f"warning: this run is {max_steps} optimizer steps, fewer than --warmup_steps {warmup_steps}, so "
              f"the learning rate never reaches --lr; {fix}, or lower --warmup_steps", file=sys.stderr, flush=True)

