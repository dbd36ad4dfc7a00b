"""The rollout engine: sample continuations of left-padded prompts with a KV cache, in plain PyTorch.

Read `generate` first. It is the whole algorithm:
  1. prefill  run the prompts through the trunk once, writing every layer's keys/values into a cache that is
              preallocated for the whole rollout; prompts that occur several times (the k samples of a prompt
              group) are prefilled once and their cache rows copied (prefix sharing)
  2. decode   one token per step: logits of the last position -> sample -> feed the token back, attending to
              the cache instead of recomputing the prefix
  3. stop     a row ends at its first stop id (end-of-text, end-of-turn); everything after it is pad. Rows that
              ended leave the decode batch (compaction), so a batch of short answers does not pay for the longest.

The fast path sits beside the eager loop and computes the same numbers: `compile=True` runs the decode step
(trunk + output layer) as one `torch.compile`d graph over a static-shape cache (every cache slot attended, the
unwritten ones masked), so its shapes never change between steps; compaction then shrinks the batch only to a
few bucket sizes (B, B/2, B/4, B/8), one compiled graph each. Where compile is unavailable (no C++ compiler for
inductor's CPU kernels) or fails, one notice line goes to stderr and the same step runs eagerly.

Random numbers. A sampled row draws one uniform number per step (`inverse_cdf_sample`), and every step draws
them for ALL B rows of the call (torch.rand(B)) whether or not a row is still in the decode batch. So neither
compaction nor prefix sharing changes any draw: they change a token only where they change its logits, which
they do at most by float rounding (a matrix product of fewer rows may sum in another order).

Multi-turn rollouts (`generate_turns`, for tool use). A row's assistant turn ends when it samples a stop id; the
caller's `env` then gets that turn's sampled ids and answers the ids to append (a tool turn and the next generation
prompt: nano_rlhf.tools.ToolEnv) or None (the turn is the final answer: the row ends). How the appended ids enter
the KV cache while other rows decode: they are FORCED, one per decode step, as that row's input token in place of
a sampled one (its draw of the step is spent and ignored), so the row's cache, positions and attention mask are
written exactly as for any token, and the other rows' steps do not change. A tool turn of m tokens costs that row
m steps (no per-row prefill of a different length inside the batch: one code path, static shapes). Token-in,
token-out: the ids returned are the sampled ids and the env's ids as given, never re-tokenised; `policy_mask`
marks the sampled ones (holes at tool turns), and the log-probs recorded when each token was sampled are those of
the trainer's forward (log_softmax(logits / temperature), float32 at least, no top-k/top-p) up to float rounding
(tested against a teacher-forced forward). Limits: `max_turns` assistant turns, and `max_new_tokens` is the budget
of sampled AND appended tokens: a tool turn that does not fit ends the row (counted: `budget_cut`). What still
holds with turns, each tested token-identical against the plain loop (use_cache=False, which forces the same way):
prefix sharing (the prompts are prefilled as in generate), compaction (a row in a tool turn is running, not ended), the
compiled static-cache step (a forced token is only another input id of the same shape), and the per-step RNG rule
(every step still draws B numbers, forced or not). What changes: one host read of the forced and ended rows per
step, and the env runs on the host between two steps (the other rows wait for it).

Nash-MD's opponents (`generate_mixture`, for train_online.py) come from the normalised geometric mixture of several
models: one KV cache per model, their logits mixed at every step, one seeded uniform number per (row, step).
"""
import copy
import math
import os
import shutil
import sys
import time
import weakref
from dataclasses import dataclass, replace
from typing import Iterable, Optional, Union

import torch
import torch.nn.functional as F


# ---- sampling one token -------------------------------------------------------------------------

