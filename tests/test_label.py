"""python -m nano_rlhf.label (RLAIF labelling) and the LLM-as-a-judge: each format read back by the data
loaders, formats consistent with each other, determinism, no silent overwrite, one-line errors, and a judge
model whose greedy answer is built by hand, parsed from what it really generates."""
import json
import os
import statistics
import textwrap

import pytest
import torch

from conftest import prompt_rows, run, tiny_model, write_jsonl
from nano_rlhf import label
from nano_rlhf.data import load_records, load_scored
from nano_rlhf.reward import DEFAULT_TEMPLATE, LLMJudge, fill_template, load_judge, parse_score

JUDGES = """
def chars(prompts, completions):
    return [float(len(c)) for c in completions]
def shorter(prompts, a, b):
    return [1.0 if len(x) < len(y) else 0.5 if len(x) == len(y) else 0.0 for x, y in zip(a, b)]
"""


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "judges.py").write_text(textwrap.dedent(JUDGES))
    write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(6))
    return tmp_path


def label_args(tmp_path, sft_dir, out, *extra, judge="chars"):
    flag = "--pair_judge" if judge == "shorter" else "--judge"
    return ["--model", sft_dir, "--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / out),
            flag, f"{tmp_path / 'judges.py'}:{judge}", "--samples_per_prompt", "4", "--max_new_tokens", "8",
            "--batch_size", "12", *extra]


def read(path):
    return [json.loads(x) for x in open(path)]


def test_each_format_is_written_in_trl_shape_and_the_formats_agree(setup, sft_dir):
    t = setup
    label.main(label_args(t, sft_dir, "lw.jsonl", "--format", "listwise"))
    label.main(label_args(t, sft_dir, "pairs.jsonl", "--format", "pairs"))
    label.main(label_args(t, sft_dir, "unpaired.jsonl", "--format", "unpaired"))
    label.main(label_args(t, sft_dir, "thr.jsonl", "--format", "unpaired", "--threshold", "10"))
    label.main(label_args(t, sft_dir, "scored.jsonl", "--format", "scored"))
    lw = read(t / "lw.jsonl")
    prompts = [r["prompt"] for r in prompt_rows(6)]
    # listwise: TRL's prompt / completions / scores, the judge's score of each completion, every prompt once
    assert [r["prompt"] for r in lw] == prompts
    for r in lw:
        assert set(r) == {"prompt", "completions", "scores"} and len(r["completions"]) == len(r["scores"]) >= 2
        assert all(isinstance(c, str) and c.strip() for c in r["completions"])
        assert r["scores"] == [float(len(c)) for c in r["completions"]]
    # pairs: read by train_dpo.py's loader; chosen / rejected are the best / worst of the same samples
    pairs = load_records(str(t / "pairs.jsonl"), "preference")
    raw_pairs = read(t / "pairs.jsonl")
    untied = [r for r in lw if max(r["scores"]) > min(r["scores"])]       # a tied group gives no pair
    assert len(pairs) == len(untied) > 0
    for p, raw, group in zip(pairs, raw_pairs, untied):
        assert p["prompt"] == group["prompt"]
        assert p["chosen"] == group["completions"][group["scores"].index(max(group["scores"]))]
        assert p["rejected"] == group["completions"][group["scores"].index(min(group["scores"]))]
        assert raw["score_chosen"] == max(group["scores"]) > raw["score_rejected"] == min(group["scores"])
    # unpaired: read by the KTO loader; label = above the group's median, samples at the median left out
    unpaired, raw_unpaired = load_records(str(t / "unpaired.jsonl"), "unpaired"), read(t / "unpaired.jsonl")
    want = [(r["prompt"], c, s > statistics.median(r["scores"]))
            for r in lw for c, s in zip(r["completions"], r["scores"]) if s != statistics.median(r["scores"])]
    assert [(u["prompt"], u["completion"], u["label"]) for u in unpaired] == want
    assert all(set(u) == {"prompt", "completion", "label"} for u in raw_unpaired)   # one signal: DRO reads it too
    assert [r["score"] for r in load_scored(str(t / "unpaired.jsonl"))] == [1.0 if w[2] else -1.0 for w in want]
    # scored: read by DRO's loader; every sample with the judge's score
    scored = load_scored(str(t / "scored.jsonl"))
    assert [(r["prompt"], r["completion"], r["score"]) for r in scored] == \
        [(r["prompt"], c, s) for r in lw for c, s in zip(r["completions"], r["scores"])]
    assert all(set(r) == {"prompt", "completion", "score"} for r in read(t / "scored.jsonl"))
    # a fixed threshold labels every sample
    thr = load_records(str(t / "thr.jsonl"), "unpaired")
    assert [(u["completion"], u["label"]) for u in thr] == [(c, s >= 10) for r in lw for c, s in
                                                           zip(r["completions"], r["scores"])]


