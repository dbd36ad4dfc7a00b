"""Causal language models in plain PyTorch, two families behind one API: GPT-2 and the Llama family (Llama, Qwen2,
Qwen3). GPT is the policy, ScoreModel (trunk + scalar head) the reward model and critic. In reading order: the
model's shape (GPTConfig), the layers (attention, MLPs, norms, blocks, the masks and their position ids), the trunk
and the two models, and HF directories in and out. Knows nothing of tokenizers or training.

Read the ordinary forward first: `_Trunk.forward` (embeddings -> blocks -> final norm -> hidden states) and
`GPT.forward` (hidden states -> logits). The faster paths live beside it, each named, tested against it and
computing the same numbers: `_Trunk.forward_cached` (KV-cache decoding, driven by the rollout engine in
sampling.py), `_Trunk.forward_at` (the hidden state at one position per row, for end scores), `select` in
`GPT.hidden_states` (the output layer only where a loss needs it) and `token_logprobs` (the output layer in
chunks of positions, for real vocabularies).

Module names follow HF (GPT-2: transformer.wte, transformer.h.0.attn.c_attn, ...; Llama family: model.embed_tokens,
model.layers.0.self_attn.q_proj, ..., lm_head), so a checkpoint converts key for key (the last section).

Padding. With an attention mask (1 = token, 0 = pad), position ids are cumsum(mask) - 1, so a left- or
right-padded row gives the same logits on its real tokens as the row alone. Right-padded batches (SFT,
DPO, reward training) need no mask at all: causal attention never lets a real token see a later pad and
positions 0..T-1 are already right, so they take the fast `is_causal` path.

Documents (packed rows). `doc_ids` (B, T) numbers the documents of each row (any ids; pads may carry their
own, e.g. -1, or be marked by a (B, T) attention_mask): a token attends only to earlier tokens of its own
document and its position is its index inside that document, so every document gets exactly the logits it
has alone in a row. A (B, T, T) attention_mask (query, key; True/1 = may attend) is taken as it is, for any
other structure; its positions default to the number of keys each query sees, minus one (= the index inside
the document for a block-diagonal causal mask).
"""
import contextlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from . import sampling


# ---- The model's shape: GPTConfig for either family (GPT-2, or Llama / Qwen2 / Qwen3), checked field by field,
# and read from an HF config.json (config_from_hf: the model type recognised, every field type-checked, one line
# naming the file for a bad one).
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


# ---- The layers: the attention of each family (GPT-2's fused c_attn, the Llama family's grouped-query q/k/v
# projections with rotary positions and optional q/k norms), the MLPs (GELU, SwiGLU), the norms, the pre-norm
# residual blocks, and the attention masks with their position ids (right-padded, left-padded, packed documents,
# a full (B, T, T) mask; the module docstring says what each kind of mask means for a row).

# SDPA's kernels on CUDA for each kind of call, fastest first: the one place they are chosen, per call (sdpa_kernel
# restores torch's flags after it; no process-wide switch). The GPU check's profile names the kernels that ran.
# - causal: a full forward with no mask (SFT, DPO and reward batches, right-padded): cuDNN's fused attention, which
#   the H200 profile shows PyTorch already picks there, 1.7-2.3x flash on Hopper training shapes (transformers
#   PR #48163); flash next.
# - masked: a boolean (B, 1, Tq, K) mask (left padding, packing, RL updates). Flash takes no mask. The
#   memory-efficient kernel first: an RL update's lengths change every step, and cuDNN builds a plan for each new
#   shape (the first-call cost the check saw, ~50 ms a new key length).
# - decode: a KV-cache step: torch's own order (None), until the rollout issue measures the engine's.
# On a CPU torch's choice stands (these flags name CUDA kernels).
SDPA_BACKENDS = {
    "causal": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH],
    "masked": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH],
    "decode": None,
}


def attend(q, k, v, attn_mask=None, dropout_p=0.0, site=None):
    """SDPA over (B, H, Tq, hd) queries and (B, H_kv, Tk, hd) keys/values (grouped-query when H_kv < H).
    Without a mask it is causal when queries and keys are the same positions. site: the SDPA_BACKENDS entry
    (default: "masked" with a mask, else "causal")."""
    causal = attn_mask is None and k.shape[2] == q.shape[2] and q.shape[2] > 1
    backends = SDPA_BACKENDS[site or ("causal" if attn_mask is None else "masked")] if q.is_cuda else None
    with sdpa_kernel(backends, set_priority=True) if backends else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, dropout_p=dropout_p,
                                              enable_gqa=k.shape[1] != q.shape[1])


def rope_frequencies(cfg):
    """(head_dim/2,) float32 inverse frequencies, computed as transformers does (default or llama3 scaling)."""
    hd = cfg.hd
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = cfg.rope_scaling
    if s is None:
        return inv
    # Llama 3: long wavelengths slowed by `factor`, short ones kept, the band between interpolated
    factor, lo, hi, old = (s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                           s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE (HF's layout: the two halves of head_dim are the pairs), x (B, H, T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def upcast(x):
    """x in float32 where precision matters (log-softmax, norms, scores), or in float64 when it already is:
    a model run in float64 (the tests' oracles) stays float64 end to end."""
    return x if x.dtype == torch.float64 else x.float()


def in_vocabulary(ids, cfg):
    """ids with every id past the embedding's rows replaced by 0. The only such id a batch can hold is a
    tokenizer's out-of-vocabulary pad (a tokenizer with no spare special token, GPT-2's; every script checks
    that the tokenizer fits the model), and pads are always masked, so any row will do. Done here, for every
    forward path (full, cached, compiled), the model needs no pad id of its own that could disagree with the
    tokenizer's, and no embedding is resized (summarize_from_feedback_details' trick)."""
    return ids.masked_fill(ids >= cfg.vocab_size, 0)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        h = upcast(x)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Attention(nn.Module):
    """Each family gives qkv(x, rope) -> q, k, v (B, heads, T, head_dim) and out(y) -> (B, T, C)."""

    def forward(self, x, rope, attn_mask=None):
        q, k, v = self.qkv(x, rope)
        return self.out(attend(q, k, v, attn_mask, self.dropout if self.training else 0.0))


class CausalSelfAttention(_Attention):      # GPT-2
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)   # fused q | k | v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def qkv(self, x, rope=None):
        B, T, C = x.shape
        return tuple(t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))

    def out(self, y):
        B, H, T, hd = y.shape
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, H * hd)))


