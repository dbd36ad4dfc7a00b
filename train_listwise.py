"""Listwise preference optimisation: K scored responses per prompt, one loss over the whole ranking.
Imports sequence_logps (the log-prob gather) from train_dpo.py.

Data: JSONL rows {"prompt", "completions": [y_1 … y_K], "scores": [ψ_1 … ψ_K]}, higher ψ = better, ties allowed,
K may differ per row (nano_rlhf/data.py). Notation: S(y) = Σ_t log π(y_t | x, y_<t) over the response
(end-of-text included), p(y) = S(y)/|y| its length-normalised form, u(y) = S_θ(y) − S_ref(y).

  --loss rrhf   Σ_{ψ_i < ψ_j} max(0, p_i − p_j)   + w·NLL(y_best)             Yuan et al. 2023, eqs. 1–4
                (L_rank over every ordered pair; L_ft = NLL of the best-scored response; no reference)
  --loss pro    −Σ_{k=1}^{K−1} log [ exp(p_k/T_k^k) / Σ_{i=k}^{K} exp(p_i/T_k^i) ]   + w·NLL(y_best)
                responses sorted by score (y_1 best); T_k^i = 1/(ψ_k − ψ_i) for i > k, T_k^k = min_{i>k} T_k^i
                (PRO's dynamic temperature; L = L_PRO + β·L_SFT, β = w)    Song et al. 2023, §3
  --loss lipo   −Σ_{ψ_i > ψ_j} Δ_ij log σ(s_i − s_j),   s = β·u               Liu et al. 2024, the LiPO-λ objective
                Δ_ij = |G_i − G_j| · |1/D(τ_i) − 1/D(τ_j)|, gain G = 2^ψ − 1, discount D(τ) = log₂(1 + τ),
                τ_i = rank of y_i when the list is sorted by s (1 = highest); Δ is a constant (no gradient),
                as in LambdaLoss (Wang et al. 2018). For K = 2: (1 − 1/log₂3)·|G_1 − G_2| × DPO's loss.

The optimizer step minimises  mean over the step's prompts (all ranks) of the list loss  +  w·NLL(y_best), where
NLL(y_best) is the token-mean cross-entropy over the tokens of every prompt's best-scored response in the step
(w = --nll_coef; default 1 for rrhf and pro, 0 for lipo). Details and choices: docs/algorithms.md, "Listwise".

Ties: RRHF and LiPO sum only over pairs with ψ_i ≠ ψ_j. PRO sorts stably (tied responses keep their order in the
file); a response tied with y_k has T_k^i = ∞, so it stays in y_k's denominator as exp(0) = 1 and gets no
gradient from that term (the limit of the paper's formula). The best response is the first best-scored one.

Run:
    python train_listwise.py --loss rrhf                  # built-in task (data/listwise.jsonl), out/sft -> out/rrhf
    python train_listwise.py --loss lipo --beta 0.1 --data ranked.jsonl --out_dir out/my_lipo
    torchrun --nproc_per_node 2 train_listwise.py --loss pro
    torchrun --nproc_per_node 2 train_listwise.py --loss lipo --fsdp     # policy and reference sharded (FSDP2)
    python train_listwise.py --loss lipo --lora_r 16      # adapters; the reference is the policy with them off

Memory: a micro-batch of --batch_size prompts is one forward over all their completions (Σ K rows); log-probs
come from the chunked `token_logprobs`, so no (rows, T, vocab) tensor exists. A row → prompt map turns the
per-row values into a (prompts, K_max) grid with a validity mask, on which the losses work.

Simplifications: no precomputed reference (LiPO runs its reference live); PRO's and LiPO's scores are used as
given (no normalisation): rescale scores whose differences are far from 1, and LiPO needs ψ ≤ 1000 (2^ψ).
"""
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from nano_rlhf import dist, lora, parallel
from nano_rlhf import training
from nano_rlhf.checkpoint import save_model_dir
from nano_rlhf.cli import CompileOption, FrozenModelOptions, RunOptions, parse_args
from nano_rlhf.data import Batches, collate_listwise, default_data, load_records, split_off, tokenize_listwise
from nano_rlhf.model import GPT
from nano_rlhf.training import (autocast, check_device, check_vocab, derive_max_steps, fail, input_errors,
                                load_reference, lr_at, set_lr)


