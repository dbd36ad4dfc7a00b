"""Validation of the four data kinds (FILE:LINE messages), the over-long rule, padding and sharding."""
import pytest
import torch

from conftest import run, sft_rows, write_jsonl
from nano_rlhf.data import (Batches, DataError, collate_prompts, collate_sft, load_records, pad_left, pad_right,
                            tokenize_pairs, tokenize_prompts, tokenize_sft)

GOOD = {
    "sft": '{"prompt": "p", "completion": " c"}',
    "preference": '{"prompt": "p", "chosen": " a", "rejected": " b"}',
    "unpaired": '{"prompt": "p", "completion": " c", "label": true}',
    "prompts": '{"prompt": "p"}',
}

BAD = [  # (kind, bad line, expected words in the message)
    ("sft", '{"prompt": "p", "completion": " c"', "not valid JSON"),
    ("sft", '["prompt", "completion"]', "expected a JSON object"),
    ("sft", '{"prompt": "p"}', "missing field 'completion'"),
    ("sft", '{"prompt": 3, "completion": " c"}', "'prompt' must be a string"),
    ("sft", '{"prompt": "p", "completion": "  "}', "'completion' is empty"),
    ("sft", '{"text": ""}', "'text' is empty"),
    ("sft", '{"foo": "bar"}', "exactly one of"),
    ("sft", '{"messages": [{"role": "bot", "content": "hi"}]}', "'bot' is not one of"),
    ("sft", '{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ("sft", '{"messages": [{"role": "user"}]}', "missing field 'content'"),
    ("sft", '{"messages": []}', "non-empty list"),
    ("preference", '{"prompt": "p", "chosen": " a"}', "missing field 'rejected'"),
    ("preference", '{"prompt": "p", "chosen": " a", "rejected": " b", "margin": "1"}', "'margin' must be a finite number"),
    ("preference", '{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}], '
                   '"rejected": [{"role": "assistant", "content": "b"}]}', "must be 'assistant'"),
    ("preference", '{"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": " b"}', "one format"),
    ("unpaired", '{"prompt": "p", "completion": " c", "label": 1}', "'label' must be true or false"),
    ("unpaired", '{"prompt": "p", "completion": " c"}', "missing field 'label'"),
    ("prompts", '{"prompt": null}', "'prompt' must be a string"),
    ("prompts", '{"question": "p"}', "missing field 'prompt'"),
]


@pytest.mark.parametrize("kind,line,words", BAD)
def test_bad_line_names_file_and_line(tmp_path, kind, line, words):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD[kind], GOOD[kind], line, GOOD[kind]])
    with pytest.raises(DataError) as e:
        load_records(path, kind)
    assert str(e.value).startswith(f"{path}:3: ") and words in str(e.value)


def test_invalid_utf8_and_empty_file(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_bytes(GOOD["prompts"].encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"u.jsonl:2: invalid UTF-8"):
        load_records(str(p), "prompts")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"e.jsonl:1: empty file"):
        load_records(str(tmp_path / "e.jsonl"), "sft")
    with pytest.raises(DataError, match="cannot open"):
        load_records(str(tmp_path / "missing.jsonl"), "sft")


def test_good_files_of_every_kind_and_format(tmp_path):
    conv = [{"role": "user", "content": "q"}]
    rows = {
        "sft": [GOOD["sft"], '{"text": "hello"}', {"messages": conv + [{"role": "assistant", "content": "a"}]},
                {"prompt": conv, "completion": [{"role": "assistant", "content": "a"}]}],
        "preference": [GOOD["preference"], {"prompt": conv, "chosen": [{"role": "assistant", "content": "a"}],
                                            "rejected": [{"role": "assistant", "content": "b"}], "margin": 0.5}],
        "unpaired": [GOOD["unpaired"], {"prompt": conv, "completion": [{"role": "assistant", "content": "a"}],
                                        "label": False}],
        "prompts": [GOOD["prompts"], {"prompt": conv}],
    }
    for kind, rs in rows.items():
        recs = load_records(write_jsonl(tmp_path / f"{kind}.jsonl", rs), kind)
        assert len(recs) == len(rs) and recs[0]["_where"].endswith(":1")


