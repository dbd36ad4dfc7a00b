"""TDPO₂ and PAFT's L1 term in train_dpo.py: float64 oracles written from the papers (Zeng et al. 2024, TDPO₂;
Pentyala et al. 2024, the L1 sparsity penalty), the chunked full-vocabulary KL against an unchunked float64 one,
and both end to end. See docs/algorithms.md, "TDPO" and "PAFT"."""
import json
import math

import pytest
import torch

import train_dpo
from conftest import pref_rows, tiny_model, write_jsonl
from numerics import assert_close64
from nano_rlhf.data import collate_pairs, tokenize_pairs


def oracle_log_sigmoid(z):
    """log σ(z) in float64, stable on both sides: −log(1 + e^{−z}) = min(z, 0) − log1p(e^{−|z|})."""
    return torch.minimum(z, torch.zeros_like(z)) - torch.log1p(torch.exp(-z.abs()))


def oracle_tdpo2(u_w, u_l, kl_w, kl_l, beta, alpha):
    """The paper's TDPO₂ written out: u = β·log π/π_ref(y_w) − β·log π/π_ref(y_l),
    δ₂ = β·D_SeqKL(x, y_l) − sg(β·D_SeqKL(x, y_w)), L = −log σ(u − α·δ₂)."""
    u = beta * u_w - beta * u_l
    delta2 = beta * kl_l - (beta * kl_w).detach()
    return -oracle_log_sigmoid(u - alpha * delta2)