MAX_LIPO_SCORE = 30.0     # gains 2^ψ above ~2^30 overflow float32 gradient norms (Δ is cast to float32)


@dataclass
class Options(CompileOption, FrozenModelOptions, RunOptions):
    loss: Literal["rrhf", "pro", "lipo"] = "rrhf"  # which listwise loss
    beta: Optional[float] = None  # β of the implicit reward s = β·log π/π_ref (none = 0.1) [with loss=lipo] {> 0}
    nll_coef: Optional[float] = None  # weight of NLL(best response); none = 1 for rrhf/pro, 0 for lipo {>= 0}
    data: str = ""                # listwise JSONL; empty = built-in task
    eval_data: str = ""           # held-out JSONL of the same kind; empty = split --eval_fraction off --data
    eval_fraction: float = 0.05   # share of --data held out when no --eval_data is given {0 < x < 1}
    init: str = "out/sft"         # policy to start from (an SFT model directory)
    ref: str = ""                 # reference model directory; empty = --init [with loss=lipo]
    out_dir: str = ""             # output directory; empty = out/<loss>
    dropout: float = 0.0          # dropout of the policy (0: log-probs must be reproducible) {0 <= x < 1}
    batch_size: int = 4           # prompts (each with all its completions) per device per micro-step {>= 1}
    grad_accum: int = 1           # micro-steps per optimizer step {>= 1}
    max_steps: int = 0            # optimizer steps; 0 = as many as --epochs needs {>= 0}
    epochs: float = 1.0           # passes over the data when --max_steps is 0 {> 0}
    lr: float = 1e-4              # peak learning rate (built-in task); real models: as for DPO (5e-7 .. 1e-6)
                                  # {0 < x <= 1e3}
    warmup_steps: int = 10        # linear warm-up steps {>= 0}
    weight_decay: float = 0.0     # AdamW decoupled weight decay (matrices only) {>= 0}
    beta1: float = 0.9            # AdamW beta1 {0 <= x < 1}
    beta2: float = 0.95           # AdamW beta2 {0 <= x < 1}
    grad_clip: float = 1.0        # clip the global gradient norm to this (0 = off) {>= 0}
    seed: int = 0                 # seed for data order


def fill_defaults(opts):
    """The defaults that depend on --loss, filled in right after parsing (run.json records the filled values)."""
    opts.beta = 0.1 if opts.beta is None else opts.beta
    opts.nll_coef = (0.0 if opts.loss == "lipo" else 1.0) if opts.nll_coef is None else opts.nll_coef
    opts.out_dir = opts.out_dir or f"out/{opts.loss}"


# ---- the losses: pure functions of (prompts, K) grids, per prompt (P,) ---------------------------------
# p / s: the model's value of each completion; score: ψ; mask: which grid cells hold a completion (rows of
# different K are padded; padded cells must hold finite values, e.g. 0).

def rrhf_rank_loss(p, score, mask):
    """RRHF's L_rank = Σ_{ψ_i < ψ_j} max(0, p_i − p_j) (Yuan et al. 2023, eq. 2): every response scored lower
    must not be more likely (per token) than a higher-scored one. Tied pairs are not in the sum."""
    worse = mask[:, :, None] & mask[:, None, :] & (score[:, :, None] < score[:, None, :])   # [i, j]: ψ_i < ψ_j
    return torch.where(worse, F.relu(p[:, :, None] - p[:, None, :]), 0.0).sum((1, 2))


