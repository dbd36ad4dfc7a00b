"""GPTConfig: the shape of a model of either family (GPT-2, or Llama / Qwen2 / Qwen3), checked field by field,
and read from an HF config.json (config_from_hf: the model type recognised, every field type-checked, one line
naming the file for a bad one). hf_io.py reads and writes the weights; model.py builds the models. This module
imports nothing of nano_rlhf.
"""
from dataclasses import dataclass
from typing import Optional


ARCHITECTURES = {  # model_type -> (language model class, sequence classification class) in transformers
    "gpt2": ("GPT2LMHeadModel", "GPT2ForSequenceClassification"),
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
}


@dataclass
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 64                     # maximum sequence length (HF: n_positions / max_position_embeddings)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0                     # GPT-2: residual, attention, embedding; Llama: attention (0 in RLHF)
    bias: bool = True                        # GPT-2 biases in Linear and LayerNorm (GPT-2: True)
    layer_norm_epsilon: float = 1e-5
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None       # written to config.json only; the model never reads it
    eos_token_ids: Optional[list] = None     # every end id the checkpoint lists (config and generation_config)
    generation: Optional[dict] = None        # the checkpoint's generation_config.json, kept for export
    model_type: str = "gpt2"                 # gpt2 | llama | qwen2 | qwen3; the fields below are Llama family only
    n_kv_head: Optional[int] = None          # grouped-query attention: key/value heads (None = n_head)
    head_dim: Optional[int] = None           # None = n_embd // n_head (Qwen3-0.6B: 128 at width 1024, 16 heads)
    intermediate_size: Optional[int] = None  # SwiGLU width (None = 4 * n_embd)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None      # None or {"rope_type": "llama3", "factor", "low_freq_factor",
    #                                          "high_freq_factor", "original_max_position_embeddings"}
    attention_bias: bool = False             # q/k/v biases (Qwen2 always; Llama/Qwen3 then o_proj too)
    qk_norm: bool = False                    # per-head RMSNorm of q and k before RoPE (Qwen3)
    tie_word_embeddings: bool = True         # output layer = embedding (GPT-2 always)
    bos_token_id: Optional[int] = None

    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head

    @property
    def hd(self):
        return self.head_dim or self.n_embd // self.n_head

    @property
    def ffn(self):
        return self.intermediate_size or 4 * self.n_embd


def check_config(cfg, where="config"):
    """ValueError naming the field when a config cannot build a model (one line, prefixed by `where`)."""
    def positive_int(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
    if cfg.model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type {cfg.model_type!r} is not supported (gpt2, llama, qwen2, qwen3)")
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        positive_int(name, getattr(cfg, name))
    for name in ("n_kv_head", "head_dim", "intermediate_size"):
        if getattr(cfg, name) is not None:
            positive_int(name, getattr(cfg, name))
    if cfg.model_type == "gpt2":
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"{where}: n_head {cfg.n_head} does not divide n_embd {cfg.n_embd}")
        if not cfg.tie_word_embeddings or cfg.kv_heads != cfg.n_head or cfg.hd * cfg.n_head != cfg.n_embd:
            raise ValueError(f"{where}: gpt2 has tied embeddings, n_kv_head = n_head and head_dim = n_embd / n_head")
        return
    if cfg.n_head % cfg.kv_heads:
        raise ValueError(f"{where}: n_kv_head {cfg.kv_heads} does not divide n_head {cfg.n_head}")
    if cfg.hd % 2:
        raise ValueError(f"{where}: head_dim {cfg.hd} must be even for rotary embeddings")
    if cfg.model_type == "qwen2" and not cfg.attention_bias:
        raise ValueError(f"{where}: qwen2 always has q/k/v biases (attention_bias must be true)")
    s = cfg.rope_scaling
    if s is not None:
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if not isinstance(s, dict) or s.get("rope_type") != "llama3" or any(k not in s for k in need):
            raise ValueError(f"{where}: rope_scaling must be None or rope_type llama3 with {', '.join(need)}")


class _Fields:
    """Typed reads from a config dict; a wrong type is one line naming the file and the field."""

    def __init__(self, raw, path):
        self.raw, self.path = raw, path

    def get(self, key, default, kind):
        v = self.raw.get(key, default)
        ok = {"int": lambda x: isinstance(x, int) and not isinstance(x, bool),
              "size": lambda x: isinstance(x, int) and not isinstance(x, bool) and x > 0,
              "float": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
              "bool": lambda x: isinstance(x, bool),
              "id": lambda x: x is None or (isinstance(x, int) and not isinstance(x, bool))}[kind]
        if not ok(v):
            want = {"int": "an integer", "size": "a positive integer", "float": "a number", "bool": "true or false",
                    "id": "an integer or null"}
            raise ValueError(f"{self.path}: {key} must be {want[kind]}, got {v!r}")
        return v


def _first_id(f, key, default=None):
    """eos_token_id may be a list in HF configs (Llama 3: end-of-text and end-of-turn ids): take the first."""
    v = f.raw.get(key, default)
    if isinstance(v, list) and v:
        f = _Fields({key: v[0]}, f.path)
    return f.get(key, default, "id")


_GPT2_KEYS = ("n_embd", "n_layer", "n_head", "n_positions", "n_inner")
_LLAMA_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "num_key_value_heads", "rms_norm_eps", "max_position_embeddings")


