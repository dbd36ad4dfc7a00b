"""The survey scripts (train_listwise.py, train_unpaired.py, train_online.py) on the core scripts' plumbing:
--lora_r trains adapters on a bit-identical base, the reference is then the policy with its adapters off, the
merged export is base + (alpha / r) B A; --fsdp on 2 gloo ranks (torchrun, CPU) follows the unsharded run as
train_dpo.py's does (tests/test_fsdp.py: the same tolerance), its frozen reference bit-identical at the end."""
import math
import os

import pytest
import torch
from conftest import run, weights_close
from test_fsdp import close_metrics, metrics, weights
from test_lora_scripts import (LORA, assert_base_untouched, assert_merged_export_exact, assert_only_adapters_optimised,
                               ids)
from safetensors.torch import load_file

from test_online import online_args
from test_unpaired import args as unpaired_args

import train_listwise
import train_online
import train_unpaired
from nano_rlhf import dist
from nano_rlhf.lora import BaseView, lora_modules, merged_copy
from nano_rlhf.model import GPT, ScoreModel


def assert_lora_run(out, out_dir, sft_dir, optimizer):
    """The base untouched, only adapters optimised (and trained), the reference the adapters-off view of the
    policy giving the base model's logits after training, the export exact, the state adapters only."""
    assert isinstance(out.ref, BaseView) and out.ref.model is dist.unwrap(out.policy)
    fresh = GPT.from_pretrained(sft_dir).eval()
    assert_base_untouched(out.policy, fresh)
    assert_only_adapters_optimised(out.policy, optimizer)
    merged = assert_merged_export_exact(out.policy, out_dir)
    x = ids()
    with torch.no_grad():
        assert torch.equal(out.ref(x), fresh(x)) and not torch.allclose(merged(x), fresh(x))
    saved = load_file(str(out_dir / "state" / "model_policy.safetensors"))
    assert saved and all(".lora_" in k for k in saved)


# ---- train_listwise.py ----------------------------------------------------------------------------

def lw_args(task_dir, sft_dir, out, *extra):
    return ["--loss", "lipo", "--data", str(task_dir / "listwise.jsonl"), "--eval_data",
            str(task_dir / "listwise_eval.jsonl"), "--init", sft_dir, "--out_dir", str(out), "--max_steps", "3",
            "--log_interval", "1", "--lr", "1e-2", "--warmup_steps", "0", *extra]


def test_listwise_lora(tmp_path, task_dir, sft_dir):
    out = train_listwise.main(lw_args(task_dir, sft_dir, tmp_path / "o", "--batch_size", "4", "--eval_interval", "0",
                                      *LORA))
    first = metrics(tmp_path / "o")[0]
    # π = π_ref at step 1 (B = 0): every s is 0, so no pair is ranked right and each pays Δ·log 2
    assert first["train/value_mean"] == 0 and first["train/pair_accuracy"] == 0
    assert math.isfinite(first["train/loss"]) and metrics(tmp_path / "o")[-1]["train/loss"] != first["train/loss"]
    assert_lora_run(out, tmp_path / "o", sft_dir, out.optimizer)


@pytest.mark.slow
def test_listwise_fsdp_equals_one_process_reference_untouched(tmp_path, task_dir, sft_dir):
    """LiPO with a sharded frozen reference and an NLL term: 2 FSDP ranks x (2 x 2 accum) == 1 process x (4 x 2),
    step by step and in the final weights; the reference bit-identical after training."""
    common = ["--grad_accum", "2", "--nll_coef", "0.5", "--eval_interval", "2"]
    run(["train_listwise.py", *lw_args(task_dir, sft_dir, tmp_path / "one", "--batch_size", "4", *common)])
    p = run(["train_listwise.py", *lw_args(task_dir, sft_dir, tmp_path / "fsdp", "--batch_size", "2", "--fsdp",
                                           *common)], nproc=2)
    assert "frozen models bit-identical to the start: reference" in p.stdout
    assert "ref " in p.stdout.split("memory plan (fsdp, frozen shard; 2 rank(s)")[1]
    close_metrics(tmp_path / "one", tmp_path / "fsdp", ["train/loss", "train/nll", "train/grad_norm", "eval/loss",
                                                        "eval/pair_accuracy"])
    assert weights_close(weights(tmp_path / "one"), weights(tmp_path / "fsdp"))


