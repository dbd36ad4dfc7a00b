"""Rollouts: tokenized prompts become one Rollout of k samples each, decoded and scored, over the engine of
nano_rlhf/sampling.py. Knows no loss, no advantage and no script's options, and calls nothing of a script: what a
score becomes (normalised, clipped, a win rate), the forwards that fill π_old, π_ref and the values, and which
groups a step keeps are the script's (train_ppo.py, train_online.py); evaluate and label sample through it too.

B = prompts × k sequences, P = the longest prompt (left-padded), R = the longest response (right-padded). The k
samples of a prompt are k consecutive rows.
"""
from dataclasses import dataclass, field, fields
from typing import Optional

import torch
import torch.nn.functional as F

from . import dist
from .data import collate_prompts, pad_right
from .reward import Judge, RewardModel, preference_matrix
from .sampling import cut_at_stop, generate_mixture, sample_responses, sample_uniforms
from .tools import ToolEnv


@dataclass
class Rollout:
    """One batch of samples and everything an update reads about them: the one record of a batch, from the
    sampler to the loss. Sampling fills the first block; a script fills the signals and what its update needs."""
    query_response: torch.Tensor          # (B, P+R) ids: left-padded prompt | response, padded after its stop token
    attention_mask: torch.Tensor          # (B, P+R) 1 on real tokens
    response_mask: torch.Tensor           # (B, R) float, 1 up to and including the first stop token
    has_eos: torch.Tensor                 # (B,) float, 1 if the response ended with a stop token (tok.stop_ids)
    completions: list                     # B decoded response texts
    prompts: list = field(default_factory=list)  # B prompt texts (or messages) as the prompts file gave them
    weight_version: Optional[torch.Tensor] = None  # (B,) long: the optimizer steps the sampling weights had taken
    host_attention_mask: Optional[torch.Tensor] = None  # attention_mask's copy on the host, which an update finds its
    #                                                     positions and padding in without a read from the device
    action_mask: Optional[torch.Tensor] = None  # (B, R) the tokens the policy sampled: response_mask with holes at
    #                                             tool turns (their KL and loss are not the policy's); None = it
    tool_results: dict = field(default_factory=dict)  # each answered assistant turn's ids (a tuple) -> the tool
    #                                                   results that followed it (--tools: for transcripts)
    # the per-sequence signals, (B,) each
    scores: Optional[torch.Tensor] = None      # the reward the policy is trained on (the script's rule)
    raw_scores: Optional[torch.Tensor] = None  # the reward as the reward function returned it
    gold: Optional[torch.Tensor] = None        # a programmatic reward, logged only (built-in task prompts)
    costs: Optional[torch.Tensor] = None       # the cost (Safe RLHF) as the cost model or function returned it
    # what an update reads, (B, R) each
    policy_mask: Optional[torch.Tensor] = None  # the tokens the policy loss sees (action_mask, or with more holes)
    sampler_logprobs: Optional[torch.Tensor] = None  # log π_sampler(y_t): the weights and dtype that sampled
    logprobs: Optional[torch.Tensor] = None     # log π_old(y_t); None = the update's own first forward is π_old
    ref_logprobs: Optional[torch.Tensor] = None  # log π_ref(y_t); None when there is no KL
    values: Optional[torch.Tensor] = None       # V_old(x, y_≤t); None without a critic
    cost_values: Optional[torch.Tensor] = None  # V_c,old(x, y_≤t); None without a cost critic
    is_weight: Optional[torch.Tensor] = None    # a per-token importance weight on the policy loss, detached
    stats: dict = field(default_factory=dict)   # per-step figures of the sampling (rounds, mismatch, tool calls)

    @property
    def query_len(self):
        return self.query_response.shape[1] - self.response_mask.shape[1]

    @property
    def actions(self):
        """(B, R) the tokens the policy sampled (response_mask without tools)."""
        return self.response_mask if self.action_mask is None else self.action_mask

    @staticmethod
    def cat(parts, pad_id):
        """One Rollout from several, re-padded to the longest prompt (left) and response (right); stats dropped."""
        if len(parts) == 1:
            return parts[0]
        P, R = max(p.query_len for p in parts), max(p.response_mask.shape[1] for p in parts)
        out = {}
        for f in fields(Rollout):
            values = [getattr(p, f.name) for p in parts]
            if f.name == "stats":
                continue
            if f.name == "tool_results":
                out[f.name] = {k: v for d in values for k, v in d.items()}
            elif isinstance(values[0], list):
                out[f.name] = [x for v in values for x in v]
            elif values[0] is None:
                out[f.name] = None
            elif f.name in ("query_response", "attention_mask", "host_attention_mask"):   # (B, P+R): pad both ends
                value = pad_id if f.name == "query_response" else 0
                out[f.name] = torch.cat([F.pad(v, (P - p.query_len, R - p.response_mask.shape[1]), value=value)
                                         for v, p in zip(values, parts)])
            elif values[0].dim() == 2:                               # (B, R): pad the right end
                out[f.name] = torch.cat([F.pad(v, (0, R - v.shape[1])) for v in values])
            else:                                                    # (B,)
                out[f.name] = torch.cat(values)
        return Rollout(**out)

    def rows(self, rows):
        """The Rollout of these rows, in this order; stats dropped."""
        out = {}
        for f in fields(Rollout):
            value = getattr(self, f.name)
            if f.name in ("stats", "tool_results"):
                out[f.name] = {} if f.name == "stats" else value
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in rows] if value else []
            elif value is not None:
                out[f.name] = value[torch.as_tensor(rows, dtype=torch.long, device=value.device)]
        return Rollout(**out)


