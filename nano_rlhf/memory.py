"""The memory plan: per-rank device bytes of parameters, gradients and AdamW state for each model of a run
under DDP, FSDP (frozen models sharded or replicated), CPU offload of the frozen models and LoRA. Pure arithmetic
from the tensor shapes of a config; the scripts print it for their live models at start-up (startup_plan), and
docs/usage.md's memory table comes from the command line (parallel.py runs this module's main):

    python -m nano_rlhf.parallel --plan --config qwen2.5-1.5b --world 1,8,16
"""
import argparse
import json
import math
import os
import sys

from . import dist

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
    from .gpt_config import GPTConfig, config_from_hf
    if spec in PRESETS:
        return GPTConfig(**PRESETS[spec])
    path = os.path.join(spec, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--config {spec}: neither a preset ({', '.join(PRESETS)}) nor a directory with config.json")
    with open(path) as f:
        return config_from_hf(json.load(f), path)


def count_params(cfg, head="lm", lora_r=0, lora_targets=None):
    """(parameters, LoRA adapter parameters) of the model a config describes, from its tensor shapes."""
    from .hf_io import expected_shapes
    from .lora_layers import GPT2_TARGETS, LLAMA_TARGETS
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
    lines.append(f"{'model':<8} {'params':>9} {'grads':>9} {'optim':>9} {'total':>9}  ({unit} per rank)")
    for r in rows:
        cells = " ".join(f"{r[k] / div:>9.2f}" for k in ("params", "grads", "optim", "total"))
        lines.append(f"{r['model']:<8} " + cells)
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
