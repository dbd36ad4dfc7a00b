"""Online and self-play preference optimisation: sample from the current policy, let a judge compare the samples,
learn from the comparison, repeat. One loop, five methods, one flag apart.

Copied from the other scripts, so this file stands alone (tests/test_layout.py keeps each copy identical to its
original): train_dpo.py's pairwise losses (pair_loss, nll_weight and its DEFAULT_BETA / REFERENCE_FREE tables) and
train_ppo.py's log-prob gather (response_logprobs).

One step (docs/algorithms.md, "Online and self-play methods"):
  1. sample   k responses per prompt from π_θ at temperature τ, cut after the first stop token (as train_ppo.py);
              nash_md also samples k opponents per prompt from the geometric mixture π_θ^(1−β')·π_ref^β'
  2. judge    a pointwise judge (reward-model directory, gold, module:function, llm:MODEL_DIR: --judge) gives
              scores r, and P(a ≻ b) = σ(r(a) − r(b)) (Bradley–Terry); a pairwise judge (--pair_judge
              module:function) gives P(a ≻ b) directly, asked in both orders and made antisymmetric,
              ½(P(a ≻ b) + 1 − P(b ≻ a)), so a position bias cancels. Per prompt: the k×k matrix
              P_ij = P(y_i ≻ y_j), its logit D_ij (= r_i − r_j for a pointwise judge) and the win rates
              W_i = mean_{j≠i} P_ij
  3. examples and 4. update, per --method (S(y) = Σ_t log π(y_t | x, y_<t), u = S_θ − S_ref):
  online_dpo  every pair of the group (--pairs best_worst: best vs worst by Copeland wins = #{j: D_ij > 0} +
              ½#{j ≠ i: D_ij = 0}), each ordered by the sign of D_ij, kept when |D_ij| ≥ --margin (ties never),
              then ANY pairwise --loss of train_dpo.py, with soft labels for dpo and ipo: the pair's label is
              the judge's P_ij = σ(D_ij), not 1 (the dpo loss −P log σ(βh) − (1−P) log σ(−βh), ipo's target
              (P − ½)/τ; --labels hard: P = 1)                                Guo et al. 2024 (OAIF)
              + c · the same loss on --batch_size pairs of --offline_data (hard labels; default: the pairs the
              reward-model judge was fitted to)                  the hybrid objective (below); Song et al. 2024
  dno         the same, but best/worst by win rate W and the --margin on the win-rate gap W_i − W_j
              (with --ref_update_every N: iterative DPO)    Rosset et al. 2024 (DNO-Prct); Xiong et al. 2024
  sppo        (u(y) − η(P̂(y ≻ π_t) − ½))², P̂(y_i ≻ π_t) = W_i from the k samples; π_t = the reference
                                                                    Wu et al. 2024, the SPPO loss (Alg. 1)
  nash_md     y ~ π_θ, y′ ~ mixture; loss = β·Σ_t sg(log π_θ(y_t) − log π_ref(y_t))·log π_θ(y_t)
              − (P(y ≻ y′) − ½)·S_θ(y)       Munos et al. 2023 (Nash-MD-PG), as TRL's NashMDTrainer estimates it
  cringe      rejected responses (score < --cringe_threshold, or the group's worst) are negatives: at each of
              their tokens, −log(e^{s+} / (e^{s+} + e^{s−})), s = logits/τ, s− the negative token's, s+ that of a
              token sampled from the model's own top-k there (the negative token excluded); accepted responses
              (score ≥ threshold, or the group's best) get the MLE loss     Adolphs et al. 2022 (the CRINGE loss)
  --ref_update_every N makes the reference a copy of the policy after every N-th step (0 = never): iterative
  DPO / DNO, and SPPO's π_t (with 0, SPPO runs a single iteration against the initial policy).

Run:
    python train_online.py                                          # online DPO, judge out/rm -> out/online_dpo
    python train_online.py --judge gold --loss ipo                  # the built-in task's gold reward as judge
    python train_online.py --method sppo --judge gold --ref_update_every 10
    python train_online.py --method nash_md --judge out/rm --mixture_coef 0.125
    python train_online.py --method dno --pair_judge my_judges.py:prefer --judge "" --ref_update_every 20
    python train_online.py --method cringe --judge gold --cringe_threshold 0.5
    python train_online.py --judge llm:out/sft --judge_template my_template.txt   # LLM-as-a-judge (self-rewarding)
    torchrun --nproc_per_node 2 train_online.py --method sppo
    torchrun --nproc_per_node 2 train_online.py --fsdp          # sampling on gathered weights, as train_ppo.py
    python train_online.py --lora_r 16                          # adapters; the reference: the policy with them off

Why soft labels and every pair by default: with a hard label, a score gap of 0.01 is as certain as a gap of 5, so
the sigmoid loss keeps widening the margin toward whatever the judge prefers, its blind spots included (measured:
with a reward-model judge, hard best-vs-worst pairs ended below the SFT model; docs/results.md, "Online DPO that
does not hack its judge"). With P = σ(r_w − r_l) as the label the dpo loss's optimum is π ∝ π_ref·exp(r/β), the
KL-regularised optimum PPO aims at, whichever pairs are sampled; every pair of a group uses all k(k−1)/2
comparisons at no extra forward pass, and leans less on the two extremes, where a reward model is least reliable.
Why the judge's own training pairs join by default: a reward model is a lossy summary of them (held-out accuracy
0.6-0.7 on our tasks), and the online loss alone settles in its blind spots (longer answers: measured, docs/results.md);
the pairs carry what people said. Their hard-labelled loss beside the online one (HyPO's hybrid, Song et al. 2024)
teaches what the labels say where the judge errs, the fresh samples what the pairs do not cover. A judge with no
recorded pairs (gold, a function, an LLM) trains online only; --offline_data= turns them off.

Choices: every log-prob (and CRINGE's logits) uses logits/τ, as train_ppo.py; one optimizer step per rollout
(on-policy); each rank samples and judges its own prompts' groups, so group statistics need no communication;
sampling draws its uniform numbers from a generator per (step, prompt, sample), so the samples do not depend
on how prompts are split across ranks (N ranks ≡ one process) and a resumed run samples what it would have.
The judge and its preferences are nano_rlhf/reward.py's (load_judge, preference_matrix, symmetric_preference), the
same code as train_ppo.py's SPO and the labelling tool: a pairwise judge is asked about every ordered pair i ≠ j of
a group (Nash-MD: the sample and its opponent in both orders), in one call per step.
"""
import copy
import math
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from nano_rlhf import dist, lora, parallel
from nano_rlhf import reward as reward_mod
from nano_rlhf import training
from nano_rlhf.checkpoint import save_model_dir
from nano_rlhf.cli import FrozenModelOptions, RunOptions, parse_args
from nano_rlhf.data import (Batches, default_path, load_prompts, load_records, pad_left, prompt_limit,
                            tokenize_pairs, tokenize_prompts, training_length)
