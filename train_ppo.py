"""RLHF with PPO (four models) and its critic-free siblings, on one rollout -> score -> advantage -> update loop.

Models: policy π_θ (trained), critic V (trained; --advantage gae only), reference π_ref (frozen copy of the
SFT policy) and a reward R(prompt, completion) (frozen): a reward-model directory, the built-in task's
programmatic reward (--reward gold), your own Python function (--reward module:function), or self-play
(--reward selfplay, SPO): each sample's win rate against the other k − 1 samples of its prompt under a
judge's preference (--judge and/or --pair_judge, nano_rlhf/reward.py), with no reward model fitted to it.
(Models below, loaded from the options by load_models. PPO-Lagrangian, a cost bounded beside the reward, is
train_ppo_lagrangian.py: this loop with a cost, its critic and a learned multiplier.)

One step (docs/algorithms.md, "PPO" and "Critic-free estimators"):
  1. rollout   k samples per prompt at temperature τ (pure sampling), cut after the first stop token
               (end-of-text, or the chat template's end-of-turn: <|eot_id|>, <|im_end|>)
  2. score     s = clip((R(x, y) − μ_RM)/σ_RM, ±c) for a reward model (R as is for a function), read
               at the stop token; a response without one gets --missing_eos_penalty instead
               selfplay:     s_i = 1/(k−1) Σ_{j≠i} P(y_i ≻ y_j), the win rate in its group  (Swamy et al. 2024)
  3. rewards   gae / reinforce_pp: r_t = −β·KL_t on every response token, + s on the end-of-text token
               rloo / grpo / dr_grpo: the group statistic below of the scores s, plus the KL penalty
               p_i = −β·Σ_t k1_t centred in its group (never divided by the scores' spread); or KL in the loss
               (--kl_in_loss, k3)
               KL_t = k1 = log π_old − log π_ref (default), k2 = ½d² or k3 = e^−d − 1 + d; β fixed or adaptive
               (what each gives as a loss, --kl_in_loss --kl_loss_estimator: see kl_estimate)
  4. advantage gae:          δ_t = r_t + γV_{t+1} − V_t,  A_t = δ_t + γλA_{t+1}    (Schulman et al. 2016, eq. 16)
                             whitened over the valid tokens of all ranks; returns G_t = A_t + V_t
               rloo:         A_i = (s_i + p_i) − mean_{j≠i} (s_j + p_j)            (Ahmadian et al. 2024, eq. 6)
               grpo:         A_i = (s_i − mean_G s) / (std_G s + 1e-4) + p_i − mean_G p   (Shao et al. 2024, eq. 3)
               dr_grpo:      A_i = (s_i + p_i) − mean_G (s + p), loss / (sequences × max_new_tokens)  (Liu et al. 2025)
               reinforce_pp: A_t = whiten(Σ_{s≥t} γ^{s−t} r_s) over the whole batch   (Hu 2025)
  5. update    --ppo_epochs over shuffled minibatches (micro-batches accumulate):
               ρ_t = π_θ/π_old,  L_π = max(−A_t ρ_t, −A_t clip(ρ_t, 1−ε, 1+ε_high))  (Schulman et al. 2017, eq. 7)
               L_V = ½ max((V − G)², (V_old + clip(V − V_old, ±ε_v) − G)²), − c_H·entropy, + γ_ptx·NLL(SFT)
               token-mean over all micro-batches and ranks of the minibatch (dr_grpo: constant normaliser)
               variants, one flag each: --policy_loss dual_clip | gspo | cispo, --loss_agg, --dynamic_sampling,
               --overlong mask | penalty, --rollout_correction tis | mask (docs/algorithms.md, "RLVR variants")
               the first --critic_warmup_steps steps update the critic only (the policy waits for useful values)

Run (docs/usage.md: your own prompts and rewards, real families, --lora_r, torchrun and --fsdp):
    python train_ppo.py                                     # PPO: out/sft + out/rm -> out/ppo
    python train_ppo.py --advantage grpo --reward gold      # GRPO with the built-in task's verifiable reward
    python train_ppo.py --advantage grpo --reward my_rewards.py:score --prompts my_prompts.jsonl
    python train_ppo.py --advantage grpo --reward selfplay --judge out/rm      # SPO, the reward model as judge
    torchrun --nproc_per_node 2 train_ppo.py --advantage grpo --reward gold

Where we differ from TRL on purpose (docs/design.md, "PPO"): the score lands on the end-of-text token itself (TRL
puts it one slot later, on padding); rloo feeds its advantage to the token-level clipped loss (TRL clips one
sequence-level ratio). Groups of k samples live on one rank, so group statistics need no communication.
"""
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable, Literal, Optional

import torch
import torch.nn.functional as F

from nano_rlhf import dist, lora, parallel
from nano_rlhf import reward as reward_mod
from nano_rlhf import training
from nano_rlhf.checkpoint import save_model_dir
from nano_rlhf.cli import FrozenModelOptions, RunOptions, parse_args
from nano_rlhf.data import (Batches, SFTBatches, default_path, load_prompts, load_records, prompt_limit,
                            tokenize_prompts, tokenize_sft, training_length)
