"""Learning from single responses, not pairs: negatives only (NPO, D2O), or a scalar reward with a value (DRO).

Notation: S(y) = Σ_t log π(y_t | x, y_<t) over the response (end-of-text included), u(y) = S_θ(y) − S_ref(y) the
log-ratio to the frozen reference, σ the logistic, y⁻ an undesirable response (a row with "label": false).

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
    python train_unpaired.py --method npo                  # built-in task: the undesirable half of unpaired.jsonl
    python train_unpaired.py --method npo --retain_coef 1  # ... and its desirable half as retain data
    python train_unpaired.py --method d2o --num_samples 4  # samples 4 responses per prompt first -> out/d2o
    python train_unpaired.py --method dro                  # built-in scored.jsonl (gold reward + noise) -> out/dro
    python train_unpaired.py --method dro --data kto.jsonl # a label file works too: true/false = +1/−1
    torchrun --nproc_per_node 2 train_unpaired.py --method dro
    torchrun --nproc_per_node 2 train_unpaired.py --method dro --fsdp      # policy, value and reference sharded
    python train_unpaired.py --method npo --lora_r 16      # adapters; the reference is the policy with them off

Data: npo and d2o read unpaired rows {"prompt", "completion", "label"}; dro reads scored rows {"prompt",
"completion", "score"} (or "label"). Conversational rows are rendered with the model's chat template.
Outputs: the policy in out_dir (HF layout); dro also saves its value model to out_dir/value (a
*ForSequenceClassification directory).
"""
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from nano_rlhf import dist, lora, parallel
from nano_rlhf import run as run_mod
from nano_rlhf.builtin import default_data
from nano_rlhf.checkpoint import atomic_write_text, save_state
from nano_rlhf.lora import save_model_dir     # checkpoint's; under --lora_r the merged model + out_dir/adapter
from nano_rlhf.common import (adamw, autocast, check_vocab, fail, input_errors,
                              load_reference, load_tokenizer, lr_at, set_lr, split_off)
from nano_rlhf.config import parse_args, save_config, to_dict
from nano_rlhf.data import (Batches, DataError, collate_prompts, load_records, load_scored, pad_right,
                            tokenize_scored, tokenize_unpaired)
from nano_rlhf.model import GPT, ScoreModel, token_logprobs, upcast
from nano_rlhf.options import FrozenModelOptions, RunOptions

SAMPLES_FILE = "d2o_samples.jsonl"


@dataclass
class Options(FrozenModelOptions, RunOptions):
    method: Literal["npo", "d2o", "dro"] = "npo"   # which loss
    beta: float = 0.1             # npo, d2o: β {> 0}
    alpha: Optional[float] = None # d2o: weight α of the negative's log-ratio; none = β {>= 0}
    retain_coef: float = 0.0      # npo: weight of the NLL on label-true rows (retain data); 0 = they are an error {>= 0}
    retain_warn: float = 3.0      # npo: warn once if the retain NLL exceeds this × its first step's; 0 = off {>= 0}
    num_samples: int = 4          # d2o: K responses sampled from the reference per prompt {>= 1}
    max_new_tokens: int = 32      # d2o: longest sampled response {>= 1}
    temperature: float = 1.0      # d2o: sampling temperature of the K responses {> 0}
    tau: float = 0.1              # dro: τ, the KL-regularisation strength {> 0}
    value_lr: float = 1e-4        # dro: peak learning rate of the value model {> 0}
    data: str = ""                # unpaired JSONL (npo, d2o) or scored JSONL (dro); empty = built-in task
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
    lr: Optional[float] = None    # peak learning rate of the policy; none = 1e-5 for npo (the paper's), 1e-4 else {> 0}
    warmup_steps: int = 10        # linear warm-up steps {>= 0}
    weight_decay: float = 0.0     # AdamW decoupled weight decay (matrices only) {>= 0}
    beta1: float = 0.9            # AdamW beta1 {0 <= x < 1}
    beta2: float = 0.95           # AdamW beta2 {0 <= x < 1}
    grad_clip: float = 1.0        # clip each network's global gradient norm to this (0 = off) {>= 0}
    seed: int = 0                 # seed for data order and D2O's samples
    resume: bool = False          # continue from out_dir/state (D2O: with the saved samples)


