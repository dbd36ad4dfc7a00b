"""The verifiable-instruction task (nano_rlhf/tasks/ifeval.py): each constraint's checker on hand-written answers, every
phrasing read back from the prompt text, malformed answers scoring 0 without an error, held-out kinds, phrasings,
task families and topics kept out of training, the loose reading, the report at equal length, and the checker
working as `--reward module:function`."""
import importlib.util
import json
import math
import os
import random

import pytest
from conftest import ROOT

from nano_rlhf.tasks import ifeval
from nano_rlhf.reward import load_function

CASES = [  # (kind, args, answer, met)
    ("max_words", {"n": 5}, "one two three four five", True),
    ("max_words", {"n": 5}, "one two three four five six", False),
    ("max_words", {"n": 5}, "", False),
    ("min_words", {"n": 3}, "one two three", True),
    ("min_words", {"n": 3}, "one two", False),
    ("max_sentences", {"n": 2}, "It rains. It pours!", True),
    ("max_sentences", {"n": 2}, "It rains. It pours! Stay in.", False),
    ("paragraphs", {"n": 2}, "First part.\n\nSecond part.", True),
    ("paragraphs", {"n": 2}, "First part.\nSecond line.", False),
    ("paragraphs_divider", {"n": 3}, "a\n***\nb\n***\nc", True),
    ("paragraphs_divider", {"n": 3}, "a\n\nb\n\nc", False),
    ("include", {"word": "harbor"}, "The Harbor was calm.", True),
    ("include", {"word": "harbor"}, "harbors everywhere", False),
    ("include_two", {"word": "tea", "word2": "moon"}, "Tea under the moon.", True),
    ("include_two", {"word": "tea", "word2": "moon"}, "Tea at noon.", False),
    ("exclude", {"word": "the"}, "A cat sat there.", True),
    ("exclude", {"word": "the"}, "The cat sat.", False),
    ("word_frequency", {"word": "quiet", "n": 2}, "Quiet, so quiet.", True),
    ("word_frequency", {"word": "quiet", "n": 2}, "Quiet and calm.", False),
    ("letter_frequency", {"letter": "z", "n": 3}, "Zig zag zoo", True),
    ("letter_frequency", {"letter": "z", "n": 3}, "Zig zag", False),
    ("lowercase", {}, "all small here.", True),
    ("lowercase", {}, "Not all small.", False),
    ("lowercase", {}, "123 !!", False),
    ("uppercase", {}, "ALL LOUD, 100%.", True),
    ("uppercase", {}, "ALL LOUd", False),
    ("capital_words", {"n": 2}, "This is VERY, VERY good. A b.", True),
    ("capital_words", {"n": 2}, "This is VERY good. I A.", False),         # one-letter words do not count
    ("end_with", {"phrase": "The end."}, "It rained.\nThe end.  ", True),
    ("end_with", {"phrase": "The end."}, "The end. It rained.", False),
    ("quotation", {}, '  "Hello there."\n', True),
    ("quotation", {}, '"Hello" there.', False),
    ("no_comma", {}, "No commas here.", True),
    ("no_comma", {}, "Well, no.", False),
    ("json", {}, '```json\n{"a": [1, 2]}\n```', True),
    ("json", {}, '{"a": 1', False),
    ("bullets", {"n": 3}, "Intro\n* a\n- b\n* c", True),
    ("bullets", {"n": 2}, "*a\n*b", False),                          # a bullet is "* " or "- " then text
    ("title", {}, "<<Tea Time>>\nTea is good.", True),
    ("title", {}, "<Tea Time>\nTea is good.", False),
    ("highlight", {"n": 2}, "It is *very* good and *cheap*.", True),
    ("highlight", {"n": 2}, "It is *very* good.", False),
    ("sections", {"n": 2}, "SECTION 1\nA.\nSECTION 2\nB.", True),
    ("sections", {"n": 2}, "SECTION 1\nA.", False),
    ("options", {}, "My answer is maybe.", True),
    ("options", {}, "I think: My answer is maybe.", False),
    ("postscript", {}, "Dear Ann,\nSee you.\nP.S. Bring tea.", True),
    ("postscript", {}, "See you. PS bring tea.", False),
    ("placeholders", {"n": 2}, "Send it to [name] at [address].", True),
    ("placeholders", {"n": 2}, "Send it to [name].", False),
    ("repeat_request", {"request": "Describe tea."}, "Describe tea. Tea is a drink.", True),
    ("repeat_request", {"request": "Describe tea."}, "Tea is a drink.", False),
    ("two_responses", {}, "Tea is hot.\n******\nTea is brewed.", True),
    ("two_responses", {}, "Tea.\n******\nTea.", False),
    ("start_with", {"word": "Honestly"}, "Honestly, tea is fine.", True),
    ("start_with", {"word": "Honestly"}, "Tea is honestly fine.", False),
    ("no_digits", {}, "Twenty cups.", True),
    ("no_digits", {}, "20 cups.", False),
    ("word_range", {"n": 2, "m": 3}, "Tea is hot", True),
    ("word_range", {"n": 2, "m": 3}, "Tea", False),
    ("numbered_list", {"n": 2}, "1. Tea\n2. Milk", True),
    ("numbered_list", {"n": 2}, "1. Tea\n3. Milk", False),
    ("end_question", {}, "Do you like tea?", True),
    ("end_question", {}, "Do you like tea? I do.", False),
    ("hashtags", {"n": 2}, "Tea time #tea #morning", True),
    ("hashtags", {"n": 2}, "Tea time #tea", False),
]