class LlamaAttention(_Attention):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv, self.hd, self.dropout = cfg.n_head, cfg.kv_heads, cfg.hd, cfg.dropout
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.n_head * cfg.hd, cfg.n_embd, bias=cfg.attention_bias and cfg.model_type != "qwen2")
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(cfg.hd, cfg.rms_norm_eps), RMSNorm(cfg.hd, cfg.rms_norm_eps)

    def qkv(self, x, rope):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = (t.to(q.dtype)[:, None] for t in rope)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v

    def out(self, y):
        B, H, T, hd = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))


class MLP(nn.Module):                        # GPT-2
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's gelu_new


class SwiGLU(nn.Module):                     # Llama family
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _alias(name):
    """A shared name for a family's HF-named module (state-dict keys stay HF's: the alias is not registered)."""
    return property(lambda self: getattr(self, name))


class _Block(nn.Module):
    """Pre-norm residual block; `norm_1, attention, norm_2, mlp` name each family's modules."""

    def forward(self, x, rope, attn_mask=None):
        x = x + self.attention(self.norm_1(x), rope, attn_mask)
        return x + self.mlp(self.norm_2(x))


class Block(_Block):                         # GPT-2
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon, bias=cfg.bias)
        self.mlp = MLP(cfg)

    norm_1, attention, norm_2 = _alias("ln_1"), _alias("attn"), _alias("ln_2")


class LlamaBlock(_Block):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg)

    norm_1, attention, norm_2 = _alias("input_layernorm"), _alias("self_attn"), _alias("post_attention_layernorm")


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    """True if every row is 1...1 0...0 (with at least one token): then no mask is needed in attention."""
    m = attention_mask
    return bool(m[:, 0].all()) and bool((m[:, 1:] <= m[:, :-1]).all())


def padding_attention(attention_mask: torch.Tensor, q_len: int):
    """Position ids and the boolean SDPA mask (B, 1, q_len, K) for the last q_len queries over K keys.

    A query attends to real keys at or before it; every query also attends to itself, so rows of pad
    queries are never fully masked (SDPA would return NaN there); no real token ever sees a pad.
    """
    m = attention_mask.bool()
    K = m.shape[1]
    pos = (m.long().cumsum(-1) - 1).clamp(min=0)
    q_idx = torch.arange(K - q_len, K, device=m.device)[:, None]
    k_idx = torch.arange(K, device=m.device)[None, :]
    mask = (k_idx <= q_idx)[None, None] & m[:, None, None, :]
    mask = mask | (k_idx == q_idx)[None, None]
    return pos[:, K - q_len:], mask


