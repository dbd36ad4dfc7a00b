"""Reward model: a GPT trunk with a scalar head, trained on preference pairs (Bradley–Terry); with --objective cost,
Safe RLHF's cost model.

    r(x, y)  = score head on the final hidden state of the last real token of x ⊕ y (its end-of-text; for
               conversational data the chat template's end-of-turn token, which closes every response)
    L        = − log σ(r(x, y_w) − r(x, y_l) − m)                  (Bradley & Terry 1952; Ouyang et al. 2022 eq. 1)
             + c · (r_w + r_l)²                                     --center_coef (TRL, Eisenstein et al. 2023)
             + λ/2 · (r_w² + r_l²)                                  --l2_coef (align-anything; λ/(2B)·Σ over a batch)

--objective cost trains the cost model of Safe RLHF (Dai et al., ICLR 2024, eq. 6) on safety-labelled pairs:

    L_C      = − log σ(c(y_w) − c(y_l)) − log σ(s(y_w)·c(y_w)) − log σ(s(y_l)·c(y_l))      (+ the --l2_coef term)

y_w is the MORE HARMFUL response of the pair (the one not named "safer"), y_l the safer one; s(y) = +1 if y is
labelled unsafe, −1 if safe. The first term ranks, the other two pin the sign: a cost above 0 means unsafe, so
PPO-Lagrangian's bound on the expected cost has a meaning (0 is the boundary: costs are never centred).

m is the row's optional "margin" field (0 without it or with --use_margin false). Per-pair losses are
averaged over the whole optimizer step (all micro-batches and ranks). Chosen and rejected go through ONE
forward per micro-batch (2B rows: chosen first, then rejected), which halves the launches and keeps one
autograd graph per step (DDP never sees a parameter "ready twice").

At the end the mean and std of the scores on the eval set are written into config.json (reward_mean,
reward_std), so train_ppo.py can normalise scores; a cost model records instead "score_kind": "cost" (so a
--cost_model / --reward_model of the wrong kind is refused) and its eval-set cost_mean, cost_std,
cost_unsafe_share and cost_sign_accuracy, never used to normalise (0 must stay the boundary). The model is saved
in the layout of HF GPT2ForSequenceClassification (one label).

See docs/algorithms.md, "Reward model" and "Cost model".

Run:
    python train_rm.py                                  # built-in task, from out/sft -> out/rm
    python train_rm.py --data prefs.jsonl --init out/sft --out_dir out/rm --epochs 1
    python train_rm.py --data chat_prefs.jsonl --init llama_sft_dir --lr 5e-6 --grad_checkpoint
    torchrun --nproc_per_node 2 train_rm.py
    python train_rm.py --objective cost --data safety.jsonl --out_dir out/cost     # rows with safety labels

--lora_r R trains low-rank adapters on the frozen trunk and the whole score head (nano_rlhf/lora.py); the
output directory holds the merged model and out_dir/adapter the adapters in PEFT's layout (SEQ_CLS, the
head as a module to save).

Simplifications: pairwise only (no K-wise ranking); one epoch by default because reward models overfit
small preference sets (Ouyang et al. 2022; the N+ implementation details); linear decay to zero.
"""
import math
import time
from dataclasses import dataclass
from typing import Literal
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from nano_rlhf import dist, lora, parallel
from nano_rlhf import reward as reward_mod
from nano_rlhf import training
from nano_rlhf.checkpoint import save_model_dir
from nano_rlhf.cli import CompileOption, RunOptions, parse_args
from nano_rlhf.data import SAFER, Batches, collate_pairs, tokenize_pairs, training_length
from nano_rlhf.model import GPTConfig, ScoreModel, upcast
from nano_rlhf.training import (autocast, check_device, check_finite, check_vocab, derive_max_steps, fail,
                                input_errors, lr_at, set_lr)


