"""Rollouts for the scripts that train on their own samples. For train_ppo.py: the models a rollout is sampled,
scored and valued with (loaded from the script's options, the inputs they read recorded, made ready for the loop,
described in the start-up line); k completions per prompt from the rollout engine, each cut after its first stop
token; the reward read (a reward model on the very ids sampled, a function on the decoded texts, or a judge's
preferences within each prompt's group) and a cost beside it; DAPO's sampling rounds; the Rollout container the
update reads and the models' forwards over it; the window of episode costs a Lagrange multiplier steps on; the
held-out evaluation. For train_online.py (at the end): its models, k samples a prompt from the policy or from a
geometric mixture of models, preference pairs from a file in the same layout, a pointwise judge's scores of the
samples, and the step's figures. Knows no loss, advantage or KL: what a reward becomes
(normalised, clipped, penalised, a win rate), the log-prob gather and λ's step are the script's.

B = prompts × k sequences, P = the longest prompt (left-padded), R = the longest response (right-padded).
"""
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Optional

import torch
import torch.nn.functional as F

from . import dist, lora, parallel
from . import run as run_mod
from .data import collate_prompts, default_path, pad_left, pad_right
from .evaluate import eval_metrics
from .model import GPT, ScoreModel
from .reward import (Judge, RewardModel, builtin_gold, code_file, eval_columns, load_function, load_judge,
                     load_reward, model_dir, preference_matrix)
from .run import Learner, autocast, check_vocab
from .sampling import SamplingOptions, cut_at_stop, generate_mixture, sample_responses, sample_uniforms
from .tools import ToolBox, ToolEnv, code_files, load_tools


@dataclass
class Rollout:
    """One step's samples and everything the update needs. Nothing here changes after the rollout."""
    query_response: torch.Tensor          # (B, P+R) ids: left-padded prompt | response, padded after its stop token
    attention_mask: torch.Tensor          # (B, P+R) 1 on real tokens
    response_mask: torch.Tensor           # (B, R) float, 1 up to and including the first stop token
    has_eos: torch.Tensor                 # (B,) float, 1 if the response ended with a stop token (tok.stop_ids)
    completions: list                     # B decoded response texts
    # the per-sequence signals, (B,) each
    scores: Optional[torch.Tensor] = None      # the reward the policy is trained on (the script's rule)
    raw_scores: Optional[torch.Tensor] = None  # the reward as the reward function returned it
    gold: Optional[torch.Tensor] = None        # a programmatic reward, logged only (built-in task prompts)
    costs: Optional[torch.Tensor] = None       # the cost (Safe RLHF) as the cost model or function returned it
    # what the update reads, (B, R) each
    action_mask: Optional[torch.Tensor] = None  # the tokens the policy sampled: response_mask with holes at tool
    #                                             turns (their KL and loss are not the policy's); None = response_mask
    policy_mask: Optional[torch.Tensor] = None  # the tokens the policy loss sees (action_mask, or with more holes)
    logprobs: Optional[torch.Tensor] = None     # log π_old(y_t); None = the update's own first forward is π_old
    ref_logprobs: Optional[torch.Tensor] = None  # log π_ref(y_t); None when there is no KL
    values: Optional[torch.Tensor] = None       # V_old(x, y_≤t); None without a critic
    cost_values: Optional[torch.Tensor] = None  # V_c,old(x, y_≤t); None without a cost critic
    is_weight: Optional[torch.Tensor] = None    # a per-token importance weight on the policy loss, detached
    stats: dict = field(default_factory=dict)   # per-step figures of the sampling (rounds, mismatch)

    @property
    def query_len(self):
        return self.query_response.shape[1] - self.response_mask.shape[1]

    @property
    def actions(self):
        """(B, R) the tokens the policy sampled (response_mask without tools)."""
        return self.response_mask if self.action_mask is None else self.action_mask


