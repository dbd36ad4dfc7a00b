"""Learning from single responses, not pairs: labelled good or bad (KTO), negatives only (NPO, D2O), or a scalar
reward with a value (DRO). Imports sequence_logps (the log-prob gather) from train_dpo.py.

Notation: S(y) = Σ_t log π(y_t | x, y_<t) over the response (end-of-text included), u(y) = S_θ(y) − S_ref(y) the
log-ratio to the frozen reference, σ the logistic, y⁻ an undesirable response (a row with "label": false).

  --method kto   desirable y: λ_D·(1 − σ(β(u(y) − z₀))),  undesirable y: λ_U·(1 − σ(β(z₀ − u(y))))
                 z₀ = max(0, detached mean of u(x, y′) over mismatched pairs)   Ethayarajh et al. 2024, eq. 8
                 (λ_D, λ_U = --desirable_weight, --undesirable_weight). The mismatched completion y′ of example i
                 is that of a fixed other example (a seeded derangement), so its reference log-probs can be
                 precomputed like the others (--precompute_ref); z₀ is estimated per micro-batch (over every
                 rank's share of it), not over the whole step.
  --method npo   −(2/β)·log σ(−β·u(y⁻))                                       Zhang et al. 2024, eq. 3
                 rows with "label": true are an error, unless --retain_coef c > 0 makes them retain data:
                 + c·NLL over their tokens (the paper's retain-loss variant, NPO+RT; a token mean, as its code)
                 --lr defaults to the paper's 1e-5 for npo: the forget term is over SUMMED log-probs, about a
                 response's length stronger than the retain NLL; --retain_warn flags a retain NLL running away
  --method d2o   −log σ(β/K·Σᵢ u(yᵢ) − α·u(y⁻)),  y₁ … y_K ~ π_ref(·|x)        Duan et al. 2024, the D²O loss
                 the K self-generated responses are sampled ONCE from the reference before training (so the
                 method stays offline) and saved to out_dir/d2o_samples.jsonl, which --resume reuses
  --method dro   ½·(r − V(x) − τ·u(y))²  on single responses with a scalar reward r ("score", or "label" as
                 ±1) and a value model V(x) read at the prompt's last token, trained jointly   Richemond et al.
                 2024, DRO-V

NPO in one sentence: it is DPO with the chosen term dropped (the paper's derivation), so it lowers π(y⁻) with a
weight σ(β·u(y⁻)) that vanishes as y⁻ becomes unlikely: gradient ascent on the NLL, made bounded. D2O keeps the
negative's push-down anchored by responses the model itself writes: it raises their likelihood relative to the
reference as it lowers the negative's, which is what keeps NPO-style unlearning from collapsing the model.

The paper's choice of reference for each D2O term: the self-generated yᵢ are compared against π_r⁻, the negative
y⁻ against π_r⁺. Its practical algorithm samples the yᵢ from the policy being trained and refreshes them (and
π_r⁻) every few steps. Here both references are the frozen initial policy (--ref, default --init) and the yᵢ
are drawn once from it: the offline special case (the paper's algorithm before its first refresh), chosen so
the run is one reproducible pass over fixed data like every other script's. With K = 1 and α = β it is DPO
with the reference's own sample as the chosen response.

DRO's gradients: the paper takes the gradient of one loss L(θ, V) with respect to each network: for
the policy −τ·(r − V(x) − τ·u)·∇_θ log π_θ(y|x), for the value −(r − V(x) − τ·u)·∇V(x). The two networks
share no parameter, so one backward of L gives exactly both (V is a constant in the policy's gradient and π in
the value's: no stop-gradient is needed). Each has its own optimizer and learning rate (--lr, --value_lr).
V(x) starts at 0 (a zero head on the --init trunk): the first steps see the raw reward.

Every loss is a mean over the step's examples on all ranks (NPO: over its negatives; the retain NLL is a token
mean over the step's retain tokens). See docs/algorithms.md, "Negative-only" and "DRO".

Run:
    python train_unpaired.py --method kto                  # built-in task: unpaired.jsonl, both labels -> out/kto
    python train_unpaired.py --method kto --precompute_ref # reference log-probs once, then the reference is freed
    python train_unpaired.py --method npo                  # built-in task: the undesirable half of unpaired.jsonl
    python train_unpaired.py --method npo --retain_coef 1  # ... and its desirable half as retain data
    python train_unpaired.py --method d2o --num_samples 4  # samples 4 responses per prompt first -> out/d2o
    python train_unpaired.py --method dro                  # built-in scored.jsonl (gold reward + noise) -> out/dro
    python train_unpaired.py --method dro --data kto.jsonl # a label file works too: true/false = +1/−1
    torchrun --nproc_per_node 2 train_unpaired.py --method dro
    torchrun --nproc_per_node 2 train_unpaired.py --method dro --fsdp      # policy, value and reference sharded
    python train_unpaired.py --method npo --lora_r 16      # adapters; the reference is the policy with them off

Data: kto, npo and d2o read unpaired rows {"prompt", "completion", "label"}; dro reads scored rows {"prompt",
"completion", "score"} (or "label"). Conversational rows are rendered with the model's chat template.
Outputs: the policy in out_dir (HF layout); dro also saves its value model to out_dir/value (a
*ForSequenceClassification directory).
"""
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from nano_rlhf import dist, lora, parallel
from nano_rlhf import training
from nano_rlhf.checkpoint import atomic_write_text, save_model_dir
from nano_rlhf.cli import CompileOption, FrozenModelOptions, RunOptions, parse_args
from nano_rlhf.data import (Batches, DataError, collate_prompts, default_data, fit_prompt, load_records, load_scored,
                            pad_right, split_off, tokenize_scored, tokenize_unpaired, training_length)
