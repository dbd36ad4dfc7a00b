"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer` with the chat templates nano_rlhf renders.

Special tokens. End-of-text (eos) closes every plain-text response and is what generation stops on. Pad
is a *different* id, used only to fill batches and always masked: if pad were the end-of-text id, masking
pads would also mask the real end-of-text and the model would never learn to stop (huggingface/trl#1623).

One rule picks the pad, for every layout real checkpoints ship:
  1. `--pad_token`, when given (it must not be a stop token);
  2. the pad that tokenizer_config.json declares, unless it is a stop token (eos or end-of-turn) — Qwen's
     <|endoftext|> is taken, SmolLM2's pad = eos = <|im_end|> is not;
  3. a token with a usual pad name (PAD_NAMES: Llama 3's <|finetune_right_pad_id|>, our <|pad|>);
  4. the first spare special token: special, and not bos, eos, end-of-turn or a token the chat template writes,
     reserved ones first (Llama 3.0: <|reserved_special_token_0|>; SmolLM2: <|endoftext|>, id 0, which its chat
     rows never hold);
  5. only when the vocabulary has none of these (GPT-2's single special token): id = vocabulary size, an id
     outside the vocabulary that the model replaces before its embedding lookup (no embedding is resized).
So the pad is inside the vocabulary whenever the vocabulary allows it, and that id is what an exported
config.json and generation_config.json say (transformers' reward models read the score at the last token
that is not pad_token_id, so it must be a token no scored row holds). The model never reads a pad id of its
own (nano_rlhf.model.in_vocabulary), so the model and the tokenizer cannot disagree about it.
A tokenizer trained here has `<|endoftext|>` = 0 and `<|pad|>` = 1. A HF tokenizer directory's
tokenizer_config.json names bos / eos / pad (and `add_bos_token`).

Chat templates (conversational data), chosen with `chat_template`:
- `plain` (models without a template; a trained tokenizer): each message is rendered as

      system:     "System: {content}\\n"
      user:       "User: {content}\\n"
      assistant:  "Assistant:" + " {content}" + <|endoftext|>

  Only " {content}" + <|endoftext|> of assistant turns carries loss; a prompt for generation ends with
  "Assistant:". The template is plain text, so it works with any tokenizer.json, GPT-2's included.
- `chatml`, `smollm2`, `qwen2.5`, `qwen3`, `llama3`: rendered exactly as transformers' apply_chat_template
  renders those families' own templates (nano_rlhf/chat.py). The template's end-of-turn token
  (`<|im_end|>`, `<|eot_id|>`) closes each assistant turn and carries its last loss; ChatML's "\\n" after
  it carries none. Generation stops on `stop_ids` (eos and end-of-turn).
- `auto` (default): the variant recognised from the tokenizer's own template text (tokenizer_config.json
  `chat_template`, or chat_template.jinja beside it); an unrecognised template falls back to `plain`
  with a one-line notice; no template at all is `plain`.

Seam rule. Prompt and response are tokenized *separately* and their ids concatenated; the joined string
is never re-tokenized, so a BPE merge can never straddle the boundary and shift the loss mask (TRL#1679).
A response in conversational form starts right after the generation prompt and ends with the end-of-turn
token; a plain-text response ends with eos.
"""
import hashlib
import json
import os
import re
import sys
from typing import List, Sequence, Tuple, Union

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from . import chat

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>", "<|finetune_right_pad_id|>")
ROLES = ("system", "user", "assistant", "tool")   # a tool message: a tool's result
ROLE_HEADER = {"system": "System: ", "user": "User: "}        # a tool turn: chat.tool_turn("plain", ...)
ASSISTANT_HEADER = "Assistant:"
CHAT_TEMPLATES = chat.VARIANTS

Messages = List[dict]
Text = Union[str, Messages]


class Tokenizer:
    def __init__(self, tk: HFTokenizer, eos_token: str = None, pad_token: str = None, chat_template: str = "auto",
                 date_string: str = None, *, template_text: str = None, bos_token: str = None,
                 add_bos_token: bool = None, declared_pad: str = None):
        """`template_text`: the tokenizer's own Jinja chat template (kept and saved when its variant is used);
        `add_bos_token`: whether plain text starts with bos (None: as the tokenizer.json post-processor does);
        `declared_pad`: the pad tokenizer_config.json names (taken unless it is a stop token; the module
        docstring gives the whole rule)."""
        self.tk = tk
        self.path = None            # the tokenizer.json it was read from (from_file)
        vocab = tk.get_vocab(with_added_tokens=True)
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        eos_token = eos_token or next((n for n in EOS_NAMES if n in vocab), None)
        if eos_token is None or eos_token not in vocab:
            raise ValueError(f"no end-of-text token {eos_token!r} in the tokenizer" if eos_token else
                             f"no end-of-text token found (tried {EOS_NAMES}); name it with --eos_token")
        self.eos_token, self.eos_id = eos_token, vocab[eos_token]
        if pad_token and pad_token not in vocab:
            raise ValueError(f"no pad token {pad_token!r} in the tokenizer")
        if pad_token == eos_token:
            raise ValueError("pad and end-of-text must be different tokens")
        self._init_template(chat_template, template_text, date_string)
        if self.chat_template == "llama3" and bos_token is None and "<|begin_of_text|>" in vocab:
            bos_token = "<|begin_of_text|>"
        self.bos_token = bos_token if bos_token in vocab else None
        self.bos_id = vocab.get(self.bos_token)
        if pad_token and vocab[pad_token] in self.stop_ids:
            raise ValueError(f"pad {pad_token!r} is the chat template's end-of-turn token; pads must differ from it")
        if declared_pad in vocab and vocab[declared_pad] not in self.stop_ids:
            pad_token = pad_token or declared_pad
        pad_token = pad_token or next((n for n in PAD_NAMES if n in vocab), None) or self._spare_special(vocab)
        self.pad_token = pad_token
        self.pad_id = vocab[pad_token] if pad_token in vocab else self.vocab_size  # outside the vocabulary
        self._add_bos_cfg = add_bos_token
        if add_bos_token is None and self.bos_id is not None:   # what the tokenizer's post-processor does
            add_bos_token = tk.encode("a", add_special_tokens=True).ids[:1] == [self.bos_id] != \
                tk.encode("a", add_special_tokens=False).ids[:1]
        self.add_bos = bool(add_bos_token) and self.bos_id is not None

    def _spare_special(self, vocab):
        """The lowest-id special token that is not bos, eos, end-of-turn or written by the chat template, and
        encodes as itself, a reserved one first (Llama 3.0: <|reserved_special_token_0|>, not <|end_of_text|>,
        which a model may still emit); None if there is none."""
        used = set(self.stop_ids) | {self.bos_id} | {vocab[t] for t in chat.TOKENS.get(self.chat_template, ())}
        added = self.tk.get_added_tokens_decoder().items()
        for i, t in sorted(added, key=lambda it: ("reserved" not in it[1].content, it[0])):
            if t.special and i not in used and t.content != "<|begin_of_text|>" and self.encode(t.content) == [i]:
                return t.content
        return None

    def _init_template(self, chat_template, text, date_string):
        if chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"unknown chat template {chat_template!r} (one of {', '.join(CHAT_TEMPLATES)})")
        found, default_date = chat.detect(text) if text else (None, None)
        if chat_template == "auto":
            if text and not found:
                print("note: the tokenizer's chat template is not one nano_rlhf renders (chatml, smollm2, qwen2.5, "
                      "qwen3, llama3); using the plain template (--chat_template names one)", file=sys.stderr)
            chat_template = found or "plain"
        self.chat_template = chat_template
        # the loaded text is kept (and saved) only when it is the template we render
        self.template_text = text if found == chat_template else None
        self.date_string = None
        if chat_template == "llama3":
            self.date_string = date_string or (default_date if self.template_text else None) or chat.today()
        vocab = self.tk.get_vocab(with_added_tokens=True)
        if self.date_string:      # written into every system header: a control token there would forge structure
            inside = [t.content for t in self.tk.get_added_tokens_decoder().values() if t.content in self.date_string]
            if inside:
                raise ValueError(f"--date_string {self.date_string!r} contains the special token {inside[0]}")
        for t in chat.TOKENS.get(chat_template, ()):
            if t not in vocab or self.encode(t) != [vocab[t]]:
                raise ValueError(f"chat template {chat_template}: {t} is not a special token of the tokenizer "
                                 "(--chat_template plain renders without it)")
        self.eot_token = chat.END_OF_TURN.get(chat_template, self.eos_token)
        self.eot_id = vocab[self.eot_token]
        self.stop_ids = sorted({self.eos_id, self.eot_id})

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def train(cls, texts, vocab_size: int = 1024, min_frequency: int = 2, chat_template: str = "plain",
              date_string: str = None) -> "Tokenizer":
        """Train a byte-level BPE (GPT-2 style) with <|endoftext|> = 0 and <|pad|> = 1, then the special tokens
        of `chat_template` ("auto" = plain). The trainer sees at most TRAIN_MAX_CHARS characters of each text,
        with runs longer than TRAIN_MAX_WORD characters cut into pieces: BPE training time grows with the
        square of a word's length, and one 10-MB single-word line never finished."""
        if chat_template not in CHAT_TEMPLATES:   # before the (possibly long) training
            raise ValueError(f"unknown chat template {chat_template!r} (one of {', '.join(CHAT_TEMPLATES)})")
        variant = "plain" if chat_template == "auto" else chat_template
        extra = chat.TOKENS.get(variant, ()) + (("<|begin_of_text|>",) if variant == "llama3" else ())
        tk = train_bpe(texts, vocab_size, min_frequency, ["<|endoftext|>", "<|pad|>", *extra])
        return cls(tk, "<|endoftext|>", "<|pad|>", variant, date_string)

    @classmethod
    def from_file(cls, path: str, eos_token: str = None, pad_token: str = None, chat_template: str = "auto",
                  date_string: str = None) -> "Tokenizer":
        """Load a tokenizer.json. Beside it, a tokenizer_config.json (HF's convention; save() writes one) names
        the special tokens not named here (--eos_token / --pad_token; else they are found by their usual
        names) and may hold the chat template (`chat_template`: a string, or a list of {name, template} of
        which "default" is taken); a chat_template.jinja beside it takes precedence, as in transformers."""
        tk = _read(path)
        folder = os.path.dirname(path)
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        cfg = {}
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
        name = lambda v: v.get("content") if isinstance(v, dict) else v
        cfg_eos, cfg_pad = name(cfg.get("eos_token")), name(cfg.get("pad_token"))
        eos_token = eos_token or cfg_eos
        text = cfg.get("chat_template")
        if isinstance(text, list):
            text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{cfg_path}: 'chat_template' must be a string or a list of {{name, template}}")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                text = f.read()
        add_bos, saved_date = cfg.get("add_bos_token"), cfg.get("date_string")
        # the date a Llama 3 run rendered with (save() keeps it), so later stages render the same header
        date_string = date_string or (saved_date if isinstance(saved_date, str) else None)
        tok = cls(tk, eos_token, pad_token, chat_template, date_string, template_text=text,
                  bos_token=name(cfg.get("bos_token")), add_bos_token=add_bos if isinstance(add_bos, bool) else None,
                  declared_pad=cfg_pad if isinstance(cfg_pad, str) else None)
        tok.path = path
        return tok

    def save(self, path: str):
        """Write tokenizer.json and, beside it, tokenizer_config.json naming the special tokens and holding the
        chat template text (the tokenizer's own, or one that renders like the chosen variant; none for plain)
        and a Llama 3 `date_string`, so later stages, and transformers' AutoTokenizer and its
        apply_chat_template, know them without options. Each file is replaced atomically; a
        chat_template.jinja beside it (which would take precedence) is removed."""
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
               "bos_token": self.bos_token,
               "pad_token": self.pad_token if self.pad_id < self.vocab_size else None}
        if self._add_bos_cfg is not None:
            cfg["add_bos_token"] = self._add_bos_cfg
        if self.date_string:
            cfg["date_string"] = self.date_string
        if self.chat_template != "plain":
            text = self.template_text
            if (self.chat_template == "llama3" and text
                    and chat.detect(text)[1] != self.date_string):
                # the model's own text renders another date (3.1's fixed default, or 3.2's today when loaded
                # later): write one whose default is the date this run trained with, so AutoTokenizer agrees
                text = None
            cfg["chat_template"] = text or chat.template_text(self.chat_template, self.date_string)
        folder = os.path.dirname(path)
        os.makedirs(folder or ".", exist_ok=True)

        def write_config(p):
            with open(p, "w", encoding="utf-8") as f:
                f.write(json.dumps(cfg, indent=2) + "\n")
        for target, write in ((path, self.tk.save), (os.path.join(folder, "tokenizer_config.json"), write_config)):
            tmp = f"{target}.tmp{os.getpid()}"
            write(tmp)
            os.replace(tmp, target)
        stale = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(stale):
            os.remove(stale)

    # ---- plain text ---------------------------------------------------------------------------
    def encode(self, text: str) -> List[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids up to (not including) the first stop id (eos or end-of-turn); pads dropped."""
        ids = list(ids)
        cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return self.tk.decode([i for i in ids[:cut] if i != self.pad_id and i < self.vocab_size],
                              skip_special_tokens=False)

    def decode_turns(self, ids: Sequence[int]) -> str:
        """Text of a multi-turn response (assistant turns with tool turns between them): every token kept as the
        chat template wrote it, end-of-turn tokens included, except a stop id that ends it; pads dropped."""
        ids = [i for i in ids if i != self.pad_id and i < self.vocab_size]
        return self.tk.decode(ids[:-1] if ids and ids[-1] in self.stop_ids else ids, skip_special_tokens=False)

    def _with_bos(self, ids: List[int]) -> List[int]:
        """Plain text starts with bos when the tokenizer adds one (never twice)."""
        return [self.bos_id] + ids if self.add_bos and ids[:1] != [self.bos_id] else ids

    def encode_literal(self, text: str) -> List[int]:
        """Ids of text in which a special token's string ("<|im_end|>") is ordinary text, never the control
        token: for text a model wrote or a user pasted that must not open or close a turn (a judge's input)."""
        self.tk.encode_special_tokens = True
        try:
            return self.tk.encode(text, add_special_tokens=False).ids
        finally:
            self.tk.encode_special_tokens = False

    def render_prompt_literal(self, messages: Messages) -> List[int]:
        """render_prompt(messages), except that each message's content is encoded with encode_literal: the
        template's own special tokens stay control tokens, the contents' look-alikes become text. (Training
        data follows transformers' and TRL's convention instead: special-token strings in it are parsed.)"""
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]      # private-use: never in real text
        text = self.render_text([dict(m, content=k) for m, k in zip(messages, marks)], add_generation_prompt=True)
        ids = [] if self.chat_template != "plain" else self._with_bos([])
        if ids and text.startswith(self.bos_token or "\0"):
            text = text[len(self.bos_token):]
        for m, k in zip(messages, marks):
            before, text = text.split(k, 1)
            ids += self.encode(before) + self.encode_literal(m["content"])
        return ids + self.encode(text)

    def encode_text(self, text: str) -> List[int]:
        """A whole training document ({"text"} rows): [bos] + text + eos."""
        return self._with_bos(self.encode(text)) + [self.eos_id]

    # ---- chat template ------------------------------------------------------------------------
    def _segments(self, messages: Messages, add_generation_prompt: bool, tools=None):
        return chat.render(self.chat_template, messages, add_generation_prompt, self.bos_token or "",
                           self.date_string, tools)

    def _encode_segments(self, segs) -> Tuple[List[int], List[int]]:
        """Consecutive segments with the same loss flag are tokenized as one string (as apply_chat_template
        tokenizes the whole text; special tokens split it anyway), a change of flag is a seam."""
        ids, mask, i = [], [], 0
        while i < len(segs):
            j = i
            while j < len(segs) and segs[j][1] == segs[i][1]:
                j += 1
            part = self.encode("".join(s for s, _ in segs[i:j]))
            ids += part
            mask += [int(segs[i][1])] * len(part)
            i = j
        return ids, mask

    def render_text(self, messages: Messages, add_generation_prompt: bool = False, tools=None) -> str:
        """The rendered conversation as text (what apply_chat_template(tokenize=False) gives); tools: the JSON
        schemas of the tools the model may call (nano_rlhf.chat, Tools)."""
        if self.chat_template == "plain":
            ids, _ = self.encode_conversation(messages, tools)
            return self.tk.decode(ids + (self.encode(ASSISTANT_HEADER) if add_generation_prompt else []),
                                  skip_special_tokens=False)
        return "".join(s for s, _ in self._segments(messages, add_generation_prompt, tools))

    def render_prompt(self, prompt: Text, tools=None) -> List[int]:
        """Ids of a prompt: a string as is (after bos if the tokenizer adds one); a message list through the
        template plus the generation prompt ("Assistant:" for plain), with the tool list when tools are given."""
        if isinstance(prompt, str):
            if tools:
                raise ValueError("tools need a conversational prompt (a list of messages), not a text prompt")
            return self._with_bos(self.encode(prompt))
        if self.chat_template != "plain":
            return self._encode_segments(self._segments(prompt, True, tools))[0]
        ids, _ = self.encode_conversation(prompt, tools)
        return ids + self.encode(ASSISTANT_HEADER)

    def encode_conversation(self, messages: Messages, tools=None) -> Tuple[List[int], List[int]]:
        """Ids and loss mask of a whole conversation; the mask is 1 on assistant content (tool calls included)
        + end-of-turn, 0 on tool results."""
        if self.chat_template != "plain":
            return self._encode_segments(self._segments(messages, False, tools))
        ids, mask = self._plain(messages, tools)
        bos = self._with_bos([])
        return bos + ids, [0] * len(bos) + mask

    def encode_tool_turn(self, results: Sequence[str]) -> List[int]:
        """Ids of what follows an assistant turn's end-of-turn token when its tool calls answered `results`: the
        result turn(s) and the next generation prompt (chat.tool_turn). The results are encoded as literal text
        (encode_literal): a tool that echoes "<|im_end|>" cannot close a turn or open one."""
        return self._encode_pieces(chat.tool_turn(self.chat_template, list(results)))

    def _encode_pieces(self, pieces) -> List[int]:
        """(text, is_result) pieces -> ids: a result as literal text, the template's own text with its tokens."""
        return [i for text, is_result in pieces
                for i in (self.encode_literal(text) if is_result else self.encode(text))]

    def _plain(self, messages: Messages, tools=None) -> Tuple[List[int], List[int]]:
        if tools:       # the compact tool list, in the system line (after the system message's own text)
            has_system = bool(messages) and messages[0]["role"] == "system"
            system = messages[0]["content"] + "\n\n" if has_system else ""
            messages = [{"role": "system", "content": system + chat.plain_tools_text(tools)}] + \
                messages[int(has_system):]
        ids, mask = [], []
        for m in messages:
            if m["role"] == "assistant":
                head = self.encode(ASSISTANT_HEADER)
                text = chat.assistant_text("plain", m.get("content") or "", m.get("tool_calls"))
                body = self.encode(" " + text) + [self.eos_id]
                ids += head + body
                mask += [0] * len(head) + [1] * len(body)
            elif m["role"] == "tool":   # tokenized as a rollout's tool turn is (chat.tool_turn), id for id
                *turn, next_prompt = chat.tool_turn("plain", [m["content"]])
                assert next_prompt == (ASSISTANT_HEADER, False)      # the next assistant message writes its header
                seg = self._encode_pieces(turn)
                ids += seg
                mask += [0] * len(seg)
            else:
                seg = self.encode(ROLE_HEADER[m["role"]] + m["content"] + "\n")
                ids += seg
                mask += [0] * len(seg)
        return ids, mask

    def _response(self, response: Messages) -> Tuple[List[int], List[int]]:
        """Ids and mask of assistant messages following a prompt: from after the generation prompt to the
        last end-of-turn. Rendered after a stand-in user turn, so rules that look at the position (Qwen3's
        final-turn thinking block, Llama's system header) apply as after a real prompt."""
        if self.chat_template == "plain":
            ids, mask = self._plain(response)
            if response and response[0]["role"] == "assistant":  # the prompt already ends with "Assistant:"
                head = len(self.encode(ASSISTANT_HEADER))
                ids, mask = ids[head:], mask[head:]
            return ids, mask
        user = [{"role": "user", "content": "?"}]
        segs = self._segments(user + response, False)
        k = len(self._segments(user, True))
        head = "".join(s for s, _ in self._segments(user, True))
        if "".join(s for s, _ in segs[:k]) != head:   # the generation prompt must be a prefix of the turn
            raise ValueError(f"chat template {self.chat_template}: a prompt's rendering is not a prefix of the "
                             "conversation's rendering")
        segs = segs[k:]
        while segs and not segs[-1][1]:                # the response ends with its end-of-turn token
            segs = segs[:-1]
        return self._encode_segments(segs)

    def encode_response(self, response: Text) -> List[int]:
        """Ids of a response: a string + eos; a list of assistant messages as rendered after the generation
        prompt, ending with the end-of-turn token."""
        if isinstance(response, str):
            return self.encode(response) + [self.eos_id]
        return self._response(response)[0]

    def encode_response_and_mask(self, response: Text) -> Tuple[List[int], List[int]]:
        """encode_response's ids and which of them are the model's: every one, except in a response holding tool
        results (a multi-turn response), where only the assistant turns' content + end-of-turn are (the tool turns
        and the generation prompts between are context)."""
        if isinstance(response, str) or not any(m["role"] == "tool" for m in response):
            ids = self.encode_response(response)
            return ids, [1] * len(ids)
        return self._response(response)

    def encode_prompt_response(self, prompt: Text, response: Text) -> Tuple[List[int], List[int]]:
        """ids = prompt ids + response ids, tokenized separately (the seam rule); mask = 0 on the prompt, 1 on
        the response and its closing eos / end-of-turn (for a multi-message response, 1 on assistant content
        + end-of-turn only)."""
        p = self.render_prompt(prompt)
        if isinstance(response, str):
            r = self.encode_response(response)
            return p + r, [0] * len(p) + [1] * len(r)
        ids, mask = self._response(response)
        return p + ids, [0] * len(p) + mask

    def info(self) -> dict:
        return {"vocab_size": self.vocab_size, "eos_token": self.eos_token, "eos_id": self.eos_id,
                "pad_token": self.pad_token, "pad_id": self.pad_id, "bos_token": self.bos_token,
                "chat_template": self.chat_template, "eot_token": self.eot_token, "stop_ids": self.stop_ids,
                "date_string": self.date_string}

    def __repr__(self):
        return f"Tokenizer({json.dumps(self.info())})"


# ---- one tokenizer for the models of a run ----------------------------------------------------------

def _fingerprint_of(ours):
    if isinstance(ours, Tokenizer):
        if getattr(ours, "_fingerprint", None) is None:
            ours._fingerprint = fingerprint(ours.tk)
        return ours._fingerprint
    return fingerprint(_read(ours))


def mismatch(ours, model_dir):
    """None when `model_dir` (a reference, reward model, judge, merge partner, ...) ships no tokenizer.json or the
    same tokenizer as `ours` (a Tokenizer a run encodes with, or a tokenizer.json path), else the one-line
    refusal naming both: that model was trained on other ids, and would read ours as other text. The one check of
    this kind in the package (common.check_vocab and the merge call it)."""
    theirs = os.path.join(model_dir, "tokenizer.json")
    source = ours.path if isinstance(ours, Tokenizer) else ours
    if not os.path.isfile(theirs) or (source and os.path.realpath(source) == os.path.realpath(theirs)):
        return None
    if _fingerprint_of(ours) == fingerprint(_read(theirs)):
        return None
    where = (os.path.dirname(source) or ".") if source else "the tokenizer trained by this run"
    return (f"{model_dir} was trained with another tokenizer than {where} (its tokenizer.json gives the same text "
            f"other ids, whatever the vocabulary sizes); use models that share one tokenizer")


# ---- Training a byte-level BPE (GPT-2 style), reading a tokenizer.json, and the fingerprint of what decides a
# tokenizer's ids (mismatch compares two by it).
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