@dataclass
class RolloutOptions:
    """The options of the models a rollout is sampled from and scored with, its prompts and its sampling (read by
    load_rollout_models, run_record, sampling_options and sample_groups, beside the script's own options such as
    the KL coefficient, the score's normalisation and the cost limits), declared once for the script's Options to
    take: `class Options(RolloutOptions, ...)` (train_ppo.py; nano_rlhf/cli.py lists them in --help with the
    script's own options)."""
    # ---- what is trained, from what, rewarded by what
    advantage: str = "gae"        # the advantage estimator; a critic is loaded for gae only (the script's Options
                                  # declares this option again, with its estimators)
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


@dataclass
class Models:
    """Frozen = requires_grad_(False), eval(), never wrapped in DDP, in no optimizer."""
    policy: GPT                           # π_θ (trained)
    reward: Callable                      # scores = reward(prompts, completions) (nano_rlhf.reward; frozen);
    #                                     SPO: a Judge
    ref: Optional[GPT] = None             # π_ref (frozen; --lora_r: a lora.BaseView of the policy); None when β = 0
    critic: Optional[ScoreModel] = None   # V (trained; --advantage gae only)
    cost: Optional[Callable] = None       # costs = cost(prompts, completions): a cost model or function (frozen)
    cost_critic: Optional[ScoreModel] = None  # V_c (trained; --advantage gae with a cost)
    gold: Optional[Callable] = None       # a programmatic reward logged beside the trained one, when one applies
    tools: Optional[ToolBox] = None       # the tools the policy may call in its rollouts (--tools)


def load_rollout_models(opts, tok, prompt_texts, device, identity):
    """Policy, reference (only if β > 0), reward, the cost (if any) and the critics (only for gae); the reward and
    the cost on the device (run_mod.place moves the others). With --lora_r the policy and critics get adapters
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
    cost = None
    if opts.cost_model:
        cost = RewardModel.from_dir(opts.cost_model, tok, device, opts.micro_batch_size, kind="cost")
    elif opts.cost:
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
    if opts.advantage == "gae" and cost is not None:
        cost_critic = critic_from(opts.cost_model if opts.cost_critic_init == "cost_model" else opts.init,
                                  opts.cost_critic_init == "policy", "cost_critic_lora", opts.seed + 2)
    for rm, what in ((reward, "reward model"), (getattr(reward, "pointwise", None), "reward model"),
                     (cost, "cost model")):
        if isinstance(rm, RewardModel):
            dist.check_same_weights(rm.model, what)
    return Models(policy=policy, reward=reward, ref=ref, critic=critic, gold=builtin_gold(prompt_texts),
                  cost=cost, cost_critic=cost_critic, tools=load_tools(opts.tools) if opts.tools else None)


def run_record(opts, _):
    """The inputs the run only reads (reward and judge code files too: an edited reward is another run) and its
    data files; its options are its identity (nano_rlhf/run.py). A default out/rm that the run never opens (no
    reward model, no critic from it) is no input: its files are not checksummed for --resume."""
    rm_used = opts.reward == "model" or (opts.advantage == "gae" and opts.critic_init == "reward_model")
    return dict(inputs={"init": opts.init, "ref": opts.ref, "reward_model": opts.reward_model if rm_used else "",
                        "reward": code_file(opts.reward),
                        "judge": model_dir(opts.judge) or code_file(opts.judge),
                        "pair_judge": code_file(opts.pair_judge), "cost_model": opts.cost_model,
                        "cost": code_file(opts.cost),
                        **{"tools" + (f".{i}" if i else ""): f for i, f in enumerate(code_files(opts.tools))}},
                data_files={"prompts": opts.prompts or default_path("prompts"),
                            "eval_prompts": opts.eval_prompts, "ptx_data": opts.ptx_data})


def ready_models(opts, models: Models):
    """The models ready for the loop, once run.place has put them on the device: the frozen ones (reference,
    reward and cost models) placed by --fsdp / --frozen / --offload_frozen, the trained ones wrapped with their
    optimizers (the policy at --lr, the critics at --critic_lr), the memory plan printed. Returns the trained
    ones, {"policy", "critic", "cost_critic": Learner}, the critics only where there are some."""
    models.ref = run_mod.frozen(opts, models.ref)
    for scorer in (models.reward, models.cost):
        if isinstance(scorer, RewardModel):
            scorer.model = run_mod.frozen(opts, scorer.model)
    trained = {name: Learner.of(m, lr, opts) for name, m, lr in (
        ("policy", models.policy, opts.lr), ("critic", models.critic, opts.critic_lr),
        ("cost_critic", models.cost_critic, opts.critic_lr)) if m is not None}
    run_mod.plan(opts, {"policy": models.policy, "critic": models.critic, "cost_critic": models.cost_critic,
                        "ref": models.ref, "reward": getattr(models.reward, "model", None),
                        "cost": getattr(models.cost, "model", None)})
    return trained


@torch.no_grad()
def sample_groups(prompts, policy, tok, sampling, k, gen, gen_stats=None, tools=None, max_turns=1) -> Rollout:
    """k completions per prompt, cut after the first stop token (end-of-text or the chat template's end-of-turn:
    tok.stop_ids), decoded: a Rollout without signals yet. prompts: tokenized prompt records ({"prompt": ids}).
    tools (a nano_rlhf.tools.ToolBox): an assistant turn that calls tools gets their results as a tool turn and
    samples on, up to max_turns turns (sampling.generate_turns); the tool turns are context, not actions (holes
    in action_mask), and the completion's text holds them as the chat template renders them."""
    device = next(policy.parameters()).device
    q_ids, q_mask = collate_prompts([p["prompt"] for p in prompts for _ in range(k)], tok.pad_id)
    q_ids, q_mask = q_ids.to(device), q_mask.to(device)
    env = None if tools is None else ToolEnv(tools, tok)
    seen = None if tools is None else dict(tools.counts)    # the box's counts before this rollout (evaluation adds too)
    with parallel.gathered(policy):      # FSDP: one all-gather for the whole decoding, not one per token
        # response = tokens up to and including the stop token that ends it, pad after it; its last real token is
        # where the reward model reads the score (the end-of-turn token of a conversation)
        resp, response_mask, length, has_eos, actions = sample_responses(
            dist.unwrap(policy), q_ids, q_mask, sampling, gen, gen_stats, env, max_turns)
    response_mask = response_mask.float()
    decode = tok.decode if env is None else tok.decode_turns
    completions = [decode(row[:n]) for row, n in zip(resp.tolist(), length.tolist())]
    r = Rollout(query_response=torch.cat([q_ids, resp], 1),
                attention_mask=torch.cat([q_mask, response_mask.long()], 1), response_mask=response_mask,
                has_eos=has_eos.float(), completions=completions,
                action_mask=None if env is None else actions.float())
    if env is not None:              # per sequence: tool calls, and those that came back as an error
        errors = sum(v - seen.get(kind, 0) for kind, v in tools.counts.items() if kind != "ok")
        r.stats.update(tool_calls=env.counts["calls"] / len(completions), tool_errors=errors / len(completions))
    return r


