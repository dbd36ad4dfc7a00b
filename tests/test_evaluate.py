"""python -m nano_rlhf.evaluate: columns through the reward interface, one-line errors for bad flags."""
import json

import pytest

from conftest import prompt_rows, run, tiny_model, write_jsonl
from nano_rlhf import evaluate
from nano_rlhf.tasks import synthetic


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(4))


def samples(path):
    return [json.loads(x) for x in open(path)]


def test_columns_follow_the_prompts_and_the_options(tmp_path, sft_dir, rm_dir, prompts):
    """Non-task prompts: no gold column; --reward_model adds rm_score, --reward module:function adds reward."""
    (tmp_path / "user.py").write_text("def n_words(prompts, completions):\n"
                                      "    return [float(len(c.split())) for c in completions]\n")
    out = tmp_path / "s.jsonl"
    rows = evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", str(out), "--max_new_tokens", "6",
                          "--reward_model", rm_dir, "--reward", f"{tmp_path / 'user.py'}:n_words"])
    got = samples(out)
    assert len(got) == 4 and all("gold_reward" not in s for s in got) and "gold_reward" not in rows[0]
    assert all(s["reward"] == len(s["completion"].split()) for s in got)
    assert all(isinstance(s["rm_score"], float) for s in got) and "rm_score" in rows[0] and "reward" in rows[0]


def test_gold_column_only_when_every_prompt_is_the_builtin_task(tmp_path, sft_dir):
    task = write_jsonl(tmp_path / "task.jsonl", [{"prompt": synthetic.make_prompt(p)} for p in ("blender", "kettle")])
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": synthetic.make_prompt("blender")}, {"prompt": "hello"}])
    evaluate.main(["--model", sft_dir, "--prompts", task, "--out", str(tmp_path / "a.jsonl"), "--max_new_tokens", "4"])
    assert all(s["gold_reward"] == synthetic.gold_reward(s["prompt"], s["completion"])
               for s in samples(tmp_path / "a.jsonl"))
    evaluate.main(["--model", sft_dir, "--prompts", mixed, "--out", str(tmp_path / "b.jsonl"), "--max_new_tokens", "4"])
    assert all("gold_reward" not in s for s in samples(tmp_path / "b.jsonl"))


@pytest.mark.parametrize("extra, message", [
    (["--top_p", "0"], "--top_p must satisfy 0 < x <= 1 (got 0.0)"),
    (["--top_p", "1.5"], "--top_p must satisfy 0 < x <= 1"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1"),
    (["--max_new_tokens", "-5"], "--max_new_tokens must be >= 1"),
    (["--samples_per_prompt", "0"], "--samples_per_prompt must be >= 1"),
    (["--device", "tpu"], "--device must be cpu, cuda, cuda:N or auto"),
    (["--top_k", "-1"], "--top_k must be >= 1"),
    (["--batch_size", "0"], "--batch_size must be >= 1"),
    (["--reward", "nocolon"], "--reward must be module:function"),
    (["--seed", str(2 ** 70)], "a seed must be in [0, 2**63)"),
    (["--seed", "-1"], "a seed must be in [0, 2**63)"),
    (["--pass_k", "1"], "--pass_k applies only with --reward; here it would be ignored"),
    (["--pass_threshold", "0.5"], "--pass_threshold applies only with --pass_k; here it would be ignored"),
    (["--reward", "nano_rlhf.tasks.reasoning:reward", "--pass_k", "2"], "--pass_k 2 needs --samples_per_prompt >= 2"),
    (["--model", "a", "b"], "--out applies to one --model; with 2, each writes MODEL/eval_samples.jsonl"),
    (["--reward", "no_such_module_q:f"], "cannot import module"),
])
def test_bad_flags_one_line_nothing_written(tmp_path, sft_dir, prompts, capfd, extra, message):
    """main() in this process (its exit code and the stderr file descriptor): a start-up each would be ~2.5 s;
    test_a_bad_flag_is_one_line_from_the_shell runs one whole process. A bad command line (a range, an option
    that would be ignored, a rule between options) is exit 2, as in every script; a bad input exit 1."""
    out = tmp_path / "s.jsonl"
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", str(out), *extra])
    lines = capfd.readouterr().err.strip().splitlines()
    assert e.value.code == (1 if "cannot import" in message else 2), e.value.code
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not out.exists()


def test_name_with_several_models_is_refused(sft_dir, capsys):
    """--name labels one row: with several models it would be ignored."""
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", sft_dir, sft_dir, "--name", "x"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == ("error: --name applies to one --model; with 2, each row is named after its "
                                         "directory"), err


