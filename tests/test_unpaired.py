"""train_unpaired.py: NPO, D2O and DRO. Float64 oracles written from the papers (docs/algorithms.md,
"Negative-only" and "DRO"), not from the code; the label rules; D2O's samples (drawn once, reused on resume);
DRO's two gradients on real models; the scored data kind; DDP; every method end to end on the built-in task."""
import json
import math
import os

import pytest
import torch

import train_unpaired as tu
from conftest import metrics, one_line_error, run, tiny_model, unpaired_rows, weights_close, write_jsonl
from nano_rlhf.tasks import synthetic
from nano_rlhf import data as data_mod
from nano_rlhf.data import DataError, load_scored, tokenize_unpaired
from nano_rlhf.model import ScoreModel

HUGE = [-1e4, -300.0, -30.0, -1.0, -1e-7, 0.0, 1e-7, 1.0, 30.0, 300.0, 1e4]


def softplus64(z):
    """log(1 + e^z) in float64 without overflow: max(z, 0) + log1p(e^{−|z|})."""
    return torch.clamp(z, min=0) + torch.log1p(torch.exp(-z.abs()))


# ---- NPO: (2/β)·log(1 + (π_θ(y)/π_ref(y))^β) --------------------------------------------------------

@pytest.mark.parametrize("beta", [0.05, 0.1, 1.0])
def test_npo_loss_and_gradient_match_float64_oracle(beta):
    u = torch.tensor(HUGE, dtype=torch.float64, requires_grad=True)
    got = tu.npo_loss(u, beta)
    want = 2.0 / beta * softplus64(beta * u)                  # the paper's form, log(1 + ratio^β)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(got.sum(), u)
    # d/du (2/β)·log(1 + e^{βu}) = 2·σ(βu): bounded by 2, vanishing as π_θ(y⁻) → 0
    torch.testing.assert_close(g, 2 * torch.sigmoid(beta * u.detach()), rtol=1e-12, atol=1e-300)
    assert got[5].item() == pytest.approx(2 / beta * math.log(2))       # u = 0: the start of training


@pytest.mark.parametrize("first,now,factor,want", [
    (0.5, 0.99, 2.0, False), (0.5, 1.01, 2.0, True), (0.5, 1.0, 2.0, False),    # strictly past factor × first
    (0.5, 9.0, 0.0, False),                                                     # 0 = never
    (0.0, 9.0, 2.0, False),                                                     # no start value yet
    (0.48, 4.5, 2.0, True), (0.48, 0.6, 1.5, False)])                           # issue 23's run; a mild rise
def test_retain_nll_drift_rule(first, now, factor, want):
    assert tu.retain_nll_drifted(first, now, factor) is want


# ---- D2O: −log σ(β/K·Σᵢ u(yᵢ) − α·u(y⁻)) ------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 5])
def test_d2o_loss_and_gradients_match_float64_oracle(k):
    g = torch.Generator().manual_seed(k)
    u_s = (torch.randn(len(HUGE), k, generator=g, dtype=torch.float64) * 50).requires_grad_()
    u_n = torch.tensor(HUGE, dtype=torch.float64, requires_grad=True)
    beta, alpha = 0.1, 0.3
    got = tu.d2o_loss(u_s, u_n, beta, alpha)
    z = beta / k * sum(u_s[:, i] for i in range(k)) - alpha * u_n
    want = softplus64(-z)                                          # −log σ(z)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    ga = torch.autograd.grad(got.sum(), (u_s, u_n))
    gb = torch.autograd.grad(want.sum(), (u_s, u_n))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-300)
    assert torch.all(ga[0] <= 0) and torch.all(ga[1] >= 0)        # raise the samples, lower the negative


def test_d2o_with_one_sample_and_alpha_beta_is_dpo():
    u_s, u_n = torch.tensor([[2.0], [-1.0]], dtype=torch.float64), torch.tensor([0.5, 3.0], dtype=torch.float64)
    dpo = softplus64(-0.1 * (u_s[:, 0] - u_n))
    torch.testing.assert_close(tu.d2o_loss(u_s, u_n, 0.1, 0.1), dpo)


# ---- DRO-V: ½·(r − V(x) − τ·u)² ----------------------------------------------------------------------