def document_attention(doc_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
    """(B, T) document ids [, (B, T) padding mask] -> position ids (B, T) and the boolean SDPA mask (B, 1, T, T).

    Query t sees key s iff s <= t, both carry the same document id and (with a padding mask) both are real
    tokens; its position is the number of such keys minus one, which restarts at 0 with each document. Every
    query also sees itself, so a pad's row is never fully masked (SDPA would return NaN there) while no real
    token ever sees a pad or another document."""
    T = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    if attention_mask is not None:
        real = attention_mask.bool()
        same = same & real[:, :, None] & real[:, None, :]
    allowed = same & torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    pos = (allowed.sum(-1) - 1).clamp(min=0)
    return pos, (allowed | torch.eye(T, dtype=torch.bool, device=doc_ids.device))[:, None]


def full_attention(mask: torch.Tensor):
    """A (B, T, T) query-by-key mask (bool or 0/1) -> position ids (keys each query sees, minus one) and the SDPA
    mask (B, 1, T, T), each query also seeing itself (never a fully masked row)."""
    m = mask.bool()
    T = m.shape[-1]
    pos = (m.sum(-1) - 1).clamp(min=0)
    return pos, (m | torch.eye(T, dtype=torch.bool, device=m.device))[:, None]


LLAMA_FAMILY = ("llama", "qwen2", "qwen3")


# ---- the trunk: one ordinary forward, two faster paths beside it --------------------------------

class _Trunk(nn.Module):
    """Embeddings -> blocks -> final norm. Each family gives embed(ids, pos), rope(pos), blocks, final_norm."""
    gradient_checkpointing = False

    def forward(self, input_ids, attention_mask=None, position_ids=None, doc_ids=None):
        """The ordinary forward: (B, T) ids [, mask, positions, document ids] -> hidden states (B, T, C)."""
        x, rope, mask = self.inputs(input_ids, attention_mask, position_ids, doc_ids=doc_ids)
        return self.final_norm(self.run_blocks(self.blocks, x, rope, mask))

    def inputs(self, input_ids, attention_mask, position_ids, cache_pos=0, cached=False, doc_ids=None):
        """Embedded tokens, rotary (cos, sin) or None, and the attention mask (None = plain causal)."""
        B, T = input_ids.shape
        if doc_ids is not None or (attention_mask is not None and attention_mask.dim() == 3):
            if cached:
                raise ValueError("document ids and (B, T, T) masks are for full forwards, not KV-cache decoding")
            if doc_ids is not None and doc_ids.shape != input_ids.shape:
                raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must have the shape of input_ids {(B, T)}")
            if attention_mask is not None and attention_mask.shape not in ((B, T), (B, T, T)):
                raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must be (B, T) or (B, T, T), "
                                 f"input_ids {(B, T)}")
            if doc_ids is not None and attention_mask is not None and attention_mask.dim() == 3:
                raise ValueError("give doc_ids or a (B, T, T) attention_mask, not both")
            pos, mask = (document_attention(doc_ids, attention_mask) if doc_ids is not None
                         else full_attention(attention_mask))
            # the padding mask is folded into `mask`; what follows sees no attention_mask
            x, rope, _ = self.inputs(input_ids, None, pos if position_ids is None else position_ids, cache_pos)
            return x, rope, mask
        if cache_pos + T > self.cfg.block_size:
            raise ValueError(f"sequence of {cache_pos + T} tokens exceeds block_size {self.cfg.block_size}")
        attn_mask = None
        # a mask may come on the host (the caller's CPU copy): checked there, it costs a GPU forward no read
        if attention_mask is not None and (cached or not is_right_padded(attention_mask)):
            pos, attn_mask = padding_attention(attention_mask.to(input_ids.device, non_blocking=True), T)
            if position_ids is None:
                position_ids = pos
        if position_ids is None:
            position_ids = torch.arange(cache_pos, cache_pos + T, device=input_ids.device)[None]
        return self.embed(input_ids, position_ids), self.rope(position_ids), attn_mask

    def run_blocks(self, blocks, x, rope, mask):
        for block in blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # keep only each block's input; recompute its activations in backward (memory for compute)
                x = checkpoint(block, x, rope, mask, use_reentrant=False)
            else:
                x = block(x, rope, mask)
        return x

    def forward_cached(self, input_ids, attention_mask, position_ids, cache, cache_pos):
        """KV-cache decoding. Why: a new token attends to the stored keys/values of the prefix instead of
        recomputing them. cache: per block (k, v) of (B, n_kv_head, L, head_dim); this call's keys and values
        are written at cache_pos:cache_pos+T and it attends to cache[:, :, :cache_pos+T]. attention_mask: None
        (all real), (B, cache_pos+T) 1/0 over every token so far, or a ready (B, 1, T, K) bool SDPA mask (the
        rollout engine keeps one; position_ids are then required and nothing is checked per step).
        cache_pos may be a (T,) long tensor of write positions (the compiled static-shape decode step of
        nano_rlhf.sampling): then all L slots are attended and the (B, 1, T, L) mask hides the unwritten ones."""
        if attention_mask is not None and attention_mask.dim() == 4:
            x, rope, mask = self.embed(input_ids, position_ids), self.rope(position_ids), attention_mask
        else:
            x, rope, mask = self.inputs(input_ids, attention_mask, position_ids, cache_pos,
                                        cached=attention_mask is not None)
        static = isinstance(cache_pos, torch.Tensor)
        end = None if static else cache_pos + input_ids.shape[1]
        for block, (k_cache, v_cache) in zip(self.blocks, cache):
            q, k, v = block.attention.qkv(block.norm_1(x), rope)
            if static:
                k_cache.index_copy_(2, cache_pos, k)
                v_cache.index_copy_(2, cache_pos, v)
                k_all, v_all = k_cache, v_cache
            else:
                k_cache[:, :, cache_pos:end], v_cache[:, :, cache_pos:end] = k, v
                k_all, v_all = k_cache[:, :, :end], v_cache[:, :, :end]
            x = x + block.attention.out(attend(q, k_all, v_all, mask, site="decode"))
            x = x + block.mlp(block.norm_2(x))
        return self.final_norm(x)

    def forward_at(self, input_ids, attention_mask, position_ids, index):
        """Hidden state (B, C) at position index[b] of each row, exactly as forward() gives it. Why: a reward
        model's end score needs one position, so the last block runs its attention output and MLP on one
        token instead of T (its keys and values still come from every position)."""
        x, rope, mask = self.inputs(input_ids, attention_mask, position_ids)
        x = self.run_blocks(self.blocks[:-1], x, rope, mask)
        last, rows, T = self.blocks[-1], torch.arange(x.shape[0], device=x.device), x.shape[1]
        q, k, v = last.attention.qkv(last.norm_1(x), rope)
        keys = torch.arange(T, device=x.device)[None] <= index[:, None]          # causal for that query
        if attention_mask is not None:
            keys = keys & attention_mask.bool()
        y = attend(q[rows, :, index][:, :, None], k, v, keys[:, None, None, :],
                   last.attention.dropout if self.training else 0.0)
        x = x[rows, index][:, None] + last.attention.out(y)
        return self.final_norm(x + last.mlp(last.norm_2(x)))[:, 0]