def test_a_bad_flag_is_one_line_from_the_shell(tmp_path, sft_dir, prompts):
    out = tmp_path / "s.jsonl"
    p = run(["-m", "nano_rlhf.evaluate", "--model", sft_dir, "--prompts", prompts, "--out", str(out), "--top_p", "0"],
            check=False)
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ") and "--top_p" in lines[0], p.stderr
    assert not out.exists()


def test_ref_or_model_with_a_smaller_vocabulary_is_one_line(tmp_path, tok, sft_dir, prompts):
    small = tmp_path / "small"
    tiny_model(None, vocab_size=tok.vocab_size - 10).save_pretrained(str(small))
    tok.save(str(small / "tokenizer.json"))
    for args, where in ((["--model", sft_dir, "--ref", str(small)], str(small)), (["--model", str(small)], str(small))):
        out = tmp_path / "s.jsonl"
        p = run(["-m", "nano_rlhf.evaluate", *args, "--prompts", prompts, "--out", str(out)], check=False)
        lines = p.stderr.strip().splitlines()
        assert p.returncode != 0 and len(lines) == 1 and where in lines[0] and "vocabulary" in lines[0], p.stderr
        assert not out.exists()


@pytest.mark.parametrize("flag", ["--summary", "--out"])
def test_unwritable_output_is_one_line_before_sampling(tmp_path, capsys, flag, monkeypatch):
    """An output path under a regular file (unwritable even for root) stops before any model is loaded."""
    from nano_rlhf import evaluate
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setattr(evaluate.GPT, "from_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", str(tmp_path / "m"), flag, str(blocker / "out.json")])
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


def test_kl_column_and_the_policy_as_its_own_reference(tmp_path, tok, sft_dir, prompts):
    """--ref naming the policy's own directory gives KL 0 without the two extra forwards, the same figure a copy of
    the directory gives through them; a different reference gives the per-sample Σ log π − log π_ref, not 0."""
    import shutil
    copy, other = tmp_path / "copy", tmp_path / "other"
    shutil.copytree(sft_dir, copy)
    tiny_model(tok, seed=5).save_pretrained(str(other))
    tok.save(str(other / "tokenizer.json"))
    args = ["--model", sft_dir, "--prompts", prompts, "--out", str(tmp_path / "s.jsonl"), "--max_new_tokens", "6",
            "--overwrite"]
    own = evaluate.main(args + ["--ref", sft_dir])
    through_copy = evaluate.main(args + ["--ref", str(copy)])
    assert own[0]["kl"] == through_copy[0]["kl"] == 0.0
    far = evaluate.main(args + ["--ref", str(other)])
    assert far[0]["kl"] != 0.0 and all(s["kl"] != 0.0 for s in samples(tmp_path / "s.jsonl"))