@pytest.mark.parametrize("kind,args,answer,met", CASES)
def test_each_checker(kind, args, answer, met):
    assert ifeval.check(kind, args, answer) is met


def test_every_kind_has_cases_and_malformed_answers_score_zero():
    assert {c[0] for c in CASES} == set(ifeval.BY_NAME)
    for kind in ifeval.BY_NAME:
        assert ifeval.check(kind, ifeval.BY_NAME[kind].sample(random.Random(0)), None) is False
        assert ifeval.check(kind, {}, "text") in (True, False)          # missing arguments: not an error


def test_every_phrasing_reads_back_alone_and_in_company():
    rng = random.Random(0)
    for kind in ifeval.CONSTRAINTS:
        for i in range(len(kind.phrasings)):
            args = kind.sample(rng)
            text = "Describe tea. " + ifeval.sentence(kind.name, args, i)
            assert ifeval.parse(text) == [(kind.name, {**args, "request": "Describe tea."})]
    for _ in range(300):          # any compatible set, any phrasings, in any order: all read back
        kinds = ifeval._draw_kinds(rng, [k.name for k in ifeval.CONSTRAINTS])
        sent = [(k, ifeval.BY_NAME[k].sample(rng), rng.randrange(len(ifeval.BY_NAME[k].phrasings))) for k in kinds]
        text = "Write a poem about snow. " + " ".join(ifeval.sentence(k, a, i) for k, a, i in sent)
        assert [(k, {x: v for x, v in a.items() if x != "request"}) for k, a in ifeval.parse(text)] == \
            [(k, a) for k, a, _ in sent]


def test_reward_is_the_share_met_strict_all_and_loose_forgives_a_preamble():
    text = ("Tell me about tea. " + ifeval.sentence("lowercase", {}) + " "
            + ifeval.sentence("include", {"word": "silver"}))
    conv = [{"role": "system", "content": 'Include the word "window" in your response.'},
            {"role": "user", "content": text}]
    assert [k for k, _ in ifeval.parse(conv)] == ["lowercase", "include"]      # the last user message only
    answers = ["a silver kettle.", "A silver kettle.", "A kettle.", 7]
    assert ifeval.reward([conv] * 4, answers) == [1.0, 0.5, 0.0, 0.0]
    assert ifeval.strict([conv] * 4, answers) == [1.0, 0.0, 0.0, 0.0]
    assert ifeval.reward(["no constraint here", None], ["x", "y"]) == [0.0, 0.0]
    preamble = "Sure! Here it is:\na silver kettle."
    assert ifeval.strict([conv], [preamble]) == [0.0] and ifeval.loose([conv], [preamble]) == [1.0]
    stars = [{"role": "user", "content": "Describe tea. " + ifeval.sentence("end_with", {"phrase": "The end."})}]
    starred = ["Tea. **The end.**"]
    assert ifeval.strict([stars], starred) == [0.0] and ifeval.loose([stars], starred) == [1.0]