# ---- the losses: per example, (B,) --------------------------------------------------------------

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


# ---- log-probs and values ----------------------------------------------------------------------

def sequence_logps(model, input_ids, attention_mask, response_mask):
    """S = Σ_t log π(y_t | x, y_<t) per row (B,): the hidden state at t scores token t+1 when it is a response
    token; only those positions' logits are made (token_logprobs, in chunks)."""
    scored = response_mask[:, 1:].bool()
    hidden = model(input_ids, attention_mask, select=F.pad(scored, (0, 1)), return_hidden=True)
    logp = token_logprobs(hidden, dist.unwrap(model).output_weight(), input_ids[:, 1:][scored])
    rows = torch.arange(len(scored), device=scored.device)[:, None].expand_as(scored)[scored]
    return torch.zeros(len(scored), device=logp.device, dtype=logp.dtype).index_add(0, rows, logp)


def log_ratios(opts, policy, ref, rows):
    """u = S_θ − S_ref of each row (B,), with the policy's graph; S_θ too (the retain NLL)."""
    with autocast(rows.ids.device, opts.dtype):
        s = sequence_logps(policy, rows.ids, rows.attn, rows.resp)
        with torch.no_grad():
            s_ref = sequence_logps(ref, rows.ids, rows.attn, rows.resp)
    return s - s_ref, s


# ---- batches ------------------------------------------------------------------------------------

@dataclass
class Rows:
    ids: torch.Tensor     # (R, T) right-padded prompt + response
    attn: torch.Tensor    # (R, T)
    resp: torch.Tensor    # (R, T) response mask


def make_rows(pairs, pad_id, device):
    """[(prompt ids, response ids)] -> Rows on the device."""
    seqs = [p + r for p, r in pairs]
    return Rows(pad_right(seqs, pad_id).to(device), pad_right([[1] * len(s) for s in seqs], 0).to(device),
                pad_right([[0] * len(p) + [1] * len(r) for p, r in pairs], 0).to(device))


@dataclass
class Batch:
    rows: Rows                              # npo, dro: B rows; d2o: B negatives then B·K samples (example-major)
    n_items: int
    tokens: int
    label: Optional[torch.Tensor] = None    # npo: desirable (retain) rows (B,)
    score: Optional[torch.Tensor] = None    # dro: r (B,)
    prompts: Optional[tuple] = None         # dro: the prompts alone, right-padded (ids, attn), for V(x)


def make_batch(examples, opts, pad_id, device, samples=None):
    if opts.method == "d2o":
        pairs = [(e["prompt"], e["completion"]) for e in examples]
        pairs += [(e["prompt"], y) for e in examples for y in samples[tuple(e["prompt"])]]
        rows = make_rows(pairs, pad_id, device)
        return Batch(rows, len(examples), int(rows.attn.sum()))
    rows = make_rows([(e["prompt"], e["completion"]) for e in examples], pad_id, device)
    b = Batch(rows, len(examples), int(rows.attn.sum()))
    if opts.method == "npo":
        b.label = torch.tensor([e["label"] for e in examples], device=device)
    else:
        b.score = torch.tensor([e["score"] for e in examples], device=device)
        b.prompts = (pad_right([e["prompt"] for e in examples], pad_id).to(device),
                     pad_right([[1] * len(e["prompt"]) for e in examples], 0).to(device))
        b.tokens += int(b.prompts[1].sum())
    return b


# ---- one micro-batch: named sums ------------------------------------------------------------------

STATS = {"npo": ("loss", "nll", "n_negative", "retain_tokens", "rewards_negative", "logps_negative"),
         "d2o": ("loss", "rewards_negative", "rewards_samples", "margin", "accuracy", "logps_negative"),
         "dro": ("loss", "value", "reward", "advantage", "residual", "log_ratio", "logps")}
COUNTS = ("items", "tokens")


def micro_step(opts, policy, ref, batch, value=None):
    """Named sums over one micro-batch: 'loss' (and npo's 'nll') keep their graph, the rest is for the log."""
    u, s = log_ratios(opts, policy, ref, batch.rows)
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


def sum_over_ranks(sums):
    return dict(zip(sums, dist.all_reduce_sum(torch.tensor(list(sums.values()), dtype=torch.float64)).tolist()))


