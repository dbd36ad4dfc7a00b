"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer` with the one chat template nano_rlhf uses.

Special tokens. End-of-text closes every response (and every assistant turn) and is what generation
stops on. Pad is a *different* id, used only to fill batches and always masked: if pad were the
end-of-text id, masking pads would also mask the real end-of-text and the model would never learn to
stop (huggingface/trl#1623). A tokenizer trained here has `<|endoftext|>` = 0 and `<|pad|>` = 1. A
loaded tokenizer.json without a pad token (GPT-2's) gets pad id = vocabulary size, an id outside the
vocabulary that the model replaces before its embedding lookup, so no embedding is resized.

Chat template (conversational data). Each message is rendered as

    system:     "System: {content}\\n"
    user:       "User: {content}\\n"
    assistant:  "Assistant:" + " {content}" + <|endoftext|>

Only " {content}" + <|endoftext|> of assistant turns carries loss; a prompt for generation ends with
"Assistant:" and the model continues with " {content}<|endoftext|>". The template is plain text, so it
works with any tokenizer.json, GPT-2's included.

Seam rule. Prompt and response are tokenized *separately* and their ids concatenated; the joined string
is never re-tokenized, so a BPE merge can never straddle the boundary and shift the loss mask (TRL#1679).
"""
import json
import os
from typing import List, Sequence, Tuple, Union

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")
ROLES = ("system", "user", "assistant")
ROLE_HEADER = {"system": "System: ", "user": "User: "}
ASSISTANT_HEADER = "Assistant:"

Messages = List[dict]
Text = Union[str, Messages]


class Tokenizer:
    def __init__(self, tk: HFTokenizer, eos_token: str = None, pad_token: str = None):
        self.tk = tk
        vocab = tk.get_vocab(with_added_tokens=True)
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        eos_token = eos_token or next((n for n in EOS_NAMES if n in vocab), None)
        if eos_token is None or eos_token not in vocab:
            raise ValueError(f"no end-of-text token {eos_token!r} in the tokenizer" if eos_token else
                             f"no end-of-text token found (tried {EOS_NAMES}); name it with --eos_token")
        self.eos_token, self.eos_id = eos_token, vocab[eos_token]
        if pad_token and pad_token not in vocab:
            raise ValueError(f"no pad token {pad_token!r} in the tokenizer")
        pad_token = pad_token or next((n for n in PAD_NAMES if n in vocab), None)
        self.pad_token = pad_token
        self.pad_id = vocab[pad_token] if pad_token in vocab else self.vocab_size  # outside the vocabulary
        if self.pad_id == self.eos_id:
            raise ValueError("pad and end-of-text must be different tokens")

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def train(cls, texts, vocab_size: int = 1024, min_frequency: int = 2) -> "Tokenizer":
        """Train a byte-level BPE (GPT-2 style) with <|endoftext|> = 0 and <|pad|> = 1."""
        tk = HFTokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                      special_tokens=["<|endoftext|>", "<|pad|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tk.train_from_iterator(texts, trainer)
        return cls(tk, "<|endoftext|>", "<|pad|>")

    @classmethod
    def from_file(cls, path: str, eos_token: str = None, pad_token: str = None) -> "Tokenizer":
        """Load a tokenizer.json. Special tokens not named here (--eos_token / --pad_token) are taken from a
        tokenizer_config.json beside it (HF's convention; save() writes one), else found by their usual names."""
        try:
            tk = HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception with a long message
            raise ValueError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from None
        cfg_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path) as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
            name = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731  (HF: str or AddedToken)
            cfg_eos, cfg_pad = name(cfg.get("eos_token")), name(cfg.get("pad_token"))
            eos_token = eos_token or cfg_eos
            # many HF configs set pad = eos; nano_rlhf needs a distinct pad, so such a pad is not taken
            if not pad_token and cfg_pad and cfg_pad != eos_token:
                pad_token = cfg_pad
        return cls(tk, eos_token, pad_token)

    def save(self, path: str):
        """Write tokenizer.json and, beside it, tokenizer_config.json naming the special tokens (so later stages,
        and transformers' AutoTokenizer, know them without options). Each file is replaced atomically."""
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token, "bos_token": self.eos_token,
               "pad_token": self.pad_token if self.pad_id < self.vocab_size else None}
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

        def write_config(p):
            with open(p, "w") as f:
                f.write(json.dumps(cfg, indent=2) + "\n")
        for target, write in ((path, self.tk.save),
                              (os.path.join(os.path.dirname(path), "tokenizer_config.json"), write_config)):
            tmp = f"{target}.tmp{os.getpid()}"
            write(tmp)
            os.replace(tmp, target)

    # ---- plain text ---------------------------------------------------------------------------
    def encode(self, text: str) -> List[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids up to (not including) the first end-of-text; pads dropped."""
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.tk.decode([i for i in ids if i != self.pad_id and i < self.vocab_size],
                              skip_special_tokens=False)

    # ---- chat template ------------------------------------------------------------------------
    def render_prompt(self, prompt: Text) -> List[int]:
        """Ids of a prompt: a string as is; a message list through the template plus "Assistant:"."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        ids, _ = self.encode_conversation(prompt)
        return ids + self.encode(ASSISTANT_HEADER)

    def encode_conversation(self, messages: Messages) -> Tuple[List[int], List[int]]:
        """Ids and loss mask of a whole conversation; the mask is 1 on assistant content + end-of-text."""
        ids, mask = [], []
        for m in messages:
            if m["role"] == "assistant":
                head = self.encode(ASSISTANT_HEADER)
                body = self.encode(" " + m["content"]) + [self.eos_id]
                ids += head + body
                mask += [0] * len(head) + [1] * len(body)
            else:
                seg = self.encode(ROLE_HEADER[m["role"]] + m["content"] + "\n")
                ids += seg
                mask += [0] * len(seg)
        return ids, mask

    def encode_response(self, response: Text) -> List[int]:
        """Ids of a response (a string, or a list of assistant messages), ending with end-of-text."""
        if isinstance(response, str):
            return self.encode(response) + [self.eos_id]
        ids, _ = self.encode_conversation(response)
        # the prompt already ends with "Assistant:"; drop that header from the first assistant turn
        head = len(self.encode(ASSISTANT_HEADER))
        return ids[head:] if response and response[0]["role"] == "assistant" else ids

    def encode_prompt_response(self, prompt: Text, response: Text) -> Tuple[List[int], List[int]]:
        """ids = prompt ids + response ids (+ end-of-text), tokenized separately (the seam rule);
        mask = 0 on the prompt, 1 on the response and its end-of-text (for a multi-message response,
        1 on assistant content only)."""
        p = self.render_prompt(prompt)
        if isinstance(response, str):
            r = self.encode_response(response)
            return p + r, [0] * len(p) + [1] * len(r)
        ids, mask = self.encode_conversation(response)
        if response and response[0]["role"] == "assistant":
            head = len(self.encode(ASSISTANT_HEADER))
            ids, mask = ids[head:], mask[head:]
        return p + ids, [0] * len(p) + mask

    def info(self) -> dict:
        return {"vocab_size": self.vocab_size, "eos_token": self.eos_token, "eos_id": self.eos_id,
                "pad_token": self.pad_token, "pad_id": self.pad_id}

    def __repr__(self):
        return f"Tokenizer({json.dumps(self.info())})"
