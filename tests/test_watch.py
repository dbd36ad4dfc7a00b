"""nano_rlhf/watch.py: the collapse and judge-score warnings of the scripts that train on their own samples."""
import math

import pytest

from nano_rlhf.watch import (COLLAPSE_MIN_LENGTH, COLLAPSE_SHARE, Watch, collapse, mean_sd, response_counts,
                             score_escape, score_moments)


def test_response_counts_counts_empty_and_duplicates_within_groups_only():
    texts = [" a b", "  ", " a b", " c",      # group 1: one empty, one repeat of " a b"
             " c", " d", " e", " f"]          # group 2: " c" is in group 1 only: not a duplicate here
    assert response_counts([2, 0, 2, 1, 1, 1, 1, 1], texts, group_size=4) == [8.0, 9.0, 1.0, 1.0]
    assert response_counts([2, 2], [" x", " x"], group_size=1)[3] == 0.0     # one sample a prompt: no groups


def test_collapse_names_each_rule_at_its_threshold():
    assert collapse([10, 10 * COLLAPSE_MIN_LENGTH, 0, 0]) is None                    # exactly 2 tokens: fine
    assert "average 1.90 tokens" in collapse([10, 19, 0, 0])
    assert collapse([10, 50, 5, 0]) is None and "60% of the responses are empty" in collapse([10, 50, 6, 0])
    assert collapse([10, 50, 0, 6], group_size=1) is None                         # groups not checked
    assert collapse([10, 50, 0, 10 * COLLAPSE_SHARE], group_size=4) is None
    assert "repeat another sample" in collapse([10, 50, 0, 6], group_size=4)
    assert collapse([0, 0, 0, 0]) is None


def test_score_escape_is_n_standard_deviations_from_the_first_step():
    mean, sd = mean_sd(score_moments([1.0, 3.0]))                 # mean 2, population sd 1
    assert (mean, sd) == (2.0, 1.0)
    assert score_escape(5.0, (mean, sd), 3.0) is None             # exactly 3 sd: not yet
    assert "3.1 standard deviations" in score_escape(5.1, (mean, sd), 3.0)
    assert "3.1 standard deviations" in score_escape(-1.1, (mean, sd), 3.0)   # either direction
    assert score_escape(100.0, (mean, sd), 0.0) is None           # off
    assert score_escape(100.0, (mean, 0.0), 3.0) is None          # no spread at the start: no scale


def test_watch_warns_once_per_kind_naming_the_step_and_survives_a_resume():
    w = Watch(3.0)
    ok = [8, 40, 0, 0]
    assert w.check(1, ok, 4, score_moments([0.0, 2.0] * 4)) == []          # the reference: mean 1, sd 1
    assert w.check(2, ok, 4, score_moments([1.5] * 8)) == []
    lines = w.check(3, [8, 8, 6, 0], 4, score_moments([9.0] * 8))
    assert len(lines) == 2 and all(ln.startswith("warning: step 3: ") for ln in lines)
    assert "collapsed" in lines[0] and "8.0 standard deviations" in lines[1]
    assert w.check(4, [8, 8, 6, 0], 4, score_moments([9.0] * 8)) == []      # once
    resumed = Watch(3.0)
    resumed.load_state_dict(w.state_dict())
    assert resumed.reference == (1.0, 1.0) and resumed.check(5, [8, 0, 8, 0], 4, score_moments([9.0])) == []
    fresh = Watch(3.0)
    fresh.load_state_dict(Watch(3.0).state_dict())
    assert fresh.check(1, ok, 4, None) == [] and fresh.reference is None     # no judge score: no reference yet
    assert math.isclose(mean_sd([4.0, 4.0, 4.0])[1], 0.0)


def script_args(script, tmp_path, sft_dir, rm_dir, out, *extra):
    if script == "train_online":
        from test_online import online_args
        return online_args(tmp_path, sft_dir, rm_dir, out, *extra, steps=3)
    from test_ppo import ppo_args
    return ppo_args(tmp_path, sft_dir, rm_dir, out, "--advantage", "grpo", *extra, steps=3)


