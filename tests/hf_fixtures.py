"""Tiny checkpoints of real model families, built the way their authors ship them, for end-to-end tests of the
scripts: `make_hf_dir(path, family)` writes a transformers random-init model (config.json + model.safetensors,
saved by transformers' save_pretrained) with a byte-level BPE tokenizer.json that has the family's special
tokens, and a tokenizer_config.json with its bos / eos / pad and its real chat template text
(tests/fixtures/chat_templates/). Plus JSONL rows of every data kind in conversational form, written with
the words the tokenizer was trained on (so texts are a few tokens, not one token per byte).

Families (each keeps the quirks that matter to the scripts):
  llama  Llama 3.1: untied output layer, grouped-query attention 4/2, llama3 RoPE scaling, bos added by the
         tokenizer's post-processor and by the template, end-of-turn <|eot_id|> != end-of-text <|end_of_text|>,
         config eos_token_id a list (as Meta's), pad <|finetune_right_pad_id|>.
  qwen3  Qwen3: tied output layer, head_dim 32 != width / heads = 16, per-head q/k norm, no bos, eos <|im_end|>,
         pad <|endoftext|>, <think> / </think> as added (non-special) tokens.
Shipped layouts (SHIPPED; the special tokens, eos lists and pads exactly as the model cards'
tokenizer_config.json / config.json / generation_config.json give them, on tiny weights):
  smollm2   SmolLM2-Instruct: pad = eos = <|im_end|> in tokenizer_config.json, pad_token_id 2 (= <|im_end|>) in
            config.json and generation_config.json, bos <|im_start|>, unk <|endoftext|>, the StarCoder special
            tokens after them; the embedding has exactly the tokenizer's rows (an id past them is out of range).
  llama3.2  Llama 3.2 Instruct: no pad token anywhere; eos <|eot_id|> in tokenizer_config.json, eos_token_id
            [128001, 128008, 128009] (<|end_of_text|>, <|eom_id|>, <|eot_id|>) in config.json and
            generation_config.json; reserved tokens including <|finetune_right_pad_id|>; tied output layer.
  qwen2.5   Qwen2.5 Instruct: pad <|endoftext|> != eos <|im_end|>; config.json has no pad_token_id,
            generation_config.json pad 151643 and eos [151645, 151643] (<|im_end|>, <|endoftext|>).
  qwen3     as above (generation_config.json as Qwen2.5's).

Usage:
    from hf_fixtures import make_hf_dir, pref_rows, write_jsonl
    d = make_hf_dir(tmp_path / "qwen3", "qwen3")          # -> str path; `--init d` needs no --tokenizer
    rm = make_hf_dir(tmp_path / "rm", "qwen3", head="score")   # a reward model of the same family
    write_jsonl(tmp_path / "pref.jsonl", pref_rows(32))
"""
import json
import os
import random

import torch
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

FAMILIES = ("llama", "qwen3")
SHIPPED = ("smollm2", "llama3.2", "qwen2.5", "qwen3")
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "chat_templates")
# Llama 3 / Qwen pre-tokenizer regex (it splits around newlines unlike GPT-2's)
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")
WORDS = ("the motor is great and the screen is bad i love this blender phone battery review write a short "
         "of it was fine nice terrible quiet loud").split()
ITEMS = ("blender", "phone", "motor", "screen", "battery")
GOOD, BAD = ("great", "nice", "quiet", "fine"), ("bad", "terrible", "loud")
SYSTEM = "You review products."

