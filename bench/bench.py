"""Benchmarks: nano_rlhf against TRL / HF transformers, back to back on the same shape, on this machine.

    python bench/bench.py                    # everything (~10 minutes on 2 cores with TRL installed)
    python bench/bench.py --quick            # fewer steps
    python bench/bench.py --only sft,gen     # some rows
    python bench/bench.py --no-peers         # nano_rlhf only (no transformers / trl needed)
    python bench/bench.py --profile rm       # where one row's step time goes (torch profiler)

Reference shape (the one the peers' published CPU figures use; settings in bench/peers.py): GPT-2 with 4 layers, 4 heads, width 256, vocab 4096,
256 positions, dropout 0, float32, 2 threads. Every measurement runs in its own fresh process (so allocator
state, thread pools and warm caches never leak from one row into another), reports the median step time
after warm-up steps, and the ratios are computed from figures measured in this same run.

Rows: SFT step (16 x 128 tokens, forward + backward + AdamW), reward-model step (8 pairs of 128 tokens),
DPO step (8 pairs, prompt 32 + completion 96) with a live reference and with precomputed reference
log-probs, generation (batch 16, prompt 32, 64 new tokens, sampling at T = 1), GRPO step (4 prompts x 4
samples, 32 + 64 tokens, one update per rollout, beta = 0, reward = share of the letter "a"), PPO step
with critic and reward model on the same shape, and DDP scaling of the SFT step (2 processes x 1 thread
against 1 process x 1 thread). MFU-style figures divide the model's FLOPs (6·N per token + attention,
the nanoGPT/PaLM estimate) by the machine's float32 matmul throughput measured in the same run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE = dict(vocab_size=4096, block_size=256, n_layer=4, n_head=4, n_embd=256)


PROFILE = {}   # --profile: filled by the worker's timeit with where a step's time goes


def timeit(fn, warmup, steps):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    if PROFILE.get("on") and "ops" not in PROFILE:
        PROFILE["ops"] = profile_ops(fn)
    return statistics.median(ts), ts


def profile_ops(fn, calls=3):
    """Share of CPU time per operator over a few calls of fn (torch profiler, self time), largest first,
    with matrix products (mm, addmm, bmm, ...) also summed into one line."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ops.values())
    shares = sorted(((k, v / total) for k, v in ops.items()), key=lambda kv: -kv[1])
    matmul = sum(v for k, v in shares if k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"))
    return {"matrix products": matmul, **dict(shares[:12])}


def step_flops(tokens, seq_len, training=True, head_positions=None, end_rows=0, cfg=SHAPE):
    """Model FLOPs of one pass over `tokens` tokens in sequences of `seq_len` (nanoGPT's estimate_mfu / PaLM
    appendix B): 2·N per token forward, 6·N forward + backward, N = the matmul parameters a token passes
    through (positions excluded), plus attention 4·L·d·T per token forward (12·L·d·T with backward).
    head_positions: rows that go through the output layer (None = every token; 0 = none, a reward model).
    end_rows: the reward model's end_only pass, whose last block computes keys/values for every token but
    queries, projection and MLP for one position per row."""
    d, L, V = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    m = 3 if training else 1
    if end_rows:
        trunk = 12 * (L - 1) * d * d * tokens + 2 * d * d * tokens + 10 * d * d * end_rows
        attn = 2 * (L - 1) * d * seq_len * tokens
    else:
        trunk, attn = 12 * L * d * d * tokens, 2 * L * d * seq_len * tokens
    head = V * d * (tokens if head_positions is None else head_positions)
    return 2 * m * (trunk + head + attn)


# ---- workers: each runs in its own process and prints one JSON line -----------------------------------

def w_matmul(a):
    import torch
    shapes = {"qkv": (2048, 256, 768), "mlp_up": (2048, 256, 1024), "mlp_down": (2048, 1024, 256),
              "weight_grad": (256, 2048, 1024), "lm_head": (2048, 256, 4096), "square_512": (512, 512, 512)}
    out = {}
    for name, (m, k, n) in shapes.items():
        x, w = torch.randn(m, k), torch.randn(k, n)
        t, _ = timeit(lambda: torch.mm(x, w), 5, 40 if not a.quick else 15)
        out[name] = 2 * m * k * n / t / 1e9
    training = [out[k] for k in ("qkv", "mlp_up", "mlp_down", "weight_grad", "lm_head")]
    return {"gflops": statistics.median(training), "per_shape": out}


def _model(cls=None):
    import torch
    from nano_rlhf.model import GPT, GPTConfig
    torch.manual_seed(0)
    return (cls or GPT)(GPTConfig(**SHAPE, eos_token_id=0, pad_token_id=1))


def w_sft(a, dtype="float32"):
    import torch
    from nano_rlhf.training import adamw, autocast
    from train_sft import sft_nll
    m = _model().train()
    opt = adamw(m, 1e-4, 0.01)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 4096, (16, 128), generator=g)
    mask = torch.ones_like(ids)                       # plain text: every token trained, as TRL's SFT row

    def step():
        with autocast(torch.device("cpu"), dtype):        # what --dtype does in the scripts
            nll, n = sft_nll(m, ids, mask, mask)
        (nll / n).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    t, _ = timeit(step, 3, a.steps)
    return {"s_per_step": t, "tokens_per_step": 2048, "flops_per_step": step_flops(2048, 128)}


