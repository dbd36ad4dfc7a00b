"""LoRA: low-rank adapters on frozen linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models", eq. 3):

    h = W x + (alpha / r) * B A x          W (out, in) frozen;  A (r, in), B (out, r) trained

A starts Kaiming-uniform and B at zero (as in PEFT), so BA = 0 and the adapted model is exactly the base
model at step 0. Only A and B (plus any modules named in `trainable`, e.g. a reward model's score head)
receive gradients, so the optimizer state shrinks from 2 x |W| to 2 x (|A| + |B|) per layer.

Switching the adapters off gives the base model back, bit for bit: DPO's and PPO's reference policy can be
"the same model under `adapters_disabled`" instead of a second copy in memory.

Export: `merge_lora` folds W' = W + (alpha / r) B A into each layer and restores plain nn.Linear modules, so
`save_pretrained` writes an ordinary HF checkpoint; `save_peft_adapter` writes the adapter alone in PEFT's
layout (adapter_config.json + adapter_model.safetensors) for `peft.PeftModel.from_pretrained`.

Module names are HF's (model.py's convention: transformer.h.0.attn.c_attn for GPT-2,
model.layers.0.self_attn.q_proj for the Llama family), so PEFT key names are our names with a prefix.

The scripts' --lora_r / --lora_alpha / --lora_dropout / --lora_targets go through the second half of this file:
`attach` (adapters on a loaded model, before it is moved, wrapped or optimised; returns the run-identity
fields, the base's checksum among them), `BaseView` (the reference = the policy with adapters off),
and `checkpointed` (what the state holds: the adapters, not the base); checkpoint.save_model_dir writes the merged
model and out_dir/adapter in PEFT's layout.
"""
import contextlib
import copy
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from . import dist

# HF's GPT-2 stores these as Conv1D ([in, out] weights): PEFT then needs fan_in_fan_out=true to merge them.
_HF_CONV1D = ("c_attn", "c_proj", "c_fc", "q_attn")


# ---- The layer and its placement on a model ------------------------------------------------------------------
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



def _trainable_modules(model):
    names = getattr(model, "lora_trainable", ())
    return [(n, m) for n, m in model.named_modules() if n and _last(n) in names]


def lora_parameters(model):
    """The parameters to optimise: every adapter's A and B, then the modules kept trainable."""
    model = dist.unwrap(model)
    params = [p for _, m in lora_modules(model) for p in (m.lora_A, m.lora_B)]
    return params + [p for _, m in _trainable_modules(model) for p in m.parameters()]


def adapter_state_dict(model):
    """Everything that differs from the base model, in our key names (`...c_attn.lora_A`, `score.weight`):
    a few MB to keep instead of a full checkpoint."""
    model = dist.unwrap(model)
    sd = {}
    for name, m in lora_modules(model):
        sd[f"{name}.lora_A"] = m.lora_A.detach().cpu().contiguous()
        sd[f"{name}.lora_B"] = m.lora_B.detach().cpu().contiguous()
    for name, m in _trainable_modules(model):
        for pname, p in m.named_parameters():
            sd[f"{name}.{pname}"] = p.detach().cpu().contiguous()
    return sd


@contextlib.contextmanager
def adapters_disabled(model):
    """Run the base model: `with adapters_disabled(policy): ref_logits = policy(ids)` is the frozen
    reference without a second copy. Modules kept fully trainable (a score head) are not reverted: a
    reference made this way is the initial model only when they are absent. A model without adapters is a
    ValueError, so a script can never silently use the trained policy as its own reference."""
    mods = [m for _, m in lora_modules(model)]
    if not mods:
        raise ValueError("adapters_disabled: the model has no LoRA adapters")
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, e in zip(mods, before):
            m.enabled = e


@torch.no_grad()
def merge_lora(model):
    """Fold each adapter into its base weight, W' = W + (B A) (alpha / r) computed in float32, and put the
    plain nn.Linear back, in place; every parameter requires grad again (a plain model). Returns the model,
    which `save_pretrained` then writes as an ordinary HF checkpoint. Disabled adapters are merged too
    (merging is about the trained weights, not the current switch)."""
    model = dist.unwrap(model)
    for name, m in lora_modules(model):
        w = m.base.weight
        w.copy_((w.float() + (m.lora_B @ m.lora_A) * m.scaling).to(w.dtype))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, m.base)
    for p in model.parameters():
        p.requires_grad_(True)
    if hasattr(model, "lora_trainable"):
        del model.lora_trainable
    return model


def merged_copy(model):
    """A merged plain copy for a checkpoint during training (the adapters stay in `model`):
    `merged_copy(policy).save_pretrained(out_dir)`. Costs one extra copy of the model while it exists."""
    return merge_lora(copy.deepcopy(dist.unwrap(model)))


