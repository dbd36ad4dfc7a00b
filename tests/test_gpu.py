"""The CUDA paths: what `python bench/gpu.py OUT` runs first on a GPU (`pytest -m gpu`), with measurements
written to $NANO_RLHF_GPU_OUT/measurements.jsonl. Marked `gpu`: never collected into the CPU suite (conftest.py
deselects them unless the -m expression names gpu), and dry-run on the CPU at tiny shapes by
tests/test_gpu_check.py (NANO_RLHF_TEST_DEVICE=cpu), so this file cannot rot between runs on a GPU.

What is compared, and how closely (tests/numerics.py gives the float32 rules):
- HF parity, float32, both directions, GPT-2 and the Llama family (GQA + untied + llama3 RoPE; Qwen3's q/k norm
  and head_dim): logits within FLOAT32_ATOL. CUDA matmuls run in full float32 here (PyTorch's default
  allow_tf32 = False for matmuls; TF32's 10-bit mantissa would need ~1e-3).
- HF parity, bf16 autocast: both models run under the same autocast, so both round the same matmul inputs to
  bf16 (8 significant bits: u = 2^-9 per operand); their logits differ from the float64 ones by errors of the
  same size and different sign. The test holds ours no further from float64 than transformers' own bf16 path,
  with a factor 2 for the randomness of which roundings land where (each error is a sum of many independent
  roundings, so the two sums' sizes differ by a factor well inside 2 at hundreds of terms).
- Greedy generation against transformers' on a left-padded batch: tokens equal wherever the top-two logit
  margin exceeds the two paths' combined logit error (float32: 2·FLOAT32_ATOL·5 = MARGIN; bf16: the errors
  of both paths against float64, measured on this very sequence), up to the first step where it does not.
- Every script a few steps on the device in float32 and bf16 (run.finish checks each frozen model bit for
  bit against its start); resume equal bit for bit to the straight run (deterministic algorithms on); LoRA
  base weights untouched; FSDP2 (and NCCL) at world size 1; offloaded frozen models give the same weights; the
  compiled rollout's greedy tokens equal the eager ones; the bf16 sampler's log-probs against the trainer's
  (a measurement: what --rollout_correction exists for).
"""
import json
import os
import time

import pytest
import torch

from conftest import SMALL
from numerics import FLOAT32_ATOL, MARGIN