def w_sft_bf16(a):
    return w_sft(a, "bfloat16")


def _pairs(n_pairs, prompt, completion, vocab=4096, seed=0):
    import random
    r = random.Random(seed)
    return [{"prompt": [r.randrange(2, vocab) for _ in range(prompt)],
             "chosen": [r.randrange(2, vocab) for _ in range(completion - 1)] + [0],
             "rejected": [r.randrange(2, vocab) for _ in range(completion - 1)] + [0], "margin": 0.0}
            for _ in range(n_pairs)]


def w_rm(a):
    import torch
    from nano_rlhf.training import adamw
    from nano_rlhf.data import collate_pairs
    from nano_rlhf.model import ScoreModel
    from train_rm import pair_scores, reward_loss
    m = _model(ScoreModel).train()
    opt = adamw(m, 1e-4, 0.01)
    ids, attn, _, margin = collate_pairs(_pairs(8, 32, 96), pad_id=1)    # 8 pairs of exactly 128 tokens

    def step():
        rw, rl = pair_scores(m, ids, attn)
        reward_loss(rw, rl, margin).mean().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    t, _ = timeit(step, 3, a.steps)
    return {"s_per_step": t, "tokens_per_step": 16 * 128, "pairs_per_step": 8,
            "flops_per_step": step_flops(2048, 128, head_positions=0, end_rows=16)}


def w_dpo(a, precompute=False):
    import copy
    import torch
    from nano_rlhf.training import adamw
    from nano_rlhf.data import collate_pairs
    from train_dpo import dpo_loss, sequence_logps
    policy = _model().train()
    ref = copy.deepcopy(policy).requires_grad_(False).eval()
    opt = adamw(policy, 1e-4, 0.01)
    ids, attn, resp, _ = collate_pairs(_pairs(8, 32, 96), pad_id=1)
    with torch.no_grad():
        ref_w, ref_l = sequence_logps(ref, ids, attn, resp)[0].chunk(2)

    def step():
        s, _ = sequence_logps(policy, ids, attn, resp)
        pi_w, pi_l = s.chunk(2)
        if precompute:
            rw, rl = ref_w, ref_l
        else:
            with torch.no_grad():
                rw, rl = sequence_logps(ref, ids, attn, resp)[0].chunk(2)
        dpo_loss((pi_w - rw) - (pi_l - rl), 0.1).mean().backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    t, _ = timeit(step, 3, a.steps)
    n_resp = int(resp.sum())             # the output layer runs only where a response token is predicted
    flops = step_flops(2048, 128, head_positions=n_resp)
    if not precompute:
        flops += step_flops(2048, 128, training=False, head_positions=n_resp)
    return {"s_per_step": t, "tokens_per_step": 16 * 128, "pairs_per_step": 8, "flops_per_step": flops}


def w_dpo_pre(a):
    return w_dpo(a, precompute=True)


