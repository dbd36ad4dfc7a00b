"""Reward model: a GPT trunk with a scalar head, trained on preference pairs (Bradley–Terry).

    r(x, y)  = score head on the final hidden state of the last real token of x ⊕ y (its end-of-text)
    L        = − log σ(r(x, y_w) − r(x, y_l) − m)                  (Bradley & Terry 1952; Ouyang et al. 2022 eq. 1)
             + c · (r_w + r_l)²                                     --center_coef (TRL, Eisenstein et al. 2023)
             + λ/2 · (r_w² + r_l²)                                  --l2_coef (align-anything; λ/(2B)·Σ over a batch)

m is the row's optional "margin" field (0 without it or with --use_margin false). Per-pair losses are
averaged over the whole optimizer step (all micro-batches and ranks). Chosen and rejected go through ONE
forward per micro-batch (2B rows: chosen first, then rejected), which halves the launches and keeps one
autograd graph per step (DDP never sees a parameter "ready twice").

At the end the mean and std of the scores on the eval set are written into config.json (reward_mean,
reward_std), so train_ppo.py can normalise scores. The model is saved in the layout of HF
GPT2ForSequenceClassification (one label).

Run:
    python train_rm.py                                  # built-in task, from out/sft -> out/rm
    python train_rm.py --data prefs.jsonl --init out/sft --out_dir out/rm --epochs 1
    torchrun --nproc_per_node 2 train_rm.py

Simplifications: pairwise only (no K-wise ranking); one epoch by default because reward models overfit
small preference sets (Ouyang et al. 2022; the N+ implementation details); linear decay to zero.
"""
import contextlib
import math
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from nano_rlhf import dist, synthetic
from nano_rlhf.checkpoint import find_state, load_state, save_model_dir, save_state
from nano_rlhf.common import (Logger, adamw, autocast, builtin_file, check_finite, check_vocab, fail, input_errors,
                              load_tokenizer, lr_at, set_lr, split_off)
from nano_rlhf.config import parse_args, save_config
from nano_rlhf.data import Batches, collate_pairs, load_records, tokenize_pairs
from nano_rlhf.model import GPTConfig, ScoreModel


@dataclass
class Options:
    data: str = ""                # preference JSONL {"prompt","chosen","rejected"[,"margin"]}; empty = built-in task
    eval_data: str = ""           # held-out preference JSONL; empty = split --eval_fraction off --data
    eval_fraction: float = 0.05   # share of --data held out when no --eval_data is given
    init: str = "out/sft"         # SFT (or reward model) directory for the trunk; empty = from scratch
    tokenizer: str = ""           # tokenizer.json; empty = the one in --init
    eos_token: str = ""           # end-of-text token name; empty = from tokenizer_config.json or the usual names
    pad_token: str = ""           # pad token name; empty = likewise (none: an id outside the vocabulary)
    out_dir: str = "out/rm"       # where the reward model, metrics and state go
    n_layer: int = 4              # layers (from scratch only)
    n_head: int = 4               # attention heads (from scratch only)
    n_embd: int = 128             # width (from scratch only)
    block_size: int = 64          # context length (from scratch only)
    dropout: float = 0.0          # dropout in every layer
    batch_size: int = 32          # pairs per device per micro-step (2x sequences in the forward)
    grad_accum: int = 1           # micro-steps per optimizer step
    max_steps: int = 0            # optimizer steps; 0 = as many as --epochs needs
    epochs: float = 1.0           # passes over the pairs (reward models overfit: keep it at 1)
    lr: float = 1e-3              # peak learning rate, decayed linearly to 0 (built-in task; ~1e-5 for GPT-2 sizes)
    warmup_steps: int = 20        # linear warm-up steps
    weight_decay: float = 0.0     # AdamW decoupled weight decay (matrices only)
    beta1: float = 0.9            # AdamW beta1
    beta2: float = 0.95           # AdamW beta2
    grad_clip: float = 1.0        # clip the global gradient norm to this (0 = off)
    use_margin: bool = True       # subtract each row's "margin" field inside the sigmoid
    center_coef: float = 0.0      # c in c·(r_w + r_l)²: keeps rewards centred on 0 (TRL; 0.01 in the paper)
    l2_coef: float = 0.0          # λ in λ/2·(r_w² + r_l²) (align-anything uses 0.001)
    seed: int = 0                 # seed for init, data order and dropout
    device: str = "auto"          # cpu, cuda, or auto
    dtype: str = "float32"        # float32 or bfloat16 (autocast; weights stay float32)
    compile: bool = False         # torch.compile the model
    log_interval: int = 10        # print and log every N steps
    eval_interval: int = 100      # evaluate every N steps (and at the end); 0 = only at the end
    save_interval: int = 500      # checkpoint every N steps (and at the end); 0 = only at the end
    resume: bool = False          # continue from out_dir/state
    stop_at: int = 0              # end this run after step N with a checkpoint (--resume later)