SPEC = {
    "qwen3": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=["<think>", "</think>"],
        template="qwen3.jinja", bos=None, eos="<|im_end|>", pad="<|endoftext|>",
        config_eos=["<|im_end|>"], config_bos=None,
        generation=dict(bos="<|endoftext|>", pad="<|endoftext|>", eos=["<|im_end|>", "<|endoftext|>"])),
    "llama": dict(
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|finetune_right_pad_id|>"], added=[],
        template="llama3.1.jinja", bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>",
        config_eos=["<|end_of_text|>", "<|eot_id|>"], config_bos="<|begin_of_text|>"),
    "smollm2": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
                  "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>"], added=[],
        template="smollm2.jinja", bos="<|im_start|>", eos="<|im_end|>", pad="<|im_end|>", unk="<|endoftext|>",
        config_eos=["<|im_end|>"], config_bos="<|im_start|>", config_pad="<|im_end|>", exact_vocab=True, add_bos=False,
        generation=dict(bos="<|im_start|>", pad="<|im_end|>", eos=["<|im_end|>"])),
    "llama3.2": dict(
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"],
        added=[], template="llama3.2.jinja", bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
        config_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], config_bos="<|begin_of_text|>", config_pad=None,
        tied=True, generation=dict(bos="<|begin_of_text|>", pad=None,
                                   eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                                   extra={"do_sample": True, "temperature": 0.6, "top_p": 0.9})),
    "qwen2.5": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=[],
        template="qwen2.5.jinja", bos=None, eos="<|im_end|>", pad="<|endoftext|>",
        config_eos=["<|im_end|>"], config_bos="<|endoftext|>", config_pad=None,
        generation=dict(bos="<|endoftext|>", pad="<|endoftext|>", eos=["<|im_end|>", "<|endoftext|>"],
                        extra={"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8,
                               "top_k": 20})),
}
VOCAB = 380          # BPE training target (bytes 256 + specials + merges); the model's vocabulary rounds up to 64


def chat_template(family):
    """The family's real Jinja chat template text."""
    with open(os.path.join(TEMPLATES, SPEC[family]["template"]), encoding="utf-8") as f:
        return f.read()


def _corpus():
    """Text that looks like renderings (role names, headers, newlines) and like the data rows below, so
    merges exist for both and a row is tens of tokens, not hundreds of bytes."""
    r = random.Random(0)
    head = ("system\n\nuser\n\nassistant\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
            f"{SYSTEM}\n")
    return [head] * 20 + [" ".join(r.choice(WORDS + list(ITEMS)) for _ in range(12)) + "." for _ in range(200)]


def hf_tokenizer(family):
    """A byte-level BPE `tokenizers.Tokenizer` with the family's special tokens (trained, deterministic)."""
    spec = SPEC[family]
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=spec["specials"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if spec["added"]:
        tk.add_tokens(spec["added"])
    # like Llama 3's tokenizer.json: encode(add_special_tokens=True) prepends bos (SmolLM2's does not)
    if spec["bos"] and spec.get("add_bos", True):
        bos = spec["bos"]
        tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                          special_tokens=[(bos, tk.token_to_id(bos))])
    return tk


