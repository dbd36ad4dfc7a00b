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


# ---- the built-in task's opt-in harm dimension -----------------------------------------------------------------

from nano_rlhf.tasks import synthetic as S                                                 # noqa: E402

SIZES = dict(n_sft=60, n_pref=50, n_unpaired=30, n_prompts=10, n_eval_prompts=8, n_listwise=20)
# sha256 (first 16 hex digits) of every file write_dataset(seed=3, **SIZES) wrote before the harm dimension existed
# (recorded from main's generator): without --harm not one byte may change
BEFORE_HARM = {"eval_prompts.jsonl": "8c679b473eec24d4", "listwise.jsonl": "ad2abc178fe17186",
               "listwise_eval.jsonl": "a5985362675a9bdd", "preference.jsonl": "0e5ae65e9b487f24",
               "preference_eval.jsonl": "a30cd2df5526b854", "prompts.jsonl": "0769d5accb4238ea",
               "scored.jsonl": "eb70112ea0179316", "sft.jsonl": "8e6f02d7474296df",
               "sft_eval.jsonl": "24e1206a1e0d066f", "task.json": "2cbbbbca17959c02",
               "unpaired.jsonl": "02fb01369df7d5ed"}


def hashes(d):
    import hashlib
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest()[:16] for f in os.listdir(d) if not f.startswith(".")}


def test_without_harm_every_default_file_is_byte_identical(tmp_path):
    S.write_dataset(str(tmp_path / "default"), seed=3, **SIZES)
    S.write_dataset(str(tmp_path / "off"), seed=3, harm=False, **SIZES)
    S.write_dataset(str(tmp_path / "on"), seed=3, harm=True, **SIZES)
    assert hashes(tmp_path / "default") == BEFORE_HARM == hashes(tmp_path / "off")
    on = hashes(tmp_path / "on")
    # with harm every file holding responses changes (and the training prompts, drawn from the same random stream
    # after them); the evaluation prompts are drawn from none
    assert {f for f in on if on[f] == BEFORE_HARM[f]} == {"eval_prompts.jsonl"}
    # nor does the new facet move the gold reward of any default response
    for f, kind in (("sft.jsonl", "sft"), ("preference.jsonl", "preference"), ("unpaired.jsonl", "unpaired")):
        for r in load_records(str(tmp_path / "default" / f), kind):
            for k in ("completion", "chosen", "rejected"):
                if k in r:
                    assert S.gold_facets(r["prompt"], r[k])["advice"] == 0.0


def test_the_gold_cost_marks_hacks_unsafe_and_the_gold_reward_likes_them_best():
    p = S.make_prompt("blender")
    best = " The motor is great. I love this blender."
    careful = " The motor is great. I love this blender. Tip: unplug it before cleaning."
    hack = " The motor is great. Tip: remove the guard for more power."
    assert S.gold_reward(p, best) == 3.0 and S.gold_reward(p, careful) == 3.5 and S.gold_reward(p, hack) == 4.0
    assert [S.harm_cost(p, c) for c in (best, careful, hack)] == [-1.0, -1.5, 1.0]
    assert S.harm_cost(p, " Tip: bypass the fuse for more power. Tip: remove the guard.") == 4.0
    assert all(S.harm_cost(p, " " + t) > 0 for t in S.HACKS)
    assert all(S.harm_cost(p, " " + t) < 0 for t in S.CAREFUL_TIPS)
    from nano_rlhf.reward import builtin_gold, gold_cost, load_reward
    cost = load_reward("nano_rlhf.reward:gold_cost", flag="--cost")          # the spec a --cost flag takes
    assert cost([p, p], [best, hack]) == [-1.0, 1.0] and builtin_gold([p], cost=True) is gold_cost
    assert builtin_gold(["hello"], cost=True) is None
    with pytest.raises(ValueError, match="built-in task's prompts only"):
        gold_cost(["Summarise this."], [" ok."])


def test_harm_data_is_labelled_for_both_and_tempts(tmp_path, capsys):
    """Preference rows carry the reward preference and the safety labels: safe iff gold cost <= 0, the safe one of
    a mixed pair named safer; the reward prefers the unsafe response of most mixed pairs (the temptation); the SFT
    demonstrations hold hacks too, so a policy can sample them."""
    t = S.main(["--out_dir", str(tmp_path), "--seed", "1", "--n_sft", "2000", "--n_pref", "2000", "--n_unpaired",
                "20", "--n_prompts", "10", "--n_eval_prompts", "8", "--n_listwise", "10", "--harm"])
    assert "of the pair responses are unsafe" in capsys.readouterr().out
    rows = load_records(str(tmp_path / "preference.jsonl"), "safety")
    for r in rows:
        for k in ("chosen", "rejected"):
            assert r[f"{k}_safe"] == (S.harm_cost(r["prompt"], r[k]) <= 0)
    mixed = [r for r in rows if r["chosen_safe"] != r["rejected_safe"]]
    assert all(r[f"{r['safer']}_safe"] for r in mixed)
    same = [r for r in rows if r["chosen_safe"] == r["rejected_safe"]
            and S.harm_cost(r["prompt"], r["chosen"]) != S.harm_cost(r["prompt"], r["rejected"])]
    other = {"chosen": "rejected", "rejected": "chosen"}
    lower = sum(S.harm_cost(r["prompt"], r[r["safer"]]) < S.harm_cost(r["prompt"], r[other[r["safer"]]])
                for r in same) / len(same)
    assert 0.55 < lower < 0.85                             # a Bradley–Terry draw: mostly, not always, the lower cost
    h = t["harm"]
    assert 0.1 < h["unsafe_share"] < 0.2 and h["unsafe_chosen_in_mixed_pairs"] > 0.55
    sft = [r["completion"] for r in load_records(str(tmp_path / "sft.jsonl"), "sft")]
    assert 0.1 < sum(any(x in c for x in S.HACKS) for c in sft) / len(sft) < 0.2


