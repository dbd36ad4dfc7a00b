"""When the models outgrow one device: FSDP2 sharding, gathered generation, offloaded frozen models. The
algorithm code in the scripts does not change. Sharded checkpoints are in sharded.py, the memory plan in memory.py.

Sharding (`--fsdp`, PyTorch FSDP2 `fully_shard`): every transformer block is one unit, then the root (embedding,
the tied output layer, the final norm: one group, so the tied weight is one parameter). Each rank keeps 1/N of
every parameter, gradient and AdamW moment (ZeRO-3); a unit's full weights exist only while it runs (all-gather
before its forward and backward, reduce-scatter of its gradient after backward). FSDP2 averages gradients over
ranks as DDP does, so the scripts' loss scaling (dist.ddp_scale()) holds unchanged. A ScoreModel's last block
joins the root group: the reward model's end score and the KV-cache decoding call into a block's sub-modules
(not its forward), which FSDP's forward hooks would not see.

Generation: KV-cache decoding runs one token at a time; under per-block sharding every layer would be
all-gathered at every step. `gathered(policy)` all-gathers the full parameters once for the whole rollout and
reshards after: one full copy of the policy's parameters per rank for the rollout's duration (what DDP holds
all the time). Frozen models (`--frozen shard|replicate`) are sharded (default) or kept whole on every rank;
`--offload_frozen` keeps them in CPU memory and brings them to the device for their forwards only.

    python -m nano_rlhf.parallel --plan --config qwen2.5-1.5b --world 1,8,16      # the memory table (memory.py)
"""
import contextlib
import sys

import torch

from . import dist
from .dist import full_tensor
# the memory plan (memory.py) and the sharded checkpoints (sharded.py) moved out; the names other files use
# stay importable from here, and `python -m nano_rlhf.parallel --plan` runs memory.main
from .memory import (FROZEN_CHOICES, PRESETS, STRATEGIES, count_params, format_plan, gib, main,  # noqa: F401
                     memory_plan, plan_table, ppo_models, preset_config, startup_plan)
from .sharded import (TensorSource, _local, _optim_from_flat, load_model, load_optimizer,  # noqa: F401
                      optimizer_tensors, read_like, save_sharded, shard_rows)

try:        # FSDP2 (torch >= 2.6); absent on builds without torch.distributed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
except ImportError:          # pragma: no cover
    FSDPModule = DTensor = None

_MESH = None


# ---- sharding ---------------------------------------------------------------------------------------

def device_mesh():
    """A 1-D mesh over all ranks on this run's device type (an explicit CPU mesh under gloo)."""
    global _MESH
    w = dist.world()
    if _MESH is None or _MESH.size() != w.world_size:
        _MESH = init_device_mesh(w.device.type, (w.world_size,))
    return _MESH


def is_sharded(model):
    """True when the model's parameters (or the tensor itself) are FSDP shards (DTensors)."""
    if DTensor is None or model is None:
        return False
    if isinstance(model, torch.Tensor):
        return isinstance(model, DTensor)
    return any(isinstance(p, DTensor) for p in dist.unwrap(model).parameters())


def _units(model):
    """The modules sharded as units: every block; a ScoreModel's last block stays in the root group."""
    blocks = list(model.trunk.blocks)
    return blocks[:-1] if getattr(model, "head", "lm") == "score" else blocks


def shard(model, root=None, dtype="float32", offload=False):
    """fully_shard every block of `model`, then `root` (a module holding `model`, whose forward the script
    calls; default the model itself). In one process this returns the root unchanged. On CUDA with
    dtype="bfloat16" the all-gathered weights are bf16 (compute) and gradients are reduced in float32 against
    float32 master shards. offload=True (CUDA): the shards stay in CPU memory (FSDP's CPUOffloadPolicy)."""
    root = model if root is None else root
    w = dist.world()
    if not w.enabled:
        return root
    kw = {"mesh": device_mesh()}
    if w.device.type == "cpu":
        return_freed_memory()
    if w.device.type == "cuda" and dtype == "bfloat16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload and w.device.type == "cuda":
        kw["offload_policy"] = CPUOffloadPolicy()
    units = _units(model)
    for block in units:
        fully_shard(block, **kw)
    fully_shard(root, **kw)
    # FSDP picks its root at the first forward; a first call that reaches a block without the root's forward
    # (evaluate.py's log-probs through hidden_states, under gathered()) would make that block a root. Fix it now.
    root._get_fsdp_state()._lazy_init()
    root.no_sync = lambda: _no_sync(root)     # the DDP name the scripts use for gradient accumulation
    return root