def means(opts, totals):
    """Per-example means; NPO's loss and rewards per negative, its NLL per retain token."""
    n = max(totals["items"], 1)
    if opts.method == "npo":
        n_neg = max(totals["n_negative"], 1)
        out = {"loss": totals["loss"] / n_neg, "rewards_negative": totals["rewards_negative"] / n_neg,
               "logps_negative": totals["logps_negative"] / n_neg}
        if opts.retain_coef:
            out["nll"] = totals["nll"] / max(totals["retain_tokens"], 1)
        return out
    return {k: v / n for k, v in totals.items() if k not in COUNTS}


@torch.no_grad()
def evaluate(opts, policy, ref, value, examples, pad_id, device, samples):
    policy.eval()
    mine = dist.shard(examples)
    sums = zero_sums(opts)
    for i in range(0, len(mine), opts.batch_size):
        batch = make_batch(mine[i:i + opts.batch_size], opts, pad_id, device, samples)
        add_to(sums, micro_step(opts, policy, ref, batch, value), batch)
    policy.train()
    return {f"eval/{k}": v for k, v in means(opts, sum_over_ranks(sums)).items()}


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
        for i in range(0, len(prompts), 32):
            chunk = prompts[i:i + 32]
            ids, attn = collate_prompts([list(p) for p in chunk for _ in range(K)], tok.pad_id)
            n_new = min(opts.max_new_tokens, block - ids.shape[1])
            if n_new < 1:
                raise ValueError(f"--method d2o: a prompt of {ids.shape[1]} tokens leaves no room to sample a "
                                 f"response in the model's block_size {block}")
            seq = ref.generate(ids.to(device), attn.to(device), n_new, opts.temperature, eos_token_id=tok.stop_ids,
                               pad_token_id=tok.pad_id, generator=gen)[:, ids.shape[1]:].tolist()
            for j, p in enumerate(chunk):
                responses = []
                for row in seq[j * K:(j + 1) * K]:
                    end = next((t for t, x in enumerate(row) if x in tok.stop_ids), len(row) - 1)
                    responses.append(row[:end + 1])
                out[p] = responses
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
    """Rules between options; a flag the method would silently ignore is an error."""
    if opts.frozen != "shard" and not opts.fsdp:
        fail(f"--frozen {opts.frozen} applies only with --fsdp", 2)
    msg = lora.check_options(opts)
    if msg:
        fail(msg, 2)
    m = opts.method
    defaults = Options()
    own = {"retain_coef": "npo", "retain_warn": "npo", "num_samples": "d2o", "max_new_tokens": "d2o",
           "temperature": "d2o", "tau": "dro", "value_lr": "dro"}
    for name, method in own.items():
        if m != method and getattr(opts, name) != getattr(defaults, name):
            fail(f"--{name} applies only to --method {method}, not {m}")
    if opts.alpha is not None and m != "d2o":
        fail(f"--alpha applies only to --method d2o, not {m}")
    if m == "dro" and opts.beta != defaults.beta:
        fail("--beta does not apply to --method dro (its KL strength is --tau)")
    opts.alpha = opts.beta if opts.alpha is None else opts.alpha
    # NPO: 1e-5, the paper's (its code's config/forget.yaml): at 1e-4 its forget term, a SUMMED sequence log-prob,
    # wrecked the retain NLL of the built-in task's policy (0.90 -> 4.3 in 50 steps; docs/algorithms.md, NPO)
    opts.lr = opts.lr if opts.lr is not None else (1e-5 if m == "npo" else 1e-4)
    opts.out_dir = opts.out_dir or f"out/{m}"


def data_files(opts):
    """Train and eval files: the built-in task's unpaired.jsonl (npo, d2o) or scored.jsonl (dro) when none
    is given; eval None = split --eval_fraction off the train file."""
    if opts.data:
        return {"data": opts.data, "eval_data": opts.eval_data or None}
    path = default_data("scored" if opts.method == "dro" else "unpaired")   # (an old data/ gets scored.jsonl)
    return {"data": path, "eval_data": opts.eval_data or None}


