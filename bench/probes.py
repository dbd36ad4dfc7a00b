"""Small measurements behind docs/benchmarks.md's explanations of the figures (one process, alternating
the variants, median of --reps; float32, 2 threads).

    python bench/probes.py logprobs    # the output layer alone, 1,024 positions: unchunked vs chunked log-probs
    python bench/probes.py step        # one decode step of the reference shape: eager vs static cache vs compiled
    python bench/probes.py products    # the SmolLM2-135M decode step's 211 matrix products alone (16 rows)
    python bench/probes.py gather      # a KV-cache row gather: advanced indexing vs index_select
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nano_rlhf import sampling
from nano_rlhf import model as M


def alternate(variants, reps):
    """{name: fn} -> {name: median seconds}, the variants run in turn `reps` times after one warm-up each."""
    for fn in variants.values():
        fn()
    times = {k: [] for k in variants}
    for _ in range(reps):
        for k, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def logprobs(reps):
    """token_logprobs forward + backward at vocab 49,152 and 151,936: chunks of the default budget (each
    remade in backward) against one chunk holding every position. Weights at a trained model's scale."""
    out = {}
    for V in (49152, 151936):
        h0, w = torch.randn(1024, 576), (0.05 * torch.randn(V, 576)).requires_grad_()
        t = torch.randint(0, V, (1024,))

        def run(chunk):
            def fn():
                w.grad = None
                M.token_logprobs(h0.clone().requires_grad_(), w, t, chunk_size=chunk).sum().backward()
            return fn
        out[V] = alternate({"unchunked": run(1024), "chunked (default)": run(None)}, reps)
    return out


def step(reps):
    """One decode step (16 rows, written length 65 of a 128-slot cache) of the GPT-2 reference shape."""
    m = M.GPT(M.GPTConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=4, n_embd=256)).eval()
    cfg, B, L = m.cfg, 16, 128
    cache = [(torch.zeros(B, cfg.kv_heads, L, cfg.hd), torch.zeros(B, cfg.kv_heads, L, cfg.hd))
             for _ in range(cfg.n_layer)]
    tok, pos, keys, w = torch.randint(0, 4096, (B, 1)), torch.full((B, 1), 64), torch.ones(B, 1, 1, L, dtype=torch.bool), torch.tensor([64])
    compiled = torch.compile(sampling._decode_step, dynamic=False)
    with torch.no_grad():
        return alternate({
            "eager, cache sliced to the written length":
                lambda: F.linear(m.trunk.forward_cached(tok, keys[..., :65], pos, cache, 64)[:, -1], m.output_weight()),
            "eager, whole static cache (masked)": lambda: sampling._decode_step(m, tok, keys, pos, cache, w),
            "compiled, whole static cache": lambda: compiled(m, tok, keys, pos, cache, w),
        }, reps * 20)


def products(reps):
    """The matrix products of one SmolLM2-135M decode step (30 layers x q, k, v, o, gate, up, down + the output
    layer), each layer with its own weights, 16 rows: inputs (16, 1, C) as the model passes them, and (16, C)."""
    C, Fd, KV = 576, 1536, 192
    layers = [[0.02 * torch.randn(o, i) for i, o in [(C, C), (C, KV), (C, KV), (C, C), (C, Fd), (C, Fd), (Fd, C)]]
              for _ in range(30)]
    head = 0.02 * torch.randn(49152, C)
    x3 = {C: torch.randn(16, 1, C), Fd: torch.randn(16, 1, Fd)}
    x2 = {k: v.view(16, -1) for k, v in x3.items()}

    def run(xs):
        def fn():
            for ws in layers:
                for w in ws:
                    F.linear(xs[w.shape[1]], w)
            F.linear(xs[C], head)
        return fn
    return alternate({"3-D inputs": run(x3), "2-D inputs": run(x2)}, reps * 3)


def gather(reps):
    """Keeping 3/4 of a KV cache's rows (what compaction does per layer, keys and values)."""
    out = {}
    for shape in [(64, 4, 80, 32), (16, 4, 128, 64)]:
        k, keep = torch.randn(*shape), torch.randperm(shape[0])[:shape[0] * 3 // 4]
        out[str(shape)] = alternate({"k[keep]": lambda: k[keep], "k.index_select(0, keep)": lambda: k.index_select(0, keep)},
                                    reps * 100)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", choices=("logprobs", "step", "products", "gather"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    res = {"logprobs": logprobs, "step": step, "products": products, "gather": gather}[a.probe](a.reps)
    groups = res if isinstance(next(iter(res.values())), dict) else {"": res}
    for g, rows in groups.items():
        for name, s in rows.items():
            print(f"{a.probe} {g} {name:44s} {s * 1e3:10.3f} ms")


if __name__ == "__main__":
    main()