def model_type_of(raw, path):
    """The family of a HF config dict: its model_type, else the one its architectures name (LlamaForCausalLM ->
    llama), else gpt2 for GPT-2's own keys (n_embd, n_layer: configs older than model_type). Llama-style keys
    (hidden_size, ...) without either cannot tell llama from qwen2 or qwen3, whose weights differ only in biases
    and norms, so they are refused rather than read as the GPT-2 they are not."""
    if "model_type" in raw:
        return raw["model_type"]
    archs = raw.get("architectures")
    if archs:
        by_class = {c: mt for mt, classes in ARCHITECTURES.items() for c in classes}
        by_class.update({c.replace("ForCausalLM", "Model").replace("LMHeadModel", "Model"): mt
                         for c, mt in list(by_class.items())})
        families = {by_class.get(a) for a in archs} if isinstance(archs, list) else {None}
        if None in families or len(families) != 1:
            raise ValueError(f"{path}: no model_type, and architectures {archs!r} name no one supported family "
                             f"({', '.join(ARCHITECTURES)}); add \"model_type\"")
        return families.pop()
    llama = [k for k in _LLAMA_KEYS if k in raw]
    if llama:
        raise ValueError(f"{path}: no model_type (nor architectures): its keys ({', '.join(llama[:3])}) are the "
                         f"Llama family's, but not which of llama, qwen2, qwen3; add \"model_type\"")
    if not any(k in raw for k in _GPT2_KEYS):
        raise ValueError(f"{path}: no model_type (nor architectures, nor any size key): add \"model_type\"")
    return "gpt2"


def config_from_hf(raw, path):
    """GPTConfig from a HF config.json dict; ValueError naming `path` and the field for what is not supported."""
    f = _Fields(raw, path)
    mt = model_type_of(raw, path)
    if mt == "gpt2":
        for key, ok in (("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False)):
            if raw.get(key, ok) != ok:
                raise ValueError(f"{path}: {key}={raw[key]} is not supported")
        if raw.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{path}: activation_function {raw['activation_function']!r} is not supported")
        n_embd = f.get("n_embd", 768, "size")
        if raw.get("n_inner") not in (None, 4 * n_embd):
            raise ValueError(f"{path}: n_inner={raw['n_inner']} is not supported (must be 4*n_embd)")
        ours = raw.get("nano_rlhf", {})
        cfg = GPTConfig(vocab_size=f.get("vocab_size", 50257, "size"), block_size=f.get("n_positions", 1024, "size"),
                        n_layer=f.get("n_layer", 12, "size"), n_head=f.get("n_head", 12, "size"), n_embd=n_embd,
                        dropout=f.get("resid_pdrop", 0.1, "float"),
                        bias=_Fields(ours if isinstance(ours, dict) else {}, path).get("bias", True, "bool"),
                        layer_norm_epsilon=f.get("layer_norm_epsilon", 1e-5, "float"),
                        eos_token_id=_first_id(f, "eos_token_id", 50256),
                        pad_token_id=f.get("pad_token_id", None, "id"),
                        tie_word_embeddings=True)
        check_config(cfg, path)
        return cfg
    if mt not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"{path}: model_type {mt!r} is not supported (gpt2, llama, qwen2, qwen3)")
    for key, v in raw.items():
        if ("expert" in key or "moe" in key) and v not in (None, 0, False, [], {}):
            raise ValueError(f"{path}: {key}={v!r}: mixture-of-experts models are not supported")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window=true: sliding-window attention is not supported")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{path}: layer_types {sorted(set(layer_types))}: only full_attention is supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (silu)")
    if raw.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias=true is not supported")
    rope = {}
    for key in ("rope_scaling", "rope_parameters"):      # transformers 5 writes rope_parameters
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ValueError(f"{path}: {key} must be an object, got {raw[key]!r}")
        rope.update(raw.get(key) or {})
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = {"rope_type": "llama3", **{k: _Fields(rope, path).get(k, None, "float") for k in need}}
    elif rope_type != "default":
        raise ValueError(f"{path}: rope_type {rope_type!r} is not supported (default, llama3)")
    theta = _Fields(rope, path).get("rope_theta", f.get("rope_theta", 10000.0, "float"), "float")
    hidden, heads = f.get("hidden_size", None, "size"), f.get("num_attention_heads", None, "size")
    head_dim = raw.get("head_dim") or (128 if mt == "qwen3" else hidden // heads)
    cfg = GPTConfig(model_type=mt, vocab_size=f.get("vocab_size", None, "size"),
                    block_size=f.get("max_position_embeddings", 2048 if mt == "llama" else 32768, "size"),
                    n_layer=f.get("num_hidden_layers", None, "size"), n_head=heads, n_embd=hidden,
                    n_kv_head=f.get("num_key_value_heads", heads, "size"),
                    head_dim=_Fields({"head_dim": head_dim}, path).get("head_dim", 0, "int"),
                    intermediate_size=f.get("intermediate_size", None, "size"),
                    rms_norm_eps=f.get("rms_norm_eps", 1e-6, "float"), rope_theta=float(theta), rope_scaling=scaling,
                    attention_bias=True if mt == "qwen2" else f.get("attention_bias", False, "bool"),
                    qk_norm=mt == "qwen3", tie_word_embeddings=f.get("tie_word_embeddings", False, "bool"),
                    dropout=f.get("attention_dropout", 0.0, "float"), bias=False,
                    bos_token_id=_first_id(f, "bos_token_id"), eos_token_id=_first_id(f, "eos_token_id"),
                    pad_token_id=_first_id(f, "pad_token_id"))
    check_config(cfg, path)
    return cfg