def read_records(opts, path, builtin=False):
    """Validated records. npo/d2o: a desirable row (label true) is an error (FILE:LINE) unless npo's
    --retain_coef asks for it; in the built-in file (both labels, by design) those rows are left out instead."""
    if opts.method == "dro":
        return load_scored(path)
    records = load_records(path, "unpaired")
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


def tokenize_examples(opts, files, records, eval_records, eval_source, tok, block_size):
    tokenize = tokenize_scored if opts.method == "dro" else tokenize_unpaired
    train, counts = tokenize(records, tok, block_size)
    evals, eval_counts = tokenize(eval_records, tok, block_size)
    for examples, source, c in ((train, files["data"], counts), (evals, eval_source, eval_counts)):
        if not examples:
            raise ValueError(f"{source}: no example fits the model's block_size {block_size} ({c})")
    return train, evals, counts


def load_models(opts):
    """Tokenizer, policy, the frozen reference (none when LoRA's adapters-off policy is the reference: main makes
    it) and DRO's value model. Raises on bad input (one line via input_errors)."""
    tok = load_tokenizer(opts.tokenizer, opts.init, opts.eos_token, opts.pad_token, opts.chat_template,
                         opts.date_string)
    policy = GPT.from_pretrained(opts.init, dropout=opts.dropout)
    check_vocab(tok, policy.cfg, opts.init)
    ref = None
    if not lora.shares_base(opts, opts.ref):
        ref = load_reference(opts.ref or opts.init, tok, policy.cfg.block_size,
                             f"policy's {policy.cfg.block_size}")
    value = None
    if opts.method == "dro":
        value = ScoreModel.from_pretrained(opts.init, new_head=True, dropout=0.0)
        torch.nn.init.zeros_(value.score.weight)        # V(x) = 0 at the start: the first steps see the raw r
    return tok, policy, ref, value


# how the run is placed and sharded does not change the math; lora.attach records the --lora_* fields, with the
# base's checksum, when LoRA is on
NOT_IDENTITY = ("data", "eval_data", "tokenizer", "eos_token", "pad_token", "out_dir", "device", "grad_checkpoint",
                "fsdp", "frozen", "offload_frozen", "lora_r", "lora_alpha", "lora_dropout", "lora_targets")


# ---- training -----------------------------------------------------------------------------------

