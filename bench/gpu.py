"""The GPU check: correctness first, then speed, in one command of a few minutes on one GPU.

    python bench/gpu.py OUT                    # everything, ~4 minutes on one H100 (JSON into OUT as it goes)
    python bench/gpu.py OUT --only rollout     # one part again (env, correctness, sft, grpo, rollout)
    python bench/gpu.py OUT --only correctness -k "resume or lora"    # some correctness tests again
    python bench/gpu.py OUT --device cpu --tiny   # the dry run tests/test_gpu_check.py does on every CI run

Each part runs in its own process (a crash or a hang in one loses none of the others) under its own time limit,
and writes its JSON into OUT when it ends; the speed parts rewrite theirs after every row, so a run stopped at
its time limit still returns what finished. It needs nothing from the network and only what a GPU machine
without one has (torch >= 2.3, transformers, safetensors, tokenizers, numpy, pytest; peft and TRL are not
used); the versions found go into env.json.

Parts, in order:
  env          device, versions, peak bf16 dense FLOP/s used for MFU                       -> env.json
  correctness  `pytest -m gpu tests/test_gpu.py` on the device (its measurements too)      -> correctness.json
  sft          one SFT step (the script's: sft_nll with chunked float32 log-probs, backward, clip, AdamW), bf16
               autocast, at GPT-2-124M, SmolLM2-135M and Qwen2.5-0.5B shapes (random weights): tokens/s and MFU
               (nanoGPT's estimate_mfu: 6N + 12·L·H·Q·T FLOPs a token) against a bare HF transformers loop
               (model(ids, labels=ids).loss, backward, clip, AdamW) of the same shape, batch and dtype  -> sft.json
  grpo         train_ppo.py --advantage grpo at Qwen2.5-0.5B shape, bf16, 16 prompts x 8 samples x 128 new
               tokens: seconds a step and the share of rollout and update (the second step; the first warms up)
                                                                                         -> grpo.json
  rollout      64 prompts x 8 samples x 256 new tokens (no stop token: every row runs to the end) at SmolLM2-135M
               shape in bf16: the rollout engine (prefix shared, eager and compiled; compile time apart) against
               HF `generate` with its default cache and with cache_implementation="static"
                                                                                         -> rollout.json
Timing: torch.cuda.synchronize() around each timed call (only here: the scripts never synchronise for timing),
median of the timed repeats after warm-up calls.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

PARTS = ("env", "correctness", "sft", "grpo", "rollout")
LIMITS = {"env": 40, "correctness": 170, "sft": 150, "grpo": 120, "rollout": 200}   # seconds per part on a GPU

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

# bf16 dense peak FLOP/s (no sparsity) by device name, from NVIDIA's data sheets
PEAKS = [("H200", 989.4e12), ("H100 PCIe", 756.5e12), ("H100", 989.4e12), ("A100", 312e12), ("L40S", 362e12),
         ("A10G", 70e12), ("L4", 121e12)]


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

def part_correctness(a, device):
    """pytest -m gpu on the device; each test's outcome (tests/conftest.py writes outcomes.jsonl as tests end)
    and the tests' own measurements folded into one JSON."""
    outcomes, meas = (os.path.join(a.out, f) for f in ("outcomes.jsonl", "measurements.jsonl"))
    for f in (outcomes, meas):
        if os.path.exists(f):
            os.remove(f)
    env = dict(os.environ, NANO_RLHF_TEST_DEVICE=str(device), NANO_RLHF_GPU_OUT=a.out,
               CUBLAS_WORKSPACE_CONFIG=":4096:8",    # deterministic cuBLAS (the resume test); set before CUDA starts
               PYTHONPATH=ROOT)
    k = " and ".join(f"({x})" for x in (a.k, "not compiled" if a.no_compile else "") if x)
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
    """Where one call's device time goes: the top kernels by self time (ms) and their share (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    events = prof.key_averages()
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, attr, 0) for e in events) or 1
    rows = sorted(events, key=lambda e: -getattr(e, attr, 0))[:top]
    return {"total_ms": round(total / 1e3, 2),
            "top": [[e.key[:90], round(getattr(e, attr, 0) / 1e3, 2), round(getattr(e, attr, 0) / total, 3)]
                    for e in rows]}


def part_sft(a, device, save):
    import torch
    import transformers

    from nano_rlhf.training import adamw, autocast
    from nano_rlhf.model import GPT
    from train_sft import sft_nll
    transformers.logging.set_verbosity_error()
    peak, _ = device_peak(device)
    rows = []
    warmup, repeats = (1, 2) if a.tiny else (3, 8)
    for shape in [x for x in a.shapes.split(",") if x] or SHAPES:
        cfg = our_config(shape, a.tiny)
        B, T = (2, 32) if a.tiny else SFT_BATCH[shape]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(2, cfg.vocab_size, (B, T), generator=g).to(device)
        mask = torch.ones_like(ids)

        def ours_step(model, opt):
            def step():
                with autocast(device, "bfloat16"):
                    nll, n = sft_nll(model, ids, mask, mask)
                (nll / n).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step

        def hf_step(model, opt):
            def step():
                with autocast(device, "bfloat16"):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step

        def measure(side, build, make_step, profile=False):
            torch.manual_seed(0)
            row = {"shape": shape, "side": side, "batch": [B, T], "dtype": "bfloat16 autocast"}
            try:
                model, n_params = build()
                opt = adamw(model, 1e-4, 0.1)
                t0 = time.perf_counter()
                step = make_step(model, opt)
                step()
                sync(device)
                row["first_step_s"] = round(time.perf_counter() - t0, 3)     # compile, allocator warm-up
                s, ts = timed(step, device, warmup, repeats)
                tok_s = B * T / s
                row.update(s_per_step=round(s, 4), tokens_per_s=round(tok_s), times=[round(t, 4) for t in ts])
                if peak:
                    row["mfu"] = round(flops_per_token(cfg, n_params, T) * tok_s / peak, 4)
                if device.type == "cuda":
                    row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
                if profile:
                    row["profile"] = kernel_profile(step, device)
                del model, opt, step
            except Exception as e:        # one failing row must not lose the others
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            rows.append(row)
            save({"rows": rows})
            return row

        def ours(compiled=False):
            m = GPT(cfg).to(device).train()
            n = m.num_params() - (cfg.block_size * cfg.n_embd if cfg.model_type == "gpt2" else 0)
            return (torch.compile(m) if compiled else m), n

        def hf():
            m = transformers.AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="sdpa")
            m = m.to(device).train()
            wpe = cfg.block_size * cfg.n_embd if cfg.model_type == "gpt2" else 0
            return m, sum(p.numel() for p in m.parameters()) - wpe

        mine = measure("nano_rlhf", ours, ours_step, profile=shape == "gpt2-124m")
        # compiling takes tens of seconds a shape: the MFU target's shape only, and not in the dry run
        comp = measure("nano_rlhf --compile", lambda: ours(True), ours_step) \
            if shape == "gpt2-124m" and not a.no_compile else {}
        base = measure("hf bare loop", hf, hf_step)
        for r in (mine, comp):
            if "tokens_per_s" in r and "tokens_per_s" in base:
                r["vs_hf"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        save({"rows": rows})
    return {"rows": rows}


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
    if part == "env":
        result = part_env(a, device)
    elif part == "correctness":
        result = part_correctness(a, device)
    else:
        result = {"sft": part_sft, "grpo": part_grpo, "rollout": part_rollout}[part](a, device, save)
    write_json(path, {"part": part, "done": True, "seconds": round(time.time() - t0, 1), **result})
    return 1 if part == "correctness" and result["returncode"] != 0 else 0


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
    os.makedirs(a.out, exist_ok=True)
    if a.part:
        return run_part(a, a.part)
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
            if part == "correctness" and not os.path.exists(path):    # stopped: what the tests wrote so far
                prev.update(fold_outcomes(a.out))
            write_json(path, {**prev, "done": False, "process_error": tail})
        verdict = "ok" if ok else "FAILED"
        if part == "correctness" and os.path.exists(os.path.join(a.out, "correctness.json")):
            c = json.load(open(os.path.join(a.out, "correctness.json")))
            verdict += f" {c.get('counts')}"
        print(f"{part}: {verdict} ({time.time() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