@dataclass
class Options(CompileOption, RunOptions):
    # what the score learns. Named "objective" (not "--cost", which train_ppo.py gives a cost function; not
    # "--model", which names directories): reward = helpfulness, Bradley–Terry on chosen ≻ rejected; cost = harm,
    # Safe RLHF's cost model on the rows' "safer" choice and per-response safe labels (cost > 0 = unsafe)
    objective: Literal["reward", "cost"] = "reward"  # reward: a reward model; cost: a cost model (Safe RLHF)
    data: str = ""                # preference JSONL {"prompt","chosen","rejected"[,"margin"]} (cost: + "safer",
                                  # "chosen_safe", "rejected_safe"), or PKU-SafeRLHF's layout; empty = built-in task
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
    use_margin: bool = True       # subtract each row's "margin" field inside the sigmoid [with objective=reward]
    center_coef: float = 0.0      # c in c·(r_w + r_l)²: keeps rewards centred on 0 (TRL; 0.01 in the paper) [with
                                  # objective=reward] {>= 0}
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


def cost_loss(c_w, c_l, s_w, s_l, l2_coef=0.0):
    """Per-pair cost-model loss of Safe RLHF (Dai et al. 2024, eq. 6), (B,) each:

        − log σ(c_w − c_l) − log σ(s_w·c_w) − log σ(s_l·c_l)          [+ λ/2·(c_w² + c_l²), --l2_coef]

    c_w = c(y_w), the cost of the MORE HARMFUL response; s = +1 for a response labelled unsafe, −1 for a safe
    one, so the sign terms push unsafe costs above 0 and safe ones below. Costs are not clipped: each −log σ
    is F.logsigmoid (finite for any cost), and its pull fades (never to 0) once a cost is on the right side of 0
    and of the other response's; safe-rlhf bounds nothing either, --l2_coef (its `regularization`) limits the
    outward drift (docs/algorithms.md, "Cost model")."""
    loss = -F.logsigmoid(c_w - c_l) - F.logsigmoid(s_w * c_w) - F.logsigmoid(s_l * c_l)
    if l2_coef:
        loss = loss + 0.5 * l2_coef * (c_w ** 2 + c_l ** 2)
    return loss


def objective_loss(first, second, extra, opts):
    """The per-pair loss of --objective on one micro-batch's scores (first half, second half: chosen and
    rejected, or for a cost model y_w and y_l) and its `extra` (B,) margins or (B, 2) signs (s_w, s_l)."""
    if opts.objective == "cost":
        return cost_loss(first, second, extra[:, 0], extra[:, 1], opts.l2_coef)
    return reward_loss(first, second, extra if opts.use_margin else torch.zeros_like(extra), opts.center_coef,
                       opts.l2_coef)


def pair_scores(model, input_ids, attention_mask):
    """One forward over [chosen; rejected] rows -> (r_chosen, r_rejected), each (B,), read at the last
    real token of each row (the response's end-of-text). end_only: the last block computes that one
    position per row, since nothing else reaches the loss."""
    _, end = model(input_ids, attention_mask, end_only=True)
    return upcast(end).chunk(2)


# ---- named statistics: per-batch sums, one all-reduce, then means ----------------------------------

PAIR_SUMS = ("pairs", "loss", "correct", "margin", "chosen_score", "rejected_score", "score", "score_sq",
             "sign_correct", "unsafe")


def pair_sums(r_chosen, r_rejected, loss, signs=None):
    """{name: float64 sum over this batch's pairs} (a tie r_w == r_l is not a correct ranking); "score" and
    "score_sq" run over chosen and rejected scores together (the score distribution PPO normalises by). With a
    cost model's signs (B, 2): "sign_correct" counts the responses whose cost is on their label's side of 0
    (> 0 for unsafe; 0 itself reads safe) and "unsafe" those the model calls unsafe (cost > 0)."""
    r = torch.cat([r_chosen, r_rejected]).detach().double()
    sums = {"pairs": len(r_chosen), "loss": loss.sum(), "correct": (r_chosen > r_rejected).sum(),
            "margin": (r_chosen - r_rejected).sum(), "chosen_score": r_chosen.sum(),
            "rejected_score": r_rejected.sum(), "score": r.sum(), "score_sq": (r * r).sum(),
            "sign_correct": 0, "unsafe": (r > 0).sum()}
    if signs is not None:
        sums["sign_correct"] = ((r > 0) == (signs.T.reshape(-1).to(r.device) > 0)).sum()
    return {k: torch.as_tensor(v).detach().double().cpu() for k, v in sums.items()}


