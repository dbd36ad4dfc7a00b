"""SPO (--reward selfplay in train_ppo.py): win-rate rewards against a float64 oracle written from the paper,
the judge's preference matrix, the rollout's scores, every estimator family end to end, one-line errors."""
import json
import math
import textwrap

import pytest
import torch

import train_ppo
from conftest import eos_prone, gae_only, prompt_rows, run, tiny_model, write_jsonl
from nano_rlhf.tasks import synthetic
from nano_rlhf.data import tokenize_prompts
from nano_rlhf.model import GPT
from nano_rlhf.reward import Judge, eval_columns, load_judge, preference_matrix


# ---- the win rate: Swamy et al. 2024, r(y) = P(y ≻ π_t), estimated on the other k − 1 samples --------------

def oracle_win_rates(pref):
    """Float64, loops, from the paper's definition: r_i = (1/(k−1)) Σ_{j≠i} P(y_i ≻ y_j) for each group."""
    G, k, _ = pref.shape
    rows = []
    for g in range(G):
        row = []
        for i in range(k):
            total = torch.zeros((), dtype=torch.float64)
            for j in range(k):
                if j != i:
                    total = total + pref[g, i, j]
            row.append(total / (k - 1))
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.parametrize("k", [2, 3, 8])
def test_selfplay_rewards_match_the_oracle_values_and_gradients(k):
    torch.manual_seed(k)
    pref = torch.rand(5, k, k, dtype=torch.float64)
    pref[:, range(k), range(k)] = float("nan")            # the diagonal must never be read
    a = pref.clone().requires_grad_(True)
    b = pref.clone().requires_grad_(True)
    weights = torch.randn(5, k, dtype=torch.float64)
    got, want = train_ppo.selfplay_rewards(a), oracle_win_rates(b)
    assert got.shape == (5, k) and torch.isfinite(got).all()
    assert torch.allclose(got, want, rtol=0, atol=1e-15)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert torch.allclose(a.grad, torch.nan_to_num(b.grad), rtol=0, atol=1e-15)
    assert (a.grad[:, range(k), range(k)] == 0).all()


def test_win_rates_of_a_proper_preference_average_one_half():
    """P(i ≻ j) + P(j ≻ i) = 1 makes the group's win rates average exactly ½ (a zero-sum game):
    SPO's reward says only how a sample fares against its siblings."""
    torch.manual_seed(0)
    upper = torch.rand(4, 6, 6, dtype=torch.float64).triu(1)
    pref = upper + (1 - upper.transpose(1, 2)).tril(-1) + 0.5 * torch.eye(6, dtype=torch.float64)
    r = train_ppo.selfplay_rewards(pref)
    assert torch.allclose(r.mean(1), torch.full((4,), 0.5, dtype=torch.float64), rtol=0, atol=1e-15)
    # a sample that beats every sibling for sure gets 1, one that loses to all gets 0
    pref = torch.tensor([[[0.5, 1.0, 1.0], [0.0, 0.5, 0.3], [0.0, 0.7, 0.5]]], dtype=torch.float64)
    assert train_ppo.selfplay_rewards(pref).tolist() == [[1.0, 0.15, 0.35]]


# ---- the judge's preference matrix -----------------------------------------------------------------

def test_preference_matrix_from_scores_is_bradley_terry():
    judge = Judge(pointwise=lambda prompts, completions: [float(len(c)) for c in completions])
    comps = ["a", "abc", "ab", "abcd", "a", "a"]
    P = preference_matrix(judge, ["q"] * 6, comps, 3)
    for g in range(2):
        for i in range(3):
            for j in range(3):
                d = len(comps[3 * g + i]) - len(comps[3 * g + j])
                assert P[g, i, j].item() == pytest.approx(1 / (1 + math.exp(-d)), abs=1e-15)
    # given scores (the rollout's reward-model scores of the sampled ids) are used instead of calling the judge
    P2 = preference_matrix(Judge(pointwise=lambda p, c: 1 / 0), ["q"] * 6, comps, 3,
                           scores=torch.tensor([float(len(c)) for c in comps]))
    assert torch.allclose(P, P2, rtol=0, atol=1e-15)


def test_pairwise_judge_is_asked_both_orders_and_its_position_bias_cancels():
    """raw(a, b) = 0.8·q(a, b) + 0.2 favours the first position (a proper preference q ∈ {0, ½, 1}, by length);
    the matrix must be ½(raw(i, j) + 1 − raw(j, i)) = 0.8·q + 0.1: antisymmetric, bias gone."""
    calls = []

    def raw(prompts, a, b):
        calls.append(len(a))
        return [0.8 * (1.0 if len(x) > len(y) else 0.5 if len(x) == len(y) else 0.0) + 0.2 for x, y in zip(a, b)]

    comps = ["aa", "a", "aaa", "a", "b", "cc", "ddd", "e"]
    P = preference_matrix(Judge(pairwise=raw), ["q"] * 8, comps, 4)
    assert calls == [2 * 4 * 3]                             # one call, every ordered pair of both groups
    for g in range(2):
        for i in range(4):
            for j in range(4):
                x, y = comps[4 * g + i], comps[4 * g + j]
                q = 1.0 if len(x) > len(y) else 0.5 if len(x) == len(y) else 0.0
                assert P[g, i, j].item() == pytest.approx(0.5 if i == j else 0.8 * q + 0.1, abs=1e-15)
    assert torch.allclose(P + P.transpose(1, 2), torch.ones_like(P), rtol=0, atol=1e-15)


