"""The verifiable reasoning task (nano_rlhf/tasks/reasoning.py) and pass@k / maj@k in nano_rlhf/evaluate.py: the verifier
on hand-written correct, wrong and malformed answers, the prompt read back, imperfect demonstrations in their
stated shares, seeded files with held-out problems, the CLI, pass@k against a brute-force enumeration of every
k-subset, maj@k on hand-worked cases, and evaluate --pass_k end to end on a tiny model."""
import itertools
import json
import math
import random
from collections import Counter

import pytest

from conftest import run, write_jsonl
from nano_rlhf import evaluate, summary
from nano_rlhf.tasks import common, reasoning
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
    p = run(["-m", "nano_rlhf.tasks.reasoning", "--out_dir", str(out), "--n_sft", "50", "--n_prompts", "10",
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
    fn = load_function("nano_rlhf.tasks.reasoning:reward")
    assert fn([P, P], [" Answer: 18", " Answer: 1"]) == [1.0, 0.0]
    assert fn.module.answer(" Answer: 18") == "18"


# ---- pass@k and maj@k ---------------------------------------------------------------------------

def brute_pass_at_k(n, c, k):
    """Share of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_the_brute_force_enumeration():
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert summary.pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), rel=1e-12, abs=1e-12)
    assert summary.pass_at_k(200, 3, 1) == pytest.approx(3 / 200, rel=1e-12)
    # large n: the product stays accurate where the binomials are astronomically large
    assert summary.pass_at_k(1000, 1, 10) == pytest.approx(0.01, rel=1e-10)
    assert summary.pass_at_k(1000, 0, 500) == 0.0 and summary.pass_at_k(1000, 501, 500) == 1.0
    for bad in ((4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)):
        with pytest.raises(ValueError):
            summary.pass_at_k(*bad)


def test_maj_at_k_on_hand_worked_cases():
    A, B = "18", "17"
    assert summary.maj_at_k([A, A, B], [1, 1, 0], 1) == pytest.approx(2 / 3)
    # k = 2: {A, A} -> A right; {A, B} twice -> a tie, half credit each
    assert summary.maj_at_k([A, A, B], [1, 1, 0], 2) == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert summary.maj_at_k([A, A, B], [1, 1, 0], 3) == 1.0
    assert summary.maj_at_k([B, B, A], [0, 0, 1], 3) == 0.0              # the right answer outvoted
    # unanswered samples do not vote: one right answer beats two blanks
    assert summary.maj_at_k([None, None, A], [0, 0, 1], 3) == 1.0
    assert summary.maj_at_k([None, None], [0, 0], 2) == 0.0
    # pass@k counts any right sample, maj@k only a majority: B, B, C, A with A right
    answers, ok = [B, B, "5", A], [0, 0, 0, 1]
    assert summary.maj_at_k(answers, ok, 4) == 0.0 and summary.pass_at_k(4, 1, 4) == 1.0
    # maj@1 is pass@1 when the verifier agrees with the answers
    assert summary.maj_at_k(answers, ok, 1) == pytest.approx(summary.pass_at_k(4, 1, 1))
    with pytest.raises(ValueError):
        summary.maj_at_k([A, B], [1, 0], 3)


def brute_maj(answers, ok, k):
    """Every k-subset and, within it, every order of breaking a tie at the top (each equally likely)."""
    total = 0.0
    subsets = list(itertools.combinations(range(len(answers)), k))
    for s in subsets:
        votes = Counter(answers[i] for i in s if answers[i] is not None)
        if votes:
            top = max(votes.values())
            winners = [a for a in votes if votes[a] == top]
            total += sum(next(ok[i] for i in range(len(answers)) if answers[i] == w) for w in winners) / len(winners)
    return total / len(subsets)


def test_maj_at_k_against_brute_force_and_its_sampled_estimate():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 8)
        answers = [rng.choice(["1", "2", "3", None]) for _ in range(n)]
        ok = [a == "1" for a in answers]
        for k in range(1, n + 1):
            assert summary.maj_at_k(answers, ok, k) == pytest.approx(brute_maj(answers, ok, k), abs=1e-12)
    answers = [rng.choice("1123") for _ in range(20)]
    ok = [a == "1" for a in answers]
    exact = summary.maj_at_k(answers, ok, 5, max_subsets=math.comb(20, 5))
    sampled = summary.maj_at_k(answers, ok, 5, max_subsets=4000)     # 15504 subsets: sampled
    assert abs(sampled - exact) < 0.03 and sampled == summary.maj_at_k(answers, ok, 5, max_subsets=4000)


# ---- evaluate --pass_k end to end ---------------------------------------------------------------

USER_TASK = '''
def reward(prompts, completions):
    return [float(len(c) % 3 == 0) for c in completions]

def answer(completion):
    return str(len(completion) % 3) if completion else None
'''


def test_evaluate_reports_pass_and_maj_at_k(tmp_path, sft_dir):
    """A tiny model, a toy verifier whose answers are the completion length mod 3: every figure is recomputed from
    the samples written, and the reasoning verifier runs as the reward column."""
    (tmp_path / "toy.py").write_text(USER_TASK)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Compute {i} + 2.\nSolution:"} for i in range(1, 7)])
    out, summary_file = tmp_path / "s.jsonl", tmp_path / "summary.json"
    rows = evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", str(out), "--summary", str(summary_file),
                          "--max_new_tokens", "6", "--samples_per_prompt", "5", "--pass_k", "4,1",
                          "--reward", f"{tmp_path / 'toy.py'}:reward"])
    got = [json.loads(x) for x in open(out)]
    assert len(got) == 30 and all(s["answer"] == (str(len(s["completion"]) % 3) if s["completion"] else None)
                                  for s in got)
    per_prompt = [got[i:i + 5] for i in range(0, 30, 5)]
    assert [s["prompt"] for g in per_prompt for s in g] == [g[0]["prompt"] for g in per_prompt for _ in range(5)]
    for k in (1, 4):
        pk = [brute_pass_at_k(5, sum(s["reward"] for s in g), k) for g in per_prompt]
        mk = [brute_maj([s["answer"] for s in g], [s["reward"] for s in g], k) for g in per_prompt]
        assert rows[0][f"pass@{k}"] == pytest.approx(sum(pk) / 6)
        assert rows[0][f"maj@{k}"] == pytest.approx(sum(mk) / 6)
        assert rows[0][f"pass@{k}_se"] == pytest.approx(common.mean_se(pk)[1])
    assert rows[0]["pass@1"] == pytest.approx(rows[0]["reward"])
    # prompts whose samples all pass or all fail: no group-relative signal
    assert rows[0]["zero_spread"] == sum(len({s["reward"] for s in g}) == 1 for g in per_prompt) / 6
    assert json.loads(summary_file.read_text())[0]["pass@4"] == rows[0]["pass@4"]
    line = summary.format_summary("toy", rows[0])
    assert line.index("pass@1") < line.index("pass@4") < line.index("maj@1") < line.index("maj@4") and " ± " in line
    assert "| pass@1 | pass@4 | maj@1 | maj@4 | answers that parse |" in summary.format_table(rows)
    assert rows[0]["answered"] == sum(s["answer"] is not None for s in got) / 30 and "answered " in line
    # the built-in verifier: a random model answers nothing right, and the figures are there
    rows = evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", str(out), "--max_new_tokens", "4",
                          "--samples_per_prompt", "2", "--pass_k", "2", "--reward", "nano_rlhf.tasks.reasoning:reward",
                          "--overwrite"])
    assert rows[0]["pass@2"] == 0.0 and rows[0]["maj@2"] == 0.0 and rows[0]["zero_spread"] == 1.0
    assert all("answer" in json.loads(x) for x in open(out))


@pytest.mark.parametrize("extra, message", [
    (["--pass_k", "1,8", "--samples_per_prompt", "4"], "--pass_k 8 needs --samples_per_prompt >= 8"),
    (["--pass_k", "2"], "--pass_k 2 needs --samples_per_prompt >= 2 (got 1)"),
    (["--pass_k", "0"], "--pass_k values must be >= 1"),
    (["--pass_k", "1,x"], "--pass_k must be a comma list of integers"),
    (["--pass_k", "1", "--reward", ""], "--pass_k applies only with --reward; here it would be ignored"),
])
def test_bad_pass_k_is_one_line_before_sampling(tmp_path, sft_dir, capsys, monkeypatch, extra, message):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Compute 1 + 2."}])
    out = tmp_path / "s.jsonl"
    monkeypatch.setattr(evaluate.GPT, "from_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    args = ["--reward", "nano_rlhf.tasks.reasoning:reward"] if "--reward" not in extra else []
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", str(out), *args, *extra])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not out.exists()


def test_an_answer_hook_of_the_wrong_type_is_one_line(tmp_path, sft_dir, capsys):
    (tmp_path / "toy.py").write_text("def reward(p, c):\n    return [0.0] * len(c)\n"
                                     "def answer(c):\n    return len(c)\n")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Compute 1 + 2."}])
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", str(tmp_path / "s.jsonl"),
                       "--max_new_tokens", "2", "--pass_k", "1", "--reward", f"{tmp_path / 'toy.py'}:reward"])
    # the sampling's progress line comes first (the hook is read after sampling); the failure is one line, the last
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("sampling ")]
    assert e.value.code != 0 and len(lines) == 1 and "answer must return a string or None, got int" in lines[0]


def test_across_seeds_learns_by_the_one_definition():
    """A variant learns when its mean gain over the baseline exceeds twice the larger of the mean s.e. over prompts
    and the s.d. over seeds / √seeds, and every seed is above the baseline."""
    def seed(sft, a, b):
        return [{"name": "sft", "pass@1": sft, "pass@1_se": 0.02}, {"name": "a", "pass@1": a, "pass@1_se": 0.02},
                {"name": "b", "pass@1": b, "pass@1_se": 0.01}]
    rows = {r["name"]: r for r in summary.across_seeds([seed(0.5, 0.60, 0.56), seed(0.5, 0.62, 0.70),
                                                         seed(0.5, 0.64, 0.49)], "sft")}
    a, b = rows["a"], rows["b"]
    assert a["mean"] == pytest.approx(0.62) and a["sd_seeds"] == pytest.approx(0.02) and a["se_prompts"] == 0.02
    assert a["gain"] == pytest.approx(0.12) and a["learns"]                # 0.12 > 2 x max(0.02, 0.0115)
    assert b["mean"] == pytest.approx(0.5833333) and not b["learns"]       # one seed below the baseline
    assert not rows["sft"]["learns"] and rows["sft"]["gain"] == 0
    noisy = summary.across_seeds([seed(0.5, 0.53, 0.6), seed(0.5, 0.53, 0.6)], "sft")
    assert not noisy[1]["learns"] and noisy[2]["learns"]                   # 0.03 < 2 x 0.02; 0.1 > 2 x 0.01
    table = summary.format_seed_table(list(rows.values()))
    assert "| a | 0.620 ± 0.020 | 0.020 | 3 | +0.120 | yes |" in table


def test_tool_demonstrations_are_an_option_that_leaves_the_tool_free_files_alone(tmp_path):
    """--tool_rate: the same problems and phrasings as conversations offering the calculator (its schema as
    nano_rlhf.tools builds it), that share of the demonstrations calling it — on the whole expression (the tool's
    answer is the value) or on the first step (the rest by hand) — each call's result what the calculator answers,
    each final answer read by the verifier from the last turn; at 0 the tool-free files byte for byte."""
    from nano_rlhf.tools import calculator, json_schema
    assert reasoning.CALCULATOR_SCHEMA == json_schema(calculator)
    kw = dict(seed=1, n_sft=600, n_prompts=50, n_eval_prompts=20)
    reasoning.write_dataset(str(tmp_path / "plain"), **kw)
    reasoning.write_dataset(str(tmp_path / "zero"), **kw, tool_rate=0.0)
    reasoning.write_dataset(str(tmp_path / "tools"), **kw, tool_rate=0.3)
    for name in ("sft.jsonl", "sft_eval.jsonl", "prompts.jsonl", "eval_prompts.jsonl", "task.json"):
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "zero" / name).read_bytes()
    for name in ("prompts.jsonl", "eval_prompts.jsonl"):     # the same prompts, as one user turn
        plain = [json.loads(x)["prompt"] for x in open(tmp_path / "plain" / name)]
        conv = [json.loads(x)["prompt"] for x in open(tmp_path / "tools" / name)]
        assert conv == [[{"role": "user", "content": p}] for p in plain]
    plain = [json.loads(x) for x in open(tmp_path / "plain" / "sft.jsonl")]
    rows = [json.loads(x) for x in open(tmp_path / "tools" / "sft.jsonl")]
    assert [r["messages"][0]["content"] for r in rows] == [r["prompt"] for r in plain]
    assert all(r["tools"] == [reasoning.CALCULATOR_SCHEMA] for r in rows)
    calling = [r for r in rows if len(r["messages"]) > 2]
    assert 0.2 < len(calling) / len(rows) < 0.4
    whole = 0
    for r, p in zip(rows, plain):
        if len(r["messages"]) == 2:              # a tool-free demonstration, unchanged
            assert r["messages"][1] == {"role": "assistant", "content": p["completion"][1:]}
            continue
        user, call, tool, final = r["messages"]
        expr = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert call["content"] == "" and tool == {"role": "tool", "content": calculator(expr)}
        whole += reasoning._EXPR.findall(user["content"])[-1] == expr
        if reasoning._EXPR.findall(user["content"])[-1] == expr:   # the whole expression: its value is the answer
            assert reasoning.answer(final["content"]) == tool["content"]
    assert 0.3 < whole / len(calling) < 0.8      # half whole-expression calls, plus the 2-operand first steps
    task = json.loads((tmp_path / "tools" / "task.json").read_text())
    rows += [json.loads(x) for x in open(tmp_path / "tools" / "sft_eval.jsonl")]
    accepted = reasoning.reward([r["messages"][0]["content"] for r in rows],
                                [r["messages"][-1]["content"] for r in rows])
    assert task["tool_demonstrations"] == sum(len(r["messages"]) > 2 for r in rows)
    assert task["demo_pass_rate"] == sum(accepted) / len(accepted)
