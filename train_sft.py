"""Supervised fine-tuning (SFT): maximise the likelihood of the demonstrations' responses.

    L(θ) = − Σ_{b,t} m_{b,t} · log π_θ(y_{b,t} | x_b, y_{b,<t})  /  Σ_{b,t} m_{b,t}

m marks completion / assistant tokens (the closing end-of-text included, so the model learns to stop);
prompt tokens carry no loss. The token-mean is global over the whole optimizer step: the number of loss
tokens of all micro-batches on all ranks is all-reduced first, so 1 micro-batch of 4 ≡ 4 of 1 ≡ 2 ranks × 2.
{"text"} rows train on every token (plain language modelling); a text longer than the context keeps its
beginning. See docs/algorithms.md, "SFT".

Run:
    python train_sft.py                                   # built-in task, from scratch -> out/sft
    python train_sft.py --data sft.jsonl --init gpt2_dir --out_dir out/my_sft --lr 1e-4
    python train_sft.py --data chat.jsonl --init qwen3_dir --lr 1e-5 --packing --grad_checkpoint --dtype bfloat16
    torchrun --nproc_per_node 2 train_sft.py              # data parallel on one machine
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 --nproc_per_node 8 train_sft.py
    python train_sft.py --resume                          # continue out/sft from its last checkpoint

--max_length is the training sequence length (default min(block_size, 1024): an --init model may declare 128k
positions): longer examples are truncated by the over-long rule (nano_rlhf/data.py), packed rows fill up to it.

--packing concatenates consecutive examples (in data order) into rows of up to --max_length tokens, each
example keeping its own positions (restarting at 0) and attending only to itself (a block-diagonal causal
mask), so the loss is exactly the unpacked one with fewer pad tokens; the eval loss runs unpacked.

--lora_r R trains low-rank adapters on the frozen --init model instead of every weight (nano_rlhf/lora.py):
the output directory holds the merged model (an ordinary HF checkpoint) and the adapters alone in
out_dir/adapter (PEFT's layout); the state holds only the adapters, and --resume re-reads the base.
"""
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from nano_rlhf import chat, dist, lora, parallel
from nano_rlhf import training
from nano_rlhf.checkpoint import save_model_dir
from nano_rlhf.cli import CompileOption, RunOptions, parse_args
from nano_rlhf.data import Batches, collate_packed, collate_sft, pack_sft, tokenize_sft, training_length
from nano_rlhf.model import GPT, GPTConfig, is_right_padded
from nano_rlhf.tokenizer import Tokenizer
from nano_rlhf.training import (autocast, check_device, check_finite, check_vocab, derive_max_steps, fail,
                                input_errors, load_tokenizer, lr_at, set_lr, step_if_finite)


@dataclass
class Options(CompileOption, RunOptions):
    data: str = ""                # SFT JSONL ({"prompt","completion"}, {"text"} or {"messages"}); empty = built-in task
    eval_data: str = ""           # held-out SFT JSONL for the eval loss; empty = split --eval_fraction off --data
    eval_fraction: float = 0.05   # share of --data held out when no --eval_data is given {0 < x < 1}
    init: str = ""                # model directory to start from (HF GPT-2, Llama, Qwen2 or Qwen3 layout); empty = from
                                  # scratch
    tokenizer: str = ""           # tokenizer.json; empty = the one in --init, or train one on the data
    out_dir: str = "out/sft"      # where the model, tokenizer, metrics and state go
    n_layer: int = 4              # layers (from scratch only) {>= 1}
    n_head: int = 4               # attention heads (from scratch only) {>= 1}
    n_embd: int = 128             # width (from scratch only; a multiple of --n_head) {>= 1}
    block_size: int = 64          # context length (from scratch only); longer examples follow the over-long rule {>= 2}
    vocab_size: int = 512         # BPE vocabulary size when a tokenizer is trained here {>= 1}
    dropout: float = 0.0          # dropout in every layer {0 <= x < 1}
    batch_size: int = 32          # sequences per device per micro-step {>= 1}
    grad_accum: int = 1           # micro-steps per optimizer step {>= 1}
    max_steps: int = 0            # optimizer steps; 0 = derived from --epochs {>= 0}
    epochs: float = 2.0           # passes over the data when --max_steps is 0 {> 0}
    lr: float = 2e-3              # peak learning rate; GPT-2-124M: 1e-4, 0.5-1.5B models: 1e-5 {0 < x <= 1e3}
    min_lr_ratio: float = 0.1     # cosine decay ends at this fraction of --lr {0 <= x <= 1}
    warmup_steps: int = 30        # linear warm-up steps {>= 0}
    weight_decay: float = 0.1     # AdamW decoupled weight decay (matrices only) {>= 0}
    beta1: float = 0.9            # AdamW beta1 {0 <= x < 1}
    beta2: float = 0.95           # AdamW beta2 {0 <= x < 1}
    grad_clip: float = 1.0        # clip the global gradient norm to this (0 = off) {>= 0}
    seed: int = 0                 # seed for init, data order and dropout {>= 0}
    packing: bool = False         # concatenate several examples per row up to --max_length (each attends only to
                                  # itself)
    max_length: int = 0           # training sequence length: longer examples follow the over-long rule, packed rows
                                  # fill up to it; 0 = min(block_size, 1024) {>= 0}
    lora_r: int = 0               # LoRA rank: train rank-r adapters on the frozen --init model instead of every weight;
                                  # 0 = off {>= 0}