def test_dro_loss_and_gradients_match_float64_oracle():
    r = torch.tensor([1.0, -1.0, 2.5, 0.0, -1e3], dtype=torch.float64)
    v = torch.tensor([0.0, 0.3, -2.0, 1e-9, 5.0], dtype=torch.float64, requires_grad=True)
    u = torch.tensor([0.0, -4.0, 40.0, 1e-9, -1e4], dtype=torch.float64, requires_grad=True)
    tau = 0.1
    got = tu.dro_loss(r, v, u, tau)
    res = r - v.detach() - tau * u.detach()
    torch.testing.assert_close(got, 0.5 * res ** 2, rtol=1e-12, atol=1e-12)
    gv, gu = torch.autograd.grad(got.sum(), (v, u))
    torch.testing.assert_close(gv, -res, rtol=1e-12, atol=0)          # value: −(r − V − τu)
    torch.testing.assert_close(gu, -tau * res, rtol=1e-12, atol=0)    # policy, through u: −τ·(r − V − τu)


@pytest.mark.numeric
def test_dro_policy_and_value_gradients_on_real_models(tok):
    """micro_step's backward gives, for each network, the gradient of ½·Σ(r − V(x) − τ·u)² computed from full
    logits and per-token scores (independently of the code's gather and end-of-prompt read). Both sides run in
    float64, models included, so the comparison checks the math: what is left is float64 rounding (~1e-16
    relative), far inside the tolerance, whatever the CPU's kernels."""
    policy, ref = tiny_model(tok, seed=0).double(), tiny_model(tok, seed=1).double().requires_grad_(False)
    torch.manual_seed(2)
    value = ScoreModel(policy.cfg).double()
    rows = [dict(r, score=s) for r, s in zip(unpaired_rows(4), [1.0, -1.0, 0.5, 2.0])]
    examples = tu.tokenize_scored(rows, tok, 64)[0]
    opts = tu.Options(method="dro", tau=0.7)
    batch = tu.make_batch(examples, opts, tok.pad_id, "cpu")
    stats = tu.micro_step(opts, policy, ref, batch, value)
    params = list(policy.parameters()) + list(value.parameters())
    got = torch.autograd.grad(stats["loss"], params)

    def s(model, e):
        ids = torch.tensor([e["prompt"] + e["completion"]])
        logp = torch.log_softmax(model(ids)[0, :-1].double(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        return logp[len(e["prompt"]) - 1:].sum()        # the completion's tokens, predicted from t − 1
    want = 0
    for e in examples:
        scores, _ = value(torch.tensor([e["prompt"]]))
        v = scores[0, len(e["prompt"]) - 1]             # V(x): the score at the prompt's last token
        u = s(policy, e) - s(ref, e).detach()
        want = want + 0.5 * (e["score"] - v - 0.7 * u) ** 2
    assert stats["loss"].dtype == torch.float64
    assert float(stats["loss"].detach()) == pytest.approx(float(want.detach()), rel=1e-10)
    for a, b in zip(got, torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
    assert any(a.abs().sum() > 0 for a in got[len(list(policy.parameters())):])   # the value does learn


# ---- the scored kind ----------------------------------------------------------------------------------

BAD_SCORED = [
    ({"prompt": "p", "completion": " c"}, "missing field 'score' (a number) or 'label' (true/false)"),
    ({"prompt": "p", "completion": " c", "score": "1"}, "field 'score' must be a finite number, got '1'"),
    ({"prompt": "p", "completion": " c", "score": True}, "field 'score' must be a finite number, got True"),
    ('{"prompt": "p", "completion": " c", "score": NaN}', "field 'score' must be a finite number, got nan"),
    ({"prompt": "p", "completion": " c", "score": 1, "label": True}, "fields 'score' and 'label' are both given; a scored row has one of them"),
    ({"prompt": "p", "completion": " c", "label": "yes"}, "field 'label' must be true or false, got 'yes'"),
    ({"prompt": "p", "score": 1.0}, "missing field 'completion'"),
]


@pytest.mark.parametrize("row,msg", BAD_SCORED, ids=[m[:30] for _, m in BAD_SCORED])
def test_scored_rows_are_validated_with_file_line(tmp_path, row, msg):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "p", "completion": " ok", "score": 0.5}, row])
    with pytest.raises(DataError) as e:
        load_scored(path)
    assert str(e.value) == f"{path}:2: {msg}"