def sample_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None, u=None):
    """(B, V) logits -> (B,) token ids. temperature 0 = argmax; top_k/top_p filter before sampling.
    u: (B,) uniform numbers in [0, 1) to sample with (default: drawn here from generator)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits if logits.dtype == torch.float64 else logits.float()     # float32 at least
    if temperature != 1.0:                   # (x / 1.0 == x exactly: the division is skipped, not approximated)
        logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p        # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return inverse_cdf_sample(logits.softmax(-1), generator, u)


def inverse_cdf_sample(probs, generator=None, u=None):
    """(B, V) probabilities -> (B,) ids with one uniform number per row (u, or drawn from generator). Why:
    torch.multinomial draws an exponential per vocabulary entry, which costs more than a small model's whole
    decode step."""
    cdf = probs.cumsum(-1)
    if u is None:
        u = torch.rand(cdf.shape[0], generator=generator, device=cdf.device)
    return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).clamp(max=cdf.shape[-1] - 1).squeeze(-1)


def stop_table(stop_ids, vocab_size, device):
    """(V,) bool, True at the stop ids: `table[tok]` is one gather per step (torch.isin sorts every call)."""
    table = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    ids = [i for i in stop_ids if 0 <= i < vocab_size]
    if ids:
        table[torch.tensor(ids, device=device)] = True
    return table


def bucket_sizes(batch):
    """Batch sizes the compiled decode step is compiled for: batch, batch/2, batch/4, batch/8 (rounded up).
    Why stop at an eighth: each size is one more compile (seconds to a minute on CPU), and below an eighth of
    the batch the step costs little more than its weights' reads whatever the row count."""
    sizes = [batch]
    while len(sizes) < 4 and sizes[-1] > 1:
        sizes.append(math.ceil(sizes[-1] / 2))
    return sizes


# ---- the engine ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class SamplingOptions:
    """What generate samples (the first six fields) and how the engine computes it: use_cache, compile,
    share_prefix and compact give the same tokens at a seed up to float rounding; dtype samples with a copy of
    the model in another dtype (its own numbers)."""
    max_new_tokens: int = 32
    temperature: float = 1.0                  # 0 = greedy (argmax)
    top_k: Optional[int] = None               # sample among the k most likely tokens only
    top_p: Optional[float] = None             # nucleus: the smallest set of tokens holding this much probability
    stop_ids: Union[int, Iterable[int], None] = None   # ids that end a row (end-of-text, end-of-turn)
    pad_id: Optional[int] = None              # written after a row's stop token (default: the first stop id, else 0)
    use_cache: bool = True                    # False: the reference loop, a full forward per token
    compile: bool = False                     # decode with the torch.compile'd static-cache step
    share_prefix: bool = True                 # prefill identical prompt rows once
    compact: bool = True                      # ended rows leave the decode batch
    dtype: Optional[torch.dtype] = None       # sample with a copy of the model in this dtype (e.g. torch.bfloat16)


def stop_list(stop_ids):
    """An id, a list/set of ids or None -> a sorted list of stop ids."""
    return [] if stop_ids is None else [stop_ids] if isinstance(stop_ids, int) else sorted(stop_ids)


@torch.no_grad()
def generate(model, input_ids, attention_mask=None, opts=SamplingOptions(), generator=None, stats=None):
    """Sample continuations of left-padded prompts with a GPT (nano_rlhf.model).

    input_ids, attention_mask: (B, Tp) prompts, left-padded (mask 0 on pads). opts: SamplingOptions.
    Returns (B, Tp + n) ids, n <= opts.max_new_tokens: prompts followed by the new tokens; after a row's first
    stop token every position holds the pad id (cut_at_stop gives each row's length and mask). Stops early
    when every row has ended. With opts.dtype the caller recomputes log-probs with its own model
    (sampling_copy gives the sampler's). stats: a dict to fill with timings and counts (compile_s apart from
    the rest).
    """
    B, Tp = input_ids.shape
    cfg = model.cfg
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if Tp + opts.max_new_tokens > cfg.block_size:
        raise ValueError(f"prompt ({Tp}) + max_new_tokens ({opts.max_new_tokens}) exceeds block_size "
                         f"{cfg.block_size}")
    stops = stop_list(opts.stop_ids)
    opts = replace(opts, stop_ids=stops, pad_id=opts.pad_id if opts.pad_id is not None else (stops[0] if stops else 0))
    stats = {} if stats is None else stats
    stats.update(compile_s=0.0, prefill_s=0.0, decode_s=0.0, steps=0, row_steps=0, prefill_rows=0, compiled=False)
    was_training = model.training
    model.eval()
    try:
        dtype = opts.dtype
        net = model if dtype is None or dtype == model.output_weight().dtype else _shadow(model, dtype)
        if not opts.use_cache:
            return _generate_uncached(net, input_ids, attention_mask, opts, generator, stats)
        return _generate_cached(net, input_ids, attention_mask.long(), opts, generator, stats)
    finally:
        model.train(was_training)


