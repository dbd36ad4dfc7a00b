"""Safety-labelled preference data (Safe RLHF): our rows' "safer" / "chosen_safe" / "rejected_safe", the
PKU-SafeRLHF layout read as is (tests/fixtures/pku_saferlhf.jsonl, written by hand in that layout), and every
malformed row refused in one line naming file, line and field."""
import json
import os

import pytest

from conftest import run, tiny_model, write_jsonl
from nano_rlhf.data import DataError, load_records, tokenize_pairs

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "pku_saferlhf.jsonl")
OURS = {"prompt": "p", "chosen": " a", "rejected": " b", "safer": "rejected", "chosen_safe": False,
        "rejected_safe": True}


def pku_rows():
    return [json.loads(x) for x in open(FIXTURE)]


def test_pku_rows_become_conversational_pairs_with_their_labels_relative_to_the_better_response():
    raw = pku_rows()
    for kind in ("preference", "safety"):
        recs = load_records(FIXTURE, kind)
        assert len(recs) == len(raw)
        for r, x in zip(recs, raw):
            b = x["better_response_id"]
            assert r["prompt"] == [{"role": "user", "content": x["prompt"]}]          # one user turn
            assert r["chosen"] == [{"role": "assistant", "content": x[f"response_{b}"]}]
            assert r["rejected"] == [{"role": "assistant", "content": x[f"response_{1 - b}"]}]
            assert r["safer"] == ("chosen" if x["safer_response_id"] == b else "rejected")
            assert r["chosen_safe"] is x[f"is_response_{b}_safe"]
            assert r["rejected_safe"] is x[f"is_response_{1 - b}_safe"]
            # sources, harm categories, severity levels and hashes are read past, not carried
            assert set(r) == {"prompt", "chosen", "rejected", "safer", "chosen_safe", "rejected_safe", "_where"}


def test_pku_rows_render_under_the_chat_template(tok):
    """The prompt is rendered as a user turn plus the generation prompt, each response as an assistant turn that
    ends with the template's end of turn: what tokenize_pairs does with any conversational row."""
    recs = load_records(FIXTURE, "preference")
    pairs, stats = tokenize_pairs(recs, tok, 1024)
    assert stats["kept"] == len(recs)
    for p, r in zip(pairs, recs):
        assert p["prompt"] == tok.render_prompt([{"role": "user", "content": r["prompt"][0]["content"]}])
        assert p["chosen"] == tok.encode_response(r["chosen"]) and p["chosen"][-1] == tok.eot_id


def test_a_safety_row_of_pku_needs_no_better_response_id(tmp_path):
    """The cost model does not read which response is more helpful: response_0 fills the chosen slot."""
    x = pku_rows()[2]
    del x["better_response_id"]
    rec = load_records(write_jsonl(tmp_path / "d.jsonl", [x]), "safety")[0]
    assert rec["chosen"][0]["content"] == x["response_0"] and rec["safer"] == "chosen"


def pku(**change):
    """The fixture's first row with fields changed (a value None: the field removed)."""
    x = pku_rows()[0]
    for k, v in change.items():
        if v is None:
            x.pop(k)
        else:
            x[k] = v
    return x


def ours(**change):
    x = dict(OURS)
    for k, v in change.items():
        if v is None:
            x.pop(k)
        else:
            x[k] = v
    return x