def add_sums(total, sums):
    for k, v in sums.items():
        total[k] = total[k] + v


def reduce_sums(sums):
    """The global value of each named sum: ONE all-reduce of them stacked."""
    keys = list(sums)
    return dict(zip(keys, dist.all_reduce_sum(torch.stack([torch.as_tensor(sums[k]) for k in keys])).tolist()))


def pair_metrics(totals, prefix, with_scores=False, objective="reward"):
    """Means over pairs from the global sums; with_scores adds the mean and (Bessel-corrected) std of the
    scores over the chosen and rejected sequences together. A cost model's accuracy is that of the safer
    choice (c_w > c_l), its halves are named unsafer_cost / safer_cost, and it adds sign_accuracy (over
    responses) and, with_scores, unsafe_share (the share of responses it scores above 0)."""
    n = max(totals["pairs"], 1)
    halves = ("unsafer_cost", "safer_cost") if objective == "cost" else ("chosen_score", "rejected_score")
    metrics = {f"{prefix}/{k}": totals[key] / n for k, key in
               (("loss", "loss"), ("accuracy", "correct"), ("margin", "margin"),
                (halves[0], "chosen_score"), (halves[1], "rejected_score"))}
    if objective == "cost":
        metrics[f"{prefix}/sign_accuracy"] = totals["sign_correct"] / (2 * n)
    if with_scores:
        k = 2 * n
        var = totals["score_sq"] / k - (totals["score"] / k) ** 2
        metrics[f"{prefix}/score_mean"] = totals["score"] / k
        metrics[f"{prefix}/score_std"] = math.sqrt(max(var, 0.0) * k / max(k - 1, 1))
        if objective == "cost":
            metrics[f"{prefix}/unsafe_share"] = totals["unsafe"] / k
    return metrics


# ---- one optimizer step and the evaluation ---------------------------------------------------------

def train_step(ddp, optimizer, micro_batches, opts, step):
    """Forward/backward over this rank's micro-batches, then one optimizer step -> metrics.

    The loss is the mean over every pair of the optimizer step on every rank: each micro-batch's summed
    loss is divided by the global number of pairs (world_size x this rank's, as every rank takes the same
    number), and multiplied by world_size because DDP averages gradients over ranks."""
    world, t0 = dist.world(), time.time()
    n_pairs = world.world_size * sum(len(extra) for *_, extra in micro_batches)
    sums = dict.fromkeys(PAIR_SUMS, torch.zeros((), dtype=torch.float64))
    n_tokens = 0
    for j, (ids, attn, extra) in enumerate(micro_batches):
        ids, attn, extra = ids.to(world.device), attn.to(world.device), extra.to(world.device)
        parallel.sync_gradients(ddp, j == len(micro_batches) - 1)    # all-reduce gradients on the last one only
        with autocast(world.device, opts.dtype):
            r_chosen, r_rejected = pair_scores(ddp, ids, attn)
        loss = objective_loss(r_chosen, r_rejected, extra, opts)
        (loss.sum() * world.world_size / n_pairs).backward()
        add_sums(sums, pair_sums(r_chosen, r_rejected, loss, extra if opts.objective == "cost" else None))
        n_tokens += int(attn.sum())
    metrics = pair_metrics(reduce_sums(sums), "train", objective=opts.objective)
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
        ids, attn, extra = (t.to(device) for t in collate(mine[i:i + opts.batch_size], pad_id, opts.objective))
        with autocast(device, opts.dtype):
            r_chosen, r_rejected = pair_scores(model, ids, attn)
        loss = objective_loss(r_chosen, r_rejected, extra, opts)
        add_sums(sums, pair_sums(r_chosen, r_rejected, loss, extra if opts.objective == "cost" else None))
        chosen_scores.append(r_chosen.double().cpu())
        rejected_scores.append(r_rejected.double().cpu())
    model.train()
    metrics = pair_metrics(reduce_sums(sums), "eval", with_scores=True, objective=opts.objective)
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


