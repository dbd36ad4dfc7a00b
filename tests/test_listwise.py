"""Listwise preference: float64 oracles for RRHF, PRO and LiPO-λ (values and gradients), the listwise data kind
(validation, conversational rows, pair expansion), DPO on listwise data, every method end to end on the built-in
task, and DDP two ranks ≡ one process.

The oracles are written from the papers, in float64, one prompt at a time with plain Python loops:
  RRHF   Σ_{ψ_i < ψ_j} max(0, p_i − p_j)     (Yuan et al. 2023, eq. 2; subgradient 0 at the hinge)
  PRO    −Σ_k log[exp(p_k/T_k^k) / Σ_{i≥k} exp(p_i/T_k^i)],  T_k^i = 1/(ψ_k − ψ_i), T_k^k = min_{i>k} T_k^i,
         ranking by ψ descending (stable); a tie gives T = ∞, i.e. p/T = 0       (Song et al. 2023)
  LiPO-λ −Σ_{ψ_i > ψ_j} Δ_ij log σ(s_i − s_j),  Δ_ij = |G_i − G_j|·|1/D(τ_i) − 1/D(τ_j)|, G = 2^ψ − 1,
         D(τ) = log₂(1 + τ), τ = rank by s (1 = top), Δ a constant                  (Liu et al. 2024)
"""
import json
import math
import random
import types

import pytest
import torch
from safetensors.torch import load_file

import train_dpo
import train_listwise as L
from conftest import SMALL, metrics, pref_rows, run, weights_close, write_jsonl
from nano_rlhf.tasks import synthetic
from nano_rlhf.data import DataError, collate_listwise, listwise_to_pairs, load_records, tokenize_listwise
from nano_rlhf.model import GPT

D64 = torch.float64


# ---- float64 references, from the papers only ------------------------------------------------------

def nls(x):
    """−log σ(x), stable for any float64 x."""
    return torch.nn.functional.softplus(-x) if abs(float(x.detach())) < 30 else (-x if x < 0 else torch.exp(-x))


def ref_rrhf(p, psi):
    total = torch.zeros((), dtype=D64)
    for i in range(len(p)):
        for j in range(len(p)):
            if psi[i] < psi[j]:
                d = p[i] - p[j]
                total = total + (d if d > 0 else d * 0)
    return total


def ref_pro(p, psi):
    order = sorted(range(len(p)), key=lambda i: -psi[i])        # stable: ties keep their order
    total = torch.zeros((), dtype=D64)
    for a in range(len(order) - 1):
        k, rest = order[a], order[a + 1:]
        temps = [1 / (psi[k] - psi[i]) if psi[k] != psi[i] else math.inf for i in rest]
        t_kk = min(temps)
        scaled = lambda v, t: v / t if math.isfinite(t) else v * 0
        logits = [scaled(p[k], t_kk)] + [scaled(p[i], t) for i, t in zip(rest, temps)]
        total = total - (logits[0] - torch.logsumexp(torch.stack(logits), 0))
    return total


def ref_lambda_weights(s, psi):
    K = len(s)
    by_s = sorted(range(K), key=lambda i: -float(s[i].detach() if torch.is_tensor(s[i]) else s[i]))
    tau = {i: r + 1 for r, i in enumerate(by_s)}
    G = [2.0 ** x - 1 for x in psi]
    inv_d = [1 / math.log2(1 + tau[i]) for i in range(K)]
    return [[abs(G[i] - G[j]) * abs(inv_d[i] - inv_d[j]) for j in range(K)] for i in range(K)]


def ref_lipo(s, psi):
    delta = ref_lambda_weights(s, psi)
    total = torch.zeros((), dtype=D64)
    for i in range(len(s)):
        for j in range(len(s)):
            if psi[i] > psi[j]:
                total = total + delta[i][j] * nls(s[i] - s[j])
    return total


LOSSES = {"rrhf": (L.rrhf_rank_loss, ref_rrhf), "pro": (L.pro_loss, ref_pro), "lipo": (L.lipo_lambda_loss, ref_lipo)}


