"""Independent oracle tests for the Bradley-Terry reward-model loss in train_rm.py.

Reference (docs/algorithms.md#reward-model), per pair, written in float64 from the equations only:
  L = -log s(r_w - r_l - m) + c (r_w + r_l)^2 + (lam / 2) (r_w^2 + r_l^2)
so that the batch mean gives TRL's c * mean((r_w + r_l)^2) and align-anything's lam/(2B) * sum(r_w^2 + r_l^2).
"""
import math

import pytest
import torch

from train_rm import pair_scores, reward_loss

pytestmark = pytest.mark.numeric     # also run under ATEN_CPU_CAPABILITY=default by .ci/run

B = 16
D64 = torch.float64


def nls(x):
    """-log sigma(x) = log(1 + e^{-x}), two stable branches with finite gradients in each."""
    pos = x >= 0
    xp = torch.where(pos, x, torch.zeros_like(x))
    xn = torch.where(pos, torch.zeros_like(x), x)
    return torch.where(pos, torch.log1p(torch.exp(-xp)), -xn + torch.log1p(torch.exp(xn)))


def ref_reward_loss(rw, rl, m, c=0.0, lam=0.0):
    return nls(rw - rl - m) + c * (rw + rl) ** 2 + 0.5 * lam * (rw ** 2 + rl ** 2)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def _run(dtype, rw, rl, m, c, lam, seed=0):
    xs = [t.to(dtype).clone().requires_grad_(True) for t in (rw, rl, m)]
    rs = [t.detach().to(D64).clone().requires_grad_(True) for t in xs]
    out = reward_loss(xs[0], xs[1], xs[2], center_coef=c, l2_coef=lam)
    want = ref_reward_loss(*rs, c=c, lam=lam)
    assert out.shape == (len(rw),), f"reward_loss must be per pair (B,), got {tuple(out.shape)}"
    w = torch.rand(len(rw), generator=gen(100 + seed), dtype=D64)
    g = torch.autograd.grad((out.to(D64) * w).sum(), xs)
    gw = torch.autograd.grad((want * w).sum(), rs)
    return out, want, g, gw


def _close(got, want, dtype, what):
    got, want = got.detach().to(D64), want.detach().to(D64)
    assert torch.isfinite(got).all(), f"{what}: non-finite {got}"
    if dtype == D64:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda s: f"{what}: {s}")
    else:
        atol = max(1e-6, 1e-5 * float(want.abs().max()))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda s: f"{what}: {s}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("c,lam", [(0.0, 0.0), (0.01, 0.0), (0.0, 0.001), (0.05, 0.3)])
def test_reward_loss_value_and_grad(seed, dtype, c, lam):
    g = gen(seed)
    rw = torch.randn(B, generator=g, dtype=D64) * 3
    rl = torch.randn(B, generator=g, dtype=D64) * 3
    m = torch.rand(B, generator=g, dtype=D64) * 2
    out, want, grads, gw = _run(dtype, rw, rl, m, c, lam, seed)
    _close(out, want, dtype, "reward_loss value")
    for i, name in enumerate(("r_chosen", "r_rejected", "margin")):
        _close(grads[i], gw[i], dtype, f"reward_loss grad {name}")


def test_margin_shifts_the_sigmoid_argument():
    rw = torch.tensor([1.0, 2.0, 0.5, -1.0], dtype=D64)
    rl = torch.tensor([0.0, 2.0, 1.5, -3.0], dtype=D64)
    zero = torch.zeros(4, dtype=D64)
    m = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=D64)
    torch.testing.assert_close(reward_loss(rw, rl, zero), nls(rw - rl), rtol=1e-12, atol=1e-12)
    got = reward_loss(rw, rl, m)
    torch.testing.assert_close(got, nls(rw - rl - m), rtol=1e-12, atol=1e-12)
    # -log s(Delta - m): row 0 has Delta == m -> log 2; row 3 too (Delta = 2 = m)
    assert got[0].item() == pytest.approx(math.log(2), rel=1e-12)
    assert got[3].item() == pytest.approx(math.log(2), rel=1e-12)
    # a margin is equivalent to shifting r_chosen down by m
    torch.testing.assert_close(got, reward_loss(rw - m, rl, zero), rtol=1e-12, atol=1e-12)
    # a larger margin gives a larger loss
    assert (reward_loss(rw, rl, m + 1) > got).all()
    # equal rewards, no margin -> log 2
    torch.testing.assert_close(reward_loss(rw, rw, zero), torch.full((4,), math.log(2), dtype=D64))