@torch.no_grad()
def read_reward(reward, r: Rollout, prompt_texts, k):
    """The reward of each sample as its source gives it: (raw (B,) float32 or None, the reward model's recorded
    (mean, std) or None, a judge's (G, k, k) preference matrices within each prompt's group or None). A reward
    model scores the very ids sampled (no decode/re-encode round trip); a function the texts. No reward (None):
    (None, None, None)."""
    device = r.response_mask.device
    if reward is None:
        return None, None, None
    if isinstance(reward, Judge):
        rm = reward.pointwise if reward.pairwise is None else None
        ids_scores = rm.score_tokens(r.query_response, r.attention_mask) if isinstance(rm, RewardModel) else None
        return None, None, preference_matrix(reward, prompt_texts, r.completions, k, scores=ids_scores)
    if isinstance(reward, RewardModel):
        return reward.score_tokens(r.query_response, r.attention_mask), (reward.mean, reward.std), None
    return torch.tensor(reward(prompt_texts, r.completions), dtype=torch.float32, device=device), None, None


def group_spread(scores, k):
    """(G,) True where the k scores of a prompt's group are not all equal: the only groups a group estimator
    learns from (an all-equal group's advantages are 0)."""
    by_group = scores.view(-1, k)
    return by_group.max(1).values != by_group.min(1).values


