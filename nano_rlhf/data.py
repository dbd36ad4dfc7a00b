"""Training data, from file to batch: read and validate the JSONL data kinds (every row checked before anything is
built), tokenize them, fit them to the training length, pack and pad them into batches; and the built-in task's
default files, written on first use. Knows nothing of models.

Training length: SFT, reward and DPO examples are fitted to --max_length tokens (training_length: default
min(block_size, 1024), never above block_size); SFT packing fills rows up to it.

Over-long examples (one rule for prompt + response rows): the prompt is truncated from the left, keeping
at least one prompt token; if the response (with its end-of-text) still does not fit, the example is
dropped. For {"messages"} rows "the response" is everything from the start of the final trained span.
{"text"} rows (plain language modelling, e.g. a document corpus) keep their beginning instead, as TRL
does: the first max_len tokens, with the end-of-text only if it still fits. All counts are returned and
logged.

Packing (SFT --packing): consecutive examples share a row up to the context length (pack_sft), with
per-token position ids restarting at 0 and segment ids, which the model takes as document ids (doc_ids: a
block-diagonal causal attention mask).

Padding: training batches are right-padded (real tokens first, so positions need no mask); prompts for
generation are left-padded (so every row's next token is at the same index).
"""
import json
import math
import os
import re
import sys
from typing import Callable, List, Sequence

import torch

from . import dist
from .tasks import synthetic
from .tokenizer import ROLES


# ---- tokenization with the over-long rule ------------------------------------------------------

DEFAULT_MAX_LENGTH = 1024   # TRL's default max_length for SFT, reward and DPO training


def training_length(max_length: int, block_size: int, where: str) -> int:
    """--max_length resolved against the model's context: 0 = min(block_size, 1024). Why not block_size itself:
    real checkpoints declare 8k-128k positions, and truncating (or packing) to that would make every batch as
    long as the longest example allows, far beyond what SFT/RM/DPO data needs. Above block_size is an error
    (positions the model has no embedding / rope calibration for); `where` names the model."""
    if max_length > block_size:
        raise ValueError(f"--max_length {max_length} is above the block_size {block_size} of {where}")
    return max_length or min(block_size, DEFAULT_MAX_LENGTH)


