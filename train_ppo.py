"""RLHF with PPO (four models) and its critic-free siblings, on one rollout -> score -> advantage -> update loop.

Models: policy π_θ (trained), critic V (trained; --advantage gae only), reference π_ref (frozen copy of the
SFT policy) and reward model R (frozen; or --reward gold, the built-in task's programmatic reward).
Frozen = requires_grad_(False), eval(), never wrapped in DDP, in no optimizer.

One step:
  1. rollout   k samples per prompt at temperature τ (pure sampling), cut after the first end-of-text
  2. score     s = clip((R(x, y) − μ_RM)/σ_RM, ±c); a response without end-of-text gets --missing_eos_penalty
  3. rewards   gae / reinforce_pp: r_t = −β·KL_t on every response token, + s on the end-of-text token
               rloo / grpo / dr_grpo: R_i = s_i − β·Σ_t k1_t (or KL in the loss: --kl_in_loss, k3)
               KL_t = k1 = log π_old − log π_ref (default) or k3 = e^−d − 1 + d; β fixed or adaptive
  4. advantage gae:          δ_t = r_t + γV_{t+1} − V_t,  A_t = δ_t + γλA_{t+1}    (Schulman et al. 2016, eq. 16)
                             whitened over the valid tokens of all ranks; returns G_t = A_t + V_t
               rloo:         A_i = R_i − mean_{j≠i} R_j                            (Ahmadian et al. 2024, eq. 6)
               grpo:         A_i = (R_i − mean_G) / (std_G + 1e-4)                 (Shao et al. 2024, eq. 3)
               dr_grpo:      A_i = R_i − mean_G, loss / (sequences × max_new_tokens)  (Liu et al. 2025)
               reinforce_pp: A_t = whiten(Σ_{s≥t} γ^{s−t} r_s) over the whole batch   (Hu 2025)
  5. update    --ppo_epochs over shuffled minibatches (micro-batches accumulate):
               ρ_t = π_θ/π_old,  L_π = max(−A_t ρ_t, −A_t clip(ρ_t, 1−ε, 1+ε_high))  (Schulman et al. 2017, eq. 7)
               L_V = ½ max((V − G)², (V_old + clip(V − V_old, ±ε_v) − G)²), − c_H·entropy, + γ_ptx·NLL(SFT)
               token-mean over all micro-batches and ranks of the minibatch (dr_grpo: constant normaliser)

Run:
    python train_ppo.py                                     # PPO: out/sft + out/rm -> out/ppo
    python train_ppo.py --advantage grpo --reward gold      # GRPO with the verifiable gold reward -> out/grpo
    python train_ppo.py --advantage rloo --samples_per_prompt 4
    torchrun --nproc_per_node 2 train_ppo.py --advantage grpo --reward gold

Choices and deviations (see ALGORITHMS.md): the score lands on the end-of-text token itself (TRL puts it one
slot later, on padding); rloo feeds its advantage to the token-level clipped loss (TRL clips one sequence
ratio); every forward uses position ids from the attention mask (left-padded prompts); log-probs always at
temperature τ; groups of k samples live on one rank, so group statistics need no communication.
"""
import contextlib
import math
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from nano_rlhf import dist, synthetic
from nano_rlhf.checkpoint import find_state, load_state, save_model_dir, save_state
from nano_rlhf.common import (Logger, adamw, autocast, builtin_file, check_finite, check_vocab, fail, input_errors,
                              load_tokenizer, lr_at, set_lr)
from nano_rlhf.config import parse_args, save_config
from nano_rlhf.data import Batches, collate_prompts, collate_sft, load_records, tokenize_prompts, tokenize_sft
from nano_rlhf.evaluate import sample_and_score, summarize
from nano_rlhf.model import GPT, ScoreModel

GROUP = ("rloo", "grpo", "dr_grpo")


def gold_reward(prompts, completions):
    """--reward gold: the built-in task's programmatic reward (a verifiable reward; swap in your own)."""
    return [synthetic.gold_reward(p, c) for p, c in zip(prompts, completions)]


