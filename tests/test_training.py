"""nano_rlhf.training: out_dir safety, the lock, resume identity checks, end_of_step, cleanup of failed starts,
report_to. A toy script (a linear model, the same life cycle as the four scripts) runs in-process where it can,
in a subprocess where process boundaries matter (the lock, exits, torchrun)."""
import importlib.util
import dataclasses
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from conftest import ROOT, run, tiny_model
from nano_rlhf import training

TOY = '''import os, sys, time, torch
from dataclasses import dataclass
from typing import Literal
from nano_rlhf import dist, training
from nano_rlhf.checkpoint import save_state
from nano_rlhf.cli import parse_args


@dataclass
class Options:
    out_dir: str = "out/toy"       # where
    init: str = ""                 # an input model directory
    data: str = ""                 # a data file
    lr: float = 0.1                # learning rate {> 0}
    batch_size: int = 2            # per device {>= 1}
    grad_accum: int = 1            # micro-steps {>= 1}
    max_steps: int = 6             # steps {>= 1}
    log_interval: int = 2          # log every N
    eval_interval: int = 3         # eval every N
    save_interval: int = 0         # save every N
    stop_at: int = 0               # stop after step N
    resume: bool = False           # resume
    overwrite: bool = False        # allow a non-empty out_dir
    report_to: Literal["none", "tensorboard", "wandb"] = "none"  # mirror
    dist_timeout: float = 10.0     # minutes {> 0}
    nan_at: int = 0                # the loss is nan at this step
    fail_at: int = 0               # raise at this step
    sleep: float = 0               # seconds to hold the lock before training


def main(argv=None):
    opts = parse_args(Options, argv)
    world = dist.setup("cpu", timeout_minutes=opts.dist_timeout)
    run = training.open_run(opts, script="toy", identity={"lr": opts.lr}, inputs={"init": opts.init},
                             data_files={"data": opts.data})
    print("started", flush=True)
    time.sleep(opts.sleep)
    if world.is_main:
        with open(os.path.join(opts.out_dir, "tokenizer.json"), "w") as f:   # like SFT's trained tokenizer
            f.write("{}")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    if opts.resume:
        run.resume(models={"m": model}, optimizers={"m": opt})
    for step in range(run.step + 1, opts.max_steps + 1):
        g = torch.Generator().manual_seed(step)             # the data of a step: a function of the step
        x = torch.randn(opts.batch_size * opts.grad_accum * world.world_size, 3, generator=g)
        x = x[world.rank::world.world_size]
        loss = model(x + 0.01 * torch.randn(x.shape)).pow(2).mean()   # torch RNG: restored on resume
        loss.backward()
        for p in model.parameters():
            p.grad = dist.all_reduce_mean(p.grad)
        opt.step()
        opt.zero_grad()
        if step == opts.fail_at:
            raise RuntimeError("boom")
        metrics = {"train/loss": float("nan") if step == opts.nan_at else dist.all_reduce_mean(loss.item())}
        if step == 2:
            run.log_samples(step, [{"prompt": "p|q", "completion": "c", "score": 1.0}])
        if run.end_of_step(step, metrics, evaluate=lambda: {"eval/loss": 1.5},
                           save=lambda s: save_state(opts.out_dir, {"m": model}, {"m": opt}, {"step": s})):
            break
    if world.is_main:   # one line from one rank: two ranks' unbuffered prints would interleave
        print(f"final {step} {model.weight.detach().tolist()}", flush=True)
    run.finish({})


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy script in tmp_path (for subprocesses) and its main() (for in-process runs, cwd = tmp_path)."""
    path = tmp_path / "toy.py"
    path.write_text(TOY)
    spec = importlib.util.spec_from_file_location("toy", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "toy", mod)       # its Options' source is read through its module (cli.py)
    spec.loader.exec_module(mod)
    monkeypatch.chdir(tmp_path)
    mod.path = str(path)
    yield mod
    from nano_rlhf import checkpoint, training
    if training._current is not None:
        training._current.abort()
    checkpoint.RUN_INFO = None


def fails(toy, argv, capsys, code=1):
    """Run toy in-process, expecting a one-line error; returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        toy.main(argv)
    assert e.value.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def final_weights(out):
    return [ln for ln in out.splitlines() if ln.startswith("final")][-1].split(" ", 2)[2]


# ---- a normal run, stop_at and resume --------------------------------------------------------------

def test_end_of_step_logs_evaluates_saves_and_records_identity(toy, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n')
    toy.main(["--data", str(data), "--save_interval", "4"])
    out = capsys.readouterr().out
    assert "step 2/6 | loss" in out and "eval_loss 1.5" in out and "eta" in out
    rows = [json.loads(ln) for ln in open("out/toy/metrics.jsonl")]
    assert [r["step"] for r in rows] == [2, 3, 4, 6]                    # log every 2, eval at 3, last step 6
    assert [r["step"] for r in rows if "eval/loss" in r] == [3, 6]
    samples = [json.loads(ln) for ln in open("out/toy/samples.jsonl")]
    assert samples == [{"step": 2, "prompt": "p|q", "completion": "c", "score": 1.0}]
    rec = json.load(open("out/toy/state/run.json"))
    from nano_rlhf.cli import CHANGEABLE
    options = {f.name for f in dataclasses.fields(toy.Options)}
    assert set(rec["identity"]) == {"script", "global_batch"} | (options - CHANGEABLE)   # every option but those
    assert rec["identity"]["lr"] == 0.1 and rec["identity"]["global_batch"] == 2 and "out_dir" not in rec["identity"]
    assert rec["data_sha256"]["data"] == __import__("hashlib").sha256(data.read_bytes()).hexdigest()
    assert rec["step"] == 6 and rec["world_size"] == 1
    assert not os.path.exists("out/toy/.lock")                          # released by finish()


def test_stop_at_then_resume_matches_an_uninterrupted_run(toy, capsys):
    toy.main(["--out_dir", "full"])
    full = final_weights(capsys.readouterr().out)
    toy.main(["--out_dir", "split", "--stop_at", "3"])
    out = capsys.readouterr().out
    assert "stopping at step 3 (--stop_at); continue with --resume" in out and "final 3" in out
    with open("split/metrics.jsonl", "a") as f:            # logged after the checkpoint by a run that then died
        f.write('{"step": 4, "train/loss": 9.0}\n{"step": 5, "tra')
    toy.main(["--out_dir", "split", "--resume"])
    assert final_weights(capsys.readouterr().out) == full
    steps = [json.loads(ln)["step"] for ln in open("split/metrics.jsonl")]
    assert steps == [2, 3, 4, 6]                           # the stale step-4 line and the cut line are gone


def test_resume_refuses_a_different_run_naming_the_fields(toy, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n')
    toy.main(["--data", str(data), "--stop_at", "2"])
    data.write_text('{"text": "b"}\n')
    err = fails(toy, ["--data", str(data), "--resume", "--lr", "0.2"], capsys)
    assert err == ("error: --resume: out/toy was saved by a different run (saved != now): lr 0.1 != 0.2; "
                   "data sha256 differs (data.jsonl)")
    err = fails(toy, ["--resume", "--batch_size", "4"], capsys)
    assert "global_batch 2 != 4" in err and "data sha256 differs (data)" in err


def test_resume_refuses_an_input_whose_files_changed_and_names_it(toy, tmp_path, capsys):
    """Every input's files are hashed at start (checkpoint.input_sha256) into run.json: a model replaced at the
    same path is refused by --resume, in the plumbing every script shares; a run's logs beside it are not the
    model; a state saved before inputs were hashed resumes with a note."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    toy.main(["--init", str(model), "--stop_at", "2"])
    rec = json.load(open("out/toy/state/run.json"))
    assert set(rec["inputs_sha256"]) == {"init"}
    (model / "metrics.jsonl").write_text("{}\n")            # not a file of the model
    toy.main(["--init", str(model), "--resume", "--stop_at", "3"])
    assert "final 3" in capsys.readouterr().out
    (model / "model.safetensors").write_bytes(b"weightz")   # same size, another model
    err = fails(toy, ["--init", str(model), "--resume"], capsys)
    assert err == (f"error: --resume: the input --init {model} changed since out/toy was saved (sha256 of its files "
                   "differs): the run would go on against another model; restore it or start a new run")
    err = fails(toy, ["--init", str(model), "--resume", "--lr", "0.2"], capsys)
    assert err.endswith(f"lr 0.1 != 0.2; input --init {model} changed (sha256)")
    del rec["inputs_sha256"]                               # a state without input checksums is malformed
    with open("out/toy/state/run.json", "w") as f:
        json.dump(rec, f)
    err = fails(toy, ["--init", str(model), "--resume"], capsys)
    assert err.startswith("error: --resume: out/toy/state/run.json: malformed (KeyError: 'inputs_sha256')"), err


def test_resume_allows_the_changeable_options_and_the_same_global_batch(toy, capsys):
    toy.main(["--stop_at", "2"])
    toy.main(["--resume", "--max_steps", "4", "--log_interval", "1", "--eval_interval", "0", "--stop_at", "3",
              "--dist_timeout", "1"])
    assert "final 3" in capsys.readouterr().out
    toy.main(["--resume", "--batch_size", "1", "--grad_accum", "2"])       # global batch still 2
    assert "final 6" in capsys.readouterr().out


def test_resume_without_run_json_or_with_a_corrupt_file_is_one_line(toy, capsys):
    toy.main(["--stop_at", "2"])
    os.remove("out/toy/state/rng_rank0.safetensors")
    err = fails(toy, ["--resume"], capsys)
    assert err == "error: --resume: out/toy/state/rng_rank0.safetensors: missing; the saved state is incomplete"
    with open("out/toy/state/run.json", "w") as f:
        f.write("{")
    err = fails(toy, ["--resume"], capsys)
    assert err.startswith("error: --resume: out/toy/state/run.json: unreadable or corrupt")
    os.remove("out/toy/state/run.json")
    err = fails(toy, ["--resume"], capsys)
    assert err.startswith("error: --resume: out/toy/state/run.json: missing")


@pytest.mark.slow
def test_world_size_change_with_the_same_global_batch_resumes(toy, tmp_path):
    """Saved by 1 process (batch 2), resumed by 2 ranks of batch 1: allowed, RNG streams restart."""
    run([toy.path, "--out_dir", str(tmp_path / "o"), "--stop_at", "3"], cwd=str(tmp_path))
    p = run([toy.path, "--out_dir", str(tmp_path / "o"), "--resume", "--batch_size", "1"], nproc=2,
            cwd=str(tmp_path))
    assert "note: resuming with 2 ranks from a state saved with 1: RNG streams restart" in p.stdout
    assert "final 6" in p.stdout
    assert json.load(open(tmp_path / "o" / "state" / "run.json"))["world_size"] == 2


@pytest.mark.slow
def test_a_damaged_state_file_of_one_rank_stops_every_rank_with_its_line(toy, tmp_path):
    """Under torchrun, rank 1's RNG file truncated: each rank reads only its own, so only rank 1 finds it; the
    ranks share their problems and both stop with rank 1's line. Before, rank 1 exited alone and rank 0 died
    in its next all-reduce with a gloo traceback ('Connection closed by peer')."""
    out = str(tmp_path / "o")
    run([toy.path, "--out_dir", out, "--stop_at", "2", "--batch_size", "1"], nproc=2, cwd=str(tmp_path))
    rng1 = tmp_path / "o" / "state" / "rng_rank1.safetensors"
    rng1.write_bytes(rng1.read_bytes()[:20])
    p = run([toy.path, "--out_dir", out, "--resume", "--batch_size", "1"], nproc=2, cwd=str(tmp_path), check=False)
    assert p.returncode != 0
    line = f"error: --resume: {rng1}: unreadable or corrupt ("
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("error:")] == [ln for ln in p.stderr.splitlines()
                                                                              if ln.startswith(line)] != [], p.stderr
    assert p.stderr.count(line) == 2, p.stderr
    assert "[rank0]" not in p.stderr and "[rank1]" not in p.stderr and "Connection closed" not in p.stderr, p.stderr
    assert "final" not in p.stdout


# ---- out_dir safety --------------------------------------------------------------------------------

def test_out_dir_equal_to_or_inside_an_input_is_refused(toy, tmp_path, capsys):
    os.makedirs("model")
    open("model/config.json", "w").close()
    assert fails(toy, ["--init", "model", "--out_dir", "model"], capsys) == (
        "error: --out_dir model is, or is inside, the input --init model; choose another --out_dir")
    assert "--out_dir model/sub is, or is inside, the input --init model" in fails(
        toy, ["--init", "model", "--out_dir", "model/sub"], capsys)
    assert "is, or is inside" in fails(toy, ["--init", str(tmp_path / "model"), "--out_dir", "./model/"], capsys)
    assert os.listdir("model") == ["config.json"]                 # the input is never touched


def tree(d):
    return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(d) for f in fs if f != ".lock"}


@pytest.mark.parametrize("failure", [["--fail_at", "1"], ["--nan_at", "1"]])
def test_overwrite_that_fails_before_saving_keeps_the_previous_run(toy, capsys, failure):
    """--overwrite sets the previous run aside; a run that fails before its first save (a crash, a NaN loss, a
    bad input found after start-up) puts it back byte for byte."""
    toy.main(["--save_interval", "2"])
    before = tree("out/toy")
    with pytest.raises((SystemExit, RuntimeError)):
        toy.main(["--overwrite", "--save_interval", "2", *failure])
    from nano_rlhf import training
    if training._current is not None:
        training._current.abort()            # what the process's exit does (atexit)
    assert tree("out/toy") == before
    assert not [n for n in os.listdir("out/toy") if n.startswith(".overwritten")]


def test_an_input_file_that_overwrite_would_replace_is_refused(toy, capsys):
    toy.main([])
    before = tree("out/toy")
    msg = fails(toy, ["--init", "out/toy/tokenizer.json", "--overwrite"], capsys)
    assert msg.startswith("error: --init out/toy/tokenizer.json is a file of the run in --out_dir out/toy")
    assert tree("out/toy") == before


def test_non_empty_out_dir_needs_resume_or_overwrite(toy, capsys):
    toy.main([])
    os.makedirs("out/toy/keep")
    open("out/toy/notes.txt", "w").close()
    assert fails(toy, [], capsys) == ("error: --out_dir out/toy already holds a run (metrics.jsonl, samples.jsonl, "
                                      "state, tokenizer.json); pass --resume to continue it or --overwrite to "
                                      "replace it")
    assert "contradict" in fails(toy, ["--resume", "--overwrite"], capsys, code=2)      # a bad command line
    toy.main(["--overwrite", "--max_steps", "2"])
    assert "are replaced at this run's first save" in capsys.readouterr().out
    assert [json.loads(ln)["step"] for ln in open("out/toy/metrics.jsonl")] == [2]
    assert not [n for n in os.listdir("out/toy") if n.startswith(".overwritten")]     # dropped at the save
    assert os.path.exists("out/toy/notes.txt") and os.path.isdir("out/toy/keep")   # not ours: kept
    # a directory holding only files this project does not write is not a run
    os.makedirs("other")
    open("other/notes.txt", "w").close()
    toy.main(["--out_dir", "other", "--max_steps", "1"])
    assert fails(toy, ["--out_dir", "empty", "--resume"], capsys) == (
        "error: --resume: empty has no saved state to resume from (no empty/state/meta.json)")


def test_unwritable_out_dir_is_one_line_before_any_work(toy, capsys):
    open("a_file", "w").close()
    err = fails(toy, ["--out_dir", "a_file/sub"], capsys)
    assert err == "error: --out_dir a_file/sub: cannot be created (Not a directory)"
    err = fails(toy, ["--out_dir", "/proc/nano_rlhf_out"], capsys)
    assert err.startswith("error: --out_dir /proc/nano_rlhf_out: cannot be created")
    assert "started" not in capsys.readouterr().out


def test_a_failed_from_scratch_run_leaves_nothing_behind(toy, tmp_path, capsys):
    p = run([toy.path, "--out_dir", "new/deep/out", "--fail_at", "1"], cwd=str(tmp_path), check=False)
    assert p.returncode != 0 and "boom" in p.stderr
    assert not os.path.exists(tmp_path / "new")                   # every directory it created is gone
    os.makedirs("existing")
    open("existing/notes.txt", "w").close()
    err = fails(toy, ["--out_dir", "existing", "--nan_at", "1"], capsys)
    assert err.startswith("error: non-finite loss (nan) at step 1; stopping")
    assert os.listdir("existing") == ["notes.txt"]                # tokenizer.json, metrics, lock removed
    # after a save the run is kept: the checkpoint is what --resume needs
    err = fails(toy, ["--out_dir", "saved", "--save_interval", "2", "--nan_at", "3"], capsys)
    assert os.path.isfile("saved/state/meta.json") and not os.path.exists("saved/.lock")


# ---- the lock --------------------------------------------------------------------------------------

def test_second_run_on_the_same_out_dir_is_refused_while_the_first_holds_it(toy, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    first = subprocess.Popen([sys.executable, toy.path, "--sleep", "30"], cwd=str(tmp_path), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "started"       # it holds the lock now
        p = run([toy.path], cwd=str(tmp_path), check=False)
        assert p.returncode == 1
        assert p.stderr == (f"error: out/toy is in use by another run (pid {first.pid}); wait for it to end or "
                            "choose another --out_dir\n")
        assert os.path.isfile(tmp_path / "out" / "toy" / ".lock")   # the loser did not touch the holder's lock
    finally:
        first.kill()
        first.wait()
    # the holder died without releasing: the lock is stale and the next run takes it over
    p = run([toy.path, "--overwrite"], cwd=str(tmp_path))
    assert f"note: taking over the stale lock out/toy/.lock (pid {first.pid} is not running)" in p.stdout


# ---- report_to ---------------------------------------------------------------------------------------

def test_missing_report_to_package_is_one_line_at_start(toy, monkeypatch, capsys):
    import importlib
    real = importlib.import_module

    def no_backends(name, *a, **k):     # the start-up probe imports the backend by name
        if name in ("torch.utils.tensorboard", "wandb"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)
    monkeypatch.setattr(importlib, "import_module", no_backends)
    assert fails(toy, ["--report_to", "tensorboard"], capsys) == (
        "error: --report_to tensorboard needs the tensorboard package: pip install tensorboard")
    assert fails(toy, ["--report_to", "wandb"], capsys) == (
        "error: --report_to wandb needs the wandb package: pip install wandb")
    assert not os.path.exists("out")


def test_report_to_tensorboard_writes_events(toy, capsys):
    pytest.importorskip("tensorboard")
    toy.main(["--report_to", "tensorboard"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    files = os.listdir("out/toy/tensorboard")
    assert files and files[0].startswith("events.out.tfevents")
    ev = EventAccumulator("out/toy/tensorboard", size_guidance={"scalars": 0, "tensors": 0})
    ev.Reload()
    assert [s.step for s in ev.Scalars("train/loss")] == [2, 3, 4, 6]
    assert [s.value for s in ev.Scalars("eval/loss")] == [1.5, 1.5]
    assert "samples/text_summary" in ev.Tags()["tensors"]


def test_report_to_wandb_mirrors_metrics_and_samples(toy, monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda d, step: calls.append(("log", step, d))
    fake.finish = lambda: calls.append(("finish",))
    fake.Table = lambda columns, data: ("table", columns, data)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    toy.main(["--report_to", "wandb", "--max_steps", "2", "--out_dir", "runs/my_run"])
    assert calls[0][0] == "init" and calls[0][1]["project"] == "nano_rlhf" and calls[0][1]["name"] == "my_run"
    assert calls[0][1]["config"]["lr"] == 0.1
    assert ("log", 2, {"samples": ("table", ["prompt", "completion", "score"], [["p|q", "c", 1.0]])}) in calls
    logged = [c for c in calls if c[0] == "log" and "train/loss" in c[2]]
    assert [c[1] for c in logged] == [2] and set(logged[0][2]) == {"train/loss", "eval/loss"}
    assert calls[-1] == ("finish",)


def test_start_checks_run_on_rank_0_and_every_rank_stops(toy, tmp_path):
    """Under torchrun a refused out_dir stops both ranks with the same line (no hang at a barrier)."""
    os.makedirs(tmp_path / "model")
    t0 = time.time()
    p = run([toy.path, "--init", "model", "--out_dir", "model"], nproc=2, cwd=str(tmp_path), check=False)
    assert p.returncode != 0 and time.time() - t0 < 120
    assert p.stderr.count("error: --out_dir model is, or is inside, the input --init model") == 2
    assert "started" not in p.stdout


# ---- one identity rule for every script -------------------------------------------------------------------

def test_an_option_added_to_a_script_is_refused_when_changed_on_resume(tmp_path, sft_dir, monkeypatch, capfd):
    """Every option is the run's identity unless nano_rlhf/cli.py declares it changeable: an option a script
    gains later (here a dummy on train_sft.py's Options) is compared by --resume without anyone listing it."""
    import train_sft
    from conftest import write_jsonl

    @dataclasses.dataclass
    class WithDummy(train_sft.Options):
        dummy: int = 0                # a new option of the script
    monkeypatch.setattr(train_sft, "Options", WithDummy)
    data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "write a review.", "completion": " great phone."}] * 16)
    args = ["--init", sft_dir, "--data", data, "--out_dir", str(tmp_path / "o"), "--max_steps", "2", "--batch_size",
            "4", "--eval_interval", "0", "--warmup_steps", "0"]
    train_sft.main(args + ["--stop_at", "1"])
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        train_sft.main(args + ["--resume", "--dummy", "1"])
    err = capfd.readouterr().err
    assert e.value.code != 0 and err.count("\n") == 1 and "dummy 0 != 1" in err, err
    train_sft.main(args + ["--resume", "--log_interval", "5"])       # a changeable option may differ


def test_an_edited_reward_file_is_refused_on_resume(tmp_path, sft_dir, capfd):
    """A --reward file.py:function is hashed like a model input: edited between stop and resume, the run is
    another run."""
    import train_ppo
    from conftest import prompt_rows, write_jsonl
    reward = tmp_path / "my_reward.py"
    reward.write_text("def score(prompts, completions):\n    return [float(len(c)) for c in completions]\n")
    prompts = write_jsonl(tmp_path / "p.jsonl", prompt_rows(16))
    args = ["--advantage", "grpo", "--reward", f"{reward}:score", "--init", sft_dir, "--prompts", prompts,
            "--eval_prompts", prompts, "--out_dir", str(tmp_path / "o"), "--max_steps", "2", "--batch_size", "2",
            "--samples_per_prompt", "2", "--max_new_tokens", "4", "--eval_interval", "0"]
    train_ppo.main(args + ["--stop_at", "1"])
    reward.write_text("def score(prompts, completions):\n    return [-float(len(c)) for c in completions]\n")
    capfd.readouterr()
    with pytest.raises(SystemExit):
        train_ppo.main(args + ["--resume"])
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"--reward {reward}" in err and "changed" in err, err


def test_a_model_with_a_non_finite_weight_is_never_saved(tmp_path, capsys):
    """run.save refuses a model holding a NaN or an infinity before it writes anything: one line naming the model
    and the step; the previous checkpoint stays."""
    model = tiny_model()
    opts = types.SimpleNamespace(out_dir=str(tmp_path / "o"))
    opt = torch.optim.AdamW(model.parameters())
    training.Run.save(opts, 1, {"policy": model}, {"policy": opt})
    before = sorted(os.listdir(tmp_path / "o" / "state"))
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(SystemExit) as e:
        training.Run.save(opts, 2, {"policy": model}, {"policy": opt})
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error: step 2: the policy model holds non-finite weights"), err
    assert sorted(os.listdir(tmp_path / "o" / "state")) == before
    assert json.load(open(tmp_path / "o" / "state" / "meta.json"))["step"] == 1


def test_a_full_disk_during_a_save_is_one_line_and_leaves_the_last_checkpoint(toy, capsys, monkeypatch):
    """A checkpoint write that fails (ENOSPC here, at step 2 after step 1 was saved) is one line naming the step
    and the checkpoint that is kept, not an OSError stack; nothing half-written stays (state.tmp/, a FILE.tmpPID
    of a model directory's atomic write), and --resume goes on from step 1."""
    import errno
    from nano_rlhf import checkpoint
    real, calls = checkpoint.save_file, []

    def full_at_step_2(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) > 3:              # step 1 wrote model, optimizer and RNG; step 2 runs out of space
            open(os.path.join("out/toy", f"model.safetensors.tmp{os.getpid()}"), "w").write("half")
            real(tensors, path, *a, **k)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path, *a, **k)
    monkeypatch.setattr(checkpoint, "save_file", full_at_step_2)
    assert fails(toy, ["--save_interval", "1", "--max_steps", "3"], capsys) == (
        "error: step 2: writing the checkpoint to out/toy failed (No space left on device); the last complete "
        "checkpoint is step 1: free space and continue with --resume")
    assert not [n for n in os.listdir("out/toy") if n.startswith("state.") or ".tmp" in n], os.listdir("out/toy")
    assert json.load(open("out/toy/state/meta.json"))["step"] == 1
    monkeypatch.setattr(checkpoint, "save_file", real)
    toy.main(["--save_interval", "1", "--max_steps", "3", "--resume"])
    assert json.load(open("out/toy/state/meta.json"))["step"] == 3


def test_resume_after_an_overwrite_killed_before_its_first_save_names_the_set_aside_run(toy, tmp_path, capsys):
    """An --overwrite run set the previous run aside in out_dir/.overwritten.* and was killed (SIGTERM) before
    its first save: --resume finds no state, and says where the previous run is and how to get it back; done,
    that run resumes."""
    import signal
    toy.main(["--save_interval", "2", "--max_steps", "2"])
    env = dict(os.environ, PYTHONPATH=ROOT)
    second = subprocess.Popen([sys.executable, toy.path, "--overwrite", "--sleep", "30"], cwd=str(tmp_path), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "started" in [second.stdout.readline().strip() for _ in range(2)]    # after its --overwrite note
        second.send_signal(signal.SIGTERM)
    finally:
        second.wait()
    (aside,) = [n for n in os.listdir("out/toy") if n.startswith(".overwritten.")]
    assert fails(toy, ["--resume", "--max_steps", "3"], capsys) == (
        f"error: --resume: out/toy has no saved state to resume from (no out/toy/state/meta.json); out/toy/{aside} "
        "holds the run that an --overwrite run set aside and was killed before its first save: to resume that run, "
        f"move its files back (mv out/toy/{aside}/* out/toy/ && rmdir out/toy/{aside})")
    subprocess.run(f"mv out/toy/{aside}/* out/toy/ && rmdir out/toy/{aside}", shell=True, check=True)
    toy.main(["--resume", "--max_steps", "3"])
    assert json.load(open("out/toy/state/meta.json"))["step"] == 3


def test_a_module_that_moved_is_refused_with_its_new_name(tmp_path, sft_dir, rm_dir, capsys):
    """The tasks moved into nano_rlhf/tasks/ and run.py became training.py, with nothing left at the old
    addresses: a spec that names an old module is one line giving the new one, and so is --resume of a run
    recorded before the move (its state/run.json names the old module: rewritten here as such a run wrote it)."""
    import train_ppo
    from conftest import one_line_error
    from test_rlvr import grpo
    args = grpo(tmp_path, sft_dir, rm_dir, "run", "--reward", "nano_rlhf.tasks.reasoning:reward", steps=1)
    old = [a.replace("nano_rlhf.tasks.reasoning", "nano_rlhf.reasoning") for a in args]
    err = one_line_error(capsys, lambda: train_ppo.main(old), "--reward nano_rlhf.reasoning:reward: ")
    assert "nano_rlhf.reasoning is now nano_rlhf.tasks.reasoning: --reward nano_rlhf.tasks.reasoning:reward" in err
    assert not (tmp_path / "run").exists()
    train_ppo.main(args)
    record = tmp_path / "run" / "state" / "run.json"
    saved = json.loads(record.read_text())
    assert saved["identity"]["reward"] == "nano_rlhf.tasks.reasoning:reward"
    saved["identity"]["reward"] = "nano_rlhf.reasoning:reward"          # what the run recorded before the move
    record.write_text(json.dumps(saved))
    err = one_line_error(capsys, lambda: train_ppo.main(args + ["--resume"]), f"--resume: {tmp_path / 'run'} was "
                         "saved with --reward nano_rlhf.reasoning:reward, and nano_rlhf.reasoning is now "
                         "nano_rlhf.tasks.reasoning")
    assert err.endswith("start a new one with --reward nano_rlhf.tasks.reasoning:reward")
