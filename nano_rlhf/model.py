"""GPT-2 in plain PyTorch: the policy (GPT), the reward model / critic (ScoreModel), KV-cache sampling,
and import/export of the HuggingFace GPT-2 checkpoint layout (config.json + model.safetensors).

Module names follow HF's GPT-2 (transformer.wte, transformer.h.0.attn.c_attn, ...), so converting a
state dict is a key-for-key copy with the four Conv1D matrices transposed (HF stores them [in, out]).

Padding. With an attention mask (1 = token, 0 = pad), position ids are cumsum(mask) - 1, so a left- or
right-padded row gives the same logits on its real tokens as the row alone. Right-padded batches (SFT,
DPO, reward training) need no mask at all: causal attention never lets a real token see a later pad and
positions 0..T-1 are already right, so they take the fast `is_causal` path.
"""
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


@dataclass
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 64                     # maximum sequence length (HF: n_positions)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0                     # residual, attention and embedding dropout (0 for all RLHF stages)
    bias: bool = True                        # biases in Linear and LayerNorm (GPT-2: True)
    layer_norm_epsilon: float = 1e-5
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None       # may lie outside the vocabulary (GPT-2's tokenizer has no pad)


# The four Conv1D matrices of HF GPT-2 (stored [in, out]); everything else is copied as is.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)   # fused q | k | v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask=None, cache=None, cache_pos=0, query_index=None):
        B, T, C = x.shape
        if query_index is not None:   # one query per row, at query_index, over every key (see Transformer)
            w, b = self.c_attn.weight, self.c_attn.bias
            q = F.linear(x[torch.arange(B, device=x.device), query_index], w[:C], None if b is None else b[:C])
            k, v = F.linear(x, w[C:], None if b is None else b[C:]).split(C, dim=2)
            q = q.view(B, 1, self.n_head, C // self.n_head).transpose(1, 2)
            k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                               dropout_p=self.dropout if self.training else 0.0)
            return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, 1, C)))
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        if cache is not None:  # write this step's keys/values into the preallocated cache, attend to all so far
            k_cache, v_cache = cache
            k_cache[:, :, cache_pos:cache_pos + T] = k
            v_cache[:, :, cache_pos:cache_pos + T] = v
            k, v = k_cache[:, :, :cache_pos + T], v_cache[:, :, :cache_pos + T]
        causal = attn_mask is None and k.shape[2] == T and T > 1   # no mask given: plain causal attention
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's gelu_new


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, attn_mask=None, cache=None, cache_pos=0, query_index=None):
        if query_index is not None:   # keys/values from every position, output only at query_index: (B, 1, C)
            x_q = x[torch.arange(x.shape[0], device=x.device), query_index][:, None]
            x = x_q + self.attn(self.ln_1(x), attn_mask, query_index=query_index)
        else:
            x = x + self.attn(self.ln_1(x), attn_mask, cache, cache_pos)
        return x + self.mlp(self.ln_2(x))


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


