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


@pytest.mark.slow      # the whole check at tiny shapes, every part in its own process: ~30 s on 2 cores
def test_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu"
    p = subprocess.run([sys.executable, "bench/gpu.py", str(out), "--device", "cpu", "--tiny", "--no_compile"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    parts = {name: json.loads((out / f"{name}.json").read_text()) for name in gpu_module().PARTS}
    assert all(r["done"] for r in parts.values()), parts
    assert parts["env"]["versions"]["torch"] == torch.__version__
    c = parts["correctness"]
    assert c["counts"]["failed"] == 0 and c["counts"]["passed"] >= 30, c["counts"]
    names = {m["name"] for m in c["measurements"]}
    assert {"fsdp2_world1", "bf16_sampler_vs_trainer", "chunked_logprobs", "resume/grpo"} <= names
    sft = parts["sft"]["rows"]
    assert {r["side"] for r in sft} == {"nano_rlhf", "hf bare loop"} and all("tokens_per_s" in r for r in sft), sft
    assert "profile" in sft[0]
    assert parts["grpo"]["step_s"] and 0 < parts["grpo"]["rollout_share"] < 1
    sides = {r["side"]: r for r in parts["rollout"]["rows"]}
    assert len(sides) == 3 and all("new_tokens_per_s" in r for r in sides.values()), sides
    # the check never writes more files than a GPU machine's command brings back (8)
    assert len(os.listdir(out)) <= 8


@pytest.mark.parametrize("argv, message", [
    (["--only", "sft,speed"], "error: --only: unknown part(s) speed; the parts are env, correctness, sft, grpo, "
                              "rollout"),
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