def join(parts, pad_id):
    """One Rollout (before log-probs) from several, re-padded to the longest prompt (left) and response (right)."""
    if len(parts) == 1:
        return parts[0]
    P, R = max(p.query_len for p in parts), max(p.response_mask.shape[1] for p in parts)

    def fit(p):
        dp, dr = P - p.query_len, R - p.response_mask.shape[1]
        return dict(query_response=F.pad(p.query_response, (dp, dr), value=pad_id),
                    attention_mask=F.pad(p.attention_mask, (dp, dr)), response_mask=F.pad(p.response_mask, (0, dr)),
                    policy_mask=F.pad(p.policy_mask, (0, dr)),
                    **({} if p.action_mask is None else {"action_mask": F.pad(p.action_mask, (0, dr))}))
    fitted = [fit(p) for p in parts]
    cat = {k: torch.cat([f[k] for f in fitted]) for k in fitted[0]}
    optional = {k: None if getattr(parts[0], k) is None else torch.cat([getattr(p, k) for p in parts])
                for k in ("gold", "costs")}
    return Rollout(scores=torch.cat([p.scores for p in parts]),
                   raw_scores=torch.cat([p.raw_scores for p in parts]), has_eos=torch.cat([p.has_eos for p in parts]),
                   completions=[c for p in parts for c in p.completions], **cat, **optional)


def take(r: Rollout, rows):
    """The Rollout (before log-probs) of these rows, in this order."""
    rows_t = torch.as_tensor(rows, dtype=torch.long, device=r.scores.device)
    pick = {name: getattr(r, name)[rows_t] for name in ("query_response", "attention_mask", "response_mask",
                                                        "policy_mask", "scores", "raw_scores", "has_eos")}
    optional = {k: None if getattr(r, k) is None else getattr(r, k)[rows_t] for k in ("gold", "costs", "action_mask")}
    return Rollout(completions=[r.completions[i] for i in rows], **pick, **optional)


@torch.no_grad()
def sample_rounds(draw, k, batch_size, max_rounds, pad_id):
    """DAPO's dynamic sampling (Yu et al. 2025, eq. 11: keep groups with 0 < #correct < k): draw() scored
    Rollouts of a batch of prompts until this rank holds batch_size groups whose scores differ, at most
    max_rounds rounds; every rank runs the same number of rounds (a reward model may be sharded: its forwards
    are collective), and a rank still short after the last round fills up with zero-spread groups (counted)."""
    parts, spreads, first_zero = [], [], None
    for _ in range(max_rounds):
        part = draw()
        spread = group_spread(part.scores, k)
        first_zero = (~spread).float().mean().item() if first_zero is None else first_zero
        parts.append(part)
        spreads.append(spread)
        short = float(int(torch.cat(spreads).sum()) < batch_size)
        if dist.all_reduce_sum(short) == 0:                 # every rank is full
            break
    joined, spread = join(parts, pad_id), torch.cat(spreads)
    order = torch.cat([spread.nonzero().view(-1), (~spread).nonzero().view(-1)])[:batch_size].tolist()
    r = take(joined, [g * k + j for g in order for j in range(k)])
    r.stats.update(zero_spread_groups=first_zero, sampling_rounds=float(len(parts)),
                   filled_groups=float(max(0, batch_size - int(spread.sum()))))
    return r


