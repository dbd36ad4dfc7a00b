"""The verifiable-instruction task (nano_rlhf/ifeval.py): each constraint's checker on hand-written answers, the
prompt text read back, malformed answers scoring 0 without an error, held-out topics and pairs, and the checker
working as `--reward module:function`."""
import json
import re

import pytest

from nano_rlhf import ifeval
from nano_rlhf.reward import load_function

CASES = [  # (kind, arg, answer, met)
    ("max_words", 5, "one two three four five", True),
    ("max_words", 5, "one two three four five six", False),
    ("max_words", 5, "", False),
    ("lowercase", None, "all small here.", True),
    ("lowercase", None, "Not all small.", False),
    ("lowercase", None, "123 !!", False),
    ("include", "harbor", "The Harbor was calm.", True),
    ("include", "harbor", "harbors everywhere", False),
    ("end_with", "The end.", "It rained.\nThe end.  ", True),
    ("end_with", "The end.", "The end. It rained.", False),
    ("json_keys", ("name", "reason"), '{"name": "x", "reason": "y"}', True),
    ("json_keys", ("name", "reason"), '```json\n{"reason": 1, "name": 2}\n```', True),
    ("json_keys", ("name", "reason"), '{"name": "x"}', False),
    ("json_keys", ("name", "reason"), '{"name": "x", "reason": "y", "extra": 1}', False),
    ("json_keys", ("name", "reason"), '["name", "reason"]', False),
    ("json_keys", ("name", "reason"), '{"name": ', False),
    ("bullets", 3, "Intro\n- a\n- b\n* c", True),
    ("bullets", 3, "- a\n- b", False),
    ("bullets", 2, "-a\n-b", False),                   # a bullet is "- " then text
]


@pytest.mark.parametrize("kind,arg,answer,met", CASES)
def test_each_checker(kind, arg, answer, met):
    assert ifeval.check(kind, arg, answer) is met


def test_prompt_sentences_parse_back_and_reward_is_the_share_met():
    text = "Tell me about tea. " + ifeval.render("lowercase", None) + " " + ifeval.render("include", "silver")
    assert ifeval.parse(text) == [("lowercase", None), ("include", "silver")]
    conv = [{"role": "system", "content": 'Include the word "window".'}, {"role": "user", "content": text}]
    assert ifeval.parse(conv) == ifeval.parse(text)               # the last user message only
    answers = ["a silver kettle.", "A silver kettle.", "A kettle.", 7]
    assert ifeval.reward([conv] * 4, answers) == [1.0, 0.5, 0.0, 0.0]
    assert ifeval.strict([conv] * 4, answers) == [1.0, 0.0, 0.0, 0.0]
    assert ifeval.reward(["no constraint here", None], ["x", "y"]) == [0.0, 0.0]


def test_files_hold_out_topics_and_pairs_and_are_seeded(tmp_path):
    for d in ("a", "b"):
        assert ifeval.write_prompts(str(tmp_path / d), seed=3, n_train=200, n_eval=80) == str(tmp_path / d)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    train = [json.loads(x)["prompt"] for x in open(tmp_path / "a" / "train.jsonl")]
    evals = [json.loads(x)["prompt"] for x in open(tmp_path / "a" / "eval.jsonl")]
    assert len(train) == 200 and len(evals) == 80
    def topic(p):
        head = re.match(r"(?:Write a short paragraph about |Describe |Tell me about )(.+?)(?: briefly)?\.",
                        p[0]["content"])
        return head.group(1)
    assert {topic(p) for p in train} <= set(ifeval.TRAIN_TOPICS)
    assert {topic(p) for p in evals} <= set(ifeval.EVAL_TOPICS)
    pairs = lambda ps: {frozenset(k for k, _ in ifeval.parse(p)) for p in ps if len(ifeval.parse(p)) == 2}  # noqa
    assert not pairs(train) & ifeval.HELD_OUT_PAIRS and pairs(evals) & ifeval.HELD_OUT_PAIRS
    assert all(1 <= len(ifeval.parse(p)) <= 2 for p in train + evals)
    assert not any(frozenset(k for k, _ in ifeval.parse(p)) in ifeval.INCOMPATIBLE for p in train + evals)


def test_checker_is_an_ordinary_reward_function():
    fn = load_function("nano_rlhf.ifeval:reward")
    p = [{"role": "user", "content": "Describe snow briefly. " + ifeval.render("max_words", 3)}]
    assert fn([p, p], ["cold white flakes", "it is cold and white"]) == [1.0, 0.0]