def test_files_hold_out_kinds_phrasings_families_and_topics_and_are_seeded(tmp_path):
    for d in ("a", "b"):
        assert ifeval.write_prompts(str(tmp_path / d), seed=3, n_train=400, n_eval=150) == str(tmp_path / d)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    train = [json.loads(x)["prompt"][0]["content"] for x in open(tmp_path / "a" / "train.jsonl")]
    evals = [json.loads(x)["prompt"][0]["content"] for x in open(tmp_path / "a" / "eval.jsonl")]
    assert len(train) == 400 and len(evals) == 150
    held_fam = [f.split("{}")[0] for f in ifeval.FAMILIES[-ifeval.FAMILIES_HELD_OUT:]]
    held_top = ifeval.TOPICS[-ifeval.TOPICS_HELD_OUT:]
    for p in train:
        req = ifeval.parse(p)[0][1]["request"]
        assert not any(req.startswith(f) for f in held_fam) and not any(t in req for t in held_top)
    for p in evals:
        req = ifeval.parse(p)[0][1]["request"]
        assert any(req.startswith(f) for f in held_fam) and any(t in req for t in held_top)
    kinds = lambda ps: [[k for k, _ in ifeval.parse(p)] for p in ps]
    assert not any(k in ifeval.HELD_OUT for ks in kinds(train) for k in ks)
    assert sum(any(k in ifeval.HELD_OUT for k in ks) for ks in kinds(evals)) == 50
    assert set(ifeval.HELD_OUT) <= {k for ks in kinds(evals) for k in ks}
    assert all(1 <= len(ks) <= 3 and ifeval._compatible(ks) for ks in kinds(train) + kinds(evals))
    last = [ifeval.sentence(k.name, k.sample(random.Random(0)), len(k.phrasings) - 1).split("{")[0][:25]
            for k in ifeval.CONSTRAINTS if not k.held_out]
    assert not any(s in p for s in last for p in train)                         # the last phrasing: eval only
    assert any(s in p for s in last for p in evals)


def test_held_out_kinds_only_gives_every_eval_prompt_one_in_turn_and_the_same_train_file(tmp_path):
    ifeval.main(["--out_dir", str(tmp_path / "mixed"), "--seed", "5", "--n_train", "50", "--n_eval", "12"])
    ifeval.main(["--out_dir", str(tmp_path / "held"), "--seed", "5", "--n_train", "50", "--n_eval", "12",
                 "--held_out_kinds_only"])
    assert (tmp_path / "mixed" / "train.jsonl").read_bytes() == (tmp_path / "held" / "train.jsonl").read_bytes()
    evals = [json.loads(x)["prompt"][0]["content"] for x in open(tmp_path / "held" / "eval.jsonl")]
    kinds = [[k for k, _ in ifeval.parse(p)] for p in evals]
    assert [ks[0] for ks in kinds] == ifeval.HELD_OUT * 2
    assert all(ifeval._compatible(ks) and not set(ks[1:]) & set(ifeval.HELD_OUT) for ks in kinds)
    assert json.load(open(tmp_path / "held" / "task.json"))["held_out_kinds_only"] is True


