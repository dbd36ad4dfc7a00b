"""The GPU check, in parts of at most 4.5 minutes of device time each (one GPU, no network, a few minutes a command).

    python bench/gpu.py OUT --only train       # the probes, the training rows, their correctness subset
    python bench/gpu.py OUT --only rollout     # one part (train, rollout, grpo, correctness)
    python bench/gpu.py OUT --only correctness -k "resume or lora"    # some correctness tests again
    python bench/gpu.py OUT --device cpu --tiny --no_compile   # the dry run tests/test_gpu_check.py does in CI

Each part prints its plan (PLAN: what it runs, the device seconds expected for each) and is refused before
anything runs if the plan exceeds MAX_PART_S; it runs in its own process (a crash or a hang in one loses none of
the others) under its plan's time limit, and rewrites its JSON into OUT after every row, so a run stopped at its
limit still returns what finished. A table of at most 20 lines ends the output. It needs nothing from the network
and only what a GPU machine without one has (torch >= 2.3, transformers, safetensors, tokenizers, numpy, pytest;
peft and TRL are not used); the versions found go into train.json.

Parts:
  train        the device, versions, bf16 peak and a matrix-product probe; the output layer alone (log-probs
               forward + backward at 3 vocabularies: the plain one-chunk computation against the log-prob
               operator, padded and not); one SFT step at GPT-2-124M, SmolLM2-135M and Qwen2.5-0.5B shapes (random
               weights; train_sft.train_step, bf16 autocast; GPT-2 also at 32 x 1024, and against HF with its
               vocabulary padded to a multiple of 64), one DPO step at GPT-2 (live reference) and one GRPO
               update at GPT-2 and Qwen2.5-0.5B (π_old's forward, two minibatch updates), each against a bare HF
               transformers loop of the same work in this process, the two alternated step by step (A B A B),
               median of 10 steps after 3: tokens/s, MFU (nanoGPT's estimate_mfu: 6N + 12·L·H·Q·T FLOPs a token;
               DPO's reference and GRPO's π_old forward 2N more) against the datasheet and the measured matmul
               ceiling, the memory a step adds, the host syncs of our steps, a kernel profile with the attention
               kernels that ran; then the correctness tests of those paths (TRAIN_TESTS)   -> train.json
  rollout      64 prompts x 8 samples x 256 new tokens (no stop token: every row runs to the end) at SmolLM2-135M
               shape in bf16: the rollout engine (prefix shared, eager and compiled; compile time apart) against
               HF `generate` with its default cache and with cache_implementation="static"  -> rollout.json
  grpo         train_ppo.py --advantage grpo at Qwen2.5-0.5B shape, bf16, 16 prompts x 8 samples x 128 new
               tokens: seconds a step and the share of rollout and update (the second step; the first warms up)
                                                                                         -> grpo.json
  correctness  `pytest -m gpu tests/test_gpu.py` on the device (its measurements too)      -> correctness.json
Timing: torch.cuda.synchronize() around each timed call (only here: the scripts never synchronise for timing),
median of the timed repeats after warm-up calls.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

PARTS = ("train", "rollout", "grpo", "correctness")
# Each part's plan: what it runs and the device seconds expected for each (builds and compiles included), so
# that a part fits one short command on a GPU machine that allows a few minutes a command. The dry run prints
# the plans; a part planned over MAX_PART_S is refused before anything runs. A part's time limit is its plan
# plus a quarter.
PLAN = {
    "train": [("process start, CUDA init, imports", 15), ("env and the matmul probe", 15),
              ("output-layer probe: 3 vocabularies x 3 sides x 7 calls", 20),
              ("SFT gpt2-124m, ours, HF and HF with its vocabulary padded, 13 steps each, profile", 25),
              ("SFT smollm2-135m", 20),
              ("SFT qwen2.5-0.5b", 25), ("SFT gpt2-124m --compile (compile ~45 s)", 45),
              ("SFT gpt2-124m at 32 x 1024", 15),
              ("DPO gpt2-124m, live reference", 15), ("GRPO update gpt2-124m", 10),
              ("GRPO update qwen2.5-0.5b", 15), ("correctness subset (TRAIN_TESTS)", 50)],
    "rollout": [("process start", 15), ("eager and compiled engine (compile ~40 s)", 75),
                ("HF generate, default and static cache (compile ~40 s)", 90)],
    "grpo": [("process start, model save", 25), ("2 GRPO steps at qwen2.5-0.5b", 80)],
    "correctness": [("the whole GPU suite, pytest -m gpu", 170)],
}
MAX_PART_S = 270           # 4.5 minutes: a part and a rerun fit in 15 minutes of device time
LIMITS = {part: 1.25 * sum(s for _, s in items) for part, items in PLAN.items()}
# what each train row is expected to reach (the study's estimates, docs/benchmarks.md), beside what it measured
EXPECTED = {("sft", "gpt2-124m", "nano_rlhf"): {"mfu": 0.25, "vs_hf": 1.9},
            ("sft", "gpt2-124m", "nano_rlhf --compile"): {"mfu": 0.33, "vs_hf": 2.5},
            ("sft", "smollm2-135m", "nano_rlhf"): {"vs_hf": 1.1},
            ("sft", "qwen2.5-0.5b", "nano_rlhf"): {"vs_hf": 1.0},
            ("sft_32", "gpt2-124m", "nano_rlhf"): {"mfu": 0.25, "vs_hf": 1.9},
            ("dpo", "gpt2-124m", "nano_rlhf dpo"): {"vs_hf": 1.5},
            ("grpo_update", "gpt2-124m", "nano_rlhf grpo update"): {"vs_hf": 1.5},
            ("grpo_update", "qwen2.5-0.5b", "nano_rlhf grpo update"): {"vs_hf": 1.5}}

# model shapes (random weights): GPTConfig fields, with the HF config class and its fields
SHAPES = {
    "gpt2-124m": dict(model_type="gpt2", vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, block_size=2048, n_layer=30, n_head=9, n_kv_head=3,
                         n_embd=576, intermediate_size=1536, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, block_size=2048, n_layer=24, n_head=14, n_kv_head=2,
                         n_embd=896, intermediate_size=4864, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         attention_bias=True, tie_word_embeddings=True),
}
TINY_SHAPE = dict(vocab_size=512, block_size=256, n_layer=2, n_head=4, n_embd=64)
SFT_BATCH = {"gpt2-124m": (16, 1024), "smollm2-135m": (16, 1024), "qwen2.5-0.5b": (8, 1024)}

# bf16 dense peak FLOP/s (no sparsity) by device name, from NVIDIA's data sheets; the first name contained in
# the device's wins, so the NVL and PCIe cards (lower clocks and power) come before the SXM names
PEAKS = [("H200 NVL", 835e12), ("H100 NVL", 835e12), ("H100 PCIe", 756.5e12), ("H200", 989.4e12),
         ("H100", 989.4e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12), ("L4", 121e12)]


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def device_peak(device):
    import torch
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    return next((p for k, p in PEAKS if k in name), None), name


def sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup, repeats):
    """Median seconds of fn over `repeats` calls after `warmup` calls, synchronised around each."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), ts