from nano_rlhf.model import GPT, ScoreModel, upcast
from nano_rlhf.sampling import cut_at_stop
from nano_rlhf.training import (autocast, check_device, check_vocab, derive_max_steps, fail, input_errors,
                                load_reference, lr_at, set_lr)


SAMPLES_FILE = "d2o_samples.jsonl"


@dataclass
class Options(CompileOption, FrozenModelOptions, RunOptions):
    method: Literal["kto", "npo", "d2o", "dro"] = "npo"   # which loss
    beta: float = 0.1             # β (dro's KL strength is --tau) [with method!=dro] {> 0}
    desirable_weight: float = 1.0     # λ_D [with method=kto] {> 0}
    undesirable_weight: float = 1.0   # λ_U [with method=kto] {> 0}
    precompute_ref: bool = False  # compute the reference log-probs once before training, then drop the model
                                  # [with method=kto]
    alpha: Optional[float] = None # weight α of the negative's log-ratio; none = β [with method=d2o] {>= 0}
    retain_coef: float = 0.0      # weight of the NLL on label-true rows (retain data); 0 = they are an error
                                  # [with method=npo] {>= 0}
    retain_warn: float = 3.0      # warn once if the retain NLL exceeds this × its first step's; 0 = off
                                  # [with method=npo] {>= 0}
    num_samples: int = 4          # K responses sampled from the reference per prompt [with method=d2o] {>= 1}
    max_new_tokens: int = 32      # longest sampled response [with method=d2o] {>= 1}
    temperature: float = 1.0      # sampling temperature of the K responses [with method=d2o] {> 0}
    tau: float = 0.1              # τ, the KL-regularisation strength [with method=dro] {> 0}
    value_lr: float = 1e-4        # peak learning rate of the value model [with method=dro] {0 < x <= 1e3}
    data: str = ""                # unpaired JSONL (kto, npo, d2o) or scored JSONL (dro); empty = built-in task
    eval_data: str = ""           # held-out JSONL of the same kind; empty = split --eval_fraction off --data
    eval_fraction: float = 0.05   # share of --data held out when no --eval_data is given {0 < x < 1}
    init: str = "out/sft"         # policy to start from (an SFT model directory); dro's value trunk too
    ref: str = ""                 # reference model directory; empty = --init
    out_dir: str = ""             # output directory; empty = out/<method>
    dropout: float = 0.0          # dropout of the policy (0: log-probs must be reproducible) {0 <= x < 1}
    batch_size: int = 16          # examples per device per micro-step {>= 1}
    grad_accum: int = 1           # micro-steps per optimizer step {>= 1}
    max_steps: int = 0            # optimizer steps; 0 = as many as --epochs needs {>= 0}
    epochs: float = 1.0           # passes over the data when --max_steps is 0 {> 0}
    lr: Optional[float] = None    # peak learning rate of the policy; none = 1e-5 for npo (the paper's), 1e-4 else
                                  # {0 < x <= 1e3}
    warmup_steps: int = 10        # linear warm-up steps {>= 0}
    weight_decay: float = 0.0     # AdamW decoupled weight decay (matrices only) {>= 0}
    beta1: float = 0.9            # AdamW beta1 {0 <= x < 1}
    beta2: float = 0.95           # AdamW beta2 {0 <= x < 1}
    grad_clip: float = 1.0        # clip each network's global gradient norm to this (0 = off) {>= 0}
    seed: int = 0                 # seed for data order, KTO's mismatched pairs and D2O's samples
    resume: bool = False          # continue from out_dir/state (D2O: with the saved samples)
    max_length: int = 0           # training length (prompts are left-truncated); 0 = min(block_size, 1024)
                                  # [with method=kto] {>= 0}


def fill_defaults(opts):
    """The defaults that depend on --method, filled in right after parsing (run.json records the filled values)."""
    opts.alpha = opts.beta if opts.alpha is None else opts.alpha
    # NPO: 1e-5, the paper's (its code's config/forget.yaml): at 1e-4 its forget term, a SUMMED sequence log-prob,
    # wrecked the retain NLL of the built-in task's policy (0.90 -> 4.3 in 50 steps; docs/algorithms.md, NPO)
    opts.lr = opts.lr if opts.lr is not None else (1e-5 if opts.method == "npo" else 1e-4)
    opts.out_dir = opts.out_dir or f"out/{opts.method}"


# ---- the losses: per example, (B,) --------------------------------------------------------------

def kto_loss(u, desirable, z0, beta, desirable_weight=1.0, undesirable_weight=1.0):
    """KTO (Ethayarajh et al. 2024, eq. 8): λ_D·(1 − σ(β(u − z₀))) where `desirable`, else λ_U·(1 − σ(β(z₀ − u)));
    u = log π_θ/π_ref(y|x), z₀ the reference point (kto_z0)."""
    return torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (u - z0))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (z0 - u))))


def kto_z0(kl_sum, kl_count):
    """KTO's reference point z₀ = max(0, mean of S_θ − S_ref over mismatched pairs (x, y′)), detached.
    Pure: in training the caller passes sums over every rank, so every rank uses the same z₀."""
    return (kl_sum.detach() / torch.as_tensor(kl_count).clamp(min=1)).clamp(min=0)