def w_gen(a, use_cache=True):
    import torch
    m = _model().eval()
    ids = torch.randint(2, 4096, (16, 32), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    t, _ = timeit(lambda: m.generate(ids, None, 64, temperature=1.0, eos_token_id=None, generator=g,
                                     use_cache=use_cache), 2, a.steps // 2 if use_cache else 3)
    if a.save_model:
        m.save_pretrained(a.save_model)
    # prefill of 16 x 32 tokens (output layer at the last position only), then 64 decode steps of 16 rows
    flops = step_flops(16 * 32, 32, False, head_positions=16) + sum(
        step_flops(16, 32 + i, False) for i in range(1, 64))
    return {"s_per_call": t, "new_tokens_per_s": 16 * 64 / t, "flops_per_call": flops}


def w_gen_nocache(a):
    return w_gen(a, use_cache=False)


class _LetterA:
    """TRL's bench reward: the share of the letter 'a' in the completion."""

    def __call__(self, prompts, completions):
        return [c.count("a") / max(1, len(c)) for c in completions]


def _bench_tokenizer():
    import random
    from nano_rlhf.tokenizer import Tokenizer
    r = random.Random(0)
    words = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(2, 9))) for _ in range(3000)]
    tok = Tokenizer.train((" ".join(r.choice(words) for _ in range(50)) for _ in range(3000)), 4096)
    tok.eos_id = -1        # TRL's bench forces exactly 64 new tokens: nothing ends early
    tok.stop_ids = [-1]
    return tok