BAD = [  # (kind, row, the end of the one-line error after FILE:LINE)
    ("safety", ours(safer=None), "missing field 'safer' (the cost model needs"),
    ("safety", ours(chosen_safe=None), "missing field 'chosen_safe' (the cost model needs"),
    ("safety", ours(rejected_safe=None), "missing field 'rejected_safe'"),
    ("safety", {"prompt": "p", "chosen": " a", "rejected": " b"}, "missing field 'safer'"),
    ("safety", ours(safer="both"), "field 'safer' must be \"chosen\" or \"rejected\", got 'both'"),
    ("safety", ours(safer="Chosen"), "field 'safer' must be \"chosen\" or \"rejected\", got 'Chosen'"),
    ("safety", ours(safer=0), "field 'safer' must be \"chosen\" or \"rejected\", got 0"),
    ("safety", ours(chosen_safe="true"), "field 'chosen_safe' must be true or false, got 'true'"),
    ("safety", ours(rejected_safe=1), "field 'rejected_safe' must be true or false, got 1"),
    ("preference", ours(safer="neither"), "field 'safer' must be"),          # checked when present, any kind
    ("preference", ours(chosen_safe=None, rejected_safe="no"), "field 'rejected_safe' must be true or false"),
    ("safety", pku(safer_response_id=None), "missing field 'safer_response_id' (a PKU-SafeRLHF row for the cost "
                                            "model)"),
    ("safety", pku(is_response_1_safe=None), "missing field 'is_response_1_safe'"),
    ("preference", pku(better_response_id=None), "missing field 'better_response_id' (a PKU-SafeRLHF row for the "
                                                 "reward model)"),
    ("preference", pku(better_response_id=2), "field 'better_response_id' must be 0 or 1, got 2"),
    ("preference", pku(better_response_id=-1), "field 'better_response_id' must be 0 or 1, got -1"),
    ("preference", pku(better_response_id="1"), "field 'better_response_id' must be 0 or 1, got '1'"),
    ("preference", pku(better_response_id=True), "field 'better_response_id' must be 0 or 1, got True"),
    ("preference", pku(better_response_id=1.0), "field 'better_response_id' must be 0 or 1, got 1.0"),
    ("safety", pku(safer_response_id=[1]), "field 'safer_response_id' must be 0 or 1, got [1]"),
    ("safety", pku(is_response_0_safe="yes"), "field 'is_response_0_safe' must be true or false, got 'yes'"),
    ("safety", pku(is_response_0_safe=0), "field 'is_response_0_safe' must be true or false, got 0"),
    ("preference", pku(response_1=None), "missing field 'response_1'"),
    ("preference", pku(response_0=" "), "field 'response_0' is empty"),
    ("preference", pku(prompt=[{"role": "user", "content": "q"}]), "field 'prompt' must be a string"),
    ("preference", pku(chosen=" a"), "fields 'chosen'/'rejected' and 'response_0' are both given"),
]


@pytest.mark.parametrize("kind,row,message", BAD, ids=[f"{k}-{m[:40]}" for k, _, m in BAD])
def test_a_malformed_row_is_one_error_naming_file_line_and_field(tmp_path, kind, row, message):
    path = write_jsonl(tmp_path / "d.jsonl", [OURS if "response_0" not in row else pku(), row])
    with pytest.raises(DataError) as e:
        load_records(path, kind)
    assert str(e.value).startswith(f"{path}:2: {message}"), str(e.value)


def test_contradictory_labels_are_kept_and_counted_in_one_warning(tmp_path):
    """The safer response labelled unsafe while the other is labelled safe: PKU-SafeRLHF has such rows; they are
    kept (the loss weighs the ranking against the signs) and reported once with their count and the first."""
    bad = ours(safer="chosen", chosen_safe=False, rejected_safe=True)
    x = pku(safer_response_id=0)            # response 0 is the unsafe one: named safer, contradicting its labels
    path = write_jsonl(tmp_path / "d.jsonl", [OURS, bad, x, OURS])
    warnings = []
    recs = load_records(path, "safety", warn=warnings.append)
    assert len(recs) == 4 and warnings == [f"2 pair(s) in {path} name as safer a response labelled unsafe while the "
                                           f"other is labelled safe (kept), first at {path}:2"]
    assert load_records(path, "preference", warn=warnings.append) and len(warnings) == 1   # the reward model: silent


def test_train_rm_reads_the_pku_layout_in_both_objectives(tmp_path, tok):
    """The reward model ranks by better_response_id, the cost model by safer_response_id and the safe labels, from
    the same file as is (a model with room for its long rows)."""
    init = tmp_path / "init"
    tiny_model(tok, block_size=256).save_pretrained(str(init))
    tok.save(str(init / "tokenizer.json"))
    for objective in ("reward", "cost"):
        p = run(["train_rm.py", "--objective", objective, "--data", FIXTURE, "--eval_data", FIXTURE, "--init",
                 str(init), "--out_dir", str(tmp_path / objective), "--batch_size", "2", "--max_steps", "2",
                 "--warmup_steps", "0"])
        assert "5 train pairs" in p.stdout and "saved" in p.stdout
    assert json.loads((tmp_path / "cost" / "config.json").read_text())["score_kind"] == "cost"
    assert "score_kind" not in json.loads((tmp_path / "reward" / "config.json").read_text())
