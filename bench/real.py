"""Benchmark at a real model shape: SmolLM2-135M (random weights) against TRL and HF transformers, on this CPU.

    python bench/real.py                        # everything, raw output to results/bench/real/ (tens of minutes)
    python bench/real.py --only gen,mem         # some rows: sft, dpo, gen, mem, bf16
    python bench/real.py --out ""               # print only

Shape: SmolLM2-135M's config (Llama architecture): 30 layers, width 576, 9 heads / 3 key-value heads (head_dim
64), SwiGLU MLP 1536, vocabulary 49,152, tied embeddings, rope_theta 100000, RMSNorm eps 1e-5; random weights,
float32, 2 threads. Every measurement runs in its own fresh process; within a row the sides run one after the
other (nano_rlhf, then each peer; with --rounds 2 the order alternates), and every ratio comes from this run.
The peers' settings and helpers are bench/peers.py's (TRL 1.16, float32, no gradient checkpointing, constant
LR, fused AdamW, no logging/saving/eval; step time between consecutive `on_step_end` callbacks); timing,
profiling and process spawning are bench/bench.py's.

Rows (smaller batches than bench.py's GPT-2 rows: one step here is ~60x the FLOPs):
  sft   one SFT step, 4 x 256 tokens of plain text (every token trained): nano_rlhf vs TRL SFTTrainer vs a bare
        HF loop (LlamaForCausalLM(labels=ids).loss, backward, AdamW).
  dpo   one DPO step, 4 pairs of prompt 32 + completion 96, live frozen reference, beta 0.1: vs TRL DPOTrainer.
  gen   generation, 16 prompts of 32 tokens, exactly 64 new tokens, sampling at T = 1: vs HF `generate` (the very
        weights, saved by nano_rlhf and loaded by transformers) and vs the physical bound of the same call; the
        rollout engine's compiled decode step (compile time apart) beside the eager one.
  mem   peak memory of an SFT step at Qwen2.5-0.5B's vocabulary (151,936; same trunk), log-probs chunked (the
        default) vs unchunked (the whole (positions, vocab) float32 logits at once).
  bf16  the SFT step under bf16 autocast, reported apart: vs TRL at its CPU defaults (bf16 + gradient checkpointing).

The physical bound of a generate call: the prefill's FLOPs at the throughput of matrix products of its own
shapes, plus, for each of the 63 further decode steps, the larger of (a) the bytes of the weights read once
/ the measured copy bandwidth and (b) the step's FLOPs (2 per matmul parameter per row, plus attention over the
cache) / the measured throughput of matrix products of the decode's own shapes (16 rows). Peak memory: the
process's resident-set high-water mark (Linux VmHWM), reset just before the measured step via
/proc/self/clear_refs, minus the resident set before it (model, gradients and AdamW state already allocated by
a warm-up step); freed memory is returned to the OS before the reset (malloc_trim), so the figure is what that
one step adds at its peak. A profile (torch profiler, self time, one call) of nano_rlhf's side is kept for each row.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import bench as B       # noqa: E402  bench/bench.py: timeit, profile_ops, spawn, _pairs
import peers as P       # noqa: E402  bench/peers.py: TRL settings, step timer, tokenizer, pseudo-words

SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, block_size=2048, n_layer=30, n_head=9, n_kv_head=3,
                    n_embd=576, intermediate_size=1536, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True)
QWEN_VOCAB = 151936
SFT_B, SFT_T = 4, 256
DPO_PAIRS, DPO_PROMPT, DPO_COMPLETION = 4, 32, 96
GEN_B, GEN_PROMPT, GEN_NEW = 16, 32, 64


def matmul_params(vocab):
    """Parameters a token passes through in matrix products (the embedding lookup is not one; the tied output
    layer is)."""
    c = SMOLLM2_135M
    d, hd, kv, f = c["n_embd"], c["n_embd"] // c["n_head"], c["n_kv_head"], c["intermediate_size"]
    per_layer = 2 * d * d + 2 * d * kv * hd + 3 * d * f
    return c["n_layer"] * per_layer + vocab * d


def forward_flops(tokens, context, head_positions, vocab=SMOLLM2_135M["vocab_size"]):
    """Forward FLOPs: 2 per matmul parameter per token (output layer only at head_positions), plus attention's
    two products, 4·L·d·context per token (d = heads × head_dim = the width here)."""
    c = SMOLLM2_135M
    trunk = matmul_params(vocab) - vocab * c["n_embd"]
    return 2 * trunk * tokens + 2 * vocab * c["n_embd"] * head_positions + 4 * c["n_layer"] * c["n_embd"] * context * tokens


# ---- nano_rlhf workers ---------------------------------------------------------------------------------

def _ours(vocab=None):
    import torch
    from nano_rlhf.model import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = dict(SMOLLM2_135M, **({"vocab_size": vocab} if vocab else {}))
    return GPT(GPTConfig(**cfg, eos_token_id=0, pad_token_id=1, bos_token_id=0))


def _profiled(out, fn):
    out["profile"] = B.profile_ops(fn, 1)
    return out


def w_sft(a, dtype="float32"):
    import torch
    from nano_rlhf.training import adamw, autocast
    from train_sft import sft_nll
    m = _ours().train()
    opt = adamw(m, 1e-4, 0.01)
    ids = torch.randint(2, SMOLLM2_135M["vocab_size"], (SFT_B, SFT_T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def step():
        with autocast(torch.device("cpu"), dtype):
            nll, n = sft_nll(m, ids, mask, mask)
        (nll / n).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    t, ts = B.timeit(step, 2, a.steps)
    tokens = SFT_B * SFT_T
    return _profiled({"s_per_step": t, "times": ts, "tokens_per_s": tokens / t,
                      "flops_per_step": 3 * forward_flops(tokens, SFT_T, tokens)}, step)


def w_sft_bf16(a):
    return w_sft(a, "bfloat16")


def w_dpo(a):
    import copy
    import torch
    from nano_rlhf.training import adamw
    from nano_rlhf.data import collate_pairs
    from train_dpo import dpo_loss, sequence_logps
    policy = _ours().train()
    ref = copy.deepcopy(policy).requires_grad_(False).eval()
    opt = adamw(policy, 1e-4, 0.01)
    ids, attn, resp, _ = collate_pairs(B._pairs(DPO_PAIRS, DPO_PROMPT, DPO_COMPLETION, vocab=SMOLLM2_135M["vocab_size"]),
                                       pad_id=1)

    def step():
        s, _ = sequence_logps(policy, ids, attn, resp)
        pi_w, pi_l = s.chunk(2)
        with torch.no_grad():
            rw, rl = sequence_logps(ref, ids, attn, resp)[0].chunk(2)
        dpo_loss((pi_w - rw) - (pi_l - rl), 0.1).mean().backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    t, ts = B.timeit(step, 2, a.steps)
    T = DPO_PROMPT + DPO_COMPLETION
    f = forward_flops(2 * DPO_PAIRS * T, T, int(resp.sum()))
    return _profiled({"s_per_step": t, "times": ts, "pairs_per_s": DPO_PAIRS / t, "flops_per_step": 4 * f}, step)


def w_gen(a, compile=False):
    import torch
    m = _ours().eval()
    ids = torch.randint(2, SMOLLM2_135M["vocab_size"], (GEN_B, GEN_PROMPT), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    stats = {}

    def call():
        out = m.generate(ids, None, GEN_NEW, temperature=1.0, eos_token_id=None, generator=g, compile=compile,
                         stats=stats)
        assert out.shape == (GEN_B, GEN_PROMPT + GEN_NEW)
    tc = time.perf_counter()
    if compile:                          # the first call compiles: timed apart, then warm-up as usual
        call()
    compile_s = time.perf_counter() - tc
    t, ts = B.timeit(call, 1, a.gen_calls)
    if a.save_model:
        m.save_pretrained(a.save_model)
    out = {"s_per_call": t, "times": ts, "new_tokens_per_s": GEN_B * GEN_NEW / t}
    if compile:
        out.update(compile_s=compile_s, compiled=stats.get("compiled"))
    return _profiled(out, call)


def w_gen_compiled(a):
    return w_gen(a, compile=True)


def _time(fn, warmup=3, calls=20):
    return B.timeit(fn, warmup, calls)[0]


def w_bound(a):
    """Copy bandwidth, and the throughput of matrix products of the prefill's and of a decode step's shapes
    (F.linear with (out, in) weights, as the model calls them)."""
    import torch
    import torch.nn.functional as F
    c = SMOLLM2_135M
    d, kv, f, V, L = c["n_embd"], c["n_kv_head"] * 64, c["intermediate_size"], c["vocab_size"], c["n_layer"]
    src = torch.randn(128 * 1024 * 1024 // 4)          # 128 MiB, far beyond any cache
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), 2, 10)
    bandwidth = 2 * src.numel() * 4 / t                # bytes read + written per second
    # (count per step, out features, in features): q, o, k, v, gate, up, down per layer, the output layer once
    shapes = [(2 * L, d, d), (2 * L, kv, d), (2 * L, f, d), (L, d, f), (1, V, d)]

    def throughput(rows):
        flops = secs = 0.0
        for count, n_out, n_in in shapes:
            x, w = torch.randn(rows, n_in), torch.randn(n_out, n_in)
            s = _time(lambda: F.linear(x, w), 3, 20 if rows <= 64 else 8)
            flops += count * 2 * rows * n_in * n_out
            secs += count * s
        return flops / secs
    weight_bytes = 4 * matmul_params(V)
    return {"copy_bandwidth_Bps": bandwidth, "decode_matmul_flops_per_s": throughput(GEN_B),
            "prefill_matmul_flops_per_s": throughput(GEN_B * GEN_PROMPT), "weight_bytes": weight_bytes}


def _status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def w_mem(a, chunked=True):
    """Peak resident memory one SFT step adds at vocabulary 151,936 (see the module docstring)."""
    import ctypes
    import gc
    import torch
    import nano_rlhf.model as model_mod
    from nano_rlhf.training import adamw
    from train_sft import sft_nll
    if not chunked:
        model_mod.LOGITS_BUDGET = 1 << 50       # one chunk holds every position: the plain computation
    m = _ours(QWEN_VOCAB).train()
    opt = adamw(m, 1e-4, 0.01)
    ids = torch.randint(2, QWEN_VOCAB, (SFT_B, SFT_T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def step():
        nll, n = sft_nll(m, ids, mask, mask)
        (nll / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()                                      # AdamW state and gradients' first allocation happen here
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")                           # reset VmHWM to the current resident set
    t = time.perf_counter()
    step()
    t = time.perf_counter() - t
    peak = _status("VmHWM")
    return {"chunked": chunked, "rss_before": base, "rss_peak": peak, "step_added_bytes": peak - base,
            "s_per_step": t, "logits_budget_bytes": model_mod.logits_budget(torch.device("cpu"))}


def w_mem_unchunked(a):
    return w_mem(a, chunked=False)


# ---- peers (settings from bench/peers.py) ----------------------------------------------------------------

def _hf_config(**kw):
    from transformers import LlamaConfig
    c = SMOLLM2_135M
    return LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["n_embd"], intermediate_size=c["intermediate_size"],
                       num_hidden_layers=c["n_layer"], num_attention_heads=c["n_head"],
                       num_key_value_heads=c["n_kv_head"], max_position_embeddings=c["block_size"],
                       rope_theta=c["rope_theta"], rms_norm_eps=c["rms_norm_eps"], tie_word_embeddings=True,
                       bos_token_id=0, eos_token_id=0, pad_token_id=1, attention_dropout=0.0, **kw)


def _hf_model(**kw):
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(_hf_config(**kw))


def w_trl_sft(a, trl_defaults=False):
    P._quiet()
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    tok, text = P.tokenizer(), P._words(seed=1)
    # long texts: every row is truncated to SFT_T tokens, so each step is exactly SFT_B x SFT_T
    ds = Dataset.from_dict({"text": [text(300) for _ in range(SFT_B * (a.steps + 6))]})

    def make(out, cb):
        args = P._args(SFTConfig, out, a.steps + 3, SFT_B, trl_defaults, max_length=SFT_T, packing=False,
                       dataset_text_field="text")
        return SFTTrainer(_hf_model(), args=args, train_dataset=ds, processing_class=tok, callbacks=[cb])
    t = P._train(make, a.steps + 3)
    return {"s_per_step": t, "tokens_per_s": SFT_B * SFT_T / t}


def w_trl_sft_bf16(a):
    return w_trl_sft(a, trl_defaults=True)


def w_hf_loop(a):
    import torch
    P._quiet()
    model = _hf_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    b = torch.randint(2, SMOLLM2_135M["vocab_size"], (SFT_B, SFT_T), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=b, labels=b).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    t, ts = B.timeit(step, 2, a.steps)
    return {"s_per_step": t, "times": ts, "tokens_per_s": SFT_B * SFT_T / t}


def w_trl_dpo(a):
    import copy
    P._quiet()
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    tok, text = P.tokenizer(), P._words(seed=2)
    # ~2.3 tokens per pseudo-word: 14 words make a prompt of about 32 tokens; completions are truncated
    rows = [{"prompt": text(14), "chosen": " " + text(80), "rejected": " " + text(80)}
            for _ in range(DPO_PAIRS * (a.steps + 6))]

    def make(out, cb):
        args = P._args(DPOConfig, out, a.steps + 3, DPO_PAIRS, beta=0.1, max_length=DPO_PROMPT + DPO_COMPLETION)
        model = _hf_model()
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        return DPOTrainer(model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[cb])
    t = P._train(make, a.steps + 3)
    return {"s_per_step": t, "pairs_per_s": DPO_PAIRS / t}


def w_hf_gen(a):
    import torch
    P._quiet()
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(a.save_model, dtype=torch.float32).eval()
    ids = torch.randint(2, SMOLLM2_135M["vocab_size"], (GEN_B, GEN_PROMPT), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=GEN_NEW, min_new_tokens=GEN_NEW, use_cache=True,
              pad_token_id=1, do_sample=True, top_k=0, temperature=1.0)

    def call():
        with torch.no_grad():
            model.generate(ids, **kw)
    t, ts = B.timeit(call, 1, a.gen_calls)
    return {"s_per_call": t, "times": ts, "new_tokens_per_s": GEN_B * GEN_NEW / t}


WORKERS = {k[2:]: v for k, v in globals().items() if k.startswith("w_")}


# ---- orchestration -----------------------------------------------------------------------------------------

def run(name, a, save_model=""):
    args = [os.path.abspath(__file__), "--worker", name, "--steps", str(a.steps), "--gen_calls", str(a.gen_calls)]
    t = time.time()
    out = B.spawn(args + (["--save_model", save_model] if save_model else []), threads=a.threads)
    print(f"  [{name}: {time.time() - t:.0f} s wall]", flush=True)
    return out


def sides(a, names, **kw):
    """Each side `rounds` times, alternating the order; per side the median of its rounds' step times."""
    got = {n: [] for n in names}
    for r in range(a.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            try:
                got[n].append(run(n, a, **kw))
            except RuntimeError as e:
                if n in ("trl_sft", "hf_loop", "trl_dpo", "hf_gen", "trl_sft_bf16"):
                    print(f"  (peer {n} unavailable: {str(e).strip().splitlines()[-1][:200]})", flush=True)
                    continue
                raise
    return {n: v for n, v in got.items() if v}


def med(results, key):
    return statistics.median(r[key] for r in results) if results else None


def top_ops(profile, k=6):
    return ", ".join(f"{op} {100 * s:.0f}%" for op, s in list(profile.items())[:k])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated rows: sft,dpo,gen,mem,bf16")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--steps", type=int, default=5, help="timed steps per training side (after warm-up)")
    p.add_argument("--gen_calls", type=int, default=3, help="timed generate calls per side (after one warm-up)")
    p.add_argument("--rounds", type=int, default=1, help="measure each side this many times, alternating the order")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench", "real", "run"),
                   help="write OUT.txt (what is printed) and OUT.json (every figure); empty = print only")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--save_model", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        import torch
        torch.set_num_threads(a.threads)
        if not a.worker.startswith("mem"):
            from nano_rlhf.dist import keep_freed_memory
            keep_freed_memory()          # what every nano_rlhf script does at start-up (peers get it too: fair)
        print("RESULT " + json.dumps(WORKERS[a.worker](a)), flush=True)
        return
    rows = a.only.split(",") if a.only else ["sft", "dpo", "gen", "mem", "bf16"]
    bad = [r for r in rows if r not in ("sft", "dpo", "gen", "mem", "bf16")]
    if bad:
        sys.exit(f"error: --only: unknown row(s) {', '.join(bad)} (sft, dpo, gen, mem, bf16)")
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)
    import torch
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"] * 3
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    say(f"machine: {cpu}, {os.cpu_count()} logical CPUs | torch {torch.__version__} | {a.threads} threads | "
        f"load average at start {' '.join(load)} | {a.steps} timed steps, {a.gen_calls} generate calls, "
        f"{a.rounds} round(s) per side")
    say(f"shape: SmolLM2-135M (30 x 576, 9/3 heads, MLP 1536, vocab 49,152, tied), random weights, float32; "
        f"{matmul_params(SMOLLM2_135M['vocab_size']) / 1e6:.1f}M matmul parameters")
    res = {"machine": cpu, "threads": a.threads, "torch": torch.__version__, "load_start": load, "steps": a.steps}

    def ratio_line(title, unit, ours, peers_):
        parts = [f"{n}: {v:,.2f} -> {ours / v:.2f}x" for n, v in peers_ if v]
        say(f"{title:<38} nano_rlhf {ours:,.2f} {unit}" + ("" if not parts else " | " + " | ".join(parts)))

    def row_sft():
        got = sides(a, ["sft", "trl_sft", "hf_loop"])
        ours = med(got["sft"], "tokens_per_s")
        ratio_line(f"SFT step, {SFT_B} x {SFT_T} tokens", "tok/s", ours,
                   [("TRL SFTTrainer", med(got.get("trl_sft"), "tokens_per_s")),
                    ("HF bare loop", med(got.get("hf_loop"), "tokens_per_s"))])
        say(f"  nano_rlhf profile: {top_ops(got['sft'][0]['profile'])}")
        res["sft"] = got

    def row_dpo():
        got = sides(a, ["dpo", "trl_dpo"])
        ratio_line(f"DPO step, {DPO_PAIRS} pairs {DPO_PROMPT}+{DPO_COMPLETION}, live ref", "pairs/s",
                   med(got["dpo"], "pairs_per_s"), [("TRL DPOTrainer", med(got.get("trl_dpo"), "pairs_per_s"))])
        say(f"  nano_rlhf profile: {top_ops(got['dpo'][0]['profile'])}")
        res["dpo"] = got

    def row_gen():
        save = tempfile.mkdtemp()
        bound = run("bound", a)
        got = {"gen": [], "hf_gen": []}
        for r in range(a.rounds):       # nano_rlhf first in round 0: it writes the weights HF generate loads
            for n in (["gen", "hf_gen"] if r % 2 == 0 else ["hf_gen", "gen"]):
                try:
                    got[n].append(run(n, a, save_model=save))
                except RuntimeError as e:
                    if n != "hf_gen":
                        raise
                    print(f"  (peer hf_gen unavailable: {str(e).strip().splitlines()[-1][:200]})", flush=True)
        V = SMOLLM2_135M["vocab_size"]
        prefill = forward_flops(GEN_B * GEN_PROMPT, GEN_PROMPT, GEN_B)
        decode = [forward_flops(GEN_B, GEN_PROMPT + i + 1, GEN_B) for i in range(GEN_NEW - 1)]
        t_bytes = bound["weight_bytes"] / bound["copy_bandwidth_Bps"]
        t_decode = [max(t_bytes, f / bound["decode_matmul_flops_per_s"]) for f in decode]
        t_bound = prefill / bound["prefill_matmul_flops_per_s"] + sum(t_decode)
        ours_s = med(got["gen"], "s_per_call")
        try:
            got["gen_compiled"] = [run("gen_compiled", a)]
        except RuntimeError as e:
            say(f"  (compiled decoding failed: {str(e).strip().splitlines()[-1][:200]})")
        ratio_line(f"generate, {GEN_B} x ({GEN_PROMPT} + {GEN_NEW}), T=1", "new tok/s", GEN_B * GEN_NEW / ours_s,
                   [("HF generate", med(got.get("hf_gen"), "new_tokens_per_s"))])
        say(f"  physical bound of the call {t_bound:.3f} s (nano_rlhf {ours_s:.3f} s -> {100 * t_bound / ours_s:.0f}% "
            f"of the bound): decode step {decode[0] / 1e9:.2f} GFLOP at "
            f"{bound['decode_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s (16-row products) = {decode[0] / bound['decode_matmul_flops_per_s'] * 1e3:.1f} ms"
            f" vs {bound['weight_bytes'] / 1e6:.0f} MB of weights at {bound['copy_bandwidth_Bps'] / 1e9:.1f} GB/s "
            f"copy bandwidth = {t_bytes * 1e3:.1f} ms; prefill {prefill / 1e9:.1f} GFLOP at "
            f"{bound['prefill_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s")
        say(f"  nano_rlhf profile: {top_ops(got['gen'][0]['profile'])}")
        if got.get("gen_compiled"):
            c = got["gen_compiled"][0]
            say(f"  compiled decode step (--compile_rollout): {c['s_per_call']:.3f} s a call -> "
                f"{100 * t_bound / c['s_per_call']:.0f}% of the bound, {ours_s / c['s_per_call']:.2f}x eager "
                f"(first call, compiling, {c['compile_s']:.0f} s apart; compiled={c['compiled']}); "
                f"profile: {top_ops(c['profile'])}")
        res["gen"] = dict(got, bound=bound, bound_s=t_bound, fraction_of_bound=t_bound / ours_s, vocab=V)

    def row_mem():
        got = sides(a, ["mem", "mem_unchunked"])
        c, u = got["mem"][0], got["mem_unchunked"][0]
        say(f"peak memory an SFT step adds, {SFT_B} x {SFT_T} tokens at vocab {QWEN_VOCAB:,}: chunked log-probs "
            f"{c['step_added_bytes'] / 2**20:,.0f} MiB | unchunked {u['step_added_bytes'] / 2**20:,.0f} MiB | "
            f"(resident before the step {c['rss_before'] / 2**20:,.0f} / {u['rss_before'] / 2**20:,.0f} MiB; "
            f"step {c['s_per_step']:.1f} / {u['s_per_step']:.1f} s)")
        res["mem"] = got

    def row_bf16():
        got = sides(a, ["sft_bf16", "trl_sft_bf16"])
        ratio_line("SFT step, bf16 autocast (apart)", "tok/s", med(got["sft_bf16"], "tokens_per_s"),
                   [("TRL at its CPU defaults (bf16 + grad ckpt)", med(got.get("trl_sft_bf16"), "tokens_per_s"))])
        res["bf16"] = got

    def write():
        if a.out:
            os.makedirs(os.path.dirname(a.out), exist_ok=True)
            with open(a.out + ".txt", "w") as f:
                f.write("\n".join(lines) + "\n")
            with open(a.out + ".json", "w") as f:
                json.dump(res, f, indent=1)
    rows_fn = {"sft": row_sft, "dpo": row_dpo, "gen": row_gen, "mem": row_mem, "bf16": row_bf16}
    for r in rows:          # in the order given; a failing row is reported and the others still run
        try:
            rows_fn[r]()
        except RuntimeError as e:
            say(f"{r}: FAILED: {str(e).strip().splitlines()[-1][:300]}")
            res[r] = {"error": str(e)[-3000:]}
        res["load_after_" + r] = open("/proc/loadavg").read().split()[:3]
        say(f"  [load average after {r}: {' '.join(res['load_after_' + r])}]")
        write()
    if a.out:
        print(f"wrote {a.out}.txt and {a.out}.json")


if __name__ == "__main__":
    main()
