"""The judge interface of the online methods: Bradley–Terry preferences from scores, pairwise functions
checked at every call, one-line errors for bad specifications."""
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from nano_rlhf.tasks import synthetic
from nano_rlhf.reward import Judge, bradley_terry, load_judge


def test_bradley_terry_is_the_logistic_of_the_score_difference():
    p = bradley_terry([0.0, 2.0, -1.0], [0.0, 0.0, 3.0])
    want = [0.5, 1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(4.0))]
    assert torch.allclose(p, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(bradley_terry(3.0, 1.0) + bradley_terry(1.0, 3.0), torch.tensor(1.0, dtype=torch.float64))


def test_pointwise_judge_gives_preferences_under_bradley_terry():
    judge = Judge(pointwise=lambda prompts, completions: [float(len(c)) for c in completions])
    p = judge.preference(["q", "q"], ["aaa", "a"], ["a", "a"])
    assert torch.allclose(p, torch.tensor([1 / (1 + math.exp(-2.0)), 0.5], dtype=torch.float64))
    assert judge.scores(["q"], ["ab"]).tolist() == [2.0]


def test_gold_judge_prefers_the_best_completion():
    prompt = synthetic.make_prompt(next(iter(synthetic.PRODUCTS)))
    judge = load_judge("gold", prompts=[prompt])
    best = synthetic.best_completion(prompt)
    assert judge.preference([prompt], [best], [" no."]).item() > 0.5


def _write(tmp_path, body):
    f = tmp_path / "judges.py"
    f.write_text(textwrap.dedent(body))
    return str(f)


def one_line_exit(capfd, fn):
    """(exit code, stderr) of fn(), which must exit: in this process, reading the stderr file descriptor (a
    start-up each would be ~2.5 s; test_pairwise_only_judge_refuses_scores_in_one_line runs a whole process)."""
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        fn()
    assert isinstance(e.value.code, int)
    return e.value.code, capfd.readouterr().err


def test_pairwise_function_is_used_and_checked(tmp_path, capfd):
    path = _write(tmp_path, """
        def prefer(prompts, a, b):
            return [1.0 if len(x) > len(y) else 0.0 for x, y in zip(a, b)]
        def bad_range(prompts, a, b):
            return [1.5 for _ in a]
        def bad_len(prompts, a, b):
            return [0.5]
    """)
    judge = load_judge(pair_spec=f"{path}:prefer")
    assert judge.preference(["q", "q"], ["aa", "a"], ["a", "aa"]).tolist() == [1.0, 0.0]
    for name, msg in [("bad_range", "not a probability"), ("bad_len", "returned 1 probabilities for 2 pairs")]:
        code, err = one_line_exit(capfd, lambda: load_judge(pair_spec=f"{path}:{name}").preference(
            ["q", "q"], ["a", "b"], ["c", "d"]))
        assert code != 0 and msg in err and "--pair_judge" in err
        assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args,msg", [
    ({"pair_spec": "no_such_module_xyz:f"}, "--pair_judge no_such_module_xyz:f: cannot import module"),
    ({"pair_spec": "/nonexistent/dir"}, "--pair_judge /nonexistent/dir: expected module:function"),
    ({}, "a judge is needed"),
], ids=["pair_spec='no_such_module_xyz:f'", "pair_spec='/nonexistent/dir'", ""])
def test_bad_judge_specifications_are_one_line(capfd, args, msg):
    code, err = one_line_exit(capfd, lambda: load_judge(**args))
    assert code != 0 and msg in err
    assert len(err.strip().splitlines()) == 1


def test_pairwise_only_judge_refuses_scores_in_one_line(tmp_path):
    path = _write(tmp_path, "def prefer(prompts, a, b):\n    return [0.5 for _ in a]\n")
    code = f"from nano_rlhf.reward import load_judge; load_judge(pair_spec={path + ':prefer'!r}).scores(['q'], ['a'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "pairwise only" in r.stderr