def gold_reference(evals, objective="reward"):
    """The reference for gold_agreement where the task has one (every eval prompt is a text prompt of the
    built-in task: its gold reward, or for a cost model its gold cost, from the reward interface), else None:
    no gold figures logged."""
    prompts = [p["texts"][0] for p in evals]
    if not all(isinstance(p, str) for p in prompts):
        return None
    return reward_mod.builtin_gold(prompts, cost=objective == "cost")


# ---- data and model --------------------------------------------------------------------------------

def run_record(opts, data_path):
    """The inputs a reward-model run only reads and its data files (its options are its identity:
    nano_rlhf/training.py)."""
    return dict(inputs={"init": opts.init, "tokenizer": opts.tokenizer},
                data_files={"data": data_path, "eval_data": opts.eval_data})


def harm_ordered(record):
    """A safety-labelled record as the cost model's pair: y_w, the more harmful response (the one not named
    safer), in the first slot (where collate_pairs puts "chosen"), y_l in the second, and their signs
    s = +1 unsafe / −1 safe. Which response is more helpful plays no part."""
    w, l = SAFER[record["safer"] == "chosen"], record["safer"]
    return {"prompt": record["prompt"], "chosen": record[w], "rejected": record[l],
            "signs": [-1.0 if record[f"{w}_safe"] else 1.0, -1.0 if record[f"{l}_safe"] else 1.0]}


def collate(pairs, pad_id, objective):
    """A micro-batch: ids and attention mask of the 2B rows (first slots, then second slots) and its extra:
    the (B,) margins of a reward model, or the (B, 2) signs (s_w, s_l) of a cost model."""
    ids, attn, _, margin = collate_pairs(pairs, pad_id)
    return ids, attn, (torch.tensor([p["signs"] for p in pairs]) if objective == "cost" else margin)


