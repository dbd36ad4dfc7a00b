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
  --loss tdpo    −log σ(βh − α·(β·D(x, y_l) − sg[β·D(x, y_w)])),  D(x, y) = Σ_t KL(π_ref(·|x, y_<t) ‖ π_θ(·|x, y_<t))
                 over the full vocabulary at every response position   Zeng et al. 2024, TDPO₂ (δ₂)
  --nll_coef α   adds α·NLL(y_w) to any pair loss (RPO, Pang et al. 2024)
  --l1_coef λ    adds λ·Σ|θ − θ_init| over every weight: a sparse preference delta (PAFT, Pentyala et al. 2024),
                 to be merged with an SFT delta by `python -m nano_rlhf.merge`

The optimizer step minimises  mean over the step's pairs (all ranks) of the loss  +  w·NLL(y_w), where NLL(y_w)
is the token-mean cross-entropy over all chosen-response tokens of the step (the prompt excluded; TRL's ORPO
includes it) and w = --nll_coef (+ α for cpo, + 1 for orpo). The math and its choices in detail:
docs/algorithms.md, sections "DPO family" and "Common mechanics".

KTO learns from unpaired data, so it lives with NPO, D2O and DRO: `python train_unpaired.py --method kto`.

Run:
    python train_dpo.py                                   # DPO on the built-in task, from out/sft -> out/dpo
    python train_dpo.py --loss ipo --beta 0.1             # -> out/ipo
    python train_dpo.py --loss tdpo --alpha 0.5           # token-level KL on both responses -> out/tdpo
    python train_dpo.py --init base --l1_coef 1e-4 --out_dir out/paft_dpo   # PAFT: then nano_rlhf.merge (docs)
    python train_dpo.py --data prefs.jsonl --init out/sft --precompute_ref --out_dir out/my_dpo
    python train_dpo.py --data data/listwise.jsonl --listwise_pairs best_worst --out_dir out/dpo_bw   # listwise data
    torchrun --nproc_per_node 2 train_dpo.py --loss simpo
    python train_dpo.py --init Qwen3-0.6B-sft --data prefs.jsonl --lr 5e-7 --grad_checkpoint --out_dir out/qwen3_dpo

Real model families (GPT-2, Llama, Qwen2, Qwen3 directories in the HF layout): conversational rows are rendered
with the checkpoint's own chat template (recognised from its tokenizer_config.json; --chat_template names one),
and each response is scored up to and including the template's end-of-turn token. --date_string fixes the date
Llama 3's template writes into its system header; the date used is part of the run, so --resume renders the same
tokens. The output directory loads in transformers like the input did.

Listwise data ({"prompt", "completions", "scores"} rows, as train_listwise.py reads) runs through every pairwise
loss: each row becomes pairs, --listwise_pairs all (every pair with a higher score over a lower one; ties skipped)
or best_worst (one pair per row). The eval split is made on rows, before the expansion.