# ---- the rollout --------------------------------------------------------------------------------------

def test_rollout_scores_are_win_rates_under_the_judge(tok, tmp_path):
    """The trained reward is the win rate, recomputed here from the decoded completions alone."""
    policy = eos_prone(tiny_model(tok), tok)
    prompts, _ = tokenize_prompts(prompt_rows(3), tok, 40)
    shorter = lambda p, a, b: [1.0 if len(x) < len(y) else 0.5 if len(x) == len(y) else 0.0
                               for x, y in zip(a, b)]
    o = train_ppo.Options(reward="selfplay", samples_per_prompt=4, micro_batch_size=12, max_new_tokens=8,
                          missing_eos_penalty=-7.0)
    models = train_ppo.Models(policy=policy, reward=Judge(pairwise=shorter))
    r = train_ppo.rollout(lambda: prompts, models, tok, o, torch.Generator().manual_seed(0))
    lengths = [len(c) for c in r.completions]
    assert len(set(lengths)) > 2, "the test needs completions of different lengths"
    for g in range(3):
        for i in range(4):
            mine = lengths[4 * g + i]
            others = [lengths[4 * g + j] for j in range(4) if j != i]
            want = sum(1.0 if mine < x else 0.5 if mine == x else 0.0 for x in others) / 3
            assert r.raw_scores[4 * g + i].item() == pytest.approx(want, abs=1e-6)
            assert r.scores[4 * g + i].item() == pytest.approx(want if r.has_eos[4 * g + i] else -7.0, abs=1e-6)


# ---- end to end -------------------------------------------------------------------------------------------

JUDGES = """
def shorter(prompts, a, b):
    return [1.0 if len(x) < len(y) else 0.5 if len(x) == len(y) else 0.0 for x, y in zip(a, b)]
"""


def spo_args(tmp_path, sft_dir, out, *extra, builtin=False):
    if builtin:
        if not (tmp_path / "task").exists():
            synthetic.main(["--out_dir", str(tmp_path / "task"), "--n_sft", "50", "--n_pref", "20", "--n_unpaired",
                            "20", "--n_prompts", "40", "--n_eval_prompts", "8"])
        prompts, eval_prompts = tmp_path / "task" / "prompts.jsonl", tmp_path / "task" / "eval_prompts.jsonl"
    else:
        prompts = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(24))
        eval_prompts = write_jsonl(tmp_path / "eval_prompts.jsonl", prompt_rows(4, seed=1))
    return gae_only(["--reward", "selfplay", "--prompts", str(prompts), "--eval_prompts", str(eval_prompts), "--init",
                     sft_dir, "--out_dir", str(tmp_path / out), "--max_steps", "2", "--batch_size", "2",
                     "--samples_per_prompt", "3", "--max_new_tokens", "10", "--eval_interval", "0", "--eval_samples",
                     "4", "--num_minibatches", "1", "--ppo_epochs", "1", "--critic_warmup_steps", "0", "--lr", "1e-3",
                     *extra])


@pytest.mark.parametrize("advantage,judge", [("grpo", "gold"), ("gae", "gold"), ("grpo", "pair"), ("gae", "pair"),
                                             ("rloo", "rm")])
def test_spo_end_to_end(tmp_path, sft_dir, rm_dir, advantage, judge):
    (tmp_path / "judges.py").write_text(textwrap.dedent(JUDGES))
    flags = {"gold": ["--judge", "gold"], "pair": ["--pair_judge", f"{tmp_path / 'judges.py'}:shorter"],
             "rm": ["--judge", rm_dir]}[judge]
    out = train_ppo.main(spo_args(tmp_path, sft_dir, "spo", "--advantage", advantage, *flags,
                                  builtin=judge == "gold"))
    assert (out.critic is None) == (advantage != "gae") and isinstance(out.reward, Judge)
    m = [json.loads(x) for x in open(tmp_path / "spo" / "metrics.jsonl")]
    train, last = [x for x in m if "train/policy_loss" in x], m[-1]
    assert len(train) == 2 and all(torch.isfinite(torch.tensor(x["train/policy_loss"])) for x in train)
    assert all(0 <= x["train/rm_score_raw"] <= 1 for x in train)        # win rates
    assert "eval/kl" in last
    if judge == "gold":       # the gold reward is logged in training and in evaluation, under its usual name
        assert "train/gold_reward" in last and "eval/gold_reward" in last and "eval/reward" not in last
    if judge == "rm":         # the judge's own score stands in for the win rate at evaluation
        assert "eval/rm_score" in last
    if judge == "pair":       # pairwise only: no per-response score to evaluate with
        assert not any(k in last for k in ("eval/reward", "eval/rm_score", "eval/gold_reward"))
    GPT.from_pretrained(str(tmp_path / "spo"))


