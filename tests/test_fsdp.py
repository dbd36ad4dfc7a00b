"""FSDP2 sharding (--fsdp), sharded checkpoints that resume on another number of ranks without unpickling
anything, frozen models left bit-identical, and the memory plan's arithmetic.

The multi-process tests run 2 gloo ranks on CPU (torchrun) against one process (SFT, RM, DPO: same global
batch, so the same trajectory to float rounding) or against DDP on 2 ranks (PPO, GRPO: each rank samples
its own rollouts, so one process sees other samples; FSDP must follow DDP)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import gae_only, pref_rows, prompt_rows, run, sft_rows, weights_close, write_jsonl
from nano_rlhf import checkpoint, parallel


# ---- the memory plan ------------------------------------------------------------------------------

def test_memory_plan_hand_computed():
    """1,000-parameter policy and critic (trained), ref and reward (frozen); float32, AdamW (8 B/param)."""
    models = {"policy": {"params": 1000, "trainable": True, "adapters": 10},
              "critic": {"params": 1000, "trainable": True, "adapters": 10},
              "ref": {"params": 1000, "trainable": False, "shared": True},
              "reward": {"params": 1000, "trainable": False}}
    ddp = {r["model"]: r for r in parallel.memory_plan(models, "ddp", 8)}
    assert ddp["policy"] == {"model": "policy", "params": 4000, "grads": 4000, "optim": 8000, "total": 16000}
    assert ddp["ref"]["total"] == ddp["reward"]["total"] == 4000
    assert ddp["total"]["total"] == 2 * 16000 + 2 * 4000
    fsdp = {r["model"]: r for r in parallel.memory_plan(models, "fsdp", 8)}
    assert fsdp["policy"] == {"model": "policy", "params": 500, "grads": 500, "optim": 1000, "total": 2000}  # 125 each
    assert fsdp["ref"]["params"] == 500 and fsdp["total"]["total"] == 2 * 2000 + 2 * 500
    rep = {r["model"]: r for r in parallel.memory_plan(models, "fsdp", 8, frozen="replicate")}
    assert rep["ref"]["params"] == 4000 and rep["policy"]["total"] == 2000
    off = {r["model"]: r for r in parallel.memory_plan(models, "fsdp", 8, offload=True)}
    assert off["ref"]["total"] == off["reward"]["total"] == 0 and off["total"]["total"] == 4000
    # LoRA: base + adapters held, only the 10 adapter parameters have gradients and moments; the reference
    # is the policy with its adapters off (no memory of its own), the reward model still is a model
    lora = {r["model"]: r for r in parallel.memory_plan(models, "ddp", 1, lora=True)}
    assert lora["policy"] == {"model": "policy", "params": 4040, "grads": 40, "optim": 80, "total": 4160}
    assert lora["ref"]["total"] == 0 and lora["reward"]["total"] == 4000
    # uneven shards: every rank is charged the largest (ceil)
    assert parallel.memory_plan({"m": {"params": 10, "trainable": False}}, "fsdp", 3)[0]["params"] == 4 * 4
    with pytest.raises(ValueError, match="strategy"):
        parallel.memory_plan(models, "zero9", 2)


@pytest.mark.parametrize("model_type", ["gpt2", "qwen2"])
def test_parameter_counts_from_config_equal_the_built_model(model_type):
    from nano_rlhf.lora import apply_lora, lora_parameters
    from nano_rlhf.model import GPT, GPTConfig, ScoreModel
    kw = dict(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32, model_type=model_type)
    if model_type != "gpt2":
        kw.update(n_kv_head=2, intermediate_size=48, attention_bias=True, tie_word_embeddings=False)
    cfg = GPTConfig(**kw)
    for cls, head in ((GPT, "lm"), (ScoreModel, "score")):
        m = cls(cfg)
        n, adapters = parallel.count_params(cfg, head, lora_r=4)
        assert n == sum(p.numel() for p in m.parameters())
        apply_lora(m, 4, 8.0)
        assert adapters == sum(p.numel() for p in lora_parameters(m))


def test_plan_command_prints_the_table_and_rejects_bad_input(capsys):
    assert parallel.main(["--plan", "--config", "qwen2.5-1.5b", "--world", "1,8,16"]) == 0
    out = capsys.readouterr().out
    assert "policy 1,543.7M" in out                      # Qwen2.5-1.5B: 1.54 B parameters (tied embedding)
    rows = [ln for ln in out.splitlines() if ln.startswith("| 1 |") or ln.startswith("| 8 |")]
    one, eight = ([float(x) for x in r.strip("|").split("|")[1:]] for r in rows)
    assert one[0] == one[1] and eight[1] == pytest.approx(one[1] / 8, rel=1e-3)   # FSDP at 1/N of DDP
    assert parallel.main(["--plan", "--config", "7b", "--world", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --world '0'")
    assert parallel.main(["--plan", "--config", "/nonexistent"]) == 2
    assert "error: --config /nonexistent: neither a preset" in capsys.readouterr().err


# ---- sharded checkpoint files ---------------------------------------------------------------------

@pytest.mark.parametrize("n,world", [(10, 2), (10, 3), (7, 4), (2, 4), (1, 2)])
def test_shard_rows_are_torch_chunk(n, world):
    """FSDP2 shards dim 0 as torch.chunk does (the last ranks may hold fewer rows, or none)."""
    chunks = torch.arange(n).chunk(world)
    for r in range(world):
        a, b = checkpoint.shard_rows(n, world, r)
        want = chunks[r].tolist() if r < len(chunks) else []
        assert list(range(a, b)) == want


def test_tensor_source_reads_any_rows_across_rank_files(tmp_path):
    """A state saved by 3 ranks read back whole and as 2 ranks' rows (crossing file boundaries); unsharded
    tensors come from rank 0's file; the single-file layout answers the same calls."""
    w = torch.arange(70.0).view(10, 7)
    step = torch.tensor(3.0)
    for r in range(3):
        a, b = checkpoint.shard_rows(10, 3, r)
        save_file({"w": w[a:b].contiguous(), **({"step": step} if r == 0 else {})},
                  str(tmp_path / f"m.rank{r}.safetensors"))
    (tmp_path / "m.json").write_text(json.dumps({"world_size": 3, "tensors": {
        "w": {"shape": [10, 7], "sharded": True}, "step": {"shape": [], "sharded": False}}}))
    src = checkpoint.TensorSource(str(tmp_path), "m")
    assert src.sharded and torch.equal(src.read("w"), w) and torch.equal(src.read("step"), step)
    for r in range(2):
        a, b = checkpoint.shard_rows(10, 2, r)
        assert torch.equal(src.read("w", a, b), w[a:b])
    save_file({"w": w, "step": step}, str(tmp_path / "whole.safetensors"))
    whole = checkpoint.TensorSource(str(tmp_path), "whole")
    assert not whole.sharded and torch.equal(whole.read("w", 4, 8), w[4:8])
    os.remove(tmp_path / "m.rank1.safetensors")
    from nano_rlhf.checkpoint import StateError
    with pytest.raises(StateError, match=r"m.rank1.safetensors: missing"):
        checkpoint.TensorSource(str(tmp_path), "m").read("w", 0, 10)


