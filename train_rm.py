"""Reward model: a GPT trunk with a scalar head, trained on preference pairs (Bradley–Terry).

    r(x, y)  = score head on the final hidden state of the last real token of x ⊕ y (its end-of-text; for
               conversational data the chat template's end-of-turn token, which closes every response)
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

See docs/algorithms.md, "Reward model".

Run:
    python train_rm.py                                  # built-in task, from out/sft -> out/rm
    python train_rm.py --data prefs.jsonl --init out/sft --out_dir out/rm --epochs 1
    python train_rm.py --data chat_prefs.jsonl --init llama_sft_dir --lr 5e-6 --grad_checkpoint
    torchrun --nproc_per_node 2 train_rm.py

--lora_r R trains low-rank adapters on the frozen trunk and the whole score head (nano_rlhf/lora.py); the
output directory holds the merged model and out_dir/adapter the adapters in PEFT's layout (SEQ_CLS, the
head as a module to save).

Simplifications: pairwise only (no K-wise ranking); one epoch by default because reward models overfit
small preference sets (Ouyang et al. 2022; the N+ implementation details); linear decay to zero.
"""
import contextlib
import math
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from nano_rlhf import dist, lora, parallel
from nano_rlhf import reward as reward_mod
from nano_rlhf import run as run_mod
from nano_rlhf.checkpoint import save_model_dir
from nano_rlhf.cli import CompileOption, RunOptions
from nano_rlhf.data import Batches, collate_pairs, tokenize_pairs, training_length
from nano_rlhf.model import GPTConfig, ScoreModel, upcast
from nano_rlhf.run import (autocast, check_finite, check_vocab, derive_max_steps, fail, input_errors,
                           lr_at, set_lr)


@dataclass
class Options(CompileOption, RunOptions):
    data: str = ""                # preference JSONL {"prompt","chosen","rejected"[,"margin"]}; empty = built-in task
    eval_data: str = ""           # held-out preference JSONL; empty = split --eval_fraction off --data
    eval_fraction: float = 0.05   # share of --data held out when no --eval_data is given {0 < x < 1}
    init: str = "out/sft"         # SFT (or reward model) directory for the trunk; empty = from scratch
    out_dir: str = "out/rm"       # where the reward model, metrics and state go
    n_layer: int = 4              # layers (from scratch only) {>= 1}
    n_head: int = 4               # attention heads (from scratch only) {>= 1}
    n_embd: int = 128             # width (from scratch only; a multiple of --n_head) {>= 1}
    block_size: int = 64          # context length (from scratch only) {>= 2}
    dropout: float = 0.0          # dropout in every layer {0 <= x < 1}
    batch_size: int = 32          # pairs per device per micro-step (2x sequences in the forward) {>= 1}
    grad_accum: int = 1           # micro-steps per optimizer step {>= 1}
    max_steps: int = 0            # optimizer steps; 0 = derived from --epochs {>= 0}
    epochs: float = 1.0           # passes over the pairs when --max_steps is 0 (reward models overfit: keep it at 1) {>
                                  # 0}
    lr: float = 1e-3              # peak learning rate, decayed linearly to 0; GPT-2-124M: 1e-5, 0.5-1.5B models: 5e-6
                                  # {0 < x <= 1e3}
    warmup_steps: int = 20        # linear warm-up steps {>= 0}
    weight_decay: float = 0.0     # AdamW decoupled weight decay (matrices only) {>= 0}
    beta1: float = 0.9            # AdamW beta1 {0 <= x < 1}
    beta2: float = 0.95           # AdamW beta2 {0 <= x < 1}
    grad_clip: float = 1.0        # clip the global gradient norm to this (0 = off) {>= 0}
    use_margin: bool = True       # subtract each row's "margin" field inside the sigmoid
    center_coef: float = 0.0      # c in c·(r_w + r_l)²: keeps rewards centred on 0 (TRL; 0.01 in the paper) {>= 0}
    l2_coef: float = 0.0          # λ in λ/2·(r_w² + r_l²) (align-anything uses 0.001) {>= 0}
    seed: int = 0                 # seed for init, data order and dropout {>= 0}
    max_length: int = 0           # training sequence length: prompts are left-truncated so each pair fits; 0 =
                                  # min(block_size, 1024) {>= 0}
    lora_r: int = 0               # LoRA rank: train rank-r adapters on the frozen --init trunk (the score head fully);
                                  # 0 = off {>= 0}