def test_center_and_l2_terms_alone_and_together():
    g = gen(7)
    rw = torch.randn(B, generator=g, dtype=D64) * 2
    rl = torch.randn(B, generator=g, dtype=D64) * 2
    m = torch.zeros(B, dtype=D64)
    base = reward_loss(rw, rl, m)
    torch.testing.assert_close(base, nls(rw - rl), rtol=1e-12, atol=1e-12)
    c, lam = 0.01, 0.001
    only_c = reward_loss(rw, rl, m, center_coef=c)
    only_l = reward_loss(rw, rl, m, l2_coef=lam)
    both = reward_loss(rw, rl, m, center_coef=c, l2_coef=lam)
    torch.testing.assert_close(only_c - base, c * (rw + rl) ** 2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(only_l - base, 0.5 * lam * (rw ** 2 + rl ** 2), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(both - base, c * (rw + rl) ** 2 + 0.5 * lam * (rw ** 2 + rl ** 2), rtol=1e-10,
                               atol=1e-12)
    # batch means equal the framework forms
    torch.testing.assert_close((only_c - base).mean(), c * ((rw + rl) ** 2).mean())                  # TRL
    torch.testing.assert_close((only_l - base).mean(), lam / (2 * B) * (rw ** 2 + rl ** 2).sum())    # align-anything
    # shifting both rewards leaves the Bradley-Terry part unchanged; only the centring term sees the shift
    s = reward_loss(rw + 1.0, rl + 1.0, m, center_coef=c) - reward_loss(rw + 1.0, rl + 1.0, m)
    torch.testing.assert_close(s, c * (rw + rl + 2.0) ** 2, rtol=1e-10, atol=1e-12)
    # centring has zero value and zero gradient at r_w = -r_l; L2 has zero value at 0
    x = torch.tensor([1.5, -0.3], dtype=D64, requires_grad=True)
    y = (-x.detach()).clone().requires_grad_(True)
    pure_c = reward_loss(x, y, torch.zeros(2, dtype=D64), center_coef=0.3) - nls(x - y)
    gx, gy = torch.autograd.grad(pure_c.sum(), [x, y])
    assert pure_c.abs().max() < 1e-12 and gx.abs().max() < 1e-12 and gy.abs().max() < 1e-12
    z = torch.zeros(3, dtype=D64)
    torch.testing.assert_close(reward_loss(z, z, z, l2_coef=0.5), torch.full((3,), math.log(2), dtype=D64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_reward_differences_finite(dtype):
    rw = torch.tensor([1e4, -1e4, 5e3, 0.0], dtype=D64)
    rl = torch.tensor([-1e4, 1e4, -5e3, 0.0], dtype=D64)
    m = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=D64)
    for c, lam in [(0.0, 0.0), (0.01, 0.001)]:
        out, want, grads, gw = _run(dtype, rw, rl, m, c, lam)
        assert torch.isfinite(out).all(), out
        for gr in grads:
            assert torch.isfinite(gr).all(), gr
        _close(out, want, dtype, f"large value c={c} lam={lam}")
        for i in range(3):
            _close(grads[i], gw[i], dtype, f"large grad {i} c={c} lam={lam}")
        if c == 0 and lam == 0:
            assert out[0].item() == pytest.approx(0.0, abs=1e-6)           # Delta -> +inf: loss -> 0
            assert out[1].item() == pytest.approx(2e4, rel=1e-6)           # Delta -> -inf: loss -> -Delta
            assert grads[0][1].item() != 0                                  # still learning when badly wrong


def test_reward_loss_is_not_reduced():
    rw = torch.randn(B, dtype=D64)
    rl = torch.randn(B, dtype=D64)
    m = torch.zeros(B, dtype=D64)
    out = reward_loss(rw, rl, m, center_coef=0.01, l2_coef=0.001)
    assert out.shape == (B,)
    rw2 = rw.clone()
    rw2[5] += 1
    out2 = reward_loss(rw2, rl, m, center_coef=0.01, l2_coef=0.001)
    assert (out != out2).nonzero().flatten().tolist() == [5]


# ----------------------------------------------------------------------------------------------------
# pair_scores: chosen rows first, then rejected; end scores as float32
# ----------------------------------------------------------------------------------------------------
class FakeRM:
    def __init__(self, end, T):
        self.end = end
        self.T = T
        self.calls = []

    def __call__(self, ids, *args, **kw):
        self.calls.append((ids, args, kw))
        n = ids.shape[0]
        per_tok = torch.zeros(n, self.T, dtype=self.end.dtype) + 123.0      # must not be used as the score
        return per_tok, self.end


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pair_scores_split_and_dtype(dtype):
    Bp, T = 5, 7
    ids = torch.randint(0, 50, (2 * Bp, T))
    attn = torch.ones(2 * Bp, T, dtype=torch.long)
    attn[1, :2] = 0
    end = torch.arange(2 * Bp, dtype=dtype) * 0.5 - 1.0
    end = end.clone().requires_grad_(True)
    model = FakeRM(end, T)
    rc, rr = pair_scores(model, ids, attn)
    assert len(model.calls) == 1 and torch.equal(model.calls[0][0], ids)
    assert rc.shape == (Bp,) and rr.shape == (Bp,)
    want_dtype = torch.float64 if dtype == torch.float64 else torch.float32     # at least float32 (upcast)
    assert rc.dtype == want_dtype and rr.dtype == want_dtype
    torch.testing.assert_close(rc.to(D64), end.detach()[:Bp].to(D64))
    torch.testing.assert_close(rr.to(D64), end.detach()[Bp:].to(D64))
    # gradients reach the model's end scores, chosen half and rejected half separately
    (g,) = torch.autograd.grad((rc * 1.0 + 0.0).sum() + (rr * 2.0).sum(), end)
    want = torch.cat([torch.ones(Bp), 2 * torch.ones(Bp)]).to(dtype)
    torch.testing.assert_close(g, want)