def test_report_and_equal_length(tmp_path):
    p = [{"role": "user", "content": "Describe snow. " + ifeval.sentence("max_words", {"n": 3})}]
    q = [{"role": "user", "content": "Describe snow. " + ifeval.sentence("start_with", {"word": "Well"})}]
    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)
    # a: every answer passes, half short and half long; b: mostly long answers, which fail, and two short ones
    a = write("a.jsonl", [{"prompt": p, "completion": "cold white", "length": 2, "eos": True}] * 4
              + [{"prompt": q, "completion": "Well, cold snow falls here", "length": 9, "eos": True}] * 4)
    b = write("b.jsonl", [{"prompt": p, "completion": "cold white flakes fall", "length": 9, "eos": False}] * 6
              + [{"prompt": q, "completion": "Well, snow.", "length": 2, "eos": True}] * 2)
    r = ifeval.report(a)
    assert r["all"]["strict"] == 1.0 and r["seen_kinds"]["n"] == 4 and r["held_out_kinds"]["n"] == 4
    assert r["per_kind"] == {"max_words": {"n": 4, "met": 1.0}, "start_with": {"n": 4, "met": 1.0}}
    assert ifeval.report(b)["never_ended"] == 0.75 and ifeval.report(b)["all"]["strict"] == 0.25
    # pooled: 6 short (<= 2 tokens) and 10 long answers; b's accuracy is 1 when short and 0 when long, so at the
    # pooled length mix it is 6/16, not its raw 2/8
    eq = ifeval.equal_length([a, b], bins=4)
    assert eq["edges"] == [2, 9] and eq["dropped_share"] == 0.0
    assert eq["strict"][a] == 1.0 and eq["strict"][b] == pytest.approx(6 / 16)


def test_paired_differences_and_their_standard_error(tmp_path, capsys):
    p = [{"role": "user", "content": "Describe snow. " + ifeval.sentence("max_words", {"n": 3})}]
    q = [{"role": "user", "content": "Describe snow. " + ifeval.sentence("start_with", {"word": "Well"})}]
    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": x, "completion": c}) + "\n" for x, c in rows))
        return str(tmp_path / name)
    ok_p, bad_p, ok_q, bad_q = "cold white", "it is cold and white", "Well, snow.", "Snow."
    base = write("base.jsonl", [(p, bad_p), (p, ok_p), (p, bad_p), (q, bad_q), (q, ok_q)])
    new = write("new.jsonl", [(p, ok_p), (p, ok_p), (p, bad_p), (q, ok_q), (q, bad_q)])
    r = ifeval.paired(base, new)
    # per prompt: +1, 0, 0 on the training kind; +1, -1 on the held-out one
    assert r["seen_kinds"]["diffs"] == [1, 0, 0] and r["held_out_kinds"]["diffs"] == [1, -1]
    assert r["all"]["diff"] == pytest.approx(1 / 5)
    # sample variance of (1, 0, 0, 1, -1) around 0.2 is (0.64 * 2 + 0.04 * 2 + 1.44) / 4 = 0.7
    assert r["all"]["se"] == pytest.approx(math.sqrt(0.7 / 5))
    assert r["held_out_kinds"]["se"] == pytest.approx(math.sqrt(2 / 2))
    ifeval.main(["--report", base, new])
    assert json.loads(capsys.readouterr().out)["paired"][new]["all"] == {"diff": 0.2, "se": r["all"]["se"], "n": 5}
    other = write("other.jsonl", [(q, ok_q)] * 5)
    with pytest.raises(ValueError, match="same prompts"):
        ifeval.paired(base, other)
    with pytest.raises(SystemExit) as e:
        ifeval.main(["--report", base, other])
    assert e.value.code == 2 and "same prompts" in capsys.readouterr().err