@dataclass
class Options:
    advantage: Literal["gae", "rloo", "grpo", "dr_grpo", "reinforce_pp"] = "gae"  # advantage estimator
    reward: Literal["model", "gold"] = "model"  # score with the reward model, or the built-in task's gold reward
    init: str = "out/sft"         # policy to start from (also the reference unless --ref)
    ref: str = ""                 # reference policy directory; empty = --init
    reward_model: str = "out/rm"  # reward model directory (with --reward model)
    critic_init: Literal["auto", "reward_model", "policy"] = "auto"  # critic trunk+head from; auto = RM if used
    prompts: str = ""             # RL prompts JSONL {"prompt": ...}; empty = built-in task
    eval_prompts: str = ""        # held-out prompts for periodic evaluation; empty = built-in task's
    tokenizer: str = ""           # tokenizer.json; empty = the one in --init
    eos_token: str = ""           # end-of-text token name; empty = from tokenizer_config.json or the usual names
    pad_token: str = ""           # pad token name; empty = likewise (none: an id outside the vocabulary)
    out_dir: str = ""             # output directory; empty = out/ppo (gae) or out/<advantage>
    batch_size: int = 16          # prompts per device per step
    samples_per_prompt: Optional[int] = None  # k; none = 1 for gae/reinforce_pp, 4 for rloo/grpo/dr_grpo
    max_new_tokens: int = 40      # response length limit (also Dr. GRPO's constant normaliser)
    temperature: float = 1.0      # sampling temperature; log-probs use logits / temperature everywhere
    max_prompt_len: int = 0       # prompts are left-truncated to this; 0 = block_size − max_new_tokens
    kl_coef: float = 0.1          # β, the KL penalty coefficient (initial value when adaptive); 0 = no reference
    kl_estimator: Literal["k1", "k3"] = "k1"  # per-token KL estimate in the reward
    adaptive_kl: bool = False     # adapt β towards --kl_target (Ziegler et al. 2019)
    kl_target: float = 1.0        # target KL per sequence for the adaptive controller
    kl_horizon: int = 10000       # horizon (in samples) of the adaptive controller
    kl_in_loss: bool = False      # KL as β·k3 per token in the loss instead of in the reward (GRPO style)
    missing_eos_penalty: Optional[float] = -3.0  # score given (replacing R) to a response without end-of-text; none = off
    score_clip: float = 5.0       # clip the normalised reward-model score to ±this
    normalize_score: bool = True  # (R − μ)/σ with the statistics train_rm.py saved
    gamma: float = 1.0            # GAE / reward-to-go discount
    lam: float = 0.95             # GAE λ
    ppo_epochs: int = 4           # passes over each rollout
    num_minibatches: int = 2      # optimizer steps per epoch (the rollout is split into this many)
    micro_batch_size: int = 0     # sequences per forward/backward; 0 = the whole minibatch
    clip_eps: float = 0.2         # policy ratio clip ε
    clip_high: Optional[float] = None  # upper clip ε_high (DAPO clip-higher); none = --clip_eps
    value_clip: float = 0.2       # critic update clip ε_v
    entropy_coef: float = 0.0     # entropy bonus coefficient c_H
    ptx_data: str = ""            # SFT JSONL for the pre-training mix (InstructGPT PPO-ptx); empty = off
    ptx_coef: float = 0.0         # γ_ptx, weight of the PTX NLL
    ptx_batch_size: int = 8       # SFT sequences per device per minibatch for PTX
    lr: float = 2e-5              # policy learning rate
    critic_lr: float = 1e-4       # critic learning rate
    warmup_steps: int = 0         # linear warm-up steps (then constant)
    weight_decay: float = 0.0     # AdamW decoupled weight decay (matrices only)
    adam_eps: float = 1e-5        # AdamW epsilon (1e-5 as in the PPO implementation details)
    grad_clip: float = 1.0        # clip each model's global gradient norm (0 = off)
    max_steps: int = 100          # rollout + update iterations
    seed: int = 0                 # seed (ranks sample with seed + rank offset)
    device: str = "auto"          # cpu, cuda, or auto
    dtype: str = "float32"        # float32 or bfloat16 (autocast; log-softmax always float32)
    log_interval: int = 1         # print and log every N steps
    eval_interval: int = 20       # evaluate on held-out prompts every N steps (and at the end); 0 = end only
    eval_samples: int = 128       # held-out prompts sampled per evaluation
    save_interval: int = 50       # checkpoint every N steps (and at the end); 0 = only at the end
    resume: bool = False          # continue from out_dir/state
    stop_at: int = 0              # end this run after step N with a checkpoint (--resume later)


# ---- log-probs and KL ----------------------------------------------------------------------------

def response_logprobs(model, ids, attn, resp_mask, temperature, with_entropy=False):
    """log π(y_t | ...) at temperature τ for each response token, (B, R), 0 on padding; optionally the
    entropy of π(· | ...) at those positions too.

    ids = [left-padded prompt (P) | response (R)]; the logits at position P−1+t predict response token t.
    Only those positions' logits are computed (select=...), in float32 for the log-softmax.
    """
    B, T = ids.shape
    P = T - resp_mask.shape[1]
    sel = torch.zeros_like(ids, dtype=torch.bool)
    sel[:, P - 1:T - 1] = resp_mask.bool()                       # the predicting positions
    logits = model(ids, attn, select=sel).float() / temperature  # (N, V)
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, ids[:, P:][resp_mask.bool()][:, None]).squeeze(-1)
    out = torch.zeros(resp_mask.shape, device=ids.device).masked_scatter(resp_mask.bool(), logp)
    if not with_entropy:
        return out
    ent = -(logp_all.exp() * logp_all).sum(-1)                  # H = −Σ p log p
    return out, torch.zeros(resp_mask.shape, device=ids.device).masked_scatter(resp_mask.bool(), ent)


