"""Direct preference optimisation and its family: offline losses on preference pairs, one flag apart.

Notation: S(y) = Σ_t log π(y_t | x, y_<t) over the response (end-of-text included), Ā(y) = S(y)/|y|,
u = S_θ − S_ref (the implicit reward / β), h = u_w − u_l (w = chosen, l = rejected), σ the logistic.

  --loss dpo     −log σ(βh)                    with --label_smoothing ε (cDPO): −(1−ε)log σ(βh) − ε log σ(−βh)
                                                                           Rafailov et al. 2023, eq. 7
  --loss robust  [−(1−ε)log σ(βh) + ε log σ(−βh)] / (1−2ε)                 Chowdhury et al. 2024, eq. 6
  --loss ipo     (h̃ − 1/(2β))²,  h̃ = u_w/|y_w| − u_l/|y_l|                 Azar et al. 2023, eq. 17
  --loss hinge   max(0, 1 − βh)                                            SLiC, Zhao et al. 2023
  --loss rdpo    −log σ(βh + α(|y_w| − |y_l|))                             Park et al. 2024, eq. 9
  --loss simpo   −log σ(β(Ā_θ(y_w) − Ā_θ(y_l)) − γ)            no reference  Meng et al. 2024, eq. 6
  --loss cpo     −log σ(β(S_θ(y_w) − S_θ(y_l))) + α·NLL(y_w)   no reference  Xu et al. 2024, eq. 5
  --loss orpo    NLL(y_w) − λ·log σ(logodds_w − logodds_l),   no reference  Hong et al. 2024, eq. 6
                 logodds(y) = Ā_θ(y) − log(1 − exp(Ā_θ(y)))
  --loss kto     unpaired data; z₀ = max(0, detached mean of S_θ − S_ref on mismatched (x, y′));
                 desirable λ_D(1 − σ(β(u − z₀))), undesirable λ_U(1 − σ(β(z₀ − u)))  Ethayarajh et al. 2024, eq. 8
  --nll_coef α   adds α·NLL(y_w) to any pair loss (RPO, Pang et al. 2024); kto has no y_w

NLL(y_w) is the token-mean cross-entropy over all chosen-response tokens of the optimizer step (the prompt
excluded; TRL's ORPO includes it). Pair losses are averaged over all pairs of the step, on all ranks.

Run:
    python train_dpo.py                                   # DPO on the built-in task, from out/sft -> out/dpo
    python train_dpo.py --loss ipo --beta 0.1             # -> out/ipo
    python train_dpo.py --loss kto                        # reads the unpaired data -> out/kto
    python train_dpo.py --data prefs.jsonl --init out/sft --precompute_ref --out_dir out/my_dpo
    torchrun --nproc_per_node 2 train_dpo.py --loss simpo

Reading the logs: rewards are β·u (β·S_θ for cpo, β·Ā_θ for simpo, log-odds for orpo). Both chosen and
rejected rewards usually fall below zero: after SFT on similar data, any other objective lowers the
likelihood of the data; what DPO optimises is the margin between them (eric-mitchell/dpo#8, #32).

Simplifications: the reference is a frozen copy of the initial policy (or precomputed log-probs); no
reference-model syncing (TR-DPO); KTO's mismatched completion for example i is that of a fixed other
example (a seeded derangement), so its reference log-probs can be precomputed like the others.
"""
import contextlib
import math
import os
import random
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from nano_rlhf import dist
from nano_rlhf.checkpoint import find_state, load_state, save_model_dir, save_state
from nano_rlhf.common import (Logger, adamw, autocast, builtin_file, check_finite, check_vocab, fail, input_errors,
                              load_tokenizer, lr_at, set_lr, split_off)
from nano_rlhf.config import parse_args, save_config
from nano_rlhf.data import Batches, collate_pairs, load_records, pad_right, tokenize_pairs, tokenize_unpaired
from nano_rlhf.model import GPT