# ---- env --------------------------------------------------------------------------------------------------

def part_env(a, device):
    import importlib
    import platform

    import torch
    versions = {"python": platform.python_version()}
    for name in ("torch", "transformers", "safetensors", "tokenizers", "numpy", "pytest", "peft", "trl"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except Exception:
            versions[name] = None
    peak, name = device_peak(device)
    env = {"device": name, "peak_bf16_flops": peak, "versions": versions, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
           "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2 ** 30, 1),
                   multiprocessors=p.multi_processor_count, bf16_supported=torch.cuda.is_bf16_supported())
    env["matmul_tflops"] = matmul_probe(device, a.tiny)
    if device.type == "cuda":    # clocks and power right after the probe's load (a capped card shows here)
        q = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,pstate"
        try:
            env["nvidia_smi"] = dict(zip(q.split(","), subprocess.run(
                ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True,
                timeout=20).stdout.strip().split(", ")))
        except (OSError, subprocess.SubprocessError) as e:
            env["nvidia_smi"] = str(e)
    return env


def matmul_probe(device, tiny):
    """Measured bf16 matmul TFLOP/s: a large square product (the card's practical peak) and the shapes of a
    GPT-2-124M SFT step at 16 x 1024 tokens (what its MFU can reach at best)."""
    import torch
    shapes = {"8192^3": (8192, 8192, 8192), "gpt2 qkv 16384x768x2304": (16384, 768, 2304),
              "gpt2 mlp 16384x768x3072": (16384, 768, 3072), "gpt2 head 16384x768x50257": (16384, 768, 50257)}
    out = {}
    for name, (m, k, n) in shapes.items():
        if tiny:
            m, k, n = 64, 64, 64
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        s, _ = timed(lambda: x @ w, device, 3, 10)
        out[name] = round(2 * m * k * n / s / 1e12, 1)
    return out


# ---- correctness ------------------------------------------------------------------------------------------

# what the train part checks after its rows: the paths its issue changed (log-probs, the SFT and DPO steps, resume)
TRAIN_TESTS = "chunked or parity or script_steps or resume"


def part_correctness(a, device, subset=""):
    """pytest -m gpu on the device (only the tests `subset` selects, a -k expression, when given); each test's
    outcome (tests/conftest.py writes outcomes.jsonl as tests end) and the tests' own measurements folded into
    one JSON."""
    outcomes, meas = (os.path.join(a.out, f) for f in ("outcomes.jsonl", "measurements.jsonl"))
    for f in (outcomes, meas):
        if os.path.exists(f):
            os.remove(f)
    env = dict(os.environ, NANO_RLHF_TEST_DEVICE=str(device), NANO_RLHF_GPU_OUT=a.out,
               CUBLAS_WORKSPACE_CONFIG=":4096:8",    # deterministic cuBLAS (the resume test); set before CUDA starts
               PYTHONPATH=ROOT)
    k = " and ".join(f"({x})" for x in (a.k, subset, "not compiled" if a.no_compile else "") if x)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-n", "0", "-q", "-rfE", "-p",
           "no:cacheprovider"] + (["-k", k] if k else [])
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    result = {"returncode": p.returncode, "output_tail": p.stdout[-3000:] + p.stderr[-2000:]}
    result.update(fold_outcomes(a.out))
    return result