def test_scored_labels_read_as_plus_minus_one(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "p", "completion": " a", "label": True},
                                             {"prompt": "p", "completion": " b", "label": False},
                                             {"prompt": "p", "completion": " c", "score": -2}])
    assert [r["score"] for r in load_scored(path)] == [1.0, -1.0, -2.0]


def test_builtin_scored_file_is_gold_plus_noise_and_seeded(tmp_path):
    a = synthetic.write_scored(str(tmp_path / "a"), seed=3, n=300)
    b = synthetic.write_scored(str(tmp_path / "b"), seed=3, n=300)
    assert open(a, "rb").read() == open(b, "rb").read()
    rows = [json.loads(x) for x in open(a)]
    noise = [r["score"] - synthetic.gold_reward(r["prompt"], r["completion"]) for r in rows]
    mean = sum(noise) / len(noise)
    std = (sum((x - mean) ** 2 for x in noise) / len(noise)) ** 0.5
    assert abs(mean) < 0.1 and 0.4 < std < 0.6                   # N(0, 0.5²)


# ---- runs -------------------------------------------------------------------------------------------

def files(tmp_path):
    if not (tmp_path / "neg.jsonl").exists():
        rows = unpaired_rows(64)
        write_jsonl(tmp_path / "mixed.jsonl", rows)
        write_jsonl(tmp_path / "neg.jsonl", [dict(r, label=False) for r in rows])
        write_jsonl(tmp_path / "neg_eval.jsonl", [dict(r, label=False) for r in unpaired_rows(8, seed=1)])
        write_jsonl(tmp_path / "scored.jsonl", [{"prompt": r["prompt"], "completion": r["completion"],
                                                 "score": (1.0 if r["label"] else -1.0) * (1 + i % 3)}
                                                for i, r in enumerate(rows)])
    return tmp_path


def args(tmp_path, sft_dir, out, method, *extra, data=None, steps=3):
    d = files(tmp_path)
    data = data or ("scored" if method == "dro" else "neg")
    ev = ["--eval_data", str(d / "neg_eval.jsonl")] if data == "neg" else []
    return ["--method", method, "--data", str(d / f"{data}.jsonl"), *ev, "--init", sft_dir,
            "--out_dir", str(tmp_path / out), "--max_steps", str(steps), "--batch_size", "4", "--log_interval", "1",
            "--eval_interval", "0", "--lr", "1e-3", "--warmup_steps", "0", *extra]


def test_npo_refuses_desirable_rows_unless_retained(tmp_path, sft_dir, capsys):
    err = one_line_error(capsys, lambda: tu.main(args(tmp_path, sft_dir, "o", "npo", data="mixed")),
                         f"{tmp_path / 'mixed.jsonl'}:1: field 'label' is true")
    assert "--retain_coef" in err
    assert not (tmp_path / "o").exists()                  # refused before any model was loaded, nothing left
    out = tu.main(args(tmp_path, sft_dir, "rt", "npo", "--retain_coef", "1.0", data="mixed"))
    m = metrics(tmp_path / "rt")
    assert all(math.isfinite(x["train/nll"]) and x["train/nll"] > 0 for x in m)
    assert out.policy is not None
    one_line_error(capsys, lambda: tu.main(args(tmp_path, sft_dir, "d", "d2o", data="mixed")),
                   f"{tmp_path / 'mixed.jsonl'}:1: field 'label' is true, but --method d2o")


def test_npo_warns_once_when_the_retain_nll_runs_away(tmp_path, sft_dir, capsys):
    # a large lr: the summed-log-prob NPO term overpowers the token-mean retain NLL (issue 23, at toy scale; a
    # random policy starts near log V, so the factor is small here)
    flags = ["--retain_coef", "1", "--lr", "0.05", "--retain_warn", "1.2"]
    tu.main(args(tmp_path, sft_dir, "hot", "npo", *flags, data="mixed", steps=8))
    nll = [x["train/nll"] for x in metrics(tmp_path / "hot")]
    err = capsys.readouterr().err
    assert max(nll) > 1.2 * nll[0], nll                                # the regime the warning is for
    warned = [line for line in err.splitlines() if line.startswith("warning: step ")]
    assert len(warned) == 1 and "its first value" in warned[0] and "--lr" in warned[0], err
    tu.main(args(tmp_path, sft_dir, "off", "npo", *flags[:-1], "0", data="mixed", steps=8))
    assert "retain NLL" not in capsys.readouterr().err
    tu.main(args(tmp_path, sft_dir, "calm", "npo", *flags[:2], "--lr", "1e-5", *flags[-2:], data="mixed", steps=8))
    assert "retain NLL" not in capsys.readouterr().err                 # a small lr: the retain NLL holds