@torch.no_grad()
def forwards(r: Rollout, models: Models, logprobs_of, opts, old=True, sampler=None):
    """The rollout with what the update reads from the models, computed over its sequences in micro-batches of
    --micro_batch_size with the policy in eval mode: π_old's log-probs (old), the reference's, the critics' values;
    and the sampler's log-probs (sampler: the sampling copy, or the policy itself: then π_old's), returned beside
    it, (B, R) or None. logprobs_of(model, ids, attn, response_mask, temperature): the script's gather."""
    seq, attn, response_mask, device = r.query_response, r.attention_mask, r.response_mask, r.scores.device
    P = r.query_len
    logprobs = torch.zeros_like(response_mask) if old else None
    sampler_logprobs = torch.zeros_like(response_mask) if sampler is not None else None
    ref_logprobs = torch.zeros_like(response_mask) if models.ref is not None else None
    values = torch.zeros_like(response_mask) if models.critic is not None else None
    cost_values = torch.zeros_like(response_mask) if models.cost_critic is not None else None
    models.policy.eval()
    for i in range(0, seq.shape[0], opts.micro_batch_size):
        mb = slice(i, i + opts.micro_batch_size)
        batch = (seq[mb], attn[mb], response_mask[mb], opts.temperature)
        with autocast(device, opts.dtype):
            if logprobs is not None:
                logprobs[mb] = logprobs_of(models.policy, *batch)
            if sampler_logprobs is not None:
                sampler_logprobs[mb] = logprobs[mb] if sampler is models.policy else logprobs_of(sampler, *batch)
            if ref_logprobs is not None:
                ref_logprobs[mb] = logprobs_of(models.ref, *batch)
            for critic, v in ((models.critic, values), (models.cost_critic, cost_values)):
                if v is not None:
                    v[mb] = critic(seq[mb], attn[mb])[0][:, P - 1:-1].float() * response_mask[mb]
    models.policy.train()
    return replace(r, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values,
                   cost_values=cost_values), sampler_logprobs


def sampling_options(opts, tok):
    """What a rollout samples and how the engine computes it (nano_rlhf.sampling.SamplingOptions), from the
    script's options: pure sampling at τ up to the tokenizer's stop ids (end-of-text, the template's end-of-turn)."""
    # under --fsdp the engine samples with the gathered weights themselves (an FSDP module cannot be copied
    # into a sampling copy of another dtype; --rollout_dtype bfloat16 is refused with --fsdp)
    return SamplingOptions(max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, stop_ids=tok.stop_ids,
                           pad_id=tok.pad_id, compile=opts.compile_rollout, share_prefix=opts.share_prompt_prefill,
                           compact=opts.compact_rollout,
                           dtype=None if opts.fsdp else getattr(torch, opts.rollout_dtype))


def step_metrics(r: Rollout, seq_kl, kl_penalty, sums, beta, k=1):
    """Named per-step figures, averaged over all ranks: sequence means (seq_kl: the script's Σ_t KL_t of each
    sequence, kl_penalty: the KL part of its reward), token means and update means of the update's named sums.
    k > 1 (a group estimator's samples per prompt) adds zero_spread, the share of groups whose k scores are all
    equal (they teach a group estimator nothing)."""
    seq = {"score": r.scores, "rm_score_raw": r.raw_scores, "kl": seq_kl,
           "non_score_reward": kl_penalty, "response_length": r.response_mask.sum(1), "eos_rate": r.has_eos}
    if k > 1:
        seq["zero_spread"] = (~group_spread(r.scores, k)).repeat_interleave(k).to(r.scores.dtype)
    if r.gold is not None:
        seq["gold_reward"] = r.gold
    if r.costs is not None:
        seq["cost"] = r.costs
    names = ["sequences", *seq, *sums]
    local = [float(r.scores.shape[0]), *(v.sum().item() for v in seq.values()), *sums.values()]
    total = dict(zip(names, dist.all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()))
    metrics = {f"train/{k}": total[k] / total["sequences"] for k in seq}
    per_token = ("policy_loss", "entropy", "approx_kl", "clipfrac", "ratio", "value_loss", "value_clipfrac",
                 "cost_value_loss", "cost_value_clipfrac")
    metrics.update({f"train/{k}": total[k] / max(total["tokens"], 1) for k in per_token if k in total})
    per_update = max(total["updates"], 1)          # every rank counts its updates, so this also divides by ranks
    metrics.update({f"train/{k}": total[k] / per_update for k in ("grad_norm", "critic_grad_norm",
                                                                  "cost_critic_grad_norm") if k in total})
    metrics["train/kl_coef"] = beta
    for k in ("policy_loss", "entropy", "approx_kl", "clipfrac", "ratio"):    # over the policy loss's own tokens
        if k in total and "policy_tokens" in total:
            metrics[f"train/{k}"] = total[k] / max(total["policy_tokens"], 1)
    if r.stats:       # rank means of the sampling's figures (dynamic sampling, sampler/trainer mismatch)
        names = sorted(r.stats)
        sums = dist.all_reduce_sum(torch.tensor([r.stats[k] for k in names], dtype=torch.float64))
        means = sums / dist.world().world_size
        metrics.update({f"train/{k}": v for k, v in zip(names, means.tolist())})
    return metrics