# ---- train_unpaired.py ----------------------------------------------------------------------------

def test_unpaired_npo_lora(tmp_path, sft_dir):
    out = train_unpaired.main(unpaired_args(tmp_path, sft_dir, "o", "npo", *LORA, "--lr", "1e-2"))
    first = metrics(tmp_path / "o")[0]
    # π = π_ref at step 1 (B = 0): u = 0, so every negative pays (2/β)·log 2 (β = 0.1) and its reward is 0
    assert first["train/loss"] == pytest.approx(20 * math.log(2), rel=1e-6) and first["train/rewards_negative"] == 0
    assert_lora_run(out, tmp_path / "o", sft_dir, out.optimizers["policy"])


def test_unpaired_dro_lora_adapts_the_value_model_too(tmp_path, sft_dir):
    out = train_unpaired.main(unpaired_args(tmp_path, sft_dir, "o", "dro", *LORA, "--lr", "1e-2", "--value_lr",
                                            "1e-2"))
    assert_lora_run(out, tmp_path / "o", sft_dir, out.optimizers["policy"])
    fresh = ScoreModel.from_pretrained(sft_dir, new_head=True)
    assert_base_untouched(out.value, fresh, skip=("score.weight",))
    assert_only_adapters_optimised(out.value, out.optimizers["value"], head=("score.weight",))
    assert lora_modules(out.value) and out.value.score.weight.abs().sum() > 0     # V(x) started at 0
    assert_merged_export_exact(out.value, tmp_path / "o" / "value", ScoreModel)


@pytest.mark.slow
def test_unpaired_dro_fsdp_equals_one_process_reference_untouched(tmp_path, sft_dir):
    """DRO (policy and value model sharded, the reference sharded): 2 FSDP ranks x (2 x 2 accum) == 1 process x
    (4 x 2), step by step (with an evaluation) and in both models' final weights."""
    common = ["--grad_accum", "2", "--value_lr", "1e-2", "--eval_interval", "2"]
    run(["train_unpaired.py", *unpaired_args(tmp_path, sft_dir, "one", "dro", "--batch_size", "4", *common)])
    p = run(["train_unpaired.py", *unpaired_args(tmp_path, sft_dir, "fsdp", "dro", "--batch_size", "2", "--fsdp",
                                                 *common)], nproc=2)
    assert "frozen models bit-identical to the start: reference" in p.stdout
    close_metrics(tmp_path / "one", tmp_path / "fsdp", ["train/loss", "train/value", "train/grad_norm",
                                                        "train/value_grad_norm", "eval/loss"])
    for sub in ("", "value"):
        assert weights_close(weights(tmp_path / "one" / sub), weights(tmp_path / "fsdp" / sub)), sub


# ---- train_online.py ------------------------------------------------------------------------------

def test_online_dpo_lora(tmp_path, sft_dir, rm_dir):
    out = train_online.main(online_args(tmp_path, sft_dir, rm_dir, "o", *LORA, "--pairs", "all", "--lr", "1e-2",
                                        steps=3))
    assert out.ref is out.init_ref
    first = metrics(tmp_path / "o")[0]
    # π = π_ref at step 1 (B = 0): the samples' KL to the reference and every pair's reward are exactly 0
    assert first["train/kl"] == 0 and first["train/reward_margin"] == 0 and first["train/pairs"] > 0
    assert_lora_run(out, tmp_path / "o", sft_dir, out.optimizer)


def test_online_sppo_lora_reference_updates_to_the_merged_policy(tmp_path, sft_dir, rm_dir):
    """--ref_update_every under LoRA: the reference copy becomes base + (α/r)·B·A, the policy's merged weights."""
    out = train_online.main(online_args(tmp_path, sft_dir, rm_dir, "o", *LORA, "--method", "sppo",
                                        "--ref_update_every", "1", "--lr", "1e-2", steps=2))
    assert isinstance(out.ref, GPT) and isinstance(out.init_ref, BaseView)
    want = merged_copy(out.policy).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in out.ref.state_dict().items())
    assert_base_untouched(out.policy, GPT.from_pretrained(sft_dir))


