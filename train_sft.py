"""Supervised fine-tuning (SFT): maximise the likelihood of the demonstrations' responses.

    L(θ) = − Σ_{b,t} m_{b,t} · log π_θ(y_{b,t} | x_b, y_{b,<t})  /  Σ_{b,t} m_{b,t}

m marks completion / assistant tokens (the closing end-of-text included, so the model learns to stop);
prompt tokens carry no loss. The token-mean is global over the whole optimizer step: the number of loss
tokens of all micro-batches on all ranks is all-reduced first, so 1 micro-batch of 4 ≡ 4 of 1 ≡ 2 ranks × 2.
{"text"} rows train on every token (plain language modelling).

Run:
    python train_sft.py                                   # built-in task, from scratch -> out/sft
    python train_sft.py --data sft.jsonl --init gpt2_dir --out_dir out/my_sft --lr 1e-4
    torchrun --nproc_per_node 2 train_sft.py              # data parallel on one machine
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 --nproc_per_node 8 train_sft.py
    python train_sft.py --resume                          # continue out/sft from its last checkpoint

Simplifications: no sequence packing (each row is one example, right-padded); no LoRA.
"""
import contextlib
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from nano_rlhf import dist
from nano_rlhf.checkpoint import find_state, load_state, save_model_dir, save_state
from nano_rlhf.common import (Logger, adamw, autocast, builtin_file, check_finite, fail, input_errors, lr_at, set_lr,
                              split_off)
from nano_rlhf.config import parse_args, save_config
from nano_rlhf.data import Batches, collate_sft, load_records, tokenize_sft
from nano_rlhf.model import GPT, GPTConfig
from nano_rlhf.tokenizer import Tokenizer


@dataclass
class Options:
    data: str = ""                # SFT JSONL ({"prompt","completion"}, {"text"} or {"messages"}); empty = built-in task
    eval_data: str = ""           # held-out SFT JSONL for the eval loss; empty = split --eval_fraction off --data
    eval_fraction: float = 0.05   # share of --data held out when no --eval_data is given
    init: str = ""                # model directory to start from (HF GPT-2 layout); empty = from scratch
    tokenizer: str = ""           # tokenizer.json; empty = the one in --init, or train one on the data
    eos_token: str = ""           # end-of-text token name; empty = from tokenizer_config.json or the usual names
    pad_token: str = ""           # pad token name; empty = likewise (none: an id outside the vocabulary)
    out_dir: str = "out/sft"      # where the model, tokenizer, metrics and state go
    n_layer: int = 4              # layers (from scratch only)
    n_head: int = 4               # attention heads (from scratch only)
    n_embd: int = 128             # width (from scratch only)
    block_size: int = 64          # context length (from scratch only); longer examples follow the over-long rule
    vocab_size: int = 512         # BPE vocabulary size when a tokenizer is trained here
    dropout: float = 0.0          # dropout in every layer
    batch_size: int = 32          # sequences per device per micro-step
    grad_accum: int = 1           # micro-steps per optimizer step
    max_steps: int = 0            # optimizer steps; 0 = as many as --epochs needs
    epochs: float = 2.0           # passes over the data when --max_steps is 0
    lr: float = 2e-3              # peak learning rate
    min_lr_ratio: float = 0.1     # cosine decay ends at this fraction of --lr
    warmup_steps: int = 30        # linear warm-up steps
    weight_decay: float = 0.1     # AdamW decoupled weight decay (matrices only)
    beta1: float = 0.9            # AdamW beta1
    beta2: float = 0.95           # AdamW beta2
    grad_clip: float = 1.0        # clip the global gradient norm to this (0 = off)
    seed: int = 0                 # seed for init, data order and dropout
    device: str = "auto"          # cpu, cuda, or auto
    dtype: str = "float32"        # float32 or bfloat16 (autocast; weights stay float32)
    compile: bool = False         # torch.compile the model
    log_interval: int = 10        # print and log every N steps
    eval_interval: int = 100      # eval loss every N steps (and at the end); 0 = only at the end
    save_interval: int = 500      # checkpoint every N steps (and at the end); 0 = only at the end
    resume: bool = False          # continue from out_dir/state
    stop_at: int = 0              # end this run after step N with a checkpoint (split a long job; --resume later)