@pytest.mark.parametrize("script", ["train_sft.py"])
def test_script_exits_nonzero_with_one_line_before_building_a_model(tmp_path, script):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD["sft"], '{"prompt": "p", "completion": 5}'])
    p = run([script, "--data", path, "--out_dir", str(tmp_path / "out")], check=False)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1] == f"error: {path}:2: field 'completion' must be a string, got int"
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_overlong_rule(tok):
    recs = [{"prompt": "the motor is great " * 10, "completion": " quiet."},           # prompt truncated
            {"prompt": "p", "completion": " the motor is great" * 20},                  # response too long: drop
            {"text": "the motor is great " * 20},                                       # text too long: its start
            {"prompt": "write", "completion": " fine."}]                                # fits
    out, st = tokenize_sft(recs, tok, 16)
    assert st == {"kept": 3, "truncated": 2, "dropped": 1}
    ids, mask = out[0]
    resp = tok.encode(" quiet.") + [tok.eos_id]
    assert len(ids) == 16 and ids[-len(resp):] == resp and mask.count(1) == len(resp) and mask[0] == 0
    full = tok.encode("the motor is great " * 10)
    assert ids[:16 - len(resp)] == full[-(16 - len(resp)):]                           # kept the end of the prompt
    pairs, pst = tokenize_pairs([{"prompt": "the motor is great " * 10, "chosen": " a.", "rejected": " quiet fine."}],
                                tok, 12)
    assert pst["truncated"] == 1 and len(pairs[0]["prompt"]) + len(pairs[0]["rejected"]) == 12
    pr, prst = tokenize_prompts([{"prompt": "the motor is great " * 10}], tok, 8)
    assert len(pr[0]["prompt"]) == 8 and prst["truncated"] == 1


def test_padding_and_collation(tok):
    assert pad_right([[5, 6], [7]], 1).tolist() == [[5, 6], [7, 1]]
    assert pad_left([[5, 6], [7]], 1).tolist() == [[5, 6], [1, 7]]
    ids, attn, loss = collate_sft([([5, 6, 7], [0, 1, 1]), ([8], [1])], pad_id=1)
    assert ids.tolist() == [[5, 6, 7], [8, 1, 1]] and attn.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert loss.tolist() == [[0, 1, 1], [1, 0, 0]]
    ids, attn = collate_prompts([[5, 6], [7]], pad_id=1)
    assert ids.tolist() == [[5, 6], [1, 7]] and attn.tolist() == [[1, 1], [0, 1]]


def test_batches_same_examples_per_step_however_split():
    """A step covers the same examples whether 1 rank x 4 micro-batches or 2 ranks x 2 of 1, etc."""
    def step_sets(B, G, W, steps=12):
        loaders = [Batches(50, B, G, r, W, seed=3) for r in range(W)]
        return [sorted(i for ld in loaders for mb in ld.next_step() for i in mb) for _ in range(steps)]
    ref = step_sets(4, 1, 1)
    assert step_sets(1, 4, 1) == ref and step_sets(1, 2, 2) == ref and step_sets(2, 1, 2) == ref
    flat = [i for s in ref[:12] for i in s]
    assert len(set(flat[:48])) == 48          # within an epoch no repeats (50 // 4 = 12 steps/epoch)


def test_batches_resume_and_errors():
    a = Batches(30, 2, 2, seed=1)
    for _ in range(9):
        a.next_step()
    b = Batches(30, 2, 2, seed=1)
    b.load_state_dict(a.state_dict())
    assert [a.next_step() for _ in range(5)] == [b.next_step() for _ in range(5)]
    with pytest.raises(ValueError, match="fewer than one global batch"):
        Batches(3, 2, 1, world_size=2)


def test_sft_rows_fixture_is_valid(tmp_path):
    assert len(load_records(write_jsonl(tmp_path / "s.jsonl", sft_rows(8)), "sft")) == 8
    assert torch.is_tensor(collate_sft([([1, 2], [0, 1])], 1)[0])


def test_text_rows_longer_than_the_context_keep_their_beginning(tok):
    """A document corpus ({"text"} rows longer than the context) trains on each document's first max_len
    tokens (TRL's truncation), the end-of-text only where it fits; it used to drop every row."""
    doc = "the motor is great and the screen is bad " * 10
    full = tok.encode(doc)
    short = "nice phone."
    out, st = tokenize_sft([{"text": doc}, {"text": short}], tok, 16)
    assert st == {"kept": 2, "truncated": 1, "dropped": 0}
    assert out[0] == (full[:16], [1] * 16) and tok.eos_id not in out[0][0]
    assert out[1][0] == tok.encode(short) + [tok.eos_id]                 # fits: unchanged, with end-of-text
    n = len(tok.encode(short))
    exact, st = tokenize_sft([{"text": short}], tok, n)                   # text fits, its end-of-text does not
    assert exact[0][0] == tok.encode(short) and st["truncated"] == 1


def test_lone_surrogate_is_rejected_with_file_line_and_field(tmp_path):
    """json.loads accepts "\\ud800" (a lone surrogate); the tokenizer then crashed with a TypeError."""
    lines = [GOOD["preference"], '{"prompt": "p", "chosen": " a\\ud800b", "rejected": " b"}']
    path = write_jsonl(tmp_path / "s.jsonl", lines)
    with pytest.raises(DataError) as e:
        load_records(path, "preference")
    assert str(e.value).startswith(f"{path}:2: field 'chosen' holds a lone surrogate escape")
    conv = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\udfff"}]}'
    path = write_jsonl(tmp_path / "m.jsonl", [conv])
    with pytest.raises(DataError, match=r"m.jsonl:1: messages\[1\]: field 'content' holds a lone surrogate"):
        load_records(path, "sft")