from nano_rlhf.evaluate import eval_metrics
from nano_rlhf.model import GPT
from nano_rlhf.reward import (LLM, bradley_terry, check_specs, load_judge, model_dir as judge_dir, preference_matrix,
                              symmetric_preference)
from nano_rlhf.rollout import Rollout, judge_scores, sample_mixture_groups
from nano_rlhf.sampling import SamplingOptions
from nano_rlhf.training import autocast, check_device, check_vocab, fail, input_errors, lr_at, set_lr, warn_short_warmup
from nano_rlhf.watch import KLWatch, Watch, check_step, watch_kl

PAIRWISE = ("online_dpo", "dno")           # methods that build (chosen, rejected) pairs for a train_dpo.py loss
# the pairwise losses of train_dpo.py (its --loss table minus tdpo, whose token KL needs the reference's hidden
# states at every position): pair_loss below, train_dpo.py's to the character
PAIR_LOSSES = ("dpo", "robust", "ipo", "hinge", "rdpo", "simpo", "cpo", "orpo")
SOFT_LOSSES = ("dpo", "ipo")      # the pair losses with a soft-label form (--labels soft)


PairLoss = Literal["dpo", "robust", "ipo", "hinge", "rdpo", "simpo", "cpo", "orpo"]   # train_dpo.py's pair losses


@dataclass
class Options(FrozenModelOptions, RunOptions):
    method: Literal["online_dpo", "dno", "sppo", "nash_md", "cringe"] = "online_dpo"  # which online method
    judge: str = "out/rm"         # reward-model dir, gold, module:function, llm:MODEL_DIR; empty = --pair_judge only
    pair_judge: str = ""          # pairwise judge module:function(prompts, a, b) -> P(a ≻ b), asked both ways
    judge_template: str = ""      # --judge llm:MODEL_DIR: template with {prompt} and {response}; empty = the default
    loss: PairLoss = "dpo"        # train_dpo.py's pair loss [with method=online_dpo|dno]
    labels: Literal["auto", "soft", "hard"] = "auto"  # soft = a pair's label is the judge's own P(y_w ≻ y_l)
                                                      # (dpo: label smoothing 1 − P; ipo: target (P − ½)/τ), so a
                                                      # tiny score gap is a weak label; hard = the order is certain
                                                      # (TRL's); auto = soft for dpo and ipo, hard for the losses
                                                      # without a soft form [with method=online_dpo|dno]
    beta: Optional[float] = None  # pair loss β (train_dpo.py's default per loss); nash_md: KL coefficient β (none =
                                  # 0.1) [with method=online_dpo|dno|nash_md] {> 0}
    label_smoothing: float = 0.0  # pair loss ε [with method=online_dpo|dno and loss=dpo|robust] {0 <= x < 0.5}
    gamma: float = 0.5            # SimPO target margin γ [with method=online_dpo|dno and loss=simpo] {>= 0}
    alpha: Optional[float] = None # rdpo length coefficient (none = 0.01); cpo NLL weight (none = 1.0)
                                  # [with method=online_dpo|dno and loss=rdpo|cpo] {>= 0}
    lam: float = 0.1              # ORPO weight λ [with method=online_dpo|dno and loss=orpo] {>= 0}
    nll_coef: float = 0.0         # add this × NLL(chosen) (RPO) [with method=online_dpo|dno] {>= 0}
    pairs: Literal["all", "best_worst"] = "all"  # which pairs of each group (every pair, or the best against the
                                                 # worst) [with method=online_dpo|dno]
    margin: float = 0.0           # keep a pair when its gap ≥ this (online_dpo: logit of P, = score gap; dno: win-rate
                                  # gap) [with method=online_dpo|dno] {>= 0}
    offline_data: str = "judge"   # preference JSONL joining every step: the hybrid objective adds --offline_coef x
                                  # the pair loss over --batch_size of its pairs, labelled by the file's order;
                                  # judge = the pairs the --judge reward model was fitted to (its train_config.json),
                                  # when it names them; empty = online pairs only [with method=online_dpo|dno]
    offline_coef: float = 1.0     # weight of the offline pairs' mean loss [with offline_data] {>= 0}
    ref_update_every: int = 0     # the reference becomes a copy of the policy after every N steps; 0 = never {>= 0}
    eta: float = 10.0             # SPPO η: the target log-ratio is η(P̂ − ½) [with method=sppo] {> 0}
    mixture_coef: float = 0.5     # Nash-MD β′: opponents sample from π_θ^(1−β′)·π_ref^β′ (per token)
                                  # [with method=nash_md] {0 <= x <= 1}
    cringe_threshold: Optional[float] = None  # score < this = negative, ≥ = positive; none = the group's worst / best
                                              # [with method=cringe]
    cringe_topk: int = 5          # positive tokens are sampled from the model's top-k [with method=cringe] {>= 1}
    cringe_alpha: float = 1.0     # weight of the contrastive term beside the MLE term [with method=cringe] {>= 0}
    kl_warn: float = 2.0          # warn once if the KL to the initial ref jumps past this (nats); 0 = off {>= 0}
    score_warn: float = 3.0       # warn once if the mean judge score leaves the first step's mean ± this × its sd
                                  # (nano_rlhf/watch.py; collapsed responses are always warned about); 0 = off {>= 0}
    missing_eos_penalty: Optional[float] = None  # subtracted from the --judge score of a response with no stop token
                                                 # (TRL's); none = off {>= 0}
    init: str = "out/sft"         # policy to start from (also the reference unless --ref)
    ref: str = ""                 # reference policy directory; empty = --init
    prompts: str = ""             # prompts JSONL {"prompt": ...}; empty = built-in task
    eval_prompts: str = ""        # held-out prompts; empty = built-in task's, or split --eval_fraction off --prompts
    eval_fraction: float = 0.05   # share of --prompts held out when no --eval_prompts {0 < x < 1}
    out_dir: str = ""             # output directory; empty = out/<method>
    batch_size: int = 8           # prompts per device per step {>= 1}
    samples_per_prompt: int = 4   # k responses per prompt (nash_md: k policy samples, each against its own opponent)
                                  # {>= 1}
    max_new_tokens: int = 40      # response length limit {>= 1}
    temperature: float = 1.0      # sampling temperature; log-probs use logits / τ everywhere {> 0}
    max_prompt_len: int = 0       # prompts are left-truncated to this; 0 = min(block_size, 1024) − max_new_tokens
                                  # {>= 0}
    lr: Optional[float] = None    # learning rate (constant after warm-up); none = 1e-4 for online_dpo and dno (as
                                  # train_dpo.py, whose losses they train), else 5e-5; 0.5-1.5B models: 5e-7
                                  # {0 <= x <= 1e3}
    warmup_steps: int = 0         # linear warm-up steps {>= 0}
    weight_decay: float = 0.0     # AdamW decoupled weight decay (matrices only) {>= 0}
    beta1: float = 0.9            # AdamW beta1 {0 <= x < 1}
    beta2: float = 0.95           # AdamW beta2 {0 <= x < 1}
    grad_clip: float = 1.0        # clip the global gradient norm (0 = off) {>= 0}
    max_steps: int = 100          # sample + judge + update iterations {>= 1}
    seed: int = 0                 # seed of the prompt order and of every sample
    log_interval: int = 1         # print and log every N steps {>= 1}
    eval_interval: int = 20       # evaluate on held-out prompts every N steps (and at the end); 0 = end only {>= 0}
    eval_samples: int = 128       # held-out prompts sampled per evaluation {>= 1}
    save_interval: int = 50       # checkpoint every N steps (and at the end); 0 = only at the end {>= 0}