def save_peft_adapter(model, out_dir, base_model_name_or_path, task_type="CAUSAL_LM"):
    """Write the adapters in PEFT's layout: adapter_config.json + adapter_model.safetensors with keys
    `base_model.model.<HF module name>.lora_{A,B}.weight` (A: (r, in), B: (out, r), for Conv1D modules
    too) and the fully trainable modules' weights under `base_model.model.<name>.<param>` (PEFT's
    `modules_to_save`). Each file is replaced atomically. task_type: "CAUSAL_LM" for the policy,
    "SEQ_CLS" for a reward model / critic."""
    model = dist.unwrap(model)
    mods = lora_modules(model)
    if not mods:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters")
    r, alpha, p = mods[0][1].r, mods[0][1].alpha, mods[0][1].dropout
    if any((m.r, m.alpha) != (r, alpha) for _, m in mods):
        raise ValueError("save_peft_adapter: adapters with different r/alpha cannot share one adapter_config")
    targets = sorted({_last(n) for n, _ in mods})
    conv1d = [t in _HF_CONV1D for t in targets]
    if any(conv1d) and not all(conv1d):
        raise ValueError(f"save_peft_adapter: targets {targets} mix HF Conv1D and Linear modules; PEFT has one "
                         "fan_in_fan_out flag per adapter")
    trainable = list(getattr(model, "lora_trainable", ()))
    config = {"peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model_name_or_path,
              "r": r, "lora_alpha": alpha, "lora_dropout": p.p if isinstance(p, nn.Dropout) else 0.0,
              "target_modules": targets, "bias": "none", "fan_in_fan_out": all(conv1d),
              "modules_to_save": trainable or None, "inference_mode": True, "init_lora_weights": True,
              "use_rslora": False, "use_dora": False}
    tensors = {f"base_model.model.{k}.weight" if k.endswith((".lora_A", ".lora_B")) else f"base_model.model.{k}": v
               for k, v in adapter_state_dict(model).items()}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "adapter_model.safetensors")
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    path = os.path.join(out_dir, "adapter_config.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)


def trainable_and_frozen_bytes(model):
    """(bytes of parameters that train, bytes of frozen ones): with LoRA the first is the adapters (+ a
    score head), the second the base. A memory plan multiplies the first by 4 (weights, gradients, two
    AdamW moments, all float32) and counts the second once."""
    trainable = frozen = 0
    for p in dist.unwrap(model).parameters():
        n = p.numel() * p.element_size()
        if p.requires_grad:
            trainable += n
        else:
            frozen += n
    return trainable, frozen


# ---- what the scripts use: flags, the reference without a copy, checkpoints, export ----------------

# every nn.Linear name a policy or reward model of either family can have (GPT-2's output layer is tied:
# no lm_head; a Llama with untied embeddings has one)
KNOWN_TARGETS = GPT2_TARGETS + LLAMA_TARGETS + ("lm_head",)
ADAPTER_DIR = "adapter"            # out_dir/adapter: the PEFT layout, beside the merged model


def parse_targets(spec: str):
    """--lora_targets "c_attn, c_fc" -> ("c_attn", "c_fc"); "" -> None (the attention and MLP projections
    the model has). A name no model here has is a ValueError naming it (checked before any model loads)."""
    if not spec.strip():
        return None
    names = [s.strip() for s in spec.split(",")]
    for n in names:
        if not n:
            raise ValueError(f"--lora_targets {spec!r}: an empty name in the comma list")
        if n not in KNOWN_TARGETS:
            raise ValueError(f"--lora_targets: unknown module name {n!r} (the models here have: "
                             f"{', '.join(KNOWN_TARGETS)})")
    return tuple(dict.fromkeys(names))


def check_lora_options(opts, needs_init=""):
    """The --lora_* rules between options, as a one-line message (None when fine): LoRA needs a pretrained base
    to re-read on --resume (needs_init: the flag that must then be given, for the scripts that can start from
    scratch). (A --lora_* flag without --lora_r is refused by the parser: its field declares [with lora_r>0].)"""
    if not opts.lora_r:
        return None
    if needs_init and not getattr(opts, needs_init):
        return f"--lora_r trains adapters on a pretrained model: it needs --{needs_init} DIR (not a model from scratch)"
    if getattr(opts, "fsdp", False):   # the merged export copies the whole module, which a sharded one is not
        return "--lora_r with --fsdp is not supported yet: use LoRA under DDP (its training state is small)"
    try:
        parse_targets(opts.lora_targets)
    except ValueError as e:
        return str(e)
    return None


def attach(model, opts, base_dir, trainable=(), prefix="lora", seed=None):
    """--lora_r > 0: put adapters (rank --lora_r, scale --lora_alpha / --lora_r, --lora_dropout) on the
    --lora_targets of `model` (in place, before it is moved, wrapped or optimised) and freeze everything
    else but `trainable` (a reward model's or critic's "score" head). Returns what the run's identity must
    record, as `<prefix>_r`, ... `<prefix>_base_checksum`: the adapter settings and a checksum of the base
    weights, which --resume re-reads from base_dir instead of the state (a changed base is then refused
    with one line naming `<prefix>_base_checksum`); {} when --lora_r is 0 (nothing changes).

    The adapters' A is drawn with the RNG seeded with `seed` (default --seed) inside a fork of the global
    stream, which is left as it was: the same seed gives the same adapters on every rank, on any device."""
    if not opts.lora_r:
        return {}
    model = dist.unwrap(model)
    # only rank 0 compares identities (nano_rlhf.training): the other ranks skip hashing every weight
    base_checksum = f"{dist.weights_checksum(model):016x}" if dist.world().is_main else ""
    targets = parse_targets(opts.lora_targets)
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(opts.seed if seed is None else seed)
        try:
            adapted = apply_lora(model, opts.lora_r, opts.lora_alpha, opts.lora_dropout, targets, trainable)
        except ValueError as e:     # a target this model does not have: name the flag
            raise ValueError(f"--lora_targets: {e}") from None
    model.lora_base = base_dir
    return {f"{prefix}_r": opts.lora_r, f"{prefix}_alpha": opts.lora_alpha, f"{prefix}_dropout": opts.lora_dropout,
            f"{prefix}_targets": ",".join(sorted({_last(n) for n in adapted})),
            f"{prefix}_base_checksum": base_checksum}


def describe(model):
    """' | LoRA r 8 on 24 layers: 0.29M of 135M parameters train' for the start-up line ('' without)."""
    mods = lora_modules(model)
    if not mods:
        return ""
    trainable = sum(p.numel() for p in lora_parameters(model))
    total = sum(p.numel() for p in dist.unwrap(model).parameters())
    return (f" | LoRA r {mods[0][1].r} alpha {mods[0][1].alpha} on {len(mods)} layers: {trainable:,} of "
            f"{total:,} parameters train")


@contextlib.contextmanager
def _frozen_mode(model):
    """eval() for the duration (no dropout, as a frozen reference runs), each module's flag restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, t in modes:
            m.training = t


class BaseView:
    """The frozen base model under a LoRA model, without a second copy: every call runs the model with
    its adapters switched off and in eval mode (as a frozen reference runs), then switches them back.
    It is DPO's and PPO's reference policy when the reference is the initial model. It owns no parameters:
    `.to()`, `.eval()`, `.requires_grad_()` change nothing and return the view; other attributes (cfg, ...)
    are the model's, and its methods (hidden_states, output_weight, ...) run with the adapters off.
    Only calls without gradients make sense: it is the reference, never trained."""
    shares_trained_model = True   # parallel.prepare_frozen: no copy to place, no own weights to checksum

    def __init__(self, model):
        self.model = dist.unwrap(model)
        if not lora_modules(self.model):
            raise ValueError("BaseView: the model has no LoRA adapters")
        if getattr(self.model, "lora_trainable", ()):
            raise ValueError("BaseView: the model has fully trained modules, so adapters off is not the base")

    def _off(self, fn, *args, **kwargs):
        with adapters_disabled(self.model), _frozen_mode(self.model):
            return fn(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._off(self.model, *args, **kwargs)

    def to(self, *args, **kwargs):
        return self

    def eval(self):
        return self

    def requires_grad_(self, requires_grad=True):
        return self

    def __getattr__(self, name):
        if name == "model":          # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        attr = getattr(self.model, name)
        if callable(attr) and not isinstance(attr, nn.Module):
            return lambda *args, **kwargs: self._off(attr, *args, **kwargs)
        return attr

    def __repr__(self):
        return f"BaseView({type(self.model).__name__} with adapters off)"


def shares_base(opts, ref_dir):
    """True when --lora_r is on and the reference is the initial model (ref_dir empty or --init itself):
    then the reference is BaseView(policy), no second model."""
    return bool(opts.lora_r) and (not ref_dir or os.path.realpath(ref_dir) == os.path.realpath(opts.init))


class Adapters:
    """What a LoRA run checkpoints of a model: the adapters (and the fully trained modules), never the
    frozen base, which --resume re-reads from --init (and checks by checksum). It has the two methods
    checkpoint.save_state / load_state call on a model, so those save and restore it unchanged."""

    def __init__(self, model):
        self.model = dist.unwrap(model)

    def _params(self):
        out = {}
        for name, m in lora_modules(self.model):
            out[f"{name}.lora_A"], out[f"{name}.lora_B"] = m.lora_A, m.lora_B
        for name, m in _trainable_modules(self.model):
            for pname, p in m.named_parameters():
                out[f"{name}.{pname}"] = p
        return out

    def parameters(self):
        """The checkpointed tensors (what parallel.is_sharded inspects before saving)."""
        return iter(self._params().values())

    def state_dict(self):
        return adapter_state_dict(self.model)

    @torch.no_grad()
    def load_state_dict(self, state):
        """Copy saved adapters in, exactly; a missing, unexpected or misshapen tensor is a RuntimeError
        (load_state turns it into one line naming the file)."""
        params = self._params()
        missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        if missing or unexpected:
            raise RuntimeError(f"the saved adapters do not match the model's: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}")
        for k, p in params.items():
            if state[k].shape != p.shape:
                raise RuntimeError(f"{k}: shape {tuple(state[k].shape)} != {tuple(p.shape)} (another --lora_r?)")
            p.copy_(state[k])


def checkpointed(model):
    """What save_state / load_state should hold for `model`: its adapters under LoRA, else the model."""
    return Adapters(model) if lora_modules(model) else model