def test_npo_lr_defaults_to_the_papers_1e5_and_the_others_keep_1e4():
    for method, want in (("npo", 1e-5), ("d2o", 1e-4), ("dro", 1e-4)):
        o = tu.Options(method=method)
        tu.fill_defaults(o)
        assert o.lr == want
    o = tu.Options(method="npo", lr=3e-4)
    tu.fill_defaults(o)
    assert o.lr == 3e-4                                                # an explicit --lr is kept


def test_npo_lowers_the_negatives_likelihood(tmp_path, sft_dir):
    tu.main(args(tmp_path, sft_dir, "npo", "npo", "--eval_interval", "4", steps=4))
    m = metrics(tmp_path / "npo")
    assert m[0]["train/rewards_negative"] == pytest.approx(0, abs=1e-6)    # the policy starts as the reference
    assert m[-1]["eval/rewards_negative"] < 0 and m[-1]["train/logps_negative"] < m[0]["train/logps_negative"]


@pytest.mark.slow
def test_d2o_draws_k_samples_once_and_resume_reuses_them(tmp_path, sft_dir, tok):
    one = tu.main(args(tmp_path, sft_dir, "one", "d2o", "--num_samples", "3", "--max_new_tokens", "8", steps=4))
    saved = [json.loads(x) for x in open(tmp_path / "one" / tu.SAMPLES_FILE)]
    prompts = {tuple(e["prompt"]) for e in tokenize_unpaired(unpaired_rows(64) + unpaired_rows(8, seed=1), tok, 64)[0]}
    assert {tuple(r["prompt_ids"]) for r in saved} == prompts
    for r in saved:
        assert len(r["sample_ids"]) == 3
        for y in r["sample_ids"]:                 # ends at its first stop token, or runs to max_new_tokens
            assert 1 <= len(y) <= 8
            assert all(t not in tok.stop_ids for t in y[:-1])
            assert y[-1] in tok.stop_ids or len(y) == 8
    assert {k: v for k, v in one.samples.items()} == {tuple(r["prompt_ids"]): r["sample_ids"] for r in saved}
    # stop at 2, resume: the same samples (the file), the same trajectory
    tu.main(args(tmp_path, sft_dir, "two", "d2o", "--num_samples", "3", "--max_new_tokens", "8", "--stop_at", "2", steps=4))
    before = open(tmp_path / "two" / tu.SAMPLES_FILE).read()
    two = tu.main(args(tmp_path, sft_dir, "two", "d2o", "--num_samples", "3", "--max_new_tokens", "8", "--resume", steps=4))
    assert open(tmp_path / "two" / tu.SAMPLES_FILE).read() == before
    assert weights_close(one.policy.state_dict(), two.policy.state_dict())
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [x["train/loss"] for x in a] == pytest.approx([x["train/loss"] for x in b], rel=1e-5)


def test_d2o_resume_without_its_samples_is_refused(tmp_path, sft_dir, capsys):
    tu.main(args(tmp_path, sft_dir, "r", "d2o", "--num_samples", "2", "--max_new_tokens", "6", "--stop_at", "1", steps=3))
    os.remove(tmp_path / "r" / tu.SAMPLES_FILE)
    one_line_error(capsys, lambda: tu.main(args(tmp_path, sft_dir, "r", "d2o", "--num_samples", "2", "--max_new_tokens",
                                                "6", "--resume", steps=3)),
                   f"{tmp_path / 'r' / tu.SAMPLES_FILE}: missing")


def test_d2o_resume_with_edited_samples_is_refused(tmp_path, sft_dir, capsys):
    """d2o_samples.jsonl is hashed like the data: a token id edited past the vocabulary between stop and resume is
    one line naming the file (it was a RuntimeError from the model's embedding), the checkpoint untouched."""
    tu.main(args(tmp_path, sft_dir, "r", "d2o", "--num_samples", "2", "--max_new_tokens", "6", "--stop_at", "1", steps=3))
    assert "D2O: sampling the reference | " in capsys.readouterr().out                # the pass shows progress
    path = tmp_path / "r" / tu.SAMPLES_FILE
    rows = [json.loads(x) for x in open(path)]
    rows[0]["sample_ids"][0][0] = 99999
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = {f: (tmp_path / "r" / "state" / f).read_bytes() for f in os.listdir(tmp_path / "r" / "state")}
    one_line_error(capsys, lambda: tu.main(args(tmp_path, sft_dir, "r", "d2o", "--num_samples", "2", "--max_new_tokens",
                                                "6", "--resume", steps=3)),
                   f"--resume: {tmp_path / 'r'} was saved by a different run (saved != now): data sha256 differs "
                   f"({tu.SAMPLES_FILE})")
    assert {f: (tmp_path / "r" / "state" / f).read_bytes() for f in os.listdir(tmp_path / "r" / "state")} == before