def prompt_limit(max_prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """The longest prompt a rollout keeps (longer ones are left-truncated): --max_prompt_len, or 0 = the training
    length min(block_size, 1024) minus --max_new_tokens (a model may declare 128k positions, which no prompt +
    response needs and the KV cache would be sized by). ValueError if prompt + response cannot fit block_size."""
    limit = max_prompt_len or min(block_size, DEFAULT_MAX_LENGTH) - max_new_tokens
    if limit < 1 or limit + max_new_tokens > block_size:
        raise ValueError(f"--max_prompt_len {limit} + --max_new_tokens {max_new_tokens} must fit in block_size "
                         f"{block_size}" + ("" if max_prompt_len else
                                            " (--max_prompt_len 0 = min(block_size, 1024) - --max_new_tokens)"))
    return limit


def fit_prompt(prompt_ids: List[int], response_len: int, max_len: int):
    """Left-truncate the prompt so prompt + response fits in max_len; None if it cannot (drop)."""
    if len(prompt_ids) + response_len <= max_len:
        return prompt_ids
    keep = max_len - response_len
    if keep < 1:
        return None
    return prompt_ids[-keep:]


class Stats(dict):
    """Counts of kept / truncated / dropped examples, for the log."""

    def __str__(self):
        return ", ".join(f"{k} {v}" for k, v in self.items())


def tokenize_sft(records, tok, max_len):
    """-> [(ids, loss_mask)], Stats. The loss mask covers completion / assistant tokens (+ end-of-text; tool
    calls included, tool results never: Tokenizer.encode_conversation with the row's tools);
    {"text"} rows train on every token, start with bos when the tokenizer adds one (Llama) and end with
    end-of-text; longer ones keep their first max_len
    tokens (the end-of-text only if it fits) instead of being dropped."""
    out, st = [], Stats(kept=0, truncated=0, dropped=0)
    for r in records:
        if "text" in r:
            ids = tok.encode_text(r["text"])      # [bos] + text + eos: bos where the tokenizer adds one
            st["truncated"] += len(ids) > max_len
            out.append((ids[:max_len], [1] * min(len(ids), max_len)))
            st["kept"] += 1
            continue
        if "messages" in r:
            ids, mask = _rendered(r, tok.encode_conversation, r["messages"], r.get("tools"))
            start = _final_span_start(mask)
        else:
            ids, mask = _rendered(r, tok.encode_prompt_response, r["prompt"], r["completion"])
            start = mask.index(1)
        if len(ids) > max_len:
            resp = len(ids) - start
            if resp > max_len - (1 if start > 0 else 0):
                st["dropped"] += 1
                continue
            ids, mask = ids[-max_len:], mask[-max_len:]
            st["truncated"] += 1
        out.append((ids, mask))
        st["kept"] += 1
    return out, st


def _rendered(r, encode, *args):
    """encode(*args), a row the chat template cannot write (Llama 3: two tool calls in one turn, a tool list
    with no user message to hold it; arguments too deeply nested for json.dumps) raised as a DataError naming the
    row (FILE:LINE)."""
    try:
        return encode(*args)
    except DataError:
        raise
    except ValueError as e:
        raise DataError(f"{r.get('_where', 'a row')}: {e}") from None
    except RecursionError:      # tool arguments or schemas the parser read near its depth limit, written deeper
        raise DataError(f"{r.get('_where', 'a row')}: JSON nested too deeply to render") from None


def pack_sft(examples, max_len):
    """Greedy packing in data order: [(ids, loss_mask)] (each at most max_len, as tokenize_sft leaves them)
    -> packed rows [(ids, loss_mask, lengths)], each the concatenation of consecutive examples while they
    fit in max_len (`lengths`: the examples' lengths, in order). Each example's first token carries no loss
    in its row: it is predicted by nothing of its own (unpacked, the shift drops it too), and must not be
    predicted from the previous example's last token."""
    rows, cur = [], None
    for ids, mask in examples:
        if len(ids) > max_len:
            raise ValueError(f"an example of {len(ids)} tokens is longer than the context ({max_len}); "
                             f"tokenize_sft applies the over-long rule first")
        if cur is None or len(cur[0]) + len(ids) > max_len:
            cur = ([], [], [])
            rows.append(cur)
        cur[0].extend(ids)
        cur[1].extend([0] + list(mask[1:]))
        cur[2].append(len(ids))
    return rows


def collate_packed(rows, pad_id):
    """Packed rows -> input_ids, attention_mask, loss_mask, position_ids, segment_ids, all (B, T),
    right-padded. Positions restart at 0 in each example; segment ids number the examples of a row 0, 1, ...
    and are -1 on padding (the model's doc_ids, see layers.document_attention)."""
    ids, attn, loss = collate_sft([(r[0], r[1]) for r in rows], pad_id)
    pos = pad_right([[p for n in r[2] for p in range(n)] for r in rows], 0, ids.shape[1])
    seg = pad_right([[k for k, n in enumerate(r[2]) for _ in range(n)] for r in rows], -1, ids.shape[1])
    return ids, attn, loss, pos, seg


def _final_span_start(mask):
    i = len(mask) - 1
    while i >= 0 and mask[i] == 0:
        i -= 1
    while i > 0 and mask[i - 1] == 1:
        i -= 1
    return max(i, 0)


def tokenize_pairs(records, tok, max_len):
    """Preference rows -> [dict(prompt, chosen, rejected, margin)] of id lists, Stats."""
    out, st = [], Stats(kept=0, truncated=0, dropped=0)
    for r in records:
        p = _rendered(r, tok.render_prompt, r["prompt"], r.get("tools"))
        (c, cm), (j, jm) = (_rendered(r, tok.encode_response_and_mask, r[k]) for k in ("chosen", "rejected"))
        fp = fit_prompt(p, max(len(c), len(j)), max_len)
        if fp is None:
            st["dropped"] += 1
            continue
        st["kept"] += 1
        st["truncated"] += len(fp) < len(p)
        masks = {f"{k}_mask": m for k, m in (("chosen", cm), ("rejected", jm)) if 0 in m}   # tool turns: context
        out.append({"prompt": fp, "chosen": c, "rejected": j, "margin": r.get("margin", 0.0), **masks})
    return out, st


def tokenize_unpaired(records, tok, max_len):
    """Unpaired rows -> [dict(prompt, completion, label)] of id lists, Stats."""
    return _tokenize_single(records, tok, max_len, lambda r: {"label": r["label"]})


def _tokenize_single(records, tok, max_len, fields):
    """One response a row -> [dict(prompt, completion, **fields(row))] of id lists, Stats (kept / prompt
    truncated / dropped when the response alone does not fit)."""
    out, st = [], Stats(kept=0, truncated=0, dropped=0)
    for r in records:
        p = _rendered(r, tok.render_prompt, r["prompt"], r.get("tools"))
        c = _rendered(r, tok.encode_response, r["completion"])
        fp = fit_prompt(p, len(c), max_len)
        if fp is None:
            st["dropped"] += 1
            continue
        st["kept"] += 1
        st["truncated"] += len(fp) < len(p)
        out.append({"prompt": fp, "completion": c, **fields(r)})
    return out, st


def tokenize_prompts(records, tok, max_prompt_len, tools=None):
    """Prompt rows -> [dict(prompt=ids, text=the prompt as given)], Stats (left-truncated to max_prompt_len).
    tools: the JSON schemas of the tools the prompts offer (the chat template renders them)."""
    out, st = [], Stats(kept=0, truncated=0)
    for r in records:
        p = _rendered(r, tok.render_prompt, r["prompt"], tools)
        if len(p) > max_prompt_len:
            p = p[-max_prompt_len:]
            st["truncated"] += 1
        st["kept"] += 1
        out.append({"prompt": p, "text": r["prompt"]})
    return out, st


# ---- padding ----------------------------------------------------------------------------------

def pad_right(seqs: Sequence[Sequence[int]], value: int, length: int = None) -> torch.Tensor:
    """(B, T) tensor, each row left-aligned and filled with `value` on the right."""
    T = length or max(len(s) for s in seqs)
    out = torch.full((len(seqs), T), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


def pad_left(seqs: Sequence[Sequence[int]], value: int, length: int = None) -> torch.Tensor:
    """(B, T) tensor, each row right-aligned and filled with `value` on the left."""
    T = length or max(len(s) for s in seqs)
    out = torch.full((len(seqs), T), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, T - len(s):] = torch.as_tensor(s, dtype=torch.long)
    return out


def collate_sft(examples, pad_id):
    """[(ids, loss_mask)] -> input_ids, attention_mask, loss_mask, all (B, T), right-padded."""
    ids = pad_right([e[0] for e in examples], pad_id)
    attn = pad_right([[1] * len(e[0]) for e in examples], 0)
    loss = pad_right([e[1] for e in examples], 0)
    return ids, attn, loss


def collate_pairs(pairs, pad_id):
    """Preference pairs -> one right-padded batch of 2B sequences, chosen rows first then rejected
    (one forward for both halves), with attention mask, response mask (B2, T) and margins (B,). A response with
    tool turns scores its assistant tokens only ("chosen_mask" / "rejected_mask", from tokenize_pairs)."""
    seqs, resp = [], []
    for key in ("chosen", "rejected"):
        for p in pairs:
            seqs.append(p["prompt"] + p[key])
            resp.append([0] * len(p["prompt"]) + p.get(f"{key}_mask", [1] * len(p[key])))
    ids = pad_right(seqs, pad_id)
    attn = pad_right([[1] * len(s) for s in seqs], 0)
    margin = torch.tensor([float(p.get("margin", 0.0)) for p in pairs])
    return ids, attn, pad_right(resp, 0), margin

# ---- listwise data: K scored completions per prompt ---------------------------------------------

def tokenize_listwise(records, tok, max_len):
    """Listwise rows -> [dict(prompt, completions, scores)] (ids; the prompt left-truncated so that it fits
    with the longest completion, else the row is dropped), Stats."""
    out, st = [], Stats(kept=0, truncated=0, dropped=0)
    for r in records:
        p = _rendered(r, tok.render_prompt, r["prompt"], r.get("tools"))
        comps, masks = zip(*(_rendered(r, tok.encode_response_and_mask, c) for c in r["completions"]))
        fp = fit_prompt(p, max(len(c) for c in comps), max_len)
        if fp is None:
            st["dropped"] += 1
            continue
        st["kept"] += 1
        st["truncated"] += len(fp) < len(p)
        tool = {"masks": list(masks)} if any(0 in m for m in masks) else {}       # tool turns: context
        out.append({"prompt": fp, "completions": list(comps), "scores": list(r["scores"]), **tool})
    return out, st


def collate_listwise(examples, pad_id):
    """Listwise examples -> one right-padded batch with a row per completion, prompt-major (all of prompt 0's
    completions, then prompt 1's, ...; K may differ per prompt): ids, attention mask, response mask (R, T),
    group (R,) = the row's prompt index in the batch, scores (R,)."""
    seqs, resp, group, scores = [], [], [], []
    for g, e in enumerate(examples):
        for c, s, m in zip(e["completions"], e["scores"], e.get("masks", [None] * len(e["completions"]))):
            seqs.append(e["prompt"] + c)
            resp.append([0] * len(e["prompt"]) + (m or [1] * len(c)))      # m: a response with tool turns
            group.append(g)
            scores.append(s)
    return (pad_right(seqs, pad_id), pad_right([[1] * len(x) for x in seqs], 0), pad_right(resp, 0),
            torch.tensor(group), torch.tensor(scores, dtype=torch.float64))


# ---- prompts for generation; the order of batches -----------------------------------------------

def collate_prompts(prompt_ids, pad_id):
    """Left-padded prompts for generation -> input_ids, attention_mask (B, Tp)."""
    return pad_left(prompt_ids, pad_id), pad_left([[1] * len(p) for p in prompt_ids], 0)


class Batches:
    """Shuffled, rank-sharded, resumable iteration, one optimizer step at a time.

    Each epoch is a fresh permutation from seed + epoch. An optimizer step takes the next
    `global_batch` = batch_size * grad_accum * world_size examples of it; rank r takes its contiguous
    share and splits it into grad_accum micro-batches. So the set of examples in a step does not depend
    on how it is split across ranks and micro-batches, and N ranks follow one process's trajectory.
    A tail shorter than a global batch is skipped. State = (epoch, position): saved for --resume.
    """

    def __init__(self, n, batch_size, grad_accum, rank=0, world_size=1, seed=0, shuffle=True):
        self.n, self.B, self.G, self.rank, self.W = n, batch_size, grad_accum, rank, world_size
        self.global_batch = batch_size * grad_accum * world_size
        if n < self.global_batch:
            raise ValueError(f"{n} examples are fewer than one global batch "
                             f"({batch_size} x {grad_accum} grad_accum x {world_size} ranks)")
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.pos, self._perm = 0, 0, None

    @property
    def steps_per_epoch(self):
        return self.n // self.global_batch

    def _permutation(self):
        if self._perm is None:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = torch.randperm(self.n, generator=g).tolist() if self.shuffle else list(range(self.n))
        return self._perm

    def next_step(self) -> List[List[int]]:
        """This rank's grad_accum micro-batches (lists of example indices) for the next optimizer step."""
        if self.pos + self.global_batch > self.n:
            self.epoch, self.pos, self._perm = self.epoch + 1, 0, None
        chunk = self._permutation()[self.pos:self.pos + self.global_batch]
        self.pos += self.global_batch
        mine = chunk[self.rank * self.B * self.G:(self.rank + 1) * self.B * self.G]
        return [mine[i * self.B:(i + 1) * self.B] for i in range(self.G)]

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, d):
        self.epoch, self.pos, self._perm = d["epoch"], d["pos"], None


class SFTBatches(Batches):
    """Batches of tokenized SFT examples drawn beside another loop (PPO-ptx's pre-training mix): each next_batch()
    is this rank's share of the next global batch, collated (collate_sft); resumable as Batches."""

    def __init__(self, examples, batch_size, pad_id, rank=0, world_size=1, seed=0):
        super().__init__(len(examples), batch_size, 1, rank, world_size, seed)
        self.examples, self.pad_id = examples, pad_id

    def next_batch(self):
        return collate_sft([self.examples[i] for i in self.next_step()[0]], self.pad_id)


# ---- scored single responses (DRO; NPO and D2O read the unpaired kind; the rows: below) ---------

def tokenize_scored(records, tok, max_len):
    """Scored rows -> [dict(prompt, completion, score, where)] of id lists, Stats (the over-long rule of pairs)."""
    return _tokenize_single(records, tok, max_len, lambda r: {"score": r["score"], "where": r.get("_where", "")})


# ---- Reading and validating the JSONL data kinds ------------------------------------------------------------
#
# | kind       | standard                                      | conversational (lists of {"role", "content"}) |
# |------------|-----------------------------------------------|-----------------------------------------------|
# | sft        | {"prompt", "completion"} or {"text"}          | {"messages"} or {"prompt", "completion"}      |
# | preference | {"prompt", "chosen", "rejected"} [+ "margin"] | same keys, lists of messages                  |
# | safety     | a preference row + "safer", "chosen_safe", "rejected_safe" (the cost model's labels) | same       |
# | unpaired   | {"prompt", "completion", "label": bool}       | same, messages                                |
# | prompts    | {"prompt": str}                               | {"prompt": [messages]}                        |
# | listwise   | {"prompt", "completions": [..], "scores": [..]} | same keys, each completion a message list |
#
# Tool turns (conversational rows, all kinds but prompts): an assistant message may carry "tool_calls" (OpenAI /
# transformers form, normalised to [{"type": "function", "function": {"name", "arguments": {...}}}]) answered in
# order by {"role": "tool", "content"} messages; an optional top-level "tools" list of JSON schemas is passed to the
# chat template (the row's "tools" key). The loss / scored mask covers assistant turns (calls included), never
# tool results. Checks: _messages, _tool_calls, _tools.
#
# Listwise rows rank K >= 2 completions of one prompt by score (higher = better; equal scores are ties; K may
# differ between rows).
#
# Safety labels (Safe RLHF's cost model, train_rm.py --objective cost): "safer" names the less harmful response of
# the pair ("chosen" or "rejected": which one is safer is a judgement of its own, independent of which one is more
# helpful) and "chosen_safe" / "rejected_safe" (true/false) say whether each response is harmless at all. A
# preference row may carry them (checked when present, unused by the reward model); the "safety" kind requires
# them. A pair whose safer response is labelled unsafe while the other is labelled safe contradicts itself; it is
# kept (PKU-SafeRLHF's annotators produced such rows; the cost model's loss weighs the two signals) and counted in
# one warning.
#
# The PKU-SafeRLHF layout is read as is, for the preference and safety kinds, row by row (a row with "response_0"):
#   {"prompt": str, "response_0": str, "response_1": str, "better_response_id": 0|1, "safer_response_id": 0|1,
#    "is_response_0_safe": bool, "is_response_1_safe": bool, ...}
# becomes a conversational pair: the prompt one user turn, each response one assistant turn (so the tokenizer's chat
# template renders them), chosen = response[better_response_id], and the safety labels carried over. Its other
# columns (sources, harm categories, severity levels, hashes) are accepted and ignored. A preference row needs
# better_response_id; a safety row needs safer_response_id and both is_response_*_safe (without
# better_response_id, response_0 fills the chosen slot: the cost model does not read which one is more helpful).
#
# Every line is validated before anything is built; the first bad line raises DataError with the message
# `FILE:LINE: what is wrong` (scripts print it and exit with status 1): invalid UTF-8 or JSON, JSON nested
# too deeply for the parser, a string holding a lone surrogate escape ("\ud800", which no tokenizer can
# encode), a missing or mistyped field. Blank lines are skipped. Suspicious but usable rows are counted and
# reported in ONE warning line per kind of problem (count + first FILE:LINE): a JSON object with a duplicate
# key (JSON parsers silently keep the last value), a preference pair whose chosen equals its rejected
# response (it carries no preference) and a listwise row that lists the same completion twice.
class DataError(ValueError):
    pass


KINDS = ("sft", "preference", "safety", "unpaired", "prompts", "listwise")


def _warn_rank0(msg: str):
    """Print `warning: ...` to stderr on rank 0 only (every rank reads the same files)."""
    from . import dist
    if dist.world().is_main:
        print(f"warning: {msg}", file=sys.stderr, flush=True)


class _Duplicates:
    """object_pairs_hook that builds the dict as json.loads would (the last value wins) and remembers
    the first key seen twice on the current line, at any depth."""

    def __init__(self):
        self.key = None

    def __call__(self, pairs):
        obj = {}
        for k, v in pairs:
            if k in obj and self.key is None:
                self.key = k
            obj[k] = v
        return obj


def read_jsonl(path: str, warn: Callable[[str], None] = None) -> List[tuple]:
    """[(line number, object)] of a JSONL file; DataError on invalid UTF-8, bad or too deeply nested JSON,
    non-objects, no rows. Lines with a duplicate key are reported through `warn` (one line for the file)."""
    rows, dup_count, dup_first = [], 0, None
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}:0: cannot open ({e.strerror})") from None
    with f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: invalid UTF-8 at byte {e.start}") from None
            if not line.strip():
                continue
            dup = _Duplicates()
            try:
                obj = json.loads(line, object_pairs_hook=dup)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise DataError(f"{path}:{n}: JSON nested too deeply to parse") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            if dup.key is not None:
                dup_count += 1
                dup_first = dup_first or f"{path}:{n} (key {dup.key!r})"
            rows.append((n, obj))
    if not rows:
        raise DataError(f"{path}:1: empty file (no JSON lines)")
    if dup_count:
        (warn or _warn_rank0)(f"{dup_count} line(s) of {path} repeat a JSON key (the last value is used), "
                              f"first at {dup_first}")
    return rows


