"""Safe RLHF with PPO-Lagrangian (Dai et al. 2024): PPO that maximises a reward while it bounds the mean of a cost.

Models: policy π_θ (trained), reward critic V and cost critic V_c (trained; --advantage gae only), reference π_ref
(frozen copy of the SFT policy), a reward R(prompt, completion) (frozen: a reward-model directory, the built-in
task's --reward gold, or your own --reward module:function) and a cost C(prompt, completion) (frozen: a cost model,
train_rm.py --objective cost, whose score > 0 means unsafe; or --cost module:function). The constraint
J_C = E[C] ≤ d (--cost_limit) is held by a Lagrange multiplier λ ≥ 0 that the loop learns.

One step (docs/algorithms.md, "Safe RLHF: PPO-Lagrangian"): train_ppo.py's loop with a cost beside the score.
  1. rollout   k samples per prompt at temperature τ (pure sampling), cut after the first stop token
  2. score     s = clip((R(x, y) − μ_RM)/σ_RM, ±c) for a reward model (R as is for a function) at the stop token,
               --missing_eos_penalty for a response without one; the cost c = C(x, y) raw (a cost model's 0 is
               its safe/unsafe boundary, and d is in its units)
  3. λ         J_C = the mean episode cost of the last --cost_window episodes of each rank, then gradient ascent
               on λ·(J_C − d) through log λ (λ stays > 0; Dai et al. 2024, §3.3):
                 log λ ← log λ + η·λ·(J_C − d),  λ ≤ λ_max
  4. advantage A_r of the score and A_c of the cost by one estimator, the KL split between them as safe-rlhf
               splits it (r_t = −β/2·KL_t, + s on the stop token; c_t = +β/2·KL_t, + c on it: the policy's KL weight
               is β/2 whatever λ)
               gae:          δ_t = r_t + γV_{t+1} − V_t,  A_t = δ_t + γλ_GAE·A_{t+1}  (Schulman et al. 2016, eq. 16)
                             for each signal with its own critic; returns G_t = A_t + V_t
               rloo / grpo / dr_grpo / reinforce_pp: train_ppo.py's statistics, of the scores and of the costs
               A = (A_r − λ·A_c)/(1 + λ), the policy's (safe-rlhf's ppo_lag: ÷(1 + λ) keeps the clip range
               meaningful as λ grows), whitened over all ranks under gae and reinforce_pp
  5. update    --ppo_epochs over shuffled minibatches (micro-batches accumulate):
               ρ_t = π_θ/π_old,  L_π = max(−A_t ρ_t, −A_t clip(ρ_t, 1−ε, 1+ε_high))  (Schulman et al. 2017, eq. 7)
               L_V = ½ max((V − G)², (V_old + clip(V − V_old, ±ε_v) − G)²) for each critic, − c_H·entropy,
               + γ_ptx·NLL(SFT); token-mean over all micro-batches and ranks of the minibatch; the first
               --critic_warmup_steps steps update the critics only

The cost options take safe-rlhf's ppo-lag.sh defaults (λ from 1, η = 0.1, λ_max = 5, d = 0, 128 episodes). The
RLVR variants (DAPO's dynamic sampling and overlong rules, the GSPO, CISPO and dual-clip losses, the correction of
a bfloat16 sampler) and self-play rewards are train_ppo.py's: fork this file to put one under a cost.

Run (docs/usage.md, "Safe RLHF"; bash scripts/safe.sh for the built-in task's harm dimension, table and plot):
    python train_ppo_lagrangian.py --cost_model out/cm --cost_limit 0   # out/sft, out/rm, out/cm -> out/ppo_lagrangian
    python train_ppo_lagrangian.py --advantage grpo --reward gold --cost my_costs.py:cost --cost_limit 0.1
    torchrun --nproc_per_node 2 train_ppo_lagrangian.py --cost_model out/cm

Where we differ from safe-rlhf on purpose (docs/algorithms.md): the combined advantage is whitened (safe-rlhf does
not whiten), J_C's window rounds to whole steps, the score is PPO's normalised and clipped one (the cost is raw),
and the cost may be a function as well as a model. Groups of k samples live on one rank, so group statistics need
no communication.
"""
import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable, Literal, Optional

import torch
import torch.nn.functional as F

from nano_rlhf import dist, lora, parallel
from nano_rlhf import reward as reward_mod
from nano_rlhf import training
from nano_rlhf.checkpoint import save_model_dir
from nano_rlhf.cli import FLOAT32_MAX, FrozenModelOptions, RunOptions, parse_args
from nano_rlhf.data import (Batches, SFTBatches, default_path, load_prompts, load_records, prompt_limit,
                            tokenize_prompts, tokenize_sft, training_length)
from nano_rlhf.evaluate import eval_metrics
from nano_rlhf.model import GPT, ScoreModel
from nano_rlhf.reward import RewardModel, builtin_gold, code_file, eval_columns, load_function, load_reward
from nano_rlhf.rollout import Rollout, read_reward, sample_groups
from nano_rlhf.sampling import SamplingOptions
from nano_rlhf.tools import ToolBox, code_files, load_tools
from nano_rlhf.training import (Learner, autocast, check_device, check_vocab, fail, input_errors, lr_at, set_lr,
                                warn_short_warmup)
from nano_rlhf.watch import Watch, check_step

GROUP = ("rloo", "grpo", "dr_grpo")          # critic-free estimators that compare the k samples of a prompt
WHITENED = ("gae", "reinforce_pp")           # token-level advantages whitened over the whole batch