REFERENCE_FREE = ("simpo", "cpo", "orpo")
# β defaults: 0.1, except SimPO (its reward is a per-token mean, so it needs a larger scale, as in the paper)
# and IPO (τ sets the target margin 1/(2τ) of the per-token log-ratio: 0.1 would ask for 5 nats per token)
DEFAULT_BETA = {"simpo": 2.0, "ipo": 0.5}


@dataclass
class Options:
    loss: Literal["dpo", "robust", "ipo", "hinge", "rdpo", "simpo", "cpo", "orpo", "kto"] = "dpo"  # which loss
    beta: Optional[float] = None  # β (ipo: τ); none = 0.1, or 2.0 for simpo, 0.5 for ipo
    label_smoothing: float = 0.0  # ε: assumed share of flipped labels (dpo = cDPO, robust; an error elsewhere)
    gamma: float = 0.5            # SimPO target margin γ
    alpha: Optional[float] = None # rdpo: length coefficient (none = 0.01); cpo: NLL weight (none = 1.0)
    lam: float = 0.1              # ORPO weight λ of the odds-ratio term
    desirable_weight: float = 1.0     # KTO λ_D
    undesirable_weight: float = 1.0   # KTO λ_U
    nll_coef: float = 0.0         # add this × NLL(chosen) to the loss (RPO); cpo/orpo add their own; not kto
    precompute_ref: bool = False  # compute the reference log-probs once before training, then drop the reference
    data: str = ""                # preference JSONL (unpaired JSONL for kto); empty = built-in task
    eval_data: str = ""           # held-out JSONL of the same kind; empty = split --eval_fraction off --data
    eval_fraction: float = 0.05   # share of --data held out when no --eval_data is given
    init: str = "out/sft"         # policy to start from (an SFT model directory)
    ref: str = ""                 # reference model directory; empty = --init
    tokenizer: str = ""           # tokenizer.json; empty = the one in --init
    eos_token: str = ""           # end-of-text token name; empty = from tokenizer_config.json or the usual names
    pad_token: str = ""           # pad token name; empty = likewise (none: an id outside the vocabulary)
    out_dir: str = ""             # output directory; empty = out/<loss>
    dropout: float = 0.0          # dropout of the policy (0: log-probs must be reproducible)
    batch_size: int = 16          # pairs (kto: examples) per device per micro-step
    grad_accum: int = 1           # micro-steps per optimizer step
    max_steps: int = 0            # optimizer steps; 0 = as many as --epochs needs
    epochs: float = 1.0           # passes over the data when --max_steps is 0
    lr: float = 1e-4              # peak learning rate (built-in task; ~5e-7 for GPT-2 sizes)
    warmup_steps: int = 10        # linear warm-up steps
    weight_decay: float = 0.0     # AdamW decoupled weight decay (matrices only)
    beta1: float = 0.9            # AdamW beta1
    beta2: float = 0.95           # AdamW beta2
    grad_clip: float = 1.0        # clip the global gradient norm to this (0 = off)
    seed: int = 0                 # seed for data order (and KTO's mismatched pairs)
    device: str = "auto"          # cpu, cuda, or auto
    dtype: str = "float32"        # float32 or bfloat16 (autocast; log-softmax always float32)
    compile: bool = False         # torch.compile the policy
    log_interval: int = 10        # print and log every N steps
    eval_interval: int = 100      # evaluate every N steps (and at the end); 0 = only at the end
    save_interval: int = 500      # checkpoint every N steps (and at the end); 0 = only at the end
    resume: bool = False          # continue from out_dir/state
    stop_at: int = 0              # end this run after step N with a checkpoint (--resume later)


# ---- the one log-prob gather --------------------------------------------------------------------