def main(argv=None):
    opts = parse_args(Options, argv, __doc__)
    check_options(opts)
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    files = data_files(opts)
    run = run_mod.start(opts, script="unpaired",
                        identity={k: v for k, v in to_dict(opts).items() if k not in NOT_IDENTITY},
                        inputs={"init": opts.init, "ref": opts.ref},
                        data_files={k: v for k, v in files.items() if v})
    with input_errors():
        records = read_train_eval(opts, files)
        tok, policy, ref, value = load_models(opts)
        run.identity.update(lora.attach(policy, opts, opts.init))      # --lora_r: adapters, the base frozen
        if value is not None:      # DRO's value model as PPO's critic: adapters on its trunk, its head trained fully
            run.identity.update(lora.attach(value, opts, opts.init, trainable=("score",), prefix="value_lora",
                                            seed=opts.seed + 1))
        if ref is None:                                                  # LoRA, reference = --init: the policy
            ref = lora.BaseView(policy)                                  # with its adapters off, no second copy
        train, evals, counts = tokenize_examples(opts, files, *records, tok, policy.cfg.block_size)
        batches = Batches(len(train), opts.batch_size, opts.grad_accum, world.rank, world.world_size, opts.seed)
    run.identity.update(chat_template=tok.chat_template, date_string=tok.date_string)
    models = {"policy": policy} if value is None else {"policy": policy, "value": value}
    for name, m in models.items():
        if opts.grad_checkpoint:
            m.set_grad_checkpointing(True)
        m.to(world.device)
        dist.check_same_weights(m, name)
    ref.to(world.device)
    dist.seed_everything(opts.seed, world.rank)
    samples = None
    if opts.method == "d2o":
        prompts = sorted({tuple(e["prompt"]) for e in train + evals})
        path = os.path.join(opts.out_dir, SAMPLES_FILE)
        with input_errors():
            if opts.resume:
                samples = load_samples(path, prompts, opts.num_samples)
            else:
                t0 = time.time()
                samples = draw_samples(opts, ref, prompts, tok, world.device)
                if world.is_main:
                    save_samples(path, samples, tok)
                dist.print0(f"sampled {opts.num_samples} responses for each of {len(prompts):,} prompts from the "
                            f"reference in {time.time() - t0:.1f}s -> {path}")
            longest = max(len(p) + len(y) for p, ys in samples.items() for y in ys)
            if longest > policy.cfg.block_size:
                raise ValueError(f"{path}: a prompt + sample of {longest} tokens exceeds block_size "
                                 f"{policy.cfg.block_size}")
    ref = parallel.prepare_frozen(ref, opts.fsdp, opts.frozen, opts.offload_frozen, opts.dtype)
    ddp = {name: parallel.wrap(m, opts.fsdp, dtype=opts.dtype) for name, m in models.items()}
    optimizers = {"policy": adamw(policy, opts.lr, opts.weight_decay, (opts.beta1, opts.beta2))}
    if value is not None:
        optimizers["value"] = adamw(value, opts.value_lr, opts.weight_decay, (opts.beta1, opts.beta2))
    dist.print0(parallel.startup_plan({**models, "ref": ref}, "fsdp" if parallel.is_sharded(policy) else "ddp",
                                      opts.frozen, opts.offload_frozen))
    peak = {"policy": opts.lr, "value": opts.value_lr}
    max_steps = run.max_steps = opts.max_steps or max(1, int(opts.epochs * batches.steps_per_epoch))
    if opts.resume:
        batches.load_state_dict(run.resume(models={k: lora.checkpointed(m) for k, m in models.items()},
                                           optimizers=optimizers)["data"])
    if world.is_main:
        save_config(opts, os.path.join(opts.out_dir, "train_config.json"), world_size=world.world_size,
                    global_batch=batches.global_batch, max_steps=max_steps)
    dist.print0(f"{opts.method.upper()}{lora.describe(policy)} | {len(train):,} train examples ({counts}) | "
                f"{len(evals):,} eval | global batch {batches.global_batch} | {max_steps} steps"
                + (f" | resuming at step {run.step}" if run.step else ""))
    run.show = {"npo": ["train/loss", "train/rewards_negative", "train/nll", "eval/loss"],
                "d2o": ["train/loss", "train/accuracy", "train/rewards_negative", "train/rewards_samples", "eval/loss"],
                "dro": ["train/loss", "train/value", "train/advantage", "train/log_ratio", "eval/loss"]}[opts.method]
    run.loss_key = ("train/loss", "train/grad_norm")

    def save(step):
        save_state(opts.out_dir, {k: lora.checkpointed(m) for k, m in models.items()}, optimizers,
                   {"step": step, "data": batches.state_dict()})
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
        sums = zero_sums(opts)
        for j, batch in enumerate(micro):
            with contextlib.ExitStack() as stack:
                if world.enabled and j < len(micro) - 1:           # gradients are all-reduced on the last one
                    for d in ddp.values():
                        stack.enter_context(d.no_sync())
                stats = micro_step(opts, ddp["policy"], ref, batch, ddp.get("value"))
                (objective(opts, stats, n_items, n_negative, n_retain) * dist.ddp_scale()).backward()
            add_to(sums, stats, batch)
        totals = sum_over_ranks(sums)
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
        for name, m in models.items():
            norm = parallel.clip_grad_norm(m.parameters(), opts.grad_clip)
            metrics["train/grad_norm" if name == "policy" else f"train/{name}_grad_norm"] = norm
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        metrics.update({"train/lr": optimizers["policy"].param_groups[0]["lr"],
                        "train/tokens_per_s": totals["tokens"] / max(time.time() - t0, 1e-9)})
        if run.end_of_step(step, metrics, save=save, evaluate=lambda: evaluate_gathered(
                opts, policy, ref, value, evals, tok.pad_id, world.device, samples)):
            break
    for name, m in models.items():
        dist.check_same_weights(m, name)
    parallel.check_frozen({"reference": ref})
    dist.print0(f"saved {opts.out_dir} (HF {policy.architecture} layout)")
    run.finish()
    return SimpleNamespace(policy=policy, ref=ref, value=value, optimizers=optimizers, options=opts, samples=samples)


if __name__ == "__main__":
    main()