def pro_loss(p, score, mask):
    """PRO's L_PRO (Song et al. 2023, §3): for each position k of the ranking, the Plackett–Luce
    log-likelihood that y_k beats every lower-ranked y_i, with logits p_i/T_k^i, 1/T_k^i = ψ_k − ψ_i and
    1/T_k^k = max_{i>k}(ψ_k − ψ_i). For K = 2 it is −log σ((ψ_1 − ψ_2)(p_1 − p_2))."""
    key = score.masked_fill(~mask, float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices      # best first; padding last
    p, score, mask = p.gather(1, order), score.gather(1, order), mask.gather(1, order)
    K = p.shape[1]
    later = torch.ones(K, K, dtype=torch.bool, device=p.device).triu(1)       # [k, i]: i ranked below k
    below = mask[:, :, None] & mask[:, None, :] & later
    inv_t = torch.where(below, score[:, :, None] - score[:, None, :], 0.0)    # 1/T_k^i = ψ_k − ψ_i ≥ 0
    diag = p * inv_t.amax(2)                                                  # p_k / T_k^k
    logits = torch.where(below, p[:, None, :] * inv_t, float("-inf"))
    logits = torch.where(torch.eye(K, dtype=torch.bool, device=p.device), diag[:, :, None], logits)
    term = torch.logsumexp(logits, 2) - diag                                  # −log softmax of y_k
    return torch.where(below.any(2), term, 0.0).sum(1)                        # the last position has no term


@torch.no_grad()
def lambda_weights(s, score, mask):
    """LiPO-λ's Δ_ij = |G_i − G_j| · |1/D(τ_i) − 1/D(τ_j)| (Liu et al. 2024, LiPO-λ; LambdaLoss): gain G = 2^ψ − 1,
    discount D(τ) = log₂(1 + τ), τ = the rank (1 = top) of each response in the order its current s
    induces (ties in s: stable sort). Computed in float64 (2^ψ), no gradient."""
    key = s.detach().double().masked_fill(~mask, float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    K = s.shape[1]
    ranks = torch.arange(1, K + 1, dtype=torch.float64, device=s.device).expand_as(key)
    tau = torch.empty_like(key).scatter_(1, order, ranks)
    gain = torch.exp2(score.double()) - 1
    disc = 1 / torch.log2(1 + tau)
    delta = (gain[:, :, None] - gain[:, None, :]).abs() * (disc[:, :, None] - disc[:, None, :]).abs()
    return delta.to(s.dtype)


def lipo_lambda_loss(s, score, mask):
    """LiPO-λ: −Σ_{ψ_i > ψ_j} Δ_ij log σ(s_i − s_j) with s = β·log π/π_ref (Liu et al. 2024, LiPO-λ)."""
    better = mask[:, :, None] & mask[:, None, :] & (score[:, :, None] > score[:, None, :])  # [i, j]: ψ_i > ψ_j
    nll = -F.logsigmoid(s[:, :, None] - s[:, None, :])
    return torch.where(better, lambda_weights(s, score, mask) * nll, 0.0).sum((1, 2))


def to_grid(values, group, n_groups):
    """Per-row values (R,), rows grouped prompt-major (group = prompt index, non-decreasing) -> a (P, K_max)
    grid (0 in empty cells, differentiable) and its validity mask."""
    counts = torch.bincount(group, minlength=n_groups)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(len(group), device=group.device) - starts[group]
    shape = (n_groups, int(counts.max()))
    grid = torch.zeros(shape, dtype=values.dtype, device=values.device).index_put((group, slot), values)
    filled = torch.ones_like(group, dtype=torch.bool)
    mask = torch.zeros(shape, dtype=torch.bool, device=values.device).index_put((group, slot), filled)
    return grid, mask


def list_loss(opts, pi, length, ref_lp, group, scores, n_groups):
    """The --loss table: per-prompt loss (P,), and the (P, K) grid of the value each loss ranks by
    (p for rrhf/pro, s = β·u for lipo), with the score grid and mask, for the log."""
    score, mask = to_grid(scores.to(pi.dtype), group, n_groups)
    if opts.loss == "lipo":
        s, _ = to_grid(opts.beta * (pi - ref_lp), group, n_groups)
        return lipo_lambda_loss(s, score, mask), s, score, mask
    p, _ = to_grid(pi / length.clamp(min=1), group, n_groups)
    loss = rrhf_rank_loss(p, score, mask) if opts.loss == "rrhf" else pro_loss(p, score, mask)
    return loss, p, score, mask


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


# ---- batches ------------------------------------------------------------------------------------

@dataclass
class Batch:
    """One micro-batch on the device: a row per completion, prompt-major."""
    ids: torch.Tensor       # (R, T) right-padded
    attn: torch.Tensor      # (R, T) attention mask
    resp: torch.Tensor      # (R, T) response mask
    group: torch.Tensor     # (R,) prompt index of each row
    scores: torch.Tensor    # (R,) ψ, float64
    best: torch.Tensor      # (R,) bool: the row is its prompt's (first) best-scored completion
    n_items: int            # prompts
    n_best_tokens: int      # tokens of the best completions: the NLL's denominator


def make_batch(examples, pad_id, device):
    ids, attn, resp, group, scores = collate_listwise(examples, pad_id)
    best, n_best_tokens = [], 0
    for e in examples:
        top = e["scores"].index(max(e["scores"]))
        best += [k == top for k in range(len(e["scores"]))]
        n_best_tokens += len(e["completions"][top])
    return Batch(ids.to(device), attn.to(device), resp.to(device), group.to(device), scores.to(device),
                 torch.tensor(best, device=device), len(examples), n_best_tokens)


STATS = ("loss", "nll", "pair_accuracy", "n_pairs", "top1_accuracy", "n_ranked", "value_best", "value_mean")
COUNTS = ("items", "best_tokens", "rows", "tokens")


def micro_step(opts, policy, ref, batch):
    """Named sums over one micro-batch. 'loss' (Σ of per-prompt losses) and 'nll' (Σ of −log π over the best
    completions' tokens) keep their graph for the backward; the others are for the log."""
    with autocast(batch.ids.device, opts.dtype):
        pi, length = sequence_logps(policy, batch.ids, batch.attn, batch.resp)
    ref_lp = None
    if ref is not None:
        with torch.no_grad(), autocast(batch.ids.device, opts.dtype):
            ref_lp, _ = sequence_logps(ref, batch.ids, batch.attn, batch.resp)
    loss, value, score, mask = list_loss(opts, pi, length, ref_lp, batch.group, batch.scores, batch.n_items)
    with torch.no_grad():
        v = value.detach()
        better = mask[:, :, None] & mask[:, None, :] & (score[:, :, None] > score[:, None, :])
        # top-1: some best-scored response is strictly above every other one (a tie in the model's value
        # is a miss, so a policy equal to its reference does not score 100%). Only lists with a strict order
        # count: in a list whose scores all tie every response is "best", and it would score 1 for free.
        ranked = better.any(2).any(1)
        is_best = mask & (score == score.masked_fill(~mask, float("-inf")).amax(1, keepdim=True))
        top_best = v.masked_fill(~is_best, float("-inf")).amax(1)
        top_other = v.masked_fill(~(mask & ~is_best), float("-inf")).amax(1)
        stats = {"pair_accuracy": (better & (v[:, :, None] > v[:, None, :])).sum(), "n_pairs": better.sum(),
                 "top1_accuracy": (ranked & (top_best > top_other)).sum(), "n_ranked": ranked.sum(),
                 "value_best": v.flatten()[mask.flatten()][batch.best].sum(), "value_mean": (v * mask).sum()}
    return {"loss": loss.sum(), "nll": -pi[batch.best].sum(), **stats}


def zero_sums():
    return dict.fromkeys(STATS + COUNTS, 0.0)


def add_to(sums, stats, batch):
    for k, v in stats.items():
        sums[k] += float(v.detach())
    sums["items"] += batch.n_items
    sums["best_tokens"] += batch.n_best_tokens
    sums["rows"] += len(batch.ids)
    sums["tokens"] += int(batch.attn.sum())


def means(totals):
    """Sums over a step (or the eval set) on all ranks -> what is logged: loss per prompt, top-1 per prompt
    whose scores do not all tie, pair accuracy per scored pair, NLL per best-response token, the ranked value
    (p or s) of best and all rows."""
    items = max(totals["items"], 1)
    return {"loss": totals["loss"] / items, "nll": totals["nll"] / max(totals["best_tokens"], 1),
            "pair_accuracy": totals["pair_accuracy"] / max(totals["n_pairs"], 1),
            "top1_accuracy": totals["top1_accuracy"] / max(totals["n_ranked"], 1),
            "value_best": totals["value_best"] / items,
            "value_mean": totals["value_mean"] / max(totals["rows"], 1)}


@torch.no_grad()
def evaluate(opts, policy, ref, examples, pad_id, device):
    """Means over the whole eval set, on all ranks (an empty shard adds zeros)."""
    policy.eval()
    mine = dist.rank_share(examples)
    sums = zero_sums()
    for i in range(0, len(mine), opts.batch_size):
        batch = make_batch(mine[i:i + opts.batch_size], pad_id, device)
        add_to(sums, micro_step(opts, policy, ref, batch), batch)
    policy.train()
    return {f"eval/{k}": v for k, v in means(dist.all_reduce_sums(sums)).items()}


# ---- set-up -------------------------------------------------------------------------------------

def evaluate_gathered(opts, policy, ref, examples, pad_id, device):
    """evaluate() on gathered weights under FSDP: ranks may hold different numbers of eval batches, so the
    forwards must not all-gather."""
    with parallel.gathered(policy, ref):
        return evaluate(opts, policy, ref, examples, pad_id, device)


def check_options(opts):
    """--device one this machine has, then the rules between options (ranges are checked by parse_args). A flag the
    loss would silently ignore is an error."""
    check_device(opts.device)
    if opts.fsdp and opts.compile:
        fail("--compile with --fsdp is not supported; drop one of them", 2)
    if opts.offload_frozen and opts.loss != "lipo":
        fail(f"--offload_frozen: this run holds no reference model (--loss {opts.loss} uses none)", 2)
    msg = lora.check_lora_options(opts)
    if msg:
        fail(msg, 2)


def data_files(opts):
    """Train and eval JSONL (the built-in task's when not given); eval None = split --eval_fraction off --data."""
    if opts.data:
        return {"data": opts.data, "eval_data": opts.eval_data or None}
    return {"data": default_data("listwise"), "eval_data": opts.eval_data or default_data("listwise", "eval")}


def load_models(opts, tok):
    """Policy and (lipo only) the frozen reference; none when LoRA's adapters-off policy is the reference
    (main makes it). Raises on bad input (one line via input_errors)."""
    policy = GPT.from_pretrained(opts.init, dropout=opts.dropout)
    check_vocab(tok, policy.cfg, opts.init)
    ref = None
    if opts.loss == "lipo" and not lora.shares_base(opts, opts.ref):
        ref = load_reference(opts.ref or opts.init, tok, policy.cfg.block_size,
                             f"policy's {policy.cfg.block_size}")
    return policy, ref


def load_examples(opts, files, tok, block_size):
    """Tokenized train and eval examples and the train counts."""
    records = load_records(files["data"], "listwise")
    if files["eval_data"]:
        eval_source, eval_records = files["eval_data"], load_records(files["eval_data"], "listwise")
    else:
        records, eval_records = split_off(records, opts.eval_fraction, opts.seed)
        eval_source = f"{files['data']} (the --eval_fraction {opts.eval_fraction} held out)"
        if not records:
            raise ValueError(f"--eval_fraction {opts.eval_fraction} holds out every row of {files['data']} "
                             f"({len(eval_records)}): none is left to train on; pass --eval_data")
    if opts.loss == "lipo":
        for r in records + eval_records:
            if max(r["scores"]) > MAX_LIPO_SCORE:
                raise ValueError(f"{r['_where']}: score {max(r['scores'])} is too large for LiPO's gain 2^ψ "
                                 f"(at most {MAX_LIPO_SCORE:g}); rescale the scores")
    train, counts = tokenize_listwise(records, tok, block_size)
    evals, eval_counts = tokenize_listwise(eval_records, tok, block_size)
    for examples, source, c in ((train, files["data"], counts), (evals, eval_source, eval_counts)):
        if not examples:
            raise ValueError(f"{source}: no example fits the model's block_size {block_size} ({c})")
        # as train_dpo.py --listwise_pairs: lists whose scores all tie carry no preference (every loss is 0,
        # with no gradient), so a file of nothing else would train on nothing
        if all(len(set(e["scores"])) < 2 for e in examples):
            raise ValueError(f"{source}: no listwise row has two different scores, so there is no order to "
                             f"train or evaluate on")
    return train, evals, counts


def run_record(opts, files):
    """The inputs the run only reads and its data files (its options are its identity: nano_rlhf/training.py)."""
    return dict(inputs={"init": opts.init, "ref": opts.ref}, data_files=files)


# ---- training -----------------------------------------------------------------------------------

SHOW = ["train/loss", "train/pair_accuracy", "train/top1_accuracy", "train/nll", "eval/loss",
        "eval/pair_accuracy"]                  # the progress line's metrics, in order
LOSS_KEYS = ["train/loss", "train/grad_norm"]  # a NaN/inf in either stops the run (the checkpoint intact)


def main(argv=None):
    opts = parse_args(Options, argv, __doc__)      # each option's range and [with ...] refused here
    fill_defaults(opts)                            # the defaults that depend on other options
    check_options(opts)                            # --device and the rules between options; only refuses
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    files = data_files(opts)
    run = training.open_run(opts, "listwise", **run_record(opts, files), show=SHOW, loss_keys=LOSS_KEYS)
    with input_errors():
        tok = training.tokenizer(opts, run)
        policy, ref = load_models(opts, tok)
        run.identity.update(lora.attach(policy, opts, opts.init))      # --lora_r: adapters, the base frozen
        if ref is None and opts.loss == "lipo":                         # LoRA, reference = --init: the policy
            ref = lora.BaseView(policy)                                  # with its adapters off, no second copy
        train, evals, counts = load_examples(opts, files, tok, policy.cfg.block_size)
        batches = Batches(len(train), opts.batch_size, opts.grad_accum, world.rank, world.world_size, opts.seed)
    training.place(opts, world, {"policy": policy}, {"reference model": ref})
    ref = training.frozen(opts, ref)
    ddp, optimizer = training.prepare(opts, policy, opts.lr)
    training.plan(opts, {"policy": policy, "ref": ref})
    max_steps = derive_max_steps(opts, batches.steps_per_epoch)
    run.set_max_steps(max_steps)
    run.resume({"policy": policy}, {"policy": optimizer}, data={"data": batches},
              global_batch=batches.global_batch, max_steps=max_steps)
    n_rows = sum(len(e["completions"]) for e in train)
    dist.print0(f"{opts.loss.upper()}{lora.describe(policy)} | "
                + (f"beta {opts.beta} | " if opts.loss == "lipo" else "")
                + f"nll_coef {opts.nll_coef} | {len(train):,} train prompts, {n_rows:,} completions ({counts}) | "
                f"{len(evals):,} eval | global batch {batches.global_batch} prompts | {max_steps} steps"
                + (f" | resuming at step {run.step}" if run.step else ""))

    def save(step):
        run.save(step, {"policy": policy}, {"policy": optimizer}, data={"data": batches})
        save_model_dir(opts.out_dir, policy, tok)

    for step in range(run.step + 1, max_steps + 1):
        t0 = time.time()
        lr = lr_at(step - 1, max_steps, opts.lr, opts.warmup_steps, "linear")
        set_lr(optimizer, lr)
        micro = [make_batch([train[i] for i in idx], tok.pad_id, world.device) for idx in batches.next_step()]
        # the step's denominators over all ranks, before any backward: prompts, and best-response tokens
        n_items = batches.global_batch
        n_best = max(dist.all_reduce_sum(float(sum(b.n_best_tokens for b in micro))), 1)
        sums = zero_sums()
        for j, batch in enumerate(micro):
            parallel.sync_gradients(ddp, j == len(micro) - 1)       # gradients all-reduced once, on the last one
            stats = micro_step(opts, ddp, ref, batch)
            objective = stats["loss"] / n_items                         # mean over the step's prompts ...
            if opts.nll_coef:                                            # ... + w · token-mean NLL(best)
                objective = objective + opts.nll_coef * stats["nll"] / n_best
            (objective * dist.ddp_scale()).backward()                    # DDP averages over ranks: undo it
            add_to(sums, stats, batch)
        totals = dist.all_reduce_sums(sums)
        grad_norm = parallel.clip_grad_norm(policy.parameters(), opts.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        metrics = {**{f"train/{k}": v for k, v in means(totals).items()}, "train/lr": lr, "train/grad_norm": grad_norm,
                   "train/tokens_per_s": totals["tokens"] / max(time.time() - t0, 1e-9)}
        if run.end_of_step(step, metrics, evaluate=lambda: evaluate_gathered(opts, policy, ref, evals, tok.pad_id,
                                                                             world.device), save=save):
            break
    run.finish({"policy": policy}, {"reference": ref},
              saved=f"saved {opts.out_dir} (HF {dist.unwrap(policy).architecture} layout)")
    return SimpleNamespace(policy=policy, ref=ref, optimizer=optimizer, options=opts)


if __name__ == "__main__":
    main()
