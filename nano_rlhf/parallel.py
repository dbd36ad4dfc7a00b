"""When the models outgrow one device: FSDP2 sharding, gathered generation, offloaded frozen models, and the memory
plan that says what each choice costs a rank. The algorithm code in the scripts does not change. (Sharded
checkpoint files: checkpoint.py.)

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

    python -m nano_rlhf.parallel --plan --config qwen2.5-1.5b --world 1,8,16      # the memory table
"""
import argparse
import contextlib
import json
import math
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from . import dist
from .dist import full_tensor

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


def sync_gradients(model, on):
    """Whether the next forward/backward through `model` (what wrap returned) communicates its gradients: DDP's
    all-reduce, FSDP2's reduce-scatter. Off for every micro-batch of an accumulation but the last, so the summed
    gradients travel once (nanoGPT sets DDP's require_backward_grad_sync the same way; DDP reads it in the
    forward, so it is set before it). A module in one process has nothing to sync: a no-op."""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = on
    elif hasattr(model, "set_requires_gradient_sync"):     # an FSDP2 root
        model.set_requires_gradient_sync(on)


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
    # Neither is measured on a GPU yet; on an H100 this path gave bit-identical weights to
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
    return clipped_grad_norm(parameters, max_norm).item()


def clipped_grad_norm(parameters, max_norm):
    """clip_grad_norm's norm as a 0-dim tensor on the device: clipping reads nothing back to the host."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm or float("inf"))
    if DTensor is not None and isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


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
    from .lora import LoRALinear, apply_lora, lora_modules
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


# ---- The memory plan: per-rank device bytes of parameters, gradients and AdamW state for each model of a run
# under DDP, FSDP (frozen models sharded or replicated), CPU offload of the frozen models and LoRA. Pure arithmetic
# from the tensor shapes of a config; the scripts print it for their live models at start-up (startup_plan), and
# docs/usage.md's memory table comes from the command line:
#
#     python -m nano_rlhf.parallel --plan --config qwen2.5-1.5b --world 1,8,16
FROZEN_CHOICES = ("shard", "replicate")


def memory_plan(models, strategy="ddp", world_size=1, *, lora=False, offload=False, frozen="shard",
                param_bytes=4, grad_bytes=4, optim_bytes=8):
    """Per-rank device bytes of parameters, gradients and optimizer state for each model, and the total.

    models: {name: {"params": n, "trainable": bool, "adapters": n_lora_params (with lora), "shared": bool}};
      "shared" marks a frozen model that, with LoRA, is the policy with its adapters off (no memory of its own).
    strategy: "ddp" (every rank holds everything) or "fsdp" (trainable models sharded 1/N with their gradients
      and optimizer state; frozen ones per `frozen`: "shard" 1/N, "replicate" whole).
    lora: only adapters are trained (gradients and AdamW moments for them alone); base weights stay frozen.
    offload: frozen models live in CPU memory: 0 device bytes (they visit the device for their forwards).
    optim_bytes: AdamW keeps two float32 moments per trained parameter (8 bytes).
    Returns [{"model", "params", "grads", "optim", "total"}] (bytes per rank), the last row named "total".
    Activations, the rollout's transient full policy (gathered for generation) and buffers are not counted."""
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be ddp or fsdp, got {strategy!r}")
    if frozen not in FROZEN_CHOICES:
        raise ValueError(f"frozen must be shard or replicate, got {frozen!r}")
    N = max(1, int(world_size))
    share = (lambda n: math.ceil(n / N)) if strategy == "fsdp" else (lambda n: n)
    rows = []
    for name, m in models.items():
        n = int(m["params"])
        if m.get("trainable"):
            trained = int(m.get("adapters", 0)) if lora else n
            held = n + (int(m.get("adapters", 0)) if lora else 0)
            p, g, o = share(held) * param_bytes, share(trained) * grad_bytes, share(trained) * optim_bytes
        else:
            if (lora and m.get("shared")) or offload:
                p = 0
            else:
                p = (share(n) if strategy == "fsdp" and frozen == "shard" else n) * param_bytes
            g = o = 0
        rows.append({"model": name, "params": p, "grads": g, "optim": o, "total": p + g + o})
    rows.append({"model": "total", **{k: sum(r[k] for r in rows) for k in ("params", "grads", "optim", "total")}})
    return rows