def test_label_output_trains_dro_directly(setup, sft_dir):
    """label -> train_unpaired.py --method dro on both single-response formats (their command lines, in this
    process): DRO reads the unpaired rows' label as ±1 and the scored rows' score (unpaired rows used to carry
    both, which DRO refuses)."""
    import train_unpaired
    for fmt in ("unpaired", "scored"):
        label.main(label_args(setup, sft_dir, f"{fmt}.jsonl", "--format", fmt))
        out = setup / f"dro_{fmt}"
        res = train_unpaired.main(["--method", "dro", "--data", str(setup / f"{fmt}.jsonl"), "--eval_fraction", "0.2",
                                   "--init", sft_dir, "--out_dir", str(out), "--max_steps", "1", "--batch_size", "4"])
        assert res.value is not None and (out / "value" / "model.safetensors").exists()


def test_pairwise_judge_scores_are_win_rates(setup, sft_dir):
    label.main(label_args(setup, sft_dir, "lw.jsonl", "--format", "listwise", judge="shorter"))
    for r in read(setup / "lw.jsonl"):
        lengths = [len(c) for c in r["completions"]]
        if len(lengths) < 4:                  # an empty sample was left out: its rate was against all four
            continue
        for i, mine in enumerate(lengths):
            others = [x for j, x in enumerate(lengths) if j != i]
            want = sum(1.0 if mine < x else 0.5 if mine == x else 0.0 for x in others) / 3
            assert r["scores"][i] == pytest.approx(want, abs=1e-12)


def test_conversational_prompts_keep_messages_and_load_back(tmp_path, sft_dir):
    (tmp_path / "judges.py").write_text(textwrap.dedent(JUDGES))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": [{"role": "user", "content": r["prompt"]}]}
                                             for r in prompt_rows(4)])
    label.main(label_args(tmp_path, sft_dir, "pairs.jsonl", "--format", "pairs"))
    rows = load_records(str(tmp_path / "pairs.jsonl"), "preference")
    assert rows and all(isinstance(r["prompt"], list) and r["chosen"][0]["role"] == "assistant" for r in rows)


def test_sampling_is_deterministic_at_a_seed(setup, sft_dir):
    for out, seed in (("a.jsonl", "3"), ("b.jsonl", "3"), ("c.jsonl", "4")):
        label.main(label_args(setup, sft_dir, out, "--format", "listwise", "--seed", seed))
    a, b, c = ((setup / x).read_bytes() for x in ("a.jsonl", "b.jsonl", "c.jsonl"))
    assert a == b and a != c


def test_no_overwrite_without_the_flag(setup, sft_dir):
    out = setup / "o.jsonl"
    out.write_text("keep me\n")
    p = run(["-m", "nano_rlhf.label"] + label_args(setup, sft_dir, "o.jsonl"), check=False)
    assert p.returncode != 0 and p.stderr.strip() == f"error: --out {out}: exists; pass --overwrite to replace it"
    assert out.read_text() == "keep me\n"
    label.main(label_args(setup, sft_dir, "o.jsonl", "--overwrite"))
    assert load_records(str(out), "preference")
    assert not [f for f in os.listdir(setup) if ".tmp" in f]       # the atomic write left nothing behind