def test_overwrite_takes_the_previous_runs_value_model_and_samples_too(tmp_path, sft_dir):
    """value/ (DRO) and d2o_samples.jsonl (D2O) belong to their run like its model: --overwrite replaces them with
    the rest, so a new run never sits next to another run's value model or samples."""
    out = tmp_path / "o"
    tu.main(args(tmp_path, sft_dir, "o", "dro", steps=1))
    assert (out / "value" / "model.safetensors").exists()
    tu.main(args(tmp_path, sft_dir, "o", "d2o", "--num_samples", "1", "--max_new_tokens", "4", "--overwrite", steps=1))
    assert not (out / "value").exists() and (out / tu.SAMPLES_FILE).exists()
    tu.main(args(tmp_path, sft_dir, "o", "npo", "--overwrite", steps=1))
    assert not (out / tu.SAMPLES_FILE).exists() and not (out / "value").exists()
    assert not [n for n in os.listdir(out) if n.startswith(".overwritten.")]


def test_overwrite_that_fails_before_saving_gives_back_the_previous_d2o_samples(tmp_path, sft_dir, capsys,
                                                                                 monkeypatch):
    """An --overwrite D2O run draws (and writes) its samples before its first save; when it then fails, the
    previous run comes back whole: its own samples, which its --resume reuses, not the failed run's."""
    out = tmp_path / "o"
    d2o = ["--num_samples", "2", "--max_new_tokens", "4"]
    tu.main(args(tmp_path, sft_dir, "o", "d2o", *d2o, steps=1))
    before = {n: (out / n).read_bytes() for n in (tu.SAMPLES_FILE, "model.safetensors")}
    monkeypatch.setattr(tu, "d2o_loss", lambda u_samples, u_negative, beta, alpha: u_negative * float("nan"))
    one_line_error(capsys, lambda: tu.main(args(tmp_path, sft_dir, "o", "d2o", *d2o, "--seed", "1", "--overwrite",
                                                steps=1)), "non-finite loss")
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not [n for n in os.listdir(out) if n.startswith(".overwritten.")]


@pytest.mark.slow
def test_dro_trains_and_saves_both_networks_and_resumes(tmp_path, sft_dir):
    out = tu.main(args(tmp_path, sft_dir, "dro", "dro", "--value_lr", "1e-2", "--eval_interval", "4", steps=4))
    m = metrics(tmp_path / "dro")
    assert m[0]["train/value"] == 0.0                     # zero head: V(x) = 0 at the start
    assert m[-1]["train/value_grad_norm"] > 0 and m[-1]["eval/loss"] < m[0]["train/loss"] + 1
    v = ScoreModel.from_pretrained(str(tmp_path / "dro" / "value"))
    for a, b in zip(v.state_dict().values(), out.value.state_dict().values()):
        assert torch.equal(a, b)
    assert out.value.score.weight.abs().sum() > 0
    # stop after 2 steps and resume: both networks and both optimizers come back
    tu.main(args(tmp_path, sft_dir, "two", "dro", "--value_lr", "1e-2", "--eval_interval", "4", "--stop_at", "2", steps=4))
    two = tu.main(args(tmp_path, sft_dir, "two", "dro", "--value_lr", "1e-2", "--eval_interval", "4", "--resume", steps=4))
    assert weights_close(out.policy.state_dict(), two.policy.state_dict())
    assert weights_close(out.value.state_dict(), two.value.state_dict())