from nano_rlhf.evaluate import eval_metrics
from nano_rlhf.model import GPT, ScoreModel
from nano_rlhf.reward import RewardModel, builtin_gold, code_file, eval_columns, load_judge, load_reward, model_dir
from nano_rlhf.rollout import Rollout, read_reward, sample_groups
from nano_rlhf.sampling import SamplingOptions, sampling_copy
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
    reward: str = "model"         # model (--reward_model), gold (built-in task only), selfplay (SPO: --judge /
                                  # --pair_judge), or module:function / file.py:function
    judge: str = ""               # pointwise judge, preferences by Bradley-Terry (reward-model dir, gold,
                                  # module:function, llm:MODEL_DIR) [with reward=selfplay]
    pair_judge: str = ""          # pairwise judge module:function(prompts, a, b) -> P(a ≻ b) (used over --judge)
                                  # [with reward=selfplay]
    judge_template: str = ""      # --judge llm:MODEL_DIR: template file with {prompt} and {response}; empty =
                                  # nano_rlhf/templates/judge_default.txt [with reward=selfplay]
    init: str = "out/sft"         # policy to start from (also the reference unless --ref)
    ref: str = ""                 # reference policy directory; empty = --init
    reward_model: str = "out/rm"  # reward model directory (with --reward model)
    critic_init: Literal["auto", "reward_model", "policy"] = "auto"  # critic trunk+head from; auto = RM if used
                                                                     # [with advantage=gae]
    prompts: str = ""             # RL prompts JSONL {"prompt": ...}; empty = built-in task
    eval_prompts: str = ""        # held-out prompts; empty = built-in task's, or split --eval_fraction off --prompts
    eval_fraction: float = 0.05   # share of --prompts held out for evaluation when no --eval_prompts {0 < x < 1}
    out_dir: str = ""             # output directory; empty = out/ppo (gae) or out/<advantage>
    # ---- the rollout
    batch_size: int = 8           # prompts per device per step {>= 1}
    samples_per_prompt: int = 8   # k completions per prompt (8 x 8 = 64 completions a step, every estimator) {>= 1}
    max_new_tokens: int = 40      # response length limit (also Dr. GRPO's constant normaliser) {>= 1}
    temperature: float = 1.0      # sampling temperature; log-probs use logits / temperature everywhere {> 0}
    compile_rollout: bool = False # decode with a torch.compile'd static-cache step (compiles once per batch bucket)
    share_prompt_prefill: bool = True  # the k samples of a prompt share one prefill of it (same tokens at a seed)
    compact_rollout: bool = True  # ended samples leave the decode batch (same tokens at a seed)
    rollout_dtype: Literal["float32", "bfloat16"] = "float32"  # dtype of the sampling copy; log-probs stay float32
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
    missing_eos_penalty: Optional[float] = -3.0  # score given (replacing R) to a response without end-of-text (--reward
                                                 # selfplay: 0, the worst win rate); none = off; a score, bounded as
                                                 # every reward is (reward.MAX_SCORE) {-1e15 <= x <= 1e15}
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
    policy_loss: Literal["ppo", "dual_clip", "gspo", "cispo"] = "ppo"  # ppo: clipped token ratio; dual_clip: caps
                                                                       # −c·A for A < 0; gspo: one ratio a sequence
                                                                       # (--clip_eps 3e-4 --clip_high 4e-4); cispo:
                                                                       # a clipped, detached weight on every token
    dual_clip: float = 3.0        # the cap c [with policy_loss=dual_clip] {> 1}
    loss_agg: LossAgg = "auto"    # how token losses become the minibatch loss; auto = token_mean (dr_grpo:
                                  # seq_mean_token_sum_norm, gspo: seq_mean_token_mean)
    # ---- RLVR variants (docs/algorithms.md, "RLVR variants")
    dynamic_sampling: bool = False  # DAPO: groups whose k rewards are all equal (no signal) are dropped and more
                                    # prompts sampled until the batch is full [with advantage=rloo|grpo|dr_grpo]
    max_sampling_rounds: int = 3  # at most this many rollouts a step, then zero-spread groups fill the batch (logged)
                                  # [with dynamic_sampling] {>= 1}
    overlong: Literal["none", "mask", "penalty"] = "none"  # responses cut at --max_new_tokens: trained on as usual,
                                                           # masked out of the policy loss, or DAPO's soft length
                                                           # penalty (use with --missing_eos_penalty none)
    overlong_buffer: int = 0      # L_cache, the last tokens before the limit over which the penalty falls to −1; 0 =
                                  # max_new_tokens // 4 [with overlong=penalty] {>= 0}
    rollout_correction: Literal["none", "tis", "mask"] = "none"  # sampler/trainer log-prob mismatch: truncated
                                                                 # importance weights, or masking tokens past the cap
                                                                 # [with rollout_dtype!=float32]
    correction_level: Literal["token", "sequence"] = "token"  # the correction per token, or one ratio for the whole
                                                              # response [with rollout_correction!=none]
    correction_cap: float = 2.0   # C, the weight cap (tis) or the ratio range [1/C, C] kept (mask)
                                  # [with rollout_correction!=none] {> 1}
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
    lora_r: int = 0               # LoRA rank for the policy and the critic (its score head trains fully); the reference
                                  # is then the policy with adapters off; 0 = off {>= 0}


def fill_defaults(opts):
    """The defaults that depend on other options, filled in right after parsing (run.json records the filled
    values)."""
    opts.out_dir = opts.out_dir or ("out/ppo" if opts.advantage == "gae" else f"out/{opts.advantage}")
    if opts.critic_init == "auto":
        opts.critic_init = "reward_model" if opts.reward == "model" else "policy"
    rollout_size = opts.batch_size * opts.samples_per_prompt
    opts.micro_batch_size = opts.micro_batch_size or rollout_size // opts.num_minibatches
    if opts.reward == "selfplay" and opts.missing_eos_penalty == -3.0:
        # the default, made for scores of a few units: a win rate lies in [0, 1], so an unfinished sample gets the
        # worst win rate instead
        opts.missing_eos_penalty = 0.0


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