def test_deeply_nested_json_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "deep.jsonl", [GOOD["sft"], '{"text": ' + "[" * 200_000 + "]" * 200_000 + "}"])
    with pytest.raises(DataError) as e:
        load_records(path, "sft")
    assert str(e.value) == f"{path}:2: JSON nested too deeply to parse"


def test_duplicate_keys_and_ties_give_one_warning_each(tmp_path):
    rows = [GOOD["preference"],
            '{"prompt": "p", "chosen": " a", "chosen": " c", "rejected": " b"}',          # duplicate key
            '{"prompt": "p", "chosen": " same", "rejected": " same"}',                    # a tie
            '{"prompt": "p", "chosen": " x", "rejected": " x", "rejected": " y"}',         # both (last wins: no tie)
            '{"prompt": [{"role": "user", "content": "q", "content": "r"}], '
            '"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "a"}]}']
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    warnings = []
    recs = load_records(path, "preference", warn=warnings.append)
    assert len(recs) == 5 and recs[1]["chosen"] == " c" and recs[3]["rejected"] == " y"   # json.loads' choice kept
    assert warnings == [
        f"3 line(s) of {path} repeat a JSON key (the last value is used), first at {path}:2 (key 'chosen')",
        f"2 preference pair(s) in {path} have chosen == rejected (no preference to learn; kept), first at {path}:3"]
    clean = []
    load_records(write_jsonl(tmp_path / "c.jsonl", [GOOD["preference"]] * 3), "preference", warn=clean.append)
    assert clean == []


def test_warnings_reach_stderr_once(tmp_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", ['{"prompt": "p", "chosen": " a", "rejected": " a"}'] * 4)
    load_records(path, "preference")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: 4 preference pair(s) in {path} have chosen == rejected (no preference to learn; kept), "
                   f"first at {path}:1"]


def test_pack_sft_is_greedy_in_data_order_and_unsupervises_each_first_token():
    from nano_rlhf.data import collate_packed, pack_sft
    ex = [([1, 2, 3], [1, 1, 1]), ([4, 5], [0, 1]), ([6, 7, 8, 9], [0, 0, 1, 1]), ([10], [1]), ([11, 12], [0, 1])]
    rows = pack_sft(ex, 5)
    assert [r[0] for r in rows] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]
    assert [r[1] for r in rows] == [[0, 1, 1, 0, 1], [0, 0, 1, 1, 0], [0, 1]]
    assert [r[2] for r in rows] == [[3, 2], [4, 1], [2]]
    ids, attn, lm, pos, seg = collate_packed(rows, 99)
    assert ids[2].tolist() == [11, 12, 99, 99, 99] and attn[2].tolist() == [1, 1, 0, 0, 0]
    assert pos.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0], [0, 1, 0, 0, 0]]
    assert seg.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1], [0, 0, -1, -1, -1]]
    with pytest.raises(ValueError, match="longer than the context"):
        pack_sft([([1] * 6, [1] * 6)], 5)


def test_text_rows_start_with_bos_where_the_tokenizer_adds_one(tmp_path):
    """A Llama-style tokenizer (bos added by its post-processor) gets its bos on {"text"} rows, as on
    conversations; a GPT-2-style one (no bos) is unchanged."""
    from hf_fixtures import make_hf_dir
    from nano_rlhf.training import load_tokenizer
    from nano_rlhf.data import tokenize_sft
    text = "the motor is great."
    for family, has_bos in (("llama", True), ("qwen3", False)):
        tok = load_tokenizer("", make_hf_dir(tmp_path / family, family))
        (ids, mask), = tokenize_sft([{"text": text}], tok, 64)[0]
        body = tok.encode(text)
        assert ids == ([tok.bos_id] if has_bos else []) + body + [tok.eos_id], family
        assert mask == [1] * len(ids)


@pytest.mark.parametrize("kind,row,field", [
    ("listwise", {"prompt": "q", "completions": [" a", " b"], "scores": [10 ** 400, 1]}, "scores"),
    ("scored", {"prompt": "q", "completion": " a", "score": -10 ** 400}, "score"),
    ("preference", {"prompt": "q", "chosen": " a", "rejected": " b", "margin": 10 ** 400}, "margin"),
])
def test_a_number_too_large_for_a_float_is_a_data_error_not_a_traceback(tmp_path, kind, row, field):
    """JSON integers have no size limit: one past float's range passed isinstance(int) and then made
    math.isfinite raise OverflowError (a traceback); it is a FILE:LINE error naming the field."""
    import json
    from nano_rlhf.data import DataError, load_records, load_scored
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        load_scored(str(f)) if kind == "scored" else load_records(str(f), kind)
    assert f"{f}:1" in str(e.value) and field in str(e.value)