def fold_outcomes(out):
    """correctness.json's fields from the files the tests append to (also after a run stopped at its limit)."""
    read = lambda f: [json.loads(x) for x in open(os.path.join(out, f))] if os.path.exists(os.path.join(out, f)) \
        else []
    tests, measurements = read("outcomes.jsonl"), read("measurements.jsonl")
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    for f in ("outcomes.jsonl", "measurements.jsonl"):
        if os.path.exists(os.path.join(out, f)):
            os.remove(os.path.join(out, f))
    return {"counts": counts, "tests": tests, "measurements": measurements}


# ---- SFT step speed ---------------------------------------------------------------------------------------

def our_config(shape, tiny):
    from nano_rlhf.model import GPTConfig
    d = dict(SHAPES[shape])
    if tiny:
        d.update(TINY_SHAPE, n_kv_head=2 if d["model_type"] != "gpt2" else None,
                 intermediate_size=128 if d["model_type"] != "gpt2" else None)
        d = {k: v for k, v in d.items() if v is not None}
    return GPTConfig(**d, eos_token_id=0, pad_token_id=1)


def hf_config(cfg):
    """The transformers config of the same shape."""
    import transformers
    if cfg.model_type == "gpt2":
        return transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                                       n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0)
    cls = transformers.Qwen2Config if cfg.model_type == "qwen2" else transformers.LlamaConfig
    extra = {} if cfg.model_type == "qwen2" else {"attention_bias": cfg.attention_bias}
    return cls(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.intermediate_size,
               num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
               max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.rms_norm_eps,
               tie_word_embeddings=cfg.tie_word_embeddings,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, **extra)


def flops_per_token(cfg, n_params, T):
    """nanoGPT's estimate_mfu accounting: 6N + 12·L·H·Q·T (N without GPT-2's position embeddings)."""
    head_dim = cfg.head_dim or cfg.n_embd // cfg.n_head
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_head * head_dim * T