def fill_defaults(opts):
    """The defaults that depend on --method and --loss, filled in right after parsing (run.json records the filled
    values): soft labels where the loss has a soft form and no --label_smoothing was asked for; the learning rate."""
    if opts.method in PAIRWISE:
        if opts.labels == "auto":
            opts.labels = "soft" if opts.loss in SOFT_LOSSES and not opts.label_smoothing else "hard"
        opts.beta = DEFAULT_BETA.get(opts.loss, 0.1) if opts.beta is None else opts.beta
        opts.alpha = (1.0 if opts.loss == "cpo" else 0.01) if opts.alpha is None else opts.alpha
    elif opts.method == "nash_md":
        opts.beta = 0.1 if opts.beta is None else opts.beta
    if opts.lr is None:
        opts.lr = 1e-4 if opts.method in PAIRWISE else 5e-5
    opts.out_dir = opts.out_dir or f"out/{opts.method}"


# ---- the pairwise losses and the log-prob gather, as train_dpo.py and train_ppo.py have them (tests/test_layout.py
# keeps the copies identical) -----------------------------------------------------------------------------------

REFERENCE_FREE = ("simpo", "cpo", "orpo")
# β defaults: 0.1, except SimPO (its reward is a per-token mean, so it needs a larger scale, as in the paper)
# and IPO (τ sets the target margin 1/(2τ) of the per-token log-ratio: 0.1 would ask for 5 nats per token)
DEFAULT_BETA = {"simpo": 2.0, "ipo": 0.5}


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


def response_logprobs(model, ids, attn, response_mask, temperature, with_entropy=False):
    """log π(y_t | ...) at temperature τ for each response token, (B, R), 0 on padding; optionally the
    entropy of π(· | ...) at those positions too.

    ids = [left-padded prompt (P) | response (R)]; the hidden state at position P−1+t predicts response token t.
    Only those positions go through the output layer, in chunks (token_logprobs: a real vocabulary's logits
    are the largest tensors of a step), in float32 for the log-softmax, inside the model's forward (what DDP
    hooks and --compile compiles). response_mask and attn may be the host's copies: the positions are then found
    there, as flat indices, so that a GPU forward waits for no read.
    """
    B, T = ids.shape
    R = response_mask.shape[1]
    rows, cols = response_mask.nonzero(as_tuple=True)             # the response tokens, row by row
    positions = (rows * T + (T - R - 1) + cols).to(ids.device, non_blocking=True)   # b·T + P−1+t: predicting
    at = (rows * R + cols).to(ids.device, non_blocking=True)      # b·R + t: where each goes in the (B, R) output
    targets = ids.flatten()[positions + 1]                        # y_t
    res = model(ids, attn, select=positions, targets=targets, temperature=temperature,
                with_entropy=with_entropy)                        # log π(y_t) [, H = −Σ p log p]
    parts = res if with_entropy else (res,)
    out = [torch.zeros(B * R, device=ids.device, dtype=x.dtype).index_copy_(0, at, x).view(B, R) for x in parts]
    return tuple(out) if with_entropy else out[0]


# ---- the losses: pure functions, float64-testable ----------------------------------------------

def sppo_loss(logp, ref_logp, p_hat, eta):
    """SPPO (Wu et al. 2024, the loss of Alg. 1): (log π_θ(y)/π_t(y) − η(P̂(y ≻ π_t) − ½))² per response; logp,
    ref_logp are summed sequence log-probs S_θ, S_t (B,), p_hat the estimated win probability against π_t (B,)."""
    return (logp - ref_logp - eta * (p_hat - 0.5)) ** 2


def nash_md_loss(logp, ref_logp, mask, prob, beta):
    """Nash-MD policy gradient (Munos et al. 2023, Nash-MD-PG, in the form of TRL's NashMDTrainer), per response (B,).
    logp, ref_logp: (B, R) per-token log π_θ and log π_ref of y ~ π_θ; mask (B, R); prob: P(y ≻ y′) against the
    mixture's y′ (B,), detached. REINFORCE with ½ as the control variate: −(P − ½)·S_θ(y); the KL(π_θ‖π_ref)
    regulariser by its score-function estimate Σ_t sg(log π_θ − log π_ref)·log π_θ, weighted by β."""
    log_ratio = (logp - ref_logp).detach()
    kl_term = (log_ratio * logp * mask).sum(1)
    return beta * kl_term - (prob - 0.5) * (logp * mask).sum(1)