# ---- the loss and the scores -----------------------------------------------------------------------

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


def pair_scores(model, input_ids, attention_mask):
    """One forward over [chosen; rejected] rows -> (r_chosen, r_rejected), each (B,), read at the last
    real token of each row (the response's end-of-text). end_only: the last block computes that one
    position per row, since nothing else reaches the loss."""
    _, end = model(input_ids, attention_mask, end_only=True)
    return upcast(end).chunk(2)


# ---- named statistics: per-batch sums, one all-reduce, then means ----------------------------------

PAIR_SUMS = ("pairs", "loss", "correct", "margin", "chosen_score", "rejected_score", "score", "score_sq")


def pair_sums(r_chosen, r_rejected, loss):
    """{name: float64 sum over this batch's pairs} (a tie r_w == r_l is not a correct ranking); "score" and
    "score_sq" run over chosen and rejected scores together (the score distribution PPO normalises by)."""
    r = torch.cat([r_chosen, r_rejected]).detach().double()
    sums = {"pairs": len(r_chosen), "loss": loss.sum(), "correct": (r_chosen > r_rejected).sum(),
            "margin": (r_chosen - r_rejected).sum(), "chosen_score": r_chosen.sum(),
            "rejected_score": r_rejected.sum(), "score": r.sum(), "score_sq": (r * r).sum()}
    return {k: torch.as_tensor(v).detach().double().cpu() for k, v in sums.items()}


def add_sums(total, sums):
    for k, v in sums.items():
        total[k] = total[k] + v


def reduce_sums(sums):
    """The global value of each named sum: ONE all-reduce of them stacked."""
    keys = list(sums)
    return dict(zip(keys, dist.all_reduce_sum(torch.stack([torch.as_tensor(sums[k]) for k in keys])).tolist()))


def pair_metrics(totals, prefix, with_scores=False):
    """Means over pairs from the global sums; with_scores adds the mean and (Bessel-corrected) std of the
    scores over the chosen and rejected sequences together."""
    n = max(totals["pairs"], 1)
    metrics = {f"{prefix}/{k}": totals[key] / n for k, key in
               (("loss", "loss"), ("accuracy", "correct"), ("margin", "margin"),
                ("chosen_score", "chosen_score"), ("rejected_score", "rejected_score"))}
    if with_scores:
        k = 2 * n
        var = totals["score_sq"] / k - (totals["score"] / k) ** 2
        metrics[f"{prefix}/score_mean"] = totals["score"] / k
        metrics[f"{prefix}/score_std"] = math.sqrt(max(var, 0.0) * k / max(k - 1, 1))
    return metrics


# ---- one optimizer step and the evaluation ---------------------------------------------------------

