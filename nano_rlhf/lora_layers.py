"""The LoRA layer and its placement on a model: `LoRALinear` (h = W x + (alpha / r) * B A x, W frozen),
`apply_lora`, `lora_modules` and the default targets of the two families. lora.py (adapters on/off, merging,
PEFT export, the scripts' --lora_* glue) re-exports all of it; parallel.py imports it from here to rebuild
adapters in its plain copies, so this module sits below both (it imports only dist).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import dist

# Attention and MLP projections of the two model families; targets=None adapts those the model has.
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / r) * dropout(x) A^T B^T, with `base` (an nn.Linear) frozen.

    The adapters are kept in float32 whatever the base's dtype (PEFT does the same): bf16 would round
    away most of each small update to A and B.
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        self.base = base
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        dev = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=dev, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=dev, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))     # nn.Linear's own init, as PEFT uses
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True
        for p in base.parameters():
            p.requires_grad_(False)

    @property
    def in_features(self):
        return self.base.in_features

    @property
    def out_features(self):
        return self.base.out_features

    def delta_weight(self):
        """(alpha / r) B A, (out, in) float32: what merging adds to the base weight."""
        return (self.lora_B @ self.lora_A) * self.scaling

    @property
    def weight(self):
        """The effective weight W + (alpha / r) B A (W alone when disabled). Code that reads `.weight`
        directly instead of calling the module (the trunk's one-query path for end scores slices the
        fused q|k|v matrix) then still sees the adapted layer; dropout is not applied on that path."""
        w = self.base.weight
        return w + self.delta_weight().to(w.dtype) if self.enabled else w

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x):
        y = self.base(x)
        if not self.enabled:
            return y
        # same order of operations as PEFT (B(A(dropout(x))) * scaling), so logits agree to rounding
        lora = F.linear(F.linear(self.dropout(x).to(self.lora_A.dtype), self.lora_A), self.lora_B) * self.scaling
        return y + lora.to(y.dtype)

    def extra_repr(self):
        return f"r={self.r}, alpha={self.alpha}, enabled={self.enabled}"


def _last(name):
    return name.rsplit(".", 1)[-1]


def lora_modules(model):
    """[(name, LoRALinear)] in module order (names as in the unwrapped model)."""
    return [(n, m) for n, m in dist.unwrap(model).named_modules() if isinstance(m, LoRALinear)]


def apply_lora(model, r: int, alpha: float, dropout: float = 0.0, targets=None, trainable=()):
    """Replace every nn.Linear whose last name component is in `targets` by a LoRALinear, in place.

    targets=None adapts the attention and MLP projections the model has (GPT-2: c_attn c_proj c_fc;
    Llama family: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj). Every other parameter is
    frozen except those of the modules named in `trainable` (matched on the last name component too:
    `trainable=("score",)` for a reward model or critic, whose freshly initialised head must be trained).
    Returns the names of the adapted modules. A target or trainable name that matches nothing is a
    ValueError naming it.
    """
    model = dist.unwrap(model)
    if lora_modules(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    available = sorted({_last(n) for n in linears})
    if targets is None:
        targets = [t for t in GPT2_TARGETS + LLAMA_TARGETS if t in available]
        if not targets:
            raise ValueError(f"apply_lora: no known attention/MLP projection in the model; pass targets "
                             f"(nn.Linear names: {', '.join(available)})")
    targets, trainable = tuple(targets), tuple(trainable)
    for t in targets:
        if t not in available:
            raise ValueError(f"LoRA target {t!r} matches no nn.Linear module (nn.Linear names: {', '.join(available)})")
    module_names = {_last(n) for n, _ in model.named_modules() if n}
    for t in trainable:
        if t not in module_names:
            raise ValueError(f"trainable module {t!r} matches no module of the model")
        if t in targets:
            raise ValueError(f"{t!r} is both a LoRA target and a fully trainable module; choose one")
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, lin in linears.items():
        if _last(name) in targets:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, LoRALinear(lin, r, alpha, dropout))
            adapted.append(name)
    for name, mod in model.named_modules():
        if _last(name) in trainable:
            for p in mod.parameters():
                p.requires_grad_(True)
    model.lora_trainable = trainable      # remembered for lora_parameters / adapter export
    return adapted