def selfplay_rewards(pref):
    """SPO (Swamy et al. 2024, "A Minimaximalist Approach to RLHF"): the reward of a sample is its win rate
    against the current policy, r(y) = P(y ≻ π_t), estimated on the k samples of its prompt as the mean
    preference over the k − 1 others, r_i = 1/(k−1) Σ_{j≠i} P(y_i ≻ y_j). pref: (G, k, k) with
    pref[g, i, j] = P(y_i ≻ y_j); its diagonal is never read (a sample against itself is no evidence, and
    leaving it out keeps the estimate unbiased). Returns (G, k)."""
    k = pref.shape[-1]
    off_diagonal = ~torch.eye(k, dtype=torch.bool, device=pref.device)
    return torch.where(off_diagonal, pref, torch.zeros_like(pref)).sum(-1) / (k - 1)


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


def dual_clip_loss(loss, adv, c=3.0):
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5): for A < 0 the
    clipped surrogate max(−Aρ, −A·clip(ρ)) grows without bound in ρ; cap it at −c·A (c > 1). A ≥ 0 unchanged."""
    return torch.where(adv < 0, torch.minimum(loss, -c * adv), loss)


def gspo_loss(logp, old_logp, adv, mask, clip_low=3e-4, clip_high=4e-4):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5–7, GSPO-token form): one
    length-normalised ratio per sequence, s_i = (π_θ(y_i)/π_old(y_i))^(1/|y_i|) = exp(mean_t(log π_θ − log π_old)),
    clipped per sequence. Written per token as s_i,t = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)] (value s_i, gradient
    s_i·∇log π_θ(y_t)), so averaged over each sequence's tokens (--loss_agg seq_mean_token_mean) the value is
    max(−A_i s_i, −A_i clip(s_i, 1−ε_low, 1+ε_high)) and the gradient GSPO's −A_i s_i ∇log s_i.
    Returns the per-token loss and the (broadcast) sequence ratio s_i."""
    lengths = mask.sum(1, keepdim=True).clamp(min=1)
    log_s = ((logp - old_logp) * mask).sum(1, keepdim=True) / lengths          # (B, 1) log s_i
    s_tok = torch.exp(log_s.detach() + logp - logp.detach())                    # value s_i, gradient through log π
    loss = torch.max(-adv * s_tok, -adv * torch.clamp(s_tok, 1 - clip_low, 1 + clip_high))
    return loss, s_tok.detach().expand_as(logp)


def cispo_loss(logp, old_logp, adv, clip_low=0.2, clip_high=0.2):
    """CISPO (MiniMax-M1, 2025, eq. 4): the importance weight is clipped and held constant, and every token
    keeps a gradient: −sg(clip(ρ, 1−ε_low, 1+ε_high))·A·log π_θ. Unlike PPO's clip, a token whose ratio left
    the range still contributes (with the capped weight), so rare high-ratio tokens are not silenced."""
    ratio = torch.exp(logp - old_logp)
    weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach()
    return -weight * adv * logp, ratio


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
    if opts.policy_loss == "gspo":
        return "seq_mean_token_mean"
    return "seq_mean_token_sum_norm" if opts.advantage == "dr_grpo" else "token_mean"