def train_step(ddp, optimizer, micro_batches, opts, step):
    """Forward/backward over this rank's micro-batches, then one optimizer step -> metrics.

    The loss is the mean over every pair of the optimizer step on every rank: each micro-batch's summed
    loss is divided by the global number of pairs (world_size x this rank's, as every rank takes the same
    number), and multiplied by world_size because DDP averages gradients over ranks."""
    world, t0 = dist.world(), time.time()
    n_pairs = world.world_size * sum(len(margin) for *_, margin in micro_batches)
    sums = dict.fromkeys(PAIR_SUMS, torch.zeros((), dtype=torch.float64))
    n_tokens = 0
    for j, (ids, attn, _, margin) in enumerate(micro_batches):
        ids, attn, margin = ids.to(world.device), attn.to(world.device), margin.to(world.device)
        last = j == len(micro_batches) - 1     # all-reduce gradients only on the last micro-step
        with (ddp.no_sync() if world.enabled and not last else contextlib.nullcontext()):
            with autocast(world.device, opts.dtype):
                r_chosen, r_rejected = pair_scores(ddp, ids, attn)
            loss = reward_loss(r_chosen, r_rejected, margin if opts.use_margin else torch.zeros_like(margin),
                               opts.center_coef, opts.l2_coef)
            (loss.sum() * world.world_size / n_pairs).backward()
        add_sums(sums, pair_sums(r_chosen, r_rejected, loss))
        n_tokens += int(attn.sum())
    metrics = pair_metrics(reduce_sums(sums), "train")
    check_finite(metrics["train/loss"], step, opts.out_dir)          # never apply a non-finite update
    grad_norm = parallel.clip_grad_norm(ddp.parameters(), opts.grad_clip)
    check_finite(grad_norm, step, opts.out_dir, "gradient norm")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens_per_s = dist.all_reduce_sum(n_tokens) / max(time.time() - t0, 1e-9)
    return dict(metrics, **{"train/grad_norm": grad_norm, "train/tokens_per_s": tokens_per_s})


@torch.no_grad()
def evaluate(model, pairs, *, pad_id, opts, reward=None):
    """Loss, accuracy, margin and score statistics on the eval pairs (each rank scores a shard; the named
    sums are all-reduced). With `reward` (a reward(prompts, completions) -> list[float] function, e.g. the
    built-in task's gold reward) also how well the scores agree with it: see gold_agreement."""
    model.eval()
    device = next(model.parameters()).device
    mine = dist.rank_share(pairs)
    sums = dict.fromkeys(PAIR_SUMS, torch.zeros((), dtype=torch.float64))
    chosen_scores, rejected_scores = [], []
    for i in range(0, len(mine), opts.batch_size):
        ids, attn, _, margin = (t.to(device) for t in collate_pairs(mine[i:i + opts.batch_size], pad_id))
        with autocast(device, opts.dtype):
            r_chosen, r_rejected = pair_scores(model, ids, attn)
        loss = reward_loss(r_chosen, r_rejected, margin if opts.use_margin else 0.0, opts.center_coef, opts.l2_coef)
        add_sums(sums, pair_sums(r_chosen, r_rejected, loss))
        chosen_scores.append(r_chosen.double().cpu())
        rejected_scores.append(r_rejected.double().cpu())
    model.train()
    metrics = pair_metrics(reduce_sums(sums), "eval", with_scores=True)
    if reward is not None:
        empty = torch.zeros(0, dtype=torch.float64)
        metrics.update(gold_agreement([p["texts"] for p in mine], torch.cat(chosen_scores or [empty]),
                                      torch.cat(rejected_scores or [empty]), reward))
    return metrics


def gold_agreement(texts, r_chosen, r_rejected, reward):
    """An optional diagnostic, outside the loss: the Pearson correlation of the scores with a reference
    reward (eval/gold_corr) and that reward's own accuracy on these (noisy) labels, ties counting ½
    (eval/gold_ranker_accuracy: the ceiling for any reward model). texts: this rank's (prompt, chosen,
    rejected) strings; the sums over all ranks are all-reduced once."""
    prompts = [t[0] for t in texts]
    g_chosen = torch.tensor(reward(prompts, [t[1] for t in texts]), dtype=torch.float64)
    g_rejected = torch.tensor(reward(prompts, [t[2] for t in texts]), dtype=torch.float64)
    r, g = torch.cat([r_chosen, r_rejected]), torch.cat([g_chosen, g_rejected])
    gold_correct = (g_chosen > g_rejected).double() + 0.5 * (g_chosen == g_rejected).double()
    n, s_r, s_rr, s_g, s_gg, s_rg, s_correct = dist.all_reduce_sum(torch.stack([
        torch.tensor(float(len(texts)), dtype=torch.float64), r.sum(), (r * r).sum(), g.sum(), (g * g).sum(),
        (r * g).sum(), gold_correct.sum()])).tolist()
    k = 2 * n
    var_r, var_g = s_rr / k - (s_r / k) ** 2, s_gg / k - (s_g / k) ** 2
    if not (var_r > 0 and var_g > 0):
        return {}
    return {"eval/gold_corr": (s_rg / k - s_r / k * s_g / k) / math.sqrt(var_r * var_g),
            "eval/gold_ranker_accuracy": s_correct / n}


