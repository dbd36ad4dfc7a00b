"""The verifiable reasoning task (nano_rlhf/reasoning.py): the verifier on hand-written correct, wrong and malformed
answers, the prompt read back, imperfect demonstrations in their stated shares, seeded files with held-out
problems, the CLI."""
import json
import random
from collections import Counter

import pytest

from conftest import run
from nano_rlhf import reasoning
from nano_rlhf.reward import load_function

P = "Compute 7 + 5 * 3 - 4.\nSolution:"        # = 18

VERIFIER_CASES = [  # (prompt, completion, reward)
    (P, " 5 * 3 = 15. 7 + 15 = 22. 22 - 4 = 18. Answer: 18", 1.0),
    (P, " 5 * 3 = 15, 7 + 15 = 22, 22 - 4 = 18, so the answer is 18.", 1.0),
    (P, " The answer is 18.", 1.0),
    (P, " **Answer:** 18", 1.0),
    (P, " answer: 18.0", 1.0),                              # the same number
    (P, " Answer: 18 apples", 1.0),
    (P, " Answer: 18. Answer: 18", 1.0),                    # repeated, not contradicting
    (P, " 5 * 3 = 15. 7 + 15 = 23. 23 - 4 = 19. Answer: 19", 0.0),   # a slip carried forward
    (P, " Answer: 17", 0.0),
    (P, " Answer: 180", 0.0),                               # no prefix match on digits
    (P, " Answer: 18.5", 0.0),
    (P, " Answer: -18", 0.0),
    (P, " Answer: 17. Answer: 18", 0.0),                    # a hedge is no answer
    (P, " 5 * 3 = 15. 7 + 15 = 22. 22 - 4 = 18.", 0.0),    # no answer statement
    (P, " 18", 0.0),
    (P, "", 0.0),
    (P, " Answer:", 0.0),
    (P, " Answer: eighteen", 0.0),
    (P, None, 0.0),                                         # not a string: 0, no error
    (P, 18, 0.0),
    ("What is 4 - 9?\nSolution:", " Answer: -5", 1.0),      # a user's prompt may go negative
    ("Calculate 3 × 4 + 2.", " the answer is 14", 1.0),
    ("Tell me a joke.", " Answer: 1", 0.0),                 # no expression in the prompt
    (None, " Answer: 1", 0.0),
    ([{"role": "system", "content": "Compute 1 + 1."}, {"role": "user", "content": "What is 2 * 3 + 1?"}],
     " Answer: 7", 1.0),                                    # the last user message
]


@pytest.mark.parametrize("prompt,completion,expected", VERIFIER_CASES)
def test_verifier_on_hand_written_answers(prompt, completion, expected):
    assert reasoning.reward([prompt], [completion]) == [expected]


def test_answer_extraction_and_its_normal_form():
    assert reasoning.answer(" 2 + 2 = 4. Answer: 4") == "4"
    assert reasoning.answer("So the answer is -3.") == "-3"
    assert reasoning.answer("Answer: 04") == "4"
    assert reasoning.answer("Answer: 2.50") == "2.5"
    assert reasoning.answer("Answer: 18.0 and the answer is 18") == "18"
    for bad in ("Answer: 3, the answer is 4.", "no answer here", "", None, 7, ["Answer: 1"]):
        assert reasoning.answer(bad) is None


def test_solve_reads_the_last_expression_with_precedence():
    assert reasoning.solve(P) == 18
    assert reasoning.solve("Compute 2 + 3 * 4 * 2 - 6.") == 20
    assert reasoning.solve("Compute -3 + 4.") == 1
    assert reasoning.solve("Compute 7 - -2.") == 9
    assert reasoning.solve("Step 1 + 1 then what is 9 - 4 * 2?") == 1
    assert reasoning.solve("What is 12?") is None and reasoning.solve(3) is None
    rng = random.Random(0)
    for _ in range(300):                       # every generated problem against Python's own arithmetic
        nums, ops = reasoning.sample_problem(rng, held_out=rng.random() < 0.5)
        expr = reasoning.expression(nums, ops)
        assert reasoning.solve(reasoning.make_prompt(nums, ops, rng.randrange(4))) == eval(expr)
        work, final = reasoning.steps(nums, ops)
        assert final == eval(expr) and len(work) == len(ops) and all(0 <= c <= 99 for *_, c in work)


def test_a_slip_is_carried_forward():
    work, final = reasoning.steps([7, 5, 3, 4], ["+", "*", "-"], slip=(0, 1))
    assert work == [(5, "*", 3, 16), (7, "+", 16, 23), (23, "-", 4, 19)] and final == 19
    work, final = reasoning.steps([7, 5, 3, 4], ["+", "*", "-"], slip=(2, -10))
    assert work[:2] == reasoning.steps([7, 5, 3, 4], ["+", "*", "-"])[0][:2] and final == 8