Reading the logs: rewards are β·u (β·S_θ for cpo, β·Ā_θ for simpo, log-odds for orpo). Both chosen and
rejected rewards usually fall below zero: after SFT on similar data, any other objective lowers the
likelihood of the data; what DPO optimises is the margin between them (eric-mitchell/dpo#8, #32).

--lora_r R trains low-rank adapters on the frozen --init model (nano_rlhf/lora.py). The reference is then, when
it is --init (no other --ref), the policy itself with its adapters switched off: no second copy in memory. The
output directory holds the merged model and out_dir/adapter the adapters alone in PEFT's layout.

Simplifications: the reference is a frozen copy of the initial policy (or precomputed log-probs); no
reference-model syncing (TR-DPO).
"""
import math
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nano_rlhf import dist, lora, parallel
from nano_rlhf import training
from nano_rlhf.checkpoint import save_model_dir
from nano_rlhf.cli import CompileOption, FrozenModelOptions, RunOptions, parse_args
from nano_rlhf.data import (Batches, collate_pairs, default_data, is_listwise_file, listwise_to_pairs, load_records,
                            split_off, tokenize_pairs, training_length)
from nano_rlhf.model import GPT, chunk_rows, is_right_padded, token_logprobs, upcast
from nano_rlhf.training import (autocast, check_device, check_vocab, derive_max_steps, fail, input_errors,
                                load_reference, lr_at, set_lr)

REFERENCE_FREE = ("simpo", "cpo", "orpo")
# β defaults: 0.1, except SimPO (its reward is a per-token mean, so it needs a larger scale, as in the paper)
# and IPO (τ sets the target margin 1/(2τ) of the per-token log-ratio: 0.1 would ask for 5 nats per token)
DEFAULT_BETA = {"simpo": 2.0, "ipo": 0.5}


@dataclass
class Options(CompileOption, FrozenModelOptions, RunOptions):
    loss: Literal["dpo", "robust", "ipo", "hinge", "rdpo", "simpo", "cpo", "orpo", "tdpo"] = "dpo"  # which loss
    beta: Optional[float] = None  # β (ipo: τ); none = 0.1, or 2.0 for simpo, 0.5 for ipo {> 0}
    label_smoothing: float = 0.0  # ε: assumed share of flipped labels (dpo = cDPO, robust) [with loss=dpo|robust]
                                  # {0 <= x < 0.5}
    gamma: float = 0.5            # SimPO target margin γ [with loss=simpo] {>= 0}
    alpha: Optional[float] = None # rdpo: length coefficient (none = 0.01); cpo: NLL weight (none = 1.0); tdpo: KL
                                  # weight (none = 0.5) [with loss=rdpo|cpo|tdpo] {>= 0}
    lam: float = 0.1              # ORPO weight λ of the odds-ratio term [with loss=orpo] {>= 0}
    nll_coef: float = 0.0         # add this × NLL(chosen) to the loss (RPO); cpo/orpo add their own {>= 0}
    l1_coef: float = 0.0          # λ of λ·Σ|θ − θ_init| (PAFT's sparse preference delta); 0 = off {>= 0}
    precompute_ref: bool = False  # compute the reference log-probs once before training, then drop the reference
                                  # [with loss!=simpo|cpo|orpo]
    data: str = ""                # preference JSONL; empty = built-in task
    eval_data: str = ""           # held-out JSONL of the same kind; empty = split --eval_fraction off --data
    eval_fraction: float = 0.05   # share of --data held out when no --eval_data is given {0 < x < 1}
    listwise_pairs: Literal["auto", "all", "best_worst"] = "auto"  # listwise --data/--eval_data (rows with
                                                                   # 'completions'/'scores') -> pairs: all = every pair
                                                                   # with s_i > s_j (ties skipped), best_worst = best vs
                                                                   # worst; auto = all, and pairs data as is
    init: str = "out/sft"         # policy to start from (an SFT model directory)
    ref: str = ""                 # reference model directory; empty = --init [with loss!=simpo|cpo|orpo]
    out_dir: str = ""             # output directory; empty = out/<loss>
    dropout: float = 0.0          # dropout of the policy (0: log-probs must be reproducible) {0 <= x < 1}
    batch_size: int = 16          # pairs per device per micro-step {>= 1}
    grad_accum: int = 1           # micro-steps per optimizer step {>= 1}
    max_steps: int = 0            # optimizer steps; 0 = as many as --epochs needs {>= 0}
    epochs: float = 1.0           # passes over the data when --max_steps is 0 {> 0}
    lr: float = 1e-4              # peak learning rate (built-in task); GPT-2-124M: 1e-6, 0.5-1.5B models: 5e-7
                                  # {0 < x <= 1e3}
    warmup_steps: int = 10        # linear warm-up steps {>= 0}
    weight_decay: float = 0.0     # AdamW decoupled weight decay (matrices only) {>= 0}
    beta1: float = 0.9            # AdamW beta1 {0 <= x < 1}
    beta2: float = 0.95           # AdamW beta2 {0 <= x < 1}
    grad_clip: float = 1.0        # clip the global gradient norm to this (0 = off) {>= 0}
    seed: int = 0                 # seed for data order
    max_length: int = 0           # training sequence length: prompts are left-truncated so prompt + response fits; 0 =
                                  # min(block_size, 1024) {>= 0}


def fill_defaults(opts):
    """The defaults that depend on --loss, filled in right after parsing (run.json records the filled values)."""
    opts.beta = DEFAULT_BETA.get(opts.loss, 0.1) if opts.beta is None else opts.beta
    opts.alpha = {"cpo": 1.0, "tdpo": 0.5}.get(opts.loss, 0.01) if opts.alpha is None else opts.alpha
    opts.out_dir = opts.out_dir or f"out/{opts.loss}"


# ---- the one log-prob gather (copied into train_listwise.py and train_unpaired.py, kept identical) ----

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


def token_logps(model, input_ids, attention_mask, response_mask):
    """log π(y_t | x, y_<t) of every response token, (B, T−1): column t scores token t+1; 0 elsewhere."""
    logp, scored = _scored_logps(model, input_ids, attention_mask, response_mask)
    return torch.zeros(scored.shape, device=logp.device, dtype=logp.dtype).masked_scatter(scored.to(logp.device), logp)


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


def _chunk_kl(h_pi, h_ref, w_pi, w_ref):
    logp = upcast(F.linear(h_pi, w_pi)).log_softmax(-1)
    logq = upcast(F.linear(h_ref, w_ref)).log_softmax(-1)
    return (logq.exp() * (logq - logp)).sum(-1)


def token_kl(hidden_pi, hidden_ref, weight_pi, weight_ref, chunk_size=None):
    """(N, C) policy and reference hidden states at the same N positions -> (N,) float32 KL(π_ref ‖ π_θ) over the
    whole vocabulary at each position. Chunked within model.token_logprobs' budget (two rows of logits a position)
    and each chunk recomputed in backward by torch's checkpoint, so the two (N, V) logit tensors are never held
    at once beyond chunk_size positions; chunked == unchunked."""
    if chunk_size is None:
        chunk_size = chunk_rows(2 * weight_pi.shape[0], hidden_pi.device)
    if hidden_pi.shape[0] <= chunk_size:
        return _chunk_kl(hidden_pi, hidden_ref, weight_pi, weight_ref)
    grad = torch.is_grad_enabled() and (hidden_pi.requires_grad or weight_pi.requires_grad)
    parts = []
    for i in range(0, hidden_pi.shape[0], chunk_size):
        args = (hidden_pi[i:i + chunk_size], hidden_ref[i:i + chunk_size], weight_pi, weight_ref)
        parts.append(checkpoint(_chunk_kl, *args, use_reentrant=False) if grad else _chunk_kl(*args))
    return torch.cat(parts)


def sequence_logps_and_kl(policy, ref, input_ids, attention_mask, response_mask):
    """TDPO's one pass per model: S_θ (B,) with its graph, |y| (B,), S_ref (B,) and the sequential KL
    D_SeqKL(x, y; π_ref‖π_θ) = Σ_t KL(π_ref(·|x, y_<t) ‖ π_θ(·|x, y_<t)) (B,), summed over the response
    positions (the ones whose token is scored, as in sequence_logps). The reference runs without grad."""
    scored = response_mask[:, 1:].bool()
    positions = F.pad(scored, (0, 1)).flatten().nonzero().squeeze(1).to(input_ids.device)   # as in _scored_logps
    targets = input_ids.flatten()[positions + 1]
    h_pi = policy(input_ids, attention_mask, select=positions, return_hidden=True)
    w_pi = dist.unwrap(policy).output_weight()
    with torch.no_grad():
        h_ref = ref(input_ids, attention_mask, select=positions, return_hidden=True)
        w_ref = ref.output_weight()
        s_ref = row_sums(token_logprobs(h_ref, w_ref, targets), scored)
    s_pi = row_sums(token_logprobs(h_pi, w_pi, targets), scored)
    kl = row_sums(token_kl(h_pi, h_ref, w_pi, w_ref), scored)
    return s_pi, scored.sum(1).float().to(s_pi.device), s_ref, kl


# ---- the losses: per example, (B,) --------------------------------------------------------------

def dpo_loss(h, beta, label_smoothing=0.0):
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def robust_loss(h, beta, label_smoothing):
    return (-(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) \
        / (1 - 2 * label_smoothing)


def ipo_loss(u_w, u_l, len_w, len_l, beta, label_smoothing=0.0):
    """Azar et al. 2023, eq. 17: (h̃ − τ⁻¹(I − ½))² with the label I = 1 − ε (ε = label_smoothing; 0 offline, so
    the target is 1/(2τ); train_online.py's soft labels pass ε = 1 − P(y_w ≻ y_l), the paper's population
    loss with the preference P in place of a sampled label)."""
    h = u_w / len_w.clamp(min=1) - u_l / len_l.clamp(min=1)          # length-averaged (TRL PR #1265)
    return (h - (1 - 2 * label_smoothing) / (2 * beta)) ** 2


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


def tdpo_loss(h, kl_w, kl_l, beta, alpha):
    """TDPO₂: −log σ(βh − α·δ₂), δ₂ = β·D_SeqKL(x, y_l; π_ref‖π_θ) − sg[β·D_SeqKL(x, y_w; π_ref‖π_θ)]. The stop-
    gradient on the chosen KL is the paper's: only the rejected response's token-level KL is pushed down
    (kept close to the reference), while the chosen one may drift to fit the preference."""
    return -F.logsigmoid(beta * h - alpha * (beta * kl_l - beta * kl_w.detach()))


def l1_delta(params, init_params):
    """Σ|θ − θ_init| over every weight (PAFT's L1 on the preference delta); its gradient is sign(θ − θ_init),
    0 where θ = θ_init. Pure: the caller scales it by λ."""
    return sum((p - p0).abs().sum() for p, p0 in zip(params, init_params))


def pair_loss(opts, pi_w, pi_l, ref_w, ref_l, len_w, len_l):
    """The --loss table: per-pair loss and the 'rewards' logged for chosen and rejected (module docstring)."""
    beta = opts.beta
    if opts.loss in REFERENCE_FREE:
        if opts.loss == "simpo":
            return simpo_loss(pi_w, pi_l, len_w, len_l, beta, opts.gamma), beta * pi_w / len_w, beta * pi_l / len_l
        if opts.loss == "cpo":
            return cpo_loss(pi_w, pi_l, beta), beta * pi_w, beta * pi_l
        return orpo_loss(pi_w, pi_l, len_w, len_l, opts.lam), log_odds(pi_w, len_w), log_odds(pi_l, len_l)
    u_w, u_l = pi_w - ref_w, pi_l - ref_l
    h = u_w - u_l
    loss = {"dpo": lambda: dpo_loss(h, beta, opts.label_smoothing),
            "robust": lambda: robust_loss(h, beta, opts.label_smoothing),
            "ipo": lambda: ipo_loss(u_w, u_l, len_w, len_l, beta, opts.label_smoothing),
            "hinge": lambda: hinge_loss(h, beta),
            "rdpo": lambda: rdpo_loss(h, len_w, len_l, beta, opts.alpha)}[opts.loss]()
    return loss, beta * u_w, beta * u_l


def nll_weight(opts):
    """Total weight w of NLL(y_w) in the loss: RPO's --nll_coef, plus CPO's α or ORPO's 1."""
    return opts.nll_coef + (opts.alpha if opts.loss == "cpo" else 0.0) + (1.0 if opts.loss == "orpo" else 0.0)


# ---- batches ------------------------------------------------------------------------------------

@dataclass
class Batch:
    """One micro-batch: 2B rows, the chosen rows then the rejected ones (one forward for both). The ids on the
    device; the response mask on the CPU, where the positions it selects are found without a host read."""
    ids: torch.Tensor                     # (rows, T) right-padded
    attn: Optional[torch.Tensor]          # (rows, T) attention mask; None when no row has padding inside it
    resp: torch.Tensor                    # (rows, T) response mask, on the CPU
    ref_logps: Optional[torch.Tensor]     # (rows,) precomputed S_ref; None = a live reference, or none needed
    n_items: int                          # pairs
    n_chosen_tokens: int                  # tokens of y_w, the NLL's denominator
    n_tokens: int = 0                     # real tokens, for tokens/s


# the per-example reference log-probs that --precompute_ref stores in each example
REF_KEYS = ("ref_chosen", "ref_rejected")


def make_batch(examples, opts, pad_id, device):
    """Collate examples into a Batch (with the reference log-probs when precomputed). What the host needs to know is
    decided here, on the CPU copy: the token count, and whether a mask is needed (right-padded rows need none:
    causal attention never lets a real token see a later pad)."""
    ids, attn, resp, _ = collate_pairs(examples, pad_id)
    ref_logps = None                 # precomputed S_ref of the chosen rows, then the rejected ones
    if REF_KEYS[0] in examples[0]:
        ref_logps = torch.tensor([e[k] for k in REF_KEYS for e in examples], device=device)
    mask = None if is_right_padded(attn) else attn.to(device, non_blocking=True, copy=True)
    return Batch(ids.to(device, non_blocking=True, copy=True), mask, resp, ref_logps=ref_logps,
                 n_items=len(examples), n_chosen_tokens=sum(len(e["chosen"]) for e in examples),
                 n_tokens=int(attn.sum()))


def policy_and_ref_logps(opts, policy, ref, batch):
    """S_θ and |y| of the batch's rows (with the policy's graph), and S_ref: live, precomputed or None."""
    with autocast(batch.ids.device, opts.dtype):
        pi, length = sequence_logps(policy, batch.ids, batch.attn, batch.resp)
    ref_logps = batch.ref_logps
    if ref is not None:
        with torch.no_grad(), autocast(batch.ids.device, opts.dtype):
            ref_logps, _ = sequence_logps(ref, batch.ids, batch.attn, batch.resp)
    return pi, length, ref_logps


# the named sums micro_step returns, per kind of data
PAIR_STATS = ("loss", "rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin", "logps_chosen",
              "logps_rejected", "nll")
TDPO_STATS = PAIR_STATS + ("seqkl_chosen", "seqkl_rejected")


def micro_step(opts, policy, ref, batch):
    """Named sums over one micro-batch. 'loss' (Σ of per-example losses) and 'nll' (Σ of −log π over the
    chosen tokens) keep their graph for the backward; the others are for the log."""
    if opts.loss == "tdpo":       # the reference's whole distribution is needed: one pass of each model together
        with autocast(batch.ids.device, opts.dtype):
            pi, length, ref_lp, kl = sequence_logps_and_kl(policy, ref, batch.ids, batch.attn, batch.resp)
        (pi_w, pi_l), (ref_w, ref_l), (kl_w, kl_l) = pi.chunk(2), ref_lp.chunk(2), kl.chunk(2)
        h = (pi_w - ref_w) - (pi_l - ref_l)
        loss = tdpo_loss(h, kl_w, kl_l, opts.beta, opts.alpha)
        reward_w, reward_l = opts.beta * (pi_w - ref_w), opts.beta * (pi_l - ref_l)
        return {"loss": loss.sum(), "rewards_chosen": reward_w.sum(), "rewards_rejected": reward_l.sum(),
                "reward_accuracy": (reward_w > reward_l).float().sum(), "reward_margin": (reward_w - reward_l).sum(),
                "logps_chosen": pi_w.sum(), "logps_rejected": pi_l.sum(), "nll": -pi_w.sum(),
                "seqkl_chosen": kl_w.sum(), "seqkl_rejected": kl_l.sum()}
    pi, length, ref_lp = policy_and_ref_logps(opts, policy, ref, batch)
    (pi_w, pi_l), (len_w, len_l) = pi.chunk(2), length.chunk(2)
    ref_w, ref_l = ref_lp.chunk(2) if ref_lp is not None else (None, None)
    loss, reward_w, reward_l = pair_loss(opts, pi_w, pi_l, ref_w, ref_l, len_w, len_l)
    return {"loss": loss.sum(), "rewards_chosen": reward_w.sum(), "rewards_rejected": reward_l.sum(),
            "reward_accuracy": (reward_w > reward_l).float().sum(), "reward_margin": (reward_w - reward_l).sum(),
            "logps_chosen": pi_w.sum(), "logps_rejected": pi_l.sum(), "nll": -pi_w.sum()}


COUNTS = ("items", "chosen_tokens", "tokens")     # summed beside the statistics: the denominators, tok/s


def zero_sums(opts):
    return dict.fromkeys((TDPO_STATS if opts.loss == "tdpo" else PAIR_STATS) + COUNTS, 0.0)


def add_to(sums, stats, batch):
    """Accumulate a micro-batch's named sums (float64 on the device, detached: read once a step) and counts (on
    the host) into `sums`."""
    for k, v in stats.items():
        sums[k] = sums[k] + v.detach().double()
    sums["items"] += batch.n_items
    sums["chosen_tokens"] += batch.n_chosen_tokens
    sums["tokens"] += batch.n_tokens


def means(totals):
    """Sums over a step (or the eval set) on all ranks -> what is logged: per-pair means, the NLL per chosen
    token."""
    out = {k: v / max(totals["items"], 1) for k, v in totals.items() if k not in ("nll",) + COUNTS}
    out["nll"] = totals["nll"] / max(totals["chosen_tokens"], 1)
    return out


@torch.no_grad()
def precompute_reference(opts, ref, examples, pad_id, device):
    """Reference log-probs stored in each example (keyed by the example, not by batch position, so
    shuffling cannot misalign them: TRL#2337). Each rank computes a shard; an all-reduce shares them."""
    values = torch.zeros(len(examples), 2, dtype=torch.float64)         # S_ref of each example's two rows
    mine = dist.rank_share(list(range(len(examples))))
    progress = training.Progress(len(mine), "precomputing the reference's log-probs", unit="pairs",
                                stream=sys.stdout)             # beside the training loop's progress lines
    for i in range(0, len(mine), opts.batch_size):
        idx = mine[i:i + opts.batch_size]
        batch = make_batch([examples[j] for j in idx], opts, pad_id, device)
        with autocast(device, opts.dtype):
            s_ref = sequence_logps(ref, batch.ids, batch.attn, batch.resp)[0]
        values[idx] = torch.stack(s_ref.chunk(2), 1).double().cpu()
        progress.update(len(idx))
    progress.done()
    values = dist.all_reduce_sum(values)
    for e, row in zip(examples, values.tolist()):
        e.update(zip(REF_KEYS, row))


@torch.no_grad()
def evaluate(opts, policy, ref, examples, pad_id, device):
    """Means over the whole eval set, on all ranks (ranks may hold different numbers of batches, so no
    collective inside the loop)."""
    policy.eval()
    mine = dist.rank_share(examples)
    sums = zero_sums(opts)
    for i in range(0, len(mine), opts.batch_size):
        batch = make_batch(mine[i:i + opts.batch_size], opts, pad_id, device)
        add_to(sums, micro_step(opts, policy, ref, batch), batch)
    policy.train()
    return {f"eval/{k}": v for k, v in means(dist.all_reduce_sums(sums)).items()}


def add_l1_grad(policy, init_params, coef):
    """Add the gradient of coef·Σ|θ − θ_init| (coef·sign(θ − θ_init)) to the policy's gradients, after the
    all-reduce: weights are identical on every rank, so the term is too and needs no collective (a second
    backward through DDP's hooks would). Returns Σ|θ − θ_init| for the log (a 0-dim tensor, read with the step's
    figures)."""
    params = list(policy.parameters())
    with torch.enable_grad():
        leaves = [p.detach().requires_grad_(True) for p in params]
        delta = l1_delta(leaves, init_params)
        grads = torch.autograd.grad(delta, leaves)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.grad = coef * g if p.grad is None else p.grad.add_(g, alpha=coef)
    return delta.detach()


def train_step(opts, ddp, policy, ref, optimizer, micro, n_items, init_params=None):
    """Forward/backward over this rank's micro-batches (Batch), then one optimizer step -> (the step's means,
    the gradient norm, Σ|θ − θ_init| before the update (0 without --l1_coef), the step's tokens on all ranks).
    The objective is the mean over the step's n_items pairs (all ranks) of the loss, plus w · the token-mean
    NLL(y_w) over all ranks' chosen tokens. The device is read once, after the update: the step's sums, the
    gradient norm and Σ|θ − θ_init| together."""
    nll_w = nll_weight(opts)
    # the step's denominators, over all ranks, before any backward: items, and chosen tokens for the NLL
    n_chosen = max(dist.all_reduce_sum(float(sum(b.n_chosen_tokens for b in micro))), 1)
    sums = zero_sums(opts)
    for j, batch in enumerate(micro):
        parallel.sync_gradients(ddp, j == len(micro) - 1)      # gradients all-reduced once, on the last one
        stats = micro_step(opts, ddp, ref, batch)
        objective = stats["loss"] / n_items                        # mean over the step's items ...
        if nll_w:                                                   # ... + w · token-mean NLL(y_w)
            objective = objective + nll_w * stats["nll"] / n_chosen
        (objective * dist.ddp_scale()).backward()                   # DDP averages over ranks: undo it
        add_to(sums, stats, batch)
    totals = dist.all_reduce_sum(dist.stacked(sums.values()))           # on the device, read below
    l1 = add_l1_grad(policy, init_params, opts.l1_coef) if opts.l1_coef else totals.new_zeros(())
    grad_norm = parallel.clipped_grad_norm(policy.parameters(), opts.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    *totals, grad_norm, l1 = torch.cat([totals, grad_norm.double()[None], l1.double()[None]]).tolist()  # one read
    totals = dict(zip(sums, totals))
    return {f"train/{k}": v for k, v in means(totals).items()}, grad_norm, l1, totals["tokens"]


# ---- set-up -------------------------------------------------------------------------------------

def evaluate_gathered(opts, policy, ref, examples, pad_id, device):
    """evaluate() on gathered weights under FSDP: ranks may hold different numbers of eval batches, so the
    forwards must not all-gather."""
    with parallel.gathered(policy, ref):
        return evaluate(opts, policy, ref, examples, pad_id, device)


def check_options(opts):
    """--device one this machine has, then the rules between options (each option's own range is declared on Options
    and checked by parse_args). A flag the loss would silently ignore is an error."""
    check_device(opts.device)
    loss = opts.loss
    if opts.fsdp and opts.compile:
        fail("--compile with --fsdp is not supported; drop one of them", 2)
    if opts.offload_frozen and (loss in REFERENCE_FREE or opts.precompute_ref):
        fail("--offload_frozen: this run holds no reference model "
             f"({'--precompute_ref' if opts.precompute_ref else f'--loss {loss} is reference-free'})", 2)
    if loss == "tdpo" and opts.precompute_ref:
        fail("--precompute_ref cannot be used with --loss tdpo: its KL term needs the reference's whole "
             "next-token distribution at every response position, so the reference runs live", 2)
    if opts.l1_coef and opts.fsdp:   # θ_init is held whole; under --fsdp the parameters are shards
        fail("--l1_coef with --fsdp is not supported yet (θ_init would have to be sharded like the policy)", 2)
    if opts.l1_coef and opts.lora_r:  # the penalty would fall on A and B, not on PAFT's merged delta B·A
        fail("--l1_coef with --lora_r is not supported: PAFT's L1 is on the full weights' delta", 2)
    msg = lora.check_lora_options(opts)
    if msg:
        fail(msg, 2)


def load_models(opts, tok):
    """Policy, (unless the loss is reference-free) the frozen reference: no grad, eval mode, never in DDP or the
    optimizer, and the training length (--max_length resolved against the policy). Raises on bad input
    (input_errors turns that into one line)."""
    policy = GPT.from_pretrained(opts.init, dropout=opts.dropout)
    check_vocab(tok, policy.cfg, opts.init)
    max_length = training_length(opts.max_length, policy.cfg.block_size, opts.init)
    ref = None
    if opts.loss not in REFERENCE_FREE and not lora.shares_base(opts, opts.ref):   # (else: main's BaseView)
        ref = load_reference(opts.ref or opts.init, tok, max_length, f"training length {max_length} "
                             "(--max_length, default min(policy block_size, 1024))")
    return policy, ref, max_length


def data_files(opts):
    """The train and eval JSONL files (the built-in task's when not given); eval None = split --eval_fraction off
    the train file."""
    split = not opts.eval_data and opts.data
    return {"data": opts.data or default_data("preference"),
            "eval_data": None if split else opts.eval_data or default_data("preference", "eval")}


def read_records(opts, path):
    """Records of one file as pairs. A listwise file (its first row has 'completions') is read as listwise and
    expanded into pairs by --listwise_pairs after any eval split (so one prompt's pairs never straddle train and
    eval): here it is only read; `as_pairs` expands."""
    listwise = is_listwise_file(path)
    if opts.listwise_pairs != "auto" and not listwise:
        raise ValueError(f"--listwise_pairs {opts.listwise_pairs}: {path} is not listwise data (its first row has "
                         f"no 'completions' field)")
    return load_records(path, "listwise" if listwise else "preference"), listwise


def as_pairs(opts, records, listwise, source):
    """Listwise records -> preference records by --listwise_pairs (auto = all); others unchanged."""
    if not listwise:
        return records
    mode = "all" if opts.listwise_pairs == "auto" else opts.listwise_pairs
    pairs, empty = listwise_to_pairs(records, mode)
    dist.print0(f"{source}: {len(records):,} listwise rows -> {len(pairs):,} pairs (--listwise_pairs {mode}"
                + (f"; {empty} row(s) whose scores all tie give none)" if empty else ")"))
    if not pairs:
        raise ValueError(f"{source}: no listwise row has two different scores, so there is no pair to train on")
    return pairs


def load_examples(opts, files, tok, max_length):
    """Tokenized train and eval examples and the train counts."""
    records, listwise = read_records(opts, files["data"])
    if files["eval_data"]:
        eval_source = files["eval_data"]
        eval_records, eval_listwise = read_records(opts, files["eval_data"])
    else:
        records, eval_records = split_off(records, opts.eval_fraction, opts.seed)
        eval_source, eval_listwise = f"{files['data']} (the --eval_fraction {opts.eval_fraction} held out)", listwise
        if not records:
            raise ValueError(f"--eval_fraction {opts.eval_fraction} holds out every row of {files['data']} "
                             f"({len(eval_records)}): none is left to train on; pass --eval_data")
    records = as_pairs(opts, records, listwise, files["data"])
    eval_records = as_pairs(opts, eval_records, eval_listwise, eval_source)
    train, counts = tokenize_pairs(records, tok, max_length)
    evals, eval_counts = tokenize_pairs(eval_records, tok, max_length)
    for examples, source, c in ((train, files["data"], counts), (evals, eval_source, eval_counts)):
        if not examples:     # an empty eval set would log a loss and an accuracy of 0
            raise ValueError(f"{source}: no example fits the training length {max_length} ({c})")
    return train, evals, counts


# options that do not define the run: paths whose content is checked otherwise (data sha256), and how it runs;

def run_record(opts, files):
    """The inputs the run only reads and its data files (its options are its identity: nano_rlhf/training.py)."""
    return dict(inputs={"init": opts.init, "ref": opts.ref}, data_files=files)


# ---- training -----------------------------------------------------------------------------------

SHOW = ["train/loss", "train/reward_accuracy", "train/reward_margin", "train/rewards_chosen", "train/kl", "eval/loss",
        "eval/reward_accuracy"]                # the progress line's metrics, in order
LOSS_KEYS = ["train/loss", "train/grad_norm"]  # a NaN/inf in either stops the run (the checkpoint intact)


def main(argv=None):
    opts = parse_args(Options, argv, __doc__)      # each option's range and [with ...] refused here
    fill_defaults(opts)                            # the defaults that depend on other options
    check_options(opts)                            # --device and the rules between options; only refuses
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    files = data_files(opts)
    run = training.open_run(opts, "dpo", **run_record(opts, files), show=SHOW, loss_keys=LOSS_KEYS)
    with input_errors():
        tok = training.tokenizer(opts, run)
        policy, ref, max_length = load_models(opts, tok)
        run.identity.update(max_length=max_length)      # --max_length resolved: what the data is cut to
        run.identity.update(lora.attach(policy, opts, opts.init))      # --lora_r: adapters, the base frozen
        if ref is None and opts.loss not in REFERENCE_FREE:             # LoRA, reference = --init: the policy
            ref = lora.BaseView(policy)                                  # with its adapters off, no second copy
        train, evals, counts = load_examples(opts, files, tok, max_length)
        batches = Batches(len(train), opts.batch_size, opts.grad_accum, world.rank, world.world_size, opts.seed)
    training.place(opts, world, {"policy": policy}, {"reference model": ref})
    # PAFT: θ_init is the --init weights, held once (also on --resume, which restores θ but not θ_init)
    init_params = [p.detach().clone() for p in policy.parameters()] if opts.l1_coef else None
    reference = "none" if ref is None else "precomputed" if opts.precompute_ref else "live"
    reference += " (the policy with its LoRA adapters off)" if isinstance(ref, lora.BaseView) else ""
    if opts.precompute_ref:
        t0 = time.time()
        for examples in (train, evals):
            precompute_reference(opts, ref, examples, tok.pad_id, world.device)
        ref = None                                          # frees the reference model's memory
        dist.print0(f"precomputed reference log-probs for {len(train) + len(evals):,} examples in "
                    f"{time.time() - t0:.1f}s")
    ref = training.frozen(opts, ref)
    ddp, optimizer = training.prepare(opts, policy, opts.lr)
    training.plan(opts, {"policy": policy, "ref": ref})
    max_steps = derive_max_steps(opts, batches.steps_per_epoch)
    run.set_max_steps(max_steps)
    run.resume({"policy": policy}, {"policy": optimizer}, data={"data": batches},
              global_batch=batches.global_batch, max_steps=max_steps)
    dist.print0(f"{opts.loss.upper()} | beta {opts.beta}{lora.describe(policy)} | {len(train):,} train examples "
                f"({counts}) | {len(evals):,} eval | max length {max_length} | global batch {batches.global_batch} | "
                f"{max_steps} steps | reference: {reference}"
                + (f" | resuming at step {run.step}" if run.step else ""))

    def save(step):
        run.save(step, {"policy": policy}, {"policy": optimizer}, data={"data": batches})
        save_model_dir(opts.out_dir, policy, tok)

    for step in range(run.step + 1, max_steps + 1):           # step = optimizer steps done after this one
        t0 = time.time()
        lr = lr_at(step - 1, max_steps, opts.lr, opts.warmup_steps, "linear")
        set_lr(optimizer, lr)
        micro = [make_batch([train[i] for i in idx], opts, tok.pad_id, world.device) for idx in batches.next_step()]
        means_, grad_norm, l1, tokens = train_step(opts, ddp, policy, ref, optimizer, micro, batches.global_batch,
                                                   init_params)
        metrics = {**means_, "train/lr": lr, "train/grad_norm": grad_norm,
                   "train/tokens_per_s": tokens / max(time.time() - t0, 1e-9)}
        if opts.l1_coef:
            metrics["train/l1_delta"] = l1          # Σ|θ − θ_init| before this step's update
        if run.end_of_step(step, metrics, evaluate=lambda: evaluate_gathered(opts, policy, ref, evals, tok.pad_id,
                                                                             world.device), save=save):
            break
    run.finish({"policy": policy}, {"reference": ref},
              saved=f"saved {opts.out_dir} (HF {dist.unwrap(policy).architecture} layout)")
    return SimpleNamespace(policy=policy, ref=ref, optimizer=optimizer, options=opts)


if __name__ == "__main__":
    main()