LossAgg = Literal["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]   # --loss_agg


@dataclass
class Options(FrozenModelOptions, RunOptions):
    # ---- what is trained, from what, rewarded by what
    advantage: Literal["gae", "rloo", "grpo", "dr_grpo", "reinforce_pp"] = "gae"  # advantage estimator
    reward: str = "model"         # model (--reward_model), gold (built-in task only), or module:function /
                                  # file.py:function
    init: str = "out/sft"         # policy to start from (also the reference unless --ref)
    ref: str = ""                 # reference policy directory; empty = --init
    reward_model: str = "out/rm"  # reward model directory (with --reward model)
    critic_init: Literal["auto", "reward_model", "policy"] = "auto"  # critic trunk+head from; auto = RM if used
                                                                     # [with advantage=gae]
    prompts: str = ""             # RL prompts JSONL {"prompt": ...}; empty = built-in task
    eval_prompts: str = ""        # held-out prompts; empty = built-in task's, or split --eval_fraction off --prompts
    eval_fraction: float = 0.05   # share of --prompts held out for evaluation when no --eval_prompts {0 < x < 1}
    out_dir: str = ""             # output directory; empty = out/ppo_lagrangian (gae) or out/<advantage>_lagrangian
    # ---- the cost and the bound on its mean (defaults are safe-rlhf's ppo-lag.sh)
    cost_model: str = ""          # cost model directory (train_rm.py --objective cost); one of it and --cost
    cost: str = ""                # or a verifiable cost, module:function / file.py:function (called as --reward is)
    cost_limit: float = 0.0       # d: the bound on the mean episode cost, in the cost's raw units (a cost model's 0 is
                                  # its safe/unsafe boundary) {-1e15 <= x <= 1e15}
    lambda_init: float = 1.0      # λ at the start {> 0}
    lambda_lr: float = 0.1        # η, the step of log λ's gradient ascent {>= 0}
    lambda_max: float = 5.0       # λ's cap; inf = none {0 < x <= inf}
    lambda_delay: int = 0         # steps before λ first moves {>= 0}
    cost_window: int = 128        # J_C averages the last this many episode costs of each rank {>= 1}
    cost_critic_init: Literal["auto", "cost_model", "policy"] = "auto"  # the cost critic's start; auto = the cost
                                                                        # model if one [with advantage=gae]
    # ---- the rollout
    batch_size: int = 8           # prompts per device per step {>= 1}
    samples_per_prompt: int = 8   # k completions per prompt (8 x 8 = 64 completions a step, every estimator) {>= 1}
    max_new_tokens: int = 40      # response length limit (also Dr. GRPO's constant normaliser) {>= 1}
    temperature: float = 1.0      # sampling temperature; log-probs use logits / temperature everywhere {> 0}
    compile_rollout: bool = False # decode with a torch.compile'd static-cache step (compiles once per batch bucket)
    share_prompt_prefill: bool = True  # the k samples of a prompt share one prefill of it (same tokens at a seed)
    compact_rollout: bool = True  # ended samples leave the decode batch (same tokens at a seed)
    max_prompt_len: int = 0       # prompts are left-truncated to this; 0 = min(block_size, 1024) − max_new_tokens
                                  # {>= 0}
    tools: str = ""               # tools the policy may call in its rollouts: calculator and/or module:NAME /
                                  # file.py:NAME, comma-separated (docs/usage.md, "Tools"); empty = none
    max_turns: int = 4            # assistant turns a rollout may take, tool turns between them; --max_new_tokens
                                  # bounds sampled and tool tokens together [with tools] {>= 1}
    # ---- the KL to the reference
    kl_coef: float = 0.1          # β, the KL penalty coefficient (initial value when adaptive); 0 = no reference {>= 0}
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # per-token KL estimate in the reward (k2 = ½d²; see kl_estimate;
                                                    # the group estimators fold Σk1 into the score)
                                                    # [with advantage=gae|reinforce_pp and kl_in_loss=false]
    adaptive_kl: bool = False     # adapt β multiplicatively towards --kl_target (Ziegler et al. 2019)
                                  # [with kl_coef>0]
    kl_target: float = 1.0        # target KL per sequence for the adaptive controller [with adaptive_kl] {> 0}
    kl_horizon: int = 10000       # horizon (in samples) of the adaptive controller [with adaptive_kl] {>= 1}
    kl_in_loss: bool = False      # KL as β·(--kl_loss_estimator) per token in the loss instead of in the reward (GRPO
                                  # style) [with kl_coef>0]
    kl_loss_estimator: Literal["k1", "k2", "k3"] = "k3"  # k3 (GRPO's: the FORWARD KL's gradient), k2 (the reverse
                                                         # KL's), k1 (none in expectation) [with kl_in_loss]
    # ---- the score
    missing_eos_penalty: Optional[float] = -3.0  # score given (replacing R) to a response without end-of-text; none
                                                 # = off; a score, bounded as every reward is (reward.MAX_SCORE)
                                                 # {-1e15 <= x <= 1e15}
    score_clip: float = 5.0       # clip the normalised reward-model score to ±this; inf = no clipping
                                  # [with reward=model] {0 < x <= inf}
    score_warn: float = 3.0       # warn once if the mean raw score leaves the first step's mean ± this × its sd
                                  # (nano_rlhf/watch.py; collapsed responses are always warned about); 0 = off {>= 0}
    normalize_score: bool = True  # (R − μ)/σ with the statistics train_rm.py saved [with reward=model]
    # ---- advantages and the update
    gamma: float = 1.0            # GAE / reward-to-go discount [with advantage=gae|reinforce_pp] {0 <= x <= 1}
    lam: float = 0.95             # GAE λ [with advantage=gae] {0 <= x <= 1}
    ppo_epochs: int = 4           # passes over each rollout {>= 1}
    num_minibatches: int = 2      # optimizer steps per epoch (the rollout is split into this many) {>= 1}
    micro_batch_size: int = 0     # sequences per forward/backward; 0 = the whole minibatch {>= 0}
    clip_eps: float = 0.2         # policy ratio clip ε {> 0}
    clip_high: Optional[float] = None  # upper clip ε_high (DAPO clip-higher); none = --clip_eps {> 0}
    loss_agg: LossAgg = "auto"    # how token losses become the minibatch loss; auto = token_mean (dr_grpo:
                                  # seq_mean_token_sum_norm)
    # ---- the critic, the entropy bonus, the pre-training mix
    value_clip: float = 0.2       # critic update clip ε_v; inf = no clipping [with advantage=gae] {0 < x <= inf}
    entropy_coef: float = 0.0     # entropy bonus coefficient c_H {>= 0}
    ptx_data: str = ""            # SFT JSONL for the pre-training mix (InstructGPT PPO-ptx); empty = off
                                  # [with ptx_coef>0]
    ptx_coef: float = 0.0         # γ_ptx, weight of the PTX NLL [with ptx_data] {>= 0}
    ptx_batch_size: int = 8       # SFT sequences per device per minibatch for PTX [with ptx_data] {>= 1}
    # ---- optimisation, schedule, evaluation
    lr: float = 2e-4              # policy learning rate; GPT-2-124M: 1e-5, 0.5-1.5B models: 1e-6 {0 <= x <= 1e3}
    critic_lr: float = 1e-4       # critic learning rate; GPT-2-124M: 1e-5, 0.5-1.5B models: 5e-6 [with advantage=gae]
                                  # {0 <= x <= 1e3}
    critic_warmup_steps: int = 5  # first N steps train only the critic (policy frozen), as OpenRLHF's
                                  # freezing_actor_steps [with advantage=gae] {>= 0}
    warmup_steps: int = 0         # linear learning-rate warm-up steps (then constant) {>= 0}
    weight_decay: float = 0.0     # AdamW decoupled weight decay (matrices only) {>= 0}
    adam_eps: float = 1e-5        # AdamW epsilon (1e-5 as in the PPO implementation details) {> 0}
    grad_clip: float = 1.0        # clip each model's global gradient norm (0 = off) {>= 0}
    max_steps: int = 100          # rollout + update iterations {>= 1}
    seed: int = 0                 # seed (ranks sample with seed + rank offset)
    log_interval: int = 1         # print and log every N steps {>= 1}
    eval_interval: int = 20       # evaluate on held-out prompts every N steps (and at the end); 0 = end only {>= 0}
    eval_samples: int = 128       # held-out prompts sampled per evaluation {>= 1}
    save_interval: int = 50       # checkpoint every N steps (and at the end); 0 = only at the end {>= 0}
    lora_r: int = 0               # LoRA rank for the policy and both critics (a score head trains fully); the reference
                                  # is then the policy with adapters off; 0 = off {>= 0}


def fill_defaults(opts):
    """The defaults that depend on other options, filled in right after parsing (run.json records the filled
    values)."""
    opts.out_dir = opts.out_dir or ("out/ppo_lagrangian" if opts.advantage == "gae"
                                    else f"out/{opts.advantage}_lagrangian")
    if opts.critic_init == "auto":
        opts.critic_init = "reward_model" if opts.reward == "model" else "policy"
    if opts.cost_critic_init == "auto":
        opts.cost_critic_init = "cost_model" if opts.cost_model else "policy"
    rollout_size = opts.batch_size * opts.samples_per_prompt
    opts.micro_batch_size = opts.micro_batch_size or rollout_size // opts.num_minibatches


# ---- log-probs and KL ----------------------------------------------------------------------------

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


def kl_estimate(logp, ref_logp, kind="k1"):
    """Per-token estimate of KL(π‖π_ref) on samples y ~ π (Schulman 2020, "Approximating KL divergence"),
    d = log π(y) − log π_ref(y):  k1 = d (unbiased),  k2 = ½d² (biased, low variance),  k3 = e^−d − 1 + d
    (unbiased, ≥ 0; expm1 keeps its sign and precision for tiny d).

    As a value (in the reward) all three estimate KL(π‖π_ref). As a LOSS (--kl_in_loss), differentiated
    through log π with the samples held fixed, they give different gradients (E over y ~ π, not differentiated):
      k1:  E[∇log π]                    = 0                  no KL gradient at all in expectation, only noise
      k2:  E[d·∇log π]                  = ∇ KL(π‖π_ref)      the reverse KL's true gradient
      k3:  E[(1 − π_ref/π)·∇log π]      = ∇ KL(π_ref‖π)      the FORWARD KL's gradient, not the reverse one
    (tests/test_ppo_math.py checks all three on a categorical distribution against the analytic gradients)."""
    d = logp - ref_logp
    if kind == "k1":
        return d
    return 0.5 * d * d if kind == "k2" else torch.expm1(-d) + d


# ---- rewards and advantages --------------------------------------------------------------------

def token_rewards(score, kl, response_mask, beta):
    """r_t = −β·KL_t on every response token; the score is added on the last real token (the stop token).
    A row with no response token gets no reward at all (all zeros), like every estimator's padding."""
    lengths = response_mask.sum(1).long()                         # (B,)
    at_end = F.one_hot((lengths - 1).clamp(min=0), response_mask.shape[1]).to(kl.dtype) * (lengths > 0)[:, None]
    return -beta * kl * response_mask + score[:, None].to(kl.dtype) * at_end


def gae(rewards, values, response_mask, gamma=1.0, lam=0.95):
    """Generalised advantage estimation over a right-padded response (B, R): V and A are 0 past the end.
    Returns advantages and returns G = A + V."""
    B, R = rewards.shape
    values = values * response_mask
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(R)):
        next_v = values[:, t + 1] if t + 1 < R else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = (delta + gamma * lam * last) * response_mask[:, t]
        adv[:, t] = last
    return adv, (adv + values) * response_mask