@pytest.mark.parametrize("extra,message,code", [
    (["--judge", ""], "a judge is needed", 2),
    (["--pair_judge", "/nonexistent"], "--pair_judge /nonexistent: expected module:function", 2),
    (["--pair_judge", "no_such_module_xyz:f"], "--pair_judge no_such_module_xyz:f: cannot import module", 1),
    (["--judge", "/nonexistent/rm"], "/nonexistent/rm", 1),
    (["--judge", "llm:/nonexistent/judge"], "--judge llm:/nonexistent/judge: no such model directory", 1),
    (["--judge", "gold"], "gold scores the built-in task's prompts only", 1),
    (["--judge_template", "t.txt"], "--judge_template t.txt: applies only to --judge llm:", 2),
    (["--threshold", "1"], "--threshold applies only with --format unpaired (got pairs); here it would be ignored", 2),
    (["--samples_per_prompt", "1"], "--format pairs needs --samples_per_prompt >= 2", 2),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such model directory", 1),
])
def test_bad_inputs_are_one_line(setup, sft_dir, capsys, extra, message, code):
    """A bad command line (an option that would be ignored, a rule between options) is exit 2, as in every script;
    a bad input exit 1."""
    with pytest.raises(SystemExit) as e:
        label.main(label_args(setup, sft_dir, "o.jsonl", *extra))
    err = capsys.readouterr().err
    assert e.value.code == code and message in err and err.startswith("error: "), (e.value.code, err)
    assert len(err.strip().splitlines()) == 1
    assert not (setup / "o.jsonl").exists()


def test_a_full_disk_leaves_no_half_written_output(setup, sft_dir, capsys, monkeypatch):
    """The disk filling up while --out is written: one error line after the progress lines, no stack, and no
    half-written --out nor OUT.tmpPID; a previous --out stays whole."""
    import errno
    out = setup / "o.jsonl"
    out.write_text("the previous labels\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(SystemExit) as e:
        label.main(label_args(setup, sft_dir, "o.jsonl", "--overwrite"))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and [x for x in err if not x.startswith("sampling ")] == [
        f"error: --out {out}: cannot be written (No space left on device); nothing was written there"], err
    assert out.read_text() == "the previous labels\n" and not [f for f in os.listdir(setup) if ".tmp" in f]


# ---- the LLM judge -------------------------------------------------------------------------------------

def answering_model(tok, answer):
    """A tiny Llama whose greedy answer to any prompt is the token `answer` then end-of-text: the blocks add
    nothing to the residual stream (o_proj, down_proj = 0), so the last hidden state is the current token's
    embedding: u for every token but `answer`, v for it; the untied output layer maps u to `answer` and v
    to end-of-text."""
    m = tiny_model(tok, model_type="llama", tie_word_embeddings=False)
    (a,) = tok.encode(answer)
    u, v = torch.zeros(m.cfg.n_embd), torch.zeros(m.cfg.n_embd)
    u[0], u[1], v[2], v[3] = 1.0, -1.0, 1.0, -1.0
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        emb = m.trunk.embedding.weight
        emb.copy_(u.expand_as(emb))
        emb[a] = v
        m.lm_head.weight.zero_()
        m.lm_head.weight[a] = 10 * u
        m.lm_head.weight[tok.eos_id] = 10 * v
    return m


def judge_dir(tmp_path, tok, answer):
    d = tmp_path / f"judge_{answer}"
    answering_model(tok, answer).save_pretrained(str(d))
    tok.save(str(d / "tokenizer.json"))
    return str(d)


def test_parse_score_takes_the_first_number_in_range():
    assert parse_score("7") == 7.0 and parse_score("Score: 8/10") == 8.0 and parse_score("8.5 out of 10") == 8.5
    assert parse_score("0, then 11, then 3") == 3.0 and parse_score("10") == 10.0
    assert parse_score("no idea") is None and parse_score("0") is None and parse_score("-4") is None


def test_llm_judge_parses_its_generated_answer(tmp_path, tok, capsys):
    judge = load_judge(f"llm:{judge_dir(tmp_path, tok, '7')}", batch_size=2)
    prompts, comps = ["write a short review of the phone."] * 3, [" great.", " bad screen.", " fine"]
    assert judge.pointwise.answers(prompts, comps) == ["7"] * 3         # really generated, then parsed
    assert judge.scores(prompts, comps).tolist() == [7.0] * 3
    assert judge.pointwise.unparsed == 0 and "no score" not in capsys.readouterr().err
    # an answer outside 1..10 is no score: the fallback (the lowest grade), counted in a warning
    zero = load_judge(f"llm:{judge_dir(tmp_path, tok, '0')}")
    assert zero.scores(prompts, comps).tolist() == [1.0] * 3 and zero.pointwise.unparsed == 3
    err = capsys.readouterr().err
    assert "3 of 3 answers hold no score in [1, 10] and score 1" in err
    # the default template does not fit a 64-token context: the inputs lose their beginning, and the user is told
    assert zero.pointwise.truncated == 3 and "3 of 3 judge inputs were longer than its context (64 tokens" in err


def test_llm_judge_renders_the_template_as_a_user_message(tmp_path, tok):
    (tmp_path / "t.txt").write_text("Q: {prompt}\nA: {response}\nJSON like {\"score\": n}. Score:")
    judge = LLMJudge.from_dir(judge_dir(tmp_path, tok, "7"), str(tmp_path / "t.txt"))
    text = fill_template(judge.template, "review {response}", " nice.")
    assert text == "Q: review {response}\nA:  nice.\nJSON like {\"score\": n}. Score:"   # one pass, braces kept
    assert judge.render("review {response}", " nice.") == tok.render_prompt([{"role": "user", "content": text}])
    conv = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "review it"}]
    assert fill_template("{prompt}", conv, "") == "System: be nice\n\nUser: review it"
    default = open(DEFAULT_TEMPLATE).read()
    assert "{prompt}" in default and "{response}" in default and "1 to 10" in default