def cut_at_stop(response, stop_ids, pad_id):
    """Each sampled response cut after its first stop token: (B, R) ids -> (ids, mask, length, ended).

    ids (B, R): the response with pad_id after its first stop token (generate already writes them: then
    unchanged); mask (B, R) bool: True up to and including the first stop token, every position of a row with
    none; length (B,): its True count; ended (B,) bool: the row holds a stop token. stop_ids: an id, a
    list/set of ids or None (no row ends). pad_id may lie outside the vocabulary (it is only written)."""
    stops = torch.tensor(stop_list(stop_ids), dtype=response.dtype, device=response.device)
    is_stop = torch.isin(response, stops)
    # a position is kept while no stop token came before it (cumsum counts the stops up to and including it)
    mask = (is_stop.cumsum(1) - is_stop.long()) == 0
    return response.masked_fill(~mask, pad_id), mask, mask.sum(1), is_stop.any(1)



def sample_responses(model, input_ids, attention_mask, opts, generator=None, stats=None, env=None, max_turns=1):
    """The responses a caller trains on or scores, each up to its end: `generate` cut after the first stop token
    (env None), or `generate_turns` with env's tool turns inside (up to max_turns assistant turns). Returns (ids
    (B, R) with opts.pad_id after each end, mask (B, R) bool up to and including the end, length (B,), ended (B,)
    bool: the row ended on a stop id it sampled, actions (B, R) bool: the tokens the policy sampled — mask itself
    without tools, mask with holes at the tool turns with them)."""
    Tp = input_ids.shape[1]
    if env is None:
        seq = generate(model, input_ids, attention_mask, opts, generator, stats)
        ids, mask, length, ended = cut_at_stop(seq[:, Tp:], opts.stop_ids, opts.pad_id)
        return ids, mask, length, ended, mask
    t = generate_turns(model, input_ids, attention_mask, opts, env, max_turns, generator, stats)
    ids = t.ids[:, Tp:].masked_fill(~t.response_mask, opts.pad_id)
    return ids, t.response_mask, t.response_mask.sum(1), t.ended, t.policy_mask


def _generate_uncached(model, ids, mask, opts, generator, stats, turns=None):
    """The reference loop: a full forward over the whole sequence for every new token."""
    B, Tp = ids.shape
    is_stop = stop_table(opts.stop_ids, model.cfg.vocab_size, ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=ids.device)
    left_padded = not bool(mask.all())
    t0, new = time.perf_counter(), []
    rows = torch.arange(B, device=ids.device)
    for step in range(opts.max_new_tokens):
        logits = model(ids, mask if left_padded else None)[:, -1]
        u = torch.rand(B, generator=generator, device=ids.device) if opts.temperature else None
        tok = sample_token(logits, opts.temperature, opts.top_k, opts.top_p, generator, u)
        if turns is None:
            new.append(tok.masked_fill(done, opts.pad_id))
            done |= is_stop[tok]
        else:
            tok = turns.force(rows, tok)
            new.append(tok.masked_fill(done, opts.pad_id))
            done = done | turns.after_step(step, rows, tok, logits, done, is_stop, torch.stack(new, 1))
        ids, mask = torch.cat([ids, tok[:, None]], 1), torch.cat([mask, mask.new_ones(B, 1)], 1)
        stats["steps"] += 1
        stats["row_steps"] += B
        if bool(done.all()):
            break
    stats["decode_s"] = time.perf_counter() - t0
    return torch.cat([ids[:, :Tp], torch.stack(new, 1)], 1)