def cringe_loss(logits, negative, positive):
    """CRINGE token loss (Adolphs et al. 2022): −log(e^{s+} / (e^{s+} + e^{s−})) = softplus(s− − s+) per
    negative token. logits (N, V) at the negative tokens' positions, negative (N,) the negative tokens, positive
    (N,) the sampled positive tokens (cringe_positives)."""
    s_neg = logits.gather(-1, negative[:, None]).squeeze(-1)
    s_pos = logits.gather(-1, positive[:, None]).squeeze(-1)
    return F.softplus(s_neg - s_pos)


def cringe_positives(logits, negative, top_k, generator=None):
    """CRINGE's positive token at each position: a sample from softmax over the model's top-k logits, the negative
    token excluded (it must not be its own contrast). Not differentiable: the ids are returned."""
    masked = logits.detach().float().scatter(-1, negative[:, None], float("-inf"))
    top = masked.topk(min(top_k, logits.shape[-1] - 1), dim=-1)
    pick = torch.multinomial(top.values.softmax(-1), 1, generator=generator)
    return top.indices.gather(-1, pick).squeeze(-1)


# ---- group preferences and example selection: pure functions -----------------------------------

def preference_logits(pref, scores=None):
    """D, the logit of the preferences P = pref (..., k, k): log P − log(1 − P), antisymmetric when P is; 0 on
    the diagonal (P = ½). From pointwise scores r (..., k), whose P is Bradley–Terry, D_ij = r_i − r_j exactly
    (no round trip through σ, which saturates)."""
    if scores is not None:
        scores = torch.as_tensor(scores, dtype=torch.float64)
        return scores[..., :, None] - scores[..., None, :]
    return torch.log(pref) - torch.log1p(-pref)


def win_rates(pref):
    """W_i = mean_{j≠i} P(y_i ≻ y_j), pref (k, k) = P: the estimate of P(y_i ≻ π) from the group (SPPO's P̂,
    DNO's ranking)."""
    k = pref.shape[0]
    return (pref.sum(1) - pref.diagonal()) / (k - 1)


def copeland(pref_logits):
    """Copeland score of each sample from D = pref_logits (k, k): pairwise wins, a tie counting ½ (the diagonal
    is not a tie)."""
    return (pref_logits > 0).double().sum(1) + 0.5 * ((pref_logits == 0).double().sum(1) - 1)


def select_pairs(gap, rank_key, pairs="best_worst", margin=0.0):
    """(chosen, rejected) index pairs of one group. gap (k, k), antisymmetric: how much y_i beats y_j; rank_key
    (k,): best = its first maximum, worst = its first minimum. Each candidate pair is ordered by the sign of its
    gap and kept when the gap is > 0 and ≥ margin: ties (gap 0) are never pairs."""
    k = gap.shape[0]
    key = rank_key.tolist()
    if pairs == "best_worst":
        candidates = [(key.index(max(key)), key.index(min(key)))]
    else:
        candidates = [(i, j) for i in range(k) for j in range(i + 1, k)]
    out = []
    for i, j in candidates:
        g = float(gap[i, j])
        if g < 0:
            i, j, g = j, i, -g
        if g > 0 and g >= margin:
            out.append((i, j))
    return out


def cringe_labels(scores, threshold=None):
    """Per response of one group: +1 accepted (MLE), −1 rejected (CRINGE), 0 unused. With a threshold: score ≥ it
    accepted, below it rejected; without: the group's best accepted and its worst rejected (first of equals),
    nothing when every score is equal."""
    scores = torch.as_tensor(scores, dtype=torch.float64)
    if threshold is not None:
        return torch.where(scores >= threshold, 1, -1)
    labels = torch.zeros(len(scores), dtype=torch.long)
    if scores.max() > scores.min():
        key = scores.tolist()
        labels[key.index(max(key))], labels[key.index(min(key))] = 1, -1
    return labels


def group_preferences(judge, samples: Rollout, k, tok, penalty=None):
    """Per group of k: (pref, pref_logits), and the judge's pointwise scores (G, k) (None for a pairwise-only
    judge). pref (k, k), P_ij = P(y_i ≻ y_j), is nano_rlhf.reward.preference_matrix: Bradley–Terry on the scores
    (those of judge_scores: the sampled ids, the missing-end-of-text penalty), or, when given, the pairwise judge
    asked about every ordered pair and made antisymmetric (the rule SPO and the labelling tool use);
    pref_logits = preference_logits (D)."""
    n_groups = len(samples.completions) // k
    scores = judge_scores(judge, samples, tok, penalty).view(n_groups, k) if judge.pointwise is not None else None
    pref = preference_matrix(judge, samples.prompts, samples.completions, k,
                             scores=None if scores is None else scores.flatten())
    pref_logits = preference_logits(pref, scores if judge.pairwise is None else None)
    return list(zip(pref, pref_logits)), scores


# ---- one update per method ---------------------------------------------------------------------

def seq_logps(model, samples: Rollout, opts):
    """Per-token log π(y_t) at τ (N, R) (through the DDP wrapper when given one) and S = Σ_t (N,)."""
    with autocast(samples.query_response.device, opts.dtype):
        lp = response_logprobs(model, samples.query_response, samples.attention_mask, samples.response_mask,
                               opts.temperature)
    return lp, (lp * samples.response_mask).sum(1)


@torch.no_grad()
def kl_sum(S, S_ref, ref, init_ref, samples, opts):
    """Σ over this rank's samples of S_θ(y) − S_0(y), y ~ π_θ: the k1 estimate of the sequence KL(π_θ ‖ π_0) to the
    initial reference (at τ), times the number of samples; every step, so a run-away (1 → 15 nats between two
    evaluations, seen on a held-back task) is seen when it starts. S_ref is reused when the reference is π_0."""
    S_0 = S_ref if ref is init_ref and S_ref is not None else seq_logps(init_ref, samples, opts)[1]
    return float((S.detach() - S_0).sum())


