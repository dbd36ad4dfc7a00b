"""JSONL data: read and validate the data kinds, each row checked before anything is built (data.py
tokenizes, packs and batches what comes out of here).

| kind       | standard                                      | conversational (lists of {"role", "content"}) |
|------------|-----------------------------------------------|-----------------------------------------------|
| sft        | {"prompt", "completion"} or {"text"}          | {"messages"} or {"prompt", "completion"}      |
| preference | {"prompt", "chosen", "rejected"} [+ "margin"] | same keys, lists of messages                  |
| unpaired   | {"prompt", "completion", "label": bool}       | same, messages                                |
| prompts    | {"prompt": str}                               | {"prompt": [messages]}                        |
| listwise   | {"prompt", "completions": [..], "scores": [..]} | same keys, each completion a message list |

Listwise rows rank K >= 2 completions of one prompt by score (higher = better; equal scores are ties; K may
differ between rows).

Every line is validated before anything is built; the first bad line raises DataError with the message
`FILE:LINE: what is wrong` (scripts print it and exit with status 1): invalid UTF-8 or JSON, JSON nested
too deeply for the parser, a string holding a lone surrogate escape ("\ud800", which no tokenizer can
encode), a missing or mistyped field. Blank lines are skipped. Suspicious but usable rows are counted and
reported in ONE warning line per kind of problem (count + first FILE:LINE): a JSON object with a duplicate
key (JSON parsers silently keep the last value), a preference pair whose chosen equals its rejected
response (it carries no preference) and a listwise row that lists the same completion twice.
"""
import json
import math
import sys
from typing import Callable, List

from .tokenizer import ROLES


class DataError(ValueError):
    pass


KINDS = ("sft", "preference", "unpaired", "prompts", "listwise")


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
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:   # a lone surrogate escape such as "\ud800": valid JSON, not valid text
        raise DataError(f"{where}: field '{key}' holds a lone surrogate escape ({v[e.start]!r} at character "
                        f"{e.start}), which is not text") from None
    return v


def _messages(v, key, where, need_assistant=False, only_assistant=False):
    if not isinstance(v, list) or not v:
        raise DataError(f"{where}: field '{key}' must be a non-empty list of messages")
    for i, m in enumerate(v):
        at = f"{where}: {key}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{at} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{at}.role: {role!r} is not one of {', '.join(ROLES)}")
        _text(m, "content", f"{at}")
        if only_assistant and role != "assistant":
            raise DataError(f"{at}.role: must be 'assistant' (a response), got {role!r}")
    if need_assistant and not any(m["role"] == "assistant" for m in v):
        raise DataError(f"{where}: field '{key}' has no assistant message (nothing to train on)")
    return v


def _prompt_and(obj, where, keys):
    """Validate prompt + response fields: all strings, or prompt messages + assistant-message responses."""
    if "prompt" not in obj:
        raise DataError(f"{where}: missing field 'prompt'")
    if isinstance(obj["prompt"], list):
        out = {"prompt": _messages(obj["prompt"], "prompt", where)}
        for k in keys:
            if k not in obj:
                raise DataError(f"{where}: missing field '{k}'")
            out[k] = _messages(obj[k], k, where, only_assistant=True)
        return out
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
            return {"messages": _messages(obj["messages"], "messages", where, need_assistant=True)}
        return _prompt_and(obj, where, ["completion"])
    if kind == "preference":
        out = _prompt_and(obj, where, ["chosen", "rejected"])
        if "margin" in obj:
            m = obj["margin"]
            if not finite_number(m):
                raise DataError(f"{where}: field 'margin' must be a finite number, got {m!r}")
            out["margin"] = float(m)
        return out
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
        if isinstance(obj["prompt"], list):
            return {"prompt": _messages(obj["prompt"], "prompt", where)}
        return {"prompt": _text(obj, "prompt", where)}
    raise ValueError(f"unknown data kind {kind!r} (one of {KINDS})")


def load_records(path: str, kind: str, warn: Callable[[str], None] = None) -> List[dict]:
    """Read and validate a whole file; each record also carries its origin in '_where' (FILE:LINE).
    Usable-but-suspicious rows go to `warn` (default: a `warning:` line on stderr, rank 0), one line each."""
    out, ties = [], []
    for n, obj in read_jsonl(path, warn):
        rec = validate(obj, kind, f"{path}:{n}")
        rec["_where"] = f"{path}:{n}"
        if kind == "preference" and rec["chosen"] == rec["rejected"]:
            ties.append(rec["_where"])
        out.append(rec)
        if kind == "listwise" and len({json.dumps(c) for c in rec["completions"]}) < len(rec["completions"]):
            ties.append(rec["_where"])
    if ties and kind == "listwise":
        (warn or _warn_rank0)(f"{len(ties)} listwise row(s) in {path} list the same completion twice (kept), "
                              f"first at {ties[0]}")
    elif ties:
        (warn or _warn_rank0)(f"{len(ties)} preference pair(s) in {path} have chosen == rejected (no preference "
                              f"to learn; kept), first at {ties[0]}")
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
    prompt = _messages(obj["prompt"], "prompt", where) if chat else _text(obj, "prompt", where)
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
            out.append(_messages(c, key, where, only_assistant=True))
        elif isinstance(c, list):
            raise DataError(f"{where}: field '{key}' is a message list but 'prompt' is a string; use one format")
        else:
            out.append(_text({key: c}, key, where))
    for i, s in enumerate(scores):
        if not finite_number(s):
            raise DataError(f"{where}: field 'scores[{i}]' must be a finite number, got {s!r}")
    return {"prompt": prompt, "completions": out, "scores": [float(s) for s in scores]}


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
        out += [{"prompt": r["prompt"], "chosen": c[i], "rejected": c[j], "_where": r.get("_where", "")}
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