DEVICE = torch.device(os.environ.get("NANO_RLHF_TEST_DEVICE", "cuda"))
TINY = DEVICE.type == "cpu"          # the CPU dry run: the same code at the smallest shapes
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")]
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def record(name, **figures):
    """Append one measurement to $NANO_RLHF_GPU_OUT/measurements.jsonl (bench/gpu.py folds it into its JSON)."""
    out = os.environ.get("NANO_RLHF_GPU_OUT")
    row = {"name": name, "device": str(DEVICE), **figures}
    print(json.dumps(row))
    if out:
        with open(os.path.join(out, "measurements.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# ---- model families against transformers --------------------------------------------------------------

V = 256
HF_CONFIGS = {   # name -> (transformers prefix, config kwargs); widths ≤ 64 keep tests/numerics.py's float32 argument
    "gpt2": ("GPT2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0)),
    "llama": ("Llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 16})),
    "qwen3": ("Qwen3", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                            max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def hf_model(name, seed=0):
    prefix, extra = HF_CONFIGS[name]
    cfg = getattr(transformers, prefix + "Config")(vocab_size=V, bos_token_id=0, eos_token_id=0, pad_token_id=1,
                                                   **extra)
    torch.manual_seed(seed)
    m = getattr(transformers, prefix + ("LMHeadModel" if name == "gpt2" else "ForCausalLM"))(cfg).eval()
    with torch.no_grad():     # norms start at 1 and biases at 0: randomise everything so no term hides
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def both(name, tmp_path, direction):
    """(ours, transformers') on DEVICE holding the same weights, converted in the given direction."""
    from nano_rlhf.model import GPT
    hf = hf_model(name)
    if direction == "hf_to_ours":
        hf.save_pretrained(tmp_path / "hf")
        ours = GPT.from_pretrained(tmp_path / "hf")
    else:    # ours written by our exporter, read by transformers
        hf.save_pretrained(tmp_path / "hf")
        ours = GPT.from_pretrained(tmp_path / "hf")
        ours.save_pretrained(tmp_path / "ours")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    return ours.to(DEVICE).eval(), hf.to(DEVICE).eval()


def padded_batch(lens=(20, 14, 7, 17), seed=1):
    """Left-padded ids >= 2 (1 = pad), mask, and transformers' position ids for the padding."""
    g = torch.Generator().manual_seed(seed)
    W = max(lens)
    ids = torch.randint(2, V, (len(lens), W), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        mask[i, W - n:] = 1
    ids = ids.masked_fill(mask == 0, 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(DEVICE), mask.to(DEVICE), pos.to(DEVICE)


def logits_pair(ours, hf, ids, mask, pos, dtype):
    from nano_rlhf.training import autocast
    with torch.no_grad(), autocast(DEVICE, dtype):
        a = ours(ids, mask).float()
        b = hf(ids, attention_mask=mask, position_ids=pos).logits.float()
    return a, b


@pytest.mark.parametrize("direction", ["hf_to_ours", "ours_to_hf"])
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_parity_float32(tmp_path, name, direction):
    ours, hf = both(name, tmp_path, direction)
    ids, mask, pos = padded_batch()
    a, b = logits_pair(ours, hf, ids, mask, pos, "float32")
    m = mask.bool()
    err = float((a[m] - b[m]).abs().max())
    record(f"hf_parity_float32/{name}/{direction}", max_abs_diff=err)
    assert err <= FLOAT32_ATOL


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_parity_bf16_autocast(tmp_path, name):
    import copy
    ours, hf = both(name, tmp_path, "hf_to_ours")
    ids, mask, pos = padded_batch()
    m = mask.bool()
    with torch.no_grad():
        exact = copy.deepcopy(ours).double()(ids, mask)[m]
    a, b = logits_pair(ours, hf, ids, mask, pos, "bfloat16")
    err_ours, err_hf = float((a[m] - exact).abs().max()), float((b[m] - exact).abs().max())
    with torch.no_grad():     # transformers' usual bf16: the whole model cast (recorded, not compared)
        hf_cast = copy.deepcopy(hf).to(torch.bfloat16)
        err_cast = float((hf_cast(ids, attention_mask=mask, position_ids=pos).logits.double()[m] - exact).abs().max())
    record(f"hf_parity_bf16/{name}", max_err_ours_autocast=err_ours, max_err_hf_autocast=err_hf,
           max_err_hf_bf16_weights=err_cast, max_abs_logit=float(exact.abs().max()))
    assert err_ours <= 2 * err_hf + FLOAT32_ATOL, (err_ours, err_hf)


def first_unsure(margins, bound):
    """Index of the first decode step whose top-two margin is within `bound` (len if none)."""
    bad = (margins <= bound).nonzero()
    return int(bad[0]) if len(bad) else len(margins)


def step_margins(model, seq, prompt_mask, dtype="float32"):
    """(B, N) top-two logit gaps at the positions that chose seq[:, P:], and those logits (float64)."""
    from nano_rlhf.training import autocast
    P = prompt_mask.shape[1]
    mask = torch.cat([prompt_mask, torch.ones_like(seq[:, P:])], 1)
    with torch.no_grad(), autocast(DEVICE, dtype):
        logits = model(seq, mask)[:, P - 1:-1].double()
    top2 = logits.topk(2, -1).values
    return top2[..., 0] - top2[..., 1], logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_generation_equals_transformers(tmp_path, name, dtype):
    import copy
    from nano_rlhf.training import autocast
    ours, hf = both(name, tmp_path, "hf_to_ours")
    ids, mask, _ = padded_batch(lens=(9, 5, 12, 3))
    n = 16
    with torch.no_grad(), autocast(DEVICE, dtype):
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=1)
        got = ours.generate(ids, mask, n, temperature=0, pad_token_id=1)
    margins, logits = step_margins(ours, want, mask)
    if dtype == "float32":
        bound = torch.full((ids.shape[0],), MARGIN, device=DEVICE)
    else:   # each path's bf16 logits against float64 on this very sequence: a flip needs the sum of both errors
        exact = step_margins(copy.deepcopy(ours).double(), want, mask)[1]
        _, ours_bf16 = step_margins(ours, want, mask, "bfloat16")
        P = mask.shape[1]
        full = torch.cat([mask, torch.ones_like(want[:, P:])], 1)
        with torch.no_grad(), autocast(DEVICE, "bfloat16"):
            pos = (full.cumsum(-1) - 1).clamp(min=0)
            hf_bf16 = hf(want, attention_mask=full, position_ids=pos).logits[:, P - 1:-1].double()
        bound = 2 * ((ours_bf16 - exact).abs().amax((1, 2)) + (hf_bf16 - exact).abs().amax((1, 2)))
    P, compared = ids.shape[1], 0
    for i in range(ids.shape[0]):
        k = first_unsure(margins[i], float(bound[i]))
        assert torch.equal(got[i, P:P + k], want[i, P:P + k]), (i, k, got[i, P:], want[i, P:])
        compared += k
    record(f"greedy_vs_hf/{name}/{dtype}", tokens_compared=compared, tokens=int(want[:, P:].numel()))
    if dtype == "float32":      # float32 margins clear the bound everywhere (as on the CPU): every token compared
        assert compared == want[:, P:].numel()


# ---- the scripts on the device ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nano_rlhf.tasks import synthetic
    d = tmp_path_factory.mktemp("task")
    synthetic.write_dataset(str(d), seed=0, **SMALL)
    return d


MODEL = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64"]
COMMON = ["--device", str(DEVICE), "--log_interval", "1", "--eval_interval", "0", "--save_interval", "0"]


@pytest.fixture(scope="module")
def sft_init(task, tmp_path_factory):
    """A tiny SFT policy trained on the device (the start of every other script's run) and a reward model."""
    import train_rm
    import train_sft
    d = tmp_path_factory.mktemp("init")
    train_sft.main(["--data", str(task / "sft.jsonl"), "--eval_data", str(task / "sft_eval.jsonl"),
                    "--out_dir", str(d / "sft"), "--max_steps", "8", "--batch_size", "16", *MODEL, *COMMON])
    train_rm.main(["--data", str(task / "preference.jsonl"), "--eval_data", str(task / "preference_eval.jsonl"),
                   "--init", str(d / "sft"), "--out_dir", str(d / "rm"), "--max_steps", "3", "--batch_size", "8",
                   *COMMON])
    return d


def run_script(name, task, init, out, *extra):
    import importlib
    module, args = SCRIPTS[name](task, init)
    result = importlib.import_module(module).main([*args, "--out_dir", str(out), *COMMON, *extra])
    return result


SCRIPTS = {
    "sft": lambda t, i: ("train_sft", ["--data", str(t / "sft.jsonl"), "--eval_data", str(t / "sft_eval.jsonl"),
                                       "--init", str(i / "sft"), "--batch_size", "8", "--max_steps", "2"]),
    "rm": lambda t, i: ("train_rm", ["--data", str(t / "preference.jsonl"), "--eval_data",
                                     str(t / "preference_eval.jsonl"), "--init", str(i / "sft"), "--batch_size", "8",
                                     "--max_steps", "2"]),
    "dpo": lambda t, i: ("train_dpo", ["--data", str(t / "preference.jsonl"), "--eval_data",
                                       str(t / "preference_eval.jsonl"), "--init", str(i / "sft"),
                                       "--batch_size", "4", "--max_steps", "2"]),
    "kto": lambda t, i: ("train_unpaired", ["--method", "kto", "--data", str(t / "unpaired.jsonl"),
                                            "--init", str(i / "sft"), "--batch_size", "8", "--max_steps", "2"]),
    "lipo": lambda t, i: ("train_listwise", ["--loss", "lipo", "--data", str(t / "listwise.jsonl"), "--eval_data",
                                             str(t / "listwise_eval.jsonl"), "--init", str(i / "sft"),
                                             "--batch_size", "4", "--max_steps", "2"]),
    "online_dpo": lambda t, i: ("train_online", ["--method", "online_dpo", "--judge", str(i / "rm"),
                                                 "--prompts", str(t / "prompts.jsonl"), "--eval_prompts",
                                                 str(t / "eval_prompts.jsonl"), "--init", str(i / "sft"),
                                                 "--batch_size", "4", "--max_new_tokens", "12", "--max_steps", "2"]),
    "ppo": lambda t, i: ("train_ppo", ["--reward_model", str(i / "rm"), "--prompts", str(t / "prompts.jsonl"),
                                       "--eval_prompts", str(t / "eval_prompts.jsonl"), "--init", str(i / "sft"),
                                       "--batch_size", "4", "--samples_per_prompt", "2", "--max_new_tokens", "12",
                                       "--max_steps", "2"]),
    "grpo": lambda t, i: ("train_ppo", ["--advantage", "grpo", "--reward", "gold", "--prompts",
                                        str(t / "prompts.jsonl"), "--eval_prompts", str(t / "eval_prompts.jsonl"),
                                        "--init", str(i / "sft"), "--batch_size", "4", "--samples_per_prompt", "4",
                                        "--max_new_tokens", "12", "--max_steps", "2"]),
}


def metrics(out):
    return [json.loads(x) for x in open(out / "metrics.jsonl")]


def weights(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(str(path), "model.safetensors"))


def assert_same_weights(model, model_dir, rename=lambda k: k):
    """Every tensor of the model directory's policy equals `model`'s (names through `rename`) bit for bit."""
    from nano_rlhf.model import GPT
    mine = {rename(k): v for k, v in model.state_dict().items()}
    start = GPT.from_pretrained(str(model_dir)).state_dict()
    checked = [k for k in start if k in mine]
    assert checked
    for k in checked:
        assert torch.equal(mine[k].cpu(), start[k]), k
    return len(checked)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script_steps_on_device(task, sft_init, tmp_path, name, dtype):
    """A few steps of each script on the device: finite losses, a saved model that loads, every frozen model
    bit-identical to its start (run.finish raises otherwise), the reference equal to the file it came from."""
    t0 = time.time()
    out = run_script(name, task, sft_init, tmp_path / "run", "--dtype", dtype)
    seconds = time.time() - t0
    rows = [r for r in metrics(tmp_path / "run") if "step" in r]
    losses = [v for r in rows for k, v in r.items() if k.startswith("train/") and k.endswith("loss")]
    assert rows and losses and all(v == v and abs(v) != float("inf") for v in losses), rows
    assert os.path.isfile(tmp_path / "run" / "model.safetensors")
    ref = getattr(out, "ref", None)
    if ref is not None and not getattr(ref, "shares_trained_model", False):
        assert_same_weights(ref, sft_init / "sft")
    record(f"script/{name}/{dtype}", seconds=round(seconds, 2), steps=len(rows))


def test_resume_is_exact_on_device(task, sft_init, tmp_path):
    """Two steps, stop, resume for two more: bit for bit the four-step run (and a second four-step run equals
    the first: the run itself is reproducible). Deterministic algorithms are on for this test: CUDA has
    nondeterministic kernels (atomic adds in some backward passes), which would make both comparisons
    meaningless; with them on, a kernel without a deterministic version raises here, naming itself."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        for name in ("sft", "dpo", "grpo"):
            straight, again, resumed = (tmp_path / name / x for x in ("straight", "again", "resumed"))
            run_script(name, task, sft_init, straight, "--max_steps", "4")
            run_script(name, task, sft_init, again, "--max_steps", "4")
            run_script(name, task, sft_init, resumed, "--max_steps", "4", "--stop_at", "2")
            run_script(name, task, sft_init, resumed, "--max_steps", "4", "--resume")
            a, b, c = weights(straight), weights(again), weights(resumed)
            same_again = all(torch.equal(a[k], b[k]) for k in a)
            same_resumed = all(torch.equal(a[k], c[k]) for k in a)
            record(f"resume/{name}", reproducible=same_again, resume_exact=same_resumed)
            assert same_again and same_resumed, name
    finally:
        torch.use_deterministic_algorithms(False)


def test_lora_on_device_leaves_the_base_untouched(task, sft_init, tmp_path):
    """DPO with LoRA adapters (the reference is the policy with its adapters off): the base weights after
    training are the init's bit for bit, and the adapters moved."""
    for dtype in ("float32", "bfloat16"):
        out = run_script("dpo", task, sft_init, tmp_path / dtype, "--lora_r", "4", "--dtype", dtype)
        policy = out.policy
        moved = [v for k, v in policy.state_dict().items() if "lora_B" in k]
        assert moved and any(float(v.abs().max()) > 0 for v in moved)   # B starts at zero
        checked = assert_same_weights(policy, sft_init / "sft", rename=lambda k: k.replace(".base.", "."))
        record(f"lora/{dtype}", adapters=len(moved), base_tensors_checked=checked)


def test_offload_frozen_gives_the_same_run(task, sft_init, tmp_path):
    """--offload_frozen keeps the reference in CPU memory and brings it to the device for its forwards: the
    same numbers, so the same weights bit for bit (deterministic algorithms on, as for resume)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        run_script("dpo", task, sft_init, tmp_path / "plain")
        run_script("dpo", task, sft_init, tmp_path / "offload", "--offload_frozen")
        a, b = weights(tmp_path / "plain"), weights(tmp_path / "offload")
        same = all(torch.equal(a[k], b[k]) for k in a)
        record("offload_frozen/dpo", same_weights=same)
        assert same
    finally:
        torch.use_deterministic_algorithms(False)


# ---- FSDP2 at world size 1 --------------------------------------------------------------------------

def test_fsdp2_and_collectives_at_world_size_1(monkeypatch):
    """One GPU: a 1-rank process group (NCCL on CUDA, gloo on CPU), the package's all-reduce and the
    cross-rank weight check through it, and FSDP2 (parallel.shard, bf16 MixedPrecisionPolicy on CUDA) for a
    training step, which must equal the unsharded step (float32: within rounding; the sharded bf16 step within
    the distance of a bf16 autocast step from the float32 one, times 2). Multi-GPU stays untested."""
    import copy
    import socket

    import torch.distributed as tdist

    from nano_rlhf import dist, parallel
    from nano_rlhf.training import adamw, autocast
    from nano_rlhf.model import GPT, GPTConfig
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if DEVICE.type == "cuda" else "gloo"
    tdist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    monkeypatch.setattr(dist, "_CTX", dist.Dist(0, 0, 1, DEVICE))
    monkeypatch.setattr(dist.Dist, "enabled", property(lambda self: True))   # world size 1, collectives on
    monkeypatch.setattr(parallel, "_MESH", None, raising=False)
    try:
        total = dist.all_reduce_sum(torch.tensor([1.0, 2.0], device=DEVICE))
        assert total.tolist() == [1.0, 2.0]
        torch.manual_seed(0)
        cfg = GPTConfig(model_type="llama", vocab_size=V, block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                        n_embd=64, intermediate_size=128, tie_word_embeddings=False)
        plain = GPT(cfg).to(DEVICE)
        ids = torch.randint(2, V, (4, 32), device=DEVICE)
        results = {}
        for dtype in ("float32", "bfloat16"):
            ref_model = copy.deepcopy(plain)
            sharded = parallel.shard(copy.deepcopy(plain), dtype=dtype)
            assert parallel.is_sharded(sharded)
            dist.check_same_weights(sharded, "sharded")
            losses = []
            for m, ac in ((ref_model, dtype), (sharded, "float32" if DEVICE.type == "cuda" else dtype)):
                # the sharded bf16 run computes in bf16 through FSDP's MixedPrecisionPolicy, not autocast
                opt = adamw(m, 1e-3, 0.0)
                with autocast(DEVICE, ac):
                    loss = torch.nn.functional.cross_entropy(m(ids)[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
                loss.backward()
                opt.step()
                losses.append(float(loss))
            full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sharded.state_dict().items()}
            diff = max(float((full[k].float() - v.float()).abs().max()) for k, v in ref_model.state_dict().items())
            results[dtype] = dict(loss_plain=losses[0], loss_sharded=losses[1], max_weight_diff=diff)
        record("fsdp2_world1", backend=backend, **{f"{d}/{k}": v for d, r in results.items() for k, v in r.items()})
        assert abs(results["float32"]["loss_plain"] - results["float32"]["loss_sharded"]) <= FLOAT32_ATOL
        # one AdamW step moves each weight by ~lr whatever the gradient's size: equal steps agree to rounding
        assert results["float32"]["max_weight_diff"] <= 1e-3 * 1e-2
        assert abs(results["bfloat16"]["loss_plain"] - results["bfloat16"]["loss_sharded"]) <= 0.05
    finally:
        tdist.destroy_process_group()


# ---- the rollout engine -------------------------------------------------------------------------------

def rollout_model(vocab, width=64, layers=2):
    from nano_rlhf.model import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(model_type="llama", vocab_size=vocab, block_size=256, n_layer=layers, n_head=4, n_kv_head=2,
                    n_embd=width, intermediate_size=2 * width, tie_word_embeddings=True, eos_token_id=0,
                    pad_token_id=1)
    m = GPT(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.to(DEVICE).eval()


def test_bf16_sampler_against_float32_trainer():
    """--rollout_dtype bfloat16: the sampler (a bf16 copy) and the trainer (float32 weights, float32 or bf16
    autocast) score the same sampled tokens differently. Measured, with the share of tokens whose truncated
    importance weight min(π_train/π_sampler, 2) is capped and the per-sequence log-ratio; asserted only to be
    finite and small next to the tokens' own log-probs."""
    from nano_rlhf.training import autocast
    from nano_rlhf.model import token_logprobs
    from nano_rlhf.sampling import sampling_copy
    vocab = 512 if TINY else 49152
    m = rollout_model(vocab, width=64 if TINY else 576, layers=2 if TINY else 8)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.randint(2, vocab, (16, 32), device=DEVICE, generator=g)
    mask = torch.ones_like(ids)
    out = m.generate(ids, mask, 64, temperature=1.0, generator=g, dtype=torch.bfloat16)
    seq = out
    full = torch.ones_like(seq)
    targets = seq[:, 1:]

    def logp(model, dtype):
        with torch.no_grad(), autocast(DEVICE, dtype):
            h = model(seq, full, return_hidden=True)[:, :-1]
        return token_logprobs(h.flatten(0, 1), model.output_weight(), targets.flatten()).view(targets.shape)[:, 31:]

    sampler = logp(sampling_copy(m, torch.bfloat16), "float32")
    figures = {}
    for dtype in ("float32", "bfloat16"):
        trainer = logp(m, dtype)
        d = (trainer - sampler).float()
        w = d.exp()
        figures.update({f"trainer_{dtype}/mean_abs_logp_diff": float(d.abs().mean()),
                        f"trainer_{dtype}/max_abs_logp_diff": float(d.abs().max()),
                        f"trainer_{dtype}/tis_capped_share": float((w > 2.0).float().mean()),
                        f"trainer_{dtype}/seq_logratio_abs_mean": float(d.sum(1).abs().mean())})
    figures["mean_token_logp"] = float(sampler.mean())
    record("bf16_sampler_vs_trainer", vocab=vocab, **figures)
    assert all(v == v for v in figures.values())
    assert figures["trainer_float32/mean_abs_logp_diff"] < 0.1 * abs(figures["mean_token_logp"])


def test_chunked_logprobs_at_a_real_vocabulary():
    """token_logprobs in chunks (bounded memory) against the whole log-softmax at Qwen2.5's vocabulary:
    values and gradients within float32 rounding (a log-softmax over V terms: √V·u·|logit| ≪ 1e-4 here),
    and the peak memory of each."""
    from nano_rlhf.model import token_logprobs
    vocab, width, n = (4096, 64, 256) if TINY else (151936, 896, 2048)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    h = (torch.randn(n, width, device=DEVICE, generator=g)).requires_grad_()
    w = (torch.randn(vocab, width, device=DEVICE, generator=g) * width ** -0.5).requires_grad_()
    t = torch.randint(0, vocab, (n,), device=DEVICE, generator=g)
    peaks, outs = {}, {}
    # the operator in chunks of the default budget (64 positions in the dry run, whose logits fit one), its output
    # layer padded to 128 rows (CUDA's default) and not, against the plain one-chunk computation
    chunk = 64 if TINY else None
    for name, chunk, pad in (("chunked", chunk, 1), ("chunked_padded", chunk, 128), ("whole", n, 1)):
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        lp = token_logprobs(h, w, t, chunk_size=chunk, pad_to=pad)
        gh, gw = torch.autograd.grad(lp.sum(), (h, w))
        sync()
        if DEVICE.type == "cuda":
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        outs[name] = (lp.detach(), gh, gw)
    errs = {}
    for name in ("chunked", "chunked_padded"):
        err = [float((a - b).abs().max()) for a, b in zip(outs[name], outs["whole"])]
        errs.update({f"{name}/max_diff_logp": err[0], f"{name}/max_diff_grad_h": err[1],
                     f"{name}/max_diff_grad_w": err[2]})
    record("chunked_logprobs", vocab=vocab, positions=n, **errs,
           **{f"peak_mib/{k}": round(v, 1) for k, v in peaks.items()})
    assert all(e <= 1e-4 for e in errs.values()), errs


def test_compiled_rollout_equals_eager_at_temperature_0():
    """The compiled decode step (CUDA graphs on GPU) gives the eager step's greedy tokens, one batch bucket
    (8 rows), wherever the top-two margin exceeds the float32 bound; compile time reported apart."""
    m = rollout_model(V)
    ids, mask, _ = padded_batch(lens=(9, 5, 12, 3, 7, 12, 10, 4))
    n = 24
    eager_stats, compiled_stats = {}, {}
    eager = m.generate(ids, mask, n, temperature=0, pad_token_id=1, stats=eager_stats)
    t0 = time.time()
    compiled = m.generate(ids, mask, n, temperature=0, pad_token_id=1, compile=True, stats=compiled_stats)
    first = time.time() - t0
    t0 = time.time()
    again = m.generate(ids, mask, n, temperature=0, pad_token_id=1, compile=True)
    sync()
    second = time.time() - t0
    assert compiled_stats["compiled"], "the decode step was not compiled (see the notice above)"
    margins, _ = step_margins(m, eager, mask)
    P, compared = ids.shape[1], 0
    for i in range(ids.shape[0]):
        k = first_unsure(margins[i], MARGIN)
        assert torch.equal(compiled[i, P:P + k], eager[i, P:P + k]) and torch.equal(again[i], compiled[i]), i
        compared += k
    record("compiled_rollout", compile_s=round(compiled_stats["compile_s"], 2), first_call_s=round(first, 2),
           second_call_s=round(second, 3), eager_decode_s=round(eager_stats["decode_s"], 3),
           tokens_compared=compared, tokens=n * ids.shape[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tool_rollout_on_device(tmp_path, monkeypatch, dtype):
    """train_ppo's rollout with the calculator on the device (a policy scripted to call it, read the answer and
    end): the ids are the sampled ones plus the tool turn, the tool turn is a hole in the action mask, and the
    trainer's recomputed log-probs equal the decode's on the actions — within 2 × FLOAT32_ATOL in float32
    (tests/test_turns.py's argument); in bf16 the two differ by bf16 rounding and the gap is measured."""
    import train_ppo
    from nano_rlhf import chat, sampling
    from nano_rlhf.model import GPT, GPTConfig
    from nano_rlhf.tools import ToolEnv, load_tools
    from test_chat_templates import build, calls
    _, tok, _ = build("qwen2.5", tmp_path)
    box = load_tools("calculator")
    first = tok.encode(chat.assistant_text(tok.chat_template, "", calls(("calculator", {"expression": "6*7"})))) + \
        [tok.eot_id]
    tool, answer = tok.encode_tool_turn(["42"]), tok.encode("It is 42.") + [tok.eot_id]
    script = first + tool + answer
    step = [0]

    def scripted(logits, temperature, top_k, top_p, generator, u):
        step[0] += 1
        return torch.full((logits.shape[0],), script[min(step[0] - 1, len(script) - 1)], dtype=torch.long,
                          device=logits.device)
    monkeypatch.setattr(sampling, "sample_token", scripted)
    p_ids = tok.render_prompt([{"role": "user", "content": "What is 6*7?"}], box.schemas)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=len(p_ids) + len(script) + 8, n_layer=2, n_head=4,
                    n_embd=64)
    policy, ref = GPT(cfg).to(DEVICE).eval(), GPT(cfg).to(DEVICE).eval()
    o = train_ppo.Options(advantage="grpo", samples_per_prompt=1, micro_batch_size=1, max_new_tokens=len(script) + 8,
                          tools="calculator", max_turns=3, missing_eos_penalty=None, dtype=dtype,
                          device=DEVICE.type)
    models = train_ppo.Models(policy=policy, reward=lambda p, c: [float("42" in x) for x in c], ref=ref, tools=box)
    r = train_ppo.rollout(lambda: [{"prompt": p_ids, "text": "What is 6*7?"}], models, tok, o,
                          torch.Generator(device=DEVICE).manual_seed(0))
    n = int(r.response_mask[0].sum())
    hole = [1.0] * len(first) + [0.0] * len(tool) + [1.0] * len(answer)
    assert r.query_response[0].tolist() == p_ids + script and r.action_mask[0].tolist() == hole
    assert r.scores[0] == 1.0 and r.stats["tool_calls"] == 1.0
    step[0] = 0
    from nano_rlhf.training import autocast
    with autocast(DEVICE, dtype):
        decoded = sampling.generate_turns(policy, torch.tensor([p_ids], device=DEVICE), None, sampling.SamplingOptions(
            max_new_tokens=len(script) + 8, temperature=1.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id),
            ToolEnv(box, tok), 3)
    acts = decoded.policy_mask[0, :n].to(r.logprobs.device)
    gap = float((r.logprobs[0][acts] - decoded.logprobs[0, :n].to(r.logprobs.device)[acts].float()).abs().max())
    record(f"tool_rollout/{dtype}", max_abs_logp_diff=gap, actions=int(acts.sum()), tool_tokens=len(tool))
    box.close()
    assert gap == gap and gap <= (2 * FLOAT32_ATOL if dtype == "float32" else 0.1)