def random_lists(seed, sizes=(2, 4, 3, 5), tie=True, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    rows, scores, group = [], [], []
    for n, K in enumerate(sizes):
        rows += (torch.randn(K, generator=g, dtype=D64) * scale - 1).tolist()
        psi = [round(float(x), 1) for x in torch.randn(K, generator=g, dtype=D64)]
        if tie and K > 2:
            psi[1] = psi[0]                                  # a tie in every list that can afford one
        scores += psi
        group += [n] * K
    return torch.tensor(rows, dtype=D64), torch.tensor(scores, dtype=D64), torch.tensor(group), len(sizes)


def check_against_oracle(name, x, scores, group, P):
    fn, ref = LOSSES[name]
    a = x.clone().requires_grad_(True)
    grid, mask = L.to_grid(a, group, P)
    score, _ = L.to_grid(scores, group, P)
    got = fn(grid, score, mask)
    got.sum().backward()
    b = x.clone().requires_grad_(True)
    want = torch.stack([ref([b[r] for r in range(len(b)) if group[r] == n],
                            [float(scores[r]) for r in range(len(b)) if group[r] == n]) for n in range(P)])
    want.sum().backward()
    assert got.dtype == D64
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    return got


@pytest.mark.parametrize("name", ["rrhf", "pro", "lipo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_losses_match_float64_oracles_with_varying_k_and_ties(name, seed):
    x, scores, group, P = random_lists(seed)
    got = check_against_oracle(name, x, scores, group, P)
    assert (got > 0).any()                                   # not vacuously zero


@pytest.mark.parametrize("name", ["rrhf", "pro", "lipo"])
@pytest.mark.parametrize("scale", [1e4, 1e-8])
def test_huge_and_tiny_values_stay_finite_and_match(name, scale):
    x, scores, group, P = random_lists(5, scale=scale)
    x[0], x[1] = -3e4 * (scale > 1), 2e4 * (scale > 1)       # extreme log-probs / log-ratios
    check_against_oracle(name, x, scores, group, P)


def test_rrhf_hinge_boundary_and_ties():
    psi = torch.tensor([[0.0, 1.0]], dtype=D64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    for gap, value, grad in ((0.0, 0.0, 0.0), (1e-6, 1e-6, 1.0), (-1e-6, 0.0, 0.0)):
        p = torch.tensor([[-2.0 + gap, -2.0]], dtype=D64, requires_grad=True)   # the worse one, p_0 − p_1 = gap
        loss = L.rrhf_rank_loss(p, psi, mask)
        loss.sum().backward()
        assert loss.item() == pytest.approx(value, abs=1e-15)
        assert p.grad[0].tolist() == pytest.approx([grad, -grad])
    # a tie is no preference: however wrong the order, nothing to pay
    p = torch.tensor([[0.0, -5.0]], dtype=D64)
    assert L.rrhf_rank_loss(p, torch.tensor([[1.0, 1.0]], dtype=D64), mask).item() == 0.0


def test_pro_k2_is_the_pairwise_form_with_the_score_gap_as_inverse_temperature():
    g = torch.Generator().manual_seed(3)
    p = torch.randn(8, 2, generator=g, dtype=D64, requires_grad=True)
    psi = torch.randn(8, 2, generator=g, dtype=D64)
    loss = L.pro_loss(p, psi, torch.ones(8, 2, dtype=torch.bool))
    w, l = psi.argmax(1), psi.argmin(1)
    pw, pl = p.gather(1, w[:, None]).squeeze(1), p.gather(1, l[:, None]).squeeze(1)
    gap = (psi.amax(1) - psi.amin(1))
    want = torch.stack([nls(x) for x in gap * (pw - pl)])     # −log σ((ψ_1 − ψ_2)(p_1 − p_2))
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    ga, = torch.autograd.grad(loss.sum(), p)
    gb, = torch.autograd.grad(want.sum(), p)
    torch.testing.assert_close(ga, gb)


def test_pro_temperatures_by_hand():
    """K = 3, ψ = (2, 1, 0): the top term uses 1/T_1^1 = max(1, 2) = 2, 1/T_1^2 = 1, 1/T_1^3 = 2; the second
    1/T_2^2 = 1/T_2^3 = 1. A tie below the top (ψ = 2, 2, 0) enters the top term as exp(0)."""
    p = torch.tensor([[-1.0, -2.0, -3.0]], dtype=D64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    e = math.exp
    want = -math.log(e(-2) / (e(-2) + e(-2) + e(-6))) - math.log(e(-2) / (e(-2) + e(-3)))
    assert L.pro_loss(p, torch.tensor([[2.0, 1.0, 0.0]], dtype=D64), mask).item() == pytest.approx(want, rel=1e-12)
    want_tie = -math.log(e(-2) / (e(-2) + e(0) + e(-6))) - math.log(e(-4) / (e(-4) + e(-6)))
    assert L.pro_loss(p, torch.tensor([[2.0, 2.0, 0.0]], dtype=D64), mask).item() == pytest.approx(want_tie, rel=1e-12)
    # the ranking comes from the scores, not the column order
    perm = [2, 0, 1]
    assert L.pro_loss(p[:, perm], torch.tensor([[2.0, 1.0, 0.0]], dtype=D64)[:, perm], mask).item() == \
        pytest.approx(want, rel=1e-12)


def test_lipo_lambda_weights_by_hand():
    s = torch.tensor([[0.3, 0.1, 0.2]], dtype=D64)
    psi = torch.tensor([[1.0, 0.0, 2.0]], dtype=D64)
    # τ = (1, 3, 2); G = (1, 0, 3); 1/D = (1, 1/2, 1/log₂3)
    d = L.lambda_weights(s, psi, torch.ones(1, 3, dtype=torch.bool))[0]
    c = 1 / math.log2(3)
    assert d[0, 1].item() == pytest.approx(1 * 0.5)
    assert d[0, 2].item() == pytest.approx(2 * (1 - c))
    assert d[1, 2].item() == pytest.approx(3 * (c - 0.5))
    assert torch.equal(d, d.T) and (d.diagonal() == 0).all()
    torch.testing.assert_close(d, torch.tensor(ref_lambda_weights(s[0].tolist(), psi[0].tolist()), dtype=D64))


def test_lipo_k2_is_dpo_times_the_lambda_constant():
    g = torch.Generator().manual_seed(4)
    beta = 0.1
    u = torch.randn(6, 2, generator=g, dtype=D64) * 5           # log π/π_ref of two responses, chosen first
    psi = torch.tensor([[1.5, 0.5]] * 6, dtype=D64)
    s = (beta * u).requires_grad_(True)
    loss = L.lipo_lambda_loss(s, psi, torch.ones(6, 2, dtype=torch.bool))
    const = abs(2 ** 1.5 - 2 ** 0.5) * (1 - 1 / math.log2(3))
    want = const * train_dpo.dpo_loss(u[:, 0] - u[:, 1], beta)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    ga, = torch.autograd.grad(loss.sum(), s)
    assert ga[:, 0].tolist() == pytest.approx((-ga[:, 1]).tolist())
    assert (ga[:, 0] < 0).all()                                   # descent raises the chosen response's reward


def test_lipo_weights_carry_no_gradient():
    s = torch.tensor([[0.3, 0.1, 0.2]], dtype=D64, requires_grad=True)
    psi = torch.tensor([[1.0, 0.0, 2.0]], dtype=D64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert not L.lambda_weights(s, psi, mask).requires_grad
    loss = L.lipo_lambda_loss(s, psi, mask)
    g, = torch.autograd.grad(loss.sum(), s)
    assert g.sum().item() == pytest.approx(0.0, abs=1e-14)        # pairwise differences only


# ---- data --------------------------------------------------------------------------------------------

def lw_rows(n=48, seed=0):
    """Listwise rows from the shared preference fixture: K = 2 .. 5 per row, ties in some."""
    r = random.Random(seed)
    rows = []
    for p in pref_rows(n, seed):
        K = r.randint(2, 5)
        extra = [f" the motor is{' fine' * i}." for i in range(1, K - 1)]
        scores = [2.0, -1.0] + [r.choice([0.0, 0.5, 2.0]) for _ in extra]
        rows.append({"prompt": p["prompt"], "completions": [p["chosen"], p["rejected"]] + extra, "scores": scores})
    return rows


BAD = [
    ({"prompt": "x", "completions": [" a."], "scores": [1]}, "needs at least two responses to rank, got 1"),
    ({"prompt": "x", "completions": [" a.", " b."], "scores": [1]}, "'scores' has 1 value(s) but 'completions' has 2"),
    ('{"prompt": "x", "completions": [" a.", " b."], "scores": [1, NaN]}', "'scores[1]' must be a finite number, got nan"),
    ('{"prompt": "x", "completions": [" a.", " b."], "scores": [Infinity, 1]}', "'scores[0]' must be a finite number"),
    ({"prompt": "x", "completions": [" a.", " b."], "scores": ["1", 2]}, "'scores[0]' must be a finite number, got '1'"),
    ({"prompt": "x", "completions": [" a.", " b."], "scores": [True, 2]}, "'scores[0]' must be a finite number, got True"),
    ({"prompt": "x", "completions": [" a.", "  "], "scores": [1, 2]}, "field 'completions[1]' is empty"),
    ({"prompt": "x", "completions": " a.", "scores": [1, 2]}, "field 'completions' must be a list, got str"),
    ({"prompt": "x", "completions": [" a.", " b."]}, "missing field 'scores'"),
    ({"prompt": "x", "completions": [" a.", [{"role": "assistant", "content": "b"}]], "scores": [1, 2]},
     "'completions[1]' is a message list but 'prompt' is a string"),
    ({"prompt": [{"role": "user", "content": "x"}], "completions": [[{"role": "assistant", "content": "a"}],
                                                                    [{"role": "user", "content": "b"}]],
      "scores": [1, 2]}, "completions[1][0].role: must be 'assistant'"),
]


@pytest.mark.parametrize("row,words", BAD)
def test_bad_listwise_rows_name_file_line_and_field(tmp_path, row, words):
    good = lw_rows(2)
    path = write_jsonl(tmp_path / "lw.jsonl", good + [row])
    with pytest.raises(DataError) as e:
        load_records(path, "listwise")
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and words in msg and "\n" not in msg, msg


def test_bad_listwise_file_stops_the_script_with_one_line(tmp_path, sft_dir):
    path = write_jsonl(tmp_path / "lw.jsonl", lw_rows(3) + [BAD[1][0]])
    p = run(["train_listwise.py", "--data", path, "--init", sft_dir, "--out_dir", str(tmp_path / "o")], check=False)
    assert p.returncode != 0
    assert p.stderr.strip() == f"error: {path}:4: field 'scores' has 1 value(s) but 'completions' has 2"
    assert not (tmp_path / "o" / "model.safetensors").exists()


def tied_rows(n):
    """Listwise rows whose scores all tie: no preference in any of them."""
    return [{**r, "scores": [1.5] * len(r["scores"])} for r in lw_rows(n)]


@pytest.mark.parametrize("tied", ["data", "eval_data"])
def test_a_file_whose_lists_all_tie_is_refused_like_dpo_listwise_pairs(tmp_path, sft_dir, tied, capsys):
    """Every loss is 0 with no gradient on such a file: one line before training, as train_dpo.py refuses it."""
    files = {"data": write_jsonl(tmp_path / "d.jsonl", lw_rows(8)),
             "eval_data": write_jsonl(tmp_path / "e.jsonl", lw_rows(4, 1))}
    files[tied] = write_jsonl(tmp_path / "t.jsonl", tied_rows(8))
    args = ["--data", files["data"], "--eval_data", files["eval_data"], "--init", sft_dir]
    want = f"error: {files[tied]}: no listwise row has two different scores"
    for loss in ("rrhf", "lipo"):
        err = one_line_exit(capsys, L.main, ["--loss", loss, *args, "--out_dir", str(tmp_path / loss)])
        assert err.startswith(want), err
        assert not (tmp_path / loss / "model.safetensors").exists() and not (tmp_path / loss / "metrics.jsonl").exists()
    err = one_line_exit(capsys, train_dpo.main, ["--listwise_pairs", "all", *args, "--out_dir", str(tmp_path / "o")])
    assert err.startswith(want), err


def test_top1_accuracy_leaves_out_lists_whose_scores_all_tie(monkeypatch):
    """A tied list has every response "best": it must not count as a top-1 hit (nor as a miss). Two lists: one
    all tied, one ranked [2, 0] whose best response the policy ranks below the other -> top-1 is 0/1, not 1/2."""
    ex = [{"prompt": [5, 6], "completions": [[7], [8]], "scores": [1.0, 1.0]},
          {"prompt": [5, 6], "completions": [[7], [8]], "scores": [2.0, 0.0]}]
    batch = L.make_batch(ex, 0, "cpu")
    monkeypatch.setattr(L, "sequence_logps", lambda *a: (torch.tensor([-1.0, -2.0, -3.0, -1.0]), torch.ones(4)))
    opts = types.SimpleNamespace(loss="rrhf", dtype="float32", beta=0.1)
    sums = L.zero_sums()
    L.add_to(sums, L.micro_step(opts, None, None, batch), batch)
    got = L.means(sums)
    assert sums["n_ranked"] == 1 and got["top1_accuracy"] == 0.0 and got["pair_accuracy"] == 0.0
    monkeypatch.setattr(L, "sequence_logps", lambda *a: (torch.tensor([-1.0, -2.0, -1.0, -3.0]), torch.ones(4)))
    sums = L.zero_sums()
    L.add_to(sums, L.micro_step(opts, None, None, batch), batch)
    assert L.means(sums)["top1_accuracy"] == 1.0


def test_conversational_rows_tokenize_and_collate(tmp_path, tok):
    chat = {"prompt": [{"role": "user", "content": "review the phone"}],
            "completions": [[{"role": "assistant", "content": "great"}], [{"role": "assistant", "content": "bad"}],
                            [{"role": "assistant", "content": "the screen is fine"}]], "scores": [1, -1, 0]}
    recs = load_records(write_jsonl(tmp_path / "c.jsonl", [chat] + lw_rows(1)), "listwise")
    ex, st = tokenize_listwise(recs, tok, 64)
    assert st["kept"] == 2 and [len(e["completions"]) for e in ex] == [3, len(lw_rows(1)[0]["completions"])]
    assert ex[0]["prompt"] == tok.render_prompt(chat["prompt"])
    assert ex[0]["completions"][1] == tok.encode_response(chat["completions"][1])
    ids, attn, resp, group, scores = collate_listwise(ex, tok.pad_id)
    K0 = 3
    assert group.tolist() == [0] * K0 + [1] * (len(ids) - K0) and scores[:K0].tolist() == [1.0, -1.0, 0.0]
    for r in range(len(ids)):                                     # each row = prompt + its completion, right-padded
        e = ex[group[r]]
        c = e["completions"][r - (0 if r < K0 else K0)]
        n = len(e["prompt"]) + len(c)
        assert ids[r, :n].tolist() == e["prompt"] + c and attn[r].sum() == n
        assert resp[r].tolist() == [0] * len(e["prompt"]) + [1] * len(c) + [0] * (ids.shape[1] - n)


def test_listwise_to_pairs_all_and_best_worst():
    recs = [{"prompt": "x", "completions": ["a", "b", "c", "d"], "scores": [3.0, 1.0, 3.0, 0.0], "_where": "f:1"},
            {"prompt": "y", "completions": ["e", "f"], "scores": [2.0, 2.0], "_where": "f:2"}]
    pairs, empty = listwise_to_pairs(recs, "all")
    assert sorted((p["chosen"], p["rejected"]) for p in pairs) == \
        [("a", "b"), ("a", "d"), ("b", "d"), ("c", "b"), ("c", "d")]          # the tie a ~ c is skipped
    assert empty == 1 and all(p["prompt"] == "x" and p["_where"] == "f:1" for p in pairs)
    pairs, empty = listwise_to_pairs(recs, "best_worst")
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [("a", "d")] and empty == 1


def test_dpo_expands_listwise_data_into_pairs(tmp_path, tok):
    rows = lw_rows(20)
    path = write_jsonl(tmp_path / "lw.jsonl", rows)
    ev = write_jsonl(tmp_path / "lw_eval.jsonl", lw_rows(4, seed=1))
    n_all = sum(sum(a > b for a in r["scores"] for b in r["scores"]) for r in rows)
    for mode, want in (("auto", n_all), ("all", n_all), ("best_worst", len(rows))):
        opts = types.SimpleNamespace(loss="dpo", listwise_pairs=mode, eval_fraction=0.05, seed=0)
        train, evals, _ = train_dpo.load_examples(opts, {"data": path, "eval_data": ev}, tok, 64)
        assert len(train) == want, mode
        got = {(tuple(e["chosen"]), tuple(e["rejected"])) for e in train}
        for r in rows:                                            # best vs worst is always among them
            b, w = r["scores"].index(max(r["scores"])), r["scores"].index(min(r["scores"]))
            assert (tuple(tok.encode_response(r["completions"][b])),
                    tuple(tok.encode_response(r["completions"][w]))) in got
    # without --eval_data the split is made on rows: no prompt's pairs on both sides
    opts = types.SimpleNamespace(loss="dpo", listwise_pairs="all", eval_fraction=0.25, seed=0)
    train, evals, _ = train_dpo.load_examples(opts, {"data": path, "eval_data": None}, tok, 64)
    assert len(train) + len(evals) == n_all and len(evals) > 0


def one_line_exit(capsys, main, argv):
    """main(argv) must stop with a non-zero exit and exactly one stderr line; returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code != 0 and "\n" not in err, err
    return err


def test_dpo_listwise_flag_on_pairs_data_is_one_line(tmp_path, sft_dir, capsys):
    path = write_jsonl(tmp_path / "pref.jsonl", pref_rows(8))
    err = one_line_exit(capsys, train_dpo.main, ["--data", path, "--listwise_pairs", "best_worst", "--init", sft_dir,
                                                 "--out_dir", str(tmp_path / "o")])
    assert err == f"error: --listwise_pairs best_worst: {path} is not listwise data (its first row has no 'completions' field)"
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_flags_the_loss_would_ignore_are_errors(tmp_path, sft_dir, capsys):
    for args, msg in ((["--loss", "rrhf", "--beta", "0.2"], "error: --beta applies only with --loss lipo (got rrhf)"),
                      (["--loss", "pro", "--ref", sft_dir], "error: --ref applies only with --loss lipo (got pro)")):
        assert one_line_exit(capsys, L.main, [*args, "--init", sft_dir, "--out_dir", str(tmp_path / "o")]).startswith(msg)


# ---- the built-in task, end to end ---------------------------------------------------------------



def test_synthetic_listwise_files_are_valid_ranked_and_leave_other_files_alone(tmp_path):
    synthetic.write_dataset(str(tmp_path / "a"), seed=0, **SMALL)
    synthetic.write_dataset(str(tmp_path / "b"), seed=0, **{**SMALL, "n_listwise": 10})
    for f in ("sft.jsonl", "preference.jsonl", "unpaired.jsonl", "prompts.jsonl", "task.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    rows = load_records(str(tmp_path / "a" / "listwise.jsonl"), "listwise")
    evals = load_records(str(tmp_path / "a" / "listwise_eval.jsonl"), "listwise")
    assert len(rows) + len(evals) == 60 and len(evals) == 3
    for r in rows:
        assert len(r["completions"]) == synthetic.LISTWISE_K == len(set(r["completions"]))
        assert synthetic.is_task_prompt(r["prompt"])
    # noisy scores: they follow the gold reward, but not always
    agree = [(a > b) == (synthetic.gold_reward(r["prompt"], ca) > synthetic.gold_reward(r["prompt"], cb))
             for r in rows for ca, a in zip(r["completions"], r["scores"]) for cb, b in zip(r["completions"], r["scores"])
             if synthetic.gold_reward(r["prompt"], ca) != synthetic.gold_reward(r["prompt"], cb)]
    assert 0.6 < sum(agree) / len(agree) < 0.97


def lw_args(data_dir, sft_dir, out, loss, *extra, steps=3):
    return ["--loss", loss, "--data", str(data_dir / "listwise.jsonl"), "--eval_data", str(data_dir / "listwise_eval.jsonl"),
            "--init", sft_dir, "--out_dir", str(out), "--max_steps", str(steps), "--batch_size", "4",
            "--log_interval", "1", "--eval_interval", "0", "--lr", "1e-3", "--warmup_steps", "0", *extra]


@pytest.mark.parametrize("loss", ["rrhf", "pro", "lipo"])
def test_each_method_end_to_end_on_the_builtin_task(tmp_path, task_dir, sft_dir, loss):
    out = L.main(lw_args(task_dir, sft_dir, tmp_path / loss, loss))
    m = metrics(tmp_path / loss)
    assert [x["step"] for x in m] == [1, 2, 3] and all(math.isfinite(x["train/loss"]) for x in m)
    assert 0 <= m[-1]["eval/pair_accuracy"] <= 1 and "eval/top1_accuracy" in m[-1]
    assert (out.ref is not None) == (loss == "lipo")
    if loss == "lipo":      # policy = reference at step 1: s = 0, every pair pays Δ·log 2, and no pair is "right"
        assert m[0]["train/pair_accuracy"] == 0 and m[0]["train/value_mean"] == 0
    saved = GPT.from_pretrained(str(tmp_path / loss))
    fresh = GPT.from_pretrained(sft_dir)
    assert any(not torch.equal(a, b) for a, b in zip(saved.state_dict().values(), fresh.state_dict().values()))


def test_first_step_loss_equals_the_oracle_on_real_log_probs(tmp_path, task_dir, sft_dir, tok):
    """The script's step-1 train loss (mean over the step's prompts) + NLL is the formula on the same examples."""
    L.main(lw_args(task_dir, sft_dir, tmp_path / "o", "pro", "--nll_coef", "0.5", steps=1))
    got = metrics(tmp_path / "o")[0]
    recs = load_records(str(task_dir / "listwise.jsonl"), "listwise")
    ex, _ = tokenize_listwise(recs, tok, 64)
    from nano_rlhf.data import Batches
    idx = Batches(len(ex), 4, 1, seed=0).next_step()[0]
    model = GPT.from_pretrained(sft_dir)
    losses, nll, n_tok = [], 0.0, 0
    with torch.no_grad():
        for i in idx:
            e = ex[i]
            ps = []
            for c in e["completions"]:
                ids = torch.tensor([e["prompt"] + c])
                lp = torch.log_softmax(model(ids)[0, :-1].double(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
                ps.append(lp[len(e["prompt"]) - 1:])
            losses.append(ref_pro([x.mean() for x in ps], e["scores"]))
            best = ps[e["scores"].index(max(e["scores"]))]
            nll, n_tok = nll - best.sum().item(), n_tok + len(best)
    assert got["train/loss"] == pytest.approx(sum(x.item() for x in losses) / 4, rel=1e-4)
    assert got["train/nll"] == pytest.approx(nll / n_tok, rel=1e-4)


def test_an_old_data_directory_gets_its_listwise_files(tmp_path, monkeypatch):
    from nano_rlhf import data as data_mod
    d = tmp_path / "d"
    synthetic.write_dataset(str(d), seed=3, **SMALL)
    want = (d / "listwise_eval.jsonl").read_bytes()
    for f in ("listwise.jsonl", "listwise_eval.jsonl"):
        (d / f).unlink()
    monkeypatch.setattr(data_mod, "BUILTIN_DIR", str(d))
    before = {f.name: f.read_bytes() for f in d.iterdir()}
    opts = types.SimpleNamespace(data="", eval_data="")
    assert L.data_files(opts) == {"data": str(d / "listwise.jsonl"), "eval_data": str(d / "listwise_eval.jsonl")}
    # written with the task's own seed (3, from task.json), at the default row count; the rest untouched
    assert (d / "listwise_eval.jsonl").read_bytes().startswith(want.split(b"\n")[0] + b"\n")
    assert len(load_records(str(d / "listwise.jsonl"), "listwise")) == 1900
    assert all((d / k).read_bytes() == v for k, v in before.items())


def test_dpo_end_to_end_on_listwise_data(tmp_path, task_dir, sft_dir):
    out = train_dpo.main(["--data", str(task_dir / "listwise.jsonl"), "--eval_data", str(task_dir / "listwise_eval.jsonl"),
                          "--listwise_pairs", "best_worst", "--init", sft_dir, "--out_dir", str(tmp_path / "o"),
                          "--max_steps", "2", "--batch_size", "4", "--log_interval", "1"])
    m = metrics(tmp_path / "o")
    assert m[0]["train/loss"] == pytest.approx(math.log(2), rel=1e-5) and out.options.listwise_pairs == "best_worst"


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_process(tmp_path, task_dir, sft_dir):
    """LiPO with an NLL term: λ-weights per prompt, the global prompt count and best-token count, on two ranks
    (batch 2 each) as in one process (batch 4), both with 2 micro-batches."""
    args = lambda out, b: lw_args(task_dir, sft_dir, tmp_path / out, "lipo", "--batch_size", b, "--grad_accum", "2",
                                  "--nll_coef", "0.5", "--eval_interval", "3")
    run(["train_listwise.py"] + args("one", "4"))
    p = run(["train_listwise.py"] + args("two", "2"), nproc=2)
    assert "saved" in p.stdout
    assert weights_close(load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors"))
    la, lb = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("train/loss", "train/nll", "train/grad_norm", "train/pair_accuracy"):
        assert [x[key] for x in la] == pytest.approx([x[key] for x in lb], rel=1e-4, abs=1e-7), key
    for key in ("eval/loss", "eval/pair_accuracy", "eval/top1_accuracy"):
        assert la[-1][key] == pytest.approx(lb[-1][key], rel=1e-4, abs=1e-7), key


@pytest.mark.slow      # four training runs and an evaluation in subprocesses, ~1-2 minutes on a busy 2-core machine
def test_survey_script_reuses_the_pipeline_models_and_prints_the_table(tmp_path, sft_dir, rm_dir):
    import os
    import shutil
    import subprocess
    import sys
    from conftest import ROOT
    out = tmp_path / "out"
    shutil.copytree(sft_dir, out / "sft")
    shutil.copytree(rm_dir, out / "rm")
    env = dict(os.environ, TINY="1", OUT=str(out), DATA=str(tmp_path / "data"), PYTHON=sys.executable,
               OMP_NUM_THREADS="2")
    p = subprocess.run(["bash", "scripts/survey.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert f"reusing {out}/sft" in lines and f"reusing {out}/rm" in lines
    # (PAFT's SFT branch is a new run from the reused model, into its own directory)
    assert not any(f"--out_dir {out}/sft " in ln or f"--out_dir {out}/rm " in ln for ln in lines if ln.startswith("+ "))
    policies = ["sft", "rrhf", "pro", "lipo", "dpo_listwise", "npo", "d2o", "dro", "tdpo", "paft_sft", "paft_dpo",
                "paft", "dpo_offline_matched", "online_dpo", "online_dpo_gold", "dno", "sppo", "nash_md", "cringe", "spo"]
    for name in policies[1:]:
        GPT.from_pretrained(str(out / name))
        assert (out / name / "metrics.jsonl").exists() or name == "paft"    # PAFT's model is a merge, not a run
    table = [ln for ln in lines if ln.startswith("| ")]
    assert [ln.split(" | ")[0][2:] for ln in table[1:]] == policies
    results = json.loads((out / "survey.json").read_text())
    assert [r["name"] for r in results] == policies and "kl" in results[1] and "gold_reward" in results[1]
    # every trained policy's wall-clock time is in the table (the merged PAFT model and SFT were not trained here)
    assert "training time" in table[0]
    assert all(("train_seconds" in r) == (r["name"] not in ("sft", "paft")) for r in results)