def pairwise_terms(opts, policy, ref, samples, pairs, init_ref=None, probs=None):
    """online_dpo / dno: Σ of train_dpo.pair_loss over this rank's pairs (with graph), Σ NLL(chosen) (with graph)
    and sums for the log (with init_ref: the KL to it over all samples, kl_sum)."""
    _, S = seq_logps(policy, samples, opts)
    S_ref = None if ref is None else seq_logps(ref, samples, opts)[1].detach()
    chosen = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=S.device)
    rejected = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=S.device)
    lengths = samples.response_mask.sum(1)
    ref_chosen, ref_rejected = (None, None) if S_ref is None else (S_ref[chosen], S_ref[rejected])
    loss_opts = opts
    if probs is not None:          # --labels soft: each pair's own label smoothing, 1 − P(y_w ≻ y_l)
        loss_opts = copy.copy(opts)
        loss_opts.label_smoothing = 1 - torch.tensor(probs, dtype=S.dtype, device=S.device)
    loss, reward_chosen, reward_rejected = pair_loss(loss_opts, S[chosen], S[rejected], ref_chosen,
                                                               ref_rejected, lengths[chosen], lengths[rejected])
    sums = {"loss": loss.sum(), "rewards_chosen": reward_chosen.sum(), "rewards_rejected": reward_rejected.sum(),
            "reward_accuracy": (reward_chosen > reward_rejected).float().sum(),
            "reward_margin": (reward_chosen - reward_rejected).sum()}
    if init_ref is not None:
        sums["kl"] = kl_sum(S, S_ref, ref, init_ref, samples, opts)
    # a rank without pairs still runs its backward (DDP all-reduces every rank's gradients): 0·S keeps the graph
    return loss.sum() + 0 * S.sum(), -S[chosen].sum(), sums


def pairs_as_rollout(examples, pad_id, device):
    """Tokenized preference pairs (data.tokenize_pairs) in the samples' layout, so their log-probs are read as the
    samples' are: rows 0..B−1 each pair's chosen response, rows B..2B−1 its rejected one, each row
    [left padding | prompt | response] ending at the last column, and the response mask over the last R columns
    (R = the longest response; a shorter one's prompt tokens there are context, as is a tool turn inside a
    response). Why not a prompt block then a response block, as sampling lays them out: the longest prompt and
    the longest response of different pairs could together exceed the context; this is as wide as one pair."""
    keys = ("chosen", "rejected")
    seqs = [e["prompt"] + e[key] for key in keys for e in examples]
    masks = [e.get(f"{key}_mask", [1] * len(e[key])) for key in keys for e in examples]
    R = max(len(m) for m in masks)
    return Rollout(query_response=pad_left(seqs, pad_id).to(device),
                   attention_mask=pad_left([[1] * len(x) for x in seqs], 0).to(device),
                   response_mask=pad_left(masks, 0, R).float().to(device),
                   has_eos=torch.ones(len(seqs), device=device), completions=[])