PRESETS = {   # shapes of public checkpoints (their config.json), for the plan without downloading anything
    "gpt2-124m": dict(model_type="gpt2", vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_kv_head=3,
                         n_embd=576, intermediate_size=1536, tie_word_embeddings=True),
    "smollm2-360m": dict(model_type="llama", vocab_size=49152, block_size=8192, n_layer=32, n_head=15, n_kv_head=5,
                         n_embd=960, intermediate_size=2560, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, block_size=32768, n_layer=28, n_head=12, n_kv_head=2,
                         n_embd=1536, intermediate_size=8960, attention_bias=True, tie_word_embeddings=True),
    "7b": dict(model_type="qwen2", vocab_size=152064, block_size=32768, n_layer=28, n_head=28, n_kv_head=4,
               n_embd=3584, intermediate_size=18944, attention_bias=True, tie_word_embeddings=False),   # Qwen2.5-7B
}


def preset_config(spec):
    """GPTConfig of a preset name or of a model directory's config.json (no weights are read)."""
    from .model import GPTConfig, config_from_hf
    if spec in PRESETS:
        return GPTConfig(**PRESETS[spec])
    path = os.path.join(spec, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--config {spec}: neither a preset ({', '.join(PRESETS)}) nor a directory with config.json")
    with open(path) as f:
        return config_from_hf(json.load(f), path)


def count_params(cfg, head="lm", lora_r=0, lora_targets=None):
    """(parameters, LoRA adapter parameters) of the model a config describes, from its tensor shapes."""
    from .model import expected_shapes
    from .lora import GPT2_TARGETS, LLAMA_TARGETS
    shapes = expected_shapes(cfg, head)
    n = sum(math.prod(s) for s in shapes.values())
    targets = lora_targets or (GPT2_TARGETS if cfg.model_type == "gpt2" else LLAMA_TARGETS)
    adapters = sum(lora_r * (s[0] + s[1]) for k, s in shapes.items()
                   if k.endswith(".weight") and len(s) == 2 and k.rsplit(".", 2)[-2] in targets)
    return n, adapters


def ppo_models(cfg, lora_r=16):
    """The four PPO models of one config: policy and critic trained, reference and reward model frozen
    (critic and reward model: the trunk and a scalar head)."""
    lm, lm_ad = count_params(cfg, "lm", lora_r)
    sc, sc_ad = count_params(cfg, "score", lora_r)
    return {"policy": {"params": lm, "trainable": True, "adapters": lm_ad},
            "critic": {"params": sc, "trainable": True, "adapters": sc_ad + cfg.n_embd},   # + its score head
            "ref": {"params": lm, "trainable": False, "shared": True},
            "reward": {"params": sc, "trainable": False}}


def gib(n):
    return f"{n / 2**30:.2f}"


def format_plan(rows, title=""):
    """The plan as a text table, in GiB per rank (MiB when the total is under 1 GiB)."""
    unit, div = ("GiB", 2**30) if rows[-1]["total"] >= 2**30 else ("MiB", 2**20)
    lines = [title] if title else []
    w = max(8, *(len(r["model"]) for r in rows))
    lines.append(f"{'model':<{w}} {'params':>9} {'grads':>9} {'optim':>9} {'total':>9}  ({unit} per rank)")
    for r in rows:
        cells = " ".join(f"{r[k] / div:>9.2f}" for k in ("params", "grads", "optim", "total"))
        lines.append(f"{r['model']:<{w}} " + cells)
    return "\n".join(lines)


STRATEGIES = {   # the columns of docs/usage.md's memory table: name -> memory_plan keywords
    "ddp": dict(strategy="ddp"),
    "fsdp": dict(strategy="fsdp", frozen="shard"),
    "fsdp+offload": dict(strategy="fsdp", offload=True),
    "lora (ddp)": dict(strategy="ddp", lora=True),
    "fsdp+lora": dict(strategy="fsdp", frozen="shard", lora=True),
}


def plan_table(cfg, worlds, lora_r=16):
    """Markdown: total GiB per rank of PPO's four models for each strategy and world size."""
    models = ppo_models(cfg, lora_r)
    head = "| GPUs | " + " | ".join(STRATEGIES) + " |"
    lines = [head, "|" + "---|" * (len(STRATEGIES) + 1)]
    for w in worlds:
        cells = [gib(memory_plan(models, world_size=w, **kw)[-1]["total"]) for kw in STRATEGIES.values()]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def startup_plan(models: dict, strategy, frozen="shard", offload=False, lora=False):
    """The memory plan of the live models of a run, as text (printed by rank 0 at start-up). models:
    {name: module or None}; a module with no trainable parameter counts as frozen; with LoRA the adapters are
    the trainable parameters (nano_rlhf.lora.lora_parameters)."""
    spec = {}
    for name, m in models.items():
        if m is None:
            continue
        m = dist.unwrap(m)
        n = sum(p.numel() for p in m.parameters())
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        lora_now = lora and trainable and trainable < n
        spec[name] = {"params": n - (trainable if lora_now else 0), "trainable": trainable > 0,
                      "adapters": trainable if lora_now else 0, "shared": False}
    rows = memory_plan(spec, strategy, dist.world().world_size, lora=lora, offload=offload, frozen=frozen)
    has_frozen = any(not v["trainable"] for v in spec.values())
    what = (strategy + (f", frozen {frozen}" if strategy == "fsdp" and has_frozen else "")
            + (", offload" if offload else "") + (", lora" if lora else ""))
    return format_plan(rows, f"memory plan ({what}; {dist.world().world_size} rank(s); weights and optimizer only):")



# ---- the command line ---------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m nano_rlhf.parallel",
                                 description="Per-rank memory of PPO's four models under DDP, FSDP, offload and LoRA.")
    ap.add_argument("--plan", action="store_true", help="print the memory table")
    ap.add_argument("--config", default="qwen2.5-1.5b",
                    help=f"a model directory (its config.json) or a preset: {', '.join(PRESETS)}")
    ap.add_argument("--world", default="1,8,16", help="comma-separated numbers of GPUs")
    ap.add_argument("--lora_r", type=int, default=16, help="LoRA rank for the LoRA columns")
    ap.add_argument("--detail", action="store_true", help="also the per-model breakdown for each world size")
    a = ap.parse_args(argv)
    try:
        worlds = [int(x) for x in a.world.split(",") if x.strip()]
        if not worlds or min(worlds) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --world {a.world!r}: expected positive integers separated by commas", file=sys.stderr)
        return 2
    if a.lora_r < 1:
        print(f"error: --lora_r {a.lora_r}: must be >= 1", file=sys.stderr)
        return 2
    try:
        cfg = preset_config(a.config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.plan:
        print("error: nothing to do: pass --plan", file=sys.stderr)
        return 2
    models = ppo_models(cfg, a.lora_r)
    counts = ", ".join(f"{k} {v['params'] / 1e6:,.1f}M" for k, v in models.items())
    print(f"{a.config}: {counts}; LoRA r={a.lora_r}: {models['policy']['adapters'] / 1e6:,.2f}M adapter parameters "
          "(policy)")
    print("GiB per rank, float32 weights + gradients + AdamW moments of PPO's policy, critic, reference and reward "
          "model (no activations):")
    print(plan_table(cfg, worlds, a.lora_r))
    if a.detail:
        for w in worlds:
            for name, kw in STRATEGIES.items():
                print(format_plan(memory_plan(models, world_size=w, **kw), f"\n{name}, {w} GPU(s):"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