def overlong_penalty(length, max_len, buffer):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the score: 0 up to L_max − L_cache
    tokens, then falling linearly to −1 at L_max (responses are cut at L_max, so never below −1)."""
    start = max_len - buffer
    return ((start - length.float()) / max(buffer, 1)).clamp(min=-1.0, max=0.0)


def rollout_correction(train_logp, sampler_logp, mask, how, level="token", cap=2.0):
    """The sampler (a bf16 copy, a compiled step, another engine) and the trainer compute slightly different
    log-probs for the same tokens, so the rollout is off-policy for the trainer's π_old. Returns per-token
    weights (detached) that multiply the policy loss and the share of tokens capped or masked.
      tis   truncated importance sampling, w = min(π_old/π_sampler, C)           (Yao et al. 2025, "Your efficient
            RL framework secretly brings you off-policy RL training")
      mask  w = 1 where the ratio lies in [1/C, C], else 0 (the token, or the whole sequence, leaves the loss)
    level=token: the ratio of each token; sequence: exp(Σ_t log-ratio) of the whole response, for all its tokens."""
    log_ratio = (train_logp - sampler_logp) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(1, keepdim=True).expand_as(mask)
    ratio = torch.exp(log_ratio.clamp(max=50.0))               # exp(50) is already far past any cap
    if how == "tis":
        w = ratio.clamp(max=cap)
        hit = ratio > cap
    else:
        hit = (ratio > cap) | (ratio < 1 / cap)
        w = (~hit).to(ratio.dtype)
    return w.detach() * mask, (hit.float() * mask).sum() / mask.sum().clamp(min=1)


class AdaptiveKL:
    """β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon), n = samples in the update (Ziegler et al. 2019)."""

    def __init__(self, beta, target, horizon):
        self.beta, self.target, self.horizon = beta, target, horizon

    def update(self, kl, n):
        err = min(max(kl / self.target - 1, -0.2), 0.2)
        self.beta *= 1 + err * n / self.horizon


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
    reward: Callable                      # scores = reward(prompts, completions) (nano_rlhf.reward; frozen);
    #                                     SPO: a Judge
    ref: Optional[GPT] = None             # π_ref (frozen; --lora_r: a lora.BaseView of the policy); None when β = 0
    critic: Optional[ScoreModel] = None   # V (trained; --advantage gae only)
    gold: Optional[Callable] = None       # a programmatic reward logged beside the trained one, when one applies
    tools: Optional[ToolBox] = None       # the tools the policy may call in its rollouts (--tools)


def sampling_options(opts, tok):
    """What a rollout samples and how the engine computes it (nano_rlhf.sampling.SamplingOptions): pure sampling
    at τ up to the tokenizer's stop ids (end-of-text, the template's end-of-turn)."""
    # under --fsdp the engine samples with the gathered weights themselves (an FSDP module cannot be copied
    # into a sampling copy of another dtype; --rollout_dtype bfloat16 is refused with --fsdp)
    return SamplingOptions(max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, stop_ids=tok.stop_ids,
                           pad_id=tok.pad_id, compile=opts.compile_rollout, share_prefix=opts.share_prompt_prefill,
                           compact=opts.compact_rollout,
                           dtype=None if opts.fsdp else getattr(torch, opts.rollout_dtype))


def group_spread(scores, k):
    """(G,) True where the k scores of a prompt's group are not all equal: the only groups a group estimator
    learns from (an all-equal group's advantages are 0)."""
    by_group = scores.view(-1, k)
    return by_group.max(1).values != by_group.min(1).values


@torch.no_grad()
def rollout(next_prompts, models: Models, tok, opts, gen, gen_stats=None, version=0) -> Rollout:
    """One step's Rollout, the one path: sample and score k completions of each prompt of next_prompts(), then
    what the update needs from the models (with_logprobs). next_prompts() -> the next batch of tokenized prompt
    records. version: the optimizer steps the policy has taken (each sample records it).
    --dynamic_sampling (DAPO, Yu et al. 2025, eq. 11: keep groups with 0 < #correct < k): more batches of prompts
    are sampled until this rank holds batch_size groups whose scores differ, at most --max_sampling_rounds
    rounds; every rank runs the same number of rounds (a reward model may be sharded: its forwards are
    collective), and a rank still short after the last round fills up with zero-spread groups (counted)."""
    k, B = opts.samples_per_prompt, opts.batch_size
    if not opts.dynamic_sampling:
        return with_logprobs(sample(next_prompts(), models, tok, opts, gen, gen_stats, version), models, opts)
    parts, spreads, first_zero = [], [], None
    for _ in range(opts.max_sampling_rounds):
        part = sample(next_prompts(), models, tok, opts, gen, gen_stats, version)
        spread = group_spread(part.scores, k)
        first_zero = (~spread).float().mean().item() if first_zero is None else first_zero
        parts.append(part)
        spreads.append(spread)
        short = float(int(torch.cat(spreads).sum()) < B)
        if dist.all_reduce_sum(short) == 0:                 # every rank is full
            break
    joined, spread = Rollout.cat(parts, tok.pad_id), torch.cat(spreads)
    order = torch.cat([spread.nonzero().view(-1), (~spread).nonzero().view(-1)])[:B].tolist()
    r = joined.rows([g * k + j for g in order for j in range(k)])
    r.stats.update(zero_spread_groups=first_zero, sampling_rounds=float(len(parts)),
                   filled_groups=float(max(0, B - int(spread.sum()))))
    return with_logprobs(r, models, opts)


def sample(prompts, models: Models, tok, opts, gen, gen_stats=None, version=0) -> Rollout:
    """k completions per prompt (nano_rlhf/rollout.py) with the score the policy is trained on: a win rate within
    the prompt's group under a judge (SPO), else the reward as scores_from_reward makes it, plus DAPO's overlong
    rule (--overlong penalty in the score, or mask: no policy gradient from a truncated response)."""
    k = opts.samples_per_prompt
    # the sampled tokens are all the update takes from generation: log-probs (π_old) are recomputed in
    # with_logprobs or in the update by the float32 policy, so a bfloat16 sampling copy keeps the ratio 1 at lr 0
    with parallel.gathered(models.policy):      # FSDP: one all-gather for the whole decoding, not one per token
        r = sample_groups(prompts, models.policy, tok, sampling_options(opts, tok), k, gen, gen_stats, models.tools,
                          opts.max_turns, version)
    raw, rm_stats, pref = read_reward(models.reward, r, k)
    device = r.response_mask.device
    if pref is not None:                                     # SPO: win rates within each prompt's k samples
        raw = selfplay_rewards(pref).view(-1).float().to(device)
    gold = raw if models.gold is models.reward else read_reward(models.gold, r, k)[0]
    scores = scores_from_reward(raw, r.has_eos.bool(), opts, rm_stats)
    policy_mask = r.actions                                  # tool turns are context, never the policy's loss
    if opts.overlong == "penalty":
        buffer = opts.overlong_buffer or opts.max_new_tokens // 4
        scores = scores + overlong_penalty(r.response_mask.sum(1).long(), opts.max_new_tokens, buffer)
    elif opts.overlong == "mask":                            # DAPO's overlong filtering: no policy gradient from them
        policy_mask = policy_mask * r.has_eos[:, None]
    return replace(r, scores=scores, raw_scores=raw, gold=gold, policy_mask=policy_mask)


@torch.no_grad()
def with_logprobs(r: Rollout, models: Models, opts) -> Rollout:
    """The rollout with what the update needs from the models, computed over its sequences in micro-batches of
    --micro_batch_size with the policy in eval mode: π_old's log-probs (unless the update's own first forward is
    π_old), the reference's, the critic's values, the sampler's, and the sampler/trainer correction
    (--rollout_correction)."""
    # One update on the rollout it was sampled from, and no KL: π_old is the current policy, so its log-probs
    # come from the update's own forward (detached) and this extra forward is skipped (as TRL's GRPO does).
    mismatch = opts.rollout_dtype != "float32" or opts.rollout_correction != "none"
    need_old = models.ref is not None or opts.ppo_epochs > 1 or opts.num_minibatches > 1 or mismatch
    # the sampler's log-probs: those of the sampling copy the engine decoded with (--rollout_dtype), recomputed
    # over the sampled sequences in one forward (the decode's own kernels may differ again in the last bits)
    sampler = (sampling_copy(models.policy, getattr(torch, opts.rollout_dtype)) if opts.rollout_dtype != "float32"
               else models.policy) if mismatch else None
    seq, attn, response_mask, device = r.query_response, r.attention_mask, r.response_mask, r.scores.device
    P = r.query_len
    logprobs, sampler_logprobs, ref_logprobs, values = (
        torch.zeros_like(response_mask) if needed else None for needed in (
            need_old, sampler is not None, models.ref is not None, models.critic is not None))
    models.policy.eval()
    for i in range(0, seq.shape[0], opts.micro_batch_size):
        mb = slice(i, i + opts.micro_batch_size)
        batch = (seq[mb], attn[mb], response_mask[mb], opts.temperature)
        with autocast(device, opts.dtype):
            if logprobs is not None:
                logprobs[mb] = response_logprobs(models.policy, *batch)
            if sampler_logprobs is not None:
                sampler_logprobs[mb] = logprobs[mb] if sampler is models.policy else response_logprobs(sampler, *batch)
            if ref_logprobs is not None:
                ref_logprobs[mb] = response_logprobs(models.ref, *batch)
            if values is not None:
                values[mb] = models.critic(seq[mb], attn[mb])[0][:, P - 1:-1].float() * response_mask[mb]
    models.policy.train()
    actions, policy_mask, is_weight, stats = r.actions, r.policy_mask, None, dict(r.stats)
    if mismatch:
        # per token, on the sampler's samples: KL(sampler ‖ trainer) (k3: ≥ 0, unbiased) — of order d²/2, below
        # metrics.jsonl's 6 decimals for a bf16 copy — and the mean |d|, d = log π_sampler − log π_old
        n_resp = actions.sum().clamp(min=1)
        stats["sampler_kl"] = ((kl_estimate(sampler_logprobs, logprobs, "k3") * actions).sum() / n_resp).item()
        stats["sampler_abs_logratio"] = (((sampler_logprobs - logprobs).abs() * actions).sum() / n_resp).item()
    if opts.rollout_correction != "none":
        w, hit = rollout_correction(logprobs, sampler_logprobs, actions, opts.rollout_correction,
                                    opts.correction_level, opts.correction_cap)
        stats["correction_hit"] = hit.item()
        if opts.rollout_correction == "tis":
            is_weight = w
        else:
            policy_mask = policy_mask * w
    return replace(r, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, sampler_logprobs=sampler_logprobs,
                   policy_mask=policy_mask, is_weight=is_weight, stats=stats)


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


def policy_objective(opts):
    """--policy_loss as one function, chosen once: (logp, old_logp, adv, policy_mask) -> per-token loss, ratio."""
    lo, hi = opts.clip_eps, opts.clip_high if opts.clip_high is not None else opts.clip_eps
    if opts.policy_loss == "gspo":
        return lambda logp, old, adv, mask: gspo_loss(logp, old, adv, mask, lo, hi)
    if opts.policy_loss == "cispo":
        return lambda logp, old, adv, mask: cispo_loss(logp, old, adv, lo, hi)
    if opts.policy_loss == "dual_clip":
        def dual_clip(logp, old, adv, mask):
            pg, ratio = policy_loss(logp, old, adv, lo, hi)
            return dual_clip_loss(pg, adv, opts.dual_clip), ratio
        return dual_clip
    return lambda logp, old, adv, mask: policy_loss(logp, old, adv, lo, hi)


def update(r: Rollout, targets: Advantages, policy: Optional[Learner], critic: Optional[Learner], opts, beta, gen,
           ptx: Optional[SFTBatches] = None):
    """--ppo_epochs over shuffled minibatches of the rollout; policy=None trains the critic only (warm-up).
    Returns named sums over this rank's tokens (and summed gradient norms) for the step's statistics: 0-dim
    float64 tensors on the device, which step_metrics reads with everything else in one go. The positions and the
    padding are found in the rollout's host copy of the mask, so a GPU update reads nothing back."""
    B, P, device = r.query_response.shape[0], r.query_len, r.query_response.device
    mb_size = B // opts.num_minibatches
    clip_high = opts.clip_high if opts.clip_high is not None else opts.clip_eps
    agg, objective = loss_aggregation(opts), policy_objective(opts)
    policy_mask = r.response_mask if r.policy_mask is None else r.policy_mask
    sums = defaultdict(float)
    for epoch in range(opts.ppo_epochs):
        order = torch.randperm(B, generator=gen, device="cpu")        # the host's; a copy indexes the device's
        on_device = order.to(device, non_blocking=True)
        for start in range(0, B, mb_size):
            idx = on_device[start:start + mb_size]
            # the minibatch's global normalisers, over all ranks (aggregate_loss), left on the device
            host_mask = r.host_attention_mask[order[start:start + mb_size], P:]
            n_tok, n_pol_tok, n_pol_seq = dist.all_reduce_sum(minibatch_counts(host_mask, policy_mask[idx]))
            if policy is not None and ptx is not None:
                ptx_backward(policy, ptx, opts)
            micro = list(range(0, len(idx), opts.micro_batch_size))
            for j, ms in enumerate(micro):
                i, on_host = idx[ms:ms + opts.micro_batch_size], order[start + ms:start + ms + opts.micro_batch_size]
                seq, host_attn = r.query_response[i], r.host_attention_mask[on_host]
                mb_mask, mb_policy_mask = r.response_mask[i], policy_mask[i]      # (b, R): critic's, policy's
                last = j == len(micro) - 1      # gradients all-reduced on the minibatch's last micro-batch only
                sums["tokens"] += float(host_attn[:, P:].sum())
                if policy is not None:
                    parallel.sync_gradients(policy.wrapped, last)
                    with autocast(seq.device, opts.dtype):
                        logp, ent = response_logprobs(policy.wrapped, seq, host_attn, host_attn[:, P:],
                                                      opts.temperature, with_entropy=True)
                    old = logp.detach() if r.logprobs is None else r.logprobs[i]
                    pg, ratio = objective(logp, old, targets.adv[i], mb_policy_mask)
                    if r.is_weight is not None:              # --rollout_correction tis
                        pg = pg * r.is_weight[i]
                    per_token = pg - opts.entropy_coef * ent
                    if opts.kl_in_loss and r.ref_logprobs is not None:
                        per_token = per_token + beta * kl_estimate(logp, r.ref_logprobs[i], opts.kl_loss_estimator)
                    aggregate_loss(per_token, mb_policy_mask, agg, n_pol_tok, n_pol_seq, opts.max_new_tokens,
                                   scale=dist.ddp_scale()).backward()
                    with torch.no_grad():         # each a float64 sum on the device (float32 terms, as .item()'s)
                        sums["policy_tokens"] += mb_policy_mask.sum().double()
                        sums["policy_loss"] += (pg * mb_policy_mask).sum().double()
                        sums["entropy"] += (ent * mb_policy_mask).sum().double()
                        # k3 of KL(old‖new)
                        sums["approx_kl"] += ((ratio - 1 - (logp - old)) * mb_policy_mask).sum().double()
                        # clip fraction = tokens whose ratio lies outside [1 − ε, 1 + ε_high] (as OpenAI
                        # baselines / TRL log it), not "the clipped term was the one selected by the max"
                        outside = (ratio < 1 - opts.clip_eps) | (ratio > 1 + clip_high)
                        sums["clipfrac"] += (outside.float() * mb_policy_mask).sum().double()
                        sums["ratio"] += (ratio * mb_policy_mask).sum().double()
                if critic is not None:
                    parallel.sync_gradients(critic.wrapped, last)
                    with autocast(seq.device, opts.dtype):
                        new_values = critic.wrapped(seq, r.attention_mask[i])[0][:, P - 1:-1].float()
                    v_loss, v_clipped = value_loss(new_values, r.values[i], targets.returns[i], opts.value_clip)
                    ((v_loss * mb_mask).sum() * token_mean_scale(n_tok)).backward()
                    sums["value_loss"] += (v_loss.detach() * mb_mask).sum().double()
                    sums["value_clipfrac"] += (v_clipped.float() * mb_mask).sum().double()
            sums["updates"] += 1
            if policy is not None:
                sums["grad_norm"] += policy.step(opts.grad_clip)
            if critic is not None:
                sums["critic_grad_norm"] += critic.step(opts.grad_clip)
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
    figures over the policy loss's own tokens, the critic's over every response token). k > 1 (a group
    estimator's samples per prompt) adds zero_spread, the share of groups whose k scores are all equal (they
    teach a group estimator nothing)."""
    seq = {"score": r.scores, "rm_score_raw": r.raw_scores, "kl": seq_kl,
           "non_score_reward": kl_penalty, "response_length": r.response_mask.sum(1), "eos_rate": r.has_eos}
    if k > 1:
        seq["zero_spread"] = (~group_spread(r.scores, k)).repeat_interleave(k).to(r.scores.dtype)
    if r.gold is not None:
        seq["gold_reward"] = r.gold
    names = ["sequences", *seq, *sums]
    local = [r.scores.shape[0], *(v.sum() for v in seq.values()), *sums.values()]
    total = dict(zip(names, dist.all_reduce_sum(dist.stacked(local)).tolist()))     # the one read
    metrics = {f"train/{k}": total[k] / total["sequences"] for k in seq}
    policy = ("policy_loss", "entropy", "approx_kl", "clipfrac", "ratio")     # update() counts policy_tokens beside
    per_token = (*policy, "value_loss", "value_clipfrac")
    metrics.update({f"train/{k}": total[k] / max(total["policy_tokens" if k in policy else "tokens"], 1)
                    for k in per_token if k in total})
    per_update = max(total["updates"], 1)          # every rank counts its updates, so this also divides by ranks
    metrics.update({f"train/{k}": total[k] / per_update for k in ("grad_norm", "critic_grad_norm") if k in total})
    metrics["train/kl_coef"] = beta
    if r.stats:       # rank means of the sampling's figures (dynamic sampling, sampler/trainer mismatch)
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
    if opts.reward not in ("model", "gold", "selfplay") and not reward_mod.is_function_spec(opts.reward):
        fail(f"--reward must be model, gold, selfplay, or module:function / path/to/file.py:function "
             f"(got {opts.reward!r})", 2)
    if opts.policy_loss == "gspo" and opts.advantage == "gae":
        fail("--policy_loss gspo weighs whole sequences: it needs a sequence-level advantage "
             "(--advantage rloo, grpo, dr_grpo or reinforce_pp), not gae's per-token one", 2)
    if opts.overlong != "none" and opts.missing_eos_penalty is not None:
        fail(f"--overlong {opts.overlong} decides what a truncated response costs; pass --missing_eos_penalty none "
             "with it (that penalty would replace the score of the same responses)", 2)
    if opts.overlong == "penalty" and opts.overlong_buffer > opts.max_new_tokens:
        fail(f"--overlong_buffer {opts.overlong_buffer} is longer than --max_new_tokens {opts.max_new_tokens}", 2)
    if opts.fsdp and opts.rollout_dtype != "float32":
        fail("--rollout_dtype bfloat16 with --fsdp is not supported: the rollout samples with the gathered weights "
             "(under --dtype bfloat16 on CUDA they are already bf16)", 2)
    if opts.reward == "selfplay":
        if opts.samples_per_prompt < 2:
            fail("--reward selfplay needs --samples_per_prompt >= 2 (a sample's reward is its win rate against the "
                 "others)", 2)
        if not (opts.judge or opts.pair_judge):
            fail("--reward selfplay needs a judge: --judge (reward-model dir, gold, module:function, llm:MODEL_DIR) "
                 "and/or --pair_judge module:function", 2)
    rollout_size = opts.batch_size * opts.samples_per_prompt
    if rollout_size % opts.num_minibatches:
        fail(f"the rollout of {rollout_size} sequences per device (--batch_size {opts.batch_size} x "
             f"--samples_per_prompt {opts.samples_per_prompt}) does not split into --num_minibatches "
             f"{opts.num_minibatches}", 2)
    mb_size = rollout_size // opts.num_minibatches
    if mb_size % opts.micro_batch_size:
        fail(f"a minibatch of {mb_size} sequences does not split into micro-batches of --micro_batch_size "
             f"{opts.micro_batch_size}", 2)
    msg = lora.check_lora_options(opts)
    if msg:
        fail(msg, 2)


def run_record(opts):
    """The inputs the run only reads (reward and judge code files too: an edited reward is another run) and its
    data files; its options are its identity (nano_rlhf/training.py). A default out/rm that the run never opens (no
    reward model, no critic from it) is no input: its files are not checksummed for --resume."""
    rm_used = opts.reward == "model" or (opts.advantage == "gae" and opts.critic_init == "reward_model")
    return dict(inputs={"init": opts.init, "ref": opts.ref, "reward_model": opts.reward_model if rm_used else "",
                        "reward": code_file(opts.reward),
                        "judge": model_dir(opts.judge) or code_file(opts.judge),
                        "pair_judge": code_file(opts.pair_judge),
                        **{"tools" + (f".{i}" if i else ""): f for i, f in enumerate(code_files(opts.tools))}},
                data_files={"prompts": opts.prompts or default_path("prompts"),
                            "eval_prompts": opts.eval_prompts, "ptx_data": opts.ptx_data})


def startup_line(opts, models: Models, n_prompts, prompt_stats, step):
    """The run's one-line summary printed at start-up (step: where a --resume goes on)."""
    B, k = opts.batch_size, opts.samples_per_prompt
    return (f"{opts.advantage.upper()} | reward {opts.reward} | {n_prompts:,} prompts ({prompt_stats}) | {B} prompts x "
            f"{k} samples x {dist.world().world_size} ranks per step | {opts.ppo_epochs} epochs x "
            f"{opts.num_minibatches} minibatches of {B * k // opts.num_minibatches} (micro {opts.micro_batch_size}) | "
            f"critic: {opts.critic_init if models.critic is not None else 'none'} | {opts.max_steps} steps"
            + lora.describe(models.policy) + (" | reference: the policy with its adapters off"
                                              if isinstance(models.ref, lora.BaseView) else "")
            + (f" | resuming at step {step}" if step else ""))