@pytest.mark.parametrize("script", ["train_online", "train_ppo"])
def test_both_scripts_warn_once_per_run_with_real_counts_and_across_a_resume(script, tmp_path, sft_dir, rm_dir,
                                                                           monkeypatch, capsys):
    """The wiring, with the rules forced to fire: each warning once, naming its step, on stderr; the counts are the
    step's samples (batch x k); the score reference is the first step's; a resumed run does not warn again."""
    import importlib

    from nano_rlhf import watch
    main = importlib.import_module(script).main
    seen = []
    monkeypatch.setattr(watch, "collapse", lambda counts, k: seen.append((list(counts), k)) or "forced")
    monkeypatch.setattr(watch, "score_escape", lambda mean, ref, n: "forced score")
    main(script_args(script, tmp_path, sft_dir, rm_dir, "w"))
    err = capsys.readouterr().err
    assert err.count("warning: step 1: the responses collapsed: forced") == 1
    assert err.count("warning: step 2: forced score") == 1 and err.count("warning:") == 2
    k = 3 if script == "train_online" else 4
    assert [c[0] for c, _ in seen] == [4.0 * k] * 3 and {g for _, g in seen} == {k}
    assert all(0 < c[1] <= 4 * k * 12 for c, _ in seen)                  # Σ length: at most max_new_tokens each
    main(script_args(script, tmp_path, sft_dir, rm_dir, "r", "--stop_at", "2"))
    assert capsys.readouterr().err.count("warning:") == 2
    main(script_args(script, tmp_path, sft_dir, rm_dir, "r", "--resume"))
    assert "warning:" not in capsys.readouterr().err


def test_no_signal_counts_flat_groups_and_flat_steps():
    from nano_rlhf.watch import FLAT_STEPS, flat_groups, no_signal
    assert flat_groups([0, 0, 1, 0, 2, 2], 2) == [3.0, 2.0] and flat_groups([1, 2], 1) == [0.0, 0.0]
    assert no_signal(score_moments([0, 0, 1, 1]), [2.0, 2.0], 2)                # every group flat
    assert not no_signal(score_moments([0, 0, 1, 0]), [2.0, 1.0], 2)
    assert no_signal(score_moments([0.5] * 8), [0.0, 0.0], 1)                   # one sample a prompt: all equal
    assert not no_signal(score_moments([0.5] * 7 + [0.6]), [0.0, 0.0], 1)
    w, flat = Watch(3.0), [4.0, 4.0]
    lines = [w.check(s, [8, 40, 0, 0], 2, score_moments([0.0] * 8), flat) for s in range(1, FLAT_STEPS + 3)]
    assert [len(x) for x in lines] == [0] * (FLAT_STEPS - 1) + [1, 0, 0]          # once, at step FLAT_STEPS
    assert lines[FLAT_STEPS - 1][0].startswith(f"warning: step {FLAT_STEPS}: nothing to learn from")
    w = Watch(3.0)                                       # one step with spread among the first: never
    w.check(1, [8, 40, 0, 0], 2, score_moments([0.0] * 8), flat)
    w.check(2, [8, 40, 0, 0], 2, score_moments([0.0, 1.0] * 4), [4.0, 0.0])
    assert all(w.check(s, [8, 40, 0, 0], 2, score_moments([0.0] * 8), flat) == [] for s in range(3, 9))
    resumed = Watch(3.0)                                 # a resume keeps the count
    w = Watch(3.0)
    for s in range(1, FLAT_STEPS - 1):
        w.check(s, [8, 40, 0, 0], 2, score_moments([0.0] * 8), flat)
    resumed.load_state_dict(w.state_dict())
    assert resumed.check(FLAT_STEPS - 1, [8, 40, 0, 0], 2, score_moments([0.0] * 8), flat) == []
    assert len(resumed.check(FLAT_STEPS, [8, 40, 0, 0], 2, score_moments([0.0] * 8), flat)) == 1