def test_spo_with_an_llm_judge(tmp_path, sft_dir, tok):
    """An LLM judge built to answer "7" to everything: every answer parsed (no warning), every sample ties, so
    every win rate is exactly ½; the judge answered each rollout sample and each evaluation sample once."""
    from test_label import judge_dir
    out = train_ppo.main(spo_args(tmp_path, sft_dir, "llm", "--advantage", "grpo", "--judge",
                                  f"llm:{judge_dir(tmp_path, tok, '7')}", "--kl_coef", "0"))
    assert out.reward.pointwise.answered == 2 * 2 * 3 + 4 and out.reward.pointwise.unparsed == 0
    m = [json.loads(x) for x in open(tmp_path / "llm" / "metrics.jsonl")]
    assert [x["train/rm_score_raw"] for x in m if "train/rm_score_raw" in x] == [0.5, 0.5]
    assert m[-1]["eval/reward"] == 7.0



def test_resume_refuses_an_llm_judge_replaced_at_the_same_path(tmp_path, sft_dir, tok, capsys):
    """--judge llm:DIR: DIR's files are hashed at start like any input; another model there is refused by
    --resume with one line naming it."""
    import os
    from test_label import answering_model, judge_dir
    judge, out = judge_dir(tmp_path, tok, "7"), tmp_path / "llm"
    args = ("--advantage", "grpo", "--judge", f"llm:{judge}", "--kl_coef", "0")
    train_ppo.main(spo_args(tmp_path, sft_dir, "llm", *args, "--stop_at", "1"))
    capsys.readouterr()                 # the first run's warnings
    before = {f: (out / "state" / f).read_bytes() for f in os.listdir(out / "state")}
    answering_model(tok, "3").save_pretrained(judge)            # a judge that answers otherwise, same path
    with pytest.raises(SystemExit) as e:
        train_ppo.main(spo_args(tmp_path, sft_dir, "llm", *args, "--resume"))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: --resume: the input --judge {judge} changed since {out} was saved"), err
    assert {f: (out / "state" / f).read_bytes() for f in os.listdir(out / "state")} == before


def test_one_sample_per_prompt_is_refused_in_one_line(tmp_path, sft_dir):
    p = run(["train_ppo.py"] + spo_args(tmp_path, sft_dir, "x", "--samples_per_prompt", "1", "--judge", "gold"),
            check=False)
    assert p.returncode != 0 and p.stderr.strip() == ("error: --reward selfplay needs --samples_per_prompt >= 2 (a "
                                                      "sample's reward is its win rate against the others)")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("extra,message", [
    ([], "--reward selfplay needs a judge"),
    (["--pair_judge", "no_such_module_xyz:f"], "--pair_judge no_such_module_xyz:f: cannot import module"),
    (["--pair_judge", "llm:out/sft"], "an LLM judge gives scores, not pairwise preferences"),
    (["--judge", "llm:/nonexistent/judge"], "--judge llm:/nonexistent/judge: no such model directory"),
    (["--judge", "gold", "--judge_template", "t.txt"], "--judge_template t.txt: applies only to --judge llm:"),
    (["--judge", "gold"], "gold scores the built-in task's prompts only"),
    (["--reward", "model", "--judge", "gold"], "--judge applies only with --reward selfplay"),
    (["--judge", "gold", "--score_clip", "5.0"], "--score_clip applies only with --reward model (got selfplay)"),
])
def test_bad_selfplay_options_are_one_line(tmp_path, sft_dir, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        train_ppo.main(spo_args(tmp_path, sft_dir, "x", *extra))
    err = capsys.readouterr().err
    assert e.value.code != 0 and message in err and err.startswith("error: "), err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_llm_judge_template_needs_both_placeholders(tmp_path, sft_dir, capsys):
    (tmp_path / "t.txt").write_text("Rate this: {response}\n")
    with pytest.raises(SystemExit) as e:
        load_judge(f"llm:{sft_dir}", template=str(tmp_path / "t.txt"))
    err = capsys.readouterr().err
    assert e.value.code != 0 and "must contain {prompt} and {response} (missing {prompt})" in err
    assert len(err.strip().splitlines()) == 1


def test_gold_judge_loads_as_the_gold_reward():
    """--judge gold is the very gold function, so evaluation reports it once, as gold_reward."""
    prompt = synthetic.make_prompt(next(iter(synthetic.PRODUCTS)))
    judge = load_judge("gold", prompts=[prompt])
    assert list(eval_columns(judge, judge.pointwise)) == ["gold_reward"]