def load_models(opts, tok, prompt_texts, device, identity):
    """Policy, reference (only if β > 0), reward and the critic (only for gae); the reward on the device
    (training.place moves the others). With --lora_r the policy and the critic get adapters
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
    if opts.reward == "selfplay":
        reward = load_judge(opts.judge or None, opts.pair_judge or None, tokenizer=tok, device=device,
                            prompts=prompt_texts, batch_size=opts.micro_batch_size, template=opts.judge_template)
    else:
        reward = load_reward(spec, tokenizer=tok, device=device, prompts=prompt_texts, batch_size=opts.micro_batch_size)
    if isinstance(reward, RewardModel) and opts.normalize_score and not reward.has_stats:
        dist.print0(f"note: {spec}/config.json has no reward_mean/reward_std; scores are not normalised")
    critic = None
    if opts.advantage == "gae":
        src = opts.reward_model if opts.critic_init == "reward_model" else opts.init
        critic = ScoreModel.from_pretrained(src, new_head=opts.critic_init == "policy", dropout=0.0)
        check_vocab(tok, critic.cfg, src)                     # it reads the policy tokenizer's ids
        identity.update(lora.attach(critic, opts, src, trainable=("score",), prefix="critic_lora", seed=opts.seed + 1))
    for rm in (reward, getattr(reward, "pointwise", None)):
        if isinstance(rm, RewardModel):
            dist.check_same_weights(rm.model, "reward model")
    return Models(policy=policy, reward=reward, ref=ref, critic=critic, gold=builtin_gold(prompt_texts),
                  tools=load_tools(opts.tools) if opts.tools else None)


def ready_models(opts, models: Models):
    """The models ready for the loop, once training.place has put them on the device: the frozen ones (reference,
    reward model) placed by --fsdp / --frozen / --offload_frozen, the trained ones wrapped with their optimizers
    (the policy at --lr, the critic at --critic_lr), the memory plan printed. Returns the trained ones,
    {"policy", "critic": Learner}, the critic only where there is one."""
    models.ref = training.frozen(opts, models.ref)
    if isinstance(models.reward, RewardModel):
        models.reward.model = training.frozen(opts, models.reward.model)
    trained = {name: Learner.of(m, lr, opts) for name, m, lr in (
        ("policy", models.policy, opts.lr), ("critic", models.critic, opts.critic_lr)) if m is not None}
    training.plan(opts, {"policy": models.policy, "critic": models.critic, "ref": models.ref,
                        "reward": getattr(models.reward, "model", None)})
    return trained


def held_out_metrics(run, step, models: Models, tok, prompts, opts):
    """Held-out prompts, pure sampling at T = 1 with a fixed seed (comparable across steps), scored by the reward
    and the gold reward where there is one, with the KL to the reference; rank 0 only."""
    return eval_metrics(run, step, models.policy, tok, prompts, replace(sampling_options(opts, tok), temperature=1.0),
                        ref=models.ref, rewards=eval_columns(models.reward, models.gold),
                        gathered=(models.ref, getattr(models.reward, "model", None)), show=3, tools=models.tools,
                        max_turns=opts.max_turns)


SHOW = ["train/score", "train/gold_reward", "train/kl", "train/entropy", "train/clipfrac", "train/value_loss",
        "train/response_length", "eval/gold_reward", "eval/rm_score", "eval/reward", "eval/kl"]   # the progress line's
LOSS_KEYS = ["train/policy_loss", "train/value_loss"]      # a NaN/inf in either stops the run (checkpoint intact)


def main(argv=None):
    opts = parse_args(Options, argv, __doc__)      # each option's range and [with ...] refused here
    fill_defaults(opts)                            # the defaults that depend on other options
    check_options(opts)                            # --device and the rules between options; only refuses
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    run = training.open_run(opts, "ppo", **run_record(opts), show=SHOW, loss_keys=LOSS_KEYS)
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
    training.place(opts, world, {"policy": models.policy, "critic": models.critic}, {"ref": models.ref})
    gen = torch.Generator(device=world.device).manual_seed(opts.seed + 100003 * world.rank)  # ranks sample differently
    shuffle_gen = torch.Generator().manual_seed(opts.seed + 7 + 100003 * world.rank)
    trained = ready_models(opts, models)    # the frozen models placed, the trained ones wrapped
    policy, critic = trained["policy"], trained.get("critic")
    state = dict(models={k: v.model for k, v in trained.items()}, optimizers={k: v.opt for k, v in trained.items()},
                 generators={"rollout": gen, "shuffle": shuffle_gen})
    kl_ctl = AdaptiveKL(opts.kl_coef, opts.kl_target, opts.kl_horizon)
    watch = Watch(opts.score_warn)
    orders = {"data": prompt_batches, "watch": watch, **({"ptx_data": ptx} if ptx else {})}   # resumable positions
    meta = run.resume(**state, data=orders)
    if meta:
        kl_ctl.beta = meta["kl_coef"]
    dist.print0(startup_line(opts, models, len(prompts), prompt_stats, run.step))
    warn_short_warmup(opts.max_steps, opts.warmup_steps)

    def evaluate(step):
        return held_out_metrics(run, step, models, tok, eval_prompts, opts)

    def save(step):
        run.save(step, **state, data=orders, kl_coef=kl_ctl.beta)
        save_model_dir(opts.out_dir, models.policy, tok)

    if run.step == 0 and opts.eval_interval:       # the starting point of the eval curves
        run.log(0, evaluate(0))
    for step in range(run.step + 1, opts.max_steps + 1):
        t0 = time.time()
        set_lr(policy.opt, lr_at(step - 1, opts.max_steps, opts.lr, opts.warmup_steps, "constant"))
        gen_stats = {}
        batch = rollout(lambda: [prompts[i] for i in prompt_batches.next_step()[0]], models, tok, opts, gen, gen_stats,
                        version=step - 1)
        t_gen = time.time() - t0
        beta = kl_ctl.beta
        targets = advantages(batch, estimator=opts.advantage, beta=beta, kl_estimator=opts.kl_estimator,
                             kl_in_loss=opts.kl_in_loss, k=opts.samples_per_prompt, gamma=opts.gamma, lam=opts.lam)
        if opts.advantage in WHITENED:
            targets.adv = whiten_over_ranks(targets.adv, batch.actions)
        warming_up = critic is not None and step <= opts.critic_warmup_steps
        sums = update(batch, targets, policy=None if warming_up else policy, critic=critic, opts=opts, beta=beta,
                      gen=shuffle_gen, ptx=ptx)
        metrics = step_metrics(batch, sequence_kl(batch), targets.kl_penalty, sums, beta,
                               opts.samples_per_prompt if opts.advantage in GROUP else 1)
        if opts.adaptive_kl:
            kl_ctl.update(metrics["train/kl"], dist.all_reduce_sum(float(batch.scores.shape[0])))
        if critic is not None:
            metrics["train/explained_variance"] = explained_variance_over_ranks(targets.returns, batch.values,
                                                                                batch.response_mask)
        check_step(watch, step, (batch.response_mask.sum(1) - batch.has_eos).tolist(), batch.completions,
                   batch.raw_scores.tolist(), opts.samples_per_prompt, batch.policy_mask.sum().item())
        metrics.update({"train/step_time": time.time() - t0, "train/generate_time": t_gen})
        if opts.compile_rollout:               # compiling (first steps, each new batch bucket) timed apart
            metrics["train/generate_compile_time"] = gen_stats["compile_s"]
        if run.end_of_step(step, metrics, evaluate=lambda: evaluate(step), save=save):
            break
    run.finish(state["models"], {"ref": models.ref, "reward model": getattr(models.reward, "model", None)},
              saved=f"saved {opts.out_dir} (HF {models.policy.architecture} layout)")
    if models.tools is not None:
        models.tools.close()
    return SimpleNamespace(policy=models.policy, ref=models.ref, reward=models.reward, critic=models.critic,
                           optimizers=state["optimizers"], options=opts)


if __name__ == "__main__":
    main()
