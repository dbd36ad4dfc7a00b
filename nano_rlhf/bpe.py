"""The tokenizers-library side of tokenizer.py: training a byte-level BPE (GPT-2 style) on texts, reading a
tokenizer.json, and the fingerprint of what decides a tokenizer's ids (tokenizer.mismatch compares two by it).
tokenizer.py wraps the result with special tokens and chat templates.
"""
import hashlib
import json
import re

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

# BPE training cost grows with the square of a pre-tokenized word's length: a 10-MB single-word line
# never finishes. So the trainer sees at most TRAIN_MAX_CHARS of each text, with runs of non-space (or
# of space) cut into pieces of at most TRAIN_MAX_WORD characters.
TRAIN_MAX_CHARS = 100_000
TRAIN_MAX_WORD = 256
_LONG_RUN = re.compile(r"\S{%d,}|\s{%d,}" % (TRAIN_MAX_WORD + 1, TRAIN_MAX_WORD + 1))


def _for_training(texts):
    """What the BPE trainer sees of `texts`: each capped and its over-long runs split (see TRAIN_MAX_*)."""
    for t in texts:
        t, start = t[:TRAIN_MAX_CHARS], 0
        for m in _LONG_RUN.finditer(t):
            if m.start() > start:
                yield t[start:m.start()]
            for i in range(m.start(), m.end(), TRAIN_MAX_WORD):
                yield t[i:min(i + TRAIN_MAX_WORD, m.end())]
            start = m.end()
        if start < len(t):
            yield t[start:] if start else t


def train_bpe(texts, vocab_size, min_frequency, special_tokens):
    """A byte-level BPE trained on `texts` (as _for_training cuts them), `special_tokens` first in the vocabulary."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_for_training(texts), trainer)
    return tk


def _read(path):
    try:
        return HFTokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception with a long message
        raise ValueError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from None


def fingerprint(tk: HFTokenizer) -> str:
    """sha256 of what decides the ids of a text: the tokenizer model (its type, vocabulary, merges and settings)
    and the added tokens (id, content). Taken from the tokenizers library's own serialisation of the loaded
    tokenizer, so two files that differ only in layout (another library version's field order or defaults,
    merges stored as "a b" or ["a", "b"]) compare equal; comparing vocabulary sizes only would take another
    model's tokenizer of the same size."""
    d = json.loads(tk.to_str())
    model = dict(d.get("model") or {})
    if isinstance(model.get("merges"), list):
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]]
    added = sorted((t.get("id"), t.get("content")) for t in d.get("added_tokens") or [])
    text = json.dumps({"model": model, "added_tokens": added}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