# ---- the scripts under torchrun -------------------------------------------------------------------

# Run a script in a process where unpickling raises (pickle and torch.load), then the script itself.
NO_PICKLE = """import pickle, runpy, sys
import torch
def _refuse(*a, **k):
    raise RuntimeError("unpickling attempted")
class _Refuse(pickle.Unpickler):
    def __init__(self, *a, **k):
        _refuse()
pickle.loads, pickle.load, pickle.Unpickler, torch.load = _refuse, _refuse, _Refuse, _refuse
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def metrics(d):
    with open(os.path.join(d, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f]


def close_metrics(a, b, keys, tol=1e-4):
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb):
        for k in keys:
            if k in x or k in y:
                assert abs(x[k] - y[k]) <= tol * max(1.0, abs(x[k])), (k, x, y)


def weights(d):
    return load_file(os.path.join(d, "model.safetensors"))


@pytest.mark.slow
def test_sft_fsdp_equals_one_process_and_resumes_across_world_sizes(tmp_path):
    """2 ranks x (1 x 2 accum) sharded == 1 process x 4, step by step (loss, gradient norm, eval loss on an
    eval set that splits 3 + 2 over the ranks) and in the final weights; the state is per-rank shards; a
    state saved by 2 FSDP ranks resumes in 1 process (without unpickling anything) and one saved by 1
    process resumes on 2 FSDP ranks, both equal to the uninterrupted run."""
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(96))
    write_jsonl(tmp_path / "eval.jsonl", sft_rows(5, seed=1))

    def args(out, *extra):
        return ["train_sft.py", "--data", str(tmp_path / "sft.jsonl"), "--eval_data", str(tmp_path / "eval.jsonl"),
                "--out_dir", str(tmp_path / out), "--max_steps", "4", "--n_layer", "2", "--n_head", "2",
                "--n_embd", "32", "--vocab_size", "300", "--log_interval", "1", "--eval_interval", "2",
                "--warmup_steps", "1", *extra]
    run(args("one", "--batch_size", "4"))
    tk = ["--tokenizer", str(tmp_path / "one" / "tokenizer.json")]
    two = ["--batch_size", "1", "--grad_accum", "2", "--fsdp", *tk]
    p = run(args("fsdp", *two), nproc=2)
    assert "memory plan (fsdp; 2 rank(s)" in p.stdout
    close_metrics(tmp_path / "one", tmp_path / "fsdp", ["train/loss", "train/grad_norm", "eval/loss"])
    assert weights_close(weights(tmp_path / "one"), weights(tmp_path / "fsdp"))
    state = sorted(os.listdir(tmp_path / "fsdp" / "state"))
    assert {"model_policy.rank0.safetensors", "model_policy.rank1.safetensors", "model_policy.json",
            "optim_policy.rank0.safetensors", "optim_policy.rank1.safetensors", "optim_policy.json"} <= set(state)
    assert "model_policy.safetensors" not in state
    # each rank's file holds half of the embedding's rows
    shard0 = load_file(str(tmp_path / "fsdp" / "state" / "model_policy.rank0.safetensors"))
    assert shard0["transformer.wte.weight"].shape == (150, 32)

    # 2 -> 1: saved by 2 sharded ranks at step 2, resumed by one process that may not unpickle
    run(args("two_one", *two, "--stop_at", "2"), nproc=2)
    p = run(["-c", NO_PICKLE, *args("two_one", "--batch_size", "4", "--resume", *tk)])
    assert "RNG streams restart" in p.stdout
    assert weights_close(weights(tmp_path / "one"), weights(tmp_path / "two_one"))
    close_metrics(tmp_path / "one", tmp_path / "two_one", ["train/loss", "train/grad_norm"])
    # the guard is real: the same wrapper refuses torch.load
    (tmp_path / "load.py").write_text("import torch; torch.load('x')")
    bad = run(["-c", NO_PICKLE, str(tmp_path / "load.py")], check=False)
    assert "unpickling attempted" in bad.stderr

    # 1 -> 2: saved by one process (unsharded files), resumed on 2 FSDP ranks
    run(args("one_two", "--batch_size", "4", "--stop_at", "2", *tk))
    run(args("one_two", *two, "--resume"), nproc=2)
    assert weights_close(weights(tmp_path / "one"), weights(tmp_path / "one_two"))
    close_metrics(tmp_path / "one", tmp_path / "one_two", ["train/loss", "train/grad_norm"])


@pytest.mark.slow
def test_rm_and_dpo_fsdp_equal_one_process_reference_untouched(tmp_path, sft_dir):
    """Reward model (score head; the last block in the root group for the end-score path) and DPO with a
    sharded frozen reference: 2 FSDP ranks == 1 process; the reference is bit-identical after training."""
    write_jsonl(tmp_path / "pref.jsonl", pref_rows(64))
    write_jsonl(tmp_path / "pref_eval.jsonl", pref_rows(5, seed=1))
    common = ["--data", str(tmp_path / "pref.jsonl"), "--eval_data", str(tmp_path / "pref_eval.jsonl"),
              "--init", sft_dir, "--max_steps", "3", "--log_interval", "1", "--eval_interval", "2", "--lr", "1e-3",
              "--warmup_steps", "0"]
    run(["train_rm.py", *common, "--out_dir", str(tmp_path / "rm1"), "--batch_size", "4"])
    run(["train_rm.py", *common, "--out_dir", str(tmp_path / "rm2"), "--batch_size", "1", "--grad_accum", "2",
         "--fsdp"], nproc=2)
    close_metrics(tmp_path / "rm1", tmp_path / "rm2", ["train/loss", "train/grad_norm", "eval/loss"])
    assert weights_close(weights(tmp_path / "rm1"), weights(tmp_path / "rm2"))

    run(["train_dpo.py", *common, "--out_dir", str(tmp_path / "d1"), "--batch_size", "4"])
    p = run(["train_dpo.py", *common, "--out_dir", str(tmp_path / "d2"), "--batch_size", "1", "--grad_accum", "2",
             "--fsdp"], nproc=2)
    assert "frozen models bit-identical to the start: reference" in p.stdout
    assert "ref " in p.stdout.split("memory plan (fsdp, frozen shard; 2 rank(s)")[1]
    close_metrics(tmp_path / "d1", tmp_path / "d2", ["train/loss", "train/grad_norm", "eval/loss"])
    assert weights_close(weights(tmp_path / "d1"), weights(tmp_path / "d2"))


def ppo_args(tmp_path, sft_dir, rm_dir, out, *extra):
    if not (tmp_path / "prompts.jsonl").exists():
        write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(48))
        write_jsonl(tmp_path / "eval_prompts.jsonl", prompt_rows(8, seed=1))
    return gae_only(["train_ppo.py", "--prompts", str(tmp_path / "prompts.jsonl"), "--eval_prompts",
                     str(tmp_path / "eval_prompts.jsonl"), "--init", sft_dir, "--reward_model", rm_dir, "--out_dir",
                     str(tmp_path / out), "--max_steps", "2", "--batch_size", "2", "--max_new_tokens", "8",
                     "--eval_interval", "2", "--eval_samples", "4", "--lr", "1e-3", "--critic_lr", "1e-3",
                     "--critic_warmup_steps", "0", "--log_interval", "1", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("--kl_coef", "0.05", "--frozen", "shard"),
                                   ("--advantage", "grpo", "--samples_per_prompt", "2", "--kl_coef", "0.05",
                                    "--frozen", "replicate")], ids=["ppo", "grpo"])
def test_ppo_and_grpo_fsdp_follow_ddp(tmp_path, sft_dir, rm_dir, extra):
    """PPO (policy and critic sharded, reference and reward model sharded) and GRPO (frozen models
    replicated): 2 FSDP ranks follow 2 DDP ranks (the same rollouts: generation on gathered weights samples
    what DDP samples) in every logged statistic and the final weights; frozen models bit-identical."""
    run(ppo_args(tmp_path, sft_dir, rm_dir, "ddp", *extra[:-2]), nproc=2)
    p = run(ppo_args(tmp_path, sft_dir, rm_dir, "fsdp", "--fsdp", *extra), nproc=2)
    assert "frozen models bit-identical to the start: ref" in p.stdout and "reward model" in p.stdout
    keys = ["train/score", "train/kl", "train/policy_loss", "train/value_loss", "train/entropy", "train/grad_norm",
            "train/critic_grad_norm", "eval/rm_score", "eval/kl"]
    close_metrics(tmp_path / "ddp", tmp_path / "fsdp", keys)
    assert weights_close(weights(tmp_path / "ddp"), weights(tmp_path / "fsdp"))


@pytest.mark.slow
def test_fsdp_flag_errors_are_one_line(tmp_path, sft_dir):
    p = run(["train_dpo.py", "--init", sft_dir, "--frozen", "replicate", "--out_dir", str(tmp_path / "x")],
            check=False)
    assert p.returncode == 2 and p.stderr.strip() == "error: --frozen applies only with --fsdp; here it would be ignored"
    p = run(["train_dpo.py", "--init", sft_dir, "--loss", "simpo", "--offload_frozen", "--out_dir",
             str(tmp_path / "x")], check=False)
    assert p.returncode != 0 and "error: --offload_frozen: this run holds no reference model" in p.stderr
    p = run(["train_sft.py", "--fsdp", "--compile", "--out_dir", str(tmp_path / "x")], check=False)
    assert p.returncode != 0 and p.stderr.strip() == "error: --compile with --fsdp is not supported; drop one of them"
    assert not (tmp_path / "x").exists()