def sequence_logps(model, input_ids, attention_mask, response_mask):
    """Per-sequence sums of response-token log-probs S (B,) and response lengths |y| (B,).

    Shift: logits at position t predict token t+1, so token t+1 is scored iff response_mask[t+1] = 1; the
    first response token is predicted from the last prompt position. Prompt and padding are never scored.
    Only the needed positions' logits are computed (select=...); log-softmax in float32.
    """
    target_mask = response_mask[:, 1:].bool()                        # (B, T-1): is token t+1 scored?
    logits = model(input_ids, attention_mask, select=F.pad(target_mask, (0, 1)))   # (N, V)
    targets = input_ids[:, 1:][target_mask]                          # (N,)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None].expand_as(target_mask)[target_mask]
    sums = torch.zeros(input_ids.shape[0], device=logp.device).index_add(0, rows, logp)
    return sums, target_mask.sum(1).float()


# ---- the losses: per example, (B,) --------------------------------------------------------------

def dpo_loss(h, beta, label_smoothing=0.0):
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def robust_loss(h, beta, label_smoothing):
    return (-(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) \
        / (1 - 2 * label_smoothing)


def ipo_loss(u_w, u_l, len_w, len_l, beta):
    h = u_w / len_w.clamp(min=1) - u_l / len_l.clamp(min=1)          # length-averaged (TRL PR #1265)
    return (h - 1 / (2 * beta)) ** 2


def hinge_loss(h, beta):
    return F.relu(1 - beta * h)


def rdpo_loss(h, len_w, len_l, beta, alpha):
    return -F.logsigmoid(beta * h + alpha * (len_w - len_l))


def simpo_loss(s_w, s_l, len_w, len_l, beta, gamma):
    return -F.logsigmoid(beta * (s_w / len_w.clamp(min=1) - s_l / len_l.clamp(min=1)) - gamma)


def cpo_loss(s_w, s_l, beta):
    return -F.logsigmoid(beta * (s_w - s_l))


def log_odds(s, length):
    """log(p / (1 − p)) with log p = Ā = S/|y| ≤ 0, computed stably: log(1 − e^a) is log(−expm1(a)) near
    0 and log1p(−e^a) far below it (Mächler 2012); a is kept just below 0 so p = 1 cannot give inf.
    Each branch gets an input clamped to its own safe domain ("double where"): torch.where's backward
    multiplies the unselected branch's gradient by 0, and 0·inf = NaN — e.g. log1p(−e^a) at a = −1e-10,
    where e^a rounds to 1 in float32. The selected branch sees a unchanged, so the value is exact."""
    a = (s / length.clamp(min=1)).clamp(max=-1e-12)
    near = a > -math.log(2)
    log1mexp = torch.where(near, torch.log(-torch.expm1(a.clamp(min=-math.log(2)))),
                           torch.log1p(-torch.exp(a.clamp(max=-math.log(2)))))
    return a - log1mexp


def orpo_loss(s_w, s_l, len_w, len_l, lam):
    """The odds-ratio term only; ORPO's NLL(y_w) is added at the batch level like every NLL term."""
    return -lam * F.logsigmoid(log_odds(s_w, len_w) - log_odds(s_l, len_l))


def kto_loss(u, desirable, z0, beta, desirable_weight=1.0, undesirable_weight=1.0):
    return torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (u - z0))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (z0 - u))))


def kto_z0(kl_sum, kl_count, sync=True):
    """Reference point: max(0, mean of S_θ − S_ref over mismatched pairs), detached; in training the
    sums are all-reduced so every rank uses the same z₀."""
    total = torch.stack([kl_sum.detach().double().cpu(), torch.tensor(float(kl_count), dtype=torch.float64)])
    if sync:
        total = dist.all_reduce_sum(total)
    return (total[0] / total[1].clamp(min=1)).clamp(min=0).float().to(kl_sum.device)