def sft_nll(model, input_ids, attention_mask, loss_mask):
    """Sum over supervised tokens of −log π(y_t | y_<t), and how many there are.

    Shift: the logits at position t predict token t+1, so token t+1 is scored iff loss_mask[t+1] = 1; the
    first response token is predicted from the last prompt position. Only those positions' logits are
    computed (select=...), in float32 for the log-softmax whatever the autocast dtype.
    """
    target_mask = loss_mask[:, 1:].bool()                          # (B, T-1): is token t+1 supervised?
    select = F.pad(target_mask, (0, 1))                            # (B, T): the positions that predict them
    logits = model(input_ids, attention_mask, select=select)       # (N, V)
    targets = input_ids[:, 1:][target_mask]                        # (N,)
    return F.cross_entropy(logits.float(), targets, reduction="sum"), targets.numel()


def make_tokenizer(opts, records, ctx):
    names = (opts.eos_token or None, opts.pad_token or None)
    if opts.tokenizer:
        return Tokenizer.from_file(opts.tokenizer, *names)
    if opts.init:
        path = os.path.join(opts.init, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: missing; pass --tokenizer with the tokenizer.json of {opts.init}")
        return Tokenizer.from_file(path, *names)
    path = os.path.join(opts.out_dir, "tokenizer.json")
    if opts.resume and os.path.isfile(path):
        return Tokenizer.from_file(path, *names)
    if ctx.is_main:  # rank 0 trains it, the others load the very same file
        def texts():
            for r in records:
                if "text" in r:
                    yield r["text"]
                elif "messages" in r:
                    yield "".join(f"{m['role'].title()}: {m['content']}\n" for m in r["messages"])
                else:
                    for k in ("prompt", "completion"):
                        v = r[k]
                        yield v if isinstance(v, str) else "".join(f"{m['role'].title()}: {m['content']}\n" for m in v)
        os.makedirs(opts.out_dir, exist_ok=True)
        Tokenizer.train(texts(), opts.vocab_size).save(path)
    dist.barrier()
    return Tokenizer.from_file(path, *names)


@torch.no_grad()
def evaluate_loss(model, examples, tok, opts, ctx):
    """Global token-mean NLL over the eval set (each rank takes a shard; sums all-reduced)."""
    model.eval()
    mine = dist.shard(examples)
    total, count = 0.0, 0
    for i in range(0, len(mine), opts.batch_size):
        ids, attn, lm = (t.to(ctx.device) for t in collate_sft(mine[i:i + opts.batch_size], tok.pad_id))
        with autocast(ctx.device, opts.dtype):
            nll, n = sft_nll(model, ids, attn, lm)
        total, count = total + nll.item(), count + n
    model.train()
    return dist.all_reduce_sum(total) / max(1.0, dist.all_reduce_sum(count))


def main(argv=None):
    opts = parse_args(Options, argv, __doc__)
    ctx = dist.setup(opts.device)
    if opts.resume and find_state(opts.out_dir) is None:
        fail(f"{opts.out_dir}: --resume given but there is no saved state in it")

    # ---- data first: every line is validated before any model is built ----
    with input_errors():
        data_path = opts.data or builtin_file("sft.jsonl")
        records = load_records(data_path, "sft")
        if opts.eval_data or not opts.data:
            eval_records = load_records(opts.eval_data or builtin_file("sft_eval.jsonl"), "sft")
        else:
            records, eval_records = split_off(records, opts.eval_fraction, opts.seed)
        tok = make_tokenizer(opts, records, ctx)

        # ---- model: identical on every rank (same seed before init, same checkpoint) ----
        torch.manual_seed(opts.seed)
        if opts.init:
            model = GPT.from_pretrained(opts.init, dropout=opts.dropout)
            if tok.vocab_size > model.cfg.vocab_size:
                raise ValueError(f"{opts.init}: tokenizer has {tok.vocab_size} tokens, model only {model.cfg.vocab_size}")
        else:
            model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=opts.block_size, n_layer=opts.n_layer,
                                  n_head=opts.n_head, n_embd=opts.n_embd, dropout=opts.dropout))
        model.cfg.eos_token_id, model.cfg.pad_token_id = tok.eos_id, tok.pad_id
        train, st = tokenize_sft(records, tok, model.cfg.block_size)
        evals, est = tokenize_sft(eval_records, tok, model.cfg.block_size)
        if not train:
            raise ValueError(f"{data_path}: no example fits in {model.cfg.block_size} tokens")
    model.to(ctx.device)
    dist.check_same_weights(model, "policy")
    dist.seed_everything(opts.seed, ctx.rank)           # from here on ranks differ (dropout)
    if opts.compile:
        model = torch.compile(model)
    ddp = dist.wrap_ddp(model)
    optimizer = adamw(model, opts.lr, opts.weight_decay, (opts.beta1, opts.beta2))

    with input_errors():
        batches = Batches(len(train), opts.batch_size, opts.grad_accum, ctx.rank, ctx.world_size, opts.seed)
    max_steps = opts.max_steps or max(1, int(opts.epochs * batches.steps_per_epoch))
    step = 0
    if opts.resume:
        meta = load_state(opts.out_dir, {"policy": model}, {"policy": optimizer})
        step = meta["step"]
        batches.load_state_dict(meta["data"])
    if ctx.is_main:
        os.makedirs(opts.out_dir, exist_ok=True)
        save_config(opts, os.path.join(opts.out_dir, "train_config.json"), world_size=ctx.world_size,
                    global_batch=batches.global_batch, max_steps=max_steps, tokenizer=tok.info())
    dist.print0(f"SFT | {dist.unwrap(model).num_params():,} parameters | {len(train):,} train examples "
                f"({st}) | {len(evals):,} eval ({est}) | global batch {batches.global_batch} = {opts.batch_size} "
                f"x {opts.grad_accum} accum x {ctx.world_size} ranks | {max_steps} steps" +
                (f" | resuming at step {step}" if step else ""))
    log = Logger(opts.out_dir, max_steps, resume=opts.resume, start_step=step)

    def checkpoint(step):
        save_state(opts.out_dir, {"policy": model}, {"policy": optimizer},
                   {"step": step, "data": batches.state_dict()})
        save_model_dir(opts.out_dir, model, tok)

    t_last, tokens_since = time.time(), 0
    while step < max_steps:
        lr = lr_at(step, max_steps, opts.lr, opts.warmup_steps, "cosine", opts.min_lr_ratio)
        set_lr(optimizer, lr)
        micro = [collate_sft([train[i] for i in mb], tok.pad_id) for mb in batches.next_step()]
        # global number of loss tokens in this optimizer step (all micro-batches, all ranks)
        n_tok = dist.all_reduce_sum(sum(int(lm[:, 1:].sum()) for _, _, lm in micro))
        nll_sum = 0.0
        for j, (ids, attn, lm) in enumerate(micro):
            ids, attn, lm = ids.to(ctx.device), attn.to(ctx.device), lm.to(ctx.device)
            last = j == len(micro) - 1     # all-reduce gradients only on the last micro-step
            with (ddp.no_sync() if ctx.enabled and not last else contextlib.nullcontext()):
                with autocast(ctx.device, opts.dtype):
                    nll, _ = sft_nll(ddp, ids, attn, lm)
                # DDP averages gradients over ranks, so scale by world_size to get sum / global count
                (nll * ctx.world_size / max(n_tok, 1)).backward()
            nll_sum += nll.item()
            tokens_since += int(attn.sum())
        loss = dist.all_reduce_sum(nll_sum) / max(n_tok, 1)
        check_finite(loss, step, opts.out_dir)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip or float("inf")).item()
        check_finite(grad_norm, step, opts.out_dir, "gradient norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % opts.log_interval == 0 or step == max_steps:
            dt = time.time() - t_last
            tps = dist.all_reduce_sum(tokens_since) / max(dt, 1e-9)
            m = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "train/tokens_per_s": tps,
                 "train/epoch": batches.epoch + batches.pos / len(train)}
            if (opts.eval_interval and step % opts.eval_interval == 0) or step == max_steps:
                m["eval/loss"] = evaluate_loss(model, evals, tok, opts, ctx)
            log.log(step, m)
            log.progress(step, m, ["train/loss", "eval/loss", "train/lr", "train/grad_norm"], tps)
            t_last, tokens_since = time.time(), 0
        elif opts.eval_interval and step % opts.eval_interval == 0:
            log.log(step, {"eval/loss": evaluate_loss(model, evals, tok, opts, ctx)})
        if (opts.save_interval and step % opts.save_interval == 0) or step in (max_steps, opts.stop_at):
            checkpoint(step)
        if step == opts.stop_at:
            dist.print0(f"stopping at step {step} (--stop_at); continue with --resume")
            break
    dist.check_same_weights(model, "policy")     # DDP kept every rank in lock-step: prove it
    dist.print0(f"saved {opts.out_dir} (HF GPT2LMHeadModel layout + tokenizer.json); "
                f"weights checksum {dist.weights_checksum(model):016x} on all {ctx.world_size} rank(s)")
    dist.cleanup()
    return SimpleNamespace(model=model, optimizer=optimizer, options=opts)


if __name__ == "__main__":
    main()