BAD = [
    ("npo", ["--tau", "0.5"], "--tau applies only with --method dro (got npo)"),
    ("dro", ["--retain_coef", "1"], "--retain_coef applies only with --method npo (got dro)"),
    ("d2o", ["--retain_warn", "2"], "--retain_warn applies only with --method npo (got d2o)"),
    ("npo", ["--retain_warn", "-1"], "--retain_warn"),
    ("npo", ["--alpha", "0.1"], "--alpha applies only with --method d2o (got npo)"),
    ("dro", ["--beta", "0.5"], "--beta applies only with --method other than dro (got dro)"),
    ("d2o", ["--num_samples", "0"], "--num_samples"),
    ("npo", ["--beta", "0"], "--beta"),
    ("dro", ["--tau", "-1"], "--tau"),
    ("dro", ["--value_lr", "0"], "--value_lr"),
    ("npo", ["--method", "ppo"], "argument --method: invalid choice"),
]


@pytest.mark.parametrize("method,flags,msg", BAD, ids=[f"{m}{''.join(f)}" for m, f, _ in BAD])
def test_bad_flags_are_one_line_errors_before_any_work(tmp_path, sft_dir, capsys, method, flags, msg):
    one_line_error(capsys, lambda: tu.main(args(tmp_path, sft_dir, "o", method, *flags)), msg)
    assert not (tmp_path / "o").exists()


def test_bad_scored_data_is_one_line_error(tmp_path, sft_dir, capsys):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "completion": " c", "score": 1},
                                                {"prompt": "p", "completion": " c", "score": float("inf")}])
    one_line_error(capsys, lambda: tu.main(args(tmp_path, sft_dir, "o", "dro", data="bad")),
                   f"{path}:2: field 'score' must be a finite number")


@pytest.mark.slow
def test_dro_ddp_two_ranks_equal_one_process(tmp_path, sft_dir):
    run(["train_unpaired.py"] + args(tmp_path, sft_dir, "one", "dro", "--batch_size", "4", "--grad_accum", "2",
                                     "--value_lr", "1e-2"))
    run(["train_unpaired.py"] + args(tmp_path, sft_dir, "two", "dro", "--batch_size", "2", "--grad_accum", "2",
                                     "--value_lr", "1e-2"), nproc=2)
    from safetensors.torch import load_file
    for f in ("model.safetensors", "value/model.safetensors"):
        assert weights_close(load_file(str(tmp_path / "one" / f)), load_file(str(tmp_path / "two" / f))), f
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for x, y in zip(a, b):
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-5)
        assert x["train/value"] == pytest.approx(y["train/value"], rel=1e-5, abs=1e-7)


# ---- the built-in task ------------------------------------------------------------------------------

@pytest.mark.parametrize("method,extra", [("npo", []), ("npo", ["--retain_coef", "1"]),
                                          ("d2o", ["--num_samples", "2", "--max_new_tokens", "8"]), ("dro", [])])
def test_every_method_end_to_end_on_the_builtin_task(tmp_path_factory, sft_dir, capsys, monkeypatch, method, extra):
    data = tmp_path_factory.getbasetemp() / "builtin_unpaired"
    if not (data / "task.json").exists():
        synthetic.write_dataset(str(data), seed=0, n_sft=40, n_pref=40, n_unpaired=200, n_prompts=10, n_eval_prompts=8)
    if method == "dro":                 # a data/ written before scored.jsonl existed gets just that file added
        (data / synthetic.SCORED_FILE).unlink(missing_ok=True)
    monkeypatch.setattr(data_mod, "BUILTIN_DIR", str(data))
    out = tmp_path_factory.mktemp(method)
    capsys.readouterr()
    tu.main(["--method", method, "--init", sft_dir, "--out_dir", str(out), "--max_steps", "2", "--batch_size", "4",
             "--eval_interval", "0", "--log_interval", "1", *extra])
    stdout = capsys.readouterr().out
    m = metrics(out)
    assert len(m) == 2 and all(math.isfinite(x["train/loss"]) for x in m) and "eval/loss" in m[-1], stdout
    assert (out / "model.safetensors").exists()
    counts = stdout.split(" train examples (")[1].split(")")[0]        # kept K, truncated T, dropped D
    kept, dropped = (int(counts.split(f"{k} ")[1].split(",")[0]) for k in ("kept", "dropped"))
    rows = [json.loads(x) for x in open(data / ("scored.jsonl" if method == "dro" else "unpaired.jsonl"))]
    usable = len(rows) if method == "dro" or extra[:1] == ["--retain_coef"] else sum(not r["label"] for r in rows)
    assert kept + dropped == usable - max(1, int(usable * 0.05))     # the negatives only, unless retained