def pair_loss(o, pi_w, pi_l, ref_w, ref_l, len_w, len_l):
    """Per-pair loss and the 'rewards' logged for chosen and rejected (see the module docstring)."""
    beta = o.beta
    if o.loss in REFERENCE_FREE:
        if o.loss == "simpo":
            return simpo_loss(pi_w, pi_l, len_w, len_l, beta, o.gamma), beta * pi_w / len_w, beta * pi_l / len_l
        if o.loss == "cpo":
            return cpo_loss(pi_w, pi_l, beta), beta * pi_w, beta * pi_l
        return orpo_loss(pi_w, pi_l, len_w, len_l, o.lam), log_odds(pi_w, len_w), log_odds(pi_l, len_l)
    u_w, u_l = pi_w - ref_w, pi_l - ref_l
    h = u_w - u_l
    loss = {"dpo": lambda: dpo_loss(h, beta, o.label_smoothing),
            "robust": lambda: robust_loss(h, beta, o.label_smoothing),
            "ipo": lambda: ipo_loss(u_w, u_l, len_w, len_l, beta),
            "hinge": lambda: hinge_loss(h, beta),
            "rdpo": lambda: rdpo_loss(h, len_w, len_l, beta, o.alpha)}[o.loss]()
    return loss, beta * u_w, beta * u_l


def nll_weight(o):
    """Total weight of NLL(y_w) in the loss: RPO's --nll_coef, plus CPO's α or ORPO's 1."""
    return o.nll_coef + (o.alpha if o.loss == "cpo" else 0.0) + (1.0 if o.loss == "orpo" else 0.0)


# ---- batches ------------------------------------------------------------------------------------

def collate_unpaired(examples, pad_id, with_mismatched=False):
    """KTO: [prompt + completion] rows (and, optionally, [prompt + mismatched completion] rows after
    them), right-padded -> ids, attention mask, response mask, labels (B,)."""
    keys = ("completion", "mismatched") if with_mismatched else ("completion",)
    seqs = [e["prompt"] + e[k] for k in keys for e in examples]
    resp = [[0] * len(e["prompt"]) + [1] * len(e[k]) for k in keys for e in examples]
    return (pad_right(seqs, pad_id), pad_right([[1] * len(s) for s in seqs], 0), pad_right(resp, 0),
            torch.tensor([e["label"] for e in examples]))