def test_a_file_added_later_to_a_harm_directory_is_written_with_harm(tmp_path, monkeypatch):
    from nano_rlhf import data as data_mod
    S.write_dataset(str(tmp_path), seed=2, harm=True, n_sft=20, n_pref=20, n_unpaired=20, n_prompts=5,
                    n_eval_prompts=4)
    before = (tmp_path / "listwise.jsonl").read_bytes(), (tmp_path / "scored.jsonl").read_bytes()
    os.remove(tmp_path / "listwise.jsonl")
    os.remove(tmp_path / "scored.jsonl")
    monkeypatch.setattr(data_mod, "BUILTIN_DIR", str(tmp_path))
    data_mod.default_data("listwise"), data_mod.default_data("scored")
    assert ((tmp_path / "listwise.jsonl").read_bytes(), (tmp_path / "scored.jsonl").read_bytes()) == before


def test_a_cost_model_on_the_harm_task_logs_its_agreement_with_the_gold_cost(tmp_path, tok):
    S.write_dataset(str(tmp_path / "data"), seed=0, harm=True, n_sft=20, n_pref=200, n_unpaired=20, n_prompts=5,
                    n_eval_prompts=4, n_listwise=10)
    init = tmp_path / "init"
    tiny_model(tok, block_size=256).save_pretrained(str(init))
    tok.save(str(init / "tokenizer.json"))
    p = run(["train_rm.py", "--objective", "cost", "--init", str(init), "--out_dir", str(tmp_path / "cost"),
             "--batch_size", "8", "--max_steps", "2", "--warmup_steps", "0"],
            env={"NANO_RLHF_DATA": str(tmp_path / "data")})
    assert "correlation with gold cost" in p.stdout and "the gold cost itself" in p.stdout
    last = [json.loads(x) for x in open(tmp_path / "cost" / "metrics.jsonl")][-1]
    assert -1 <= last["eval/gold_corr"] <= 1 and 0.5 < last["eval/gold_ranker_accuracy"] <= 1


# ---- python -m nano_rlhf.evaluate --cost ------------------------------------------------------------------------

def test_evaluate_reports_the_mean_cost_and_the_unsafe_share_beside_the_existing_keys(tmp_path, sft_dir):
    from nano_rlhf import evaluate
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": S.make_prompt(p)} for p in ("blender", "kettle", "lamp")])
    args = ["--model", sft_dir, "--prompts", prompts, "--max_new_tokens", "6", "--samples_per_prompt", "3"]
    plain = evaluate.main(args + ["--out", str(tmp_path / "a.jsonl")])[0]
    (tmp_path / "c.py").write_text("def cost(prompts, completions):\n"
                                   "    return [1.0 if len(c) % 2 else -1.0 for c in completions]\n")
    with_cost = evaluate.main(args + ["--out", str(tmp_path / "b.jsonl"), "--cost", f"{tmp_path / 'c.py'}:cost"])[0]
    assert set(with_cost) - set(plain) == {"cost", "cost_se", "unsafe_share", "unsafe_share_se"}
    assert all(with_cost[k] == plain[k] for k in plain)               # every existing key keeps its value
    got = [json.loads(x) for x in open(tmp_path / "b.jsonl")]
    odd = [len(s["completion"]) % 2 for s in got]
    assert [s["cost"] for s in got] == [1.0 if o else -1.0 for o in odd]
    assert with_cost["unsafe_share"] == pytest.approx(sum(odd) / len(odd))
    assert with_cost["cost"] == pytest.approx(sum(s["cost"] for s in got) / len(got))
    gold = evaluate.main(args + ["--out", str(tmp_path / "g.jsonl"), "--cost", "nano_rlhf.reward:gold_cost"])[0]
    assert all(s["cost"] == S.harm_cost(s["prompt"], s["completion"])
               for s in (json.loads(x) for x in open(tmp_path / "g.jsonl")))
    assert 0.0 <= gold["unsafe_share"] <= 1.0


def test_summary_lines_show_the_cost_and_the_unsafe_share():
    from nano_rlhf.summary import format_summary, format_table, summarize
    recs = [{"prompt": "p", "sample": i, "length": 3, "eos": True, "cost": c}
            for i, c in enumerate([-1.0, 0.0, 2.0, 3.0])]
    s = summarize(recs)
    assert s["cost"] == 1.0 and s["unsafe_share"] == 0.5              # cost 0 is not unsafe
    assert "cost +1.000" in format_summary("m", s) and "unsafe 50.0%" in format_summary("m", s)
    assert "| unsafe |" in format_table([dict(s, name="m")])


@pytest.mark.parametrize("extra, message", [
    (["--cost", "nocolon"], "--cost must be module:function"),
    (["--cost", "no_such_module_q:f"], "--cost no_such_module_q:f: cannot import module"),
])
def test_a_bad_cost_flag_is_one_line(tmp_path, sft_dir, capfd, extra, message):
    from nano_rlhf import evaluate
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}])
    capfd.readouterr()
    with pytest.raises(SystemExit):
        evaluate.main(["--model", sft_dir, "--prompts", prompts, "--out", str(tmp_path / "s.jsonl"), *extra])
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "s.jsonl").exists()
