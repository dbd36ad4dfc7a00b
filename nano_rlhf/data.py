"""Tokenize the data kinds, fit them to the training length, pack and pad them into batches. The JSONL rows
come from jsonl.py (reading and validating; its names are re-exported here).

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
from typing import List, Sequence

import torch

# the readers and validators live in jsonl.py; the names other files import from here stay importable from here
from .jsonl import (KINDS, DataError, finite_number, is_listwise_file, listwise_to_pairs,  # noqa: F401
                    load_records, load_scored, load_train_eval, read_jsonl, split_off, validate, validate_listwise,
                    validate_scored)


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
    """-> [(ids, loss_mask)], Stats. The loss mask covers completion / assistant tokens (+ end-of-text);
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
            ids, mask = tok.encode_conversation(r["messages"])
            start = _final_span_start(mask)
        else:
            ids, mask = tok.encode_prompt_response(r["prompt"], r["completion"])
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
        p = tok.render_prompt(r["prompt"])
        c, j = tok.encode_response(r["chosen"]), tok.encode_response(r["rejected"])
        fp = fit_prompt(p, max(len(c), len(j)), max_len)
        if fp is None:
            st["dropped"] += 1
            continue
        st["kept"] += 1
        st["truncated"] += len(fp) < len(p)
        out.append({"prompt": fp, "chosen": c, "rejected": j, "margin": r.get("margin", 0.0)})
    return out, st


def tokenize_unpaired(records, tok, max_len):
    """Unpaired rows -> [dict(prompt, completion, label)] of id lists, Stats."""
    return _tokenize_single(records, tok, max_len, lambda r: {"label": r["label"]})


def _tokenize_single(records, tok, max_len, fields):
    """One response a row -> [dict(prompt, completion, **fields(row))] of id lists, Stats (kept / prompt
    truncated / dropped when the response alone does not fit)."""
    out, st = [], Stats(kept=0, truncated=0, dropped=0)
    for r in records:
        p, c = tok.render_prompt(r["prompt"]), tok.encode_response(r["completion"])
        fp = fit_prompt(p, len(c), max_len)
        if fp is None:
            st["dropped"] += 1
            continue
        st["kept"] += 1
        st["truncated"] += len(fp) < len(p)
        out.append({"prompt": fp, "completion": c, **fields(r)})
    return out, st


def tokenize_prompts(records, tok, max_prompt_len):
    """Prompt rows -> [dict(prompt=ids, text=the prompt as given)], Stats (left-truncated to max_prompt_len)."""
    out, st = [], Stats(kept=0, truncated=0)
    for r in records:
        p = tok.render_prompt(r["prompt"])
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
    (one forward for both halves), with attention mask, response mask (B2, T) and margins (B,)."""
    seqs, resp = [], []
    for key in ("chosen", "rejected"):
        for p in pairs:
            seqs.append(p["prompt"] + p[key])
            resp.append([0] * len(p["prompt"]) + [1] * len(p[key]))
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
        p = tok.render_prompt(r["prompt"])
        comps = [tok.encode_response(c) for c in r["completions"]]
        fp = fit_prompt(p, max(len(c) for c in comps), max_len)
        if fp is None:
            st["dropped"] += 1
            continue
        st["kept"] += 1
        st["truncated"] += len(fp) < len(p)
        out.append({"prompt": fp, "completions": comps, "scores": list(r["scores"])})
    return out, st


def collate_listwise(examples, pad_id):
    """Listwise examples -> one right-padded batch with a row per completion, prompt-major (all of prompt 0's
    completions, then prompt 1's, ...; K may differ per prompt): ids, attention mask, response mask (R, T),
    group (R,) = the row's prompt index in the batch, scores (R,)."""
    seqs, resp, group, scores = [], [], [], []
    for g, e in enumerate(examples):
        for c, s in zip(e["completions"], e["scores"]):
            seqs.append(e["prompt"] + c)
            resp.append([0] * len(e["prompt"]) + [1] * len(c))
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


# ---- scored single responses (DRO; NPO and D2O read the unpaired kind; the rows: jsonl.py) ----------

def tokenize_scored(records, tok, max_len):
    """Scored rows -> [dict(prompt, completion, score, where)] of id lists, Stats (the over-long rule of pairs)."""
    return _tokenize_single(records, tok, max_len, lambda r: {"score": r["score"], "where": r.get("_where", "")})