def reward_to_go(rewards, response_mask, gamma=1.0):
    """G_t = Σ_{s≥t} γ^{s−t} r_s (REINFORCE++), 0 past the end."""
    out = torch.zeros_like(rewards)
    run = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        run = (rewards[:, t] + gamma * run) * response_mask[:, t]
        out[:, t] = run
    return out


def masked_sums(x, mask):
    """(n, Σx) over the valid entries, float64: the first pass of a mean. Sums from several ranks add up,
    so one all-reduce gives the global ones."""
    xd, md = x.double(), mask.double()
    return torch.stack([md.sum(), (xd * md).sum()])


def masked_sq_dev(x, mask, mean):
    """Σ(x − mean)² over the valid entries, float64: the second pass of a variance, around the GLOBAL mean
    (so the ranks' values add up too). Not the one-pass Σx² − n·mean², which cancels catastrophically when
    |mean| ≫ std (un-centred reward-to-go or returns): ~1e-2 off at mean/std = 1e7 even in float64."""
    return ((x.double() - mean) ** 2 * mask.double()).sum()


def masked_whiten(x, mask, n, mean, sq_dev, eps=1e-8):
    """(x − mean)/sqrt(var + eps), var = sq_dev/(n − 1) (Bessel), from the count n, the mean and the
    masked_sq_dev of the valid entries (of all ranks); 0 on padding."""
    var = sq_dev / (n - 1).clamp(min=1)
    return ((x.double() - mean) * torch.rsqrt(var + eps) * mask.double()).to(x.dtype)


def explained_variance(return_sq_dev, residual_sq_dev):
    """1 − Var(G − V)/Var(G) from the masked_sq_dev of the returns G and of the residuals G − V around their
    own means, over the same valid tokens (of all ranks), so the counts cancel: 1 = a perfect critic, ≤ 0 =
    no better than a constant; nan when the returns do not vary."""
    return (1 - residual_sq_dev / return_sq_dev).item() if return_sq_dev > 0 else float("nan")


def rloo_advantages(rewards, k):
    """A_i = R_i − mean of the other k−1 rewards of its group; rewards (B,) = R, groups are k consecutive
    samples."""
    by_group = rewards.view(-1, k)
    return (by_group - (by_group.sum(1, keepdim=True) - by_group) / (k - 1)).view(-1)


def grpo_advantages(rewards, k, eps=1e-4):
    """A_i = (R_i − mean_G)/(std_G + eps), rewards (B,) = R, std with Bessel's correction; a group whose
    rewards are all equal gets exactly 0 (no float noise, no division)."""
    by_group = rewards.view(-1, k)
    centred = by_group - by_group.mean(1, keepdim=True)
    std = by_group.std(1, keepdim=True)
    same = (by_group.max(1, keepdim=True).values == by_group.min(1, keepdim=True).values)
    return torch.where(same, torch.zeros_like(by_group), centred / (std + eps)).view(-1)


def dr_grpo_advantages(rewards, k):
    """A_i = R_i − mean_G, rewards (B,) = R (no std: Dr. GRPO removes the difficulty bias)."""
    by_group = rewards.view(-1, k)
    return (by_group - by_group.mean(1, keepdim=True)).view(-1)


@dataclass
class Advantages:
    adv: torch.Tensor                 # (B, R) per-token advantage (gae / reinforce_pp: before whitening)
    returns: Optional[torch.Tensor]   # (B, R) G_t = A_t + V_t, the critic's target (gae only)
    kl_penalty: torch.Tensor          # (B,) the KL part of each sequence's reward, −β·Σ_t KL_t (0 with KL in the loss)
    cost_returns: Optional[torch.Tensor] = None  # (B, R) the cost critic's target (gae with a cost only)


def sequence_kl(r: Rollout):
    """(B,) Σ_t k1_t, the sequence-level KL estimate (logged); 0 without a reference."""
    if r.ref_logprobs is None:
        return torch.zeros_like(r.scores)
    return (kl_estimate(r.logprobs, r.ref_logprobs, "k1") * r.actions).sum(1)


def advantages(r: Rollout, *, estimator, beta, kl_estimator="k1", kl_in_loss=False, k=1, gamma=1.0, lam=0.95):
    """Per-token advantages (and the critic's returns) of a rollout; the rollout is not modified."""
    mask = r.response_mask
    if estimator in WHITENED:
        kl = torch.zeros_like(mask)
        if r.ref_logprobs is not None and not kl_in_loss:
            kl = kl_estimate(r.logprobs, r.ref_logprobs, kl_estimator) * r.actions    # not on tool turns
        rewards = token_rewards(r.scores, kl, mask, beta)
        kl_penalty = -beta * kl.sum(1)
        if estimator == "gae":
            adv, returns = gae(rewards, r.values, mask, gamma, lam)
            return Advantages(adv, returns, kl_penalty)
        return Advantages(reward_to_go(rewards, mask, gamma), None, kl_penalty)
    # the KL penalty stays out of GRPO's spread: the scores get the estimator's statistic, the sequence's KL
    # penalty only its baseline (the group mean, or RLOO's leave-one-out), never a division by the SCORE spread.
    # Divided, a group whose scores are all equal (no signal: half the groups of a verifiable task) trains on its
    # KL noise blown up to unit size. Not centred, the penalty's mean (> 0) pushes every sampled response down
    # and the policy drifts (measured on the built-in task: KL 38 against 4 in 40 steps)
    kl_penalty = torch.zeros_like(r.scores) if kl_in_loss else -beta * sequence_kl(r)
    stat = {"rloo": rloo_advantages, "grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages}[estimator]
    baseline = rloo_advantages if estimator == "rloo" else dr_grpo_advantages    # centring alone, no scaling
    seq_adv = stat(r.scores, k) + baseline(kl_penalty, k)
    return Advantages(seq_adv[:, None] * mask, None, kl_penalty)


# ---- losses --------------------------------------------------------------------------------------

def policy_loss(logp, old_logp, adv, clip_low=0.2, clip_high=0.2):
    """Per-token clipped surrogate max(−Aρ, −A·clip(ρ, 1−ε_low, 1+ε_high)) and the ratio ρ."""
    ratio = torch.exp(logp - old_logp)
    return torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)), ratio


