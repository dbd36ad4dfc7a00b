"""Causal language models in plain PyTorch, two families behind one API: GPT-2 and the Llama family (Llama, Qwen2,
Qwen3). GPT is the policy, ScoreModel (trunk + scalar head) the reward model and critic. The pieces they are built
from (attention, MLPs, norms, blocks, the masks and position ids below) are in layers.py.

Read the ordinary forward first: `_Trunk.forward` (embeddings -> blocks -> final norm -> hidden states) and
`GPT.forward` (hidden states -> logits). The faster paths live beside it, each named, tested against it and
computing the same numbers: `_Trunk.forward_cached` (KV-cache decoding, driven by the rollout engine in
sampling.py), `_Trunk.forward_at` (the hidden state at one position per row, for end scores), `select` in
`GPT.hidden_states` (the output layer only where a loss needs it) and `token_logprobs` (the output layer in
chunks of positions, for real vocabularies).

Module names follow HF (GPT-2: transformer.wte, transformer.h.0.attn.c_attn, ...; Llama family: model.embed_tokens,
model.layers.0.self_attn.q_proj, ..., lm_head), so a checkpoint converts key for key (hf_io.py).

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
import math
from dataclasses import asdict, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import sampling
from .sampling import inverse_cdf_sample, sample_token  # noqa: F401  (re-exported: they lived here)
# GPTConfig, check_config and ARCHITECTURES are defined in gpt_config.py (reading a config needs them; it imports
# nothing of ours) and re-exported here, as is read_hf_dir (`from nano_rlhf.model import GPTConfig, read_hf_dir`)
from .gpt_config import ARCHITECTURES, GPTConfig, check_config  # noqa: F401
from .hf_io import hf_config, read_hf_dir, write_hf_dir  # noqa: F401
# the pieces (attention, MLPs, norms, blocks, masks and positions) are in layers.py; the names other files import
# from here (upcast, in_vocabulary, document_attention, rope_frequencies, _Block) stay importable from here
from .layers import (Block, LlamaBlock, RMSNorm, _alias, _Block, apply_rope, attend, document_attention,  # noqa: F401
                     full_attention, in_vocabulary, is_right_padded, padding_attention, rope_frequencies, upcast)

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
        if attention_mask is not None and (cached or not is_right_padded(attention_mask)):
            pos, attn_mask = padding_attention(attention_mask, T)
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
            x = x + block.attention.out(attend(q, k_all, v_all, mask))
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
        """Final hidden states (B, T, C), or (N, C) at the positions of the (B, T) bool `select` (row-major)."""
        h = self.trunk(input_ids, attention_mask, position_ids, doc_ids)
        return h if select is None else h[select]

    def forward(self, input_ids, attention_mask=None, position_ids=None, select=None, return_hidden=False,
                doc_ids=None):
        """(B, T) ids [, (B, T) or (B, T, T) mask] -> (B, T, V) logits; with select (B, T) bool, (N, V) there.
        doc_ids (B, T): packed documents, each attending only to itself with positions from 0 (module docstring).
        Why select: scripts pass the positions that predict response tokens, which skips the output layer
        (a quarter of the FLOPs at vocab 4096) on prompt and padding positions. return_hidden=True returns the
        final hidden states instead (what token_logprobs takes, so a real vocabulary's logits are made in
        chunks); it goes through forward so that a DDP-wrapped model can be called for it."""
        h = self.hidden_states(input_ids, attention_mask, position_ids, select, doc_ids)
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


LOGITS_BUDGET = 1 << 25   # elements of float32 logits held at once by token_logprobs (128 MiB)


def token_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=None, with_entropy=False):
    """(N, C) final hidden states, (V, C) output weight, (N,) targets -> (N,) float32 log_softmax(hidden @
    weight.T / temperature) at targets, and (N,) entropies with with_entropy=True.

    Why chunks: with a real vocabulary (49k-152k) the (N, V) logits are the largest tensors of a step. Computing
    them chunk_size positions at a time, and recomputing each chunk in backward (checkpoint), bounds the peak by
    (chunk_size, V) in forward and backward; the result equals the unchunked computation. chunk_size=None takes
    as many positions as fit in LOGITS_BUDGET elements; when one chunk holds every position nothing is
    recomputed (a small vocabulary pays nothing for the bound)."""
    if chunk_size is None:
        chunk_size = max(1, LOGITS_BUDGET // weight.shape[0])
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if hidden.shape[0] <= chunk_size:   # one chunk: the plain computation, no recompute
        out = _chunk_logprobs(hidden, weight, targets, temperature, with_entropy)
        return out if with_entropy else out[0]
    parts = []
    for s in range(0, hidden.shape[0], chunk_size):
        args = (hidden[s:s + chunk_size], weight, targets[s:s + chunk_size], temperature, with_entropy)
        parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args))
    out = [torch.cat(p) for p in zip(*parts)]
    return tuple(out) if with_entropy else out[0]


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
        model.extra_config = {k: raw[k] for k in ("reward_mean", "reward_std") if k in raw}
        return model


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