def test_demonstrations_are_imperfect_in_the_stated_shares():
    rng = random.Random(1)
    n, kinds, steps_right = 4000, Counter(), 0
    for _ in range(n):
        nums, ops = reasoning.sample_problem(rng, False)
        text, kind = reasoning.demonstration(rng, nums, ops, wrong_rate=0.3, malformed_rate=0.1)
        kinds[kind] += 1
        got = reasoning.reward([reasoning.make_prompt(nums, ops)], [text])[0]
        assert got == (kind == "correct"), (text, kind)             # the verifier agrees with the generator
        assert (reasoning.answer(text) is None) == (kind == "malformed")
        if kind == "wrong" and len(ops) > 1:                          # a wrong answer may still show right steps
            first = reasoning.steps(nums, ops)[0][0]
            steps_right += text.startswith(f" {first[0]} {first[1]} {first[2]} = {first[3]}")
    assert abs(kinds["malformed"] / n - 0.1) < 0.02
    assert abs(kinds["wrong"] / (n - kinds["malformed"]) - 0.3) < 0.03
    assert steps_right > 0.3 * kinds["wrong"]


def problems(path):
    rows = [json.loads(x) for x in open(path)]
    return [reasoning._EXPR.findall(r["prompt"])[-1] for r in rows], rows


def test_files_are_seeded_and_hold_out_their_problems(tmp_path):
    for d, seed in (("a", 3), ("b", 3), ("c", 4)):
        reasoning.write_dataset(str(tmp_path / d), seed=seed, n_sft=400, n_prompts=200, n_eval_prompts=64)
    names = ("sft.jsonl", "sft_eval.jsonl", "prompts.jsonl", "eval_prompts.jsonl", "task.json")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(names)     # no temporary file left
    for name in names[:4]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()
    task = json.loads((tmp_path / "a" / "task.json").read_text())
    assert task["counts"] == {"sft.jsonl": 380, "sft_eval.jsonl": 20, "prompts.jsonl": 200, "eval_prompts.jsonl": 64}
    evals, eval_rows = problems(tmp_path / "a" / "eval_prompts.jsonl")
    assert len(set(evals)) == 64 and all(set(r) == {"prompt"} for r in eval_rows)
    for d in ("a", "c"):                         # disjoint from every seed's training problems
        train = set()
        for name in ("sft.jsonl", "sft_eval.jsonl", "prompts.jsonl"):
            train |= set(problems(tmp_path / d / name)[0])
        assert not train & set(evals) and len(train) > 200
    sft = [json.loads(x) for x in open(tmp_path / "a" / "sft.jsonl")]
    assert all(set(r) == {"prompt", "completion"} and r["completion"].startswith(" ") for r in sft)
    assert 0.55 < task["demo_pass_rate"] < 0.85 and sum(task["demonstrations"].values()) == 400
    assert task["demo_pass_rate"] == task["demonstrations"]["correct"] / 400


def test_cli_writes_the_files_and_refuses_bad_flags_in_one_line(tmp_path, capsys):
    out = tmp_path / "r"
    p = run(["-m", "nano_rlhf.reasoning", "--out_dir", str(out), "--n_sft", "50", "--n_prompts", "10",
             "--n_eval_prompts", "5", "--seed", "2"], timeout=120)
    assert "the verifier accepts" in p.stdout
    assert sum(1 for _ in open(out / "eval_prompts.jsonl")) == 5 and sum(1 for _ in open(out / "sft.jsonl")) == 48
    (tmp_path / "file").write_text("x")
    for extra, message in ((["--n_sft", "0"], "--n_sft must be >= 2"), (["--wrong_rate", "1.5"], "--wrong_rate"),
                           (["--malformed_rate", "nan"], "--malformed_rate"), (["--seed", "-1"], "--seed"),
                           (["--n_eval_prompts", "x"], "invalid int"), (["--n_eval_prompts", "5001"], "at most 5000"),
                           (["--out_dir", str(tmp_path / "file")], "is a file")):
        bad = tmp_path / "bad"
        with pytest.raises(SystemExit) as e:
            reasoning.main(["--out_dir", str(bad), *extra])
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code != 0 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
        assert not bad.exists()


def test_verifier_and_answer_hook_load_as_a_reward_module():
    fn = load_function("nano_rlhf.reasoning:reward")
    assert fn([P, P], [" Answer: 18", " Answer: 1"]) == [1.0, 0.0]