class Transformer(nn.Module):
    """The GPT-2 trunk (HF's `transformer.*`): embeddings, blocks, final LayerNorm -> hidden states."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon, bias=cfg.bias)

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, cache_pos=0, last_index=None):
        """-> hidden states (B, T, C). With last_index (B,), the last block computes only the output at that
        position of each row, (B, 1, C): all a reward model's end score needs. The last block's queries,
        output projection and MLP then run on one token instead of T (a fifth of the trunk at 4 layers);
        its keys and values still come from every position, so the result is exact."""
        B, T = input_ids.shape
        if cache_pos + T > self.cfg.block_size:
            raise ValueError(f"sequence of {cache_pos + T} tokens exceeds block_size {self.cfg.block_size}")
        pad = self.cfg.pad_token_id
        if pad is not None and pad >= self.cfg.vocab_size:
            # a pad id outside the vocabulary (e.g. GPT-2's tokenizer): it is always masked, so any
            # embedding row will do; this avoids resizing the embedding (summarize_from_feedback_details)
            input_ids = input_ids.masked_fill(input_ids == pad, 0)
        attn_mask = None
        if attention_mask is not None and not (cache is None and is_right_padded(attention_mask)):
            pos, attn_mask = padding_attention(attention_mask, T)
            if position_ids is None:
                position_ids = pos
        if position_ids is None:
            position_ids = torch.arange(cache_pos, cache_pos + T, device=input_ids.device)[None]
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for i, block in enumerate(self.h):
            if last_index is not None and i == len(self.h) - 1:
                keys = torch.arange(T, device=x.device)[None] <= last_index[:, None]      # causal for that query
                if attention_mask is not None:
                    keys = keys & attention_mask.bool()
                x = block(x, keys[:, None, None, :], query_index=last_index)
            else:
                x = block(x, attn_mask, None if cache is None else cache[i], cache_pos)
        return self.ln_f(x)


class _Pretrained(nn.Module):
    """Shared HF-directory I/O for GPT and ScoreModel."""
    architecture = ""

    def _hf_state_dict(self):
        sd = {}
        for k, v in self.state_dict().items():
            v = v.detach().to("cpu", torch.float32)
            sd[k] = v.t().contiguous() if k.endswith(_CONV1D) else v.contiguous()
        if not self.cfg.bias:  # HF GPT-2 always has biases: write zeros so transformers can load it
            for name, mod in self.named_modules():
                if isinstance(mod, (nn.Linear, nn.LayerNorm)) and mod.bias is None:
                    sd[name + ".bias"] = torch.zeros(mod.weight.shape[0])
        return sd

    def hf_config(self, **extra):
        c = self.cfg
        d = {"model_type": "gpt2", "architectures": [self.architecture], "vocab_size": c.vocab_size,
             "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
             "n_head": c.n_head, "n_inner": None, "activation_function": "gelu_new",
             "layer_norm_epsilon": c.layer_norm_epsilon, "resid_pdrop": c.dropout, "embd_pdrop": c.dropout,
             "attn_pdrop": c.dropout, "initializer_range": 0.02, "scale_attn_weights": True,
             "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
             "tie_word_embeddings": True, "use_cache": True, "dtype": "float32",
             "bos_token_id": c.eos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
             "nano_rlhf": {"bias": c.bias}}
        d.update(extra)
        return d

    def save_pretrained(self, out_dir, **extra_config):
        """Write config.json + model.safetensors in the HF GPT-2 layout, each file replaced atomically."""
        os.makedirs(out_dir, exist_ok=True)
        _atomic(os.path.join(out_dir, "model.safetensors"),
                lambda p: save_file(self._hf_state_dict(), p, metadata={"format": "pt"}))
        cfg = self.hf_config(**extra_config)
        _atomic(os.path.join(out_dir, "config.json"),
                lambda p: open(p, "w").write(json.dumps(cfg, indent=2) + "\n"))


def _atomic(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def read_hf_dir(model_dir):
    """Read config.json and model.safetensors of a HF GPT-2 directory (or ours) -> (GPTConfig, raw config,
    state dict in our layout). Accepts keys with or without the `transformer.` prefix, an extra
    `lm_head.weight` (tied, ignored; an untied one that differs from wte is an error) and stale
    `attn.bias`/`attn.masked_bias` buffers (ignored)."""
    cpath, wpath = os.path.join(model_dir, "config.json"), os.path.join(model_dir, "model.safetensors")
    for p in (cpath, wpath):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p}: missing (a model directory needs config.json and model.safetensors)")
    with open(cpath) as f:
        raw = json.load(f)
    if raw.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{cpath}: model_type {raw.get('model_type')!r} is not gpt2")
    for key, ok in (("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False)):
        if raw.get(key, ok) != ok:
            raise ValueError(f"{cpath}: {key}={raw[key]} is not supported")
    if raw.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{cpath}: activation_function {raw['activation_function']!r} is not supported")
    n_embd = raw.get("n_embd", 768)
    if raw.get("n_inner") not in (None, 4 * n_embd):
        raise ValueError(f"{cpath}: n_inner={raw['n_inner']} is not supported (must be 4*n_embd)")
    cfg = GPTConfig(vocab_size=raw.get("vocab_size", 50257), block_size=raw.get("n_positions", 1024),
                    n_layer=raw.get("n_layer", 12), n_head=raw.get("n_head", 12), n_embd=n_embd,
                    dropout=raw.get("resid_pdrop", 0.1), bias=raw.get("nano_rlhf", {}).get("bias", True),
                    layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-5),
                    eos_token_id=raw.get("eos_token_id", 50256), pad_token_id=raw.get("pad_token_id"))
    sd, lm_head = {}, None
    for k, v in load_file(wpath).items():
        if k == "lm_head.weight":
            lm_head = v
            continue
        if k.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if not k.startswith(("transformer.", "score.")):
            k = "transformer." + k          # original OpenAI layout: wte.weight, h.0..., ln_f...
        sd[k] = v.t() if k.endswith(_CONV1D) else v
    # our GPT ties the output layer to wte, so lm_head.weight is dropped; that is exact only if it equals
    # wte (HF itself ties them unless tie_word_embeddings is false). An untied head would load silently
    # as the wrong output layer.
    wte = sd.get("transformer.wte.weight")
    if (raw.get("tie_word_embeddings", True) is False and lm_head is not None
            and (wte is None or not torch.equal(lm_head, wte))):
        raise ValueError(f"{model_dir}: tie_word_embeddings is false and lm_head.weight differs from the "
                         "embedding (wte); this GPT ties them, so the untied output layer cannot be loaded")
    if not cfg.bias:
        sd = {k: v for k, v in sd.items() if not (k.endswith(".bias") and not v.any())}
    return cfg, raw, sd


def _init_weights(model, n_layer):
    """GPT-2 initialisation: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), zero biases."""
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
        elif name.endswith(("wte.weight", "wpe.weight")) or (p.dim() == 2 and not name.startswith("score")):
            nn.init.normal_(p, 0.0, 0.02)
        elif "ln_" in name and name.endswith("weight"):
            nn.init.ones_(p)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


def _load(model, sd, path, strict_keys):
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k not in strict_keys]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config (missing {missing[:4]}, unexpected {unexpected[:4]})")


class GPT(_Pretrained):
    """GPT-2 language model: logits = ln_f(trunk(x)) @ wte.T (tied embeddings)."""
    architecture = "GPT2LMHeadModel"

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = Transformer(cfg)
        _init_weights(self, cfg.n_layer)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids, attention_mask=None, position_ids=None, select=None):
        """(B, T) ids [, (B, T) mask] -> (B, T, V) logits.

        select: optional (B, T) bool; then only the logits at those positions are computed, (N, V) in
        row-major order. Training scripts pass the positions that predict response tokens, which skips
        the output layer (a quarter of the model's FLOPs at vocab 4096) on prompt and padding positions.
        """
        h = self.transformer(input_ids, attention_mask, position_ids)
        if select is not None:
            h = h[select]
        return F.linear(h, self.transformer.wte.weight)

    @classmethod
    def from_pretrained(cls, model_dir, **overrides):
        cfg, _, sd = read_hf_dir(model_dir)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        model = cls(cfg)
        sd = {k: v for k, v in sd.items() if not k.startswith("score.")}   # a reward model's trunk loads too
        _load(model, sd, model_dir, strict_keys=())
        return model

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens=32, temperature=1.0, top_k=None,
                 top_p=None, eos_token_id=None, pad_token_id=None, generator=None, use_cache=True):
        """Sample continuations of left-padded prompts.

        input_ids, attention_mask: (B, Tp) prompts, left-padded (mask 0 on pads). temperature 0 = greedy.
        Returns (B, Tp + n) ids, n <= max_new_tokens: prompts followed by the new tokens; after a row's
        first eos_token_id every position holds pad_token_id. Stops early when every row has ended.
        The KV cache is preallocated once; the prompt's logits are computed only at its last position.
        """
        B, Tp = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if Tp + max_new_tokens > self.cfg.block_size:
            raise ValueError(f"prompt ({Tp}) + max_new_tokens ({max_new_tokens}) exceeds block_size {self.cfg.block_size}")
        pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)
        was_training = self.training
        self.eval()
        ids, mask = input_ids, attention_mask.long()
        finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
        left_padded = not bool(mask.all())
        cache = None
        if use_cache:
            H, hd = self.cfg.n_head, self.cfg.n_embd // self.cfg.n_head
            cache = [(ids.new_empty((B, H, Tp + max_new_tokens, hd), dtype=self.transformer.wte.weight.dtype),
                      ids.new_empty((B, H, Tp + max_new_tokens, hd), dtype=self.transformer.wte.weight.dtype))
                     for _ in range(self.cfg.n_layer)]
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            h = self.transformer(ids, mask if left_padded else None, pos, cache, 0)
            next_pos = pos[:, -1:] + 1
        new = []
        for step in range(max_new_tokens):
            if use_cache:
                logits = F.linear(h[:, -1], self.transformer.wte.weight)
            else:
                logits = self(ids, mask if left_padded else None)[:, -1]
            tok = sample_token(logits, temperature, top_k, top_p, generator)
            tok = torch.where(finished, torch.full_like(tok, pad), tok)
            new.append(tok)
            if eos_token_id is not None:
                finished |= tok == eos_token_id
            ids = torch.cat([ids, tok[:, None]], 1) if not use_cache else ids
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            if use_cache:
                h = self.transformer(tok[:, None], mask if left_padded else None, next_pos, cache, Tp + step)
                next_pos = next_pos + 1
        self.train(was_training)
        return torch.cat([input_ids, torch.stack(new, 1)], 1)


def sample_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """(B, V) logits -> (B,) token ids. temperature 0 = argmax; top_k/top_p filter before sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p        # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    # inverse-CDF sampling: one uniform number per row. torch.multinomial draws an exponential per vocabulary
    # entry (4096 per row), which costs more than the whole forward pass of a small model's decode step.
    cdf = logits.softmax(-1).cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[-1] - 1).squeeze(-1)