def offline_backward(opts, policy, ref, pairs: Rollout):
    """--offline_data, the hybrid objective's offline half: backward of c · the mean pair loss over all ranks'
    offline pairs (rows: the chosen, then the rejected), each labelled by the file's order (hard). With gradient
    sync: it runs after the online half's backward, which ran without. Returns the log's sums."""
    n = dist.all_reduce_sum(float(pairs.query_response.shape[0] // 2))
    _, S = seq_logps(policy, pairs, opts)
    with torch.no_grad():
        S_ref = None if ref is None else seq_logps(ref, pairs, opts)[1]
    (pi_w, pi_l), (len_w, len_l) = S.chunk(2), pairs.response_mask.sum(1).chunk(2)
    ref_w, ref_l = (None, None) if S_ref is None else S_ref.chunk(2)
    loss, reward_w, reward_l = pair_loss(opts, pi_w, pi_l, ref_w, ref_l, len_w, len_l)
    (opts.offline_coef * loss.sum() / n * dist.ddp_scale()).backward()
    return {"offline_loss": (float(loss.detach().sum()), n),
            "offline_accuracy": (float((reward_w > reward_l).float().sum()), n)}


def step_objective(opts, policy, ref, samples, groups, step, prob=None, accept_key=None, init_ref=None):
    """This rank's share of the step's objective (with graph, divided by the global counts; None when no rank has
    anything to learn from) and the log's figures as {name: (this rank's sum, global denominator)}. The counts
    are all-reduced first, so every rank divides by the same numbers. With init_ref, every method also logs kl,
    the mean sequence KL of its samples to init_ref (CRINGE, which needs no sequence log-probs, at the cost of one
    forward of the policy and one of init_ref without gradients)."""
    k, device = opts.samples_per_prompt, samples.query_response.device
    n = dist.all_reduce_sum(float(samples.query_response.shape[0]))
    if opts.method in PAIRWISE:
        pairs, probs = [], []
        for g, (pref, pref_logits) in enumerate(groups):
            if opts.method == "online_dpo":
                gap, key = pref_logits, copeland(pref_logits)
            else:
                win_rate = win_rates(pref)
                gap, key = win_rate[:, None] - win_rate[None, :], win_rate
            chosen_rejected = select_pairs(gap, key, opts.pairs, opts.margin)
            pairs += [(g * k + i, g * k + j) for i, j in chosen_rejected]
            probs += [float(torch.sigmoid(pref_logits[i, j])) for i, j in chosen_rejected]
        chosen_tokens = sum(float(samples.response_mask[i].sum()) for i, _ in pairs)
        n_pairs, n_chosen = dist.all_reduce_sum(torch.tensor([len(pairs), chosen_tokens], dtype=torch.float64)).tolist()
        if n_pairs == 0:                 # nothing to learn from; the KL of the samples is still news
            if init_ref is None:
                return None, {"pairs": (0.0, 1)}
            with torch.no_grad():
                S = seq_logps(policy, samples, opts)[1]
            return None, {"pairs": (0.0, 1), "kl": (kl_sum(S, None, None, init_ref, samples, opts), n)}
        loss_sum, nll_sum, sums = pairwise_terms(opts, policy, ref, samples, pairs, init_ref,
                                                 probs if opts.labels == "soft" else None)
        kl = {"kl": (sums.pop("kl"), n)} if "kl" in sums else {}
        objective = loss_sum / n_pairs                                  # mean over the step's pairs (all ranks) ...
        nll_w = nll_weight(opts)
        if nll_w:                                                       # ... + w · token-mean NLL(y_w), as train_dpo
            objective = objective + nll_w * nll_sum / max(n_chosen, 1)
        log = {name: (float(v.detach()), n_pairs) for name, v in sums.items()}
        return objective, {**log, **kl, "pairs": (float(len(pairs)), 1),
                           "nll": (float(nll_sum.detach()), max(n_chosen, 1))}
    kl = (lambda S, S_ref: {"kl": (kl_sum(S, S_ref, ref, init_ref, samples, opts), n)}) if init_ref is not None \
        else (lambda S, S_ref: {})
    if opts.method == "sppo":
        p_hat = torch.cat([win_rates(pref) for pref, _ in groups]).to(device, torch.float32)
        _, S = seq_logps(policy, samples, opts)
        S_ref = seq_logps(ref, samples, opts)[1].detach()
        loss = sppo_loss(S, S_ref, p_hat, opts.eta)
        return loss.sum() / n, {"loss": (float(loss.detach().sum()), n), "p_hat": (float(p_hat.sum()), n),
                                "log_ratio": (float((S.detach() - S_ref).sum()), n), **kl(S, S_ref)}
    if opts.method == "nash_md":
        lp, S = seq_logps(policy, samples, opts)
        ref_lp, S_ref = (t.detach() for t in seq_logps(ref, samples, opts))
        loss = nash_md_loss(lp, ref_lp, samples.response_mask, prob.to(lp), opts.beta)
        return loss.sum() / n, {"loss": (float(loss.detach().sum()), n), "probability": (float(prob.sum()), n),
                                **(kl(S, S_ref) if init_ref is not None else
                                   {"kl": (float(((lp.detach() - ref_lp) * samples.response_mask).sum()), n)})}
    # cringe: accepted responses' tokens get the MLE loss, rejected responses' tokens the CRINGE loss
    labels = torch.cat([cringe_labels(g, opts.cringe_threshold) for g in accept_key]).to(device)
    valid = samples.response_mask.bool()
    is_pos = (labels == 1)[:, None].expand_as(valid)[valid]            # per response token, row-major
    is_neg = (labels == -1)[:, None].expand_as(valid)[valid]
    n_pos, n_neg = dist.all_reduce_sum(torch.tensor([float(is_pos.sum()), float(is_neg.sum())],
                                                    dtype=torch.float64)).tolist()
    kl_log = {}
    if init_ref is not None:       # the KL the warning watches: S_θ − S_0 of the samples, one extra forward each
        with torch.no_grad():
            kl_log = {"kl": (kl_sum(seq_logps(policy, samples, opts)[1], None, None, init_ref, samples, opts), n)}
    if n_pos + n_neg == 0:
        return None, {"positive_tokens": (0.0, 1), "negative_tokens": (0.0, 1), **kl_log}
    prompt_len = samples.query_response.shape[1] - samples.response_mask.shape[1]
    sel = torch.zeros_like(samples.query_response, dtype=torch.bool)
    sel[:, prompt_len - 1:-1] = valid                          # the positions predicting response tokens
    with autocast(device, opts.dtype):
        hidden = policy(samples.query_response, samples.attention_mask, select=sel, return_hidden=True)
    logits = F.linear(hidden, dist.unwrap(policy).output_weight()).float() / opts.temperature   # (M, V)
    targets = samples.query_response[:, prompt_len:][valid]
    nll = F.cross_entropy(logits, targets, reduction="none")
    # the positive tokens: a fresh generator per (step, rank), so a resumed run draws what it would have
    seed = (opts.seed * 1_000_003 + step * 1009 + dist.world().rank) % 2 ** 63
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    cr = cringe_loss(logits, targets, cringe_positives(logits, targets, opts.cringe_topk, gen))
    nll_sum, cr_sum = (nll * is_pos).sum(), (cr * is_neg).sum()
    objective = nll_sum / max(n_pos, 1) + opts.cringe_alpha * cr_sum / max(n_neg, 1)
    return objective, {"loss": (float(objective.detach()), 1), "positive_tokens": (float(is_pos.sum()), 1),
                       "negative_tokens": (float(is_neg.sum()), 1), "nll": (float(nll_sum.detach()), max(n_pos, 1)),
                       "cringe_loss": (float(cr_sum.detach()), max(n_neg, 1)), **kl_log}


def step_metrics(samples: Rollout, scores, stats, gold):
    """The step's figures over all ranks, in one all-reduce: sequence means (judge score, gold reward, length,
    end-of-text rate) and the method's {name: (this rank's sum, global denominator)}."""
    seq = {"response_length": samples.response_mask.sum(1), "eos_rate": samples.has_eos}
    if scores is not None:
        seq["score"] = scores.flatten()
    if gold is not None:
        seq["gold_reward"] = torch.tensor(gold(samples.prompts, samples.completions))
    names = ["sequences", *seq, *stats]
    local = [float(samples.query_response.shape[0]), *(float(v.sum()) for v in seq.values()),
             *(v[0] for v in stats.values())]
    total = dict(zip(names, dist.all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()))
    metrics = {f"train/{k}": total[k] / total["sequences"] for k in seq}
    metrics.update({f"train/{k}": total[k] / denominator for k, (_, denominator) in stats.items()})
    return metrics


# ---- set-up ------------------------------------------------------------------------------------

def check_options(opts):
    """--device one this machine has, then the rules between options; each option's own range is declared on Options
    (checked on parsing)."""
    check_device(opts.device)
    method = opts.method
    msg = lora.check_lora_options(opts)
    if msg:
        fail(msg, 2)
    if opts.fsdp and opts.ref_update_every:   # the reference would be a sharded copy rewritten every N steps
        fail("--ref_update_every with --fsdp is not supported yet", 2)
    if method == "nash_md" and lora.shares_base(opts, opts.ref):
        # the mixture sampler runs the reference's blocks directly (a KV cache per model), which the adapters-off
        # view of the policy does not switch: it would sample from the adapted policy twice
        fail("--method nash_md with --lora_r needs a separate --ref DIR (not --init): its mixture sampler cannot "
             "use the policy with its adapters off as the reference", 2)
    # the judge flags as train_ppo.py's SPO reads them (nano_rlhf/reward.py), refused before out_dir is touched
    check_specs(opts.judge or None, opts.pair_judge or None, opts.judge_template)
    llm = opts.judge.startswith(LLM)
    if opts.judge and not llm and opts.judge != reward_mod.GOLD and not reward_mod.is_function_spec(opts.judge) \
            and not os.path.isdir(opts.judge):
        fail(f"--judge {opts.judge}: not a directory, gold, llm:MODEL_DIR, or module:function / "
             "path/to/file.py:function", 2)
    if opts.judge and not llm and reward_mod.is_function_spec(opts.judge):
        reward_mod.load_function(opts.judge, "--judge")          # its import errors name --judge, not --reward
    if method != "nash_md" and opts.samples_per_prompt < 2:
        fail(f"--method {method} compares the samples of a prompt: it needs --samples_per_prompt >= 2", 2)
    if opts.ref_update_every and not needs_reference(opts):
        fail(f"--ref_update_every has no effect with --method {method}" + (f" --loss {opts.loss} (reference-free)"
                                                                      if method in PAIRWISE else ""), 2)
    if method == "cringe" and opts.cringe_threshold is not None and not opts.judge:
        fail("--cringe_threshold compares scores: it needs a pointwise --judge", 2)
    if opts.missing_eos_penalty and (not opts.judge or opts.pair_judge):
        fail("--missing_eos_penalty lowers a --judge score: it needs a pointwise --judge and no --pair_judge "
             "(whose preferences it would not change)", 2)
    # a flag the method would ignore is refused by the parser: each declares when it applies ([with ...])
    if method in PAIRWISE:
        if opts.labels == "soft" and opts.loss not in SOFT_LOSSES:
            fail(f"--labels soft: --loss {opts.loss} has no soft-label form (only {' and '.join(SOFT_LOSSES)})", 2)
        if opts.labels == "soft" and opts.label_smoothing:
            fail("--labels soft sets each pair's label smoothing from the judge: pass --labels hard with "
                 "--label_smoothing", 2)


def offline_file(opts):
    """--offline_data resolved: (the preference file, "") or ("", why there is none)."""
    if opts.method not in PAIRWISE or not opts.offline_data:
        return "", "off"
    return reward_mod.training_pairs(opts.judge) if opts.offline_data == "judge" else (opts.offline_data, "")


def needs_reference(opts):
    """A training reference: every method but CRINGE and a reference-free pair loss (simpo, cpo, orpo)."""
    return opts.method != "cringe" and not (opts.method in PAIRWISE and opts.loss in REFERENCE_FREE)


def load_models(opts, tok, run, training_copy):
    """The policy (--lora_r: with adapters, what they add to the run's identity recorded), the initial reference
    (the KL of the evaluation is always to it; --lora_r with the reference = --init: the policy with its adapters
    off, no second copy) and, with training_copy (--ref_update_every), the training reference: a separate copy
    that is replaced with the policy every N steps (else None: training uses the initial reference). Raises on
    bad input (one line via input_errors)."""
    policy = GPT.from_pretrained(opts.init, dropout=0.0)
    check_vocab(tok, policy.cfg, opts.init)
    ref_dir = opts.ref or opts.init
    run.identity.update(lora.attach(policy, opts, opts.init))      # --lora_r: adapters, the base frozen
    if lora.shares_base(opts, opts.ref):
        init_ref = lora.BaseView(policy)
    else:
        init_ref = GPT.from_pretrained(ref_dir, dropout=0.0).requires_grad_(False).eval()
        check_vocab(tok, init_ref.cfg, ref_dir)
    if init_ref.cfg.vocab_size != policy.cfg.vocab_size:     # Nash-MD adds their logits; every method compares them
        raise ValueError(f"{ref_dir}: the reference's vocabulary ({init_ref.cfg.vocab_size}) differs from the "
                         f"policy's ({policy.cfg.vocab_size})")
    copy = GPT.from_pretrained(ref_dir, dropout=0.0).requires_grad_(False).eval() if training_copy else None
    return policy, init_ref, copy


def run_record(opts):
    """The inputs the run only reads (the judge's model or code file too) and its data files (its options are
    its identity: nano_rlhf/training.py)."""
    return dict(inputs={"init": opts.init, "ref": opts.ref,
                        "judge": judge_dir(opts.judge) or reward_mod.code_file(opts.judge),
                        "pair_judge": reward_mod.code_file(opts.pair_judge)},
                data_files={"prompts": opts.prompts or default_path("prompts"),
                            "eval_prompts": opts.eval_prompts, "offline_data": offline_file(opts)[0]})


def startup_line(opts, n_prompts, prompt_stats, step, offline):
    """The run's one-line summary printed at start-up (step: where a --resume goes on)."""
    return (f"{opts.method.upper()} | judge {opts.judge or '-'}"
            f"{' + pairwise ' + opts.pair_judge if opts.pair_judge else ''}"
            f" | {n_prompts:,} prompts ({prompt_stats}) | {opts.batch_size} prompts x {opts.samples_per_prompt} "
            f"samples x {dist.world().world_size} ranks per step"
            + (f" | --loss {opts.loss}, {opts.labels} labels, {opts.pairs.replace('_', '/')} pairs, offline pairs "
               f"{offline}" if opts.method in PAIRWISE else "")
            + " | reference update every "
            f"{opts.ref_update_every or 'never'} | {opts.max_steps} steps"
            + (f" | resuming at step {step}" if step else ""))


SHOW = ["train/loss", "train/pairs", "train/offline_loss", "train/score", "train/gold_reward",
        "train/response_length", "time/rollout_frac", "eval/gold_reward", "eval/rm_score", "eval/reward",
        "eval/kl"]                             # the progress line's metrics, in order
LOSS_KEYS = ["train/loss", "train/grad_norm"]  # a NaN/inf in either stops the run (the checkpoint intact)


def main(argv=None):
    opts = parse_args(Options, argv, __doc__)      # each option's range and [with ...] refused here
    fill_defaults(opts)                            # the defaults that depend on other options
    check_options(opts)                            # --device and the rules between options; only refuses
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    run = training.open_run(opts, "online", **run_record(opts), show=SHOW, loss_keys=LOSS_KEYS)
    with input_errors():
        prompt_records, eval_records = load_prompts(opts.prompts, opts.eval_prompts, opts.eval_fraction, opts.seed)
        tok = training.tokenizer(opts, run)
        policy, init_ref, copy = load_models(opts, tok, run, needs_reference(opts) and opts.ref_update_every > 0)
        texts = [p["prompt"] for p in prompt_records + eval_records]
        judge = load_judge(opts.judge or None, opts.pair_judge or None, tokenizer=tok, device=world.device,
                           prompts=texts, template=opts.judge_template)
        prompts, prompt_stats = tokenize_prompts(prompt_records, tok, prompt_limit(
            opts.max_prompt_len, opts.max_new_tokens, policy.cfg.block_size))
        prompt_batches = Batches(len(prompts), opts.batch_size, 1, world.rank, world.world_size, opts.seed)
        offline, offline_batches = None, None
        offline_path = run.data_files.get("offline_data", "")      # run_record resolved it (and hashed the file)
        why_not = "" if offline_path else offline_file(opts)[1]
        if offline_path:
            offline, counts = tokenize_pairs(load_records(offline_path, "preference"), tok,
                                             training_length(0, policy.cfg.block_size, opts.init))
            if len(offline) < opts.batch_size * world.world_size:
                raise ValueError(f"--offline_data {offline_path}: {len(offline)} pairs fit the model's context "
                                 f"({counts}), fewer than a step takes ({opts.batch_size} x {world.world_size} ranks)")
            offline_batches = Batches(len(offline), opts.batch_size, 1, world.rank, world.world_size, opts.seed)
    gold = reward_mod.builtin_gold(texts)
    training.place(opts, world, {"policy": policy}, {"reference": init_ref, "reference copy": copy})
    init_ref = training.frozen(opts, init_ref)
    ref = copy if copy is not None else init_ref if needs_reference(opts) else None
    ddp, optimizer = training.prepare(opts, policy, opts.lr)
    training.plan(opts, {"policy": policy, "ref": init_ref})
    models = {"policy": policy, **({"ref": ref} if opts.ref_update_every and ref is not None else {})}
    watch = Watch(opts.score_warn)
    orders = {"data": prompt_batches, "watch": watch, **({"offline": offline_batches} if offline else {})}
    run.resume(models, {"policy": optimizer}, data=orders)
    k = opts.samples_per_prompt
    dist.print0(startup_line(opts, len(prompts), prompt_stats, run.step, offline_path or f"none ({why_not})"))
    warn_short_warmup(opts.max_steps, opts.warmup_steps)
    eval_prompts = eval_records[:opts.eval_samples]

    def evaluate(step):
        """Held-out prompts, pure sampling at T = 1 with a fixed seed, KL to the initial reference; rank 0 only."""
        return eval_metrics(run, step, policy, tok, eval_prompts, SamplingOptions(opts.max_new_tokens), ref=init_ref,
                            rewards=reward_mod.eval_columns(judge, gold), gathered=(init_ref,))

    def save(step):
        run.save(step, models, {"policy": optimizer}, data=orders)
        save_model_dir(opts.out_dir, policy, tok)

    if run.step == 0 and opts.eval_interval:
        run.log(0, evaluate(0))
    kl_watch = KLWatch()
    for step in range(run.step + 1, opts.max_steps + 1):
        t0 = time.time()
        lr = lr_at(step - 1, opts.max_steps, opts.lr, opts.warmup_steps, "constant")
        set_lr(optimizer, lr)
        idx = prompt_batches.next_step()[0]
        batch = [prompts[i] for i in idx]
        # 1. sample (nash_md: and the opponents from the geometric mixture of policy and reference); under FSDP on
        # weights gathered once for the whole decoding, not once per token, as train_ppo.py's rollout
        opponents = None
        with parallel.gathered(policy, ref if opts.method == "nash_md" else None):
            batch_samples = sample_mixture_groups([(policy, 1.0)], batch, idx, tok, k, opts.temperature,
                                                  opts.max_new_tokens, opts.seed, step, world.device)
            if opts.method == "nash_md":
                mixture = [(policy, 1 - opts.mixture_coef), (ref, opts.mixture_coef)]   # π_θ^(1−β′)·π_ref^β′
                opponents = sample_mixture_groups(mixture, batch, idx, tok, k, opts.temperature, opts.max_new_tokens,
                                                  opts.seed, step, world.device, stream=1)
        policy.train()
        t_gen = time.time() - t0
        # 2. judge
        groups, scores, prob, accept_key = None, None, None, None
        if opts.method == "nash_md":
            penalty = opts.missing_eos_penalty
            scores = judge_scores(judge, batch_samples, tok, penalty) if judge.pointwise else None
            prob = symmetric_preference(judge, batch_samples.prompts, batch_samples.completions,
                                        opponents.completions) if judge.pairwise \
                else bradley_terry(scores, judge_scores(judge, opponents, tok, penalty))
        else:
            groups, scores = group_preferences(judge, batch_samples, k, tok, opts.missing_eos_penalty)
        if opts.method == "cringe":      # accepted / rejected by score, or by Copeland wins with a pairwise judge only
            accept_key = list(scores) if scores is not None else [copeland(pref_logits) for _, pref_logits in groups]
        # 3.-4. examples, loss, update (--offline_data: the online backward without gradient sync, the offline one with)
        parallel.sync_gradients(ddp, not offline)
        objective, stats = step_objective(opts, ddp, ref, batch_samples, groups, step, prob, accept_key, init_ref)
        if objective is not None:
            (objective * dist.ddp_scale()).backward()
        if offline:
            parallel.sync_gradients(ddp, True)
            pairs = pairs_as_rollout([offline[i] for i in offline_batches.next_step()[0]], tok.pad_id, world.device)
            stats.update(offline_backward(opts, ddp, ref, pairs))
        grad_norm = 0.0
        if objective is not None or offline:     # no pair / no labelled token on any rank: no update at all
            grad_norm = parallel.clip_grad_norm(policy.parameters(), opts.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if opts.ref_update_every and ref is not None and step % opts.ref_update_every == 0:
            # iterative DPO / DNO / SPPO: π_t ← π_θ (--lora_r: the base with the adapters merged in)
            ref.load_state_dict((lora.merged_copy(policy) if opts.lora_r else policy).state_dict())
        metrics = step_metrics(batch_samples, scores, stats, gold)
        if "train/kl" in metrics and opts.kl_warn:      # the same value on every rank (all-reduced)
            watch_kl(kl_watch, metrics["train/kl"], opts.kl_warn, step)
        check_step(watch, step, (batch_samples.response_mask.sum(1) - batch_samples.has_eos).tolist(),
                   batch_samples.completions, scores.flatten().tolist() if scores is not None else None, k)
        t_step = time.time() - t0
        metrics.update({"train/lr": lr, "train/grad_norm": grad_norm, "train/step_time": t_step,
                        "train/generate_time": t_gen, "time/rollout_frac": t_gen / max(t_step, 1e-9)})
        if run.end_of_step(step, metrics, evaluate=lambda: evaluate(step), save=save):
            break
    run.finish({"policy": policy}, {"reference": init_ref},
              saved=f"saved {opts.out_dir} (HF {policy.architecture} layout)")
    return SimpleNamespace(policy=policy, ref=ref, init_ref=init_ref, judge=judge, optimizer=optimizer, options=opts)


if __name__ == "__main__":
    main()