# ---- the loss --------------------------------------------------------------------------------------

def sft_nll(model, input_ids, attention_mask, loss_mask, position_ids=None, doc_ids=None):
    """Sum over supervised tokens of −log π(y_t | y_<t), and how many there are.

    Shift: the hidden state at position t predicts token t+1, so token t+1 is scored iff loss_mask[t+1] = 1;
    the first response token is predicted from the last prompt position. Only those positions' hidden states
    go through the output layer (select=...), in chunks bounded in memory for real vocabularies
    (token_logprobs), in float32 for the log-softmax whatever the autocast dtype, inside the model's forward
    (targets=...): what DDP hooks when `model` is DDP-wrapped, and what --compile compiles whole.
    Packed rows (--packing) pass their per-example positions and example ids as doc_ids: the model then lets each
    example attend only to itself (a block-diagonal causal mask), so its loss is the one it has alone in a row.
    """
    target_mask = loss_mask[:, 1:].bool()                          # (B, T-1): is token t+1 supervised?
    select = F.pad(target_mask, (0, 1))                            # (B, T): the positions that predict them
    # as flat indices b·T + t, found where loss_mask is: train_step keeps it on the CPU, so that a GPU step
    # selects its positions without a host read (a mask would have to be counted first)
    positions = select.flatten().nonzero().squeeze(1).to(input_ids.device)                        # (N,)
    packed = {} if doc_ids is None else {"position_ids": position_ids, "doc_ids": doc_ids}
    targets = input_ids.flatten()[positions + 1]          # (N,) token t+1 (select's last column is never set)
    logp = model(input_ids, attention_mask, select=positions, targets=targets, **packed)            # (N,)
    return -logp.sum(), targets.numel()


# ---- data and tokenizer ----------------------------------------------------------------------------

def record_texts(records):
    """The plain text of each SFT record, to train a tokenizer on: what the plain template shows the model, tool
    lists and calls included (so that their fixed markup gets tokens of its own)."""
    def flat(value):
        if isinstance(value, str):
            return value
        return "".join(f"{m['role'].title()}: "
                       f"{chat.assistant_text('plain', m.get('content') or '', m.get('tool_calls'))}\n" for m in value)
    for r in records:
        if r.get("tools"):
            yield chat.plain_tools_text(r["tools"])
        if "text" in r:
            yield r["text"]
        elif "messages" in r:
            yield flat(r["messages"])
        else:
            yield flat(r["prompt"])
            yield flat(r["completion"])


def train_tokenizer(records, opts):
    """A BPE tokenizer of --vocab_size trained on the records (with the special tokens of --chat_template;
    auto = plain), saved as out_dir/tokenizer.json (the model directory's tokenizer) with the template and
    date; --resume loads the one saved there instead. Rank 0 trains it, the other ranks load that very file."""
    path = os.path.join(opts.out_dir, "tokenizer.json")
    if dist.world().is_main and not (opts.resume and os.path.isfile(path)):
        os.makedirs(opts.out_dir, exist_ok=True)
        Tokenizer.train(record_texts(records), opts.vocab_size, chat_template=opts.chat_template,
                        date_string=opts.date_string or None).save(path)
    dist.barrier()
    return load_tokenizer(path, "", opts.eos_token, opts.pad_token, opts.chat_template, opts.date_string)


def run_record(opts, data_path):
    """The inputs an SFT run only reads and its data files (its options are its identity:
    nano_rlhf/training.py)."""
    return dict(inputs={"init": opts.init, "tokenizer": opts.tokenizer},
                data_files={"data": data_path, "eval_data": opts.eval_data})