@torch.no_grad()
def sample_groups(prompts, policy, tok, sampling, k, gen, gen_stats=None, tools=None, max_turns=1,
                  version=0) -> Rollout:
    """k completions per prompt, cut after the first stop token (end-of-text or the chat template's end-of-turn:
    tok.stop_ids), decoded: a Rollout without signals yet. prompts: tokenized prompt records ({"prompt": ids,
    "text": the prompt as given}). sampling: the engine's SamplingOptions. version: the optimizer steps the
    policy's weights have taken (recorded per sample). tools (a nano_rlhf.tools.ToolBox): an assistant turn that
    calls tools gets their results as a tool turn and samples on, up to max_turns turns (sampling.generate_turns);
    the tool turns are context, not actions (holes in action_mask), and the completion's text holds them as the
    chat template renders them. Under FSDP the caller gathers the policy's weights around the call
    (parallel.gathered: one all-gather for the whole decoding, not one per token)."""
    device = next(policy.parameters()).device
    q_ids, q_mask = collate_prompts([p["prompt"] for p in prompts for _ in range(k)], tok.pad_id)
    q_ids, q_mask = q_ids.to(device), q_mask.to(device)
    env = None if tools is None else ToolEnv(tools, tok)
    seen = None if tools is None else dict(tools.counts)    # the box's counts before this rollout (evaluation adds too)
    # response = tokens up to and including the stop token that ends it, pad after it; its last real token is
    # where the reward model reads the score (the end-of-turn token of a conversation)
    resp, response_mask, length, has_eos, actions = sample_responses(
        dist.unwrap(policy), q_ids, q_mask, sampling, gen, gen_stats, env, max_turns)
    response_mask = response_mask.float()
    decode = tok.decode if env is None else tok.decode_turns
    completions = [decode(row[:n]) for row, n in zip(resp.tolist(), length.tolist())]
    attention_mask = torch.cat([q_mask, response_mask.long()], 1)
    r = Rollout(query_response=torch.cat([q_ids, resp], 1), attention_mask=attention_mask,
                host_attention_mask=attention_mask.cpu(), response_mask=response_mask,
                has_eos=has_eos.float(), completions=completions,
                prompts=[p["text"] for p in prompts for _ in range(k)],
                weight_version=torch.full((len(completions),), version, dtype=torch.long, device=device),
                action_mask=None if env is None else actions.float(),
                tool_results={} if env is None else dict(env.answered))
    if env is not None:              # per sequence: tool calls, and those that came back as an error
        errors = sum(v - seen.get(kind, 0) for kind, v in tools.counts.items() if kind != "ok")
        r.stats.update(tool_calls=env.counts["calls"] / len(completions), tool_errors=errors / len(completions))
    return r