@pytest.mark.parametrize("extra, line", [
    (["--lora_r", "4", "--method", "nash_md"], "--method nash_md with --lora_r needs a separate --ref DIR"),
    (["--fsdp", "--method", "sppo", "--ref_update_every", "2"], "--ref_update_every with --fsdp is not supported"),
    (["--frozen", "replicate"], "--frozen applies only with --fsdp"),
    (["--lora_r", "4", "--fsdp"], "--lora_r with --fsdp is not supported yet"),
])
def test_online_plumbing_flag_errors_are_one_line(tmp_path, sft_dir, rm_dir, capsys, extra, line):
    with pytest.raises(SystemExit) as e:
        train_online.main(online_args(tmp_path, sft_dir, rm_dir, "x", *extra))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: {line}"), err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("script, argv, line", [
    ("listwise", ["--fsdp", "--compile"], "--compile with --fsdp is not supported"),
    ("listwise", ["--offload_frozen"], "--offload_frozen: this run holds no reference model (--loss rrhf"),
    ("unpaired", ["--frozen", "replicate"], "--frozen applies only with --fsdp"),
    ("unpaired", ["--lora_targets", "c_attn"], "--lora_targets applies only with --lora_r > 0"),
])
def test_listwise_and_unpaired_plumbing_flag_errors_are_one_line(tmp_path, capsys, script, argv, line):
    main = {"listwise": train_listwise.main, "unpaired": train_unpaired.main}[script]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out_dir", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: {line}"), err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("method", [["--method", "online_dpo", "--pairs", "all", "--nll_coef", "0.3"],
                                    ["--method", "nash_md"]], ids=["online_dpo", "nash_md"])
def test_online_fsdp_follows_ddp(tmp_path, sft_dir, rm_dir, method):
    """2 FSDP ranks (policy and reference sharded; sampling, Nash-MD's mixture included, and the rank-0
    evaluation on gathered weights) follow 2 DDP ranks in every logged figure and the final weights; the
    reference bit-identical at the end."""
    common = [*method, "--eval_interval", "2", "--log_interval", "1"]
    run(["train_online.py", *online_args(tmp_path, sft_dir, rm_dir, "ddp", *common)], nproc=2)
    p = run(["train_online.py", *online_args(tmp_path, sft_dir, rm_dir, "fsdp", *common, "--fsdp")], nproc=2)
    assert "frozen models bit-identical to the start: reference" in p.stdout
    assert "memory plan (fsdp, frozen shard; 2 rank(s)" in p.stdout
    close_metrics(tmp_path / "ddp", tmp_path / "fsdp", ["train/loss", "train/score", "train/kl", "train/grad_norm",
                                                        "train/response_length", "eval/rm_score", "eval/kl"])
    assert weights_close(weights(tmp_path / "ddp"), weights(tmp_path / "fsdp"))


# ---- resume under LoRA ------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["listwise", "unpaired", "online"])
def test_lora_resume_is_exact(tmp_path, task_dir, sft_dir, rm_dir, script):
    """4 steps straight == 2 steps, stop, --resume: the saved adapters (DRO: the value model's too), the merged
    export and every logged figure, bit for bit."""
    mod, args = {
        "listwise": (train_listwise, lambda out, *x: lw_args(task_dir, sft_dir, tmp_path / out, "--batch_size", "4",
                                                             "--eval_interval", "0", "--max_steps", "4", *LORA, *x)),
        "unpaired": (train_unpaired, lambda out, *x: unpaired_args(tmp_path, sft_dir, out, "dro", *LORA, "--lr",
                                                                   "1e-2", "--value_lr", "1e-2", *x, steps=4)),
        "online": (train_online, lambda out, *x: online_args(tmp_path, sft_dir, rm_dir, out, *LORA, "--pairs", "all",
                                                             "--lr", "1e-2", *x, steps=4)),
    }[script]
    mod.main(args("straight"))
    mod.main(args("split", "--stop_at", "2"))
    mod.main(args("split", "--resume"))
    names = [n for n in os.listdir(tmp_path / "straight" / "state") if n.startswith("model_")]
    assert names
    for name in names:
        a, b = (load_file(str(tmp_path / d / "state" / name)) for d in ("straight", "split"))
        assert a and all(".lora_" in k or k.startswith("score.") for k in a), name   # adapters (and a head) only
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("straight", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    timing = ("train/tokens_per_s", "train/step_time", "train/generate_time", "time/rollout_frac")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]
    assert strip(metrics(tmp_path / "straight")) == strip(metrics(tmp_path / "split"))