def reward_loss(r_chosen, r_rejected, margin, center_coef=0.0, l2_coef=0.0):
    """Per-pair Bradley–Terry loss with the optional centring and L2 terms, (B,) each.

    −log σ(r_w − r_l − m) is computed as softplus(−(r_w − r_l − m)) by F.logsigmoid: no overflow for any margin.
    """
    loss = -F.logsigmoid(r_chosen - r_rejected - margin)
    if center_coef:
        loss = loss + center_coef * (r_chosen + r_rejected) ** 2
    if l2_coef:
        loss = loss + 0.5 * l2_coef * (r_chosen ** 2 + r_rejected ** 2)
    return loss


def pair_scores(model, ids, attn):
    """One forward over [chosen; rejected] rows -> (r_chosen, r_rejected), each (B,), read at the last
    real token of each row (the response's end-of-text). end_only: the last block computes that one
    position per row, since nothing else reaches the loss."""
    _, end = model(ids, attn, end_only=True)
    return end.float().chunk(2)


@torch.no_grad()
def evaluate(model, pairs, tok, opts, ctx):
    """Loss, accuracy, margin and score statistics on the eval pairs (sharded, sums all-reduced), plus the
    Pearson correlation of scores with the built-in task's gold reward when the prompts are the task's."""
    model.eval()
    mine = dist.shard(pairs)
    gold = all("text" in p for p in pairs)
    # n, Σloss, Σcorrect, Σ(r_w - r_l), Σr, Σr², Σg, Σg², Σrg (r over chosen and rejected rows), the
    # accuracy of the gold reward itself on these (noisy) labels, ties counting ½: the ceiling for any RM,
    # and Σr_w, Σr_l (the train-side chosen/rejected score metrics)
    sums = torch.zeros(12, dtype=torch.float64)
    for i in range(0, len(mine), opts.batch_size):
        chunk = mine[i:i + opts.batch_size]
        ids, attn, _, margin = (t.to(ctx.device) for t in collate_pairs(chunk, tok.pad_id))
        with autocast(ctx.device, opts.dtype):
            rw, rl = pair_scores(model, ids, attn)
        loss = reward_loss(rw, rl, margin if opts.use_margin else 0.0, opts.center_coef, opts.l2_coef)
        r = torch.cat([rw, rl]).double().cpu()
        g = torch.tensor([synthetic.gold_reward(p["text"], p[k]) for k in ("chosen_text", "rejected_text")
                          for p in chunk], dtype=torch.float64) if gold else torch.zeros_like(r)
        gw, gl = g.chunk(2)
        rwd, rld = r.chunk(2)
        sums += torch.tensor([len(chunk), loss.sum().item(), (rw > rl).sum().item(), (rw - rl).sum().item(),
                              r.sum(), (r * r).sum(), g.sum(), (g * g).sum(), (r * g).sum(),
                              ((gw > gl).double() + 0.5 * (gw == gl).double()).sum(), rwd.sum(), rld.sum()],
                             dtype=torch.float64)
    model.train()
    n, loss, correct, margin, sr, srr, sg, sgg, srg, gold_correct, srw, srl = dist.all_reduce_sum(sums).tolist()
    k = 2 * n
    var_r, var_g = srr / k - (sr / k) ** 2, sgg / k - (sg / k) ** 2
    out = {"eval/loss": loss / n, "eval/accuracy": correct / n, "eval/margin": margin / n,
           "eval/chosen_score": srw / n, "eval/rejected_score": srl / n,
           "eval/score_mean": sr / k, "eval/score_std": math.sqrt(max(var_r, 0.0) * k / max(k - 1, 1))}
    if gold and var_r > 0 and var_g > 0:
        out["eval/gold_corr"] = (srg / k - sr / k * sg / k) / math.sqrt(var_r * var_g)
        out["eval/gold_ranker_accuracy"] = gold_correct / n
    return out