def tokenize(records, tok, block_size, path, objective="reward"):
    """Tokenized pairs (each keeping its strings as "texts", for a reference reward; a cost model's records in
    harm order, with their signs) and their stats; an error naming the file when no pair fits."""
    pairs, stats = [], None
    for record in records:       # one at a time, so each kept pair stays beside its own record
        if objective == "cost":
            record = harm_ordered(record)
        kept, one = tokenize_pairs([record], tok, block_size)
        stats = one if stats is None else type(one)((k, stats[k] + one[k]) for k in one)
        pairs += [dict(p, texts=(record["prompt"], record["chosen"], record["rejected"]),
                       **({"signs": record["signs"]} if objective == "cost" else {})) for p in kept]
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
    """--device one this machine has, then the cross-field rules (each field's own range is declared in Options
    and checked by parse_args)."""
    check_device(opts.device)
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
    opts = parse_args(Options, argv, __doc__)      # each option's range and [with ...] refused here
    check_options(opts)                            # --device and the rules between options; only refuses
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    # the data before the run opens: every line is validated before anything is written or built
    records, eval_records, data_path, eval_path = training.train_eval_records(
        opts, "safety" if opts.objective == "cost" else "preference")
    sign = ["sign_accuracy"] if opts.objective == "cost" else []
    run = training.open_run(opts, "rm", **run_record(opts, data_path),
                            show=["train/loss", "train/accuracy", *(f"train/{k}" for k in sign), "eval/loss",
                                  "eval/accuracy", *(f"eval/{k}" for k in sign), "eval/gold_corr"])
    with input_errors():
        tok = training.tokenizer(opts, run, policy=False)
        model = build_model(opts, tok)
        run.identity.update(lora.attach(model, opts, opts.init, trainable=("score",)))   # --lora_r; head trains
        max_length = training_length(opts.max_length, model.cfg.block_size, opts.init or "the new model")
        run.identity.update(max_length=max_length)   # --max_length resolved: what the data is cut to
        train, train_stats = tokenize(records, tok, max_length, data_path, opts.objective)
        evals, eval_stats = tokenize(eval_records, tok, max_length, eval_path, opts.objective)
        batches = Batches(len(train), opts.batch_size, opts.grad_accum, world.rank, world.world_size, opts.seed)
    gold = gold_reference(evals, opts.objective)       # the gold diagnostic only where the task defines one
    training.place(opts, world, {"reward model": model})
    ddp, optimizer = training.prepare(opts, model, opts.lr)
    training.plan(opts, {"rm": model})
    max_steps = derive_max_steps(opts, batches.steps_per_epoch)
    run.set_max_steps(max_steps)
    run.resume({"rm": model}, {"rm": optimizer}, data={"data": batches},
              global_batch=batches.global_batch, max_steps=max_steps, tokenizer=tok.info())
    dist.print0(f"{'CM' if opts.objective == 'cost' else 'RM'} | {sum(p.numel() for p in model.parameters()):,} "
                f"parameters{lora.describe(model)} | {len(train):,} train pairs "
                f"({train_stats}) | {len(evals):,} eval pairs ({eval_stats}) | max length {max_length} | global batch "
                f"{batches.global_batch} "
                f"pairs | {max_steps} steps" + (f" | resuming at step {run.step}" if run.step else ""))
    kind = {"score_kind": "cost"} if opts.objective == "cost" else {}    # in every model directory it writes
    evaluated = {}      # step -> metrics of the last evaluation: the final save reuses it

    def evaluate_now(step):
        evaluated.clear()
        with parallel.gathered(ddp):      # FSDP: ranks may hold different numbers of eval batches
            evaluated[step] = evaluate(model, evals, pad_id=tok.pad_id, opts=opts, reward=gold)
        return evaluated[step]

    def save(step):
        run.save(step, {"rm": model}, {"rm": optimizer}, data={"data": batches})
        # the final model directory is written once, below, with its score statistics: a model saved
        # here at the last step without reward_mean/std would make PPO skip normalisation if the run
        # died before that save (a --resume at max_steps then only evaluates and saves)
        if step != max_steps:
            save_model_dir(opts.out_dir, model, tok, **kind)

    step = run.step
    for step in range(run.step + 1, max_steps + 1):      # step = optimizer steps done after this one
        lr = lr_at(step - 1, max_steps, opts.lr, opts.warmup_steps, "linear")
        set_lr(optimizer, lr)
        micro_batches = [collate([train[i] for i in mb], tok.pad_id, opts.objective) for mb in batches.next_step()]
        metrics = dict(train_step(ddp, optimizer, micro_batches, opts, step - 1), **{"train/lr": lr})
        if run.end_of_step(step, metrics, evaluate=lambda: evaluate_now(step), save=save):
            break

    if step == max_steps:
        # score statistics on the eval set, for PPO's reward normalisation (OpenRLHF normalize_reward);
        # the last step already evaluated these weights unless this run resumed at max_steps
        final = evaluated.get(step) or evaluate_now(step)
        if opts.objective == "cost":       # statistics to read, not to normalise by: a cost's 0 is its boundary
            save_model_dir(opts.out_dir, model, tok, **kind, cost_mean=final["eval/score_mean"],
                           cost_std=final["eval/score_std"], cost_unsafe_share=final["eval/unsafe_share"],
                           cost_sign_accuracy=final["eval/sign_accuracy"])
        else:
            save_model_dir(opts.out_dir, model, tok, reward_mean=final["eval/score_mean"],
                           reward_std=final["eval/score_std"])
        dist.check_same_weights(model, "cost model" if opts.objective == "cost" else "reward model")
        what = "gold cost" if opts.objective == "cost" else "gold reward"
        gold_note = (f" (the {what} itself: {final['eval/gold_ranker_accuracy']:.3f}) | correlation with {what} "
                     f"{final['eval/gold_corr']:.3f}" if "eval/gold_corr" in final else "")
        cost_note = (f" | sign accuracy {final['eval/sign_accuracy']:.3f} | unsafe share "
                     f"{final['eval/unsafe_share']:.3f}" if opts.objective == "cost" else "")
        dist.print0(f"saved {opts.out_dir} (HF {model.architecture} layout{', a cost model' if kind else ''}) | "
                    f"eval {'safer-choice ' if kind else ''}accuracy {final['eval/accuracy']:.3f}{cost_note} | "
                    f"scores mean {final['eval/score_mean']:+.3f} std {final['eval/score_std']:.3f}" + gold_note)
    run.close()
    return SimpleNamespace(model=model, optimizer=optimizer, options=opts)


if __name__ == "__main__":
    main()