def return_freed_memory():
    """Undo dist.keep_freed_memory (glibc's defaults again). FSDP allocates and frees a block's full weights
    and gradients at every use; kept in the process, those freed buffers would make every rank's RSS as large
    as DDP's (measured: bench/memory.py --default_malloc). Linux/glibc only; no-op elsewhere."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, ctypes.c_int(128 * 1024))   # M_TRIM_THRESHOLD
        libc.mallopt(-3, ctypes.c_int(128 * 1024))   # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _no_sync(root):
    """Gradient accumulation without communication: gradients stay unsharded and accumulate locally;
    the backward of the micro-batch after this context reduce-scatters them all at once (DDP's no_sync)."""
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def wrap(model, fsdp=False, root=None, dtype="float32"):
    """What a trainable model's forward/backward go through: FSDP-sharded with --fsdp under torchrun, else
    DDP (dist.wrap_ddp), else the module itself. The optimizer must be built after this (on the shards)."""
    if dist.world().device.type != "cpu":
        Offloaded.training_hook(model)
    if fsdp and dist.world().enabled:
        return shard(model, root, dtype)
    return dist.wrap_ddp(model if root is None else root)


def prepare_frozen(model, fsdp=False, frozen="shard", offload=False, dtype="float32"):
    """A frozen model (reference, reward model) placed per --frozen/--offload_frozen. Sharded under --fsdp
    with frozen="shard"; else whole on every rank, and with offload kept in CPU memory and moved to the
    device around each forward (Offloaded). Returns the module to call."""
    if model is None or getattr(model, "shares_trained_model", False):   # LoRA's adapters-off view
        return model
    model._frozen_checksum = dist.weights_checksum(model)      # check_frozen compares the end with this
    if fsdp and frozen == "shard" and dist.world().enabled:
        return shard(model, dtype=dtype, offload=offload)
    if offload and dist.world().device.type != "cpu":
        Offloaded.register(model, dist.world().device)
    return model


def check_frozen(models: dict):
    """Raise if a frozen model (placed by prepare_frozen) no longer holds its start-up weights bit for bit;
    print the verdict (rank 0). Collective under FSDP (the checksum gathers the shards)."""
    done = []
    for name, m in models.items():
        if m is None or not hasattr(m, "_frozen_checksum"):
            continue
        now = dist.weights_checksum(m)
        if now != m._frozen_checksum:
            raise RuntimeError(f"{name}: a frozen model changed during training (checksum {m._frozen_checksum:016x} "
                               f"-> {now:016x})")
        done.append(f"{name} {now:016x}")
    if done:
        dist.print0(f"frozen models bit-identical to the start: {', '.join(done)}")


class Offloaded:
    """Frozen models kept in CPU memory that visit the device for their forwards, one at a time: a forward
    of one moves it to the device (and any other visitor back to the CPU); the next training forward (grad
    enabled) of any model sends the visitor home. Its weights stay on the device between its forward and the
    next one of another model, so code reading them after the forward (the output layer) still finds them."""
    visitors = []

    # Why plain .to() both ways: a frozen model's weights never change, so the copy home is redundant and a
    # pinned CPU copy would let the visit be an asynchronous host-to-device copy (pin_memory + non_blocking).
    # Both wait for a GPU session that can measure them; on an H100 this path gave bit-identical weights to
    # keeping the reference on the device (tests/test_gpu.py::test_offload_frozen_gives_the_same_run).
    @classmethod
    def register(cls, model, device):
        model.to("cpu")
        cls.visitors.append(model)

        def come(module, args):
            cls.evict(keep=module)
            module.to(device)
        model.register_forward_pre_hook(come)

    @classmethod
    def evict(cls, keep=None):
        for m in cls.visitors:
            if m is not keep:
                m.to("cpu")

    @classmethod
    def training_hook(cls, model):
        """Install on a trained model: its training forwards send the visitors home."""
        model.register_forward_pre_hook(lambda m, a: cls.evict() if torch.is_grad_enabled() and cls.visitors
                                        else None)


def _fsdp_modules(model):
    return [] if model is None else [m for m in model.modules() if FSDPModule is not None and isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(*models):
    """Full (all-gathered) parameters on every rank for the duration: one all-gather per unit, instead of one
    per unit per call (KV-cache decoding calls every layer once per new token). Costs a full copy of each
    model's parameters per rank while inside. Collective: every rank enters it. A no-op without FSDP."""
    mods = [m for model in models for m in _fsdp_modules(model)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
        roots = {id(model) for model in models}
        for m in mods:            # the roots' own setting (no reshard after forward) is FSDP's default
            if id(m) not in roots:
                m.set_reshard_after_forward(True, recurse=False)


def clip_grad_norm(parameters, max_norm):
    """clip_grad_norm_ over DDP or FSDP parameters -> the pre-clip global norm as a float (FSDP: the norm of
    the sharded gradients, reduced over ranks)."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm or float("inf"))
    if DTensor is not None and isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm.item()


def plain_copy(model):
    """An unsharded float32 CPU copy of a sharded model on rank 0 (None on the others), to write the final
    HF directory. Collective (one all-gather per tensor). LoRA adapters are rebuilt in the copy so that the
    export path (merging) sees the model it expects."""
    model = dist.unwrap(model)
    sd = {k: full_tensor(v).detach().to("cpu") for k, v in model.state_dict().items()}
    if not dist.world().is_main:
        return None
    cls = type(model).__bases__[-1] if FSDPModule is not None and isinstance(model, FSDPModule) else type(model)
    with torch.device("meta"):
        copy = cls(model.cfg)
    from .lora_layers import LoRALinear, apply_lora, lora_modules
    mods = lora_modules(model)
    if mods:
        first = mods[0][1]
        apply_lora(copy, first.r, first.alpha, 0.0, targets=sorted({n.rsplit(".", 1)[-1] for n, _ in mods}),
                   trainable=getattr(model, "lora_trainable", ()))
        for name, m in mods:
            copy.get_submodule(name).enabled = m.enabled
            assert isinstance(copy.get_submodule(name), LoRALinear)
    copy.to_empty(device="cpu")
    copy.load_state_dict(sd)
    for name, b in model.named_buffers():       # non-persistent buffers are not in the state dict
        parent, _, leaf = name.rpartition(".")
        (copy.get_submodule(parent) if parent else copy)._buffers[leaf] = b.detach().to("cpu").clone()
    for attr in ("extra_config",):
        if hasattr(model, attr):
            setattr(copy, attr, getattr(model, attr))
    return copy.train(model.training)





if __name__ == "__main__":
    sys.exit(main())