def test_table_of_runs_with_the_held_out_kinds_test(tmp_path, capsys):
    """scripts/ifeval_table.py over two seeds' directories, one with MODES held only: the held-out-kinds test's rows
    and its paired line (per-prompt differences averaged over the seeds, then mean ± s.e. over prompts)."""
    spec = importlib.util.spec_from_file_location("ifeval_table", os.path.join(ROOT, "scripts", "ifeval_table.py"))
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    q = [{"role": "user", "content": "Describe snow. " + ifeval.sentence("start_with", {"word": "Well"})}]
    ok, bad = "Well, snow.", "Snow."

    def run(name, start, grpo, modes):
        d = tmp_path / name
        d.mkdir()
        (d / "times.tsv").write_text("grpo\t600\n")
        for mode in modes:
            (d / mode).mkdir(exist_ok=True)
            files = []
            for model, answers in (("start", start), ("grpo", grpo)):
                files.append(str(d / mode / f"{model}.jsonl"))
                rows = [{"prompt": q, "completion": c, "length": 3, "eos": True} for c in answers]
                open(files[-1], "w").write("".join(json.dumps(r) + "\n" for r in rows))
            ifeval.main(["--report"] + files)
            (d / f"report_{mode}.json").write_text(capsys.readouterr().out)
            if mode == "sampled":        # evaluate's summary carries the KL to the start of the samples
                for model, kl, kl_se in (("start", 0.0, 0.0), ("grpo", 1.25, 0.5)):
                    (d / mode / f"{model}.summary.json").write_text(
                        json.dumps([{"name": model, "kl": kl, "kl_se": kl_se}]))
        return str(d)
    # per prompt, grpo minus start: seed a (+1, 0, 0, -1), seed b (+1, +1, 0, 0); averaged (1, .5, 0, -.5)
    a = run("a", [bad, ok, bad, ok], [ok, ok, bad, bad], ("held", "greedy"))
    b = run("b", [bad, bad, ok, bad], [ok, ok, ok, bad], ("held",))
    text, runs = table.tables([a, b])
    assert "strict" not in runs[1]["grpo"] and "test" in runs[1]["grpo"]        # b ran the test only
    assert "Held-out-kinds test: 4 prompts, every one opening with a kind training never saw (2 seeds)" in text
    assert "| start | 0.375 (0.250..0.500) |" in text and "| grpo | 0.625 (0.500..0.750) |" in text
    # (1, .5, 0, -.5): mean .25, sample variance (.5625 + .0625 + .0625 + .5625) / 3
    se = math.sqrt(1.25 / 3 / 4)
    # each prompt's only constraint is the unseen one, so it alone moves as strict does
    assert f"| grpo (2 seeds) | +0.250 ± {se:.3f} | +0.250 ± {se:.3f} | +0.000, +0.500 |" in text
    assert "| grpo (1 seed) | +0.000 ± " in text                      # the greedy paired line: seed a only
    assert table.main([a, b]) is None and capsys.readouterr().out == text + "\n"
    # a run of the sampled evaluation only: its own table, with the KL, and its paired line (+1, 0, 0, -1)
    c = run("c", [bad, ok, bad, ok], [ok, ok, bad, bad], ("sampled",))
    text, runs = table.tables([c])
    assert text.startswith("Sampled: the same prompts, one answer each (1 seed)") and "Held-out" not in text
    assert "| start | 0.500 ± 0.250 | – |" in text and "| 0% | 0.00 ± 0.00 |" in text and "| 0% | 1.25 ± 0.50 |" in text
    # every prompt has a held-out kind: no training-kinds group
    assert f"| grpo (1 seed) | +0.000 ± {math.sqrt(2 / 3 / 4):.3f} | – | +0.000 ± " in text


def test_repetitive_marks_a_loop_not_a_long_answer():
    loop = "the cat sat on the mat and " * 10
    prose = " ".join(f"word{i}" for i in range(60))
    assert ifeval.repetitive(loop) and not ifeval.repetitive(prose) and not ifeval.repetitive("a a a a")


def test_checker_is_an_ordinary_reward_function():
    fn = load_function("nano_rlhf.tasks.ifeval:reward")
    p = [{"role": "user", "content": "Describe snow briefly. " + ifeval.sentence("max_words", {"n": 3})}]
    assert fn([p, p], ["cold white flakes", "it is cold and white"]) == [1.0, 0.0]


def test_report_of_a_missing_file_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ifeval.main(["--report", str(tmp_path / "nope.jsonl")])
    assert e.value.code == 2 and "error: --report" in capsys.readouterr().err