def gold_reference(evals):
    """The reference reward for gold_agreement where the task has one (every eval prompt is a text prompt of
    the built-in task: its gold reward, from the reward interface), else None: no gold figures logged."""
    prompts = [p["texts"][0] for p in evals]
    return reward_mod.builtin_gold(prompts) if all(isinstance(p, str) for p in prompts) else None


# ---- data and model --------------------------------------------------------------------------------

def run_record(opts, data):
    """The inputs a reward-model run only reads and its data files (its options are its identity:
    nano_rlhf/run.py)."""
    return dict(inputs={"init": opts.init, "tokenizer": opts.tokenizer},
                data_files={"data": data[2], "eval_data": opts.eval_data})


def tokenize(records, tok, block_size, path):
    """Tokenized pairs (each keeping its strings as "texts", for a reference reward) and their stats; an
    error naming the file when no pair fits."""
    pairs, stats = [], None
    for record in records:       # one at a time, so each kept pair stays beside its own record
        kept, one = tokenize_pairs([record], tok, block_size)
        stats = one if stats is None else type(one)((k, stats[k] + one[k]) for k in one)
        pairs += [dict(p, texts=(record["prompt"], record["chosen"], record["rejected"])) for p in kept]
    if not pairs:
        raise ValueError(f"{path}: none of its {len(records)} pair(s) fits in {block_size} tokens "
                         f"(each response alone is longer)")
    return pairs, stats


def build_model(opts, tok):
    """The reward model: --init's trunk with a fresh score head (or --init's head, if it is a reward
    model), or a fresh one of the given shape; identical on every rank."""
    torch.manual_seed(opts.seed)
    if opts.init:
        model = ScoreModel.from_pretrained(opts.init, new_head=True, dropout=opts.dropout)
    else:
        model = ScoreModel(GPTConfig(vocab_size=tok.vocab_size, block_size=opts.block_size, n_layer=opts.n_layer,
                                     n_head=opts.n_head, n_embd=opts.n_embd, dropout=opts.dropout))
    check_vocab(tok, model.cfg, opts.init or "--tokenizer")
    model.cfg.eos_token_id, model.cfg.pad_token_id = tok.eos_id, tok.pad_id
    return model


def check_options(opts):
    """Cross-field rules (each field's own range is declared in Options and checked by parse_args)."""
    if opts.max_steps and opts.stop_at > opts.max_steps:
        fail(f"--stop_at {opts.stop_at} is past --max_steps {opts.max_steps}", 2)
    if opts.fsdp and opts.compile:
        fail("--compile with --fsdp is not supported; drop one of them", 2)
    if not opts.init and not opts.tokenizer:
        fail("a reward model from scratch needs --tokenizer (or --init with a tokenizer.json)", 2)
    if not opts.init and opts.n_embd % opts.n_head:
        fail(f"--n_embd {opts.n_embd} must be a multiple of --n_head {opts.n_head}", 2)
    if not opts.init and opts.max_length > opts.block_size:
        fail(f"--max_length {opts.max_length} is above --block_size {opts.block_size}", 2)
    msg = lora.check_lora_options(opts, needs_init="init")
    if msg:
        fail(msg, 2)