@pytest.mark.parametrize("scale", [1e-6, 1.0, 50.0, 1e3])
def test_tdpo_loss_values_and_gradients_match_float64_oracle(scale):
    g = torch.Generator().manual_seed(0)
    leaves = [(torch.randn(9, generator=g, dtype=torch.float64) * scale).requires_grad_() for _ in range(4)]
    u_w, u_l, kl_w, kl_l = leaves
    with torch.no_grad():                     # KLs are non-negative
        kl_w.abs_(), kl_l.abs_()
    beta, alpha = 0.3, 0.7
    got = train_dpo.tdpo_loss(u_w - u_l, kl_w, kl_l, beta, alpha)
    want = oracle_tdpo2(u_w, u_l, kl_w, kl_l, beta, alpha)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got = torch.autograd.grad(got.sum(), leaves, allow_unused=True)
    g_want = torch.autograd.grad(want.sum(), leaves, allow_unused=True)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a if a is not None else torch.zeros(9, dtype=torch.float64),
                                   b if b is not None else torch.zeros(9, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert g_got[2] is None or torch.all(g_got[2] == 0)        # the chosen KL is stop-gradient
    assert torch.all(g_got[3] >= 0)                              # the loss grows with the rejected KL


def test_tdpo_with_alpha_zero_is_dpo():
    h = torch.linspace(-30, 30, 13, dtype=torch.float64)
    kl = torch.rand(13, dtype=torch.float64)
    torch.testing.assert_close(train_dpo.tdpo_loss(h, kl, 2 * kl, 0.1, 0.0), train_dpo.dpo_loss(h, 0.1))


def oracle_seq_kl_and_logps(policy, ref, ids, resp):
    """Unchunked, full logits (every position, whole vocabulary) in float64: per row Σ over response positions
    of KL(π_ref ‖ π_θ), and S_θ, S_ref. Row by row, unpadded, so padding cannot matter."""
    kls, s_pi, s_ref = [], [], []
    for i in range(ids.shape[0]):
        n = int((resp[i].nonzero().max()) + 1)          # right padding: the response ends the row
        row, scored = ids[i:i + 1, :n], resp[i, 1:n].double()
        logp = torch.log_softmax(policy(row)[0, :-1].double(), -1)
        with torch.no_grad():
            logq = torch.log_softmax(ref(row)[0, :-1].double(), -1)
        kls.append(((logq.exp() * (logq - logp)).sum(-1) * scored).sum())
        tgt = row[0, 1:, None]
        s_pi.append((logp.gather(-1, tgt).squeeze(-1) * scored).sum())
        s_ref.append((logq.gather(-1, tgt).squeeze(-1) * scored).sum())
    return torch.stack(kls), torch.stack(s_pi), torch.stack(s_ref)


@pytest.mark.numeric
def test_sequential_kl_matches_full_vocabulary_float64(tok):
    # both sides in float64, models included (tests/numerics.py): the tolerance checks the math
    policy, ref = tiny_model(tok, seed=0).double(), tiny_model(tok, seed=1).double().requires_grad_(False)
    pairs, _ = tokenize_pairs(pref_rows(4), tok, 64)
    ids, attn, resp, _ = collate_pairs(pairs, tok.pad_id)
    s_pi, length, s_ref, kl = train_dpo.sequence_logps_and_kl(policy, ref, ids, attn, resp)
    want_kl, want_pi, want_ref = oracle_seq_kl_and_logps(policy, ref, ids, resp)
    assert torch.all(kl > 0)
    assert_close64(kl, want_kl.detach())
    assert_close64(s_pi, want_pi.detach())
    assert_close64(s_ref, want_ref)
    assert torch.equal(length, resp[:, 1:].sum(1).float())
    # gradients of the KL sum with respect to every policy weight
    got = torch.autograd.grad(kl.sum(), list(policy.parameters()))
    want = torch.autograd.grad(want_kl.sum(), list(policy.parameters()))
    for a, b in zip(got, want):
        assert_close64(a, b)
    # the policy against itself: the KL is zero (float64 rounding of sums of O(1) terms)
    same = train_dpo.sequence_logps_and_kl(ref, ref, ids, attn, resp)[3]
    assert same.abs().max() < 1e-12


@pytest.mark.numeric
def test_token_kl_chunked_equals_unchunked():
    g = torch.Generator().manual_seed(3)
    d = dict(generator=g, dtype=torch.float64)          # float64: two layouts of one sum (tests/numerics.py)
    h_pi = torch.randn(23, 8, requires_grad=True, **d)
    h_ref = torch.randn(23, 8, **d)
    w_pi = torch.randn(50, 8, requires_grad=True, **d)
    w_ref = torch.randn(50, 8, **d)
    whole = train_dpo.token_kl(h_pi, h_ref, w_pi, w_ref)
    chunked = train_dpo.token_kl(h_pi, h_ref, w_pi, w_ref, chunk_size=4)
    assert_close64(chunked, whole)
    ga = torch.autograd.grad(whole.sum(), (h_pi, w_pi))
    gb = torch.autograd.grad(chunked.sum(), (h_pi, w_pi))
    for a, b in zip(ga, gb):
        assert_close64(a, b)


# ---- PAFT's L1 term ----------------------------------------------------------------------------------

def test_l1_gradient_is_coef_times_sign_of_the_delta():
    init = [torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)]
    theta = [torch.tensor([0.7, -1.0, 1.0], dtype=torch.float64, requires_grad=True),
             torch.tensor([[1e-9, -1e-9], [0.0, 3.0]], dtype=torch.float64, requires_grad=True)]
    value = train_dpo.l1_delta(theta, init)
    assert value.item() == pytest.approx(0.2 + 0 + 1.0 + 1e-9 + 1e-9 + 0 + 3.0, rel=1e-12)
    grads = torch.autograd.grad(value, theta)
    for g_, t, t0 in zip(grads, theta, init):
        assert torch.equal(g_, torch.sign(t.detach() - t0))     # 0 where θ = θ_init (a subgradient)
    # add_l1_grad: λ·sign(θ − θ_init) added to whatever the loss put in .grad
    model = torch.nn.Linear(3, 2)
    init_params = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.weight[0, 0] += 0.1
        model.bias[1] -= 0.2
    model(torch.ones(1, 3)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    delta = train_dpo.add_l1_grad(model, init_params, 0.01)
    assert delta == pytest.approx(0.3, rel=1e-5)
    for p, p0, b in zip(model.parameters(), init_params, before):
        torch.testing.assert_close(p.grad, b + 0.01 * torch.sign(p.detach() - p0), rtol=0, atol=1e-7)


# ---- end to end ----------------------------------------------------------------------------------

def args(tmp_path, sft_dir, out, *extra, steps=3):
    if not (tmp_path / "pref.jsonl").exists():
        write_jsonl(tmp_path / "pref.jsonl", pref_rows(64))
        write_jsonl(tmp_path / "pref_eval.jsonl", pref_rows(8, seed=1))
    return ["--data", str(tmp_path / "pref.jsonl"), "--eval_data", str(tmp_path / "pref_eval.jsonl"), "--init", sft_dir,
            "--out_dir", str(tmp_path / out), "--max_steps", str(steps), "--batch_size", "4", "--log_interval", "1",
            "--eval_interval", "0", "--lr", "1e-3", "--warmup_steps", "0", *extra]


def metrics(path):
    return [json.loads(x) for x in open(path / "metrics.jsonl")]


def test_tdpo_end_to_end_and_alpha_zero_equals_dpo(tmp_path, sft_dir):
    train_dpo.main(args(tmp_path, sft_dir, "tdpo", "--loss", "tdpo"))
    m = metrics(tmp_path / "tdpo")
    assert len(m) == 3 and all(math.isfinite(x["train/loss"]) for x in m)
    assert m[0]["train/seqkl_chosen"] == pytest.approx(0, abs=1e-5)     # step 1: the policy is the reference
    assert m[-1]["train/seqkl_rejected"] > 0 and "eval/seqkl_rejected" in m[-1]
    train_dpo.main(args(tmp_path, sft_dir, "t0", "--loss", "tdpo", "--alpha", "0"))
    train_dpo.main(args(tmp_path, sft_dir, "dpo", "--loss", "dpo"))
    for a, b in zip(metrics(tmp_path / "t0"), metrics(tmp_path / "dpo")):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)