def _generate_cached(model, input_ids, mask, opts, generator, stats, turns=None):
    B, Tp = input_ids.shape
    max_new_tokens, temperature, stops, pad = opts.max_new_tokens, opts.temperature, opts.stop_ids, opts.pad_id
    device, trunk, W = input_ids.device, model.trunk, model.output_weight()
    tc = time.perf_counter()
    step_fn = _compiled_step(model, device) if opts.compile else None     # (imports dynamo/inductor the first time)
    stats["compile_s"] = time.perf_counter() - tc
    stats["compiled"] = step_fn is not None
    left_padded = not bool(mask.all())
    static = step_fn is not None                       # static shapes: attend to every cache slot, masked
    L = Tp + max_new_tokens
    if static:                                         # a few cache lengths, so varying prompts reuse graphs
        L = min(model.cfg.block_size, 64 * math.ceil(L / 64))

    # 1. prefill: each distinct prompt row once, then its cache rows copied to the rows that share it
    t0 = time.perf_counter()
    rows_in = torch.arange(B, device=device)
    if opts.share_prefix:
        _, inverse = torch.unique(torch.cat([input_ids, mask], 1), dim=0, return_inverse=True)
        first = torch.full((int(inverse.max()) + 1,), B, device=device).scatter_reduce(0, inverse, rows_in, "amin")
        if len(first) < B:
            rows_in = first                            # prefill these rows; row b reads shared row inverse[b]
    shape = (len(rows_in), model.cfg.kv_heads, L, model.cfg.hd)
    cache = [(W.new_zeros(shape), W.new_zeros(shape)) for _ in range(model.cfg.n_layer)]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    p_ids, p_mask = input_ids[rows_in], mask[rows_in]
    h = trunk.forward_cached(p_ids, p_mask if left_padded else None, pos[rows_in], cache, 0)[:, -1]
    logits = F.linear(h, W)
    if len(rows_in) < B:
        # (index_select, not k[inverse]: advanced indexing of a 4-D tensor is several times slower on CPU)
        cache = [(k.index_select(0, inverse), v.index_select(0, inverse)) for k, v in cache]
        logits = logits[inverse]
    stats["prefill_rows"] = len(rows_in)
    stats["prefill_s"] = time.perf_counter() - t0

    # 2./3. decode. rows: which of the B rows the decode batch holds (compaction removes ended ones)
    is_stop = stop_table(stops, model.cfg.vocab_size, device)
    rows = torch.arange(B, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    out = torch.full((B, max_new_tokens), pad, dtype=input_ids.dtype, device=device)
    next_pos = pos[:, -1:] + 1
    keys = None                                        # (b, 1, 1, L) bool: which cache slots a query may see
    if static or left_padded:
        keys = F.pad(mask.bool(), (0, L - Tp))[:, None, None, :]
    buckets = bucket_sizes(B)
    seen_shapes = _SEEN.setdefault(model, set())
    t0, n, compile_s = time.perf_counter(), 0, stats["compile_s"]
    for step in range(max_new_tokens):
        sel = rows if len(rows) < B else slice(None)   # until the first compaction: views, no gathers
        u = torch.rand(B, generator=generator, device=device)[sel] if temperature else None
        tok = sample_token(logits, temperature, opts.top_k, opts.top_p, generator, u)
        ended = done[sel]
        if turns is None:
            out[sel, step] = tok.masked_fill(ended, pad)
            done[sel] = ended | is_stop[tok]
        else:                                           # a row in a tool turn feeds its next tool id instead
            tok = turns.force(rows, tok)
            out[sel, step] = tok.masked_fill(ended, pad)
            done[sel] = ended | turns.after_step(step, rows, tok, logits, ended, is_stop, out)
        stats["steps"] += 1
        stats["row_steps"] += len(rows)
        n = step + 1
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if opts.compact and stops:                          # (without stop ids no row ends early)
            alive = (~done[rows]).nonzero().squeeze(1)
            # eager: shrink to the running rows once a quarter has ended (each shrink copies the cache);
            # static: to the smallest bucket that holds them, so only len(buckets) shapes are ever compiled
            size = min(s for s in buckets if s >= len(alive)) if static else len(alive)
            if (size < len(rows)) if static else (size <= 0.75 * len(rows)):
                # keep the running rows, then (static) ended ones as filler up to the bucket size
                keep = torch.cat([alive, (done[rows]).nonzero().squeeze(1)])[:size]
                rows, tok, next_pos = rows[keep], tok[keep], next_pos[keep]
                cache = [(k.index_select(0, keep), v.index_select(0, keep)) for k, v in cache]
                keys = None if keys is None else keys[keep]
        # the token fed back is the sampled one even for ended rows (their outputs are discarded): a pad id may
        # lie outside the vocabulary
        write = Tp + step
        if keys is not None:
            keys[:, :, :, write] = True
        if static:
            args = (tok[:, None], keys, next_pos, cache, torch.tensor([write], device=device))
            key = (len(rows), L)
            if key not in seen_shapes:                 # first call at this shape: compiles (timed apart)
                seen_shapes.add(key)
                tc = time.perf_counter()
                logits, step_fn = _first_call(step_fn, model, args)
                stats["compile_s"] += time.perf_counter() - tc
            else:
                logits = step_fn(*args)
        else:
            m = None if keys is None else keys[:, :, :, :write + 1]
            logits = F.linear(trunk.forward_cached(tok[:, None], m, next_pos, cache, write)[:, -1], W)
        next_pos = next_pos + 1
    stats["decode_s"] = time.perf_counter() - t0 - (stats["compile_s"] - compile_s)
    return torch.cat([input_ids, out[:, :n]], 1)


# ---- multi-turn rollouts (tool use) ---------------------------------------------------------------

@dataclass
class Turns:
    """What generate_turns returns; B rows, n = the response length (at most max_new_tokens)."""
    ids: torch.Tensor               # (B, Tp + n): prompts | sampled and appended ids, pad after each row's end
    response_mask: torch.Tensor     # (B, n) bool: the row's tokens, sampled or appended, up to its end
    policy_mask: torch.Tensor       # (B, n) bool: the tokens the policy sampled (its actions), up to its end
    logprobs: torch.Tensor          # (B, n): log-prob of each sampled token when it was sampled, 0 elsewhere
    #                                 (with opts.dtype: the sampling copy's, as generate's note says)
    turns: torch.Tensor             # (B,) long: assistant turns the row began
    ended: torch.Tensor             # (B,) bool: the row ended on a stop id it sampled (no call, or max_turns)
    budget_cut: torch.Tensor        # (B,) bool: the row ended because its tool turn did not fit the budget


class _TurnState:
    """Per-row state of a multi-turn rollout: each row's tool ids still to feed, the step its current turn
    began, its turn count, what it sampled (policy mask, log-probs) and where it ended."""

    def __init__(self, env, max_turns, B, n, temperature, device):
        self.env, self.max_turns, self.n, self.temperature = env, max_turns, n, temperature
        self.queue = [[] for _ in range(B)]
        self.turn_start, self.turns, self.length = [0] * B, [1] * B, [n] * B
        self.forcing = torch.zeros(B, dtype=torch.bool, device=device)     # rows with tool ids still to feed
        self.forced_now = None                                              # (b,) the rows fed one this step
        self.policy = torch.zeros(B, n, dtype=torch.bool, device=device)
        self.logprobs = None                                                # (B, n), in the logits' dtype
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        self.cut = torch.zeros(B, dtype=torch.bool, device=device)

    def force(self, rows, tok):
        """The step's input ids: the sampled ones, and each forcing row's next tool id in its place."""
        self.forced_now = self.forcing[rows]
        which = self.forced_now.nonzero().view(-1).tolist()
        if not which:
            return tok
        tok = tok.clone()
        for j in which:
            b = int(rows[j])
            tok[j] = self.queue[b].pop(0)
            if not self.queue[b]:
                self.forcing[b] = False
        return tok

    def after_step(self, step, rows, tok, logits, ended, is_stop, out):
        """Record which tokens were sampled and their log-probs; for rows whose turn ended, ask the env (one call
        for all of them). out: the (B, >= step+1) ids so far. Returns (b,) bool: the rows that end now."""
        sampled = ~ended & ~self.forced_now
        x = logits if logits.dtype == torch.float64 else logits.float()       # as the trainer's forward
        logp = (x if self.temperature in (0, 1.0) else x / self.temperature).log_softmax(-1)
        lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        if self.logprobs is None:
            self.logprobs = torch.zeros(self.policy.shape, dtype=lp.dtype, device=lp.device)
        self.policy[rows, step] = sampled
        self.logprobs[rows, step] = lp.masked_fill(~sampled, 0.0)
        ends = torch.zeros_like(ended)
        stop = (sampled & is_stop[tok]).nonzero().view(-1).tolist()
        if not stop:
            return ends
        asked = []
        for j in stop:
            b = int(rows[j])
            self.length[b] = step + 1                     # (undone below for a row that goes on)
            if self.turns[b] >= self.max_turns:
                ends[j], self.finished[b] = True, True
            else:
                asked.append((j, b))
        answers = self.env([out[b, self.turn_start[b]:step + 1].tolist() for _, b in asked]) if asked else []
        for (j, b), ids in zip(asked, answers):
            if ids is None:                               # no call: the turn is the answer
                ends[j], self.finished[b] = True, True
            elif len(ids) >= self.n - step - 1:           # no room for the tool turn and one sampled token after it
                ends[j], self.cut[b] = True, True
            else:
                self.queue[b], self.turns[b], self.length[b] = list(ids), self.turns[b] + 1, self.n
                self.forcing[b] = True
                self.turn_start[b] = step + 1 + len(ids)
        return ends


@torch.no_grad()
def generate_turns(model, input_ids, attention_mask=None, opts=SamplingOptions(), env=None, max_turns=1,
                   generator=None, stats=None) -> Turns:
    """Multi-turn sampling (the header's last paragraph): `generate`, except that when a row samples a stop id
    and has begun fewer than max_turns assistant turns, env(turns) is asked — turns: one list of ids per row
    whose turn just ended (that turn's sampled ids, its stop id last) — and answers, per turn, the ids to append
    (fed to the model as context, never sampled) or None (the row ends). opts.max_new_tokens bounds sampled +
    appended tokens. Read each row's end from Turns.response_mask (cut_at_stop would cut at its first turn)."""
    if env is None or max_turns < 1:
        raise ValueError("generate_turns needs an env and max_turns >= 1 (plain sampling is generate)")
    B, Tp = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if Tp + opts.max_new_tokens > model.cfg.block_size:
        raise ValueError(f"prompt ({Tp}) + max_new_tokens ({opts.max_new_tokens}) exceeds block_size "
                         f"{model.cfg.block_size}")
    stops = stop_list(opts.stop_ids)
    if not stops:
        raise ValueError("multi-turn sampling needs stop ids: a turn ends on one")
    opts = replace(opts, stop_ids=stops, pad_id=opts.pad_id if opts.pad_id is not None else stops[0])
    stats = {} if stats is None else stats
    stats.update(compile_s=0.0, prefill_s=0.0, decode_s=0.0, steps=0, row_steps=0, prefill_rows=0, compiled=False)
    state = _TurnState(env, max_turns, B, opts.max_new_tokens, opts.temperature, input_ids.device)
    was_training = model.training
    model.eval()
    try:
        net = model if opts.dtype is None or opts.dtype == model.output_weight().dtype else _shadow(model, opts.dtype)
        if opts.use_cache:
            seq = _generate_cached(net, input_ids, attention_mask.long(), opts, generator, stats, state)
        else:
            seq = _generate_uncached(net, input_ids, attention_mask, opts, generator, stats, state)
    finally:
        model.train(was_training)
    n = seq.shape[1] - Tp
    length = torch.tensor(state.length, device=seq.device).clamp(max=n)
    response_mask = torch.arange(n, device=seq.device)[None] < length[:, None]
    policy = state.policy[:, :n] & response_mask
    logprobs = state.logprobs[:, :n] * policy
    stats.update(tool_turns=sum(t - 1 for t in state.turns), budget_cut=int(state.cut.sum()),
                 appended_tokens=int((response_mask & ~policy).sum()))
    return Turns(ids=seq, response_mask=response_mask, policy_mask=policy, logprobs=logprobs,
                 turns=torch.tensor(state.turns, device=seq.device), ended=state.finished, budget_cut=state.cut)


# ---- the compiled decode step -------------------------------------------------------------------

def _decode_step(model, tok, keys, pos, cache, write):
    """Trunk + output layer for one token per row over the whole static cache: (b, V) logits."""
    return F.linear(model.trunk.forward_cached(tok, keys, pos, cache, write)[:, -1], model.output_weight())


_COMPILED = weakref.WeakKeyDictionary()     # model -> its compiled decode step (or None after a failure)
_SEEN = weakref.WeakKeyDictionary()         # model -> (batch, cache length) shapes already compiled
_NOTICES = set()


def notice(message):
    """One stderr line per distinct message per process."""
    if message not in _NOTICES:
        _NOTICES.add(message)
        print(f"notice: {message}", file=sys.stderr, flush=True)


def compile_problem(device):
    """Why torch.compile cannot run the decode step here, or None."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if device.type == "cpu" and not (os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "c++", "clang++"))):
        return "no C++ compiler (g++) for inductor's CPU kernels"
    return None


def _compiled_step(model, device):
    """The model's compiled decode step, or None (with a notice) where compile is unavailable."""
    if model not in _COMPILED:
        _COMPILED[model] = _compile(device)
    fn = _COMPILED[model]
    return None if fn is None else (lambda *a: fn(model, *a))


def _compile(device):
    """torch.compile of _decode_step, or None with a notice."""
    problem = compile_problem(device)
    fn = None
    if problem:
        notice(f"compiled decoding unavailable ({problem}); decoding eagerly")
    else:
        # why the limit: one graph per bucket size and cache length; the default (8) would fall back to eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # reduce-overhead asks for CUDA graphs on a GPU. Their capture limit bites here: inductor's cudagraph
        # trees skip a graph whose inputs are mutated in place unless they are parameters or buffers, and the
        # KV cache is a plain input that forward_cached writes (index_copy_). On an H100 (torch 2.11) the step
        # was compiled and fused but not graphed ("skipping cudagraphs due to mutated inputs"): 2.6x the eager
        # decode all the same (docs/benchmarks.md). Holding the cache as a module buffer would let it be graphed.
        mode = "reduce-overhead" if device.type == "cuda" else None
        fn = torch.compile(_decode_step, dynamic=False, mode=mode)
    return fn


def _first_call(step_fn, model, args):
    """Run the step at a new shape (this compiles); on failure, a notice and the eager step from then on."""
    try:
        return step_fn(*args), step_fn
    except Exception as e:       # inductor raises many types (missing headers, lowering errors): all fall back
        notice(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
               "decoding eagerly")
        _COMPILED[model] = None
        eager = lambda *a: _decode_step(model, *a)
        return eager(*args), eager


_SHADOWS = weakref.WeakKeyDictionary()      # model -> its copy in another dtype (kept: a compiled step reuses it)


def sampling_copy(model, dtype):
    """The copy of `model` in `dtype` that generate(..., dtype=dtype) samples with, with the model's current
    weights: what a caller needs to score the sampled tokens under the sampler's own numbers."""
    return model if dtype == model.output_weight().dtype else _shadow(model, dtype)


def _shadow(model, dtype):
    """A copy of the model in dtype with the model's current weights (refreshed in place on every call)."""
    twin = _SHADOWS.get(model)
    if twin is None or twin.output_weight().dtype != dtype:
        twin = copy.deepcopy(model).to(dtype).eval()
        _SHADOWS[model] = twin
    else:
        with torch.no_grad():
            for a, b in zip(twin.parameters(), model.parameters()):
                a.copy_(b)
    return twin


# ---- the geometric-mixture sampler (Nash-MD's opponents, train_online.py) -------------------------
# Several models' KV caches side by side and one uniform number per (row, step) from the row's own seeded
# generator: a sample depends only on (seed, step, prompt, sample index, stream), not on its rank or batch row.

def sample_uniforms(seed, step, prompt_ids, k, length, stream=0):
    """(len(prompt_ids)·k, length) uniform numbers, row (prompt p, sample j) from its own generator seeded by
    (seed, step, p, j, stream): a sample does not depend on which rank or batch row its prompt landed in."""
    rows = []
    for p in prompt_ids:
        for j in range(k):
            g = torch.Generator().manual_seed(((((seed * 1_000_003 + step) * 1_000_003 + p) * 1009 + j) * 7 + stream)
                                              % (1 << 63))   # any --seed: manual_seed takes 64 bits
            rows.append(torch.rand(length, generator=g, dtype=torch.float64))
    return torch.stack(rows)


@torch.no_grad()
def generate_mixture(mixture, input_ids, attention_mask, uniforms, temperature, stop_ids, pad_id):
    """Sample from the normalised geometric mixture Π_m π_m^{w_m} (mixture = [(model, w_m)], Σ w_m = 1): at each
    step the logits are Σ_m w_m·logits_m (softmax renormalises per token), divided by τ, and token t of row b is
    the inverse-CDF sample of uniforms[b, t]. A single (policy, 1.0) is plain sampling. Each model keeps its own
    KV cache (trunk.forward_cached), as GPT.generate does. Returns (B, Tp + n) ids, pad after a row's stop token."""
    B, Tp = input_ids.shape
    n_new = uniforms.shape[1]
    mask = attention_mask.long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ends = torch.tensor(sorted(stop_ids), device=input_ids.device)
    caches, hidden = [], []
    for model, _ in mixture:
        model.eval()
        W, cfg = model.output_weight(), model.cfg
        shape = (B, cfg.kv_heads, Tp + n_new, cfg.hd)
        caches.append([(W.new_empty(shape), W.new_empty(shape)) for _ in range(cfg.n_layer)])
        hidden.append(model.trunk.forward_cached(input_ids, mask, pos, caches[-1], 0)[:, -1])
    next_pos, finished, new = pos[:, -1:] + 1, torch.zeros(B, dtype=torch.bool, device=input_ids.device), []
    for t in range(n_new):
        logits = sum(weight * F.linear(h, model.output_weight()).float() for (model, weight), h in zip(mixture, hidden))
        cdf = (logits / temperature).softmax(-1).cumsum(-1)
        u = uniforms[:, t:t + 1].to(cdf) * cdf[:, -1:]
        tok = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[-1] - 1).squeeze(-1)
        tok = torch.where(finished, torch.full_like(tok, pad_id), tok)
        new.append(tok)
        finished |= torch.isin(tok, ends)
        mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
        if bool(finished.all()) or t == n_new - 1:
            break
        hidden = [model.trunk.forward_cached(tok[:, None], mask, next_pos, cache, Tp + t)[:, -1]
                  for (model, _), cache in zip(mixture, caches)]
        next_pos = next_pos + 1
    return torch.cat([input_ids, torch.stack(new, 1)], 1)