def kl_estimate(logp, ref_logp, kind="k1"):
    """Per-token KL(π‖π_ref) estimate on samples from π (Schulman 2020): k1 = d, k3 = e^−d − 1 + d, d = log π − log π_ref.
    k3 uses expm1 so it keeps its sign and precision for tiny d."""
    d = logp - ref_logp
    return d if kind == "k1" else torch.expm1(-d) + d


# ---- rewards and advantages --------------------------------------------------------------------

def token_rewards(score, kl, resp_mask, beta):
    """r_t = −β·KL_t on every response token; the score is added on the last real token (the end-of-text)."""
    r = -beta * kl * resp_mask
    last = resp_mask.sum(1).long() - 1                            # (B,) index of the end-of-text
    return r.scatter_add(1, last[:, None], score[:, None].to(r.dtype))


def gae(rewards, values, resp_mask, gamma=1.0, lam=0.95):
    """Generalised advantage estimation over a right-padded response (B, R): V and A are 0 past the end.
    Returns advantages and returns G = A + V."""
    B, R = rewards.shape
    values = values * resp_mask
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, device=rewards.device)
    for t in reversed(range(R)):
        next_v = values[:, t + 1] if t + 1 < R else torch.zeros(B, device=rewards.device)
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = (delta + gamma * lam * last) * resp_mask[:, t]
        adv[:, t] = last
    return adv, (adv + values) * resp_mask


def reward_to_go(rewards, resp_mask, gamma=1.0):
    """G_t = Σ_{s≥t} γ^{s−t} r_s (REINFORCE++), 0 past the end."""
    out = torch.zeros_like(rewards)
    run = torch.zeros(rewards.shape[0], device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        run = (rewards[:, t] + gamma * run) * resp_mask[:, t]
        out[:, t] = run
    return out


def masked_whiten(x, mask, eps=1e-8):
    """(x − mean)/sqrt(var + eps) over the valid tokens of all ranks (sums all-reduced), variance with
    Bessel's correction; 0 on padding."""
    # Two passes in float64: the one-pass E[x²] − mean² cancels catastrophically when |mean| ≫ std, as it is
    # for un-centred reward-to-go (REINFORCE++). One more scalar all-reduce is nothing next to a forward.
    xd, md = x.double(), mask.double()
    n, total = dist.all_reduce_sum(torch.stack([md.sum(), (xd * md).sum()]))
    mean = total / n.clamp(min=1)
    var = dist.all_reduce_sum(((xd - mean) ** 2 * md).sum()) / (n - 1).clamp(min=1)
    return ((xd - mean) * torch.rsqrt(var + eps) * md).to(x.dtype)


def rloo_advantages(R, k):
    """A_i = R_i − mean of the other k−1 rewards of its group; groups are k consecutive samples."""
    g = R.view(-1, k)
    return (g - (g.sum(1, keepdim=True) - g) / (k - 1)).view(-1)


def grpo_advantages(R, k, eps=1e-4):
    """A_i = (R_i − mean_G)/(std_G + eps), std with Bessel's correction; a group whose rewards are all
    equal gets exactly 0 (no float noise, no division)."""
    g = R.view(-1, k)
    centred = g - g.mean(1, keepdim=True)
    std = g.std(1, keepdim=True)
    same = (g.max(1, keepdim=True).values == g.min(1, keepdim=True).values)
    return torch.where(same, torch.zeros_like(g), centred / (std + eps)).view(-1)


def dr_grpo_advantages(R, k):
    """A_i = R_i − mean_G (no std: Dr. GRPO removes the difficulty bias)."""
    g = R.view(-1, k)
    return (g - g.mean(1, keepdim=True)).view(-1)


# ---- losses --------------------------------------------------------------------------------------

def policy_loss(logp, old_logp, adv, clip_low=0.2, clip_high=0.2):
    """Per-token clipped surrogate max(−Aρ, −A·clip(ρ, 1−ε_low, 1+ε_high)) and the ratio ρ."""
    ratio = torch.exp(logp - old_logp)
    return torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)), ratio


