"""The rollout engine against HF generate and against the physical bound, side by side in one run (float32, CPU).

    python bench/gen.py                      # both parts, writes results/bench/gen/gen.json
    python bench/gen.py --part decode --calls 4 --threads 2

1. decode: the reference shape (GPT-2, 4 x 256, vocab 4096; 16 rows, 32-token prompts, exactly 64 new tokens,
   pure sampling at T = 1). Ours eager, ours compiled (compile time reported apart), transformers'
   GPT2LMHeadModel.generate with the same weights, and the bound: the time of the call's matrix products
   (prefill + 63 decode steps, each at its own shape and with each layer's own weights, run back to back with
   nothing else), measured here; the same products with one layer's weights reused for all four (so they stay in
   the CPU's caches) are reported beside it as a best case.
2. rl: an RL-shaped rollout. A built-in-task-sized model (GPT-2, 4 x 128, vocab 512; block 128 so that 64 new
   tokens fit) whose end-of-text logit is raised so that each sample ends at its own length: the final
   LayerNorm's bias points along the end-of-text embedding (as tests/conftest.py's eos_prone does), giving a
   roughly geometric length of mean ~--mean_len tokens, capped at 64. 8 prompts x 8 samples: ours (prefix
   sharing + compaction, eager and compiled) against HF generate(num_return_sequences=8) on the same prompts.
Timing: the median of --calls calls after warm-up; `uptime` is recorded with the results (2 cores are shared).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench as B
from nano_rlhf.model import GPT, GPTConfig

REF = dict(vocab_size=4096, block_size=256, n_layer=4, n_head=4, n_embd=256)
TASK = dict(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=128)


def timeit(fn, warmup, calls):
    """Median seconds of `calls` calls after `warmup` (bench.py's timer)."""
    return B.timeit(fn, warmup, calls)[0]


def hf_twin(model, d):
    """transformers' GPT2LMHeadModel with our weights (written and read back in the HF layout)."""
    from transformers import GPT2LMHeadModel
    model.save_pretrained(d)
    return GPT2LMHeadModel.from_pretrained(d).eval()


def matmul_bound(cfg, B, Tp, new, calls, distinct=True):
    """Seconds of the matrix products of one generate call at their own shapes (no attention, no sampling).
    distinct: every layer has its own weights, as the model does (they do not all stay in the CPU's caches);
    False reuses one layer's weights for every layer (a cache-resident best case, reported apart)."""
    C, V = cfg.n_embd, cfg.vocab_size
    shapes = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]
    layers = [[(torch.randn(o, i), torch.randn(o)) for i, o in shapes] for _ in range(cfg.n_layer if distinct else 1)]
    head = torch.randn(V, C)
    xs = {rows: [torch.randn(rows, i) for i, _ in shapes] for rows in (B * Tp, B)}
    h = {rows: torch.randn(rows, C) for rows in (B * Tp, B)}

    def run():
        for step in range(new):
            rows = B * Tp if step == 0 else B       # the prefill, then one token per row
            for layer in range(cfg.n_layer):
                for x, (w, b) in zip(xs[rows], layers[layer % len(layers)]):
                    torch.addmm(b, x, w.T)
            F.linear(h[B] if step else h[rows][:B], head)   # logits at the last position only
    return timeit(run, 2, calls)