def _rl(a, advantage):
    import torch
    import train_ppo
    from nano_rlhf import dist
    from nano_rlhf.training import Learner, adamw
    from nano_rlhf.model import GPT, ScoreModel
    from nano_rlhf.reward import RewardModel
    tok = _bench_tokenizer()
    dist.setup("cpu")
    policy = _model(GPT).train()
    kl = 0.0 if advantage == "grpo" else 0.05
    opts = train_ppo.Options(advantage=advantage, batch_size=4, samples_per_prompt=4, max_new_tokens=64,
                             ppo_epochs=1, num_minibatches=1, micro_batch_size=16, kl_coef=kl,
                             missing_eos_penalty=None, critic_warmup_steps=0)
    ref = critic = None
    reward = _LetterA()
    if advantage == "gae":                   # PPO: reference, reward model and critic, all on the same shape
        import copy
        ref = copy.deepcopy(policy).requires_grad_(False).eval()
        reward = RewardModel(_model(ScoreModel).requires_grad_(False).eval(), tok)
        critic = _model(ScoreModel).train()
    models = train_ppo.Models(policy=policy, reward=reward, ref=ref, critic=critic)
    pi = Learner(policy, policy, adamw(policy, 1e-5, 0.0, eps=1e-5))
    v = Learner(critic, critic, adamw(critic, 1e-5, 0.0, eps=1e-5)) if critic is not None else None
    prompts = [{"prompt": [t % 4000 + 2 for t in range(i * 32, i * 32 + 32)], "text": ""} for i in range(4)]
    gen, shuffle = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    times = {"gen": []}

    def step():
        t = time.perf_counter()
        r = train_ppo.rollout(lambda: prompts, models, tok, opts, gen)
        times["gen"].append(time.perf_counter() - t)
        targets = train_ppo.advantages(r, estimator=advantage, beta=kl, k=opts.samples_per_prompt)
        train_ppo.update(r, targets, policy=pi, critic=v, opts=opts, beta=kl, gen=shuffle)
    t, _ = timeit(step, 3, max(5, a.steps // 2))
    rollout = statistics.median(times["gen"][3:])
    out = {"s_per_step": t, "completions_per_step": 16, "completions_per_s": 16 / t, "rollout_s": rollout}
    if advantage == "grpo":   # the update: one forward + backward of 16 x 96 tokens, output layer on the 64 responses
        out["update_flops"] = step_flops(16 * 96, 96, head_positions=16 * 64)
    return out


def w_grpo(a):
    return _rl(a, "grpo")


def w_ppo(a):
    return _rl(a, "gae")


def w_ddp_sft(a):
    """SFT step under DDP (run by torchrun): global batch 16 x 128 split over the ranks."""
    import torch
    from nano_rlhf import dist
    from nano_rlhf.training import adamw
    from train_sft import sft_nll
    ctx = dist.setup("cpu")
    m = _model().train()
    ddp = dist.wrap_ddp(m)
    opt = adamw(m, 1e-4, 0.01)
    B = 16 // ctx.world_size
    ids = torch.randint(2, 4096, (B, 128), generator=torch.Generator().manual_seed(ctx.rank))
    mask = torch.ones_like(ids)

    def step():
        nll, n = sft_nll(ddp, ids, mask, mask)
        (nll / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    t, _ = timeit(step, 3, a.steps)
    t = dist.all_reduce_max(t)
    dist.cleanup()
    return {"s_per_step": t, "tokens_per_step": 2048} if ctx.is_main else None


WORKERS = {k[2:]: v for k, v in globals().items() if k.startswith("w_")}


def worker_main(a):
    import torch
    torch.set_num_threads(a.threads)
    from nano_rlhf.dist import keep_freed_memory
    keep_freed_memory()                  # what every nano_rlhf script does at start-up
    PROFILE["on"] = a.profile_worker
    out = WORKERS[a.worker](a)
    if out is not None and "ops" in PROFILE:
        out["profile"] = PROFILE["ops"]
    if out is not None:
        print("RESULT " + json.dumps(out), flush=True)


# ---- orchestration ------------------------------------------------------------------------------------

def spawn(args, nproc=1, threads=2, env=None):
    e = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT, **(env or {}))
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", "29577"]
                              if nproc > 1 else []) + args
    p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def ours(name, a, threads=None, nproc=1):
    threads = threads or a.threads
    extra = ["--save_model", a.save_model] if name == "gen" and a.save_model else []
    return spawn([os.path.abspath(__file__), "--worker", name, "--threads", str(threads), "--steps", str(a.steps)]
                 + (["--quick"] if a.quick else []) + (["--profile_worker"] if a.profile else []) + extra,
                 nproc=nproc, threads=threads)


def peer(name, a, **kw):
    """A peer measurement from bench/peers.py, in its own process; None when TRL/transformers are missing."""
    code = ("import json,sys; sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r}); import peers; "
            "print('RESULT ' + json.dumps(peers.{name}(**{kw!r})))").format(
        root=ROOT, bench=os.path.join(ROOT, "bench"), name=name, kw=kw)
    try:
        return spawn(["-c", code], threads=a.threads)
    except RuntimeError as e:
        print(f"  (peer {name} unavailable: {str(e).strip().splitlines()[-1][:160]})", flush=True)
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated rows: sft,sft_bf16,rm,dpo,dpo_pre,gen,grpo,ppo,ddp")
    p.add_argument("--quick", action="store_true", help="fewer steps (noisier)")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="measure nano_rlhf only")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--steps", type=int, default=0, help="timed steps per row (default 20, 8 with --quick)")
    p.add_argument("--json", default="", help="also write every figure to this JSON file")
    p.add_argument("--profile", default="", help="print where one row's step time goes (torch profiler), e.g. rm, gen")
    p.add_argument("--profile_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--save_model", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.steps = a.steps or (8 if a.quick else 20)
    if a.worker:
        return worker_main(a)
    if a.profile:
        o = ours(a.profile, a)
        print(f"{a.profile}: share of CPU time per operator (torch profiler, self time, 3 calls after timing)")
        for op, share in o["profile"].items():
            print(f"  {100 * share:5.1f}%  {op}")
        return o
    rows = a.only.split(",") if a.only else ["sft", "sft_bf16", "rm", "dpo", "dpo_pre", "gen", "grpo", "ppo", "ddp"]
    import platform
    import torch
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?") \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs | torch {torch.__version__} | {a.threads} threads | "
          f"{a.steps} timed steps per row", flush=True)
    res = {"machine": cpu, "threads": a.threads, "torch": torch.__version__}
    ceiling = ours("matmul", a)
    res["matmul"] = ceiling
    print(f"float32 matmul throughput (median of training-shaped products): {ceiling['gflops']:.0f} GFLOP/s", flush=True)
    def frac(flops, seconds):
        """Share of the matmul throughput measured above that `flops` model FLOPs in `seconds` reach."""
        return flops / seconds / 1e9 / ceiling["gflops"]

    def add(row, unit, ours_val, peer_vals, extra=""):
        ratios = " | ".join(f"{n}: {v:,.1f} -> {ours_val / v:.2f}x" for n, v in peer_vals if v)
        print(f"{row:<34} nano_rlhf {ours_val:,.1f} {unit}" + (f" | {ratios}" if ratios else "") + extra, flush=True)

    if "sft" in rows:
        o = ours("sft", a)
        mfu = frac(o["flops_per_step"], o["s_per_step"])
        peers = []
        if a.peers:
            for name, fn, kw in (("TRL SFTTrainer", "trl_sft", {}), ("HF bare loop", "hf_bare_loop", {})):
                r = peer(fn, a, **kw)
                peers.append((name, r and r["tokens_per_s"]))
        add("SFT step, 16 x 128 tokens", "tok/s", o["tokens_per_step"] / o["s_per_step"], peers,
            extra=f" | {100 * mfu:.0f}% of matmul throughput")
        res["sft"] = dict(o, matmul_fraction=mfu, peers=peers)
    if "sft_bf16" in rows:   # a different precision: both sides at their bf16 settings, never mixed with float32
        o = ours("sft_bf16", a)
        peers = [("TRL SFTTrainer, its CPU defaults (bf16 + grad ckpt)",
                  (peer("trl_sft", a, trl_defaults=True) or {}).get("tokens_per_s"))] if a.peers else []
        add("SFT step, bf16 autocast", "tok/s", o["tokens_per_step"] / o["s_per_step"], peers)
        res["sft_bf16"] = dict(o, peers=peers)
    for row, fn, peer_fn, peer_kw, title in (("rm", "rm", "trl_reward", {}, "reward-model step, 8 pairs x 128"),
                                             ("dpo", "dpo", "trl_dpo", {"precompute_ref": False}, "DPO step, 8 pairs, live reference"),
                                             ("dpo_pre", "dpo_pre", "trl_dpo", {"precompute_ref": True}, "DPO step, 8 pairs, precomputed ref")):
        if row in rows:
            o = ours(fn, a)
            peers = [("TRL", (peer(peer_fn, a, **peer_kw) or {}).get("pairs_per_s"))] if a.peers else []
            share = frac(o["flops_per_step"], o["s_per_step"])
            add(title, "pairs/s", o["pairs_per_step"] / o["s_per_step"], peers,
                extra=f" | {100 * share:.0f}% of matmul throughput")
            res[row] = dict(o, matmul_fraction=share, peers=peers)
    if "gen" in rows:
        import tempfile
        a.save_model = tempfile.mkdtemp()
        o = ours("gen", a)
        nc = ours("gen_nocache", a)
        peers = [("HF generate", (peer("hf_generate", a, model_dir=a.save_model) or {}).get("new_tokens_per_s"))] \
            if a.peers else []
        peers.append(("nano_rlhf without cache", nc["new_tokens_per_s"]))
        share = frac(o["flops_per_call"], o["s_per_call"])
        add("generate, 16 x (32 + 64), T=1", "new tok/s", o["new_tokens_per_s"], peers,
            extra=f" | {100 * share:.0f}% of (training-shaped) matmul throughput")
        res["gen"] = dict(o, matmul_fraction=share, nocache=nc, peers=peers)
        a.save_model = ""
    if "grpo" in rows:
        o = ours("grpo", a)
        peers = [("TRL GRPOTrainer", (peer("trl_grpo", a) or {}).get("completions_per_s"))] if a.peers else []
        upd = frac(o["update_flops"], o["s_per_step"] - o["rollout_s"])
        add("GRPO step, 4 prompts x 4, 32 + 64", "compl/s", o["completions_per_s"], peers,
            extra=f" | rollout {o['rollout_s']:.3f} s of {o['s_per_step']:.3f} s; update at {100 * upd:.0f}% of matmul "
                  "throughput")
        o["update_matmul_fraction"] = upd
        res["grpo"] = dict(o, peers=peers)
    if "ppo" in rows:
        o = ours("ppo", a)
        add("PPO step (critic, RM, ref), same", "compl/s", o["completions_per_s"], [],
            extra=f" | rollout {o['rollout_s']:.3f} s of {o['s_per_step']:.3f} s")
        res["ppo"] = o
    if "ddp" in rows:
        one = ours("ddp_sft", a, threads=1)
        two = ours("ddp_sft", a, threads=1, nproc=2)
        add("DDP SFT: 2 procs x 1 thread", "tok/s", two["tokens_per_step"] / two["s_per_step"],
            [("1 proc x 1 thread", one["tokens_per_step"] / one["s_per_step"])])
        res["ddp"] = {"one": one, "two": two}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
