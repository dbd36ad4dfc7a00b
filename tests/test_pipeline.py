"""The README's main command, on a tiny budget: every stage produces a loadable model and the table prints.
Also the plot command."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow      # every stage of the pipeline, ~1-2 minutes on 2 cores
def test_pipeline_tiny_end_to_end(tmp_path):
    env = dict(os.environ, TINY="1", OUT=str(tmp_path / "out"), DATA=str(tmp_path / "data"), PYTHON=sys.executable,
               OMP_NUM_THREADS="2")
    p = subprocess.run(["bash", "scripts/pipeline.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    from nano_rlhf.model import GPT, ScoreModel
    out = tmp_path / "out"
    policies = ["sft", "dpo", "ipo", "simpo", "orpo", "kto", "ppo", "grpo", "ppo_overopt"]
    for name in policies:
        GPT.from_pretrained(str(out / name))
        assert (out / name / "tokenizer.json").exists() and (out / name / "metrics.jsonl").exists()
    ScoreModel.from_pretrained(str(out / "rm"))
    # the printed table has a row per policy, and results.json the same figures
    table = [ln for ln in p.stdout.splitlines() if ln.startswith("| ")]
    assert table[0].startswith("| policy | gold reward | win rate vs sft")
    assert [ln.split(" | ")[0][2:] for ln in table[1:]] == policies
    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results] == policies and results[0]["win_rate"] == 0.5
    # every command was echoed so a user can copy it
    assert sum(ln.startswith("+ ") for ln in p.stdout.splitlines()) == 13


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "ppo"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(1, 6):
            f.write(json.dumps({"step": s, "train/rm_score_raw": s * 0.1, "train/kl": s * 0.2, "train/entropy": 1.0,
                                "train/kl_coef": 0.1, "train/gold_reward": 1.0 - s * 0.1, "eval/rm_score": s * 0.2,
                                "eval/gold_reward": 1.0 - s * 0.2, "eval/kl": s * 0.5}) + "\n")
    (tmp_path / "results.json").write_text(json.dumps([
        {"name": "sft", "gold_reward": 0.1, "gold_reward_se": 0.1, "kl": 0.0},
        {"name": "ppo", "gold_reward": 1.5, "gold_reward_se": 0.1, "kl": 2.0}]))
    p = subprocess.run([sys.executable, "-m", "nano_rlhf.plot", "--out_dir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for png in ("ppo.png", "gold_vs_kl.png", "overoptimization_ppo.png"):
        data = (tmp_path / "plots" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png


def test_plot_without_matplotlib_is_a_note_not_a_crash(tmp_path):
    code = ("import sys, builtins; real = builtins.__import__\n"
            "def fake(name, *a, **k):\n"
            "    if name.startswith('matplotlib'): raise ImportError(name)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = fake\n"
            "from nano_rlhf import plot; sys.exit(0 if plot.main(['--out_dir', %r]) == [] else 1)" % str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "matplotlib is not installed" in p.stdout


@pytest.mark.slow      # SFT and seven RL variants on the reasoning task, a few steps each
def test_reasoning_script_tiny_end_to_end(tmp_path):
    """scripts/reasoning.sh (TINY=1, one seed): every variant trains and loads, each seed's evaluation has a pass@k
    per policy, and the table over seeds has a row and a verdict per policy."""
    env = dict(os.environ, TINY="1", SEEDS="0", OUT=str(tmp_path / "out"), DATA=str(tmp_path / "data"),
               PYTHON=sys.executable)
    p = subprocess.run(["bash", "scripts/reasoning.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    from nano_rlhf.model import GPT
    variants = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "ppo"]
    GPT.from_pretrained(str(tmp_path / "out" / "sft"))
    for name in variants:
        GPT.from_pretrained(str(tmp_path / "out" / "seed0" / name))
    per_seed = json.loads((tmp_path / "out" / "seed0" / "results.json").read_text())
    assert [r["name"] for r in per_seed] == ["sft"] + variants and all(0 <= r["pass@4"] <= 1 for r in per_seed)
    table = [ln for ln in p.stdout.splitlines() if ln.startswith("| ")]
    assert table[-len(variants) - 2].startswith("| policy | pass@1 (mean over seeds")
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["name"] for r in rows] == ["sft"] + variants and all(r["seeds"] == 1 and "learns" in r for r in rows)
    # stages resume: a second run reuses every model
    p = subprocess.run(["bash", "scripts/reasoning.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0 and p.stdout.count("reusing ") == 1 + len(variants), p.stdout[-2000:]


@pytest.mark.slow      # two tasks: SFT, a reward model, offline DPO and five online variants, a few steps each
def test_online_script_tiny_end_to_end(tmp_path):
    """scripts/online.sh (TINY=1, one seed, both tasks): every variant trains and loads, each task's evaluation
    scores every policy with that task's gold reward, the table over seeds has a row per policy, and the built-in
    task's curves are drawn."""
    variants = ["offline_dpo", "online_dpo", "dno", "online_dpo_online_only", "dno_iterative", "online_dpo_hard"]
    env = dict(os.environ, TINY="1", SEEDS="0", OUT=str(tmp_path / "out"), PYTHON=sys.executable, JOBS="1")
    env.pop("TRL_PYTHON", None)
    p = subprocess.run(["bash", "scripts/online.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    from nano_rlhf.model import GPT
    for task in ("builtin", "recipes"):
        for name in variants:
            GPT.from_pretrained(str(tmp_path / "out" / task / "seed0" / name))
        per_seed = json.loads((tmp_path / "out" / task / "seed0" / "results.json").read_text())
        assert [r["name"] for r in per_seed] == ["sft"] + variants and all("reward" in r for r in per_seed)
        rows = json.loads((tmp_path / "out" / task / "results.json").read_text())
        assert [r["name"] for r in rows] == ["sft"] + variants
    assert (tmp_path / "out" / "online_curves.png").exists()


@pytest.mark.slow      # SFT, a reward model, a cost model, PPO and PPO-Lagrangian, a few steps each
def test_safe_script_tiny_end_to_end(tmp_path):
    """scripts/safe.sh (TINY=1, one seed, one cost limit): the harm data, a cost model that train_ppo_lagrangian
    accepts as --cost_model, every policy trained and loadable, each scored by the gold reward and the gold cost, the table with
    the Lagrangian's final λ, and the curves."""
    env = dict(os.environ, TINY="1", SEEDS="0", LIMITS="0", OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    p = subprocess.run(["bash", "scripts/safe.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    from nano_rlhf.model import GPT
    out = tmp_path / "out"
    assert json.loads((out / "cm" / "config.json").read_text())["score_kind"] == "cost"
    for name in ("ppo", "ppo_lag_d0"):
        GPT.from_pretrained(str(out / "seed0" / name))
    per_seed = json.loads((out / "seed0" / "results.json").read_text())
    assert [r["name"] for r in per_seed] == ["sft", "ppo", "ppo_lag_d0"]
    assert all("cost" in r and "unsafe_share" in r for r in per_seed)
    rows = {r["variant"]: r for r in json.loads((out / "results.json").read_text())}
    assert rows["ppo"]["final λ"] == [None, None] and rows["ppo_lag_d0"]["final λ"][0] > 0
    assert (out / "safe_curves.png").exists() or "matplotlib is not installed" in p.stdout


@pytest.mark.slow      # reasoning.sh's GRPO arm and the tool arm (data, SFT, GRPO with the calculator), a few steps
def test_tools_script_tiny_end_to_end(tmp_path):
    """scripts/tools.sh (TINY=1, one seed): both arms train and load, the tool arm's evaluation reports tool calls
    and malformed calls, and the report's table has the four policies."""
    env = dict(os.environ, TINY="1", SEEDS="0", OUT=str(tmp_path / "out"), DATA=str(tmp_path / "data"),
               FREE_DATA=str(tmp_path / "free"), PYTHON=sys.executable, JOBS="1")
    p = subprocess.run(["bash", "scripts/tools.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    from nano_rlhf.model import GPT
    for d in ("notools/seed0/grpo", "tools/sft", "tools/seed0/grpo_tools"):
        GPT.from_pretrained(str(tmp_path / "out" / d))
    per_seed = json.loads((tmp_path / "out" / "tools" / "seed0" / "results.json").read_text())
    assert [r["name"] for r in per_seed] == ["sft", "grpo_tools"]
    assert all("tool_calls" in r and "malformed_share" in r for r in per_seed)
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["policy"] for r in report["table"]] == ["SFT (no tools)", "GRPO, no tools",
                                                      "SFT with tool demonstrations", "GRPO with the calculator"]
    assert sum(c["n"] for c in report["calls"].values()) == 16 * 4     # every sample of the tool arm has a kind