def npo_loss(u, beta):
    """NPO (Zhang et al. 2024, eq. 3): (2/β)·log(1 + (π_θ/π_ref)^β) = −(2/β)·log σ(−β·u), u = log π_θ/π_ref(y⁻)."""
    return -2.0 / beta * F.logsigmoid(-beta * u)


def retain_nll_drifted(first, now, factor):
    """True when the retain NLL `now` has grown past `factor` × its value at the run's first step. NPO+RT's
    objective (Zhang et al. 2024, as its authors' code computes it) balances a forget term over SUMMED sequence
    log-probs against a token-MEAN retain NLL, so at a large lr the forget gradient, about a response's length
    times the retain one, can win: the retain NLL rising several-fold is the sign (docs/algorithms.md, NPO).
    factor 0 = never."""
    return factor > 0 and first > 0 and now > factor * first


def d2o_loss(u_samples, u_negative, beta, alpha):
    """D²O (Duan et al. 2024): −log σ(β/K·Σᵢ u(yᵢ) − α·u(y⁻)); u_samples (B, K), u_negative (B,)."""
    return -F.logsigmoid(beta * u_samples.mean(1) - alpha * u_negative)


def dro_loss(reward, value, u, tau):
    """DRO-V (Richemond et al. 2024): ½·(r − V(x) − τ·u)²; gradients flow to both π (through u) and V."""
    return 0.5 * (reward - value - tau * u) ** 2


# ---- the log-prob gather, as train_dpo.py has it (tests/test_layout.py keeps the copies identical) ----------

def _scored_logps(model, input_ids, attention_mask, response_mask):
    """log π(y_t | x, y_<t) of the scored tokens (N,), row by row in order, and where they are: the (B, T−1)
    mask `scored`, column t for token t+1.

    Shift: the hidden state at position t predicts token t+1, so token t+1 is scored iff response_mask[t+1] = 1;
    the first response token is predicted from the last prompt position. Prompt and padding are never scored.
    Only the needed positions' hidden states are kept (select=...), and token_logprobs makes their logits in
    chunks (a real vocabulary's (N, V) logits would be the largest tensor of the step); log-softmax in float32.
    The log-probs come out of the model's forward (targets=...): under DDP only the wrapped model's forward is
    hooked for the gradient all-reduce, and --compile compiles the forward with its output layer.
    """
    scored = response_mask[:, 1:].bool()                             # (B, T-1): is token t+1 scored?
    # the positions as flat indices b·T + t, found where the mask is (a CPU mask: no host read on a GPU)
    positions = F.pad(scored, (0, 1)).flatten().nonzero().squeeze(1).to(input_ids.device)           # (N,)
    targets = input_ids.flatten()[positions + 1]                     # (N,) token t+1, N = scored.sum()
    return model(input_ids, attention_mask, select=positions, targets=targets), scored


def row_sums(values, scored):
    """(N,) values at the scored positions of a (B, T−1) mask -> (B,) per-row sums.
    index_add, not a (B, T−1) .sum(1): it adds each row's tokens one by one, in order, so a row's sum does not
    depend on how many rows share the batch or how long they are (a pairwise sum's last bits would)."""
    rows = scored.nonzero()[:, 0].to(values.device)                 # each value's row, in row-major order
    return torch.zeros(len(scored), device=values.device, dtype=values.dtype).index_add(0, rows, values)


def sequence_logps(model, input_ids, attention_mask, response_mask):
    """S = Σ_t log π(y_t | x, y_<t) per row (B,), and the response lengths |y| (B,)."""
    logp, scored = _scored_logps(model, input_ids, attention_mask, response_mask)
    return row_sums(logp, scored), scored.sum(1).float().to(logp.device)


# ---- log-probs and values (sequence_logps: train_dpo.py's gather) ------------------------------

def log_ratios(opts, policy, ref, rows, s_ref=None):
    """u = S_θ − S_ref of each row (B,), with the policy's graph; S_θ too (the retain NLL). S_ref: given
    (KTO's precomputed reference) or from the reference model."""
    with autocast(rows.ids.device, opts.dtype):
        s = sequence_logps(policy, rows.ids, rows.attn, rows.resp)[0]
        if s_ref is None:
            with torch.no_grad():
                s_ref = sequence_logps(ref, rows.ids, rows.attn, rows.resp)[0]
    return s - s_ref, s


@torch.no_grad()
def mismatched_kl_sum(opts, policy, ref, batch):
    """Σ of S_θ(x, y′) − S_ref(x, y′) over the batch's mismatched pairs: KTO's z₀ before the mean."""
    return log_ratios(opts, policy, ref, batch.mismatched, batch.ref_mismatched)[0].sum()


# ---- batches ------------------------------------------------------------------------------------

@dataclass
class Rows:
    ids: torch.Tensor     # (R, T) right-padded prompt + response
    attn: torch.Tensor    # (R, T)
    resp: torch.Tensor    # (R, T) response mask