def build_model(opts, tok):
    """The policy: --init's weights, or a fresh GPT of the given shape; identical on every rank."""
    torch.manual_seed(opts.seed)
    if opts.init:
        model = GPT.from_pretrained(opts.init, dropout=opts.dropout)
    else:
        model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=opts.block_size, n_layer=opts.n_layer,
                              n_head=opts.n_head, n_embd=opts.n_embd, dropout=opts.dropout))
    check_vocab(tok, model.cfg, opts.tokenizer or opts.init or "--tokenizer")
    model.cfg.eos_token_id, model.cfg.pad_token_id = tok.eos_id, tok.pad_id
    return model


def tokenize(records, tok, block_size, path):
    """Tokenized examples and their stats; an error naming the file when none fits."""
    examples, stats = tokenize_sft(records, tok, block_size)
    if not examples:
        raise ValueError(f"{path}: none of its {len(records)} example(s) fits in {block_size} tokens "
                         f"(each response alone is longer)")
    return examples, stats


# ---- one optimizer step and the evaluation ---------------------------------------------------------

def train_step(ddp, optimizer, micro_batches, opts, step):
    """Forward/backward over this rank's micro-batches, then one optimizer step -> metrics.

    The loss is the token-mean over the whole optimizer step on every rank: each micro-batch's summed NLL
    is divided by the GLOBAL number of loss tokens (one all-reduce before the forwards), and multiplied by
    world_size because DDP averages gradients over ranks."""
    world, t0 = dist.world(), time.time()
    n_loss_tokens = max(1, dist.all_reduce_sum(sum(int(mb[2][:, 1:].sum()) for mb in micro_batches)))
    nll_sum, n_tokens = torch.zeros((), dtype=torch.float64, device=world.device), 0
    for j, mb in enumerate(micro_batches):
        # (ids, attn, loss mask) or, packed, (ids, attn, loss mask, position ids, example ids), on the CPU: what
        # the host decides from them (the token count, the positions, whether a mask is needed) costs no read
        ids, attn, lm, *packed = mb
        n_tokens += int(attn.sum())
        if not packed and is_right_padded(attn):
            attn = None                                  # causal attention never lets a real token see a pad
        # copied even on a CPU, so the step's device tensors are never the host's (tests/test_host_reads.py)
        ids, attn, *packed = (t if t is None else t.to(world.device, non_blocking=True, copy=True)
                              for t in (ids, attn, *packed))
        parallel.sync_gradients(ddp, j == len(micro_batches) - 1)    # all-reduce gradients on the last one only
        with autocast(world.device, opts.dtype):
            nll, _ = sft_nll(ddp, ids, attn, lm, *packed)
        (nll * world.world_size / n_loss_tokens).backward()
        nll_sum += nll.detach()
    loss = dist.all_reduce_sum(nll_sum) / n_loss_tokens
    grad_norm = parallel.clipped_grad_norm(ddp.parameters(), opts.grad_clip)
    step_if_finite(optimizer, loss.isfinite() & grad_norm.isfinite())     # never apply a non-finite update
    optimizer.zero_grad(set_to_none=True)
    loss, grad_norm = torch.stack([loss, grad_norm.double()]).tolist()    # the step's one read from the device
    check_finite(loss, step, opts.out_dir)
    check_finite(grad_norm, step, opts.out_dir, "gradient norm")
    tokens_per_s = dist.all_reduce_sum(n_tokens) / max(time.time() - t0, 1e-9)
    return {"train/loss": loss, "train/grad_norm": grad_norm, "train/tokens_per_s": tokens_per_s}


@torch.no_grad()
def evaluate_loss(model, examples, *, pad_id, batch_size, dtype):
    """{"eval/loss": global token-mean NLL over the eval set} (each rank takes a shard; sums all-reduced)."""
    model.eval()
    device = next(model.parameters()).device
    mine = dist.rank_share(examples)
    nll_sum, count = 0.0, 0
    for i in range(0, len(mine), batch_size):
        ids, attn, lm = (t.to(device) for t in collate_sft(mine[i:i + batch_size], pad_id))
        with autocast(device, dtype):
            nll, n = sft_nll(model, ids, attn, lm)
        nll_sum, count = nll_sum + nll.item(), count + n
    model.train()
    return {"eval/loss": dist.all_reduce_sum(nll_sum) / max(1.0, dist.all_reduce_sum(count))}