class Transformer(_Trunk):
    """The GPT-2 trunk (HF's `transformer.*`): learned positions, LayerNorm, GELU MLP."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon, bias=cfg.bias)

    blocks, final_norm, embedding = _alias("h"), _alias("ln_f"), _alias("wte")

    def embed(self, ids, pos):
        return self.drop(self.wte(in_vocabulary(ids, self.cfg)) + self.wpe(pos))

    def rope(self, pos):
        return None


class LlamaModel(_Trunk):
    """The Llama-family trunk (HF's `model.*`): rotary positions, RMSNorm, SwiGLU, grouped-query attention."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)

    blocks, final_norm, embedding = _alias("layers"), _alias("norm"), _alias("embed_tokens")

    def embed(self, ids, pos):
        return self.embed_tokens(in_vocabulary(ids, self.cfg))

    def rope(self, pos):
        """(cos, sin), each (B or 1, T, head_dim), float32 as in transformers."""
        freqs = pos[..., None].float() * rope_frequencies(self.cfg).to(pos.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


# ---- the models ---------------------------------------------------------------------------------

def _init_weights(model, n_layer):
    """GPT-2 initialisation: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), norms 1, biases 0."""
    for name, p in model.named_parameters():
        if name.endswith(("c_proj.weight", "o_proj.weight", "down_proj.weight")):
            nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
        elif p.dim() == 2 and not name.startswith("score"):
            nn.init.normal_(p, 0.0, 0.02)
        elif p.dim() == 1 and name.endswith("weight"):
            nn.init.ones_(p)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


class _Pretrained(nn.Module):
    """What GPT and ScoreModel share: the trunk of the config's family, HF-directory I/O, the checkpointing switch."""
    head = "lm"

    def _build_trunk(self, cfg):
        check_config(cfg)
        self.cfg = cfg
        if cfg.model_type == "gpt2":
            self.transformer = Transformer(cfg)
        else:
            self.model = LlamaModel(cfg)

    @property
    def trunk(self):
        return self.transformer if self.cfg.model_type == "gpt2" else self.model

    @property
    def architecture(self):
        return ARCHITECTURES[self.cfg.model_type][self.head == "score"]

    @property
    def gradient_checkpointing(self):
        return self.trunk.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on):
        self.trunk.gradient_checkpointing = bool(on)

    def set_grad_checkpointing(self, on=True):
        """Training forwards keep only each block's input and recompute the block in backward."""
        self.gradient_checkpointing = on
        return self

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def hf_config(self, **extra):
        return hf_config(self, **extra)

    def save_pretrained(self, out_dir, **extra_config):
        """Write config.json + model.safetensors in the HF layout of the family, each file replaced atomically."""
        write_hf_dir(self, out_dir, **extra_config)

    @classmethod
    def _from_dir(cls, model_dir, overrides, allow_missing=()):
        cfg, raw, sd = read_hf_dir(model_dir, head=cls.head, allow_missing=allow_missing, **overrides)
        model = cls(cfg)        # read_hf_dir checked every key and shape against cfg: this load cannot fail
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= set(allow_missing), (missing, unexpected)
        return model, raw, sd


class GPT(_Pretrained):
    """Language model: logits = final_norm(trunk(x)) @ W.T, W = the embedding (tied) or lm_head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self._build_trunk(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        _init_weights(self, cfg.n_layer)

    def output_weight(self):
        """(V, C) output layer weight."""
        return self.trunk.embedding.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None, select=None, doc_ids=None):
        """Final hidden states (B, T, C), or (N, C) at the positions of `select`: a (B, T) bool mask (row-major
        order), or the (N,) flat indices b·T + t of those positions (no host read on a GPU: a mask's selection
        must first count its positions)."""
        h = self.trunk(input_ids, attention_mask, position_ids, doc_ids)
        if select is None:
            return h
        return h[select] if select.dtype == torch.bool else h.flatten(0, 1)[select]

    def forward(self, input_ids, attention_mask=None, position_ids=None, select=None, return_hidden=False,
                doc_ids=None, targets=None, temperature=1.0, with_entropy=False):
        """(B, T) ids [, (B, T) or (B, T, T) mask] -> (B, T, V) logits; with select (a (B, T) bool mask or (N,)
        flat indices), (N, V) there. doc_ids (B, T): packed documents, each attending only to itself with
        positions from 0 (module docstring). Why select: scripts pass the positions that predict response
        tokens, which skips the output layer (a quarter of the FLOPs at vocab 4096) on prompt and padding.
        targets (N,), the token each selected position predicts: the (N,) log-probs of token_logprobs instead
        (and the entropies, with_entropy=True), so a real vocabulary's logits are made in chunks and the output
        layer is part of the forward that --compile compiles and DDP hooks. return_hidden=True: the final hidden
        states (what a full-distribution loss such as TDPO's KL takes)."""
        h = self.hidden_states(input_ids, attention_mask, position_ids, select, doc_ids)
        if targets is not None:
            return token_logprobs(h, self.output_weight(), targets, temperature, with_entropy=with_entropy)
        return h if return_hidden else F.linear(h, self.output_weight())

    @classmethod
    def from_pretrained(cls, model_dir, **overrides):
        """Load a *ForCausalLM directory (HF or ours); a reward model's trunk loads too (score.weight dropped)."""
        return cls._from_dir(model_dir, overrides)[0]

    def generate(self, input_ids, attention_mask=None, max_new_tokens=32, temperature=1.0, top_k=None,
                 top_p=None, eos_token_id=None, pad_token_id=None, generator=None, use_cache=True, **engine):
        """Sample continuations of left-padded prompts: nano_rlhf.sampling.generate (the rollout engine), whose
        docstring says what comes back. eos_token_id: an id or a list/set of ids that end a row. engine: its
        keyword options (compile, share_prefix, compact, dtype, stats)."""
        stats = engine.pop("stats", None)
        opts = sampling.SamplingOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                        top_p=top_p, stop_ids=eos_token_id, pad_id=pad_token_id,
                                        use_cache=use_cache, **engine)
        return sampling.generate(self, input_ids, attention_mask, opts, generator, stats)


def _chunk_logprobs(h, weight, targets, temperature, with_entropy):
    logits = upcast(F.linear(h, weight))
    # x / 1.0 == x exactly: skipping it changes no bit and saves a pass over the (N, V) logits (~5% of a GPT-2 SFT
    # step on an H100, docs/benchmarks.md)
    logp = (logits if temperature == 1.0 else logits / temperature).log_softmax(-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    return (lp, -(logp.exp() * logp).sum(-1)) if with_entropy else (lp,)


# The budget of the log-prob operator: bytes of float32 logits one chunk of positions holds. None = the device's
# default (logits_budget); --logits_budget sets it for a run (training.open_run).
LOGITS_BUDGET = None


def set_logits_budget(n_bytes):
    """This process's log-prob budget in bytes; 0 = the device's default."""
    global LOGITS_BUDGET
    LOGITS_BUDGET = int(n_bytes) or None


def logits_budget(device):
    """Bytes of float32 logits token_logprobs holds at once: 128 MiB on a CPU; on CUDA min(2 GiB, 2% of the
    device's *total* memory), so that a resumed run on the same GPU chunks exactly as the run it resumes (free
    memory would vary with what else the process holds)."""
    if LOGITS_BUDGET is not None:
        return LOGITS_BUDGET
    if device.type == "cuda":
        return min(2 << 30, torch.cuda.get_device_properties(device).total_memory // 50)
    return 128 << 20


def chunk_rows(n_columns, device):
    """How many positions' float32 rows of n_columns fit in logits_budget(device) (at least one)."""
    return max(1, logits_budget(device) // (4 * n_columns))


def output_multiple(device):
    """The row multiple the output layer is padded to for its matrix product: 128 on CUDA, where a vocabulary
    that is no multiple of 8 (GPT-2's 50,257) sends cuBLAS to kernels at a quarter of the speed
    (docs/benchmarks.md); 1 (no padding) elsewhere."""
    return 128 if device.type == "cuda" else 1


def padded_rows(weight, dtype, multiple):
    """(V, C) output weight -> (V', C) in dtype, V' = V rounded up to `multiple` with zero rows appended: one
    cast and one copy for a whole batch of positions. The logits of the padded rows are not the model's: every
    caller slices them off ([..., :V]) before any softmax."""
    w = weight.to(dtype)
    extra = -weight.shape[0] % multiple
    return F.pad(w, (0, 0, 0, extra)) if extra else w


def _scaled_logits(h, w, n_vocab, temperature):
    """(n, C) hidden states, (V', C) padded weight -> (n, V) float32 logits / temperature (padded columns off)."""
    z = upcast(F.linear(h, w)[:, :n_vocab])
    return z if temperature == 1.0 else z.div_(temperature)


class _TokenLogprobs(torch.autograd.Function):
    """token_logprobs over many chunks of positions, with the memory of one. The forward keeps, per position,
    only the logsumexp of its logits and its target's log-prob (and its entropy): N floats each. The backward
    recomputes each chunk's logits from the hidden states and the output weight, which is cast (and padded) once
    for the whole call, and sums the weight's gradient over the chunks in one float32 buffer.

    With z = logits / τ, p = softmax(z), lp_t = z_t − logsumexp(z) and H = −Σ_v p_v log p_v:
        ∂lp_t/∂z = onehot(t) − p,        ∂H/∂z = −p ⊙ (log p + H),        ∂z/∂logits = 1/τ."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk, multiple):
        device = hidden.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else torch.promote_types(hidden.dtype, weight.dtype))
        with torch.autocast(device, enabled=False):
            w = padded_rows(weight, dtype, multiple)
            n, V = hidden.shape[0], weight.shape[0]
            lse = hidden.new_empty(n, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
            lp, ent = torch.empty_like(lse), (torch.empty_like(lse) if with_entropy else None)
            for s in range(0, n, chunk):
                z = _scaled_logits(hidden[s:s + chunk].to(dtype), w, V, temperature)
                t = targets[s:s + chunk, None]
                logp = z.log_softmax(-1)            # one fused pass; logsumexp(z) = z_t − log p_t
                lp[s:s + chunk] = logp.gather(-1, t).squeeze(-1)
                lse[s:s + chunk] = z.gather(-1, t).squeeze(-1) - lp[s:s + chunk]
                if with_entropy:
                    ent[s:s + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, w, targets, lse, *(() if ent is None else (ent,)))
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        return (lp, ent) if with_entropy else lp

    @staticmethod
    def backward(ctx, g_lp, g_ent=None):
        hidden, weight, w, targets, lse, *ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        n, V, tau, chunk = hidden.shape[0], weight.shape[0], ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                             device=weight.device) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                h = hidden[s:s + chunk].to(ctx.dtype)
                g = g_lp[s:s + chunk, None]
                logp = _scaled_logits(h, w, V, tau).sub_(lse[s:s + chunk, None])
                if ent:             # + g_H · ∂H/∂z
                    p = logp.exp()
                    d = logp.add_(ent[0][s:s + chunk, None]).mul_(p).mul_(-g_ent[s:s + chunk, None])
                    d.sub_(p.mul_(g))
                else:               # in place: one (chunk, V) buffer
                    d = logp.exp_().mul_(-g)
                d.scatter_add_(-1, targets[s:s + chunk, None], g)          # + g · onehot(t)
                if tau != 1.0:
                    d.div_(tau)
                d = d.to(ctx.dtype)
                if w.shape[0] > V:
                    d = F.pad(d, (0, w.shape[0] - V))       # the padded columns get no gradient
                if need_h:
                    grad_h[s:s + chunk] = d @ w
                if need_w and grad_w.dtype == d.dtype:
                    grad_w.addmm_(d.t(), h)                  # into the buffer: no (V, C) temporary
                elif need_w:
                    grad_w.add_(d.t() @ h)                   # a bf16 product summed in float32
        if need_w:
            grad_w = grad_w[:V].to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def token_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=None, with_entropy=False, pad_to=None):
    """(N, C) final hidden states, (V, C) output weight, (N,) targets -> (N,) float32 log_softmax(hidden @
    weight.T / temperature) at targets, and (N,) entropies with with_entropy=True. Every script's log-probs
    (SFT's NLL, DPO's sequence log-probs, PPO/GRPO's token log-probs, evaluation) come from here.

    Why chunks: with a real vocabulary (49k-152k) the (N, V) logits are the largest tensors of a step. When they
    fit in one chunk of chunk_size positions (default: chunk_rows, the budget logits_budget; every built-in task)
    the computation is the plain one. Otherwise _TokenLogprobs computes them chunk_size positions at a time and
    recomputes each chunk in backward, so the peak is one chunk's; the result equals the plain computation to
    rounding. pad_to: the row multiple of the output layer's product (default output_multiple: 128 on CUDA, 1
    on a CPU); the padded columns never reach the softmax."""
    if chunk_size is None:
        chunk_size = chunk_rows(weight.shape[0], hidden.device)
    multiple = output_multiple(hidden.device) if pad_to is None else pad_to
    if hidden.shape[0] <= chunk_size and weight.shape[0] % multiple == 0:     # the plain computation
        out = _chunk_logprobs(hidden, weight, targets, temperature, with_entropy)
        return out if with_entropy else out[0]
    return _TokenLogprobs.apply(hidden, weight, targets, float(temperature), with_entropy, chunk_size, multiple)


class ScoreModel(_Pretrained):
    """Trunk + a scalar head: the reward model and the PPO critic (HF *ForSequenceClassification, one label).
    Returns per-token scores (B, T) and end_scores (B,) at each row's last real token (from the mask).

    transformers instead reads the score at the rightmost token that is not config.json's pad_token_id (and
    refuses batches of more than one row when it is null). The two agree, on either padding side, when the
    saved pad_token_id is an id that never occurs as a real token of a scored sequence: a pad distinct from
    the end-of-text / end-of-turn token that closes each response, and inside the vocabulary."""
    head = "score"

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self._build_trunk(cfg)
        self.score = nn.Linear(cfg.n_embd, 1, bias=False)
        _init_weights(self, cfg.n_layer)
        self.init_head()

    def init_head(self):
        # N(0, 1/sqrt(d+1)) keeps initial rewards O(1) whatever the width (lm-human-preferences)
        nn.init.normal_(self.score.weight, 0.0, 1.0 / math.sqrt(self.cfg.n_embd + 1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, end_only=False):
        """-> (per-token scores (B, T), end scores (B,)). end_only=True (the reward model's case) returns
        (None, end scores) through the trunk's forward_at, which skips most of the last block."""
        last = last_token_index(input_ids, attention_mask)
        if end_only:
            return None, self.score(self.trunk.forward_at(input_ids, attention_mask, position_ids, last)).view(-1)
        scores = self.score(self.trunk(input_ids, attention_mask, position_ids)).squeeze(-1)     # (B, T)
        return scores, scores.gather(1, last[:, None]).squeeze(1)

    @classmethod
    def from_pretrained(cls, model_dir, new_head=False, **overrides):
        """Load a *ForSequenceClassification directory. With new_head=True a language-model directory
        (no `score.weight`) is accepted too: its trunk is loaded and the head freshly initialised."""
        model, raw, sd = cls._from_dir(model_dir, overrides, allow_missing=("score.weight",) if new_head else ())
        model.extra_config = {k: raw[k] for k in SCORE_CONFIG if k in raw}
        return model


# what train_rm.py records in a score model's config.json beside the shape: a reward model's score statistics (PPO
# normalises by them), or "score_kind": "cost" and a cost model's eval-set statistics (read, never normalised by)
SCORE_CONFIG = ("reward_mean", "reward_std", "score_kind", "cost_mean", "cost_std", "cost_unsafe_share",
                "cost_sign_accuracy")


def last_token_index(input_ids, attention_mask=None):
    """(B,) index of each row's last real token (mask 1); T-1 without a mask."""
    B, T = input_ids.shape
    if attention_mask is None:
        return torch.full((B,), T - 1, dtype=torch.long, device=input_ids.device)
    ar = torch.arange(T, device=input_ids.device)
    return (ar * attention_mask.long()).argmax(-1)


def config_from_dict(d):
    """GPTConfig from a dict, ignoring unknown keys."""
    names = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in d.items() if k in names})


def config_to_dict(cfg):
    return asdict(cfg)


def non_finite(state_dict):
    """The names of the floating-point tensors of a state dict that hold a NaN or an infinity (a sharded tensor:
    this rank's shard)."""
    return [k for k, t in state_dict.items() if t.is_floating_point()
            and not bool(torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all())]


# ---- HF model directories in and out: config.json + model.safetensors (or shards listed in
# model.safetensors.index.json), for GPT-2 (GPT2LMHeadModel / GPT2ForSequenceClassification) and the Llama
# family (Llama/Qwen2/Qwen3 ForCausalLM / ForSequenceClassification).
#
# Reading checks before building anything: the config's fields and types, then every tensor's name and shape
# (from the safetensors headers, without loading a tensor) against the shapes the config implies. So a config
# that claims sizes its weights do not have (n_layer 100000) fails in milliseconds with one line naming the file,
# instead of allocating the model. Stored weights may be float32, float16 or bfloat16; they load as float32.
#
# Key names are HF's. GPT-2's four Conv1D matrices are stored [in, out] and transposed on the way in and out;
# everything else is copied as is (the Llama family's rotate-half RoPE needs no q/k permutation).
# The four Conv1D matrices of HF GPT-2 (stored [in, out]); everything else is copied as is.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_DTYPES = ("F32", "F16", "BF16", "F64")
_MAX_HEADER = 100_000_000


def _read_json(path, kind=dict):
    try:
        with open(path) as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    if not isinstance(obj, kind):
        raise ValueError(f"{path}: expected a JSON object, got a {type(obj).__name__}")
    return obj


# ---- weights: headers first, tensors after the check ---------------------------------------------

def safetensors_header(path):
    """{name: (shape, dtype)} from a safetensors file's header, checking the file holds all the data it names."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if size < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes: empty or truncated)")
        n = int.from_bytes(fh.read(8), "little")
        if n > min(size - 8, _MAX_HEADER):
            raise ValueError(f"{path}: not a safetensors file or truncated (header of {n} bytes, file of {size})")
        try:
            header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            out = {k: (tuple(int(d) for d in v["shape"]), v["dtype"], v["data_offsets"]) for k, v in header.items()}
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            raise ValueError(f"{path}: corrupt safetensors header") from None
    end = max((o[1] for _, _, o in out.values()), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{path}: truncated ({size} bytes; its header names {8 + n + end})")
    return {k: (shape, dtype) for k, (shape, dtype, _) in out.items()}


def weight_files(model_dir):
    """{name: (shape, dtype, file)} over model.safetensors or the shards of model.safetensors.index.json
    (the single file wins when both exist, as in transformers)."""
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return {k: (s, d, single) for k, (s, d) in safetensors_header(single).items()}
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{single}: missing (a model directory needs config.json and model.safetensors "
                                "or model.safetensors.index.json)")
    wmap = _read_json(index).get("weight_map")
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to file names")
    out = {}
    for fname in sorted(set(wmap.values())):
        path = os.path.join(model_dir, fname)
        if os.path.basename(fname) != fname or not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: missing (listed in {index})")
        header = safetensors_header(path)
        for k in (k for k, v in wmap.items() if v == fname):
            if k not in header:
                raise ValueError(f"{index}: {k} is mapped to {fname}, which does not hold it")
            out[k] = (*header[k], path)
    return out


def _our_key(cfg, key):
    """Our (= HF canonical) name for a stored tensor; None for buffers that are not weights."""
    if key.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
        return None
    if cfg.model_type == "gpt2" and not key.startswith(("transformer.", "score.", "lm_head.")):
        return "transformer." + key          # original OpenAI layout: wte.weight, h.0..., ln_f...
    return key


def expected_shapes(cfg, head=None):
    """{name: shape} of the model the config describes (head "lm", "score" or None for the trunk only), in
    our layout (GPT-2 Conv1D as Linear [out, in]); equals the built model's state_dict shapes."""
    C, V, L = cfg.n_embd, cfg.vocab_size, cfg.n_layer
    out = {}
    if cfg.model_type == "gpt2":
        b = cfg.bias
        out.update({"transformer.wte.weight": (V, C), "transformer.wpe.weight": (cfg.block_size, C),
                    "transformer.ln_f.weight": (C,), **({"transformer.ln_f.bias": (C,)} if b else {})})
        layer = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (3 * C, C), "attn.c_attn.bias": (3 * C,),
                 "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
                 "mlp.c_fc.weight": (4 * C, C), "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (C, 4 * C),
                 "mlp.c_proj.bias": (C,)}
        prefix = "transformer.h"
        layer = {k: v for k, v in layer.items() if b or not k.endswith(".bias")}
    else:
        q, kv, F_ = cfg.n_head * cfg.hd, cfg.kv_heads * cfg.hd, cfg.ffn
        out.update({"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)})
        layer = {"input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
                 "self_attn.q_proj.weight": (q, C), "self_attn.k_proj.weight": (kv, C),
                 "self_attn.v_proj.weight": (kv, C), "self_attn.o_proj.weight": (C, q),
                 "mlp.gate_proj.weight": (F_, C), "mlp.up_proj.weight": (F_, C), "mlp.down_proj.weight": (C, F_)}
        if cfg.attention_bias:
            layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
            if cfg.model_type != "qwen2":
                layer["self_attn.o_proj.bias"] = (C,)
        if cfg.qk_norm:
            layer.update({"self_attn.q_norm.weight": (cfg.hd,), "self_attn.k_norm.weight": (cfg.hd,)})
        prefix = "model.layers"
    for i in range(L):
        out.update({f"{prefix}.{i}.{k}": v for k, v in layer.items()})
    if head == "lm" and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, C)
    if head == "score":
        out["score.weight"] = (1, C)
    return out


def read_hf_dir(model_dir, head=None, allow_missing=(), **overrides):
    """Read a HF model directory (or ours) -> (GPTConfig, raw config dict, state dict in our layout, float32).

    head: "lm" (GPT), "score" (ScoreModel) or None (trunk only); the other head's weights are dropped, so a
    reward model's trunk loads into a GPT and a language model's into a ScoreModel (allow_missing=("score.weight",)).
    overrides set config fields before the check. Every error is one line naming the file."""
    cpath = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cpath):
        raise FileNotFoundError(f"{cpath}: missing (a model directory needs config.json and model.safetensors)")
    raw = _read_json(cpath)
    cfg = config_from_hf(raw, cpath)
    cfg.generation, cfg.eos_token_ids = read_generation(model_dir, raw)
    if overrides:
        for k, v in overrides.items():
            setattr(cfg, k, v)
        check_config(cfg, f"{cpath} with {overrides}")
    files = weight_files(model_dir)
    wpath = next(iter(files.values()))[2] if files else os.path.join(model_dir, "model.safetensors")
    stored = {}                                         # our name -> (file name, shape in our layout, dtype, file)
    for k, (shape, dtype, path) in files.items():
        ours = _our_key(cfg, k)
        if ours is None:
            continue
        if dtype not in _DTYPES:
            raise ValueError(f"{path}: {k} is stored as {dtype}; only float32/float16/bfloat16 weights are supported")
        stored[ours] = (k, shape[::-1] if ours.endswith(_CONV1D) and cfg.model_type == "gpt2" else shape, path)
    block_key = re.compile(r"^(?:transformer\.h|model\.layers)\.(\d+)\.")
    layers = {int(m.group(1)) for m in map(block_key.match, stored) if m}
    if len(layers) != cfg.n_layer or (layers and max(layers) != cfg.n_layer - 1):
        held = f"{len(layers)}" if len(layers) != cfg.n_layer else f"layers numbered {sorted(layers)}"
        raise ValueError(f"{cpath}: the config says {cfg.n_layer} layers (0..{cfg.n_layer - 1}) but {wpath} "
                         f"holds {held}")
    drop = {"lm": ("score.weight",), "score": ("lm_head.weight",), None: ("score.weight", "lm_head.weight")}[head]
    lm_head = stored.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None   # tied: the embedding is it
    zero_biases = ({k: stored.pop(k) for k in [k for k in stored if k.endswith(".bias")]}
                   if cfg.model_type == "gpt2" and not cfg.bias else {})   # written as zeros for transformers
    want = expected_shapes(cfg, head)
    for k in (k for k in want if k in stored):
        _, shape, path = stored[k]
        if tuple(want[k]) != tuple(shape):
            raise ValueError(f"{path}: {k} has shape {list(shape)} but the config ({cpath}) implies {list(want[k])}")
    missing = [k for k in want if k not in stored and k not in allow_missing]
    unexpected = [k for k in stored if k not in want and k not in drop]
    if missing == ["score.weight"]:
        raise ValueError(f"{model_dir}: no score head (score.weight); is this a reward model directory?")
    if missing or unexpected:
        raise ValueError(f"{wpath}: weights do not match {cpath}: missing {len(missing)} {missing[:3]}, "
                         f"unexpected {len(unexpected)} {unexpected[:3]}")
    sd = {k: _load(cfg, k, *stored[k]) for k in want if k in stored}
    for k, entry in zero_biases.items():
        if _load(cfg, k, entry[0], entry[1], entry[2]).any():
            raise ValueError(f"{entry[2]}: {k} is not zero but the config has no biases (nano_rlhf.bias false)")
    # GPT-2 ties the output layer to wte; HF writes an untied lm_head only with tie_word_embeddings false, and
    # then one that differs from wte would load silently as the wrong output layer
    if cfg.model_type == "gpt2" and lm_head is not None and raw.get("tie_word_embeddings", True) is False:
        if not torch.equal(_load(cfg, "lm_head.weight", *lm_head), sd["transformer.wte.weight"]):
            raise ValueError(f"{model_dir}: tie_word_embeddings is false and lm_head.weight differs from the "
                             "embedding (wte); this GPT ties them, so the untied output layer cannot be loaded")
    return cfg, raw, sd


def _ids(v):
    """An id or a list of ids (HF writes either) -> list of ints; anything else -> []."""
    v = v if isinstance(v, list) else [v]
    return [int(i) for i in v if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def read_generation(model_dir, raw):
    """(the directory's generation_config.json as a dict or None, every end id that it and config.json list).
    Llama 3.2 lists three ([128001, 128008, 128009]), Qwen two; an export keeps them all, so transformers'
    generate stops where the checkpoint's authors said it should."""
    path = os.path.join(model_dir, "generation_config.json")
    gen = _read_json(path) if os.path.isfile(path) else None
    ends = _ids(raw.get("eos_token_id")) + _ids((gen or {}).get("eos_token_id"))
    return gen, sorted(set(ends)) or None


def write_generation(cfg, out_dir, ends, pad_id):
    """generation_config.json: the checkpoint's own (sampling defaults and bos kept) with the export's end ids
    and pad."""
    gen = dict(cfg.generation or {})
    gen.pop("transformers_version", None)
    gen.setdefault("bos_token_id", cfg.bos_token_id if cfg.model_type != "gpt2" else cfg.eos_token_id)
    # an out-of-vocabulary pad (GPT-2's) is not for generate, which feeds pads of finished rows back in
    gen.update(eos_token_id=ends if len(ends) != 1 else ends[0],
               pad_token_id=pad_id if pad_id is not None and pad_id < cfg.vocab_size else None)
    _atomic(os.path.join(out_dir, "generation_config.json"), lambda p: _write_text(p, json.dumps(gen, indent=2) + "\n"))


def _load(cfg, ours, key, shape, path):
    try:
        with safe_open(path, framework="pt") as fh:
            t = fh.get_tensor(key)
    except Exception as e:       # the header was valid, so this is a damaged file
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: cannot read {key} ({why})") from None
    t = t.to(torch.float32)
    return t.t().contiguous() if cfg.model_type == "gpt2" and ours.endswith(_CONV1D) else t


# ---- writing ----------------------------------------------------------------------------------

def hf_state_dict(model):
    """The model's tensors under HF names and layout, float32 on CPU."""
    import torch.nn as nn
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().to("cpu", torch.float32)
        sd[k] = v.t().contiguous() if model.cfg.model_type == "gpt2" and k.endswith(_CONV1D) else v.contiguous()
    if model.cfg.model_type == "gpt2" and not model.cfg.bias:   # HF GPT-2 always has biases: write zeros
        for name, mod in model.named_modules():
            if isinstance(mod, (nn.Linear, nn.LayerNorm)) and mod.bias is None and not name.startswith("score"):
                sd[name + ".bias"] = torch.zeros(mod.weight.shape[0])
    return sd


def hf_config(model, **extra):
    """config.json of the model as transformers 5 writes it for the class (plus `extra` keys)."""
    c = model.cfg
    if c.model_type == "gpt2":
        d = {"model_type": "gpt2", "architectures": [model.architecture], "vocab_size": c.vocab_size,
             "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
             "n_head": c.n_head, "n_inner": None, "activation_function": "gelu_new",
             "layer_norm_epsilon": c.layer_norm_epsilon, "resid_pdrop": c.dropout, "embd_pdrop": c.dropout,
             "attn_pdrop": c.dropout, "initializer_range": 0.02, "scale_attn_weights": True,
             "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
             "tie_word_embeddings": True, "use_cache": True, "dtype": "float32",
             "bos_token_id": c.eos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
             "nano_rlhf": {"bias": c.bias}}
    else:
        rope = {"rope_theta": c.rope_theta, "rope_type": "default"}
        if c.rope_scaling:
            rope.update(c.rope_scaling)
        d = {"architectures": [model.architecture], "model_type": c.model_type, "vocab_size": c.vocab_size,
             "hidden_size": c.n_embd, "intermediate_size": c.ffn, "num_hidden_layers": c.n_layer,
             "num_attention_heads": c.n_head, "num_key_value_heads": c.kv_heads, "head_dim": c.hd,
             "hidden_act": "silu", "max_position_embeddings": c.block_size, "rms_norm_eps": c.rms_norm_eps,
             "rope_parameters": rope, "attention_dropout": c.dropout, "initializer_range": 0.02,
             "tie_word_embeddings": c.tie_word_embeddings, "use_cache": True, "dtype": "float32",
             "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id}
        if c.model_type == "llama":
            d.update(attention_bias=c.attention_bias, mlp_bias=False, pretraining_tp=1)
        else:
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layer,
                     layer_types=["full_attention"] * c.n_layer)
            if c.model_type == "qwen3":
                d["attention_bias"] = c.attention_bias
    if model.head == "score":
        d.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, num_labels=1)
    d.update(extra)
    return d


def _atomic(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def write_hf_dir(model, out_dir, **extra_config):
    """config.json + model.safetensors (single file, float32) in the family's HF layout, each replaced atomically."""
    os.makedirs(out_dir, exist_ok=True)
    _atomic(os.path.join(out_dir, "model.safetensors"),
            lambda p: save_file(hf_state_dict(model), p, metadata={"format": "pt"}))
    cfg = hf_config(model, **extra_config)
    _atomic(os.path.join(out_dir, "config.json"), lambda p: _write_text(p, json.dumps(cfg, indent=2) + "\n"))
    if model.head != "score":
        ends = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
        write_generation(model.cfg, out_dir, [e for e in ends if e is not None], cfg["pad_token_id"])