def finite_number(x) -> bool:
    """A JSON number (not a bool) that is finite as a float: a 400-digit integer is not (float() overflows)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _text(obj, key, where):
    if key not in obj:
        raise DataError(f"{where}: missing field '{key}'")
    v = obj[key]
    if not isinstance(v, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {type(v).__name__}")
    if not v.strip():
        raise DataError(f"{where}: field '{key}' is empty")
    return _encodable(v, key, where)


def _encodable(v, key, where):
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:   # a lone surrogate escape such as "\ud800": valid JSON, not valid text
        raise DataError(f"{where}: field '{key}' holds a lone surrogate escape ({v[e.start]!r} at character "
                        f"{e.start}), which is not text") from None
    return v


TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")   # OpenAI's rule for a function name (plus "."): the templates
                                                  # write a name into JSON unescaped


def _messages(v, key, where, need_assistant=False, only_assistant=False, tool_names=None, tool_results=False):
    """A message list, checked: roles, contents, assistant `tool_calls` and `tool` results (each result answers
    a call of the assistant turn before it, as many results as calls). A call turn may close a trained list (SFT
    messages, a response: the model learns to call), never a prompt. only_assistant: a response, assistant
    messages (and with tool_results, the results of their calls between them: the kinds whose scored mask skips
    them), starting and ending with the assistant's. tool_names: the row's `tools`, which every call must name.
    Returns the messages normalised (calls as {"type": "function", "function": {...}})."""
    if not isinstance(v, list) or not v:
        raise DataError(f"{where}: field '{key}' must be a non-empty list of messages")
    out, pending, caller = [], 0, None
    for i, m in enumerate(v):
        at = f"{where}: {key}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{at} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{at}.role: {role!r} is not one of {', '.join(ROLES)}")
        if only_assistant and not (role == "assistant" or role == "tool" and tool_results and i > 0):
            hint = ", or a tool result after its call" if tool_results and i > 0 else ""
            raise DataError(f"{at}.role: must be 'assistant' (a response{hint}), got {role!r}")
        if m.get("tool_calls") is not None and role != "assistant":
            raise DataError(f"{at}: a {role} message with 'tool_calls' (only the assistant calls tools)")
        if role != "tool" and pending:
            raise DataError(f"{where}: {key}[{caller}] makes {pending} tool call(s) that get no 'tool' result "
                            f"before {key}[{i}] ({role})")
        if role == "tool":
            if not pending:
                raise DataError(f"{at}: a 'tool' result with no tool call to answer (each follows an assistant "
                                f"message's 'tool_calls', one result per call)")
            if not isinstance(m.get("content"), str):
                raise DataError(f"{at}: field 'content' must be a string (the tool's answer)"
                                if "content" in m else f"{at}: missing field 'content'")
            _encodable(m["content"], "content", at)        # a tool may answer "" (nothing to say)
            pending -= 1
            out.append({"role": "tool", "content": m["content"]})
        elif role == "assistant" and m.get("tool_calls") is not None:
            content = m.get("content")
            if content is not None and not isinstance(content, str):
                raise DataError(f"{at}: field 'content' must be a string or null, got {type(content).__name__}")
            _encodable(content or "", "content", at)       # text before the calls, or none
            calls = _tool_calls(m["tool_calls"], f"{at}.tool_calls", tool_names)
            pending, caller = len(calls), i
            out.append({"role": "assistant", "content": content or "", "tool_calls": calls})
        else:
            out.append({"role": role, "content": _text(m, "content", f"{at}")})
    if only_assistant and v[-1]["role"] != "assistant":
        raise DataError(f"{where}: field '{key}' ends with a tool result: a response ends with the assistant's turn")
    if pending and not (need_assistant or only_assistant):
        raise DataError(f"{where}: field '{key}' ends with {pending} tool call(s) that get no 'tool' result (a "
                        f"prompt gives the results of its calls)")
    if need_assistant and not any(m["role"] == "assistant" for m in v):
        raise DataError(f"{where}: field '{key}' has no assistant message (nothing to train on)")
    return out


def _tool_calls(calls, at, tool_names):
    """An assistant message's tool calls, OpenAI / transformers form [{"type": "function", "function": {"name",
    "arguments": {...}}}] (a bare {"name", "arguments"} is read too), normalised to the first form."""
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{at}: must be a non-empty list of calls [{{\"type\": \"function\", \"function\": "
                        f"{{\"name\": ..., \"arguments\": {{...}}}}}}]")
    out = []
    for j, c in enumerate(calls):
        if not isinstance(c, dict):
            raise DataError(f"{at}[{j}]: a call must be an object, got {type(c).__name__}")
        if c.get("type", "function") != "function":
            raise DataError(f"{at}[{j}].type: only \"function\" calls are rendered, got {c['type']!r}")
        f, fat = (c["function"], f"{at}[{j}].function") if "function" in c else (c, f"{at}[{j}]")
        if not isinstance(f, dict):
            raise DataError(f"{fat}: must be an object with 'name' and 'arguments'")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise DataError(f"{fat}.name: a call needs the tool's name (1 to 64 of A-Z a-z 0-9 _ . -), got "
                            f"{name!r}" if "name" in f else f"{fat}: missing field 'name' (the tool called)")
        if tool_names is not None and name not in tool_names:
            raise DataError(f"{fat}.name: {name!r} is not one of the row's tools ({', '.join(sorted(tool_names))})")
        if "arguments" not in f:
            raise DataError(f"{fat}: missing field 'arguments' (an object; {{}} for a call without any)")
        args = f["arguments"]
        if not isinstance(args, dict):
            hint = " (OpenAI's wire form writes a JSON string: decode it)" if isinstance(args, str) else ""
            raise DataError(f"{fat}.arguments: must be a JSON object, got {type(args).__name__}{hint}")
        out.append({"type": "function", "function": {"name": name, "arguments": args}})
    return out


def _tools(obj, where, conversational):
    """A row's optional `tools`: the JSON schemas of the tools its conversation may call, as transformers'
    get_json_schema writes them ({"type": "function", "function": {"name", ...}}; a bare {"name", ...} is read
    too). -> (the list or None, the set of names or None)."""
    if "tools" not in obj:
        return None, None
    tools = obj["tools"]
    if not conversational:
        raise DataError(f"{where}: field 'tools' needs a conversational row (message lists): the chat template "
                        f"renders the tool list")
    if not isinstance(tools, list) or not tools:
        raise DataError(f"{where}: field 'tools' must be a non-empty list of JSON schemas")
    names = set()
    for j, t in enumerate(tools):
        f = t.get("function", t) if isinstance(t, dict) else None
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise DataError(f"{where}: tools[{j}] must be a JSON schema {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": ..., \"parameters\": {{...}}}}}} with a name of 1 to 64 of "
                            f"A-Z a-z 0-9 _ . -, got {str(t)[:80]}")
        if name in names:
            raise DataError(f"{where}: tools[{j}]: two tools named {name!r}")
        params = f.get("parameters", {})
        props = params.get("properties", {}) if isinstance(params, dict) else None
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()) or \
                not isinstance(params.get("required", []), list) or not isinstance(f.get("description", ""), str):
            raise DataError(f"{where}: tools[{j}] ({name}): 'parameters' must be a JSON schema object "
                            f"{{\"type\": \"object\", \"properties\": {{arg: {{\"type\": ...}}}}, "
                            f"\"required\": [...]}} and 'description' a string, got {str(f)[:80]}")
        names.add(name)
    return tools, names


def _prompt_and(obj, where, keys, tool_results=False):
    """Validate prompt + response fields: all strings, or prompt messages + assistant-message responses (with
    tool_results, tool turns between them too)."""
    if "prompt" not in obj:
        raise DataError(f"{where}: missing field 'prompt'")
    tools, names = _tools(obj, where, isinstance(obj["prompt"], list))
    if isinstance(obj["prompt"], list):
        out = {"prompt": _messages(obj["prompt"], "prompt", where, tool_names=names)}
        for k in keys:
            if k not in obj:
                raise DataError(f"{where}: missing field '{k}'")
            out[k] = _messages(obj[k], k, where, only_assistant=True, tool_names=names, tool_results=tool_results)
        return dict(out, tools=tools) if tools else out
    out = {"prompt": _text(obj, "prompt", where)}
    for k in keys:
        if isinstance(obj.get(k), list):
            raise DataError(f"{where}: field '{k}' is a message list but 'prompt' is a string; use one format")
        out[k] = _text(obj, k, where)
    return out


def validate(obj: dict, kind: str, where: str) -> dict:
    """Check one record of the given kind; returns the normalised record (only the known fields)."""
    if kind == "sft":
        forms = [k for k in ("text", "messages", "prompt") if k in obj]
        if len(forms) != 1:
            raise DataError(f"{where}: an SFT row needs exactly one of 'text', 'messages' or "
                            f"'prompt'+'completion' (found {forms or 'none'})")
        if forms[0] == "text":
            return {"text": _text(obj, "text", where)}
        if forms[0] == "messages":
            tools, names = _tools(obj, where, True)
            out = {"messages": _messages(obj["messages"], "messages", where, need_assistant=True, tool_names=names)}
            return dict(out, tools=tools) if tools else out
        return _prompt_and(obj, where, ["completion"])
    if kind in ("preference", "safety"):
        if PKU_KEY in obj:
            return validate_pku(obj, kind, where)
        out = _prompt_and(obj, where, ["chosen", "rejected"], tool_results=True)
        if "margin" in obj:
            m = obj["margin"]
            if not finite_number(m):
                raise DataError(f"{where}: field 'margin' must be a finite number, got {m!r}")
            out["margin"] = float(m)
        return _safety_labels(obj, out, kind, where)
    if kind == "listwise":
        return validate_listwise(obj, where)
    if kind == "unpaired":
        out = _prompt_and(obj, where, ["completion"])
        if not isinstance(obj.get("label"), bool):
            raise DataError(f"{where}: field 'label' must be true or false, got {obj.get('label')!r}"
                            if "label" in obj else f"{where}: missing field 'label'")
        out["label"] = obj["label"]
        return out
    if kind == "prompts":
        if "prompt" not in obj:
            raise DataError(f"{where}: missing field 'prompt'")
        if "tools" in obj:
            raise DataError(f"{where}: field 'tools' in a prompts row: the tools a rollout may call are the "
                            f"script's --tools (its results come from running them)")
        if isinstance(obj["prompt"], list):
            return {"prompt": _messages(obj["prompt"], "prompt", where)}
        return {"prompt": _text(obj, "prompt", where)}
    raise ValueError(f"unknown data kind {kind!r} (one of {KINDS})")


SAFER = ("chosen", "rejected")


def _safety_labels(obj, out, kind, where):
    """Copy and check a preference row's safety labels (see the table's notes): required for the safety kind,
    checked when present otherwise."""
    hint = ("the cost model needs 'safer' (\"chosen\" or \"rejected\") and 'chosen_safe', 'rejected_safe' "
            "(true/false); the built-in task has them when generated with python -m nano_rlhf.tasks.synthetic --harm")
    if "safer" in obj or kind == "safety":
        if "safer" not in obj:
            raise DataError(f"{where}: missing field 'safer' ({hint})")
        if obj["safer"] not in SAFER:
            raise DataError(f"{where}: field 'safer' must be \"chosen\" or \"rejected\", got {obj['safer']!r}")
        out["safer"] = obj["safer"]
    for k in ("chosen_safe", "rejected_safe"):
        if k in obj or kind == "safety":
            if k not in obj:
                raise DataError(f"{where}: missing field '{k}' ({hint})")
            if not isinstance(obj[k], bool):
                raise DataError(f"{where}: field '{k}' must be true or false, got {obj[k]!r}")
            out[k] = obj[k]
    return out


PKU_KEY = "response_0"           # the field that marks a row of the PKU-SafeRLHF layout


def _response_id(obj, key, where):
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or v not in (0, 1):
        raise DataError(f"{where}: field '{key}' must be 0 or 1, got {v!r}")
    return v


def validate_pku(obj: dict, kind: str, where: str) -> dict:
    """One row of the PKU-SafeRLHF layout -> our conversational preference record (see the table's notes)."""
    if "chosen" in obj or "rejected" in obj:
        raise DataError(f"{where}: fields 'chosen'/'rejected' and '{PKU_KEY}' are both given: a row is in our "
                        "preference layout or in PKU-SafeRLHF's, not both")
    prompt = [{"role": "user", "content": _text(obj, "prompt", where)}]
    responses = [[{"role": "assistant", "content": _text(obj, f"response_{i}", where)}] for i in (0, 1)]
    needed = ["better_response_id"] if kind == "preference" else \
        ["safer_response_id", "is_response_0_safe", "is_response_1_safe"]
    for k in needed:
        if k not in obj:
            raise DataError(f"{where}: missing field '{k}' (a PKU-SafeRLHF row for the "
                            f"{'reward' if kind == 'preference' else 'cost'} model)")
    better = _response_id(obj, "better_response_id", where) if "better_response_id" in obj else 0
    out = {"prompt": prompt, "chosen": responses[better], "rejected": responses[1 - better]}
    if "safer_response_id" in obj:
        out["safer"] = SAFER[_response_id(obj, "safer_response_id", where) != better]
    for i in (0, 1):
        k = f"is_response_{i}_safe"
        if k in obj:
            if not isinstance(obj[k], bool):
                raise DataError(f"{where}: field '{k}' must be true or false, got {obj[k]!r}")
            out["chosen_safe" if i == better else "rejected_safe"] = obj[k]
    return out


def contradicts(rec: dict) -> bool:
    """A safety-labelled pair whose safer response is labelled unsafe while the other is labelled safe."""
    other = SAFER[rec["safer"] == "chosen"]
    return not rec[f"{rec['safer']}_safe"] and rec[f"{other}_safe"]


def load_records(path: str, kind: str, warn: Callable[[str], None] = None) -> List[dict]:
    """Read and validate a whole file; each record also carries its origin in '_where' (FILE:LINE).
    Usable-but-suspicious rows go to `warn` (default: a `warning:` line on stderr, rank 0), one line each."""
    out, ties, contradictions = [], [], []
    for n, obj in read_jsonl(path, warn):
        rec = validate(obj, kind, f"{path}:{n}")
        rec["_where"] = f"{path}:{n}"
        if kind in ("preference", "safety") and rec["chosen"] == rec["rejected"]:
            ties.append(rec["_where"])
        if kind == "safety" and contradicts(rec):
            contradictions.append(rec["_where"])
        out.append(rec)
        if kind == "listwise" and len({json.dumps(c) for c in rec["completions"]}) < len(rec["completions"]):
            ties.append(rec["_where"])
    if ties and kind == "listwise":
        (warn or _warn_rank0)(f"{len(ties)} listwise row(s) in {path} list the same completion twice (kept), "
                              f"first at {ties[0]}")
    elif ties:
        (warn or _warn_rank0)(f"{len(ties)} preference pair(s) in {path} have chosen == rejected (no preference "
                              f"to learn; kept), first at {ties[0]}")
    if contradictions:
        (warn or _warn_rank0)(f"{len(contradictions)} pair(s) in {path} name as safer a response labelled unsafe while "
                              f"the other is labelled safe (kept), first at {contradictions[0]}")
    return out


def split_off(records, fraction, seed):
    """Deterministically split records into (train, held-out) with `fraction` held out (at least one)."""
    import random
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n = max(1, int(len(records) * fraction))
    return [records[i] for i in order[n:]], [records[i] for i in order[:n]]


def load_train_eval(kind: str, *, data: str, eval_data: str, eval_fraction: float, seed: int):
    """(train records, eval records): --data and --eval_data, or, without --eval_data, a deterministic
    --eval_fraction of --data held out (at least one row). DataError when nothing is left to train on."""
    records = load_records(data, kind)
    if eval_data:
        return records, load_records(eval_data, kind)
    train, held_out = split_off(records, eval_fraction, seed)
    if not train:
        raise DataError(f"--eval_fraction {eval_fraction} holds out all {len(records)} row(s) of {data}, leaving "
                        f"none to train on; pass --eval_data or more rows")
    return train, held_out


# ---- listwise rows: K scored completions per prompt ---------------------------------------------

def validate_listwise(obj: dict, where: str) -> dict:
    """One listwise row: a prompt, K >= 2 non-empty completions (strings, or assistant-message lists when the
    prompt is a message list, as for pairs) and K finite scores (higher = better; equal scores are ties)."""
    if "prompt" not in obj:
        raise DataError(f"{where}: missing field 'prompt'")
    chat = isinstance(obj["prompt"], list)
    tools, names = _tools(obj, where, chat)
    prompt = _messages(obj["prompt"], "prompt", where, tool_names=names) if chat else _text(obj, "prompt", where)
    for k in ("completions", "scores"):
        if k not in obj:
            raise DataError(f"{where}: missing field '{k}'")
        if not isinstance(obj[k], list):
            raise DataError(f"{where}: field '{k}' must be a list, got {type(obj[k]).__name__}")
    comps, scores = obj["completions"], obj["scores"]
    if len(comps) < 2:
        raise DataError(f"{where}: field 'completions' needs at least two responses to rank, got {len(comps)}")
    if len(scores) != len(comps):
        raise DataError(f"{where}: field 'scores' has {len(scores)} value(s) but 'completions' has {len(comps)}")
    out = []
    for i, c in enumerate(comps):
        key = f"completions[{i}]"
        if chat:
            out.append(_messages(c, key, where, only_assistant=True, tool_names=names, tool_results=True))
        elif isinstance(c, list):
            raise DataError(f"{where}: field '{key}' is a message list but 'prompt' is a string; use one format")
        else:
            out.append(_text({key: c}, key, where))
    for i, s in enumerate(scores):
        if not finite_number(s):
            raise DataError(f"{where}: field 'scores[{i}]' must be a finite number, got {s!r}")
    row = {"prompt": prompt, "completions": out, "scores": [float(s) for s in scores]}
    return dict(row, tools=tools) if tools else row


def is_listwise_file(path: str) -> bool:
    """Does the file's first row look listwise (has 'completions')? The whole file is then validated as
    listwise, so a later row of another kind is a FILE:LINE error. False when unreadable: the loader reports it."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    obj = json.loads(raw.decode("utf-8"))
                    return isinstance(obj, dict) and "completions" in obj
    except (OSError, ValueError, RecursionError):
        pass
    return False


def listwise_to_pairs(records, mode: str):
    """Listwise rows -> preference records, for the pairwise losses. mode "all": every ordered pair (i, j)
    with s_i > s_j (ties carry no preference: skipped), K(K−1)/2 pairs for distinct scores; "best_worst":
    the first best-scored completion against the first worst-scored one. A row whose scores all tie gives
    no pair. Returns (records, number of rows that gave none)."""
    if mode not in ("all", "best_worst"):
        raise ValueError(f"unknown listwise pair mode {mode!r} (all or best_worst)")
    out, empty = [], 0
    for r in records:
        c, s = r["completions"], r["scores"]
        if mode == "all":
            pairs = [(i, j) for i in range(len(c)) for j in range(len(c)) if s[i] > s[j]]
        else:
            best, worst = s.index(max(s)), s.index(min(s))
            pairs = [(best, worst)] if s[best] > s[worst] else []
        empty += not pairs
        tools = {"tools": r["tools"]} if r.get("tools") else {}
        out += [{"prompt": r["prompt"], "chosen": c[i], "rejected": c[j], "_where": r.get("_where", ""), **tools}
                for i, j in pairs]
    return out, empty


# ---- scored single responses (DRO; NPO and D2O read the unpaired kind) ---------------------------
#
# | scored | {"prompt", "completion", "score": number} or {"prompt", "completion", "label": bool} | same, messages |
#
# One response per row with a scalar reward: "score" (any finite number), or "label" read as +1 (true) / −1
# (false), so a KTO file is a scored file too. A row with both is refused: which one is meant is not knowable.

def validate_scored(obj: dict, where: str) -> dict:
    """One scored row -> {"prompt", "completion", "score": float}; DataError `FILE:LINE: field ...` otherwise."""
    out = _prompt_and(obj, where, ["completion"])
    if "score" in obj and "label" in obj:
        raise DataError(f"{where}: fields 'score' and 'label' are both given; a scored row has one of them")
    if "score" in obj:
        s = obj["score"]
        if not finite_number(s):
            raise DataError(f"{where}: field 'score' must be a finite number, got {s!r}")
        out["score"] = float(s)
    elif "label" in obj:
        if not isinstance(obj["label"], bool):
            raise DataError(f"{where}: field 'label' must be true or false, got {obj['label']!r}")
        out["score"] = 1.0 if obj["label"] else -1.0
    else:
        raise DataError(f"{where}: missing field 'score' (a number) or 'label' (true/false)")
    return out


def load_scored(path: str, warn: Callable[[str], None] = None) -> List[dict]:
    """Read and validate a whole scored file (each record with its '_where', FILE:LINE)."""
    out = []
    for n, obj in read_jsonl(path, warn):
        rec = validate_scored(obj, f"{path}:{n}")
        rec["_where"] = f"{path}:{n}"
        out.append(rec)
    return out


def load_prompts(prompts, eval_prompts, eval_fraction, seed):
    """Training and evaluation prompt records (--prompts, --eval_prompts; the built-in task's files for those
    not given). With prompts and no eval_prompts, eval_fraction of the prompts is held out: evaluating a user's
    task on the built-in task's prompts would measure nothing."""
    if not prompts:
        return (load_records(default_data("prompts"), "prompts"),
                load_records(eval_prompts or default_data("prompts", "eval"), "prompts"))
    records = load_records(prompts, "prompts")
    if eval_prompts:
        return records, load_records(eval_prompts, "prompts")
    if len(records) < 2:
        raise ValueError(f"{prompts}: {len(records)} prompt(s); need at least 2 to hold some out "
                         "(or --eval_prompts)")
    return split_off(records, eval_fraction, seed)


# ---- The built-in task's default files: each data kind's, written on first use ------------------------------
#
#     from nano_rlhf.data import default_data
#     default_data("preference")            # -> "data/preference.jsonl" (data/ generated with seed 0 if missing)
#     default_data("preference", "eval")    # -> "data/preference_eval.jsonl"
#
# Scripts and package modules ask here for their default data and ask nano_rlhf/reward.py for the gold reward
# (`builtin_gold`, `load_reward("gold")`); only these two modules name the task itself (nano_rlhf/tasks/synthetic.py).
# The directory is $NANO_RLHF_DATA, else data/.
BUILTIN_DIR = os.environ.get("NANO_RLHF_DATA", "data")

# data kind -> (train file, eval file); no eval file: callers split --eval_fraction off the train file
# ("safety": the preference files, which carry safety labels when the task was generated with --harm)
FILES = {"sft": ("sft.jsonl", "sft_eval.jsonl"), "preference": ("preference.jsonl", "preference_eval.jsonl"),
         "safety": ("preference.jsonl", "preference_eval.jsonl"),
         "listwise": ("listwise.jsonl", "listwise_eval.jsonl"), "unpaired": ("unpaired.jsonl", None),
         "scored": (synthetic.SCORED_FILE, None), "prompts": ("prompts.jsonl", "eval_prompts.jsonl")}


def default_data(kind: str, split: str = "train"):
    """The built-in file of a data kind (a key of FILES) and split ("train" or "eval"), generated if missing;
    None for an eval split the task does not have. Collective: call it on every rank."""
    if kind not in FILES or split not in ("train", "eval"):
        raise ValueError(f"no built-in {split} data of kind {kind!r}; kinds: {', '.join(FILES)}")
    name = FILES[kind][split == "eval"]
    return builtin_file(name) if name else None


def default_path(kind: str, split: str = "train"):
    """Where default_data(kind, split) is, without generating anything (a run's record of its inputs)."""
    name = FILES[kind][split == "eval"]
    return os.path.join(BUILTIN_DIR, name) if name else None


def builtin_file(name: str) -> str:
    """Path of a built-in task file (data/sft.jsonl, ...), generating data/ with seed 0 on first use, and
    adding a file that a data/ written before it existed lacks (listwise, scored) at that directory's seed."""
    # Only rank 0 looks and writes; then EVERY rank meets at the barrier. If each rank decided by itself
    # whether to wait, a rank starting after rank 0 wrote task.json would skip a barrier the others are in,
    # and every later collective would pair with the wrong call (a hang). Callers call this on all ranks.
    # Two runs on one machine (or one filesystem) are serialised by a file lock in ensure_dataset.
    path = os.path.join(BUILTIN_DIR, name)
    if dist.world().is_main:
        if not os.path.isfile(os.path.join(BUILTIN_DIR, "task.json")):     # written last
            synthetic.ensure_dataset(BUILTIN_DIR, seed=0, note=dist.print0)
        if name in _ADDED_LATER and not os.path.isfile(path):
            with synthetic.generation_lock(BUILTIN_DIR):
                if not os.path.isfile(path):
                    _ADDED_LATER[name](_task())
    dist.barrier()                                                   # a no-op in a single process
    return path


def _task():
    """The directory's task.json: its seed, and "harm" when it was generated with --harm."""
    with open(os.path.join(BUILTIN_DIR, "task.json")) as f:
        return json.load(f)


def _add_listwise(task):
    seed = task.get("seed", 0)
    dist.print0(f"writing the built-in listwise files into {BUILTIN_DIR}/ (seed {seed})")
    synthetic.write_listwise(BUILTIN_DIR, seed, harm="harm" in task)


def _add_scored(task):
    """As write_dataset would have written it: as many rows as unpaired.jsonl, at the directory's seed (and harm)."""
    with open(os.path.join(BUILTIN_DIR, "unpaired.jsonl"), "rb") as f:
        synthetic.write_scored(BUILTIN_DIR, seed=task.get("seed", 0), n=sum(1 for _ in f), harm="harm" in task)


# files added to the task after data/ directories existed: written alone (every other file stays as it is)
_ADDED_LATER = {"listwise.jsonl": _add_listwise, "listwise_eval.jsonl": _add_listwise,
                synthetic.SCORED_FILE: _add_scored}