def main(argv=None):
    # data first (run_mod.train_eval_records): every line is validated before anything is written or built
    opts, world, run, (records, eval_records, data_path, eval_path) = run_mod.start(
        Options, argv, __doc__, check_options, "rm", run_record,
        load=lambda opts: run_mod.train_eval_records(opts, "preference"))
    with input_errors():
        tok = run_mod.tokenizer(opts, run, policy=False)
        model = build_model(opts, tok)
        run.identity.update(lora.attach(model, opts, opts.init, trainable=("score",)))   # --lora_r; head trains
        max_length = training_length(opts.max_length, model.cfg.block_size, opts.init or "the new model")
        run.identity.update(max_length=max_length)   # --max_length resolved: what the data is cut to
        train, train_stats = tokenize(records, tok, max_length, data_path)
        evals, eval_stats = tokenize(eval_records, tok, max_length, eval_path)
        batches = Batches(len(train), opts.batch_size, opts.grad_accum, world.rank, world.world_size, opts.seed)
    gold = gold_reference(evals)       # the gold-reward diagnostic only where the task defines one
    run_mod.place(opts, world, {"reward model": model})
    ddp, optimizer = run_mod.prepare(opts, model, opts.lr)
    run_mod.plan(opts, {"rm": model})
    run.max_steps = max_steps = derive_max_steps(opts, batches.steps_per_epoch)
    run_mod.resume(opts, run, {"rm": model}, {"rm": optimizer}, data={"data": batches},
                  global_batch=batches.global_batch, max_steps=max_steps, tokenizer=tok.info())
    dist.print0(f"RM | {sum(p.numel() for p in model.parameters()):,} parameters{lora.describe(model)} | "
                f"{len(train):,} train pairs "
                f"({train_stats}) | {len(evals):,} eval pairs ({eval_stats}) | max length {max_length} | global batch "
                f"{batches.global_batch} "
                f"pairs | {max_steps} steps" + (f" | resuming at step {run.step}" if run.step else ""))
    run.show = ["train/loss", "train/accuracy", "eval/loss", "eval/accuracy", "eval/gold_corr"]
    evaluated = {}      # step -> metrics of the last evaluation: the final save reuses it

    def evaluate_now(step):
        evaluated.clear()
        with parallel.gathered(ddp):      # FSDP: ranks may hold different numbers of eval batches
            evaluated[step] = evaluate(model, evals, pad_id=tok.pad_id, opts=opts, reward=gold)
        return evaluated[step]

    def save(step):
        run_mod.save(opts, step, {"rm": model}, {"rm": optimizer}, data={"data": batches})
        # the final model directory is written once, below, with its score statistics: a model saved
        # here at the last step without reward_mean/std would make PPO skip normalisation if the run
        # died before that save (a --resume at max_steps then only evaluates and saves)
        if step != max_steps:
            save_model_dir(opts.out_dir, model, tok)

    step = run.step
    for step in range(run.step + 1, max_steps + 1):      # step = optimizer steps done after this one
        lr = lr_at(step - 1, max_steps, opts.lr, opts.warmup_steps, "linear")
        set_lr(optimizer, lr)
        micro_batches = [collate_pairs([train[i] for i in mb], tok.pad_id) for mb in batches.next_step()]
        metrics = dict(train_step(ddp, optimizer, micro_batches, opts, step - 1), **{"train/lr": lr})
        if run.end_of_step(step, metrics, evaluate=lambda: evaluate_now(step), save=save):
            break

    if step == max_steps:
        # score statistics on the eval set, for PPO's reward normalisation (OpenRLHF normalize_reward);
        # the last step already evaluated these weights unless this run resumed at max_steps
        final = evaluated.get(step) or evaluate_now(step)
        save_model_dir(opts.out_dir, model, tok, reward_mean=final["eval/score_mean"],
                       reward_std=final["eval/score_std"])
        dist.check_same_weights(model, "reward model")
        gold_note = (f" (the gold reward itself: {final['eval/gold_ranker_accuracy']:.3f}) | correlation with gold "
                     f"reward {final['eval/gold_corr']:.3f}" if "eval/gold_corr" in final else "")
        dist.print0(f"saved {opts.out_dir} (HF {model.architecture} layout) | eval accuracy "
                    f"{final['eval/accuracy']:.3f} | scores mean {final['eval/score_mean']:+.3f} std "
                    f"{final['eval/score_std']:.3f}" + gold_note)
    run.finish()
    return SimpleNamespace(model=model, optimizer=optimizer, options=opts)


if __name__ == "__main__":
    main()