class Lagrange:
    """PPO-Lagrangian's multiplier as state, its step left to the script: log λ, and the (sum, count) of the episode
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


def held_out_metrics(run, step, models: Models, tok, prompts, opts):
    """Held-out prompts, pure sampling at T = 1 with a fixed seed (comparable across steps), scored by the reward,
    the gold reward and the cost where there are some, with the KL to the reference; rank 0 only."""
    return eval_metrics(run, step, models.policy, tok, prompts, replace(sampling_options(opts, tok), temperature=1.0),
                        ref=models.ref, rewards={**eval_columns(models.reward, models.gold),
                                                 **({"cost": models.cost} if models.cost is not None else {})},
                        gathered=(models.ref, getattr(models.reward, "model", None),
                                  getattr(models.cost, "model", None)), show=3, tools=models.tools,
                        max_turns=opts.max_turns)


def startup_line(opts, models: Models, n_prompts, prompt_stats, step):
    """The run's one-line summary printed at start-up (step: where a --resume goes on)."""
    B, k = opts.batch_size, opts.samples_per_prompt
    return (f"{opts.advantage.upper()} | reward {opts.reward} | {n_prompts:,} prompts ({prompt_stats}) | {B} prompts x "
            f"{k} samples x {dist.world().world_size} ranks per step | {opts.ppo_epochs} epochs x "
            f"{opts.num_minibatches} minibatches of {B * k // opts.num_minibatches} (micro {opts.micro_batch_size}) | "
            f"critic: {opts.critic_init if models.critic is not None else 'none'} | {opts.max_steps} steps"
            + (f" | cost {opts.cost_model or opts.cost} <= {opts.cost_limit:g} (PPO-Lagrangian, λ from "
               f"{opts.lambda_init:g})" if models.cost is not None else "")
            + lora.describe(models.policy) + (" | reference: the policy with its adapters off"
                                              if isinstance(models.ref, lora.BaseView) else "")
            + (f" | resuming at step {step}" if step else ""))


# ---- train_online.py's samples: k per prompt from a (mixture of) model(s), and a pointwise judge's scores ----

@dataclass
class Samples:
    """k responses per prompt, groups of k consecutive rows. R = longest response."""
    ids: torch.Tensor             # (N, P+R) left-padded prompt | response, padded after its stop token
    attn: torch.Tensor            # (N, P+R) 1 on real tokens
    response_mask: torch.Tensor   # (N, R) float, 1 up to and including the first stop token
    has_eos: torch.Tensor         # (N,) float
    prompts: list                 # N prompt texts (as given in the prompts file)
    completions: list             # N decoded responses


def load_online_models(opts, tok, run, training_copy):
    """train_online.py's models: the policy (--lora_r: with adapters, what they add to the run's identity recorded),
    the initial reference (the KL of the evaluation is always to it; --lora_r with the reference = --init: the
    policy with its adapters off, no second copy) and, with training_copy (--ref_update_every), the training
    reference: a separate copy that is replaced with the policy every N steps (else None: training uses the
    initial reference). Raises on bad input (one line via input_errors)."""
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


def pairs_as_samples(examples, pad_id, device):
    """Tokenized preference pairs (data.tokenize_pairs) in the samples' layout, so a script reads their log-probs as
    it reads its own samples': rows 0..B−1 each pair's chosen response, rows B..2B−1 its rejected one, each row
    [left padding | prompt | response] ending at the last column, and the response mask over the last R columns
    (R = the longest response; a shorter one's prompt tokens there are context, as is a tool turn inside a
    response). Why not a prompt block then a response block, as sampling lays them out: the longest prompt and
    the longest response of different pairs could together exceed the context; this is as wide as one pair."""
    keys = ("chosen", "rejected")
    seqs = [e["prompt"] + e[key] for key in keys for e in examples]
    masks = [e.get(f"{key}_mask", [1] * len(e[key])) for key in keys for e in examples]
    R = max(len(m) for m in masks)
    return Samples(ids=pad_left(seqs, pad_id).to(device), attn=pad_left([[1] * len(x) for x in seqs], 0).to(device),
                   response_mask=pad_left(masks, 0, R).float().to(device),
                   has_eos=torch.ones(len(seqs), device=device), prompts=[], completions=[])