def check_options(opts):
    """--device one this machine has, then the cross-field rules (each field's own range is declared in Options
    and checked by parse_args)."""
    check_device(opts.device)
    if opts.max_steps and opts.stop_at > opts.max_steps:
        fail(f"--stop_at {opts.stop_at} is past --max_steps {opts.max_steps}", 2)
    if opts.fsdp and opts.compile:
        fail("--compile with --fsdp is not supported; drop one of them", 2)
    if not opts.init and opts.n_embd % opts.n_head:
        fail(f"--n_embd {opts.n_embd} must be a multiple of --n_head {opts.n_head}", 2)
    if not opts.init and opts.max_length > opts.block_size:
        fail(f"--max_length {opts.max_length} is above --block_size {opts.block_size}", 2)
    msg = lora.check_lora_options(opts, needs_init="init")
    if msg:
        fail(msg, 2)


def main(argv=None):
    opts = parse_args(Options, argv, __doc__)      # each option's range and [with ...] refused here
    check_options(opts)                            # --device and the rules between options; only refuses
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    # the data before the run opens: every line is validated before anything is written or built
    records, eval_records, data_path, eval_path = training.train_eval_records(opts, "sft")
    run = training.open_run(opts, "sft", **run_record(opts, data_path),
                            show=["train/loss", "eval/loss", "train/lr", "train/grad_norm"])
    with input_errors():
        scratch = not (opts.tokenizer or opts.init)      # then a BPE trained on the data, saved with the model
        tok = training.tokenizer(opts, run, made=train_tokenizer(records, opts) if scratch else None)
        model = build_model(opts, tok)
        run.identity.update(lora.attach(model, opts, opts.init))   # --lora_r: adapters, the base frozen
        max_length = training_length(opts.max_length, model.cfg.block_size, opts.init or "the new model")
        run.identity.update(max_length=max_length)   # --max_length resolved: what the data is cut to
        train, train_stats = tokenize(records, tok, max_length, data_path)
        evals, eval_stats = tokenize(eval_records, tok, max_length, eval_path)
        if opts.packing:
            n_examples = len(train)
            train = pack_sft(train, max_length)
            train_stats = f"{train_stats}; packed {n_examples} into {len(train)} rows"
        batches = Batches(len(train), opts.batch_size, opts.grad_accum, world.rank, world.world_size, opts.seed)
    training.place(opts, world, {"policy": model})            # from here on ranks differ (dropout)
    ddp, optimizer = training.prepare(opts, model, opts.lr)
    training.plan(opts, {"policy": model})
    max_steps = derive_max_steps(opts, batches.steps_per_epoch)
    run.set_max_steps(max_steps)
    run.resume({"policy": model}, {"policy": optimizer}, data={"data": batches},
              global_batch=batches.global_batch, max_steps=max_steps, tokenizer=tok.info())
    dist.print0(f"SFT | {model.num_params():,} parameters{lora.describe(model)} | {len(train):,} train examples "
                f"({train_stats}) | {len(evals):,} eval ({eval_stats}) | max length {max_length} | global batch "
                f"{batches.global_batch} = {opts.batch_size} x {opts.grad_accum} accum x {world.world_size} ranks | "
                f"{max_steps} steps" + (f" | resuming at step {run.step}" if run.step else ""))

    def evaluate():
        with parallel.gathered(ddp):      # FSDP: ranks may hold different numbers of eval batches
            return evaluate_loss(model, evals, pad_id=tok.pad_id, batch_size=opts.batch_size, dtype=opts.dtype)

    def save(step):
        run.save(step, {"policy": model}, {"policy": optimizer}, data={"data": batches})
        save_model_dir(opts.out_dir, model, tok)

    for step in range(run.step + 1, max_steps + 1):      # step = optimizer steps done after this one
        lr = lr_at(step - 1, max_steps, opts.lr, opts.warmup_steps, "cosine", opts.min_lr_ratio)
        set_lr(optimizer, lr)
        collate = collate_packed if opts.packing else collate_sft
        micro_batches = [collate([train[i] for i in mb], tok.pad_id) for mb in batches.next_step()]
        metrics = train_step(ddp, optimizer, micro_batches, opts, step - 1)
        metrics.update({"train/lr": lr, "train/epoch": batches.epoch + batches.pos / len(train)})
        if run.end_of_step(step, metrics, evaluate=evaluate, save=save):
            break
    run.finish({"policy": model},
              saved=f"saved {opts.out_dir} (HF {model.architecture} layout + tokenizer.json); "
              f"weights checksum {dist.weights_checksum(model):016x} on all {world.world_size} rank(s)")
    return SimpleNamespace(model=model, optimizer=optimizer, options=opts)


if __name__ == "__main__":
    main()