@torch.no_grad()
def sample_mixture_groups(mixture, prompts, prompt_ids, tok, k, temperature, max_new_tokens, seed, step, device,
                          stream=0) -> Rollout:
    """k completions per prompt from the normalised geometric mixture of models (sampling.generate_mixture;
    [(policy, 1.0)] is plain sampling): prompts are tokenized prompt records, prompt_ids their dataset indices,
    which with (seed, step, stream) seed each sample's own uniform numbers (a sample does not depend on its rank
    or batch row)."""
    q_ids, q_mask = collate_prompts([p["prompt"] for p in prompts for _ in range(k)], tok.pad_id)
    u = sample_uniforms(seed, step, prompt_ids, k, max_new_tokens, stream)
    seq = generate_mixture(mixture, q_ids.to(device), q_mask.to(device), u.to(device), temperature, tok.stop_ids,
                           tok.pad_id)
    prompt_len = q_ids.shape[1]
    resp, response_mask, length, has_eos = cut_at_stop(seq[:, prompt_len:], tok.stop_ids, tok.pad_id)
    attention_mask = torch.cat([q_mask.to(device), response_mask.long()], 1)
    return Rollout(query_response=torch.cat([seq[:, :prompt_len], resp], 1), attention_mask=attention_mask,
                   host_attention_mask=attention_mask.cpu(),
                   response_mask=response_mask.float(), has_eos=has_eos.float(),
                   completions=[tok.decode(row[:n]) for row, n in zip(resp.tolist(), length.tolist())],
                   prompts=[p["text"] for p in prompts for _ in range(k)])


@torch.no_grad()
def read_reward(reward, r: Rollout, k):
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
        return None, None, preference_matrix(reward, r.prompts, r.completions, k, scores=ids_scores)
    if isinstance(reward, RewardModel):
        return reward.score_tokens(r.query_response, r.attention_mask), (reward.mean, reward.std), None
    return torch.tensor(reward(r.prompts, r.completions), dtype=torch.float32, device=device), None, None


@torch.no_grad()
def judge_scores(judge, r: Rollout, tok, missing_eos_penalty=None):
    """A pointwise judge's scores of the samples (B,), float64. A reward model scores the very ids sampled, as
    read_reward does (a decode/re-encode round trip need not give them back, nor fit the context), but each row
    closed by the end token the score is read at when the response never produced it (end-of-text after a text
    prompt, the template's end-of-turn after a conversation, as RewardModel.__call__ closes a completion).
    missing_eos_penalty: subtracted from the score of every response cut at the length limit (TRL's
    OnlineDPOConfig.missing_eos_penalty). Why: a judge may like a long unfinished answer; without the penalty the
    policy learns to ramble until the length limit."""
    rm = judge.pointwise
    if not isinstance(rm, RewardModel):
        scores = judge.scores(r.prompts, r.completions)
    else:
        rows = []
        for ids, attn, ended, prompt in zip(r.query_response.tolist(), r.attention_mask.tolist(),
                                            r.has_eos.tolist(), r.prompts):
            row = [t for t, a in zip(ids, attn) if a]                  # the row alone, no padding
            if not ended:
                row.append(tok.eos_id if isinstance(prompt, str) else tok.eot_id)
            rows.append(row[-rm.model.cfg.block_size:])
        ids, attn = pad_right(rows, tok.pad_id), pad_right([[1] * len(x) for x in rows], 0)   # plain causal
        scores = rm.score_tokens(ids.to(rm.device), attn.to(rm.device)).double().cpu()
    if missing_eos_penalty:
        scores = scores - missing_eos_penalty * (1 - r.has_eos.double().cpu())
    return scores