def add_mismatched(examples, seed):
    """KTO's mismatched pairs: example i gets the completion of a fixed other example (a seeded
    derangement: a random cycle through all examples), so x and y′ are unrelated."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    for a, b in zip(order, order[1:] + order[:1]):
        examples[a]["mismatched"] = examples[b]["completion"]


def to(dev, *ts):
    return [t.to(dev) for t in ts]


@torch.no_grad()
def precompute_reference(ref, examples, opts, tok, ctx):
    """Reference log-probs stored in each example (keyed by the example, not by batch position, so
    shuffling cannot misalign them: TRL#2337). Each rank computes a shard; an all-reduce shares them."""
    kto = opts.loss == "kto"
    keys = ("ref", "ref_kl") if kto else ("ref_chosen", "ref_rejected")
    vals = torch.zeros(len(examples), 2, dtype=torch.float64)
    idx = list(range(ctx.rank, len(examples), ctx.world_size))
    for i in range(0, len(idx), opts.batch_size):
        chunk = idx[i:i + opts.batch_size]
        batch = [examples[j] for j in chunk]
        if kto:
            ids, attn, resp, _ = collate_unpaired(batch, tok.pad_id, with_mismatched=True)
        else:
            ids, attn, resp, _ = collate_pairs(batch, tok.pad_id)
        with autocast(ctx.device, opts.dtype):
            s, _ = sequence_logps(ref, *to(ctx.device, ids, attn, resp))
        a, b = s.double().cpu().chunk(2)
        vals[chunk, 0], vals[chunk, 1] = a, b
    vals = dist.all_reduce_sum(vals)
    for e, (a, b) in zip(examples, vals.tolist()):
        e[keys[0]], e[keys[1]] = a, b


def step_losses(o, policy, ref, batch, tok, dev, n_items, n_chosen_tokens, world, sync=True):
    """The loss of one micro-batch, scaled so that summing over micro-batches and ranks (DDP averages)
    gives the mean over the step's items plus the weighted global token-mean NLL.
    Returns (loss, stats as sums over the micro-batch, number of tokens in the forward)."""
    if o.loss == "kto":
        ids, attn, resp, label = to(dev, *collate_unpaired(batch, tok.pad_id))
        with autocast(dev, o.dtype):
            pi, length = sequence_logps(policy, ids, attn, resp)
        kids, kattn, kresp, _ = to(dev, *collate_unpaired([dict(e, completion=e["mismatched"]) for e in batch], tok.pad_id))
        with torch.no_grad(), autocast(dev, o.dtype):
            pi_kl, _ = sequence_logps(policy, kids, kattn, kresp)
            if ref is not None:
                ref_lp, _ = sequence_logps(ref, ids, attn, resp)
                ref_kl, _ = sequence_logps(ref, kids, kattn, kresp)
            else:
                ref_lp = torch.tensor([e["ref"] for e in batch], device=dev)
                ref_kl = torch.tensor([e["ref_kl"] for e in batch], device=dev)
        z0 = kto_z0((pi_kl - ref_kl).sum(), len(batch), sync)
        u = pi - ref_lp
        loss = kto_loss(u, label, z0, o.beta, o.desirable_weight, o.undesirable_weight)
        total = loss.sum() * world / n_items
        stats = {"loss": loss.sum(), "kl": z0 * len(batch), "rewards_desirable": (o.beta * u * label).sum(),
                 "rewards_undesirable": (o.beta * u * ~label).sum(), "n_desirable": label.sum(),
                 "logps": pi.sum()}
        return total, stats, int(attn.sum() + kattn.sum())
    ids, attn, resp, _ = to(dev, *collate_pairs(batch, tok.pad_id))
    with autocast(dev, o.dtype):
        s, length = sequence_logps(policy, ids, attn, resp)               # (2B,): chosen rows, then rejected
    pi_w, pi_l = s.chunk(2)
    len_w, len_l = length.chunk(2)
    ref_w = ref_l = None
    if o.loss not in REFERENCE_FREE:
        if ref is not None:
            with torch.no_grad(), autocast(dev, o.dtype):
                ref_w, ref_l = sequence_logps(ref, ids, attn, resp)[0].chunk(2)
        else:
            ref_w = torch.tensor([e["ref_chosen"] for e in batch], device=dev)
            ref_l = torch.tensor([e["ref_rejected"] for e in batch], device=dev)
    loss, rw, rl = pair_loss(o, pi_w, pi_l, ref_w, ref_l, len_w, len_l)
    total = loss.sum() * world / n_items
    nll = -pi_w.sum()
    if nll_weight(o):
        total = total + nll_weight(o) * nll * world / max(n_chosen_tokens, 1)
    stats = {"loss": loss.sum(), "rewards_chosen": rw.sum(), "rewards_rejected": rl.sum(),
             "reward_accuracy": (rw > rl).float().sum(), "reward_margin": (rw - rl).sum(),
             "logps_chosen": pi_w.sum(), "logps_rejected": pi_l.sum(), "nll": nll}
    return total, stats, int(attn.sum())


# the stats step_losses returns, as sums over a micro-batch
PAIR_STATS = ("loss", "rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin", "logps_chosen",
              "logps_rejected", "nll")
KTO_STATS = ("loss", "kl", "rewards_desirable", "rewards_undesirable", "n_desirable", "logps")


def reduce_stats(stats_list, keys, n_items, n_chosen_tokens):
    """Sum the micro-batch stats over the step and ranks, then turn sums into means. An empty list (a
    rank whose eval shard is empty) contributes zeros, so that rank still joins the all-reduce."""
    local = torch.tensor([sum(float(s[k].detach()) for s in stats_list) for k in keys], dtype=torch.float64)
    tot = dict(zip(keys, dist.all_reduce_sum(local).tolist()))
    out = {k: v / max(n_items, 1) for k, v in tot.items() if k not in ("nll", "n_desirable", "rewards_desirable",
                                                                        "rewards_undesirable")}
    if "nll" in tot:
        out["nll"] = tot["nll"] / max(n_chosen_tokens, 1)
    if "n_desirable" in tot:
        nd = tot["n_desirable"]
        out["rewards_desirable"] = tot["rewards_desirable"] / max(nd, 1)
        out["rewards_undesirable"] = tot["rewards_undesirable"] / max(n_items - nd, 1)
    return out


def stat_keys(o):
    return KTO_STATS if o.loss == "kto" else PAIR_STATS


def chosen_tokens(batch, o):
    return sum(len(e["completion"] if o.loss == "kto" else e["chosen"]) for e in batch)


@torch.no_grad()
def evaluate(o, policy, ref, examples, tok, ctx):
    policy.eval()
    mine = dist.shard(examples)
    n_items = dist.all_reduce_sum(len(mine))
    n_tok = dist.all_reduce_sum(chosen_tokens(mine, o))
    # sync=False: ranks may hold different numbers of eval batches, so no collective inside the loop
    stats = [step_losses(o, policy, ref, mine[i:i + o.batch_size], tok, ctx.device, n_items, n_tok, 1, sync=False)[1]
             for i in range(0, len(mine), o.batch_size)]
    policy.train()
    return {f"eval/{k}": v for k, v in reduce_stats(stats, stat_keys(o), n_items, n_tok).items()}


def main(argv=None):
    o = parse_args(Options, argv, __doc__)
    if o.beta is None:
        o.beta = DEFAULT_BETA.get(o.loss, 0.1)
    if o.alpha is None:
        o.alpha = 1.0 if o.loss == "cpo" else 0.01
    o.out_dir = o.out_dir or f"out/{o.loss}"
    if not 0 <= o.label_smoothing < 0.5:
        fail(f"--label_smoothing must be in [0, 0.5), got {o.label_smoothing}")
    # flags a loss would silently ignore are errors, not no-ops
    if o.label_smoothing and o.loss not in ("dpo", "robust"):
        fail(f"--label_smoothing applies only to --loss dpo or robust, not {o.loss}")
    if o.nll_coef and o.loss == "kto":
        fail("--nll_coef is not supported with --loss kto (unpaired data has no chosen response)")
    ctx = dist.setup(o.device)
    if o.resume and find_state(o.out_dir) is None:
        fail(f"{o.out_dir}: --resume given but there is no saved state in it")
    kto = o.loss == "kto"
    kind, builtin = ("unpaired", "unpaired.jsonl") if kto else ("preference", "preference.jsonl")

    with input_errors():
        records = load_records(o.data or builtin_file(builtin), kind)
        if o.eval_data or not (o.data or kto):
            eval_records = load_records(o.eval_data or builtin_file("preference_eval.jsonl"), kind)
        else:
            records, eval_records = split_off(records, o.eval_fraction, o.seed)
        tok = load_tokenizer(o.tokenizer, o.init, o.eos_token, o.pad_token)
        policy = GPT.from_pretrained(o.init, dropout=o.dropout)
        check_vocab(tok, policy.cfg, o.init)
        ref = None
        if o.loss not in REFERENCE_FREE:   # frozen: no grad, eval mode, never in DDP or the optimizer
            ref = GPT.from_pretrained(o.ref or o.init, dropout=0.0).requires_grad_(False).eval()
        tokenize = tokenize_unpaired if kto else tokenize_pairs
        train, st = tokenize(records, tok, policy.cfg.block_size)
        evals, _ = tokenize(eval_records, tok, policy.cfg.block_size)
        if kto:
            if o.batch_size < 2:
                raise ValueError("--loss kto needs --batch_size >= 2")
            add_mismatched(train, o.seed)
            add_mismatched(evals, o.seed)
        batches = Batches(len(train), o.batch_size, o.grad_accum, ctx.rank, ctx.world_size, o.seed)
    policy.to(ctx.device)
    if ref is not None:
        ref.to(ctx.device)
        dist.check_same_weights(ref, "reference model")
    dist.check_same_weights(policy, "policy")
    dist.seed_everything(o.seed, ctx.rank)
    if ref is not None and o.precompute_ref:
        t0 = time.time()
        precompute_reference(ref, train, o, tok, ctx)
        precompute_reference(ref, evals, o, tok, ctx)
        ref = None                                          # frees the reference model's memory
        dist.print0(f"precomputed reference log-probs for {len(train) + len(evals):,} examples in {time.time() - t0:.1f}s")
    if o.compile:
        policy = torch.compile(policy)
    ddp = dist.wrap_ddp(policy)
    optimizer = adamw(policy, o.lr, o.weight_decay, (o.beta1, o.beta2))
    max_steps = o.max_steps or max(1, int(o.epochs * batches.steps_per_epoch))
    step = 0
    if o.resume:
        meta = load_state(o.out_dir, {"policy": policy}, {"policy": optimizer})
        step = meta["step"]
        batches.load_state_dict(meta["data"])
    if ctx.is_main:
        os.makedirs(o.out_dir, exist_ok=True)
        save_config(o, os.path.join(o.out_dir, "train_config.json"), world_size=ctx.world_size,
                    global_batch=batches.global_batch, max_steps=max_steps)
    dist.print0(f"{o.loss.upper()} | beta {o.beta} | {len(train):,} train {kind} rows ({st}) | {len(evals):,} eval "
                f"| global batch {batches.global_batch} | {max_steps} steps | reference: "
                f"{'none' if o.loss in REFERENCE_FREE else 'precomputed' if o.precompute_ref else 'live'}"
                + (f" | resuming at step {step}" if step else ""))
    log = Logger(o.out_dir, max_steps, resume=o.resume, start_step=step)
    shown = ["train/loss", "train/reward_accuracy", "train/reward_margin", "train/rewards_chosen", "train/kl",
             "eval/loss", "eval/reward_accuracy"]

    t_last, tokens_since = time.time(), 0
    while step < max_steps:
        lr = lr_at(step, max_steps, o.lr, o.warmup_steps, "linear")
        set_lr(optimizer, lr)
        micro = [[train[i] for i in mb] for mb in batches.next_step()]
        n_items = batches.global_batch
        n_tok = dist.all_reduce_sum(sum(chosen_tokens(mb, o) for mb in micro))
        stats = []
        for j, mb in enumerate(micro):
            last = j == len(micro) - 1
            with (ddp.no_sync() if ctx.enabled and not last else contextlib.nullcontext()):
                total, s, n = step_losses(o, ddp, ref, mb, tok, ctx.device, n_items, n_tok, ctx.world_size)
                total.backward()
            stats.append(s)
            tokens_since += n
        m = {f"train/{k}": v for k, v in reduce_stats(stats, stat_keys(o), n_items, n_tok).items()}
        check_finite(m["train/loss"], step, o.out_dir)
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), o.grad_clip or float("inf")).item()
        check_finite(grad_norm, step, o.out_dir, "gradient norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % o.log_interval == 0 or step == max_steps:
            dt = time.time() - t_last
            tps = dist.all_reduce_sum(tokens_since) / max(dt, 1e-9)
            m.update({"train/lr": lr, "train/grad_norm": grad_norm, "train/tokens_per_s": tps})
            if (o.eval_interval and step % o.eval_interval == 0) or step == max_steps:
                m.update(evaluate(o, policy, ref, evals, tok, ctx))
            log.log(step, m)
            log.progress(step, m, shown, tps)
            t_last, tokens_since = time.time(), 0
        elif o.eval_interval and step % o.eval_interval == 0:
            log.log(step, evaluate(o, policy, ref, evals, tok, ctx))
        if (o.save_interval and step % o.save_interval == 0) or step in (max_steps, o.stop_at):
            save_state(o.out_dir, {"policy": policy}, {"policy": optimizer}, {"step": step, "data": batches.state_dict()})
            save_model_dir(o.out_dir, policy, tok)
        if step == o.stop_at:
            dist.print0(f"stopping at step {step} (--stop_at); continue with --resume")
            break
    dist.check_same_weights(policy, "policy")
    dist.print0(f"saved {o.out_dir} (HF GPT2LMHeadModel layout)")
    dist.cleanup()
    return SimpleNamespace(policy=policy, ref=ref, optimizer=optimizer, options=o)


if __name__ == "__main__":
    main()