def test_grpo_on_a_reward_that_never_passes_warns_that_it_cannot_learn(tmp_path, sft_dir, rm_dir, capsys):
    """train_ppo end to end: a verifier that scores every answer 0 gives every group zero spread; the warning names
    step 5 once, on stderr."""
    from test_ppo import ppo_args

    import train_ppo
    (tmp_path / "never.py").write_text("def reward(prompts, completions):\n    return [0.0] * len(completions)\n")
    train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "z", "--advantage", "grpo", "--reward",
                            f"{tmp_path / 'never.py'}:reward", "--missing_eos_penalty", "none", steps=6))
    err = capsys.readouterr().err
    assert err.count("warning: step 5: nothing to learn from: in each of the first 5 steps every group's samples "
                     "scored the same") == 1, err


def test_every_response_masked_for_the_first_steps_warns_once_and_survives_a_resume():
    from nano_rlhf.watch import FLAT_STEPS
    w = Watch(3.0)
    lines = [w.check(s, [8, 40, 0, 0], 2, trained=0.0) for s in range(1, FLAT_STEPS + 3)]
    assert [len(x) for x in lines] == [0] * (FLAT_STEPS - 1) + [1, 0, 0]
    assert lines[FLAT_STEPS - 1][0].startswith(f"warning: step {FLAT_STEPS}: nothing to learn from: in each of the "
                                               f"first {FLAT_STEPS} steps every response was masked out")
    w = Watch(3.0)                                       # one step that trained on a token: never
    assert all(w.check(s, [8, 40, 0, 0], 2, trained=0.0 if s != 3 else 5.0) == [] for s in range(1, 9))
    w, resumed = Watch(3.0), Watch(3.0)
    for s in range(1, FLAT_STEPS):
        w.check(s, [8, 40, 0, 0], 2, trained=0.0)
    resumed.load_state_dict(w.state_dict())
    assert len(resumed.check(FLAT_STEPS, [8, 40, 0, 0], 2, trained=0.0)) == 1


def test_grpo_whose_every_response_is_masked_warns_that_it_cannot_learn(tmp_path, sft_dir, rm_dir, capsys):
    """train_ppo end to end: --overlong mask with responses that all run to --max_new_tokens 1 trains on no token;
    the warning names step 5 once."""
    from test_ppo import ppo_args

    import train_ppo
    (tmp_path / "length.py").write_text("def reward(prompts, completions):\n"
                                        "    return [float(len(c)) for c in completions]\n")
    train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "m", "--advantage", "grpo", "--reward",
                            f"{tmp_path / 'length.py'}:reward", "--missing_eos_penalty", "none", "--overlong", "mask",
                            "--max_new_tokens", "1", steps=5))
    err = capsys.readouterr().err
    assert err.count("warning: step 5: nothing to learn from: in each of the first 5 steps every response was masked "
                     "out of the policy loss") == 1, err


@pytest.mark.parametrize("script", ["train_dpo", "train_unpaired", "train_online", "train_ppo"])
def test_a_run_shorter_than_its_warm_up_says_so(script, tmp_path, sft_dir, rm_dir, capsys):
    """--warmup_steps 5 on a 3-step run: the learning rate never reaches --lr, and every trainer says so once at
    start-up (SFT and RM: tests/test_rm.py)."""
    import importlib
    if script == "train_dpo":
        from test_dpo import dpo_args
        args = dpo_args(tmp_path, sft_dir, "w", "dpo", "--warmup_steps", "5")
    elif script == "train_unpaired":
        from test_kto import kto_args
        args = kto_args(tmp_path, sft_dir, "w", "--warmup_steps", "5")
    else:
        args = script_args(script, tmp_path, sft_dir, rm_dir, "w", "--warmup_steps", "5")
    importlib.import_module(script).main(args + ["--stop_at", "1"])
    err = capsys.readouterr().err
    assert err.count("warning: this run is 3 optimizer steps, fewer than --warmup_steps 5, so the learning rate "
                     "never reaches --lr") == 1, err
