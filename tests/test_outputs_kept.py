"""Nothing already saved is lost, nothing non-finite is taken: an output that would replace an input (the prompts
file, directly or through a symlink; a model directory's weights or a training run's samples) is refused with one
line before any work; every float option of every script and tool refuses nan and ±inf."""
import importlib
import json
import os
import shutil

import pytest

from conftest import SCRIPTS, prompt_rows, write_jsonl
from nano_rlhf import cli, evaluate, label, merge



def one_line_exit(capsys, fn, code=None):
    with pytest.raises(SystemExit) as e:
        fn()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code != 0 and (code is None or e.value.code == code) and len(err) == 1, err
    assert err[0].startswith("error: ")
    return err[0]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_script_float_options_refuse_non_finite(capsys, script, value):
    module = importlib.import_module(script)
    floats = [f.name for f in module.Options.__dataclass_fields__.values() if f.type in (float, "float")]
    assert floats
    means_inf = {k for k, c in cli._field_comments(module.Options).items() if cli.allows_inf(cli.parse_range(c))}
    for name in floats:
        if name in means_inf and value == "inf":      # e.g. --score_clip inf ({0 < x <= inf}): no clipping
            assert cli.parse_args(module.Options, [f"--{name}", value]) is not None
            continue
        msg = one_line_exit(capsys, lambda: cli.parse_args(module.Options, [f"--{name}", value]), code=2)
        assert f"--{name}" in msg and ("finite" in msg or "expected a number" in msg or "must be" in msg or "must satisfy" in msg)


@pytest.mark.parametrize("argv", [["--temperature", "inf"], ["--top_p", "nan"]])
def test_evaluate_float_options_refuse_non_finite(capsys, tmp_path, sft_dir, argv):
    p = write_jsonl(tmp_path / "p.jsonl", prompt_rows(2))
    assert "finite" in one_line_exit(capsys, lambda: evaluate.main(["--model", sft_dir, "--prompts", p, *argv]))


@pytest.mark.parametrize("argv", [["--scale", "inf"], ["--weights", "nan"], ["--density", "nan"]])
def test_merge_float_options_refuse_non_finite(capsys, tmp_path, sft_dir, argv):
    out = tmp_path / "merged"
    msg = one_line_exit(capsys, lambda: merge.main(["--base", sft_dir, "--models", sft_dir, "--method", "ties",
                                                    "--out_dir", str(out), *argv]))
    assert "finite" in msg and not out.exists()


def test_label_threshold_refuses_nan(capsys, tmp_path, sft_dir):
    p = write_jsonl(tmp_path / "p.jsonl", prompt_rows(2))
    msg = one_line_exit(capsys, lambda: label.main(["--model", sft_dir, "--prompts", p, "--out", str(tmp_path / "o"),
                                                    "--judge", "gold", "--threshold", "nan"]))
    assert "finite" in msg


@pytest.fixture
def run_dir(tmp_path, sft_dir):
    """A copy of a model directory that also holds a training run's samples.jsonl."""
    d = tmp_path / "run"
    shutil.copytree(sft_dir, d)
    (d / "samples.jsonl").write_text('{"prompt": "p", "completion": "from training"}\n')
    return d


def snapshot(*dirs_and_files):
    out = {}
    for p in dirs_and_files:
        files = [p] if os.path.isfile(p) else [os.path.join(p, f) for f in sorted(os.listdir(p))]
        out.update({f: open(f, "rb").read() for f in files if os.path.isfile(f)})
    return out


@pytest.mark.parametrize("target", ["prompts", "prompts_link", "weights", "config", "run_samples"])
def test_evaluate_never_writes_over_an_input(capsys, tmp_path, run_dir, target):
    prompts = write_jsonl(tmp_path / "p.jsonl", prompt_rows(2))
    os.symlink(prompts, tmp_path / "link.jsonl")
    out = {"prompts": prompts, "prompts_link": str(tmp_path / "link.jsonl"),
           "weights": str(run_dir / "model.safetensors"), "config": str(run_dir / "config.json"),
           "run_samples": str(run_dir / "samples.jsonl")}[target]
    before = snapshot(str(run_dir), prompts)
    argv = ["--model", str(run_dir), "--prompts", str(tmp_path / "link.jsonl"), "--out", out, "--max_new_tokens", "2"]
    msg = one_line_exit(capsys, lambda: evaluate.main(argv))
    assert "--out" in msg
    assert snapshot(str(run_dir), prompts) == before