def sample_from_mixture(mixture, prompts, prompt_ids, tok, opts, step, device, stream=0):
    """k responses per prompt from the (mixture of) model(s): tokenized prompt records, their dataset indices."""
    k = opts.samples_per_prompt
    q_ids, q_mask = collate_prompts([p["prompt"] for p in prompts for _ in range(k)], tok.pad_id)
    u = sample_uniforms(opts.seed, step, prompt_ids, k, opts.max_new_tokens, stream)
    seq = generate_mixture(mixture, q_ids.to(device), q_mask.to(device), u.to(device), opts.temperature,
                           tok.stop_ids, tok.pad_id)
    prompt_len = q_ids.shape[1]
    resp, response_mask, length, has_eos = cut_at_stop(seq[:, prompt_len:], tok.stop_ids, tok.pad_id)
    return Samples(ids=torch.cat([seq[:, :prompt_len], resp], 1),
                   attn=torch.cat([q_mask.to(device), response_mask.long()], 1),
                   response_mask=response_mask.float(), has_eos=has_eos.float(),
                   prompts=[p["text"] for p in prompts for _ in range(k)],
                   completions=[tok.decode(row[:n]) for row, n in zip(resp.tolist(), length.tolist())])


def judge_scores(judge, samples: Samples, tok, missing_eos_penalty=None):
    """The pointwise judge's scores of the samples (N,), float64. A reward model scores the very ids sampled, as
    the PPO rollout does (a decode/re-encode round trip need not give them back, nor fit the context), each row
    closed by the end token the score is read at when the response never produced it (end-of-text after a text
    prompt, the template's end-of-turn after a conversation, as RewardModel.__call__ closes a completion).
    missing_eos_penalty: subtracted from the score of every response cut at --max_new_tokens (TRL's
    OnlineDPOConfig.missing_eos_penalty). Why: a judge may like a long unfinished answer; without the penalty the
    policy learns to ramble until the length limit."""
    scores = _raw_scores(judge, samples, tok)
    if missing_eos_penalty:
        scores = scores - missing_eos_penalty * (1 - samples.has_eos.double().cpu())
    return scores


def _raw_scores(judge, samples: Samples, tok):
    rm = judge.pointwise
    if not isinstance(rm, RewardModel):
        return judge.scores(samples.prompts, samples.completions)
    rows = []
    for ids, attn, ended, prompt in zip(samples.ids.tolist(), samples.attn.tolist(), samples.has_eos.tolist(),
                                        samples.prompts):
        row = [t for t, a in zip(ids, attn) if a]                  # the row alone, no padding
        if not ended:
            row.append(tok.eos_id if isinstance(prompt, str) else tok.eot_id)
        rows.append(row[-rm.model.cfg.block_size:])
    ids, attn = pad_right(rows, tok.pad_id), pad_right([[1] * len(r) for r in rows], 0)   # right-padded: plain causal
    return rm.score_tokens(ids.to(rm.device), attn.to(rm.device)).double().cpu()


def online_step_metrics(samples: Samples, scores, stats, gold):
    """train_online.py's step figures over all ranks, in one all-reduce: sequence means (judge score, gold reward,
    length, end-of-text rate) and the method's {name: (this rank's sum, global denominator)}."""
    seq = {"response_length": samples.response_mask.sum(1), "eos_rate": samples.has_eos}
    if scores is not None:
        seq["score"] = scores.flatten()
    if gold is not None:
        seq["gold_reward"] = torch.tensor(gold(samples.prompts, samples.completions))
    names = ["sequences", *seq, *stats]
    local = [float(samples.ids.shape[0]), *(float(v.sum()) for v in seq.values()), *(v[0] for v in stats.values())]
    total = dict(zip(names, dist.all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()))
    metrics = {f"train/{k}": total[k] / total["sequences"] for k in seq}
    metrics.update({f"train/{k}": total[k] / denominator for k, (_, denominator) in stats.items()})
    return metrics
