"""bench/gpu.py, the GPU check, dry-run on the CPU at tiny shapes (the same code path as on a GPU, minus the
torch.compile rows and test, which cost tens of seconds here), so it cannot rot between runs on a GPU; and
its bad flags."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT


def gpu_module():
    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "bench", "gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow      # the whole check at tiny shapes, every part in its own process: 1-2.5 min on 2 cores
def test_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu"
    p = subprocess.run([sys.executable, "bench/gpu.py", str(out), "--device", "cpu", "--tiny", "--no_compile"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    gpu = gpu_module()
    for part in gpu.PARTS:            # each part's plan printed before it runs
        assert f"{part}: planned {sum(s for _, s in gpu.PLAN[part])} s of device time" in p.stdout
    parts = {name: json.loads((out / f"{name}.json").read_text()) for name in gpu.PARTS}
    assert all(r["done"] for r in parts.values()), parts
    train = parts["train"]
    assert train["env"]["versions"]["torch"] == torch.__version__
    assert set(train["head"]) == {"gpt2 50257", "smollm2 49152", "qwen2.5 151936"}
    assert all("ms" in side for row in train["head"].values() for side in row.values()), train["head"]
    rows = train["rows"]
    assert not [r for r in rows if "error" in r], rows
    assert {(r["kind"], r["side"]) for r in rows} == {("sft", "nano_rlhf"), ("sft", "hf bare loop"),
                                                      ("sft", "hf bare loop, vocab padded to 64"),
                                                      ("sft_32", "nano_rlhf"), ("sft_32", "hf bare loop"),
                                                      ("dpo", "nano_rlhf dpo"), ("dpo", "hf bare loop dpo"),
                                                      ("grpo_update", "nano_rlhf grpo update"),
                                                      ("grpo_update", "hf bare loop grpo update")}
    assert all(len(r["times"]) >= 2 and r["tokens_per_s"] > 0 for r in rows)
    assert "top" in rows[0]["profile"] and rows[0]["host_reads"] == "not checked (CPU)"
    grpo = [r for r in rows if r["side"] == "nano_rlhf grpo update" and r["shape"] == "gpt2-124m"][0]
    assert "attention" in grpo["profile"] and grpo["vs_hf"] > 0
    assert [r for r in rows if r["shape"] == "gpt2-124m" and r["side"] == "nano_rlhf"][0]["vs_hf_padded_vocab"] > 0
    sub = train["correctness"]
    assert sub["counts"]["failed"] == 0 and sub["counts"]["passed"] >= 5, sub["counts"]
    assert "chunked_logprobs" in {m["name"] for m in sub["measurements"]}
    c = parts["correctness"]
    assert c["counts"]["failed"] == 0 and c["counts"]["passed"] >= 30, c["counts"]
    names = {m["name"] for m in c["measurements"]}
    assert {"fsdp2_world1", "bf16_sampler_vs_trainer", "chunked_logprobs", "resume/grpo"} <= names
    assert parts["grpo"]["step_s"] and 0 < parts["grpo"]["rollout_share"] < 1
    sides = {r["side"]: r for r in parts["rollout"]["rows"]}
    assert len(sides) == 3 and all("new_tokens_per_s" in r for r in sides.values()), sides
    # the table last, at most 20 lines; the check never writes more files than a GPU command brings back (8)
    assert "sft gpt2-124m nano_rlhf:" in p.stdout and len(gpu.table(str(out))) <= 20
    assert len(os.listdir(out)) <= 8


def test_every_part_fits_a_short_gpu_command(tmp_path, capsys, monkeypatch):
    """Each part's plan is at most 4.5 minutes of device time (builds and compiles included), and one planned
    over it is refused in one line before anything runs."""
    gpu = gpu_module()
    assert all(sum(s for _, s in items) <= gpu.MAX_PART_S for items in gpu.PLAN.values()), gpu.PLAN
    monkeypatch.setitem(gpu.PLAN, "grpo", [("too much", gpu.MAX_PART_S + 1)])
    assert gpu.main([str(tmp_path / "o"), "--device", "cpu", "--only", "grpo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: part(s) grpo planned over 270 s") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_peaks_match_the_nvl_cards_first():
    gpu = gpu_module()
    peak = lambda name: next(p for k, p in gpu.PEAKS if k in name)
    assert peak("NVIDIA H200 NVL") == peak("NVIDIA H100 NVL") == 835e12
    assert peak("NVIDIA H200") == peak("NVIDIA H100 80GB HBM3") == 989.4e12 and peak("NVIDIA H100 PCIe") == 756.5e12


@pytest.mark.parametrize("argv, message", [
    (["--only", "train,speed"], "error: --only: unknown part(s) speed; the parts are train, rollout, grpo, "
                                "correctness"),
    (["--device", "cuda"], "error: --device cuda: no CUDA GPU is available here"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # the same on a machine with a GPU
    assert gpu_module().main([str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_gpu_tests_are_never_collected_into_the_cpu_suite():
    """pytest.ini's -m 'not gpu' is replaced by any other -m; conftest.py must still deselect them."""
    for expr in ([], ["-m", "not slow"], ["-m", "numeric"]):
        p = subprocess.run([sys.executable, "-m", "pytest", "tests/test_gpu.py", "--collect-only", "-q", "-n", "0",
                            *expr], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "test_hf_parity" not in p.stdout and "skipped" not in p.stdout, (expr, p.stdout[-2000:])