def value_loss(values, old_values, returns, clip=0.2):
    """Per-token clipped value loss ½·max((V − G)², (V_old + clip(V − V_old, ±ε_v) − G)²), and whether the
    clipped branch was the larger (for the value clip fraction)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    a, b = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.max(a, b), b > a


class AdaptiveKL:
    """β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon), n = samples in the update (Ziegler et al. 2019)."""

    def __init__(self, beta, target, horizon):
        self.beta, self.target, self.horizon = beta, target, horizon

    def update(self, kl, n):
        err = min(max(kl / self.target - 1, -0.2), 0.2)
        self.beta *= 1 + err * n / self.horizon


# ---- rollout ---------------------------------------------------------------------------------------

@torch.no_grad()
def rollout(o, policy, ref, reward, critic, prompts, tok, ctx, gen, rm_stats=(0.0, 1.0)):
    """Sample, truncate, score and compute everything the update needs. Tensors are (B, ...), B = prompts × k.

    reward: the reward model (a ScoreModel: its score at the end-of-text, normalised with rm_stats and clipped),
    or any Python function (prompt texts, completion texts) -> list of floats (a verifiable reward, e.g. the
    built-in task's gold reward), used as is.
    """
    k = o.samples_per_prompt
    q_ids, q_mask = collate_prompts([p["prompt"] for p in prompts for _ in range(k)], tok.pad_id)
    q_ids, q_mask = q_ids.to(ctx.device), q_mask.to(ctx.device)
    seq = dist.unwrap(policy).generate(q_ids, q_mask, o.max_new_tokens, o.temperature, None, None,
                                       tok.eos_id, tok.pad_id, gen)
    P = q_ids.shape[1]
    resp = seq[:, P:]
    is_eos = resp == tok.eos_id
    has_eos = is_eos.any(1)
    # response = tokens up to and including the first end-of-text (generate already pads after it)
    length = torch.where(has_eos, is_eos.float().argmax(1) + 1, torch.full_like(has_eos, resp.shape[1], dtype=torch.long))
    resp_mask = (torch.arange(resp.shape[1], device=seq.device)[None] < length[:, None]).float()
    attn = torch.cat([q_mask, resp_mask.long()], 1)
    B = seq.shape[0]
    old_logp, ref_logp, values = (torch.zeros_like(resp_mask) for _ in range(3))
    # One update on the rollout it was sampled from, and no KL: π_old is the current policy, so its log-probs
    # come from the update's own forward (detached) and this extra forward is skipped (as TRL's GRPO does).
    skip_old = ref is None and o.ppo_epochs == 1 and o.num_minibatches == 1
    mb = o.micro_batch_size
    policy.eval()
    for i in range(0, B, mb):
        s = slice(i, i + mb)
        with autocast(ctx.device, o.dtype):
            if not skip_old:
                old_logp[s] = response_logprobs(policy, seq[s], attn[s], resp_mask[s], o.temperature)
            if ref is not None:
                ref_logp[s] = response_logprobs(ref, seq[s], attn[s], resp_mask[s], o.temperature)
            if critic is not None:
                values[s] = critic(seq[s], attn[s])[0][:, P - 1:-1].float() * resp_mask[s]
    policy.train()
    texts = [tok.decode(row[:n]) for row, n in zip(resp.tolist(), length.tolist())]
    prompt_texts = [p["text"] for p in prompts for _ in range(k)]
    gold = None
    if all(isinstance(t, str) and synthetic.is_task_prompt(t) for t in prompt_texts):
        gold = torch.tensor([synthetic.gold_reward(p, t) for p, t in zip(prompt_texts, texts)], device=seq.device)
    if not isinstance(reward, torch.nn.Module):
        raw = torch.tensor(reward(prompt_texts, texts), dtype=torch.float32, device=seq.device)
        score = raw
    else:
        raw = torch.cat([reward(seq[i:i + mb], attn[i:i + mb], end_only=True)[1].float() for i in range(0, B, mb)])
        score = (raw - rm_stats[0]) / rm_stats[1] if o.normalize_score else raw
        score = score.clamp(-o.score_clip, o.score_clip)
    if o.missing_eos_penalty is not None:
        score = torch.where(has_eos, score, torch.full_like(score, o.missing_eos_penalty))   # replace, not add
    if ref is None:          # no KL term at all (β = 0): the reference is not even built
        ref_logp = None
    return dict(seq=seq, attn=attn, resp_mask=resp_mask, old_logp=None if skip_old else old_logp,
                ref_logp=ref_logp, values=values,
                score=score, raw_score=raw, gold=gold, has_eos=has_eos.float(), length=length.float(),
                texts=texts, prompt_texts=prompt_texts, P=P)


def advantages(o, r, beta):
    """Token-level advantages (B, R) (and returns for the critic) from a rollout, per --advantage."""
    m = r["resp_mask"]
    if r["ref_logp"] is None:                 # β = 0: no reference, no KL
        kl = r["kl_seq_k1"] = torch.zeros_like(m)
    else:
        kl = kl_estimate(r["old_logp"], r["ref_logp"], o.kl_estimator) * m
        r["kl_seq_k1"] = kl_estimate(r["old_logp"], r["ref_logp"], "k1") * m
    r["kl_seq"] = r["kl_seq_k1"].sum(1)       # Σ_t k1: the sequence KL (logged, and folded into R_i below)
    if o.advantage in ("gae", "reinforce_pp"):
        rewards = token_rewards(r["score"], kl if not o.kl_in_loss else torch.zeros_like(kl), m, beta)
        r["non_score_reward"] = (rewards.sum(1) - r["score"])
        if o.advantage == "gae":
            adv, ret = gae(rewards, r["values"], m, o.gamma, o.lam)
            return masked_whiten(adv, m), ret
        return masked_whiten(reward_to_go(rewards, m, o.gamma), m), None
    R = r["score"] - (0.0 if o.kl_in_loss else beta * r["kl_seq"])
    r["non_score_reward"] = R - r["score"]
    a = {"rloo": rloo_advantages, "grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages}[o.advantage](R, o.samples_per_prompt)
    return a[:, None] * m, None


# ---- update ----------------------------------------------------------------------------------------

def update(o, r, adv, ret, policy_ddp, critic_ddp, opt_pi, opt_v, params_pi, params_v, ptx, tok, ctx, beta, gen,
           step=0):
    """--ppo_epochs over shuffled minibatches; returns summed statistics (see the end)."""
    B = r["seq"].shape[0]
    mb_size = B // o.num_minibatches
    clip_high = o.clip_high if o.clip_high is not None else o.clip_eps
    clipped = lambda ratio: (ratio < 1 - o.clip_eps) | (ratio > 1 + clip_high)  # noqa: E731  (clip fraction)
    st = torch.zeros(9, dtype=torch.float64)  # tokens, pg_loss, v_loss, entropy, approx_kl, clipfrac, vclipfrac, ratio, grad
    for epoch in range(o.ppo_epochs):
        order = torch.randperm(B, generator=gen, device="cpu").to(r["seq"].device)
        for start in range(0, B, mb_size):
            idx = order[start:start + mb_size]
            m_all = r["resp_mask"][idx]
            # global normaliser of this minibatch: its loss tokens on all ranks (dr_grpo: a constant)
            n_tok = dist.all_reduce_sum(m_all.sum().item())
            norm = (dist.all_reduce_sum(float(len(idx))) * o.max_new_tokens) if o.advantage == "dr_grpo" else n_tok
            if ptx is not None:
                pids, pattn, plm = (t.to(ctx.device) for t in collate_sft([ptx[1][i] for i in ptx[0].next_step()[0]], tok.pad_id))
                n_ptx = dist.all_reduce_sum(float(plm[:, 1:].sum()))
                with (policy_ddp.no_sync() if ctx.enabled else contextlib.nullcontext()):
                    with autocast(ctx.device, o.dtype):
                        sel = F.pad(plm[:, 1:].bool(), (0, 1))
                        nll = F.cross_entropy(policy_ddp(pids, pattn, select=sel).float(), pids[:, 1:][plm[:, 1:].bool()],
                                              reduction="sum")
                    (o.ptx_coef * nll * ctx.world_size / max(n_ptx, 1)).backward()
            micro = list(range(0, len(idx), o.micro_batch_size))
            for j, ms in enumerate(micro):
                i = idx[ms:ms + o.micro_batch_size]
                seq, attn, m = r["seq"][i], r["attn"][i], r["resp_mask"][i]
                last = j == len(micro) - 1
                with (policy_ddp.no_sync() if ctx.enabled and not last else contextlib.nullcontext()):
                    with autocast(ctx.device, o.dtype):
                        logp, ent = response_logprobs(policy_ddp, seq, attn, m, o.temperature, with_entropy=True)
                    old = logp.detach() if r["old_logp"] is None else r["old_logp"][i]
                    pg, ratio = policy_loss(logp, old, adv[i], o.clip_eps, clip_high)
                    per_tok = pg - o.entropy_coef * ent
                    if o.kl_in_loss and r["ref_logp"] is not None:
                        per_tok = per_tok + beta * kl_estimate(logp, r["ref_logp"][i], "k3")
                    ((per_tok * m).sum() * ctx.world_size / max(norm, 1)).backward()
                with torch.no_grad():
                    logratio = logp - old
                    st += torch.tensor([m.sum().item(), (pg * m).sum().item(), 0.0, (ent * m).sum().item(),
                                        ((ratio - 1 - logratio) * m).sum().item(),    # k3 estimate of KL(old‖new)
                                        (clipped(ratio).float() * m).sum().item(),
                                        0.0, (ratio * m).sum().item(), 0.0], dtype=torch.float64)
                if critic_ddp is not None:
                    with (critic_ddp.no_sync() if ctx.enabled and not last else contextlib.nullcontext()):
                        with autocast(ctx.device, o.dtype):
                            v = critic_ddp(seq, attn)[0][:, r["P"] - 1:-1].float()
                        vl, vclipped = value_loss(v, r["values"][i], ret[i], o.value_clip)
                        ((vl * m).sum() * ctx.world_size / max(n_tok, 1)).backward()
                    st[2] += (vl * m).sum().item()
                    st[6] += (vclipped.float() * m).sum().item()
            gn = torch.nn.utils.clip_grad_norm_(params_pi, o.grad_clip or float("inf")).item()
            check_finite(gn, step, o.out_dir, "policy gradient norm")
            st[8] += gn
            opt_pi.step()
            opt_pi.zero_grad(set_to_none=True)
            if critic_ddp is not None:
                check_finite(torch.nn.utils.clip_grad_norm_(params_v, o.grad_clip or float("inf")).item(), step,
                             o.out_dir, "critic gradient norm")
                opt_v.step()
                opt_v.zero_grad(set_to_none=True)
    return st


def explained_variance(values, returns, mask):
    """1 − Var(G − V)/Var(G) over valid tokens of all ranks: 1 = perfect critic, ≤ 0 = no better than a constant."""
    s = dist.all_reduce_sum(torch.stack([mask.sum(), (returns * mask).sum(), (returns ** 2 * mask).sum(),
                                         ((returns - values) * mask).sum(), ((returns - values) ** 2 * mask).sum()]).double())
    n = s[0].clamp(min=1)
    var_g = s[2] / n - (s[1] / n) ** 2
    var_d = s[4] / n - (s[3] / n) ** 2
    return (1 - var_d / var_g).item() if var_g > 0 else float("nan")


def main(argv=None):
    o = parse_args(Options, argv, __doc__)
    if o.samples_per_prompt is None:
        o.samples_per_prompt = 4 if o.advantage in GROUP else 1
    o.out_dir = o.out_dir or ("out/ppo" if o.advantage == "gae" else f"out/{o.advantage}")
    if o.critic_init == "auto":
        o.critic_init = "reward_model" if o.reward == "model" else "policy"
    ctx = dist.setup(o.device)
    rollout_size = o.batch_size * o.samples_per_prompt
    if o.advantage in GROUP and o.samples_per_prompt < 2:
        fail(f"--advantage {o.advantage} needs --samples_per_prompt >= 2 (it compares samples of one prompt)")
    for name, value in (("batch_size", o.batch_size), ("samples_per_prompt", o.samples_per_prompt),
                        ("num_minibatches", o.num_minibatches), ("ppo_epochs", o.ppo_epochs),
                        ("max_new_tokens", o.max_new_tokens)):
        if value < 1:
            fail(f"--{name} must be at least 1 (got {value})")
    if o.micro_batch_size < 0:
        fail(f"--micro_batch_size must be at least 1, or 0 for the whole minibatch (got {o.micro_batch_size})")
    if not o.temperature > 0:
        fail(f"--temperature must be > 0 (got {o.temperature}): log-probs are computed from logits / temperature")
    if o.adaptive_kl and not (o.kl_coef > 0 and o.kl_target > 0 and o.kl_horizon > 0):
        fail("--adaptive_kl needs --kl_coef, --kl_target and --kl_horizon > 0 (β is adapted multiplicatively)")
    if bool(o.ptx_data) != (o.ptx_coef > 0):
        fail("the PTX term needs both --ptx_data FILE and --ptx_coef > 0")
    if o.advantage in GROUP and o.kl_estimator != "k1" and not o.kl_in_loss:
        fail(f"--advantage {o.advantage} folds the sequence KL Σk1 into its reward; --kl_estimator k3 applies only "
             "with --kl_in_loss (which always uses k3) or with gae / reinforce_pp")
    if rollout_size % o.num_minibatches:
        fail(f"the rollout of {rollout_size} sequences per device (--batch_size {o.batch_size} x --samples_per_prompt "
             f"{o.samples_per_prompt}) does not split into --num_minibatches {o.num_minibatches}")
    mb_size = rollout_size // o.num_minibatches
    o.micro_batch_size = o.micro_batch_size or mb_size
    if mb_size % o.micro_batch_size:
        fail(f"a minibatch of {mb_size} sequences does not split into micro-batches of --micro_batch_size {o.micro_batch_size}")
    if o.resume and find_state(o.out_dir) is None:
        fail(f"{o.out_dir}: --resume given but there is no saved state in it")

    with input_errors():
        prompt_records = load_records(o.prompts or builtin_file("prompts.jsonl"), "prompts")
        eval_records = load_records(o.eval_prompts or builtin_file("eval_prompts.jsonl"), "prompts")
        ptx_records = load_records(o.ptx_data, "sft") if o.ptx_data and o.ptx_coef else None
        if o.reward == "gold" and not all(isinstance(p["prompt"], str) and synthetic.is_task_prompt(p["prompt"])
                                          for p in prompt_records):
            raise ValueError("--reward gold scores the built-in task only; these prompts are not the task's")
        tok = load_tokenizer(o.tokenizer, o.init, o.eos_token, o.pad_token)
        policy = GPT.from_pretrained(o.init, dropout=0.0)        # dropout off: rollout log-probs must be reproducible
        check_vocab(tok, policy.cfg, o.init)
        ref = None
        if o.kl_coef > 0 or o.adaptive_kl:   # with β = 0 no KL is ever computed: no reference model
            ref = GPT.from_pretrained(o.ref or o.init, dropout=0.0).requires_grad_(False).eval()
        reward_model = critic = None
        rm_stats = (0.0, 1.0)
        if o.reward == "model":
            reward_model = ScoreModel.from_pretrained(o.reward_model, dropout=0.0).requires_grad_(False).eval()
            check_vocab(tok, reward_model.cfg, o.reward_model)     # it scores the policy's token ids
            stats = reward_model.extra_config
            if o.normalize_score and "reward_mean" not in stats:
                dist.print0(f"note: {o.reward_model}/config.json has no reward_mean/reward_std; scores are not normalised")
            rm_stats = (stats.get("reward_mean", 0.0), stats.get("reward_std", 1.0) or 1.0)
        if o.advantage == "gae":
            src = o.reward_model if o.critic_init == "reward_model" else o.init
            critic = ScoreModel.from_pretrained(src, new_head=o.critic_init == "policy", dropout=0.0)
        max_prompt = o.max_prompt_len or policy.cfg.block_size - o.max_new_tokens
        if max_prompt < 1 or max_prompt + o.max_new_tokens > policy.cfg.block_size:
            raise ValueError(f"--max_prompt_len {max_prompt} + --max_new_tokens {o.max_new_tokens} must fit in "
                             f"block_size {policy.cfg.block_size}")
        prompts, pst = tokenize_prompts(prompt_records, tok, max_prompt)
        eval_prompts = eval_records[:o.eval_samples]
        prompt_batches = Batches(len(prompts), o.batch_size, 1, ctx.rank, ctx.world_size, o.seed)
        ptx = None
        if ptx_records is not None:
            ptx_examples, _ = tokenize_sft(ptx_records, tok, policy.cfg.block_size)
            ptx = (Batches(len(ptx_examples), o.ptx_batch_size, 1, ctx.rank, ctx.world_size, o.seed), ptx_examples)
    for m in (policy, ref, reward_model, critic):
        if m is not None:
            m.to(ctx.device)
    for name, m in (("policy", policy), ("reference", ref), ("reward model", reward_model), ("critic", critic)):
        if m is not None:
            dist.check_same_weights(m, name)
    dist.seed_everything(o.seed, ctx.rank)
    gen = torch.Generator(device=ctx.device).manual_seed(o.seed + 100003 * ctx.rank)   # ranks sample differently
    shuffle_gen = torch.Generator().manual_seed(o.seed + 7 + 100003 * ctx.rank)
    policy_ddp = dist.wrap_ddp(policy)
    critic_ddp = dist.wrap_ddp(critic) if critic is not None else None
    opt_pi = adamw(policy, o.lr, o.weight_decay, eps=o.adam_eps)
    opt_v = adamw(critic, o.critic_lr, o.weight_decay, eps=o.adam_eps) if critic is not None else None
    params_pi = [p for p in policy.parameters() if p.requires_grad]
    params_v = [p for p in critic.parameters() if p.requires_grad] if critic is not None else []
    kl_ctl = AdaptiveKL(o.kl_coef, o.kl_target, o.kl_horizon)
    models = {"policy": policy, **({"critic": critic} if critic is not None else {})}
    optims = {"policy": opt_pi, **({"critic": opt_v} if critic is not None else {})}
    gens = {"rollout": gen, "shuffle": shuffle_gen}
    step = 0
    if o.resume:
        meta = load_state(o.out_dir, models, optims, gens)
        step, kl_ctl.beta = meta["step"], meta["kl_coef"]
        prompt_batches.load_state_dict(meta["data"])
        if ptx is not None and "ptx_data" in meta:
            ptx[0].load_state_dict(meta["ptx_data"])
    if ctx.is_main:
        os.makedirs(o.out_dir, exist_ok=True)
        save_config(o, os.path.join(o.out_dir, "train_config.json"), world_size=ctx.world_size,
                    rm_stats=list(rm_stats))
    dist.print0(f"{o.advantage.upper()} | reward {o.reward} | {len(prompts):,} prompts ({pst}) | {o.batch_size} prompts "
                f"x {o.samples_per_prompt} samples x {ctx.world_size} ranks per step | {o.ppo_epochs} epochs x "
                f"{o.num_minibatches} minibatches of {mb_size} (micro {o.micro_batch_size}) | critic: "
                f"{o.critic_init if critic is not None else 'none'} | {o.max_steps} steps"
                + (f" | resuming at step {step}" if step else ""))
    log = Logger(o.out_dir, o.max_steps, resume=o.resume, start_step=step)
    shown = ["train/score", "train/gold_reward", "train/kl", "train/entropy", "train/clipfrac", "train/response_length",
             "eval/gold_reward", "eval/rm_score", "eval/kl"]

    def evaluate():
        """Held-out prompts, pure sampling at T = 1 with a fixed seed (comparable across steps); rank 0 only."""
        out = {}
        if ctx.is_main:
            samples = sample_and_score(dist.unwrap(policy), tok, eval_prompts, o.max_new_tokens, 1.0, 1, seed=1234,
                                       ref=ref, reward_model=reward_model)
            out = {f"eval/{k}": v for k, v in summarize(samples).items() if not k.endswith("_se") and k != "n"}
            for smp in samples[:3]:
                dist.print0(f"  sample | {smp['prompt']!r} -> {smp['completion']!r}"
                            + (f" | gold {smp['gold_reward']:+.2f}" if "gold_reward" in smp else ""))
        dist.barrier()
        return out

    if step == 0 and o.eval_interval:       # the starting point of the eval curves
        log.log(0, evaluate())
    while step < o.max_steps:
        t0 = time.time()
        set_lr(opt_pi, lr_at(step, o.max_steps, o.lr, o.warmup_steps, "constant"))
        batch = [prompts[i] for i in prompt_batches.next_step()[0]]
        r = rollout(o, policy, ref, reward_model if o.reward == "model" else gold_reward, critic, batch, tok, ctx, gen,
                    rm_stats)
        t_gen = time.time() - t0
        beta = kl_ctl.beta
        adv, ret = advantages(o, r, beta)
        st = update(o, r, adv, ret, policy_ddp, critic_ddp, opt_pi, opt_v, params_pi, params_v, ptx, tok, ctx, beta,
                    shuffle_gen, step + 1)
        n_seq = dist.all_reduce_sum(float(r["seq"].shape[0]))
        seq_sums = dist.all_reduce_sum(torch.tensor([r["score"].sum(), r["raw_score"].sum(), r["kl_seq"].sum(),
                                                     r["non_score_reward"].sum(), r["length"].sum(), r["has_eos"].sum(),
                                                     r["gold"].sum() if r["gold"] is not None else 0.0],
                                                    dtype=torch.float64))
        st = dist.all_reduce_sum(st)
        n_tok = st[0].item()
        updates = o.ppo_epochs * o.num_minibatches
        kl_mean = seq_sums[2].item() / n_seq
        if o.adaptive_kl:
            kl_ctl.update(kl_mean, n_seq)
        step += 1
        m = {"train/score": seq_sums[0].item() / n_seq, "train/rm_score_raw": seq_sums[1].item() / n_seq,
             "train/kl": kl_mean, "train/non_score_reward": seq_sums[3].item() / n_seq,
             "train/response_length": seq_sums[4].item() / n_seq, "train/eos_rate": seq_sums[5].item() / n_seq,
             "train/policy_loss": st[1].item() / n_tok, "train/entropy": st[3].item() / n_tok,
             "train/approx_kl": st[4].item() / n_tok, "train/clipfrac": st[5].item() / n_tok,
             "train/ratio": st[7].item() / n_tok, "train/grad_norm": st[8].item() / ctx.world_size / updates,
             "train/kl_coef": beta, "train/step_time": time.time() - t0, "train/generate_time": t_gen}
        if r["gold"] is not None:
            m["train/gold_reward"] = seq_sums[6].item() / n_seq
        if critic is not None:
            m.update({"train/value_loss": st[2].item() / n_tok, "train/value_clipfrac": st[6].item() / n_tok,
                      "train/explained_variance": explained_variance(r["values"], ret, r["resp_mask"])})
        check_finite(m["train/policy_loss"], step, o.out_dir, "policy loss")
        if (o.eval_interval and step % o.eval_interval == 0) or step == o.max_steps:
            m.update(evaluate())
        if step % o.log_interval == 0 or step == o.max_steps:
            log.log(step, m)
            log.progress(step, m, shown, None)
        if (o.save_interval and step % o.save_interval == 0) or step in (o.max_steps, o.stop_at):
            meta = {"step": step, "kl_coef": kl_ctl.beta, "data": prompt_batches.state_dict()}
            if ptx is not None:
                meta["ptx_data"] = ptx[0].state_dict()
            save_state(o.out_dir, models, optims, meta, gens)
            save_model_dir(o.out_dir, policy, tok)
        if step == o.stop_at:
            dist.print0(f"stopping at step {step} (--stop_at); continue with --resume")
            break
    for name, mdl in models.items():
        dist.check_same_weights(mdl, name)
    dist.print0(f"saved {o.out_dir} (HF GPT2LMHeadModel layout)")
    dist.cleanup()
    return SimpleNamespace(policy=policy, ref=ref, reward_model=reward_model, critic=critic, optimizers=optims, options=o)


if __name__ == "__main__":
    main()