class ScoreModel(_Pretrained):
    """GPT-2 trunk + a scalar head: the reward model and the PPO critic (HF GPT2ForSequenceClassification,
    one label). Returns per-token scores (B, T) and end_scores (B,) at each row's last real token."""
    architecture = "GPT2ForSequenceClassification"

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = Transformer(cfg)
        self.score = nn.Linear(cfg.n_embd, 1, bias=False)
        _init_weights(self, cfg.n_layer)
        self.init_head()

    def init_head(self):
        # N(0, 1/sqrt(d+1)) keeps initial rewards O(1) whatever the width (lm-human-preferences)
        nn.init.normal_(self.score.weight, 0.0, 1.0 / math.sqrt(self.cfg.n_embd + 1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, end_only=False):
        """-> (per-token scores (B, T), end scores (B,)); end_only=True computes only the end scores (the
        reward model's case) and returns (None, end scores), skipping most of the last block."""
        last = last_token_index(input_ids, attention_mask)
        if end_only:
            h = self.transformer(input_ids, attention_mask, position_ids, last_index=last)   # (B, 1, C)
            return None, self.score(h).view(-1)
        h = self.transformer(input_ids, attention_mask, position_ids)
        scores = self.score(h).squeeze(-1)                               # (B, T)
        return scores, scores.gather(1, last[:, None]).squeeze(1)

    def hf_config(self, **extra):
        d = super().hf_config(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, num_labels=1)
        d.update(extra)
        return d

    @classmethod
    def from_pretrained(cls, model_dir, new_head=False, **overrides):
        """Load a GPT2ForSequenceClassification directory. With new_head=True a language-model directory
        (no `score.weight`) is accepted too: its trunk is loaded and the head freshly initialised."""
        cfg, raw, sd = read_hf_dir(model_dir)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        model = cls(cfg)
        if "score.weight" not in sd and not new_head:
            raise ValueError(f"{model_dir}: no score head (score.weight); is this a reward model directory?")
        _load(model, sd, model_dir, strict_keys=("score.weight",))
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