def kernel_profile(fn, device, top=15):
    """Where one call's device time goes: the top kernels by time (ms) and their share, and busy = the kernels'
    time / the call's wall time (below ~0.9 the step waits on the host). On CUDA only the kernel rows count (a
    CPU op's device time repeats its kernels'); on a CPU, the ops' self time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()                              # the profiled call is not the first
    sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    if cuda:
        events = [(e.name, e.device_time_total) for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    per = {}
    for name, us in events:
        per[name] = per.get(name, 0) + us
    total = sum(per.values()) or 1
    rows = sorted(per.items(), key=lambda kv: -kv[1])[:top]
    # which SDPA kernels ran (model.SDPA_BACKENDS chose them): cuDNN's, flash's, the memory-efficient fmha's
    attention = sorted({k[:90] for k in per if re.search(r"attention|fmha|flash|sdpa|cudnn", k, re.I)})
    return {"kernel_ms": round(total / 1e3, 2), "wall_ms": round(wall * 1e3, 2),
            "busy": round(total / 1e6 / wall, 3) if cuda else None,
            "top": [[k[:90], round(us / 1e3, 2), round(us / total, 3)] for k, us in rows], "attention": attention}


def step_rows(device, make_sides, steps, warmup):
    """Median seconds a step of each side, the sides alternated step by step (A B A B ...) after `warmup` steps
    each, so that a clock or thermal drift falls on both alike. make_sides: {side: step function}."""
    times = {k: [] for k in make_sides}
    for _ in range(warmup):
        for fn in make_sides.values():
            fn()
    for _ in range(steps):
        for k, fn in make_sides.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t)
    return {k: (statistics.median(v), v) for k, v in times.items()}


def host_reads_of(fn, device):
    """The host synchronisations of one call of fn (after a first, warming call), counted under
    torch.cuda.set_sync_debug_mode("warn"): {"count": n, "first": the first warnings}. Our SFT step is meant to
    make exactly one, the read of its loss and gradient norm after the update. On a CPU: "not checked"."""
    import warnings

    import torch
    if device.type != "cuda":
        return "not checked (CPU)"
    fn()
    sync(device)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0][:160] for w in seen if "synchroniz" in str(w.message)]
    return {"count": len(syncs), "first": syncs[:3]}


def head_probe(device, tiny):
    """The output layer alone, forward + backward of the log-probs of 16,384 positions (8,192 at Qwen) under bf16
    autocast: the plain one-chunk computation (whole float32 logits), and the operator in its chunks, padded
    (CUDA's default) and not. ms a call and peak memory."""
    import torch
    from nano_rlhf import model as M
    out = {}
    shapes = {"gpt2 50257": (16384, 768, 50257), "smollm2 49152": (16384, 576, 49152),
              "qwen2.5 151936": (8192, 896, 151936)}
    for name, (n, c, v) in shapes.items():
        if tiny:
            n, c, v = 256, 64, 1001
        h0 = torch.randn(n, c, device=device)
        w = (0.02 * torch.randn(v, c, device=device)).requires_grad_()
        t = torch.randint(0, v, (n,), device=device)

        def call(chunk, pad):
            def fn():
                w.grad = None
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    M.token_logprobs(h0.clone().requires_grad_(), w, t, chunk_size=chunk, pad_to=pad).sum().backward()
            return fn
        chunk = M.chunk_rows(v, device) if not tiny else 64
        sides = {"one chunk (plain)": call(n, 1), "operator": call(chunk, 1), "operator, padded": call(chunk, 128)}
        row = {}
        for side, fn in sides.items():
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                med, _ = step_rows(device, {side: fn}, 2 if tiny else 6, 1)[side]
                row[side] = {"ms": round(med * 1e3, 2)}
                if device.type == "cuda":
                    row[side]["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
            except Exception as e:      # the plain side can run out of memory at Qwen's vocabulary
                row[side] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        out[name] = row
    return out


def part_train(a, device, save):
    """The probes, then SFT at three shapes and DPO, each against a bare HF loop of the same work in this process,
    the two alternated step by step; then the correctness subset of what this part measures."""
    import torch
    import transformers

    import train_dpo
    import train_sft
    from nano_rlhf.data import collate_pairs
    from nano_rlhf.model import GPT
    from nano_rlhf.training import adamw, autocast
    transformers.logging.set_verbosity_error()
    result = {"env": part_env(a, device)}
    save(result)
    result["head"] = head_probe(device, a.tiny)
    save(result)
    peak, _ = device_peak(device)
    ceiling = result["env"]["matmul_tflops"].get("gpt2 mlp 16384x768x3072")
    rows = result["rows"] = []
    steps, warmup = (2, 1) if a.tiny else (10, 3)
    opts = train_sft.Options(dtype="bfloat16", grad_clip=1.0)

    def finish(row, model_cfg, n_params, tokens, hf_s, flops_factor=1.0):
        """MFU against the datasheet and against the measured matmul ceiling, the ratio to HF."""
        row["tokens_per_s"] = round(tokens / row["s_per_step"])
        if peak:
            flops = flops_factor * flops_per_token(model_cfg, n_params, row["batch"][1]) * row["tokens_per_s"]
            row["mfu"] = round(flops / peak, 4)
            if ceiling:
                row["share_of_matmul_ceiling"] = round(flops / (ceiling * 1e12), 4)
        if hf_s:
            row["vs_hf"] = round(hf_s / row["s_per_step"], 3)

    def build(shape, side, compiled=False):
        cfg = our_config(shape, a.tiny)
        torch.manual_seed(0)
        wpe = cfg.block_size * cfg.n_embd if cfg.model_type == "gpt2" else 0
        if side == "hf":
            m = transformers.AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="sdpa")
            m = m.to(device).train()
            return cfg, m, sum(p.numel() for p in m.parameters()) - wpe
        m = GPT(cfg).to(device).train()
        return cfg, (torch.compile(m) if compiled else m), m.num_params() - wpe

    def sft_sides(shape, compiled, batch=None, padded_hf=False):
        """One SFT step at the shape's batch (or `batch`); padded_hf adds HF's loop on the same model with its
        vocabulary padded to a multiple of 64 (resize_token_embeddings), the fair version of HF's side."""
        cfg, ours, n = build(shape, "ours", compiled)
        hfs = {"hf bare loop": build(shape, "hf")[1]}
        if padded_hf:
            hfs["hf bare loop, vocab padded to 64"] = build(shape, "hf")[1]
            hfs["hf bare loop, vocab padded to 64"].resize_token_embeddings(cfg.vocab_size, pad_to_multiple_of=64)
        B, T = batch or ((2, 32) if a.tiny else SFT_BATCH[shape])
        ids = torch.randint(2, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        o_opt, ids_d = adamw(ours, 1e-4, 0.1), ids.to(device)
        counter = iter(range(10 ** 9))

        def ours_step():            # the script's own step: one host read, the step's figures
            train_sft.train_step(ours, o_opt, [(ids, mask, mask)], opts, next(counter))

        def hf_loop(hf):
            h_opt = adamw(hf, 1e-4, 0.1)

            def hf_step():
                with autocast(device, "bfloat16"):
                    loss = hf(input_ids=ids_d, labels=ids_d).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
                h_opt.step()
                h_opt.zero_grad(set_to_none=True)
            return hf_step
        return cfg, n, (B, T), {"nano_rlhf" + (" --compile" if compiled else ""): ours_step,
                                **{name: hf_loop(hf) for name, hf in hfs.items()}}

    def dpo_sides(shape):
        """4 pairs (8 at full size) of prompt 128 + response 384: policy forward and backward on both rows, the
        live reference's forward. HF's side: the same loss written by hand over its logits."""
        cfg, ours, n = build(shape, "ours")
        _, ref, _ = build(shape, "ours")
        _, hf, _ = build(shape, "hf")
        _, hf_ref, _ = build(shape, "hf")
        for m in (ref, hf_ref):
            m.eval().requires_grad_(False)
        pairs, P, R = (2, 8, 16) if a.tiny else (8, 128, 384)
        g = torch.Generator().manual_seed(0)
        ex = [{"prompt": torch.randint(2, cfg.vocab_size, (P,), generator=g).tolist(),
               "chosen": torch.randint(2, cfg.vocab_size, (R,), generator=g).tolist(),
               "rejected": torch.randint(2, cfg.vocab_size, (R,), generator=g).tolist()} for _ in range(pairs)]
        ids, _, resp, _ = (x.to(device) if torch.is_tensor(x) else x for x in collate_pairs(ex, 1))
        dopts = train_dpo.Options(loss="dpo", beta=0.1, dtype="bfloat16")
        train_dpo.fill_defaults(dopts)
        o_opt, h_opt = adamw(ours, 1e-4, 0.1), adamw(hf, 1e-4, 0.1)
        batch = train_dpo.make_batch(ex, dopts, 1, device)

        def ours_step():            # the script's own step: one host read, the step's figures
            train_dpo.train_step(dopts, ours, ours, ref, o_opt, [batch], pairs)

        def seq_logps(model):
            logits = model(input_ids=ids).logits[:, :-1].float()
            lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            return (lp * resp[:, 1:]).sum(1)

        def hf_step():
            with autocast(device, "bfloat16"):
                s = seq_logps(hf)
                with torch.no_grad():
                    r = seq_logps(hf_ref)
            h = (s - r).view(2, -1)
            loss = -torch.nn.functional.logsigmoid(0.1 * (h[0] - h[1])).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            h_opt.step()
            h_opt.zero_grad(set_to_none=True)
        return cfg, n, (2 * pairs, P + R), {"nano_rlhf dpo": ours_step, "hf bare loop dpo": hf_step}

    def grpo_sides(shape):
        """One GRPO update as train_ppo runs it after sampling, with --num_minibatches 2 so that π_old is a forward
        of its own: 4 prompts x 8 samples, prompts of 128 (some left-padded), responses of 64-256 tokens,
        micro-batches of 16; π_old's forward (with_logprobs), two clipped-ratio minibatch updates, the step's
        figures (step_metrics). HF's side: the same work written by hand over its logits."""
        import train_ppo
        from nano_rlhf.cli import parse_args
        from nano_rlhf.rollout import Rollout
        from nano_rlhf.training import Learner
        cfg, ours, n = build(shape, "ours")
        _, hf, _ = build(shape, "hf")
        prompts, k, P, R, micro = (2, 4, 8, 16, 4) if a.tiny else (4, 8, 128, 256, 16)
        B, g = prompts * k, torch.Generator().manual_seed(0)
        attn = torch.ones(B, P + R, dtype=torch.long)
        attn[1::2, :P // 8] = 0                                            # left-padded prompts
        lengths = torch.randint(R // 4, R + 1, (B,), generator=g)
        attn[:, P:] = (torch.arange(R)[None] < lengths[:, None]).long()   # responses of several lengths
        ids = torch.randint(2, cfg.vocab_size, (B, P + R), generator=g) * attn
        resp, scores = attn[:, P:].float(), torch.randn(B, generator=g)
        gopts = parse_args(train_ppo.Options, ["--advantage", "grpo", "--samples_per_prompt", str(k), "--batch_size",
                                               str(prompts), "--num_minibatches", "2", "--micro_batch_size",
                                               str(micro), "--dtype", "bfloat16", "--lr", "1e-6"])
        train_ppo.fill_defaults(gopts)
        rollout = Rollout(query_response=ids.to(device), attention_mask=attn.to(device), host_attention_mask=attn,
                          response_mask=resp.to(device), has_eos=torch.ones(B, device=device), completions=[""] * B,
                          scores=scores.to(device), raw_scores=scores.to(device), policy_mask=resp.to(device))
        targets = train_ppo.advantages(rollout, estimator="grpo", beta=0.0, k=k)
        models, policy = train_ppo.Models(policy=ours, reward=None), Learner(ours, ours, adamw(ours, 1e-6, 0.1))
        shuffle, h_opt = torch.Generator().manual_seed(0), adamw(hf, 1e-6, 0.1)
        ids_d, attn_d, resp_d, adv_d = ids.to(device), attn.to(device), resp.to(device), targets.adv

        def ours_step():            # the script's own update: no host read inside, one for the step's figures
            r = train_ppo.with_logprobs(rollout, models, gopts)
            sums = train_ppo.update(r, targets, policy, None, gopts, 0.0, shuffle)
            train_ppo.step_metrics(r, torch.zeros(B, device=device), torch.zeros(B, device=device), sums, 0.0, k)

        def hf_logps(rows):
            logits = hf(input_ids=ids_d[rows], attention_mask=attn_d[rows]).logits[:, P - 1:-1].float()
            return logits.log_softmax(-1).gather(-1, ids_d[rows, P:, None]).squeeze(-1) * resp_d[rows]

        def hf_step():
            with torch.no_grad(), autocast(device, "bfloat16"):
                old = torch.cat([hf_logps(slice(i, i + micro)) for i in range(0, B, micro)])
            order = torch.randperm(B, generator=shuffle).to(device)
            for half in order.view(2, -1):
                n_tok = resp_d[half].sum()
                for rows in half.view(-1, micro):
                    with autocast(device, "bfloat16"):
                        lp = hf_logps(rows)
                    ratio, adv = (lp - old[rows]).exp(), adv_d[rows]
                    pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
                    ((pg * resp_d[rows]).sum() / n_tok).backward()
                torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
                h_opt.step()
                h_opt.zero_grad(set_to_none=True)
        return cfg, n, (B, P + R), {"nano_rlhf grpo update": ours_step, "hf bare loop grpo update": hf_step}

    shapes = [x for x in a.shapes.split(",") if x] or list(SHAPES)
    # GPT-2 also at twice the batch, and against HF with its vocabulary padded (the issue's fair HF side)
    plan = [("sft", s, False) for s in shapes] + [("sft", "gpt2-124m", True)] * (not a.no_compile) + \
        [("sft_32", "gpt2-124m", False), ("dpo", "gpt2-124m", False), ("grpo_update", "gpt2-124m", False),
         ("grpo_update", "qwen2.5-0.5b", False)]
    make = {"sft": lambda shape, compiled: sft_sides(shape, compiled, padded_hf=shape == "gpt2-124m" and not compiled),
            "sft_32": lambda shape, _: sft_sides(shape, False, (4, 32) if a.tiny else (32, 1024)),
            "dpo": lambda shape, _: dpo_sides(shape), "grpo_update": lambda shape, _: grpo_sides(shape)}
    for kind, shape, compiled in plan:
        group = []
        try:
            cfg, n, (B, T), sides = make[kind](shape, compiled)
            ours_name = next(iter(sides))
            reads = host_reads_of(sides[ours_name], device)
            timing = step_rows(device, sides, steps, warmup)
            hf_s = timing[next(k for k in sides if k.startswith("hf"))][0]      # HF as shipped (the first)
            padded = timing.get("hf bare loop, vocab padded to 64")
            for side, (med, ts) in timing.items():
                row = {"shape": shape, "kind": kind, "side": side, "batch": [B, T], "dtype": "bfloat16 autocast",
                       "s_per_step": round(med, 4), "times": [round(x, 4) for x in ts]}
                # DPO's reference forward and the GRPO update's π_old forward count 2N a token beside the 6N
                finish(row, cfg, n, B * T, None if side.startswith("hf") else hf_s,
                       4 / 3 if kind in ("dpo", "grpo_update") else 1.0)
                if side == ours_name:
                    if padded:
                        row["vs_hf_padded_vocab"] = round(padded[0] / row["s_per_step"], 3)
                    row["host_reads"] = reads
                    if shape != "qwen2.5-0.5b" and not compiled:
                        row["profile"] = kernel_profile(sides[side], device)
                if device.type == "cuda":       # both sides' models live in this process: what one step adds
                    sync(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                    sides[side]()
                    sync(device)
                    row["step_added_gib"] = round((torch.cuda.max_memory_allocated(device) - before) / 2 ** 30, 2)
                    row["resident_gib"] = round(before / 2 ** 30, 2)
                group.append(row)
        except Exception as e:          # one failing row must not lose the others
            group = [{"shape": shape, "kind": kind, "error": f"{type(e).__name__}: {str(e)[:400]}"}]
        rows.extend(group)
        save(result)
        sides = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    result["correctness"] = part_correctness(a, device, subset=TRAIN_TESTS)
    return result


# ---- one GRPO step -----------------------------------------------------------------------------------------

REWARD = '''def reward(prompts, completions):
    """A reward with spread inside every group (the check times the step; what it rewards does not matter)."""
    return [(len(c) % 7) / 7.0 for c in completions]
'''


def part_grpo(a, device, save):
    import torch

    import train_ppo
    from nano_rlhf.model import GPT
    from nano_rlhf.tokenizer import Tokenizer
    work = tempfile.mkdtemp(prefix="gpu-grpo-")
    cfg = our_config("qwen2.5-0.5b", a.tiny)
    torch.manual_seed(0)
    GPT(cfg).save_pretrained(os.path.join(work, "init"))
    words = "the a review write short of phone motor screen battery great bad quiet loud fine".split()
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 9)) for i in range(400)]
    # a small tokenizer with a larger model vocabulary (as Qwen's 151,665 tokens under a 151,936-row embedding);
    # sampled ids past the tokenizer decode to nothing
    Tokenizer.train(texts, vocab_size=300).save(os.path.join(work, "init", "tokenizer.json"))
    with open(os.path.join(work, "prompts.jsonl"), "w") as f:
        for t in texts[:200]:
            f.write(json.dumps({"prompt": "write a short review of the " + t}) + "\n")
    with open(os.path.join(work, "reward.py"), "w") as f:
        f.write(REWARD)
    n_prompts, k, new = (4, 4, 16) if a.tiny else (16, 8, 128)
    args = ["--advantage", "grpo", "--reward", os.path.join(work, "reward.py") + ":reward", "--init",
            os.path.join(work, "init"), "--prompts", os.path.join(work, "prompts.jsonl"), "--out_dir",
            os.path.join(work, "out"), "--device", str(device), "--dtype", "bfloat16", "--rollout_dtype", "bfloat16",
            "--batch_size", str(n_prompts), "--samples_per_prompt", str(k), "--max_new_tokens", str(new),
            "--max_steps", "2", "--log_interval", "1", "--eval_interval", "0", "--save_interval", "0",
            "--kl_coef", "0.04", "--kl_in_loss", "--lr", "1e-6"]
    metrics = os.path.join(work, "out", "metrics.jsonl")

    def summary():
        steps = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
        steps = [s for s in steps if "train/step_time" in s]
        result = {"shape": "qwen2.5-0.5b" if not a.tiny else "tiny", "prompts": n_prompts, "samples_per_prompt": k,
                  "max_new_tokens": new, "dtype": "bfloat16 autocast, bf16 sampling copy", "args": args,
                  "step_s": [round(s["train/step_time"], 3) for s in steps],
                  "generate_s": [round(s["train/generate_time"], 3) for s in steps]}
        if steps:
            last = steps[-1]       # the first step also warms up kernels and allocators
            gen, step = last["train/generate_time"], last["train/step_time"]
            result.update(rollout_share=round(gen / step, 3), update_share=round(1 - gen / step, 3),
                          completions_per_s=round(n_prompts * k / step, 2),
                          mean_response_length=last.get("train/response_length"))
        return result

    done = threading.Event()

    def watch():                    # the file after every step, so a run stopped at its limit keeps its steps
        while not done.wait(2.0):
            save(summary())
    threading.Thread(target=watch, daemon=True).start()
    t0 = time.perf_counter()
    train_ppo.main(args)
    done.set()
    return dict(summary(), run_s_including_load=round(time.perf_counter() - t0, 1))


# ---- rollout throughput -------------------------------------------------------------------------------------

def part_rollout(a, device, save):
    import torch
    import transformers

    from nano_rlhf.model import GPT
    transformers.logging.set_verbosity_error()
    cfg = our_config("smollm2-135m", a.tiny)
    prompts, k, P, new = (4, 2, 8, 8) if a.tiny else (64, 8, 64, 256)
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(2, cfg.vocab_size, (prompts, P), generator=g).to(device)
    rows_ids = prompt_ids.repeat_interleave(k, 0)                 # the k samples of a prompt are adjacent rows
    mask = torch.ones_like(rows_ids)
    new_tokens = prompts * k * new
    rows = []

    def add(row):
        rows.append(row)
        save({"prompts": prompts, "samples_per_prompt": k, "prompt_len": P, "new_tokens": new, "rows": rows})

    torch.manual_seed(0)
    ours = GPT(cfg).to(device).eval()
    want = [x for x in a.sides.split(",") if x] or ["eager", "compiled", "hf", "hf_static"]
    sides = [("nano_rlhf eager, bf16 sampling copy", {})] if "eager" in want else []
    if not a.no_compile and "compiled" in want:
        sides.append(("nano_rlhf compiled (mode reduce-overhead), bf16 sampling copy", {"compile": True}))
    for name, kw in sides:
        stats = {}
        row = {"side": name}
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            t0 = time.perf_counter()
            out = ours.generate(rows_ids, mask, new, temperature=1.0, generator=gen, dtype=torch.bfloat16,
                                stats=stats, **kw)
            sync(device)
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            row["compile_s"] = round(stats.get("compile_s", 0.0), 2)
            assert out.shape[1] == P + new
            s, ts = timed(lambda: ours.generate(rows_ids, mask, new, temperature=1.0, generator=gen,
                                                dtype=torch.bfloat16, **kw), device, 0, 2)
            row.update(s_per_call=round(s, 3), new_tokens_per_s=round(new_tokens / s), compiled=stats.get("compiled"))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        add(row)
    tmp = tempfile.mkdtemp(prefix="gpu-rollout-")
    ours.save_pretrained(tmp)
    ours = None                   # its memory back before transformers' copy loads
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to(device).eval()
    hf_sides = [("hf generate, default cache", {})] if "hf" in want else []
    if "hf_static" in want:
        hf_sides.append(("hf generate, static cache", {"cache_implementation": "static"}))
    for name, extra in hf_sides:
        row = {"side": name}
        try:
            def call():
                return hf.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=True,
                                   num_return_sequences=k, max_new_tokens=new, min_new_tokens=new,
                                   eos_token_id=None, pad_token_id=1, top_k=None, top_p=None, temperature=1.0,
                                   **extra)
            if not extra:          # the default cache compiles nothing: a short call warms the kernels
                with torch.no_grad():
                    hf.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=True,
                                max_new_tokens=4, eos_token_id=None, pad_token_id=1)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = call()
            sync(device)
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            assert out.shape == (prompts * k, P + new), out.shape
            with torch.no_grad():
                s, ts = timed(call, device, 0, 1)
            row.update(s_per_call=round(s, 3), new_tokens_per_s=round(new_tokens / s))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        add(row)
    base = next((r for r in rows if r["side"] == "hf generate, default cache" and "s_per_call" in r), None)
    static = next((r for r in rows if r["side"] == "hf generate, static cache" and "s_per_call" in r), None)
    for r in rows:
        if r["side"].startswith("nano_rlhf") and "s_per_call" in r:
            if base:
                r["vs_hf_default"] = round(base["s_per_call"] / r["s_per_call"], 2)
            if static:
                r["vs_hf_static"] = round(static["s_per_call"] / r["s_per_call"], 2)
    result = {"prompts": prompts, "samples_per_prompt": k, "prompt_len": P, "new_tokens": new, "rows": rows}
    save(result)
    return result