def with_texts(pairs, records):
    """Keep the original strings beside built-in task pairs, for the gold-reward correlation."""
    if len(pairs) == len(records) and all(isinstance(r["prompt"], str) and synthetic.is_task_prompt(r["prompt"])
                                          for r in records):
        for p, r in zip(pairs, records):
            p.update(text=r["prompt"], chosen_text=r["chosen"], rejected_text=r["rejected"])
    return pairs


def main(argv=None):
    opts = parse_args(Options, argv, __doc__)
    ctx = dist.setup(opts.device)
    if opts.resume and find_state(opts.out_dir) is None:
        fail(f"{opts.out_dir}: --resume given but there is no saved state in it")

    with input_errors():
        records = load_records(opts.data or builtin_file("preference.jsonl"), "preference")
        if opts.eval_data or not opts.data:
            eval_records = load_records(opts.eval_data or builtin_file("preference_eval.jsonl"), "preference")
        else:
            records, eval_records = split_off(records, opts.eval_fraction, opts.seed)
        if opts.init:
            tok = load_tokenizer(opts.tokenizer, opts.init, opts.eos_token, opts.pad_token)
        elif opts.tokenizer:
            tok = load_tokenizer(opts.tokenizer, "", opts.eos_token, opts.pad_token)
        else:
            raise ValueError("a reward model from scratch needs --tokenizer (or --init with a tokenizer.json)")
        torch.manual_seed(opts.seed)
        if opts.init:
            model = ScoreModel.from_pretrained(opts.init, new_head=True, dropout=opts.dropout)
        else:
            model = ScoreModel(GPTConfig(vocab_size=tok.vocab_size, block_size=opts.block_size, n_layer=opts.n_layer,
                                         n_head=opts.n_head, n_embd=opts.n_embd, dropout=opts.dropout))
        check_vocab(tok, model.cfg, opts.init or "--tokenizer")
        model.cfg.eos_token_id, model.cfg.pad_token_id = tok.eos_id, tok.pad_id
        train, st = tokenize_pairs(records, tok, model.cfg.block_size)
        evals, est = tokenize_pairs(eval_records, tok, model.cfg.block_size)
        evals = with_texts(evals, eval_records) if est["dropped"] == 0 else evals
        if not train or not evals:
            raise ValueError("no preference pair fits in the model's block_size")
        batches = Batches(len(train), opts.batch_size, opts.grad_accum, ctx.rank, ctx.world_size, opts.seed)
    model.to(ctx.device)
    dist.check_same_weights(model, "reward model")
    dist.seed_everything(opts.seed, ctx.rank)
    if opts.compile:
        model = torch.compile(model)
    ddp = dist.wrap_ddp(model)
    optimizer = adamw(model, opts.lr, opts.weight_decay, (opts.beta1, opts.beta2))
    max_steps = opts.max_steps or max(1, int(opts.epochs * batches.steps_per_epoch))
    step = 0
    if opts.resume:
        meta = load_state(opts.out_dir, {"rm": model}, {"rm": optimizer})
        step = meta["step"]
        batches.load_state_dict(meta["data"])
    if ctx.is_main:
        os.makedirs(opts.out_dir, exist_ok=True)
        save_config(opts, os.path.join(opts.out_dir, "train_config.json"), world_size=ctx.world_size,
                    global_batch=batches.global_batch, max_steps=max_steps)
    dist.print0(f"RM | {sum(p.numel() for p in model.parameters()):,} parameters | {len(train):,} train pairs ({st}) "
                f"| {len(evals):,} eval pairs | global batch {batches.global_batch} pairs | {max_steps} steps"
                + (f" | resuming at step {step}" if step else ""))
    log = Logger(opts.out_dir, max_steps, resume=opts.resume, start_step=step)

    t_last, tokens_since, ev, ev_step = time.time(), 0, None, -1
    while step < max_steps:
        lr = lr_at(step, max_steps, opts.lr, opts.warmup_steps, "linear")
        set_lr(optimizer, lr)
        micro = [collate_pairs([train[i] for i in mb], tok.pad_id) for mb in batches.next_step()]
        n_pairs = batches.global_batch
        sums = torch.zeros(5, dtype=torch.float64)      # loss, correct, margin, Σr_w, Σr_l
        for j, (ids, attn, _, margin) in enumerate(micro):
            ids, attn, margin = ids.to(ctx.device), attn.to(ctx.device), margin.to(ctx.device)
            last = j == len(micro) - 1
            with (ddp.no_sync() if ctx.enabled and not last else contextlib.nullcontext()):
                with autocast(ctx.device, opts.dtype):
                    rw, rl = pair_scores(ddp, ids, attn)
                m = margin if opts.use_margin else torch.zeros_like(margin)
                loss = reward_loss(rw, rl, m, opts.center_coef, opts.l2_coef)
                # mean over the global batch of pairs; DDP averages over ranks, hence × world_size
                (loss.sum() * ctx.world_size / n_pairs).backward()
            sums += torch.stack([loss.sum(), (rw > rl).sum(), (rw - rl).sum(), rw.sum(), rl.sum()]).detach().double().cpu()
            tokens_since += int(attn.sum())
        sums = dist.all_reduce_sum(sums) / n_pairs
        check_finite(sums[0].item(), step, opts.out_dir)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip or float("inf")).item()
        check_finite(grad_norm, step, opts.out_dir, "gradient norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % opts.log_interval == 0 or step == max_steps:
            dt = time.time() - t_last
            tps = dist.all_reduce_sum(tokens_since) / max(dt, 1e-9)
            m = {"train/loss": sums[0].item(), "train/accuracy": sums[1].item(), "train/margin": sums[2].item(),
                 "train/chosen_score": sums[3].item(), "train/rejected_score": sums[4].item(), "train/lr": lr,
                 "train/grad_norm": grad_norm, "train/tokens_per_s": tps}
            if (opts.eval_interval and step % opts.eval_interval == 0) or step == max_steps:
                ev, ev_step = evaluate(model, evals, tok, opts, ctx), step
                m.update(ev)
            log.log(step, m)
            log.progress(step, m, ["train/loss", "train/accuracy", "eval/loss", "eval/accuracy", "eval/gold_corr"], tps)
            t_last, tokens_since = time.time(), 0
        elif opts.eval_interval and step % opts.eval_interval == 0:
            log.log(step, evaluate(model, evals, tok, opts, ctx))
        if (opts.save_interval and step % opts.save_interval == 0) or step in (max_steps, opts.stop_at):
            save_state(opts.out_dir, {"rm": model}, {"rm": optimizer}, {"step": step, "data": batches.state_dict()})
            # the final model directory is written once, below, with its score statistics: a model saved
            # here at the last step without reward_mean/std would make PPO skip normalisation if the run
            # died before that save (a --resume at max_steps then only evaluates and saves)
            if step != max_steps:
                save_model_dir(opts.out_dir, model, tok)
        if step == opts.stop_at:
            dist.print0(f"stopping at step {step} (--stop_at); continue with --resume")
            break

    if step == max_steps:
        # score statistics on the eval set, for PPO's reward normalisation (OpenRLHF normalize_reward);
        # the last logged step already evaluated these weights unless this run resumed at max_steps
        ev = ev if ev_step == step else evaluate(model, evals, tok, opts, ctx)
        save_model_dir(opts.out_dir, model, tok, reward_mean=ev["eval/score_mean"], reward_std=ev["eval/score_std"])
        dist.check_same_weights(model, "reward model")
        dist.print0(f"saved {opts.out_dir} (HF GPT2ForSequenceClassification layout) | eval accuracy "
                    f"{ev['eval/accuracy']:.3f} | scores mean {ev['eval/score_mean']:+.3f} std {ev['eval/score_std']:.3f}"
                    + (f" (the gold reward itself: {ev['eval/gold_ranker_accuracy']:.3f}) | correlation with gold "
                       f"reward {ev['eval/gold_corr']:.3f}" if "eval/gold_corr" in ev else ""))
    dist.cleanup()
    return SimpleNamespace(model=model, optimizer=optimizer, options=opts)


if __name__ == "__main__":
    main()