def eos_biased(cfg, eos, mean_len):
    """A random GPT-2 whose end-of-text has probability ~1/mean_len per token (see the module docstring)."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(**cfg, eos_token_id=eos, pad_token_id=1)).eval()
    with torch.no_grad():
        w = m.transformer.wte.weight[eos]
        p = 1.0 / mean_len
        logit = math.log(p * (cfg["vocab_size"] - 1) / (1 - p))   # other logits are ~0 at this scale
        m.transformer.ln_f.weight.mul_(0.1)
        m.transformer.ln_f.bias.copy_(w * logit / w.dot(w))
    return m


def part_decode(a, out):
    m = GPT(GPTConfig(**REF, eos_token_id=None, pad_token_id=1)).eval()
    B, Tp, new = 16, 32, 64
    ids = torch.randint(2, REF["vocab_size"], (B, Tp), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    rows = {}

    def ours(**kw):
        stats = {}
        t = timeit(lambda: m.generate(ids, None, new, temperature=1.0, generator=g, stats=stats, **kw), 2, a.calls)
        return t, stats
    t, _ = ours()
    rows["ours eager"] = t
    tc = time.perf_counter()
    st = {}
    m.generate(ids, None, new, temperature=1.0, generator=g, compile=True, stats=st)
    out["decode_compile_s"] = time.perf_counter() - tc
    out["decode_compiled"] = st["compiled"]
    t, _ = ours(compile=True)
    rows["ours compiled"] = t
    with tempfile.TemporaryDirectory() as d:
        hf = hf_twin(m, d)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=True,
                  top_k=0, temperature=1.0, pad_token_id=1)
        with torch.no_grad():
            rows["HF generate"] = timeit(lambda: hf.generate(ids, **kw), 2, a.calls)
    rows["matmul bound"] = matmul_bound(m.cfg, B, Tp, new, a.calls)
    rows["matmul, one layer's weights reused"] = matmul_bound(m.cfg, B, Tp, new, a.calls, distinct=False)
    out["decode"] = {k: {"s_per_call": v, "new_tok_per_s": B * new / v, "x_HF": rows["HF generate"] / v}
                     for k, v in rows.items()}


def part_rl(a, out):
    eos = 0
    m = eos_biased(TASK, eos, a.mean_len)
    P, k, new = 8, 8, 64
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(8, 17, (P,), generator=g)
    prompts = [torch.randint(2, TASK["vocab_size"], (int(n),), generator=g) for n in lens]
    Tp = int(lens.max())
    ids = torch.full((P, Tp), 1)
    mask = torch.zeros(P, Tp, dtype=torch.long)
    for i, p in enumerate(prompts):                     # left-padded, as rollouts are
        ids[i, Tp - len(p):], mask[i, Tp - len(p):] = p, 1
    rep_ids, rep_mask = ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)
    gen = torch.Generator().manual_seed(1)
    rows, stats = {}, {}

    def ours(**kw):
        return timeit(lambda: m.generate(rep_ids, rep_mask, new, temperature=1.0, eos_token_id=eos, pad_token_id=1,
                                         generator=gen, stats=stats, **kw), 2, a.calls)
    rows["ours eager, no sharing/compaction"] = ours(share_prefix=False, compact=False)
    rows["ours eager"] = ours()
    seq = m.generate(rep_ids, rep_mask, new, temperature=1.0, eos_token_id=eos, pad_token_id=1, generator=gen)
    resp = seq[:, Tp:]
    ended = (resp == eos).any(1)
    first_eos = (resp == eos).float().argmax(1) + 1
    length = torch.where(ended, first_eos, torch.full_like(first_eos, resp.shape[1]))
    out["rl_lengths"] = {"mean": float(length.float().mean()), "max": int(length.max()),
                         "ended": float(ended.float().mean())}
    out["rl_work"] = {"row_steps": stats["row_steps"], "steps": stats["steps"], "rows": P * k,
                      "prefill_rows": stats["prefill_rows"]}
    tc = time.perf_counter()
    st = {}
    m.generate(rep_ids, rep_mask, new, temperature=1.0, eos_token_id=eos, pad_token_id=1, generator=gen, compile=True,
               stats=st)
    out["rl_compile_s"] = time.perf_counter() - tc
    rows["ours compiled"] = ours(compile=True)
    with tempfile.TemporaryDirectory() as d:
        hf = hf_twin(m, d)
        kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=True, top_k=0, temperature=1.0,
                  num_return_sequences=k, eos_token_id=eos, pad_token_id=1)
        with torch.no_grad():
            rows["HF generate"] = timeit(lambda: hf.generate(ids, **kw), 2, a.calls)
    out["rl"] = {k_: {"s_per_call": v, "x_HF": rows["HF generate"] / v} for k_, v in rows.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "decode", "rl"), default="all")
    p.add_argument("--calls", type=int, default=6, help="timed calls per row (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mean_len", type=float, default=20.0, help="RL part: mean response length the eos bias aims at")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "bench", "gen",
                                                 "gen.json"))
    a = p.parse_args()
    if a.calls < 1 or a.threads < 1 or not a.mean_len > 1:
        print("error: --calls and --threads must be >= 1 and --mean_len > 1", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(a.threads)
    out = {"load_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
           "torch": torch.__version__, "threads": a.threads, "calls": a.calls}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    for part, run in (("decode", part_decode), ("rl", part_rl)):
        if a.part in ("all", part):
            run(a, out)
            out["load_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
            with open(a.out, "w") as f:      # after each part: a long run keeps what it measured
                json.dump(out, f, indent=1)
    for part in ("decode", "rl"):
        for name, r in out.get(part, {}).items():
            extra = f"  {r['new_tok_per_s']:8.0f} new tok/s" if "new_tok_per_s" in r else ""
            print(f"{part:6s} {name:36s} {r['s_per_call'] * 1e3:9.1f} ms{extra}  {r['x_HF']:5.2f}x HF")
    print(json.dumps({k: v for k, v in out.items() if k not in ("decode", "rl")}))


if __name__ == "__main__":
    main()