def test_response_logprobs_is_train_ppos_contract(tok):
    """evaluate.response_logprobs takes what train_ppo.response_logprobs takes (ids = [left-padded prompt |
    response], response_mask (B, R)) and returns the same (B, R): log π(y_t) at τ, 0 off the mask; both equal a
    full forward's log-softmax gathered at the response tokens."""
    import torch
    import train_ppo
    m = tiny_model(tok, seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, tok.vocab_size, (4, 11), generator=g)
    attn = torch.ones_like(ids)
    attn[1, :3] = 0                                             # left padding of the prompt (P = 6)
    response_mask = torch.ones(4, 5)
    response_mask[0, 2:] = 0
    response_mask[2, 4:] = 0
    attn[:, 6:] = response_mask.long()
    with torch.no_grad():
        got = evaluate.response_logprobs(m, ids, attn, response_mask, 0.7)
        want = train_ppo.response_logprobs(m, ids, attn, response_mask, 0.7)
        full = (m(ids, attn).double() / 0.7).log_softmax(-1)[:, 5:-1].gather(-1, ids[:, 6:, None]).squeeze(-1)
    assert got.shape == (4, 5) and torch.equal(got, want)
    assert (got[response_mask == 0] == 0).all()
    assert torch.allclose(got.double(), full * response_mask, atol=1e-5)


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_lines_in_a_log_and_in_a_terminal():
    """nano_rlhf.training.Progress: in a log, a plain line every log_every seconds and the last at done(); in a
    terminal, one line rewritten in place; the rate and ETA from the clock."""
    import io

    from nano_rlhf.training import Progress
    clock, log = _Clock(), io.StringIO()
    p = Progress(100, "sampling m", stream=log, log_every=10.0, clock=clock)
    clock.t += 5
    p.update(10)                                   # 5 s: not yet
    clock.t += 5
    p.update(10)                                   # 10 s: 20 in 10 s, 2/s, 80 left: 40 s
    p.done()
    assert log.getvalue().splitlines() == ["sampling m | 20/100 samples | 2/s | eta 0m40s"] * 2

    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty = Tty()
    p = Progress(4, "x", stream=tty, every=0.0, clock=clock)
    clock.t += 1
    p.update(2)
    clock.t += 1
    p.update(2)
    p.done()
    assert tty.getvalue() == ("\rx | 2/4 samples | 2/s | eta 0m01s\033[K\rx | 4/4 samples | 2/s | eta 0m00s\033[K"
                              "\rx | 4/4 samples | 2/s | eta 0m00s\033[K\n")


def test_evaluate_shows_sampling_progress_on_stderr(tmp_path, sft_dir, prompts, capsys):
    from nano_rlhf import evaluate
    evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", str(tmp_path / "s.jsonl")])
    captured = capsys.readouterr()
    assert f"sampling {sft_dir} |" in captured.err and "eta " in captured.err and "sampling" not in captured.out


def test_a_full_disk_leaves_no_half_written_output(tmp_path, sft_dir, prompts, capsys, monkeypatch):
    """The disk filling up while --out is written: one error line after the progress lines, no stack, and no
    truncated --out nor temporary file; the previous --out stays whole."""
    import errno
    import os
    out = tmp_path / "s.jsonl"
    out.write_text("the previous samples\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", str(out), "--overwrite",
                       "--max_new_tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and [x for x in err if not x.startswith("sampling ")] == [
        f"error: {out}: cannot be written (No space left on device); nothing was written there"], err
    assert out.read_text() == "the previous samples\n" and sorted(os.listdir(tmp_path)) == ["prompts.jsonl", "s.jsonl"]


def test_a_read_only_model_directory_is_refused_before_sampling(tmp_path, sft_dir, prompts, capsys, monkeypatch):
    """Without --out each model's samples go to MODEL/eval_samples.jsonl: a directory that cannot take it is one
    line before any model is loaded (not after the sampling). os.access is asked, as the check asks it (root
    writes into a mode-555 directory, so the test cannot make one)."""
    import os
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if os.path.realpath(p) == os.path.realpath(sft_dir)
                        else real(p, mode))
    monkeypatch.setattr(evaluate.GPT, "from_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", sft_dir, "--prompts", prompts])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err == (f"error: --model {sft_dir}: not writable, so eval_samples.jsonl cannot be "
                                         "written there; pass --out FILE elsewhere"), err


def test_a_baseline_file_that_is_not_samples_names_the_file_and_line(tmp_path, sft_dir, prompts, capsys):
    bad = tmp_path / "baseline.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\nnot json\n')
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", str(tmp_path / "s.jsonl"), "--baseline",
                       str(bad)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith(f"error: --baseline {bad}:2: not JSON"), err
