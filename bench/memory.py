"""Per-rank memory and step time of DDP vs FSDP (vs LoRA) at 2 ranks, on a SmolLM2-135M-shaped model with random
weights built here (30 layers, width 576, 9 query / 3 key-value heads, SwiGLU 1536, vocabulary 49,152, tied
embedding), plus the rollout's decoding time with the policy sharded: gathered once vs all-gathered per step.

    python bench/memory.py                    # all modes, 2 ranks each (CPU, gloo); prints a markdown table
    python bench/memory.py --modes ddp,fsdp --steps 3 --seq 128 --batch 2

Each mode is a fresh `torchrun --nproc_per_node 2` job (bench/memory.py --worker ...). Per rank it reports the
resident set size (RSS) above the process's baseline (after `import torch`, before the model is built):
the peak over the whole job (getrusage) and the steady value after the last step (model + gradients +
AdamW state + allocator cache), and the median time of a training step (forward, backward, optimizer step) on
random tokens. The LoRA mode uses nano_rlhf.lora when it is there (skipped otherwise). The last table is the
arithmetic for a 7B model on 8 and 16 GPUs (python -m nano_rlhf.parallel --plan).

The DDP and LoRA modes run with the scripts' allocator setting (dist.keep_freed_memory: glibc keeps freed
memory in the process, faster on CPU); --default_malloc gives them glibc's defaults too. FSDP on CPU always
returns freed memory (parallel.shard): its transient full-size buffers (a block's all-gathered weights and
unsharded gradients), kept resident, would hide the 1/N saving (measured before that rule, 2 ranks: FSDP
3.1 GB vs DDP 3.2 GB peak; with glibc's defaults 1.5 GB vs 3.1 GB peak and 0.9 GB vs 2.2 GB steady).
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, block_size=2048, n_layer=30, n_head=9, n_kv_head=3,
                    n_embd=576, intermediate_size=1536, tie_word_embeddings=True)


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024          # Linux: KB


def worker(a):
    import torch
    from nano_rlhf import dist, parallel
    from nano_rlhf.training import adamw
    from nano_rlhf.model import GPT, GPTConfig
    w = dist.setup("cpu")
    torch.set_num_threads(1)
    if a.default_malloc:      # undo dist.keep_freed_memory: glibc returns freed blocks to the OS again
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, ctypes.c_int(128 * 1024))    # M_TRIM_THRESHOLD (glibc default)
        libc.mallopt(-3, ctypes.c_int(128 * 1024))    # M_MMAP_THRESHOLD (glibc default)
    base = rss_mb()
    torch.manual_seed(0)                                   # identical random weights on every rank
    model = GPT(GPTConfig(**SMOLLM2_135M))
    lora = a.mode.endswith("lora")
    if lora:
        from nano_rlhf.lora import apply_lora, lora_parameters
        apply_lora(model, a.lora_r, 2.0 * a.lora_r)
    ddp = parallel.wrap(model, fsdp=a.mode.startswith("fsdp"))
    if lora:
        opt = torch.optim.AdamW(lora_parameters(model), lr=1e-4, foreach=True)
    else:
        opt = adamw(model, 1e-4, 0.0)
    g = torch.Generator().manual_seed(1 + w.rank)
    times = []
    for step in range(a.steps + 1):                        # step 0: warm-up (optimizer state allocated)
        ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (a.batch, a.seq), generator=g)
        t0 = time.time()
        logits = ddp(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        parallel.clip_grad_norm(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:
            times.append(time.time() - t0)
    out = {"mode": a.mode, "rank": w.rank, "peak_mb": peak_mb() - base, "steady_mb": rss_mb() - base,
           "step_s": statistics.median(times),
           "params": sum(p.numel() for p in model.parameters()),
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if a.rollout and a.mode == "fsdp":
        prompts = torch.randint(0, SMOLLM2_135M["vocab_size"], (a.batch, 16), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            for name, ctx, cache in (("gathered_cache", True, True), ("gathered_nocache", True, False),
                                     ("per_layer_nocache", False, False)):
                before = rss_mb()
                t0 = time.time()
                with parallel.gathered(model) if ctx else _null():
                    model.generate(prompts, max_new_tokens=a.new_tokens, temperature=0.0, use_cache=cache)
                    held = rss_mb() - before
                out[f"rollout_{name}_s"] = time.time() - t0
                out[f"rollout_{name}_extra_mb"] = held
    with open(os.path.join(a.result_dir, f"rank{w.rank}.json"), "w") as f:     # ranks print over each other
        json.dump(out, f)
    dist.cleanup()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def launch(mode, a):
    result_dir = tempfile.mkdtemp(prefix=f"bench_memory_{mode}_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.ranks),
           os.path.abspath(__file__), "--worker", "--mode", mode, "--steps", str(a.steps), "--seq", str(a.seq),
           "--batch", str(a.batch), "--lora_r", str(a.lora_r), "--new_tokens", str(a.new_tokens),
           "--result_dir", result_dir] + (["--default_malloc"] if a.default_malloc else [])
    cmd.append("--rollout" if a.rollout else "--no_rollout")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = []
    for name in sorted(os.listdir(result_dir)):
        with open(os.path.join(result_dir, name)) as f:
            rows.append(json.load(f))
    shutil.rmtree(result_dir, ignore_errors=True)
    if p.returncode != 0 or not rows:
        print(f"{mode}: failed ({p.returncode})\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}", file=sys.stderr)
        return []
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="ddp")
    ap.add_argument("--modes", default="ddp,fsdp,lora,fsdp_lora", help="comma-separated: ddp fsdp lora fsdp_lora")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lora_r", type=int, default=16)
    ap.add_argument("--new_tokens", type=int, default=32)
    ap.add_argument("--result_dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--default_malloc", action="store_true",
                    help="glibc's default thresholds (freed memory returned to the OS) instead of the training "
                         "scripts' keep-freed-memory setting")
    ap.add_argument("--rollout", action="store_true", default=True)
    ap.add_argument("--no_rollout", dest="rollout", action="store_false")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("ddp", "fsdp", "lora", "fsdp_lora")]
    if bad:
        sys.exit(f"error: --modes: unknown mode(s) {', '.join(bad)} (choose from ddp, fsdp, lora, fsdp_lora)")
    try:
        import nano_rlhf.lora  # noqa: F401
    except ImportError:
        modes = [m for m in modes if "lora" not in m]
    results = {}
    for m in modes:
        rows = launch(m, a)
        if rows:
            results[m] = rows
            print(f"{m}: " + "; ".join(f"rank {r['rank']} peak {r['peak_mb']:.0f} MB steady {r['steady_mb']:.0f} MB "
                                       f"step {r['step_s']:.2f}s" for r in rows), flush=True)
    print(f"\nSmolLM2-135M shape, {a.ranks} ranks (CPU, gloo), batch {a.batch} x {a.seq} tokens per rank, "
          "float32 weights, AdamW; RSS above each process's baseline, max over ranks")
    print("| mode | trained params | peak RSS / rank (MB) | steady RSS / rank (MB) | step time (s) |")
    print("|---|---|---|---|---|")
    for m, rows in results.items():
        print(f"| {m} | {rows[0]['trainable'] / 1e6:.1f}M | {max(r['peak_mb'] for r in rows):,.0f} | "
              f"{max(r['steady_mb'] for r in rows):,.0f} | {max(r['step_s'] for r in rows):.2f} |")
    fs = results.get("fsdp")
    if fs and "rollout_gathered_cache_s" in fs[0]:
        print(f"\nRollout under FSDP: {a.batch} prompts x 16 tokens, {a.new_tokens} new tokens (greedy), "
              "max over ranks")
        print("| decoding | time (s) | extra RSS while decoding (MB) |")
        print("|---|---|---|")
        for name, label in (("gathered_cache", "gathered once, KV cache"),
                            ("gathered_nocache", "gathered once, no cache"),
                            ("per_layer_nocache", "per-layer all-gather at every step, no cache")):
            print(f"| {label} | {max(r[f'rollout_{name}_s'] for r in fs):.2f} | "
                  f"{max(r[f'rollout_{name}_extra_mb'] for r in fs):,.0f} |")
    from nano_rlhf import parallel
    print("\n7B (Qwen2.5-7B shape), PPO's four models, float32 weights + AdamW: GiB per GPU")
    print(parallel.plan_table(parallel.preset_config("7b"), [1, 8, 16]))


if __name__ == "__main__":
    main()