def test_evaluate_default_output_keeps_the_runs_samples(tmp_path, run_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", prompt_rows(2))
    before = (run_dir / "samples.jsonl").read_bytes()
    evaluate.main(["--model", str(run_dir), "--prompts", prompts, "--max_new_tokens", "2"])
    assert (run_dir / "samples.jsonl").read_bytes() == before
    assert len((run_dir / evaluate.EVAL_SAMPLES).read_text().splitlines()) == 2


def test_evaluate_replaces_a_named_file_only_with_overwrite(capsys, tmp_path, sft_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", prompt_rows(2))
    for flag in ("--out", "--summary"):
        f = tmp_path / f"kept{flag[2:]}.json"
        f.write_text("mine\n")
        argv = ["--model", sft_dir, "--prompts", prompts, flag, str(f), "--max_new_tokens", "2"]
        msg = one_line_exit(capsys, lambda: evaluate.main(argv))
        assert msg.startswith(f"error: {flag} {f}: exists; pass --overwrite") and f.read_text() == "mine\n"
        evaluate.main(argv + ["--overwrite"])
        assert f.read_text() != "mine\n"
        capsys.readouterr()


@pytest.mark.parametrize("tool", ["evaluate", "label"])
def test_no_tool_writes_into_a_runs_state(capsys, tmp_path, sft_dir, tool):
    """A run's state/ is what --resume reads: no tool output goes there, --overwrite or not."""
    state = tmp_path / "run" / "state"
    state.mkdir(parents=True)
    for name in ("meta.json", "run.json", "rng_rank0.json"):
        (state / name).write_text("{}")
    before = snapshot(str(state))
    prompts = write_jsonl(tmp_path / "p.jsonl", prompt_rows(2))
    out = str(state / "meta.json")
    main = {"evaluate": lambda: evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", out,
                                               "--overwrite", "--max_new_tokens", "2"]),
            "label": lambda: label.main(["--model", sft_dir, "--prompts", prompts, "--out", out, "--overwrite",
                                         "--judge", "gold"])}[tool]
    msg = one_line_exit(capsys, main)
    assert "inside a training run's state directory" in msg and snapshot(str(state)) == before


def test_label_out_through_a_symlink_to_the_prompts_is_refused(capsys, tmp_path, sft_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", prompt_rows(2))
    os.symlink(prompts, tmp_path / "link.jsonl")
    before = open(prompts, "rb").read()
    msg = one_line_exit(capsys, lambda: label.main(["--model", sft_dir, "--prompts", prompts, "--out",
                                                    str(tmp_path / "link.jsonl"), "--overwrite", "--judge", "gold"]))
    assert "--prompts" in msg and open(prompts, "rb").read() == before
    json.loads(before.splitlines()[0])


@pytest.mark.parametrize("bad", [["--data", "missing.jsonl"], ["--init", "no_such_model_dir"]])
def test_overwrite_with_a_bad_input_keeps_the_previous_run(tmp_path, sft_dir, bad):
    """--overwrite used to delete the previous run before the inputs were read: a bad --data or --init then left
    nothing. Now the previous run is back, byte for byte, after the one-line error."""
    from conftest import pref_rows, run
    data = write_jsonl(tmp_path / "pref.jsonl", pref_rows(16))
    args = ["train_dpo.py", "--init", sft_dir, "--data", data, "--out_dir", str(tmp_path / "dpo"), "--max_steps",
            "1", "--batch_size", "4", "--eval_interval", "0", "--log_interval", "1"]
    run(args)
    before = snapshot(str(tmp_path / "dpo"))
    flag, value = bad
    args[args.index(flag) + 1] = str(tmp_path / value)
    p = run(args + ["--overwrite"], check=False)
    assert p.returncode != 0 and p.stderr.strip().splitlines()[-1].startswith("error: ")
    assert snapshot(str(tmp_path / "dpo")) == before
    assert not [n for n in os.listdir(tmp_path / "dpo") if n.startswith(".overwritten")]


def test_user_reward_errors_are_one_line_naming_the_function(tmp_path, capsys):
    from nano_rlhf.reward import load_function
    (tmp_path / "r.py").write_text("def boom(prompts, completions):\n"
                                   "    raise ValueError('bad row ' + prompts[0])\n"
                                   "def huge(prompts, completions):\n"
                                   "    return [10 ** 400 for _ in completions]\n")
    (tmp_path / "broken.py").write_text("x = 1 / 0\ndef f(p, c):\n    return [0.0]\n")
    msg = one_line_exit(capsys, lambda: load_function(f"{tmp_path / 'r.py'}:boom")(["p"], ["c"]))
    assert msg.startswith(f"error: --reward {tmp_path / 'r.py'}:boom raised ValueError: bad row p (at r.py:2 in boom")
    msg = one_line_exit(capsys, lambda: load_function(f"{tmp_path / 'r.py'}:huge")(["p"], ["c"]))
    assert "too large for a float" in msg
    msg = one_line_exit(capsys, lambda: load_function(f"{tmp_path / 'broken.py'}:f", flag="--judge"))
    assert msg.startswith("error: --judge") and "raised ZeroDivisionError: division by zero" in msg


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("device", ["cuda", "tpu"])
def test_a_device_this_machine_lacks_is_one_line(capsys, script, device):
    import torch
    if device == "cuda" and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.device_count()}"      # a GPU machine: one index past its devices
    module = importlib.import_module(script)
    extra = ["--judge", "gold"] if script == "train_online" else []
    msg = one_line_exit(capsys, lambda: module.main(["--device", device, *extra]))
    assert "--device" in msg


@pytest.mark.parametrize("script", SCRIPTS + ["nano_rlhf.label"])
def test_a_seed_outside_64_bits_is_one_line(capsys, script):
    module = importlib.import_module(script)
    msg = one_line_exit(capsys, lambda: cli.parse_args(module.Options, ["--seed", str(2 ** 63)]), code=2)
    assert "--seed" in msg and "2**63" in msg