# ---- the driver ---------------------------------------------------------------------------------------------

def run_part(a, part):
    """In the child process: run one part, write OUT/<part>.json."""
    import torch
    device = torch.device("cuda:0" if a.device == "cuda" else a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    path = os.path.join(a.out, f"{part}.json")
    save = lambda obj: write_json(path, {"part": part, "done": False, **obj})
    t0 = time.time()
    if part == "correctness":
        result = part_correctness(a, device)
    else:
        result = {"train": part_train, "grpo": part_grpo, "rollout": part_rollout}[part](a, device, save)
    write_json(path, {"part": part, "done": True, "seconds": round(time.time() - t0, 1),
                      "planned_s": sum(s for _, s in PLAN[part]), **result})
    tests = result if part == "correctness" else result.get("correctness")
    return 1 if tests and tests["returncode"] != 0 else 0


def table(out):
    """The measured rows of the parts in OUT, at most 20 lines: what the reply of a GPU command keeps."""
    lines = []
    path = os.path.join(out, "train.json")
    if os.path.exists(path):
        r = json.load(open(path))
        env = r.get("env", {})
        lines.append(f"train: {env.get('device')} | matmul TFLOP/s {env.get('matmul_tflops')}")
        for name, sides in r.get("head", {}).items():
            lines.append(f"  head {name}: " + ", ".join(f"{k} {v.get('ms', v.get('error', '?'))} ms"
                                                       for k, v in sides.items()))
        for row in r.get("rows", []):
            if row.get("side", "").startswith("hf"):      # its time is in our row's "x HF"
                continue
            if "error" in row:
                lines.append(f"  {row['kind']} {row['shape']}: {row['error'][:80]}")
                continue
            exp = EXPECTED.get((row["kind"], row["shape"], row["side"]), {})
            reads = row.get("host_reads")
            syncs = f", host syncs {reads['count']} (exp 1)" if isinstance(reads, dict) else ""
            padded = f", x HF padded {row['vs_hf_padded_vocab']} (exp 1.5)" if "vs_hf_padded_vocab" in row else ""
            lines.append(f"  {row['kind']} {row['shape']} {row['side']}: {row['s_per_step'] * 1e3:.1f} ms, "
                         f"MFU {row.get('mfu')} (exp {exp.get('mfu')}), x HF {row.get('vs_hf')} "
                         f"(exp {exp.get('vs_hf')}){padded}{syncs}")
    path = os.path.join(out, "rollout.json")
    if os.path.exists(path):
        for row in json.load(open(path)).get("rows", []):
            lines.append(f"rollout {row['side'][:40]}: {row.get('new_tokens_per_s')} tok/s, x HF static "
                         f"{row.get('vs_hf_static')}")
    return lines[:20]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="directory for the JSON files (created)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for the dry run")
    ap.add_argument("--only", default="", help=f"comma list of parts to run: {','.join(PARTS)}")
    ap.add_argument("-k", default="", help="correctness: pytest -k expression (rerun some tests)")
    ap.add_argument("--tiny", action="store_true", help="smallest shapes (the CPU dry run)")
    ap.add_argument("--no_compile", action="store_true", help="skip the torch.compile rows and test (the dry run)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every part's time limit")
    ap.add_argument("--shapes", default="", help=f"sft: comma list of shapes ({','.join(SHAPES)}); empty = all")
    ap.add_argument("--sides", default="", help="rollout: comma list of eager,compiled,hf,hf_static; empty = all")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)      # the child process of one part
    a = ap.parse_args(argv)
    only = [p for p in a.only.split(",") if p] or list(PARTS)
    bad = [p for p in only if p not in PARTS]
    if bad:
        print(f"error: --only: unknown part(s) {', '.join(bad)}; the parts are {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if a.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            print(f"error: --device {a.device}: no CUDA GPU is available here (use --device cpu --tiny for the "
                  "dry run)", file=sys.stderr)
            return 2
    over = [p for p in only if sum(s for _, s in PLAN[p]) > MAX_PART_S]
    if over:
        print(f"error: part(s) {', '.join(over)} planned over {MAX_PART_S} s of device time: split them",
              file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    if a.part:
        return run_part(a, a.part)
    for part in only:
        print(f"{part}: planned {sum(s for _, s in PLAN[part])} s of device time (" +
              "; ".join(f"{what} {s}" for what, s in PLAN[part]) + ")", flush=True)
    failed = []
    for part in only:
        t0 = time.time()
        cmd = [sys.executable, os.path.abspath(__file__), a.out, "--device", a.device, "--part", part] + \
              (["-k", a.k] if a.k else []) + (["--tiny"] if a.tiny else []) + \
              (["--no_compile"] if a.no_compile else []) + ["--shapes", a.shapes, "--sides", a.sides]
        try:
            p = subprocess.run(cmd, cwd=ROOT, timeout=LIMITS[part] * a.scale, capture_output=True, text=True)
            ok = p.returncode == 0
            tail = (p.stdout + p.stderr)[-1500:]
        except subprocess.TimeoutExpired as e:
            ok, tail = False, f"stopped at its limit of {LIMITS[part] * a.scale:.0f} s\n" + \
                str((e.stdout or b"")[-800:]) + str((e.stderr or b"")[-800:])
        if not ok:
            failed.append(part)
            path = os.path.join(a.out, f"{part}.json")
            prev = json.load(open(path)) if os.path.exists(path) else {"part": part}
            if part == "correctness" and "counts" not in prev:      # stopped: what the tests wrote so far
                prev.update(fold_outcomes(a.out))
            if part == "train" and "correctness" not in prev:
                prev["correctness"] = fold_outcomes(a.out)
            write_json(path, {**prev, "done": False, "process_error": tail})
        verdict = "ok" if ok else "FAILED"
        if part == "correctness" and os.path.exists(os.path.join(a.out, "correctness.json")):
            c = json.load(open(os.path.join(a.out, "correctness.json")))
            verdict += f" {c.get('counts')}"
        print(f"{part}: {verdict} ({time.time() - t0:.0f} s)", flush=True)
    print("\n".join(table(a.out)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