def test_label_with_an_llm_judge(setup, tok, sft_dir):
    label.main(label_args(setup, sft_dir, "lw.jsonl", "--format", "listwise") + ["--judge",
                                                                                  f"llm:{judge_dir(setup, tok, '7')}"])
    rows = read(setup / "lw.jsonl")
    assert rows and all(s == 7.0 for r in rows for s in r["scores"])


def test_label_with_a_reward_model_judge(setup, sft_dir, rm_dir, tok):
    """A reward-model judge scores the very ids sampled, each row closed by end-of-text as train_rm.py scored
    responses (appended to a response cut at --max_new_tokens): rebuilt here from model.generate at the same
    seed, each row scored alone without padding."""
    from nano_rlhf.data import collate_prompts
    from nano_rlhf.model import GPT, ScoreModel
    label.main(label_args(setup, sft_dir, "lw.jsonl", "--format", "listwise") + ["--judge", rm_dir])
    policy, rm = GPT.from_pretrained(sft_dir).eval(), ScoreModel.from_pretrained(rm_dir).eval()
    prompts = [tok.render_prompt(r["prompt"]) for r in prompt_rows(6) for _ in range(4)]
    gen, want = torch.Generator().manual_seed(0), []
    with torch.no_grad():
        for s in (0, 12):                                    # --batch_size 12
            ids, mask = collate_prompts(prompts[s:s + 12], tok.pad_id)
            seq = policy.generate(ids, mask, 8, 1.0, eos_token_id=tok.stop_ids, pad_token_id=tok.pad_id,
                                  generator=gen)
            for p, resp in zip(prompts[s:s + 12], seq[:, ids.shape[1]:].tolist()):
                n = next((i + 1 for i, t in enumerate(resp) if t == tok.eos_id), None)
                row = p + (resp[:n] if n else resp + [tok.eos_id])
                want.append(rm(torch.tensor([row]))[1].item())
    got = [s for r in read(setup / "lw.jsonl") for s in r["scores"]]
    assert len(got) == 24 and got == pytest.approx(want, abs=1e-5)


def test_sampling_shows_progress_on_stderr(setup, sft_dir, capsys):
    """A long labelling run is never silent: its sampling prints `sampling MODEL | n/N samples | rate | eta` on
    stderr (the last line at least), stdout keeps only the summary."""
    label.main(label_args(setup, sft_dir, "p.jsonl"))
    err = capsys.readouterr().err
    assert f"sampling {sft_dir} |" in err and " samples | " in err and "eta " in err, err