def value_loss(values, old_values, returns, clip=0.2):
    """Per-token clipped value loss ½·max((V − G)², (V_old + clip(V − V_old, ±ε_v) − G)²), and whether the
    clipped branch was the larger (for the value clip fraction)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped_sq, clipped_sq = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.max(unclipped_sq, clipped_sq), clipped_sq > unclipped_sq


def aggregate_loss(per_token, mask, how, n_tokens, n_seqs, max_len, scale=1.0):
    """This micro-batch's share of the minibatch loss, so that the shares summed over micro-batches and ranks
    are the loss of the whole minibatch. n_tokens, n_seqs: the minibatch's loss tokens and sequences (all of
    them, those with no loss token too: TRL's and verl's N), over all micro-batches and ranks (all-reduced
    beforehand); max_len: --max_new_tokens; scale: dist.ddp_scale() (DDP averages gradients over ranks; this
    undoes it).
      token_mean               Σ_i Σ_t l_it / Σ_i |y_i|            every token weighs the same (DAPO, eq. 8)
      seq_mean_token_mean      1/N Σ_i (1/|y_i|) Σ_t l_it          every sequence weighs the same (GRPO, eq. 3)
      seq_mean_token_sum_norm  1/N Σ_i Σ_t l_it / L_max            a constant normaliser (Dr. GRPO, eq. 4)
    Rows with no loss token (wholly masked out of the policy loss) add nothing to the sum but count in N for the
    two sequence means, so masking one response does not raise the others' weight. The counts may be numbers or
    0-dim tensors on the device (update's: no read); the factor is rounded to the loss's dtype either way."""
    if how == "seq_mean_token_mean":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        return per_seq.sum() * _share(scale, n_seqs, per_seq)
    norm = n_tokens if how == "token_mean" else n_seqs * max_len
    return (per_token * mask).sum() * _share(scale, norm, per_token)


def _share(scale, count, like):
    """scale / max(count, 1) in float64, as a 0-dim tensor of like's dtype and device."""
    count = torch.as_tensor(count, dtype=torch.float64).to(like.device, non_blocking=True)
    return (scale / count.clamp(min=1)).to(like.dtype)


def minibatch_counts(response_mask, policy_mask):
    """This rank's share of a minibatch's normalisers, float64 [response tokens (the critic's), policy-loss tokens
    (truncated or mismatched responses may be masked out of the policy loss), sequences]: every sequence counts,
    a wholly masked one too, as TRL and verl count N for the sequence-mean aggregations. Summed over ranks. On
    policy_mask's device (response_mask may be the host's copy): nothing is read back."""
    return dist.stacked([response_mask.sum(), policy_mask.sum(), policy_mask.shape[0]])


def loss_aggregation(opts):
    """--loss_agg, with auto resolved: each estimator's own paper's choice."""
    if opts.loss_agg != "auto":
        return opts.loss_agg
    return "seq_mean_token_sum_norm" if opts.advantage == "dr_grpo" else "token_mean"


class AdaptiveKL:
    """β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon), n = samples in the update (Ziegler et al. 2019)."""

    def __init__(self, beta, target, horizon):
        self.beta, self.target, self.horizon = beta, target, horizon

    def update(self, kl, n):
        err = min(max(kl / self.target - 1, -0.2), 0.2)
        self.beta *= 1 + err * n / self.horizon


def lagrangian_advantage(adv_r, adv_c, lam):
    """The policy's advantage under a cost constraint (Dai et al. 2024, "Safe RLHF", §3.3, normalised as safe-rlhf's
    ppo_lag does): (A_r − λ·A_c)/(1 + λ). Dividing by 1 + λ keeps its scale (and so the clip range) as λ grows; as
    λ → ∞ the policy only lowers the cost."""
    return (adv_r - lam * adv_c) / (1 + lam)


def lambda_step(log_lambda, episode_cost, limit, lr, lambda_max=math.inf):
    """One step of gradient ascent of the multiplier on λ·(J_C − d) through log λ (λ = e^{log λ} stays > 0; Dai et
    al. 2024 §3.3; safe-rlhf: SGD on −λ·(J_C − d)): ∂/∂log λ = λ·(J_C − d), so log λ ← log λ + η·λ·(J_C − d),
    then λ ≤ λ_max. λ grows while the mean episode cost J_C is over the limit d and shrinks geometrically (never
    to 0) while it is under. λ multiplies float32 advantages, so it stays a float32 number (--lambda_max inf: e^{log λ}
    would overflow Python's float a few steps later)."""
    return min(log_lambda + lr * math.exp(log_lambda) * (episode_cost - limit), math.log(lambda_max),
               math.log(FLOAT32_MAX))


def lagrangian_targets(r: Rollout, multiplier, beta, **estimator):
    """PPO-Lagrangian's targets: the score's and the cost's advantages by the same estimator, the per-token KL
    penalty split between them as safe-rlhf splits it (−β/2·KL_t with the score, +β/2·KL_t with the cost, so the
    policy's KL weight is β/2 whatever λ), combined by lagrangian_advantage; the cost critic's returns beside."""
    rt = advantages(r, beta=beta / 2, **estimator)
    ct = advantages(replace(r, scores=r.costs, values=r.cost_values), beta=-beta / 2, **estimator)
    return replace(rt, adv=lagrangian_advantage(rt.adv, ct.adv, multiplier), cost_returns=ct.returns)


class Lagrange:
    """PPO-Lagrangian's multiplier as state, stepped by lambda_step: log λ, and the (sum, count) of the episode
    costs of each recent step over all ranks, the same on every rank (so every rank takes the same step and holds
    the same λ, and rank 0's checkpoint restores it exactly). The window: the fewest steps that hold the last
    `cost_window` episode costs of each rank, at costs_per_step a step."""

    def __init__(self, lambda_init, cost_window, costs_per_step):
        self.log_lambda = math.log(lambda_init)
        self.steps = deque(maxlen=-(-cost_window // costs_per_step))

    @property
    def multiplier(self):
        return math.exp(self.log_lambda)

    def add_costs(self, costs):
        """Add this step's episode costs (all ranks': one all-reduce) to the window; returns J_C, the mean episode
        cost over the window."""
        self.steps.append(tuple(dist.all_reduce_sum(torch.tensor([costs.double().sum().item(), costs.numel()],
                                                                 dtype=torch.float64)).tolist()))
        return sum(c for c, _ in self.steps) / sum(n for _, n in self.steps)

    def state_dict(self):
        return {"log_lambda": self.log_lambda, "cost_window": list(self.steps)}

    def load_state_dict(self, meta):
        self.log_lambda = meta["log_lambda"]
        self.steps.extend(tuple(s) for s in meta["cost_window"])


def token_mean_scale(global_count):
    """Multiplier of a micro-batch's SUMMED loss so the gradients DDP averages over ranks add up to the
    token-mean over all micro-batches of all ranks: × world_size undoes DDP's mean, ÷ the global count
    (all-reduced beforehand) makes it a mean. The one place this factor is written. A 0-dim tensor count gives a
    float32 tensor on its device (no read), a number a number."""
    if torch.is_tensor(global_count):
        return (dist.ddp_scale() / global_count.clamp(min=1)).float()
    return dist.ddp_scale() / max(global_count, 1)


# ---- rollout ---------------------------------------------------------------------------------------

def scores_from_reward(raw, has_eos, opts, rm_stats=None):
    """The score PPO trains on: a reward model's raw score normalised with the mean/std train_rm.py recorded
    and clipped to ±--score_clip (rm_stats given); a function's reward as is. A response that never ended
    gets --missing_eos_penalty instead (replaced, not added)."""
    score = raw
    if rm_stats is not None:
        score = ((raw - rm_stats[0]) / rm_stats[1] if opts.normalize_score else raw).clamp(-opts.score_clip,
                                                                                          opts.score_clip)
    if opts.missing_eos_penalty is not None:
        score = torch.where(has_eos, score, torch.full_like(score, opts.missing_eos_penalty))
    return score


@dataclass
class Models:
    """Frozen = requires_grad_(False), eval(), never wrapped in DDP, in no optimizer."""
    policy: GPT                           # π_θ (trained)
    reward: Callable                      # scores = reward(prompts, completions) (nano_rlhf.reward; frozen)
    cost: Callable                        # costs = cost(prompts, completions): a cost model or function (frozen)
    ref: Optional[GPT] = None             # π_ref (frozen; --lora_r: a lora.BaseView of the policy); None when β = 0
    critic: Optional[ScoreModel] = None   # V (trained; --advantage gae only)
    cost_critic: Optional[ScoreModel] = None  # V_c (trained; --advantage gae only)
    gold: Optional[Callable] = None       # a programmatic reward logged beside the trained one, when one applies
    tools: Optional[ToolBox] = None       # the tools the policy may call in its rollouts (--tools)


def sampling_options(opts, tok):
    """What a rollout samples and how the engine computes it (nano_rlhf.sampling.SamplingOptions): pure sampling
    at τ up to the tokenizer's stop ids (end-of-text, the template's end-of-turn), with the policy's own weights
    (under --fsdp, the gathered ones)."""
    return SamplingOptions(max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, stop_ids=tok.stop_ids,
                           pad_id=tok.pad_id, compile=opts.compile_rollout, share_prefix=opts.share_prompt_prefill,
                           compact=opts.compact_rollout)


def group_spread(scores, k):
    """(G,) True where the k scores of a prompt's group are not all equal: the only groups a group estimator
    learns from (an all-equal group's advantages are 0)."""
    by_group = scores.view(-1, k)
    return by_group.max(1).values != by_group.min(1).values


@torch.no_grad()
def rollout(prompts, models: Models, tok, opts, gen, gen_stats=None, version=0) -> Rollout:
    """One step's Rollout: k completions of each tokenized prompt (nano_rlhf/rollout.py), the score the policy is
    trained on (scores_from_reward) and the cost beside it, then what the update needs from the models
    (with_logprobs). version: the optimizer steps the policy has taken (each sample records it)."""
    k = opts.samples_per_prompt
    with parallel.gathered(models.policy):      # FSDP: one all-gather for the whole decoding, not one per token
        r = sample_groups(prompts, models.policy, tok, sampling_options(opts, tok), k, gen, gen_stats, models.tools,
                          opts.max_turns, version)
    raw, rm_stats, _ = read_reward(models.reward, r, k)
    gold = raw if models.gold is models.reward else read_reward(models.gold, r, k)[0]
    scores = scores_from_reward(raw, r.has_eos.bool(), opts, rm_stats)
    costs = read_reward(models.cost, r, k)[0]                # raw: a cost model's 0 is its safe/unsafe boundary
    r = replace(r, scores=scores, raw_scores=raw, gold=gold, costs=costs,
                policy_mask=r.actions)                      # tool turns are context, never the policy's loss
    return with_logprobs(r, models, opts)


@torch.no_grad()
def with_logprobs(r: Rollout, models: Models, opts) -> Rollout:
    """The rollout with what the update needs from the models, computed over its sequences in micro-batches of
    --micro_batch_size with the policy in eval mode: π_old's log-probs (unless the update's own first forward is
    π_old), the reference's and both critics' values."""
    # One update on the rollout it was sampled from, and no KL: π_old is the current policy, so its log-probs
    # come from the update's own forward (detached) and this extra forward is skipped (as TRL's GRPO does).
    need_old = models.ref is not None or opts.ppo_epochs > 1 or opts.num_minibatches > 1
    seq, attn, response_mask, device = r.query_response, r.attention_mask, r.response_mask, r.scores.device
    P = r.query_len
    logprobs, ref_logprobs, values, cost_values = (
        torch.zeros_like(response_mask) if needed else None for needed in (
            need_old, models.ref is not None, models.critic is not None, models.cost_critic is not None))
    models.policy.eval()
    for i in range(0, seq.shape[0], opts.micro_batch_size):
        mb = slice(i, i + opts.micro_batch_size)
        batch = (seq[mb], attn[mb], response_mask[mb], opts.temperature)
        with autocast(device, opts.dtype):
            if logprobs is not None:
                logprobs[mb] = response_logprobs(models.policy, *batch)
            if ref_logprobs is not None:
                ref_logprobs[mb] = response_logprobs(models.ref, *batch)
            for critic, v in ((models.critic, values), (models.cost_critic, cost_values)):
                if v is not None:
                    v[mb] = critic(seq[mb], attn[mb])[0][:, P - 1:-1].float() * response_mask[mb]
    models.policy.train()
    return replace(r, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, cost_values=cost_values)


# ---- update ----------------------------------------------------------------------------------------

def ptx_backward(policy: Learner, ptx: SFTBatches, opts):
    """The pre-training mix (InstructGPT PPO-ptx): γ_ptx · NLL of the next SFT batch (token-mean over all ranks),
    backward without gradient sync (the minibatch's last micro-batch syncs it with the policy loss's)."""
    device = next(policy.model.parameters()).device
    ids, attn, loss_mask = (t.to(device) for t in ptx.next_batch())
    targets = loss_mask[:, 1:].bool()
    n_global = dist.all_reduce_sum(float(targets.sum()))
    parallel.sync_gradients(policy.wrapped, False)
    with autocast(device, opts.dtype):
        nll = -policy.wrapped(ids, attn, select=F.pad(targets, (0, 1)), targets=ids[:, 1:][targets]).sum()
    (opts.ptx_coef * nll * token_mean_scale(n_global)).backward()


def update(r: Rollout, targets: Advantages, policy: Optional[Learner], critic: Optional[Learner],
           cost_critic: Optional[Learner], opts, beta, gen, ptx: Optional[SFTBatches] = None):
    """--ppo_epochs over shuffled minibatches of the rollout; policy=None trains the critics only (warm-up).
    Returns named sums over this rank's tokens (and summed gradient norms) for the step's statistics."""
    critics = [(name, c, old, ret) for name, c, old, ret in (    # (metric prefix, the critic, V_old, its returns G)
        ("", critic, r.values, targets.returns), ("cost_", cost_critic, r.cost_values, targets.cost_returns))
        if c is not None]
    B = r.query_response.shape[0]
    mb_size = B // opts.num_minibatches
    clip_high = opts.clip_high if opts.clip_high is not None else opts.clip_eps
    agg = loss_aggregation(opts)
    policy_mask = r.policy_mask
    sums = defaultdict(float)
    for epoch in range(opts.ppo_epochs):
        order = torch.randperm(B, generator=gen, device="cpu").to(r.query_response.device)
        for start in range(0, B, mb_size):
            idx = order[start:start + mb_size]
            # the minibatch's global normalisers, over all ranks (aggregate_loss)
            n_tok, n_pol_tok, n_pol_seq = dist.all_reduce_sum(
                minibatch_counts(r.response_mask[idx], policy_mask[idx])).tolist()
            if policy is not None and ptx is not None:
                ptx_backward(policy, ptx, opts)
            micro = list(range(0, len(idx), opts.micro_batch_size))
            for j, ms in enumerate(micro):
                i = idx[ms:ms + opts.micro_batch_size]
                seq, attn = r.query_response[i], r.attention_mask[i]
                mb_mask, mb_policy_mask = r.response_mask[i], policy_mask[i]      # (b, R): critic's, policy's
                last = j == len(micro) - 1      # gradients all-reduced on the minibatch's last micro-batch only
                sums["tokens"] += mb_mask.sum().item()
                if policy is not None:
                    parallel.sync_gradients(policy.wrapped, last)
                    with autocast(seq.device, opts.dtype):
                        logp, ent = response_logprobs(policy.wrapped, seq, attn, mb_mask, opts.temperature,
                                                      with_entropy=True)
                    old = logp.detach() if r.logprobs is None else r.logprobs[i]
                    pg, ratio = policy_loss(logp, old, targets.adv[i], opts.clip_eps, clip_high)
                    per_token = pg - opts.entropy_coef * ent
                    if opts.kl_in_loss and r.ref_logprobs is not None:
                        per_token = per_token + beta * kl_estimate(logp, r.ref_logprobs[i], opts.kl_loss_estimator)
                    aggregate_loss(per_token, mb_policy_mask, agg, n_pol_tok, n_pol_seq, opts.max_new_tokens,
                                   scale=dist.ddp_scale()).backward()
                    with torch.no_grad():
                        sums["policy_tokens"] += mb_policy_mask.sum().item()
                        sums["policy_loss"] += (pg * mb_policy_mask).sum().item()
                        sums["entropy"] += (ent * mb_policy_mask).sum().item()
                        # k3 of KL(old‖new)
                        sums["approx_kl"] += ((ratio - 1 - (logp - old)) * mb_policy_mask).sum().item()
                        # clip fraction = tokens whose ratio lies outside [1 − ε, 1 + ε_high] (as OpenAI
                        # baselines / TRL log it), not "the clipped term was the one selected by the max"
                        outside = (ratio < 1 - opts.clip_eps) | (ratio > 1 + clip_high)
                        sums["clipfrac"] += (outside.float() * mb_policy_mask).sum().item()
                        sums["ratio"] += (ratio * mb_policy_mask).sum().item()
                for name, c, old_values, returns in critics:
                    parallel.sync_gradients(c.wrapped, last)
                    with autocast(seq.device, opts.dtype):
                        new_values = c.wrapped(seq, attn)[0][:, r.query_len - 1:-1].float()
                    v_loss, v_clipped = value_loss(new_values, old_values[i], returns[i], opts.value_clip)
                    ((v_loss * mb_mask).sum() * token_mean_scale(n_tok)).backward()
                    sums[f"{name}value_loss"] += (v_loss.detach() * mb_mask).sum().item()
                    sums[f"{name}value_clipfrac"] += (v_clipped.float() * mb_mask).sum().item()
            sums["updates"] += 1
            if policy is not None:
                sums["grad_norm"] += policy.step(opts.grad_clip)
            for name, c, _, _ in critics:
                sums[f"{name}critic_grad_norm"] += c.step(opts.grad_clip)
    return dict(sums)


# ---- statistics over all ranks (the loop's; each a visible all-reduce around the pure functions above) ----

def whiten_over_ranks(x, mask):
    """masked_whiten over the valid tokens of ALL ranks: two passes (the mean, then the squared deviations around
    it), one all-reduce each."""
    n, total = dist.all_reduce_sum(masked_sums(x, mask))
    mean = total / n.clamp(min=1)
    return masked_whiten(x, mask, n, mean, dist.all_reduce_sum(masked_sq_dev(x, mask, mean)))


def explained_variance_over_ranks(returns, values, mask):
    """explained_variance of a critic over the valid tokens of ALL ranks: two passes over the returns and the
    residuals, one all-reduce each."""
    residuals = returns - values
    sums = dist.all_reduce_sum(torch.cat([masked_sums(returns, mask), masked_sums(residuals, mask)]))
    n = sums[0].clamp(min=1)
    sq_devs = dist.all_reduce_sum(torch.stack([masked_sq_dev(returns, mask, sums[1] / n),
                                               masked_sq_dev(residuals, mask, sums[3] / n)]))
    return explained_variance(*sq_devs)


def step_metrics(r: Rollout, seq_kl, kl_penalty, sums, beta, k=1):
    """Named per-step figures, averaged over all ranks: sequence means (seq_kl: Σ_t KL_t of each sequence,
    kl_penalty: the KL part of its reward), token means and update means of update()'s named sums (the policy's
    figures over the policy loss's own tokens, the critics' over every response token). k > 1 (a group
    estimator's samples per prompt) adds zero_spread, the share of groups whose k scores are all equal (they
    teach a group estimator nothing); the cost's sequence mean beside the score's."""
    seq = {"score": r.scores, "rm_score_raw": r.raw_scores, "kl": seq_kl,
           "non_score_reward": kl_penalty, "response_length": r.response_mask.sum(1), "eos_rate": r.has_eos}
    if k > 1:
        seq["zero_spread"] = (~group_spread(r.scores, k)).repeat_interleave(k).to(r.scores.dtype)
    if r.gold is not None:
        seq["gold_reward"] = r.gold
    seq["cost"] = r.costs
    names = ["sequences", *seq, *sums]
    local = [r.scores.shape[0], *(v.sum() for v in seq.values()), *sums.values()]
    total = dict(zip(names, dist.all_reduce_sum(dist.stacked(local)).tolist()))     # the one read
    metrics = {f"train/{k}": total[k] / total["sequences"] for k in seq}
    policy = ("policy_loss", "entropy", "approx_kl", "clipfrac", "ratio")     # update() counts policy_tokens beside
    per_token = (*policy, "value_loss", "value_clipfrac", "cost_value_loss", "cost_value_clipfrac")
    metrics.update({f"train/{k}": total[k] / max(total["policy_tokens" if k in policy else "tokens"], 1)
                    for k in per_token if k in total})
    per_update = max(total["updates"], 1)          # every rank counts its updates, so this also divides by ranks
    metrics.update({f"train/{k}": total[k] / per_update for k in ("grad_norm", "critic_grad_norm",
                                                                  "cost_critic_grad_norm") if k in total})
    metrics["train/kl_coef"] = beta
    if r.stats:       # rank means of the sampling's figures (tool calls)
        names = sorted(r.stats)
        sums = dist.all_reduce_sum(torch.tensor([r.stats[k] for k in names], dtype=torch.float64))
        means = sums / dist.world().world_size
        metrics.update({f"train/{k}": v for k, v in zip(names, means.tolist())})
    return metrics


# ---- set-up -----------------------------------------------------------------------------------------

def check_options(opts):
    """--device one this machine has, then the rules between options; each option's own range is declared on its
    Options field (checked on parsing)."""
    check_device(opts.device)
    if opts.advantage in GROUP and opts.samples_per_prompt < 2:
        fail(f"--advantage {opts.advantage} needs --samples_per_prompt >= 2 (it compares samples of one prompt)", 2)
    if opts.reward not in ("model", "gold") and not reward_mod.is_function_spec(opts.reward):
        fail(f"--reward must be model, gold, or module:function / path/to/file.py:function (got {opts.reward!r})",
             2)
    rollout_size = opts.batch_size * opts.samples_per_prompt
    if rollout_size % opts.num_minibatches:
        fail(f"the rollout of {rollout_size} sequences per device (--batch_size {opts.batch_size} x "
             f"--samples_per_prompt {opts.samples_per_prompt}) does not split into --num_minibatches "
             f"{opts.num_minibatches}", 2)
    mb_size = rollout_size // opts.num_minibatches
    if mb_size % opts.micro_batch_size:
        fail(f"a minibatch of {mb_size} sequences does not split into micro-batches of --micro_batch_size "
             f"{opts.micro_batch_size}", 2)
    if not (opts.cost_model or opts.cost):
        fail("PPO-Lagrangian needs a cost: --cost_model DIR (train_rm.py --objective cost) or --cost "
             "module:function (train_ppo.py trains on the reward alone)", 2)
    if opts.cost_model and opts.cost:
        fail("pass one cost: --cost_model DIR or --cost module:function, not both", 2)
    if opts.lambda_init > opts.lambda_max:
        fail(f"--lambda_init {opts.lambda_init:g} is above --lambda_max {opts.lambda_max:g}", 2)
    if opts.cost and not reward_mod.is_function_spec(opts.cost):
        fail(f"--cost must be module:function or path/to/file.py:function (got {opts.cost!r}); a cost model "
             "directory is --cost_model", 2)
    msg = lora.check_lora_options(opts)
    if msg:
        fail(msg, 2)


def run_record(opts):
    """The inputs the run only reads (reward and cost code files too: an edited reward is another run) and its
    data files; its options are its identity (nano_rlhf/training.py). A default out/rm that the run never opens (no
    reward model, no critic from it) is no input: its files are not checksummed for --resume."""
    rm_used = opts.reward == "model" or (opts.advantage == "gae" and opts.critic_init == "reward_model")
    return dict(inputs={"init": opts.init, "ref": opts.ref, "reward_model": opts.reward_model if rm_used else "",
                        "reward": code_file(opts.reward), "cost_model": opts.cost_model,
                        "cost": code_file(opts.cost),
                        **{"tools" + (f".{i}" if i else ""): f for i, f in enumerate(code_files(opts.tools))}},
                data_files={"prompts": opts.prompts or default_path("prompts"),
                            "eval_prompts": opts.eval_prompts, "ptx_data": opts.ptx_data})


def startup_line(opts, models: Models, n_prompts, prompt_stats, step):
    """The run's one-line summary printed at start-up (step: where a --resume goes on)."""
    B, k = opts.batch_size, opts.samples_per_prompt
    return (f"{opts.advantage.upper()}-Lagrangian | reward {opts.reward} | cost {opts.cost_model or opts.cost} <= "
            f"{opts.cost_limit:g}, λ from {opts.lambda_init:g} | {n_prompts:,} prompts ({prompt_stats}) | {B} prompts "
            f"x {k} samples x {dist.world().world_size} ranks per step | {opts.ppo_epochs} epochs x "
            f"{opts.num_minibatches} minibatches of {B * k // opts.num_minibatches} (micro {opts.micro_batch_size}) | "
            f"critics: {f'{opts.critic_init}, {opts.cost_critic_init}' if models.critic is not None else 'none'} | "
            f"{opts.max_steps} steps"
            + lora.describe(models.policy) + (" | reference: the policy with its adapters off"
                                              if isinstance(models.ref, lora.BaseView) else "")
            + (f" | resuming at step {step}" if step else ""))


def load_models(opts, tok, prompt_texts, device, identity):
    """Policy, reference (only if β > 0), reward, cost and the two critics (only for gae); the reward and
    the cost on the device (training.place moves the others). With --lora_r the policy and critics get adapters
    (what that adds to the run's identity goes into `identity`) and a reference that is --init is the policy with
    its adapters off (lora.BaseView), not a second model."""
    policy = GPT.from_pretrained(opts.init, dropout=0.0)      # dropout off: rollout log-probs must be reproducible
    check_vocab(tok, policy.cfg, opts.init)
    identity.update(lora.attach(policy, opts, opts.init))     # --lora_r: adapters, the base frozen
    ref = None
    if (opts.kl_coef > 0 or opts.adaptive_kl) and lora.shares_base(opts, opts.ref):
        ref = lora.BaseView(policy)
    elif opts.kl_coef > 0 or opts.adaptive_kl:               # with β = 0 no KL is ever computed: no reference
        ref = GPT.from_pretrained(opts.ref or opts.init, dropout=0.0).requires_grad_(False).eval()
        check_vocab(tok, ref.cfg, opts.ref or opts.init)
    spec = opts.reward_model if opts.reward == "model" else opts.reward
    reward = load_reward(spec, tokenizer=tok, device=device, prompts=prompt_texts, batch_size=opts.micro_batch_size)
    if isinstance(reward, RewardModel) and opts.normalize_score and not reward.has_stats:
        dist.print0(f"note: {spec}/config.json has no reward_mean/reward_std; scores are not normalised")
    if opts.cost_model:
        cost = RewardModel.from_dir(opts.cost_model, tok, device, opts.micro_batch_size, kind="cost")
    else:
        cost = load_function(opts.cost, "--cost")

    def critic_from(src, new_head, prefix, seed):
        c = ScoreModel.from_pretrained(src, new_head=new_head, dropout=0.0)
        check_vocab(tok, c.cfg, src)                          # it reads the policy tokenizer's ids
        identity.update(lora.attach(c, opts, src, trainable=("score",), prefix=prefix, seed=seed))
        return c
    critic = cost_critic = None
    if opts.advantage == "gae":
        critic = critic_from(opts.reward_model if opts.critic_init == "reward_model" else opts.init,
                             opts.critic_init == "policy", "critic_lora", opts.seed + 1)
        cost_critic = critic_from(opts.cost_model if opts.cost_critic_init == "cost_model" else opts.init,
                                  opts.cost_critic_init == "policy", "cost_critic_lora", opts.seed + 2)
    for rm, what in ((reward, "reward model"), (cost, "cost model")):
        if isinstance(rm, RewardModel):
            dist.check_same_weights(rm.model, what)
    return Models(policy=policy, reward=reward, cost=cost, ref=ref, critic=critic, gold=builtin_gold(prompt_texts),
                  cost_critic=cost_critic, tools=load_tools(opts.tools) if opts.tools else None)


def ready_models(opts, models: Models):
    """The models ready for the loop, once training.place has put them on the device: the frozen ones (reference,
    reward and cost models) placed by --fsdp / --frozen / --offload_frozen, the trained ones wrapped with their
    optimizers (the policy at --lr, the critics at --critic_lr), the memory plan printed. Returns the trained
    ones, {"policy", "critic", "cost_critic": Learner}, the critics only where there are some."""
    models.ref = training.frozen(opts, models.ref)
    for scorer in (models.reward, models.cost):
        if isinstance(scorer, RewardModel):
            scorer.model = training.frozen(opts, scorer.model)
    trained = {name: Learner.of(m, lr, opts) for name, m, lr in (
        ("policy", models.policy, opts.lr), ("critic", models.critic, opts.critic_lr),
        ("cost_critic", models.cost_critic, opts.critic_lr)) if m is not None}
    training.plan(opts, {"policy": models.policy, "critic": models.critic, "cost_critic": models.cost_critic,
                        "ref": models.ref, "reward": getattr(models.reward, "model", None),
                        "cost": getattr(models.cost, "model", None)})
    return trained


def held_out_metrics(run, step, models: Models, tok, prompts, opts):
    """Held-out prompts, pure sampling at T = 1 with a fixed seed (comparable across steps), scored by the reward,
    the gold reward where there is one and the cost, with the KL to the reference; rank 0 only."""
    return eval_metrics(run, step, models.policy, tok, prompts, replace(sampling_options(opts, tok), temperature=1.0),
                        ref=models.ref, rewards={**eval_columns(models.reward, models.gold), "cost": models.cost},
                        gathered=(models.ref, getattr(models.reward, "model", None),
                                  getattr(models.cost, "model", None)), show=3, tools=models.tools,
                        max_turns=opts.max_turns)


SHOW = ["train/score", "train/gold_reward", "train/cost", "train/episode_cost", "train/lambda", "train/kl",
        "train/entropy", "train/clipfrac", "train/value_loss", "train/response_length",
        "eval/gold_reward", "eval/rm_score", "eval/reward", "eval/cost", "eval/kl"]   # the progress line's, in order
LOSS_KEYS = ["train/policy_loss", "train/value_loss"]      # a NaN/inf in either stops the run (checkpoint intact)


def main(argv=None):
    opts = parse_args(Options, argv, __doc__)      # each option's range and [with ...] refused here
    fill_defaults(opts)                            # the defaults that depend on other options
    check_options(opts)                            # --device and the rules between options; only refuses
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    run = training.open_run(opts, "ppo_lagrangian", **run_record(opts), show=SHOW, loss_keys=LOSS_KEYS)
    with input_errors():
        prompt_records, eval_records = load_prompts(opts.prompts, opts.eval_prompts, opts.eval_fraction, opts.seed)
        ptx_records = load_records(opts.ptx_data, "sft") if opts.ptx_data else None
        tok = training.tokenizer(opts, run)
        torch.manual_seed(opts.seed)          # a fresh critic head: a function of --seed, the same on every rank
        models = load_models(opts, tok, [p["prompt"] for p in prompt_records + eval_records], world.device,
                             run.identity)
        block = models.policy.cfg.block_size         # prompts and PTX examples fit the policy's context
        prompts, prompt_stats = tokenize_prompts(prompt_records, tok, prompt_limit(opts.max_prompt_len,
                                                                                   opts.max_new_tokens, block),
                                                 tools=None if models.tools is None else models.tools.schemas)
        ptx = None if ptx_records is None else SFTBatches(
            tokenize_sft(ptx_records, tok, training_length(0, block, opts.init))[0], opts.ptx_batch_size, tok.pad_id,
            world.rank, world.world_size, opts.seed)
        prompt_batches = Batches(len(prompts), opts.batch_size, 1, world.rank, world.world_size, opts.seed)
    eval_prompts = eval_records[:opts.eval_samples]
    training.place(opts, world, {"policy": models.policy, "critic": models.critic, "cost critic": models.cost_critic},
                  {"ref": models.ref})
    gen = torch.Generator(device=world.device).manual_seed(opts.seed + 100003 * world.rank)  # ranks sample differently
    shuffle_gen = torch.Generator().manual_seed(opts.seed + 7 + 100003 * world.rank)
    trained = ready_models(opts, models)    # the frozen models placed, the trained ones wrapped
    policy, critic, cost_critic = trained["policy"], trained.get("critic"), trained.get("cost_critic")
    state = dict(models={k: v.model for k, v in trained.items()}, optimizers={k: v.opt for k, v in trained.items()},
                 generators={"rollout": gen, "shuffle": shuffle_gen})
    kl_ctl = AdaptiveKL(opts.kl_coef, opts.kl_target, opts.kl_horizon)
    lag = Lagrange(opts.lambda_init, opts.cost_window, opts.batch_size * opts.samples_per_prompt)
    watch = Watch(opts.score_warn)
    orders = {"data": prompt_batches, "watch": watch, **({"ptx_data": ptx} if ptx else {})}   # resumable positions
    meta = run.resume(**state, data=orders)
    if meta:
        kl_ctl.beta = meta["kl_coef"]
        lag.load_state_dict(meta)
    dist.print0(startup_line(opts, models, len(prompts), prompt_stats, run.step))
    warn_short_warmup(opts.max_steps, opts.warmup_steps)

    def evaluate(step):
        return held_out_metrics(run, step, models, tok, eval_prompts, opts)

    def save(step):
        run.save(step, **state, data=orders, kl_coef=kl_ctl.beta, **lag.state_dict())
        save_model_dir(opts.out_dir, models.policy, tok)

    if run.step == 0 and opts.eval_interval:       # the starting point of the eval curves
        run.log(0, evaluate(0))
    for step in range(run.step + 1, opts.max_steps + 1):
        t0 = time.time()
        set_lr(policy.opt, lr_at(step - 1, opts.max_steps, opts.lr, opts.warmup_steps, "constant"))
        gen_stats = {}
        batch = rollout([prompts[i] for i in prompt_batches.next_step()[0]], models, tok, opts, gen, gen_stats,
                        version=step - 1)
        t_gen = time.time() - t0
        beta = kl_ctl.beta
        estimator = dict(estimator=opts.advantage, kl_estimator=opts.kl_estimator, kl_in_loss=opts.kl_in_loss,
                         k=opts.samples_per_prompt, gamma=opts.gamma, lam=opts.lam)
        episode_cost = lag.add_costs(batch.costs)   # λ's step on this step's costs first, as safe-rlhf does
        if step > opts.lambda_delay:
            lag.log_lambda = lambda_step(lag.log_lambda, episode_cost, opts.cost_limit, opts.lambda_lr, opts.lambda_max)
        targets = lagrangian_targets(batch, lag.multiplier, beta, **estimator)
        if opts.advantage in WHITENED:
            targets.adv = whiten_over_ranks(targets.adv, batch.actions)
        warming_up = critic is not None and step <= opts.critic_warmup_steps
        sums = update(batch, targets, policy=None if warming_up else policy, critic=critic, cost_critic=cost_critic,
                      opts=opts, beta=beta, gen=shuffle_gen, ptx=ptx)
        metrics = step_metrics(batch, sequence_kl(batch), targets.kl_penalty, sums, beta,
                               opts.samples_per_prompt if opts.advantage in GROUP else 1)
        if opts.adaptive_kl:
            kl_ctl.update(metrics["train/kl"], dist.all_reduce_sum(float(batch.scores.shape[0])))
        if critic is not None:
            metrics["train/explained_variance"] = explained_variance_over_ranks(targets.returns, batch.values,
                                                                                batch.response_mask)
        if cost_critic is not None:
            metrics["train/cost_explained_variance"] = explained_variance_over_ranks(
                targets.cost_returns, batch.cost_values, batch.response_mask)
        metrics.update({"train/episode_cost": episode_cost, "train/lambda": lag.multiplier})
        check_step(watch, step, (batch.response_mask.sum(1) - batch.has_eos).tolist(), batch.completions,
                   batch.raw_scores.tolist(), opts.samples_per_prompt, batch.policy_mask.sum().item())
        metrics.update({"train/step_time": time.time() - t0, "train/generate_time": t_gen})
        if opts.compile_rollout:               # compiling (first steps, each new batch bucket) timed apart
            metrics["train/generate_compile_time"] = gen_stats["compile_s"]
        if run.end_of_step(step, metrics, evaluate=lambda: evaluate(step), save=save):
            break
    run.finish(state["models"], {"ref": models.ref, "reward model": getattr(models.reward, "model", None),
                             "cost model": getattr(models.cost, "model", None)},
              saved=f"saved {opts.out_dir} (HF {models.policy.architecture} layout)")
    if models.tools is not None:
        models.tools.close()
    return SimpleNamespace(policy=models.policy, ref=models.ref, reward=models.reward, critic=models.critic,
                           cost=models.cost, cost_critic=models.cost_critic, lagrange=lag,
                           optimizers=state["optimizers"], options=opts)


if __name__ == "__main__":
    main()
