"""The pieces the models are built from: the attention of each family (GPT-2's fused c_attn, the Llama family's
grouped-query q/k/v projections with rotary positions and optional q/k norms), the MLPs (GELU, SwiGLU), the
norms, the pre-norm residual blocks, and the attention masks with their position ids (right-padded, left-padded,
packed documents, a full (B, T, T) mask). model.py assembles them into the trunk, GPT and ScoreModel; its module
docstring says what each kind of mask means for a row.
"""
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt_config import GPTConfig


def attend(q, k, v, attn_mask=None, dropout_p=0.0):
    """SDPA over (B, H, Tq, hd) queries and (B, H_kv, Tk, hd) keys/values (grouped-query when H_kv < H).
    Without a mask it is causal when queries and keys are the same positions."""
    causal = attn_mask is None and k.shape[2] == q.shape[2] and q.shape[2] > 1
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