def _hf_config(family, vocab_size, ids):
    import transformers
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.0,
                  pad_token_id=ids["pad"], eos_token_id=ids["config_eos"], bos_token_id=ids["config_bos"])
    if family == "qwen2.5":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family in ("smollm2", "llama3.2"):
        rope = ({"rope_type": "default", "rope_theta": 100000.0} if family == "smollm2" else {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        return transformers.LlamaConfig(**common, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_parameters=rope)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return transformers.LlamaConfig(**common, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})


def make_hf_dir(path, family, chat=True, seed=0, head="lm") -> str:
    """Write a tiny `family` checkpoint directory (see the module docstring) into `path`; returns str(path).
    chat=False leaves the chat template out of tokenizer_config.json (a base model: the plain template).
    head="score" writes a reward model instead (*ForSequenceClassification, one label) with the same trunk.
    The weights are transformers' random init for `seed` plus N(0, 0.05) noise on every parameter, so norm
    weights are not all 1 and no term of the forward can hide in a parity check."""
    import transformers
    if family not in SPEC:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    spec, path = SPEC[family], str(path)
    os.makedirs(path, exist_ok=True)
    tk = hf_tokenizer(family)
    tk.save(os.path.join(path, "tokenizer.json"))
    vocab = tk.get_vocab(with_added_tokens=True)
    config_pad = spec.get("config_pad", spec["pad"])
    ids = {"pad": vocab[config_pad] if config_pad else None, "config_eos": [vocab[t] for t in spec["config_eos"]],
           "config_bos": vocab[spec["config_bos"]] if spec["config_bos"] else None}
    if len(ids["config_eos"]) == 1:
        ids["config_eos"] = ids["config_eos"][0]
    n = tk.get_vocab_size(with_added_tokens=True)
    # like most real checkpoints, embedding rows past the tokenizer's (rounded up to 64); SmolLM2 has exactly its
    # tokenizer's rows, so an out-of-vocabulary id reaching the embedding is an error there
    cfg = _hf_config(family, n if spec.get("exact_vocab") else -(-n // 64) * 64, ids)
    if head not in ("lm", "score"):
        raise ValueError(f"head must be 'lm' or 'score', got {head!r}")
    if head == "score":
        cfg.num_labels = 1
    torch.manual_seed(seed)
    prefix = {"qwen3": "Qwen3", "qwen2.5": "Qwen2"}.get(family, "Llama")
    model = getattr(transformers, prefix + ("ForCausalLM" if head == "lm" else "ForSequenceClassification"))(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    gen = spec.get("generation")
    if gen:            # the model card's generation_config.json (transformers wrote one from config.json)
        eos = [vocab[t] for t in gen["eos"]]
        g = {"bos_token_id": vocab[gen["bos"]] if gen["bos"] else None, "eos_token_id": eos if len(eos) > 1 else eos[0],
             **({"pad_token_id": vocab[gen["pad"]]} if gen["pad"] else {}), **gen.get("extra", {})}
        with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(g, f, indent=2)
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spec["bos"], "eos_token": spec["eos"],
               "model_max_length": 128}
    if spec["pad"]:
        tok_cfg["pad_token"] = spec["pad"]
    if spec.get("unk"):
        tok_cfg["unk_token"] = spec["unk"]
    if chat:
        tok_cfg["chat_template"] = chat_template(family)
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f, indent=2)
    return path


# ---- conversational data rows for these tiny models ----------------------------------------------

def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _prompt(r, item):
    """A user turn, with a system message in every third row (so renderings with and without one occur)."""
    msgs = [{"role": "user", "content": f"write a short review of the {item}."}]
    return ([{"role": "system", "content": SYSTEM}] if r.random() < 1 / 3 else []) + msgs


def _say(text):
    return [{"role": "assistant", "content": text}]


def _review(r, item, good):
    words, tail = (GOOD, " and great") if good else (BAD, " and loud")
    return f"the {item} is {r.choice(words)}" + tail * r.randint(0, 2) + "."


def pref_rows(n=32, seed=0):
    """Preference rows {"prompt": [messages], "chosen": [assistant], "rejected": [assistant]}."""
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        item = r.choice(ITEMS)
        rows.append({"prompt": _prompt(r, item), "chosen": _say(_review(r, item, True)),
                     "rejected": _say(_review(r, item, False))})
    return rows


def unpaired_rows(n=32, seed=0):
    """Unpaired rows {"prompt": [messages], "completion": [assistant], "label": bool}, alternating labels."""
    r = random.Random(seed)
    rows = []
    for i in range(n):
        item = r.choice(ITEMS)
        rows.append({"prompt": _prompt(r, item), "completion": _say(_review(r, item, i % 2 == 0)),
                     "label": i % 2 == 0})
    return rows


def prompt_rows(n=16, seed=0):
    """Prompt rows {"prompt": [messages]} (generation: PPO, evaluate)."""
    r = random.Random(seed)
    return [{"prompt": _prompt(r, r.choice(ITEMS))} for _ in range(n)]


def sft_rows(n=32, seed=0):
    """SFT rows {"messages": [...]}: a conversation ending with an assistant turn (every third one two turns)."""
    r = random.Random(seed)
    rows = []
    for i in range(n):
        item = r.choice(ITEMS)
        msgs = _prompt(r, item) + _say(_review(r, item, True))
        if i % 3 == 2:
            msgs += [{"role": "user", "content": "and the battery?"}] + _say(_review(r, "battery", r.random() < .5))
        rows.append({"messages": msgs})
    return rows