def test_tdpo_refuses_a_precomputed_reference(tmp_path, sft_dir, capsys):
    with pytest.raises(SystemExit) as e:
        train_dpo.main(args(tmp_path, sft_dir, "o", "--loss", "tdpo", "--precompute_ref"))
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --precompute_ref cannot be used with --loss tdpo")
    assert not (tmp_path / "o").exists()


def test_l1_coef_end_to_end_shrinks_the_delta(tmp_path, sft_dir):
    from nano_rlhf.model import GPT
    train_dpo.main(args(tmp_path, sft_dir, "plain", steps=4))
    out = train_dpo.main(args(tmp_path, sft_dir, "l1", "--l1_coef", "1.0", steps=4))
    m = metrics(tmp_path / "l1")
    assert m[0]["train/l1_delta"] == 0.0 and m[-1]["train/l1_delta"] > 0
    init = list(GPT.from_pretrained(sft_dir).parameters())

    def delta(model):
        return float(train_dpo.l1_delta([p.detach() for p in model.parameters()], [p.detach() for p in init]))
    assert delta(out.policy) < delta(GPT.from_pretrained(str(tmp_path / "plain")))


def test_tdpo_with_l1_end_to_end_on_the_builtin_task(tmp_path, sft_dir, monkeypatch):
    from nano_rlhf import data as data_mod
    from nano_rlhf.tasks import synthetic
    synthetic.write_dataset(str(tmp_path / "data"), seed=0, n_sft=40, n_pref=100, n_unpaired=40, n_prompts=10,
                            n_eval_prompts=8)
    monkeypatch.setattr(data_mod, "BUILTIN_DIR", str(tmp_path / "data"))
    train_dpo.main(["--loss", "tdpo", "--l1_coef", "1e-3", "--init", sft_dir, "--out_dir", str(tmp_path / "o"),
                    "--max_steps", "2", "--batch_size", "4", "--eval_interval", "0", "--log_interval", "1"])
    m = metrics(tmp_path / "o")
    assert len(m) == 2 and all(math.isfinite(x["train/loss"]) for x in m)
    assert m[-1]["train/l1_delta"] > 0 and m[-1]["eval/seqkl_rejected"] > 0