def add_mismatched(examples, seed, max_len):
    """KTO's mismatched pairs: example i gets the completion of a fixed other example (a seeded
    derangement: a random cycle through all examples), so x and y′ are unrelated. A long prompt with a long
    y′ can exceed the training length although each example fits: the mismatched row's prompt is then
    left-truncated like any over-long prompt ("mismatched_prompt"; y′ alone always fits, with room for one
    prompt token, or its own example would have been dropped)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    for a, b in zip(order, order[1:] + order[:1]):
        examples[a]["mismatched"] = examples[b]["completion"]
        examples[a]["mismatched_prompt"] = fit_prompt(examples[a]["prompt"], len(examples[b]["completion"]), max_len)


def make_rows(pairs, pad_id, device):
    """[(prompt ids, response ids)] -> Rows on the device."""
    seqs = [p + r for p, r in pairs]
    return Rows(pad_right(seqs, pad_id).to(device), pad_right([[1] * len(s) for s in seqs], 0).to(device),
                pad_right([[0] * len(p) + [1] * len(r) for p, r in pairs], 0).to(device))


@dataclass
class Batch:
    rows: Rows                              # kto, npo, dro: B rows; d2o: B negatives then B·K samples (example-major)
    n_items: int
    tokens: int
    label: Optional[torch.Tensor] = None    # kto: desirable, npo: desirable (retain) rows (B,)
    score: Optional[torch.Tensor] = None    # dro: r (B,)
    prompts: Optional[tuple] = None         # dro: the prompts alone, right-padded (ids, attn), for V(x)
    mismatched: Optional[Rows] = None       # kto: the B [x, y′] rows, for z₀
    ref_logps: Optional[torch.Tensor] = None       # kto --precompute_ref: S_ref of the rows (B,)
    ref_mismatched: Optional[torch.Tensor] = None  # ... and of the mismatched rows (B,)


# the per-example reference log-probs that KTO's --precompute_ref stores: of [x, y] and of [x, y′]
REF_KEYS = ("ref", "ref_kl")


def make_batch(examples, opts, pad_id, device, samples=None):
    if opts.method == "d2o":
        pairs = [(e["prompt"], e["completion"]) for e in examples]
        pairs += [(e["prompt"], y) for e in examples for y in samples[tuple(e["prompt"])]]
        rows = make_rows(pairs, pad_id, device)
        return Batch(rows, len(examples), int(rows.attn.sum()))
    rows = make_rows([(e["prompt"], e["completion"]) for e in examples], pad_id, device)
    batch = Batch(rows, len(examples), int(rows.attn.sum()))
    if opts.method in ("kto", "npo"):
        batch.label = torch.tensor([e["label"] for e in examples], device=device)
    if opts.method == "kto":
        batch.mismatched = make_rows([(e["mismatched_prompt"], e["mismatched"]) for e in examples], pad_id, device)
        batch.tokens += int(batch.mismatched.attn.sum())
        if REF_KEYS[0] in examples[0]:
            batch.ref_logps, batch.ref_mismatched = (torch.tensor([e[k] for e in examples], device=device)
                                                     for k in REF_KEYS)
    elif opts.method == "dro":
        batch.score = torch.tensor([e["score"] for e in examples], device=device)
        batch.prompts = (pad_right([e["prompt"] for e in examples], pad_id).to(device),
                         pad_right([[1] * len(e["prompt"]) for e in examples], 0).to(device))
        batch.tokens += int(batch.prompts[1].sum())
    return batch


# ---- one micro-batch: named sums ------------------------------------------------------------------

STATS = {"kto": ("loss", "kl", "rewards_desirable", "rewards_undesirable", "n_desirable", "logps"),
         "npo": ("loss", "nll", "n_negative", "retain_tokens", "rewards_negative", "logps_negative"),
         "d2o": ("loss", "rewards_negative", "rewards_samples", "margin", "accuracy", "logps_negative"),
         "dro": ("loss", "value", "reward", "advantage", "residual", "log_ratio", "logps")}
COUNTS = ("items", "tokens")


def micro_step(opts, policy, ref, batch, value=None, z0=None):
    """Named sums over one micro-batch: 'loss' (and npo's 'nll') keep their graph, the rest is for the log.
    value: DRO's value model; z0: KTO's reference point for this micro-batch."""
    u, s = log_ratios(opts, policy, ref, batch.rows, batch.ref_logps)
    if opts.method == "kto":
        label = batch.label
        loss = kto_loss(u, label, z0, opts.beta, opts.desirable_weight, opts.undesirable_weight)
        return {"loss": loss.sum(), "kl": z0 * len(u), "rewards_desirable": (opts.beta * u * label).sum(),
                "rewards_undesirable": (opts.beta * u * ~label).sum(), "n_desirable": label.sum(),
                "logps": s.sum()}
    if opts.method == "npo":
        neg, pos = ~batch.label, batch.label
        tokens = batch.rows.resp[:, 1:].sum(1)
        return {"loss": (npo_loss(u, opts.beta) * neg).sum(), "nll": -(s * pos).sum(), "n_negative": neg.sum(),
                "retain_tokens": (tokens * pos).sum(), "rewards_negative": (opts.beta * u * neg).sum(),
                "logps_negative": (s * neg).sum()}
    if opts.method == "d2o":
        B = batch.n_items
        u_neg, u_samples = u[:B], u[B:].view(B, -1)
        logits = opts.beta * u_samples.mean(1) - opts.alpha * u_neg
        return {"loss": d2o_loss(u_samples, u_neg, opts.beta, opts.alpha).sum(),
                "rewards_negative": (opts.beta * u_neg).sum(), "rewards_samples": (opts.beta * u_samples.mean(1)).sum(),
                "margin": logits.sum(), "accuracy": (logits > 0).float().sum(), "logps_negative": s[:B].sum()}
    with autocast(batch.rows.ids.device, opts.dtype):
        v = upcast(value(*batch.prompts, end_only=True)[1])                      # V(x) at the prompt's last token
    r = batch.score
    return {"loss": dro_loss(r, v, u, opts.tau).sum(), "value": v.sum(), "reward": r.sum(), "advantage": (r - v).sum(),
            "residual": (r - v - opts.tau * u).sum(), "log_ratio": u.sum(), "logps": s.sum()}


def objective(opts, stats, n_items, n_negative, n_retain):
    """What one micro-batch adds to the step's objective (means over the whole step, on all ranks)."""
    if opts.method == "npo":
        return stats["loss"] / max(n_negative, 1) + opts.retain_coef * stats["nll"] / max(n_retain, 1)
    return stats["loss"] / n_items


def zero_sums(opts):
    return dict.fromkeys(STATS[opts.method] + COUNTS, 0.0)


def add_to(sums, stats, batch):
    for k, v in stats.items():
        sums[k] += float(v.detach())
    sums["items"] += batch.n_items
    sums["tokens"] += batch.tokens


def means(opts, totals):
    """Per-example means; NPO's loss and rewards per negative, its NLL per retain token; KTO's rewards per kind
    of example."""
    n_items = max(totals["items"], 1)
    if opts.method == "kto":
        n_desirable = totals["n_desirable"]
        return {"loss": totals["loss"] / n_items, "kl": totals["kl"] / n_items, "logps": totals["logps"] / n_items,
                "rewards_desirable": totals["rewards_desirable"] / max(n_desirable, 1),
                "rewards_undesirable": totals["rewards_undesirable"] / max(totals["items"] - n_desirable, 1)}
    if opts.method == "npo":
        n_neg = max(totals["n_negative"], 1)
        out = {"loss": totals["loss"] / n_neg, "rewards_negative": totals["rewards_negative"] / n_neg,
               "logps_negative": totals["logps_negative"] / n_neg}
        if opts.retain_coef:
            out["nll"] = totals["nll"] / max(totals["retain_tokens"], 1)
        return out
    return {k: v / n_items for k, v in totals.items() if k not in COUNTS}


@torch.no_grad()
def evaluate(opts, policy, ref, value, examples, pad_id, device, samples):
    """Means over the whole eval set, on all ranks. KTO's z₀ is each eval batch's own (ranks may hold
    different numbers of batches, so no collective inside the loop)."""
    policy.eval()
    mine = dist.rank_share(examples)
    sums = zero_sums(opts)
    for i in range(0, len(mine), opts.batch_size):
        batch = make_batch(mine[i:i + opts.batch_size], opts, pad_id, device, samples)
        z0 = kto_z0(mismatched_kl_sum(opts, policy, ref, batch), batch.n_items) if opts.method == "kto" else None
        add_to(sums, micro_step(opts, policy, ref, batch, value, z0), batch)
    policy.train()
    return {f"eval/{k}": v for k, v in means(opts, dist.all_reduce_sums(sums)).items()}


def step_z0(opts, policy, ref, micro, device):
    """KTO's z₀ of each of the step's micro-batches, from its mismatched pairs on every rank (one all-reduce);
    None for the other methods."""
    if opts.method != "kto":
        return [None] * len(micro)
    kl = dist.all_reduce_sum(torch.tensor([[float(mismatched_kl_sum(opts, policy, ref, b)), b.n_items]
                                           for b in micro], dtype=torch.float64))
    return [kto_z0(kl_sum, count).float().to(device) for kl_sum, count in kl]


@torch.no_grad()
def precompute_reference(opts, ref, example_sets, pad_id, device):
    """KTO: S_ref of each example's [x, y] and [x, y′] stored in the example (keyed by the example, not by batch
    position, so shuffling cannot misalign them: TRL#2337). Each rank computes a shard of each set; an
    all-reduce shares them. The caller then drops the reference model."""
    t0 = time.time()
    shares = [dist.rank_share(list(range(len(examples)))) for examples in example_sets]
    progress = training.Progress(sum(map(len, shares)), "precomputing the reference's log-probs", unit="examples",
                                stream=sys.stdout)             # beside the training loop's progress lines
    for examples, mine in zip(example_sets, shares):
        values = torch.zeros(len(examples), 2, dtype=torch.float64)
        for i in range(0, len(mine), opts.batch_size):
            idx = mine[i:i + opts.batch_size]
            batch = make_batch([examples[j] for j in idx], opts, pad_id, device)
            with autocast(device, opts.dtype):
                columns = [sequence_logps(ref, r.ids, r.attn, r.resp)[0] for r in (batch.rows, batch.mismatched)]
            values[idx] = torch.stack(columns, 1).double().cpu()
            progress.update(len(idx))
        values = dist.all_reduce_sum(values)
        for e, row in zip(examples, values.tolist()):
            e.update(zip(REF_KEYS, row))
    progress.done()
    dist.print0(f"precomputed reference log-probs for {sum(map(len, example_sets)):,} examples in "
                f"{time.time() - t0:.1f}s")


# ---- D2O's samples from the reference, drawn once -------------------------------------------------

@torch.no_grad()
def draw_samples(opts, ref, prompts, tok, device):
    """{prompt ids: K response id lists}, sampled from the reference on rank 0 (seeded), shared with every rank.
    A response ends at its first stop token (kept, as encode_response keeps the end-of-text); one that runs
    to max_new_tokens is kept as it is (unfinished, no end token)."""
    out = {}
    longest = max(len(p) for p in prompts)     # checked on every rank, so none waits for a rank 0 that stopped
    if longest >= ref.cfg.block_size:
        raise ValueError(f"--method d2o: a prompt of {longest} tokens leaves no room to sample a response in the "
                         f"model's block_size {ref.cfg.block_size}")
    if dist.world().is_main:      # (the other ranks wait in broadcast_object: within --dist_timeout for this pass)
        gen = torch.Generator(device=device).manual_seed(opts.seed)
        K, block = opts.num_samples, ref.cfg.block_size
        progress = training.Progress(len(prompts) * K, "D2O: sampling the reference", unit="responses",
                                    stream=sys.stdout)         # beside the training loop's progress lines
        for i in range(0, len(prompts), 32):
            chunk = prompts[i:i + 32]
            ids, attn = collate_prompts([list(p) for p in chunk for _ in range(K)], tok.pad_id)
            n_new = min(opts.max_new_tokens, block - ids.shape[1])
            if n_new < 1:
                raise ValueError(f"--method d2o: a prompt of {ids.shape[1]} tokens leaves no room to sample a "
                                 f"response in the model's block_size {block}")
            seq = ref.generate(ids.to(device), attn.to(device), n_new, opts.temperature, eos_token_id=tok.stop_ids,
                               pad_token_id=tok.pad_id, generator=gen)[:, ids.shape[1]:]
            lengths = cut_at_stop(seq, tok.stop_ids, tok.pad_id)[2].tolist()     # up to the stop token, kept
            rows = seq.tolist()
            for j, p in enumerate(chunk):
                out[p] = [rows[r][:lengths[r]] for r in range(j * K, (j + 1) * K)]
            progress.update(len(chunk) * K)
        progress.done()
    return dist.broadcast_object(out)


def save_samples(path, samples, tok):
    lines = [json.dumps({"prompt_ids": list(p), "sample_ids": ys, "samples": [tok.decode(y) for y in ys]})
             for p, ys in samples.items()]
    atomic_write_text(path, "\n".join(lines) + "\n")


def load_samples(path, prompts, k):
    """The samples a previous run saved; ValueError (one line) if they do not cover this run's prompts."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing; --resume of --method d2o reuses the samples the run drew")
    samples = {}
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        try:
            row = json.loads(line)
            samples[tuple(row["prompt_ids"])] = row["sample_ids"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{n}: not a line of saved D2O samples") from None
    missing = [p for p in prompts if len(samples.get(p, ())) != k]
    if missing:
        raise ValueError(f"{path}: no {k} samples for {len(missing)} of this run's prompts (another data set?)")
    return samples


# ---- set-up -------------------------------------------------------------------------------------

def evaluate_gathered(opts, policy, ref, value, examples, pad_id, device, samples):
    """evaluate() on gathered weights under FSDP: ranks may hold different numbers of eval batches, so the
    forwards must not all-gather."""
    with parallel.gathered(policy, ref, value):
        return evaluate(opts, policy, ref, value, examples, pad_id, device, samples)


def check_options(opts):
    """--device one this machine has, then the rules between options; a flag the method would silently ignore is an
    error."""
    check_device(opts.device)
    if opts.fsdp and opts.compile:
        fail("--compile with --fsdp is not supported; drop one of them", 2)
    msg = lora.check_lora_options(opts)
    if msg:
        fail(msg, 2)
    method = opts.method      # a flag the method would ignore is refused by the parser ([with method=...])
    if method == "kto" and opts.batch_size < 2:     # z₀ of one example is its own log-ratio
        fail(f"--method kto needs --batch_size >= 2 (got {opts.batch_size})", 2)
    if opts.offload_frozen and opts.precompute_ref:
        fail("--offload_frozen: this run holds no reference model (--precompute_ref)", 2)


def data_files(opts):
    """Train and eval files: the built-in task's unpaired.jsonl (npo, d2o) or scored.jsonl (dro) when none
    is given; eval None = split --eval_fraction off the train file."""
    if opts.data:
        return {"data": opts.data, "eval_data": opts.eval_data or None}
    path = default_data("scored" if opts.method == "dro" else "unpaired")   # (an old data/ gets scored.jsonl)
    return {"data": path, "eval_data": opts.eval_data or None}


def read_records(opts, path, builtin=False):
    """Validated records. kto: every row. npo/d2o: a desirable row (label true) is an error (FILE:LINE) unless
    npo's --retain_coef asks for it; in the built-in file (both labels, by design) those rows are left out
    instead."""
    if opts.method == "dro":
        return load_scored(path)
    records = load_records(path, "unpaired")
    if opts.method == "kto":
        return records
    if opts.method == "npo" and opts.retain_coef:
        keep = records
    elif builtin:
        keep = [r for r in records if not r["label"]]
    else:
        bad = next((r for r in records if r["label"]), None)
        if bad is not None:
            how = ("pass --retain_coef > 0 to train on them as retain data" if opts.method == "npo"
                   else "D2O learns from negatives only")
            raise DataError(f"{bad['_where']}: field 'label' is true, but --method {opts.method} takes undesirable "
                            f"responses (label false); {how}")
        keep = records
    if not any(not r["label"] for r in keep):
        raise DataError(f"{path}: no row with label false (an undesirable response) to learn from")
    return keep


def read_train_eval(opts, files):
    """(train records, eval records, eval source): validated before any model is loaded."""
    records = read_records(opts, files["data"], builtin=not opts.data)
    if files["eval_data"]:
        eval_source, eval_records = files["eval_data"], read_records(opts, files["eval_data"])
    else:
        records, eval_records = split_off(records, opts.eval_fraction, opts.seed)
        eval_source = f"{files['data']} (the --eval_fraction {opts.eval_fraction} held out)"
        if not records:
            raise ValueError(f"--eval_fraction {opts.eval_fraction} holds out every row of {files['data']}: none "
                             f"is left to train on; pass --eval_data")
    return records, eval_records, eval_source


def tokenize_examples(opts, files, records, eval_records, eval_source, tok, length):
    """Tokenized train and eval examples (KTO: with their mismatched completions) and the train counts."""
    tokenize = tokenize_scored if opts.method == "dro" else tokenize_unpaired
    train, counts = tokenize(records, tok, length)
    evals, eval_counts = tokenize(eval_records, tok, length)
    for examples, source, c in ((train, files["data"], counts), (evals, eval_source, eval_counts)):
        if not examples:
            raise ValueError(f"{source}: no example fits the training length {length} ({c})")
    if opts.method == "kto":
        add_mismatched(train, opts.seed, length)
        add_mismatched(evals, opts.seed, length)
    return train, evals, counts


def load_models(opts, tok):
    """Policy, the frozen reference (none when LoRA's adapters-off policy is the reference: main makes it),
    DRO's value model and the training length (kto: --max_length resolved against the policy; else its
    block_size). Raises on bad input (one line via input_errors)."""
    policy = GPT.from_pretrained(opts.init, dropout=opts.dropout)
    check_vocab(tok, policy.cfg, opts.init)
    length, what = policy.cfg.block_size, f"policy's {policy.cfg.block_size}"
    if opts.method == "kto":
        length = training_length(opts.max_length, policy.cfg.block_size, opts.init)
        what = f"training length {length} (--max_length, default min(policy block_size, 1024))"
    ref = None
    if not lora.shares_base(opts, opts.ref):
        ref = load_reference(opts.ref or opts.init, tok, length, what)
    value = None
    if opts.method == "dro":
        value = ScoreModel.from_pretrained(opts.init, new_head=True, dropout=0.0)
        torch.nn.init.zeros_(value.score.weight)        # V(x) = 0 at the start: the first steps see the raw r
    return policy, ref, value, length


def d2o_samples(opts, ref, examples, tok, block_size):
    """D2O's K responses per prompt, drawn once from the placed reference before training and written to
    out_dir/d2o_samples.jsonl (--resume reads them back from there). Raises on bad input (one line)."""
    prompts = sorted({tuple(e["prompt"]) for e in examples})
    path = os.path.join(opts.out_dir, SAMPLES_FILE)
    with input_errors():
        if opts.resume:
            samples = load_samples(path, prompts, opts.num_samples)
        else:
            t0 = time.time()
            samples = draw_samples(opts, ref, prompts, tok, dist.world().device)
            if dist.world().is_main:
                save_samples(path, samples, tok)
            dist.print0(f"sampled {opts.num_samples} responses for each of {len(prompts):,} prompts from the "
                        f"reference in {time.time() - t0:.1f}s -> {path}")
        longest = max(len(p) + len(y) for p, ys in samples.items() for y in ys)
        if longest > block_size:
            raise ValueError(f"{path}: a prompt + sample of {longest} tokens exceeds block_size {block_size}")
    return samples


def run_record(opts, files):
    """The inputs the run only reads and its data files (its options are its identity: nano_rlhf/training.py); D2O's
    samples, drawn once and read back by --resume, are hashed like its data (a file edited between stop and resume
    is refused, not trained on)."""
    samples = os.path.join(opts.out_dir, SAMPLES_FILE) if opts.method == "d2o" else None
    return dict(inputs={"init": opts.init, "ref": opts.ref},
                data_files={k: v for k, v in dict(files, d2o_samples=samples).items() if v})


# ---- training -----------------------------------------------------------------------------------

SHOW = {"kto": ["train/loss", "train/kl", "eval/loss"],           # the progress line's metrics, in order
        "npo": ["train/loss", "train/rewards_negative", "train/nll", "eval/loss"],
        "d2o": ["train/loss", "train/accuracy", "train/rewards_negative", "train/rewards_samples", "eval/loss"],
        "dro": ["train/loss", "train/value", "train/advantage", "train/log_ratio", "eval/loss"]}
LOSS_KEYS = ["train/loss", "train/grad_norm"]  # a NaN/inf in either stops the run (the checkpoint intact)


def main(argv=None):
    opts = parse_args(Options, argv, __doc__)      # each option's range and [with ...] refused here
    fill_defaults(opts)                            # the defaults that depend on other options
    check_options(opts)                            # --device and the rules between options; only refuses
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    files = data_files(opts)
    run = training.open_run(opts, "unpaired", **run_record(opts, files), show=SHOW[opts.method], loss_keys=LOSS_KEYS)
    with input_errors():
        records = read_train_eval(opts, files)
        tok = training.tokenizer(opts, run)
        policy, ref, value, length = load_models(opts, tok)
        run.identity.update(max_length=length)          # --max_length resolved (kto): what the data is cut to
        run.identity.update(lora.attach(policy, opts, opts.init))      # --lora_r: adapters, the base frozen
        if value is not None:      # DRO's value model as PPO's critic: adapters on its trunk, its head trained fully
            run.identity.update(lora.attach(value, opts, opts.init, trainable=("score",), prefix="value_lora",
                                            seed=opts.seed + 1))
        if ref is None:                                                  # LoRA, reference = --init: the policy
            ref = lora.BaseView(policy)                                  # with its adapters off, no second copy
        train, evals, counts = tokenize_examples(opts, files, *records, tok, length)
        batches = Batches(len(train), opts.batch_size, opts.grad_accum, world.rank, world.world_size, opts.seed)
    models = {"policy": policy} if value is None else {"policy": policy, "value": value}
    training.place(opts, world, models, {"reference": ref})
    if opts.precompute_ref:             # kto: S_ref stored in the examples, then the reference model freed
        precompute_reference(opts, ref, (train, evals), tok.pad_id, world.device)
        ref = None
    samples = d2o_samples(opts, ref, train + evals, tok, policy.cfg.block_size) if opts.method == "d2o" else None
    ref = training.frozen(opts, ref)
    peak = {"policy": opts.lr, "value": opts.value_lr}
    ddp, optimizers = {}, {}
    for name, m in models.items():
        ddp[name], optimizers[name] = training.prepare(opts, m, peak[name])
    training.plan(opts, {**models, "ref": ref})
    max_steps = derive_max_steps(opts, batches.steps_per_epoch)
    run.set_max_steps(max_steps)
    run.resume(models, optimizers, data={"data": batches}, global_batch=batches.global_batch,
              max_steps=max_steps)
    dist.print0(f"{opts.method.upper()}{lora.describe(policy)} | {len(train):,} train examples ({counts}) | "
                f"{len(evals):,} eval | global batch {batches.global_batch} | {max_steps} steps"
                + (f" | max length {length} | reference: {'precomputed' if ref is None else 'live'}"
                   if opts.method == "kto" else "")
                + (f" | resuming at step {run.step}" if run.step else ""))

    def save(step):
        run.save(step, models, optimizers, data={"data": batches})
        save_model_dir(opts.out_dir, policy, tok)
        if value is not None:
            save_model_dir(os.path.join(opts.out_dir, "value"), value, tok)

    retain = SimpleNamespace(first=0.0, warned=False)     # --retain_warn's watch (all-reduced: the same on ranks)
    for step in range(run.step + 1, max_steps + 1):
        t0 = time.time()
        for name, opt in optimizers.items():
            set_lr(opt, lr_at(step - 1, max_steps, peak[name], opts.warmup_steps, "linear"))
        micro = [make_batch([train[i] for i in idx], opts, tok.pad_id, world.device, samples)
                 for idx in batches.next_step()]
        n_items = batches.global_batch
        n_negative = n_retain = 0
        if opts.method == "npo":        # the step's denominators, over all ranks, before any backward
            n_negative, n_retain = dist.all_reduce_sum(torch.tensor(
                [[float((~b.label).sum()), float((b.rows.resp[:, 1:].sum(1) * b.label).sum())] for b in micro],
                dtype=torch.float64).sum(0)).tolist()
        z0 = step_z0(opts, policy, ref, micro, world.device)          # kto: one per micro-batch; else None
        sums = zero_sums(opts)
        for j, batch in enumerate(micro):
            for d in ddp.values():                                  # gradients all-reduced once, on the last one
                parallel.sync_gradients(d, j == len(micro) - 1)
            stats = micro_step(opts, ddp["policy"], ref, batch, ddp.get("value"), z0[j])
            (objective(opts, stats, n_items, n_negative, n_retain) * dist.ddp_scale()).backward()
            add_to(sums, stats, batch)
        totals = dist.all_reduce_sums(sums)
        metrics = {f"train/{k}": v for k, v in means(opts, totals).items()}
        if opts.method == "npo" and opts.retain_coef and totals["retain_tokens"] and not retain.warned:
            retain.first = retain.first or metrics["train/nll"]        # this run's first step with retain tokens
            if retain_nll_drifted(retain.first, metrics["train/nll"], opts.retain_warn):
                retain.warned = True
                if world.is_main:
                    print(f"warning: step {step}: the retain NLL {metrics['train/nll']:.3f} is "
                          f"{metrics['train/nll'] / retain.first:.1f}x its first value {retain.first:.3f}: the NPO "
                          f"term is overpowering the retain term; lower --lr (the paper: 1e-5) or raise --retain_coef "
                          f"(docs/algorithms.md, NPO)", file=sys.stderr, flush=True)
        for name, model in models.items():
            norm = parallel.clip_grad_norm(model.parameters(), opts.grad_clip)
            metrics["train/grad_norm" if name == "policy" else f"train/{name}_grad_norm"] = norm
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        metrics.update({"train/lr": optimizers["policy"].param_groups[0]["lr"],
                        "train/tokens_per_s": totals["tokens"] / max(time.time() - t0, 1e-9)})
        if run.end_of_step(step, metrics, save=save, evaluate=lambda: evaluate_gathered(
                opts, policy, ref, value, evals, tok.pad_id, world.device, samples)):
            break
    run.finish(models, {"reference": ref}, saved=f"saved {opts.out_dir} (HF {policy.architecture} layout)")
    return SimpleNamespace(policy=policy, ref=ref, value=value, optimizers=optimizers, options=opts, samples=samples,
                           train=train)


if __name__ == "__main__":
    main()
