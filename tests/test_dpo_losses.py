"""Independent oracle tests for the DPO-family losses and helpers in train_dpo.py.

Every reference below is written from the equations in docs/algorithms.md ("Common mechanics",
"DPO family") and the cited papers, in float64, without looking at the implementation:
  dpo     -(1-e) log s(bh) - e log s(-bh)                 (cDPO / OpenRLHF label smoothing)
  robust  [-(1-e) log s(bh) + e log s(-bh)] / (1-2e)       (Chowdhury et al. 2024, rDPO)
  ipo     (h~ - 1/(2b))^2, h~ = u_w/|y_w| - u_l/|y_l|      (Azar et al. 2023, length-averaged)
  hinge   max(0, 1 - bh)                                   (SLiC, Zhao et al. 2023)
  rdpo    -log s(bh + a(|y_w| - |y_l|))                    (Park et al. 2024)
  simpo   -log s(b(S_w/|y_w| - S_l/|y_l|) - g)             (Meng et al. 2024)
  cpo     -log s(b(S_w - S_l))                             (Xu et al. 2024)
  orpo    -lam log s(lo_w - lo_l), lo = a - log(1 - e^a), a = S/|y|   (Hong et al. 2024)
  kto     desirable lD (1 - s(b(u - z0))), undesirable lU (1 - s(b(z0 - u))),
          z0 = max(0, detached mean KL estimate)           (Ethayarajh et al. 2024)
with -log s(x) = log(1 + e^{-x}) written stably (nls below), and 1 - s(x) = s(-x).
"""
import math
import types

import pytest
import torch
from numerics import FLOAT32_ATOL  # float32 values of order one: see tests/numerics.py
from nano_rlhf.model import token_logprobs

from train_dpo import (cpo_loss, dpo_loss, hinge_loss, ipo_loss, log_odds, nll_weight, orpo_loss, rdpo_loss,
                       robust_loss, sequence_logps, simpo_loss, token_logps)
from train_unpaired import kto_loss, kto_z0      # KTO's home: its data is unpaired

pytestmark = pytest.mark.numeric     # also run under ATEN_CPU_CAPABILITY=default by .ci/run

B = 16
SEEDS = (0, 1, 2, 3)
D64 = torch.float64


# ----------------------------------------------------------------------------------------------------
# float64 references (written from the equations only)
# ----------------------------------------------------------------------------------------------------
def nls(x):
    """-log sigma(x) = log(1 + e^{-x}), written stably in two branches (exact in float64;
    torch's softplus switches to the identity above 20, an error of e^-20 ~ 2e-9)."""
    pos = x >= 0
    xp = torch.where(pos, x, torch.zeros_like(x))     # both branches stay finite, so do their gradients
    xn = torch.where(pos, torch.zeros_like(x), x)
    return torch.where(pos, torch.log1p(torch.exp(-xp)), -xn + torch.log1p(torch.exp(xn)))


def ref_dpo(h, beta, eps=0.0):
    x = beta * h
    return (1 - eps) * nls(x) + eps * nls(-x)


def ref_robust(h, beta, eps):
    x = beta * h
    return ((1 - eps) * nls(x) - eps * nls(-x)) / (1 - 2 * eps)


def ref_ipo(u_w, u_l, len_w, len_l, beta):
    ht = u_w / len_w - u_l / len_l
    return (ht - 1.0 / (2 * beta)) ** 2


def ref_hinge(h, beta):
    return torch.clamp(1 - beta * h, min=0)


def ref_rdpo(h, len_w, len_l, beta, alpha):
    return nls(beta * h + alpha * (len_w - len_l))


def ref_simpo(s_w, s_l, len_w, len_l, beta, gamma):
    return nls(beta * (s_w / len_w - s_l / len_l) - gamma)


def ref_cpo(s_w, s_l, beta):
    return nls(beta * (s_w - s_l))


def ref_log1m_exp(a):
    """log(1 - e^a) for a <= 0, the standard two-branch stable form (Maechler 2012):
    log(-expm1(a)) for a > -log 2, log1p(-exp(a)) otherwise."""
    a = a.to(D64)
    near = a > -math.log(2.0)
    a_near = torch.where(near, a, torch.full_like(a, -1.0))      # keep the unused branch finite
    a_far = torch.where(near, torch.full_like(a, -1.0), a)
    return torch.where(near, torch.log(-torch.expm1(a_near)), torch.log1p(-torch.exp(a_far)))


def ref_log_odds(s, length):
    a = s / length
    return a - ref_log1m_exp(a)


def ref_orpo(s_w, s_l, len_w, len_l, lam):
    return lam * nls(ref_log_odds(s_w, len_w) - ref_log_odds(s_l, len_l))


def ref_kto(u, desirable, z0, beta, wd=1.0, wu=1.0):
    des = wd * torch.sigmoid(-beta * (u - z0))      # 1 - s(b(u - z0))
    und = wu * torch.sigmoid(-beta * (z0 - u))      # 1 - s(b(z0 - u))
    return torch.where(desirable, des, und)


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------
def gen(seed):
    g = torch.Generator().manual_seed(seed)
    return g


def randn(g, scale=1.0, n=B):
    return torch.randn(n, generator=g, dtype=D64) * scale


def rand_len(g, lo=1, hi=30, n=B):
    return torch.randint(lo, hi + 1, (n,), generator=g).to(D64)


def logp_sum(g, length):
    """A plausible log-prob sum (<= 0) for a response of the given length: per-token mean in (-4, -0.01)."""
    return -(torch.rand(len(length), generator=g, dtype=D64) * 3.99 + 0.01) * length


def tol(dtype):
    return dict(rtol=1e-10, atol=1e-12) if dtype == D64 else dict(rtol=1e-5, atol=1e-6)


def assert_close(got, want, dtype, scale_atol=True, what=""):
    """Compare against a float64 reference.  In float32, the absolute tolerance is 1e-5 relative to the
    batch's largest magnitude (rounding of the float32 inputs/intermediates)."""
    got = got.detach().to(D64)
    want = want.detach().to(D64)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    t = tol(dtype)
    atol = t["atol"]
    if scale_atol and dtype != D64:
        atol = max(atol, 1e-5 * float(want.abs().max()) if want.numel() else 0.0)
    assert torch.isfinite(got).all() == torch.isfinite(want).all(), f"{what}: finiteness differs\n{got}\n{want}"
    torch.testing.assert_close(got, want, rtol=t["rtol"], atol=atol, msg=lambda m: f"{what}: {m}")


def check_value_and_grad(fn, ref, args, grad_idx, dtype, kwargs=None, seed=0, what=""):
    """Call fn(*args) with the float inputs cast to `dtype`, compare value and the gradient of a random
    weighted sum w.r.t. args[grad_idx] with the float64 reference evaluated on the same (cast) inputs."""
    kwargs = kwargs or {}
    impl_args, ref_args = [], []
    for i, a in enumerate(args):
        if torch.is_tensor(a) and a.is_floating_point():
            x = a.detach().to(dtype).clone().requires_grad_(i in grad_idx)
            r = x.detach().to(D64).clone().requires_grad_(i in grad_idx)
            impl_args.append(x)
            ref_args.append(r)
        else:
            impl_args.append(a)
            ref_args.append(a)
    out = fn(*impl_args, **kwargs)
    want = ref(*ref_args, **kwargs)
    assert torch.is_tensor(out) and out.shape == (len(args[0]),), f"{what}: not a per-example (B,) tensor: {getattr(out, 'shape', out)}"
    assert_close(out, want, dtype, what=f"{what} value")
    w = torch.rand(len(args[0]), generator=gen(1000 + seed), dtype=D64)     # per-element weights: checks ordering too
    gi = list(grad_idx)
    g_impl = torch.autograd.grad((out.to(D64) * w).sum(), [impl_args[i] for i in gi], allow_unused=True)
    g_ref = torch.autograd.grad((want * w).sum(), [ref_args[i] for i in gi], allow_unused=True)
    for i, a, b in zip(gi, g_impl, g_ref):
        assert a is not None, f"{what}: no gradient flows into argument {i}"
        assert torch.isfinite(a).all(), f"{what}: non-finite gradient for argument {i}: {a}"
        assert_close(a, b, dtype, what=f"{what} grad arg {i}")
    return out


DTYPES = [torch.float64, torch.float32]


# ----------------------------------------------------------------------------------------------------
# values and gradients against the references
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.1), (2.0, 0.3)])
def test_dpo_value_grad(seed, dtype, beta, eps):
    g = gen(seed)
    h = randn(g, 5.0)
    check_value_and_grad(lambda h, b, e: dpo_loss(h, b, label_smoothing=e), ref_dpo, (h, beta, eps), [0], dtype,
                         seed=seed, what="dpo_loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.1), (2.0, 0.3)])
def test_robust_value_grad(seed, dtype, beta, eps):
    g = gen(seed)
    h = randn(g, 5.0)
    check_value_and_grad(robust_loss, ref_robust, (h, beta, eps), [0], dtype, seed=seed, what="robust_loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_ipo_value_grad(seed, dtype, beta):
    g = gen(seed)
    lw, ll = rand_len(g), rand_len(g)
    uw, ul = randn(g, 3.0) * lw ** 0.5, randn(g, 3.0) * ll ** 0.5
    check_value_and_grad(ipo_loss, ref_ipo, (uw, ul, lw, ll, beta), [0, 1], dtype, seed=seed, what="ipo_loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_hinge_value_grad(seed, dtype, beta):
    g = gen(seed)
    h = randn(g, 3.0 / beta)                      # both sides of the hinge point h = 1/beta
    check_value_and_grad(hinge_loss, ref_hinge, (h, beta), [0], dtype, seed=seed, what="hinge_loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta,alpha", [(0.1, 0.01), (0.5, -0.05), (2.0, 0.2)])
def test_rdpo_value_grad(seed, dtype, beta, alpha):
    g = gen(seed)
    h = randn(g, 5.0)
    lw, ll = rand_len(g), rand_len(g)
    check_value_and_grad(rdpo_loss, ref_rdpo, (h, lw, ll, beta, alpha), [0], dtype, seed=seed, what="rdpo_loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta,gamma", [(2.0, 0.5), (2.5, 1.4), (10.0, 0.0)])
def test_simpo_value_grad(seed, dtype, beta, gamma):
    g = gen(seed)
    lw, ll = rand_len(g), rand_len(g)
    sw, sl = logp_sum(g, lw), logp_sum(g, ll)
    check_value_and_grad(simpo_loss, ref_simpo, (sw, sl, lw, ll, beta, gamma), [0, 1], dtype, seed=seed,
                         what="simpo_loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_cpo_value_grad(seed, dtype, beta):
    g = gen(seed)
    lw, ll = rand_len(g), rand_len(g)
    sw, sl = logp_sum(g, lw), logp_sum(g, ll)
    check_value_and_grad(cpo_loss, ref_cpo, (sw, sl, beta), [0, 1], dtype, seed=seed, what="cpo_loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_log_odds_value_grad(seed, dtype):
    g = gen(seed)
    length = rand_len(g)
    s = logp_sum(g, length)
    check_value_and_grad(log_odds, ref_log_odds, (s, length), [0], dtype, seed=seed, what="log_odds")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("lam", [0.1, 0.5, 1.0])
def test_orpo_value_grad(seed, dtype, lam):
    g = gen(seed)
    lw, ll = rand_len(g), rand_len(g)
    sw, sl = logp_sum(g, lw), logp_sum(g, ll)
    check_value_and_grad(orpo_loss, ref_orpo, (sw, sl, lw, ll, lam), [0, 1], dtype, seed=seed, what="orpo_loss")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta,wd,wu", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.33), (2.0, 0.7, 1.5)])
def test_kto_value_grad(seed, dtype, beta, wd, wu):
    g = gen(seed)
    u = randn(g, 5.0)
    des = torch.rand(B, generator=g) < 0.5
    des[0], des[1] = True, False                  # both kinds always present
    z0 = torch.tensor(float(torch.rand(1, generator=g)) * 2.0, dtype=dtype)
    check_value_and_grad(lambda u, d, b: kto_loss(u, d, z0, b, desirable_weight=wd, undesirable_weight=wu),
                         lambda u, d, b: ref_kto(u, d, z0.detach().to(D64), b, wd, wu),
                         (u, des, beta), [0], dtype, seed=seed, what="kto_loss")


# gradients w.r.t. the (float) length inputs, where the loss depends on them ---------------------------------
@pytest.mark.parametrize("seed", SEEDS[:2])
def test_length_inputs_gradients(seed):
    g = gen(seed)
    lw, ll = rand_len(g, 2), rand_len(g, 2)
    h = randn(g, 5.0)
    uw, ul = randn(g, 3.0), randn(g, 3.0)
    sw, sl = logp_sum(g, lw), logp_sum(g, ll)
    d = torch.float64
    check_value_and_grad(ipo_loss, ref_ipo, (uw, ul, lw, ll, 0.5), [0, 1, 2, 3], d, seed=seed, what="ipo len")
    check_value_and_grad(rdpo_loss, ref_rdpo, (h, lw, ll, 0.5, 0.05), [0, 1, 2], d, seed=seed, what="rdpo len")
    check_value_and_grad(simpo_loss, ref_simpo, (sw, sl, lw, ll, 2.0, 0.5), [0, 1, 2, 3], d, seed=seed,
                         what="simpo len")
    check_value_and_grad(log_odds, ref_log_odds, (sw, lw), [0, 1], d, seed=seed, what="log_odds len")
    check_value_and_grad(orpo_loss, ref_orpo, (sw, sl, lw, ll, 0.5), [0, 1, 2, 3], d, seed=seed, what="orpo len")


# ----------------------------------------------------------------------------------------------------
# shapes: every loss is per-example, not reduced
# ----------------------------------------------------------------------------------------------------
def test_every_loss_returns_unreduced_per_example_tensor():
    g = gen(7)
    lw, ll = rand_len(g), rand_len(g)
    h, uw, ul = randn(g), randn(g), randn(g)
    sw, sl = logp_sum(g, lw), logp_sum(g, ll)
    des = torch.arange(B) % 2 == 0
    outs = {
        "dpo": dpo_loss(h, 0.1), "dpo_ls": dpo_loss(h, 0.1, 0.1), "robust": robust_loss(h, 0.1, 0.1),
        "ipo": ipo_loss(uw, ul, lw, ll, 0.1), "hinge": hinge_loss(h, 0.1), "rdpo": rdpo_loss(h, lw, ll, 0.1, 0.01),
        "simpo": simpo_loss(sw, sl, lw, ll, 2.0, 0.5), "cpo": cpo_loss(sw, sl, 0.1), "log_odds": log_odds(sw, lw),
        "orpo": orpo_loss(sw, sl, lw, ll, 0.1), "kto": kto_loss(uw, des, torch.tensor(0.3, dtype=D64), 0.1),
    }
    for k, v in outs.items():
        assert v.shape == (B,), f"{k}: shape {tuple(v.shape)}"
    # an example's loss depends only on its own inputs
    h2 = h.clone()
    h2[3] += 1.0
    a, b = dpo_loss(h, 0.1), dpo_loss(h2, 0.1)
    changed = (a != b).nonzero().flatten().tolist()
    assert changed == [3]


# ----------------------------------------------------------------------------------------------------
# edge cases: chosen == rejected
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_chosen_equals_rejected(dtype):
    z = torch.zeros(B, dtype=dtype)
    for beta in (0.1, 1.0, 3.0):
        for eps in (0.0, 0.1, 0.4):
            torch.testing.assert_close(dpo_loss(z, beta, eps).to(D64), torch.full((B,), math.log(2), dtype=D64),
                                       rtol=1e-6, atol=1e-7)
            # robust at h = 0: [(1-e) - e] log 2 / (1 - 2e) = log 2
            torch.testing.assert_close(robust_loss(z, beta, eps).to(D64), torch.full((B,), math.log(2), dtype=D64),
                                       rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(hinge_loss(z, beta).to(D64), torch.ones(B, dtype=D64))
        # IPO: u_w = u_l and equal lengths -> h~ = 0 -> 1/(4 beta^2)
        u = torch.linspace(-3, 3, B, dtype=dtype)
        n = torch.full((B,), 7.0, dtype=dtype)
        torch.testing.assert_close(ipo_loss(u, u, n, n, beta).to(D64), torch.full((B,), 1 / (4 * beta ** 2), dtype=D64),
                                   rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(rdpo_loss(z, n, n, beta, 0.3).to(D64), torch.full((B,), math.log(2), dtype=D64),
                                   rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(cpo_loss(-n, -n, beta).to(D64), torch.full((B,), math.log(2), dtype=D64),
                                   rtol=1e-6, atol=1e-7)
        for gamma in (0.0, 0.5, 1.6):
            # equal per-token means with different lengths: -6/3 == -10/5
            sw, lw = torch.full((B,), -6.0, dtype=dtype), torch.full((B,), 3.0, dtype=dtype)
            sl, ll = torch.full((B,), -10.0, dtype=dtype), torch.full((B,), 5.0, dtype=dtype)
            want = -math.log(1 / (1 + math.exp(gamma)))       # -log s(-g)
            torch.testing.assert_close(simpo_loss(sw, sl, lw, ll, beta, gamma).to(D64), torch.full((B,), want, dtype=D64),
                                       rtol=1e-6, atol=1e-7)
        lam = 0.7
        sw, lw = torch.full((B,), -6.0, dtype=dtype), torch.full((B,), 3.0, dtype=dtype)
        sl, ll = torch.full((B,), -10.0, dtype=dtype), torch.full((B,), 5.0, dtype=dtype)
        torch.testing.assert_close(orpo_loss(sw, sl, lw, ll, lam).to(D64), torch.full((B,), lam * math.log(2), dtype=D64),
                                   rtol=1e-6, atol=1e-7)
        # KTO at u = z0: every row is lambda * 1/2
        z0 = torch.tensor(0.4, dtype=dtype)
        des = torch.arange(B) % 2 == 0
        out = kto_loss(torch.full((B,), 0.4, dtype=dtype), des, z0, beta, desirable_weight=0.8, undesirable_weight=1.3)
        want = torch.where(des, torch.tensor(0.4, dtype=D64), torch.tensor(0.65, dtype=D64))
        torch.testing.assert_close(out.to(D64), want, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------------
# edge cases: very large margins in float32
# ----------------------------------------------------------------------------------------------------
BIG = [1e4, 1e30]


def _grad_f32(fn, *xs):
    xs = [x.detach().float().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    grads = torch.autograd.grad(out.sum(), xs, allow_unused=True)
    return out, grads


def _finite(out, grads, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite value {out}"
    for i, g in enumerate(grads):
        assert g is not None, f"{what}: no gradient for input {i}"
        assert torch.isfinite(g).all(), f"{what}: non-finite gradient for input {i}: {g}"


@pytest.mark.parametrize("mag", BIG)
def test_large_margins_dpo_family_float32(mag):
    beta = 0.5
    hval = mag / beta                 # |beta h| = mag
    h = torch.tensor([hval, -hval, 0.0, hval, -hval], dtype=torch.float64)
    for eps in (0.0, 0.1):
        out, (gh,) = _grad_f32(lambda h: dpo_loss(h, beta, eps), h)
        _finite(out, (gh,), f"dpo eps={eps}")
        hr = h.float().to(D64).requires_grad_(True)
        want = ref_dpo(hr, beta, eps)
        (gw,) = torch.autograd.grad(want.sum(), hr)
        assert_close(out, want, torch.float32, scale_atol=False, what=f"dpo big value eps={eps}")
        assert_close(gh, gw, torch.float32, scale_atol=False, what=f"dpo big grad eps={eps}")
        if eps == 0.0:
            assert out[0].item() == pytest.approx(0.0, abs=1e-6)           # h -> +inf: loss -> 0
            assert out[1].item() == pytest.approx(mag, rel=1e-5)           # h -> -inf: loss -> -beta h
            assert gh[0].item() == pytest.approx(0.0, abs=1e-6)
            assert gh[1].item() == pytest.approx(-beta, rel=1e-5)
        out, (gh,) = _grad_f32(lambda h: robust_loss(h, beta, eps), h)
        _finite(out, (gh,), f"robust eps={eps}")
        hr = h.float().to(D64).requires_grad_(True)
        want = ref_robust(hr, beta, eps)
        (gw,) = torch.autograd.grad(want.sum(), hr)
        assert_close(out, want, torch.float32, scale_atol=False, what=f"robust big value eps={eps}")
        assert_close(gh, gw, torch.float32, scale_atol=False, what=f"robust big grad eps={eps}")

    out, (gh,) = _grad_f32(lambda h: hinge_loss(h, beta), h)
    _finite(out, (gh,), "hinge")
    assert out[0].item() == 0.0 and gh[0].item() == 0.0
    assert out[1].item() == pytest.approx(1 + mag, rel=1e-5) and gh[1].item() == pytest.approx(-beta, rel=1e-6)

    lw = torch.tensor([5.0, 5.0, 5.0, 9.0, 2.0], dtype=D64)
    ll = torch.tensor([5.0, 5.0, 5.0, 2.0, 9.0], dtype=D64)
    out, grads = _grad_f32(lambda h: rdpo_loss(h, lw.float(), ll.float(), beta, 0.1), h)
    _finite(out, grads, "rdpo")
    hr = h.float().to(D64).requires_grad_(True)
    want = ref_rdpo(hr, lw, ll, beta, 0.1)
    (gw,) = torch.autograd.grad(want.sum(), hr)
    assert_close(out, want, torch.float32, scale_atol=False, what="rdpo big value")
    assert_close(grads[0], gw, torch.float32, scale_atol=False, what="rdpo big grad")

    # log-prob sums: S <= 0; the difference is +-mag/beta
    s_hi = torch.tensor([0.0, -hval, -1.0, -0.5, -hval], dtype=D64)
    s_lo = torch.tensor([-hval, 0.0, -1.0, -hval, -0.5], dtype=D64)
    out, grads = _grad_f32(lambda a, b: cpo_loss(a, b, beta), s_hi, s_lo)
    _finite(out, grads, "cpo")
    a_r, b_r = s_hi.float().to(D64).requires_grad_(True), s_lo.float().to(D64).requires_grad_(True)
    want = ref_cpo(a_r, b_r, beta)
    gw = torch.autograd.grad(want.sum(), [a_r, b_r])
    assert_close(out, want, torch.float32, scale_atol=False, what="cpo big value")
    for i in range(2):
        assert_close(grads[i], gw[i], torch.float32, scale_atol=False, what=f"cpo big grad {i}")

    one = torch.ones(5, dtype=D64)
    for gamma in (0.0, 1.0):
        out, grads = _grad_f32(lambda a, b: simpo_loss(a, b, one.float(), one.float(), beta, gamma), s_hi, s_lo)
        _finite(out, grads, "simpo")
        a_r, b_r = s_hi.float().to(D64).requires_grad_(True), s_lo.float().to(D64).requires_grad_(True)
        want = ref_simpo(a_r, b_r, one, one, beta, gamma)
        gw = torch.autograd.grad(want.sum(), [a_r, b_r])
        assert_close(out, want, torch.float32, scale_atol=False, what="simpo big value")
        for i in range(2):
            assert_close(grads[i], gw[i], torch.float32, scale_atol=False, what=f"simpo big grad {i}")

    # ORPO: log-odds of a very negative mean is ~ a; S = 0 is excluded here (see the log_odds tests)
    s_hi2 = torch.tensor([-1e-3, -hval, -1.0, -0.5, -hval], dtype=D64)
    s_lo2 = torch.tensor([-hval, -1e-3, -1.0, -hval, -0.5], dtype=D64)
    out, grads = _grad_f32(lambda a, b: orpo_loss(a, b, one.float(), one.float(), 0.5), s_hi2, s_lo2)
    _finite(out, grads, "orpo")
    a_r, b_r = s_hi2.float().to(D64).requires_grad_(True), s_lo2.float().to(D64).requires_grad_(True)
    want = ref_orpo(a_r, b_r, one, one, 0.5)
    gw = torch.autograd.grad(want.sum(), [a_r, b_r])
    assert_close(out, want, torch.float32, scale_atol=False, what="orpo big value")
    for i in range(2):
        assert_close(grads[i], gw[i], torch.float32, scale_atol=False, what=f"orpo big grad {i}")

    # KTO: bounded in [0, lambda]
    u = torch.tensor([hval, -hval, hval, -hval, 0.0], dtype=D64)
    des = torch.tensor([True, True, False, False, True])
    out, grads = _grad_f32(lambda u: kto_loss(u, des, torch.tensor(0.0), beta, desirable_weight=1.0,
                                              undesirable_weight=1.5), u)
    _finite(out, grads, "kto")
    torch.testing.assert_close(out.to(D64), torch.tensor([0.0, 1.0, 1.5, 0.0, 0.5], dtype=D64), rtol=1e-6, atol=1e-6)


def test_large_margin_ipo_float32():
    """IPO is a square: at |u| ~ 1e4 it stays finite in float32 (1e30 would overflow the square by definition)."""
    beta = 0.5
    uw = torch.tensor([1e4, -1e4, 0.0, 3e4], dtype=D64)
    ul = torch.tensor([-1e4, 1e4, 0.0, -2e4], dtype=D64)
    lw = torch.tensor([1.0, 1.0, 1.0, 3.0], dtype=D64)
    ll = torch.tensor([1.0, 1.0, 1.0, 4.0], dtype=D64)
    out, grads = _grad_f32(lambda a, b: ipo_loss(a, b, lw.float(), ll.float(), beta), uw, ul)
    _finite(out, grads, "ipo")
    a_r, b_r = uw.requires_grad_(True), ul.requires_grad_(True)
    want = ref_ipo(a_r, b_r, lw, ll, beta)
    gw = torch.autograd.grad(want.sum(), [a_r, b_r])
    assert_close(out, want, torch.float32, scale_atol=False, what="ipo big value")
    for i in range(2):
        assert_close(grads[i], gw[i], torch.float32, scale_atol=False, what=f"ipo big grad {i}")


# ----------------------------------------------------------------------------------------------------
# label smoothing / robust
# ----------------------------------------------------------------------------------------------------
def test_label_smoothing_zero_is_plain_dpo_and_robust_differs():
    g = gen(11)
    h = randn(g, 4.0)
    for beta in (0.1, 1.0):
        plain = nls(beta * h)
        torch.testing.assert_close(dpo_loss(h, beta), plain, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dpo_loss(h, beta, 0.0), plain, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(robust_loss(h, beta, 0.0), plain, rtol=1e-12, atol=1e-12)
        for eps in (0.1, 0.25):
            c = dpo_loss(h, beta, eps)
            r = robust_loss(h, beta, eps)
            assert (c - r).abs().max() > 1e-3, "robust with eps > 0 must differ from cDPO"
            # cDPO is the expected BCE loss under label flips with probability eps
            torch.testing.assert_close(c, (1 - eps) * plain + eps * nls(-beta * h), rtol=1e-12, atol=1e-12)
            # rDPO (Chowdhury et al. 2024) is unbiased: E_flip[L_robust] = clean loss
            torch.testing.assert_close((1 - eps) * r + eps * robust_loss(-h, beta, eps), plain, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------------
# length dependence: these must fail if lengths are ignored
# ----------------------------------------------------------------------------------------------------
def test_losses_depend_on_lengths():
    beta = 0.5
    n_a, n_b = torch.tensor([2.0, 10.0, 4.0], dtype=D64), torch.tensor([10.0, 2.0, 4.0], dtype=D64)
    # IPO: same u, different lengths -> h~ != 0
    u = torch.tensor([-4.0, -4.0, -4.0], dtype=D64)
    got = ipo_loss(u, u, n_a, n_b, beta)
    torch.testing.assert_close(got, ref_ipo(u, u, n_a, n_b, beta))
    assert got[0] != got[1] and got[0] != got[2]
    # R-DPO: h = 0, different lengths
    z = torch.zeros(3, dtype=D64)
    got = rdpo_loss(z, n_a, n_b, beta, 0.2)
    torch.testing.assert_close(got, ref_rdpo(z, n_a, n_b, beta, 0.2))
    # row 0: alpha (|y_w| - |y_l|) = 0.2 * (2 - 10) = -1.6 -> softplus(1.6) > log 2; row 1 the mirror; row 2 log 2
    assert got[0] > math.log(2) + 0.1 and got[1] < math.log(2) - 0.1
    assert got[2].item() == pytest.approx(math.log(2), rel=1e-12)
    s = torch.tensor([-8.0, -8.0, -8.0], dtype=D64)
    for fn, ref, args in [
        (simpo_loss, ref_simpo, (s, s, n_a, n_b, 2.0, 0.5)),
        (orpo_loss, ref_orpo, (s, s, n_a, n_b, 0.5)),
    ]:
        got = fn(*args)
        torch.testing.assert_close(got, ref(*args))
        assert got[0] != got[1] and got[0] != got[2]
    torch.testing.assert_close(log_odds(s, n_a), ref_log_odds(s, n_a))


# ----------------------------------------------------------------------------------------------------
# log-odds: numerically stable near a = 0 and for very negative a; S = 0 never gives NaN
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_log_odds_near_zero_and_very_negative(dtype):
    a = torch.tensor([-1e-7, -1e-6, -1e-4, -0.01, -0.5, -math.log(2), -1.0, -5.0, -20.0, -50.0, -100.0, -1e4],
                     dtype=D64)
    for n in (1.0, 4.0):
        length = torch.full_like(a, n)
        s = (a * n).to(dtype)
        x = s.clone().requires_grad_(True)
        got = log_odds(x, length.to(dtype))
        (g,) = torch.autograd.grad(got.sum(), x)
        assert torch.isfinite(got).all() and torch.isfinite(g).all(), (got, g)
        xr = s.to(D64).requires_grad_(True)
        want = ref_log_odds(xr, length)
        (gw,) = torch.autograd.grad(want.sum(), xr)
        assert_close(got, want, dtype, scale_atol=False, what=f"log_odds n={n}")
        assert_close(g, gw, dtype, scale_atol=False, what=f"log_odds grad n={n}")
    # hand-checked anchors: a = -1e-7 -> -1e-7 - log(1 - e^-1e-7) ~ -log(1e-7) ~ 16.118; a = -50 -> ~ -50
    got = log_odds(torch.tensor([-1e-7, -50.0], dtype=dtype), torch.tensor([1.0, 1.0], dtype=dtype)).to(D64)
    assert got[0].item() == pytest.approx(-1e-7 - math.log(-math.expm1(-1e-7)), rel=1e-5)
    assert got[0].item() == pytest.approx(16.118095, rel=1e-5)
    assert got[1].item() == pytest.approx(-50.0, rel=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_odds_grad_finite_where_exp_rounds_to_one(dtype):
    """In float32, e^a rounds to 1 for a in about (-3e-8, 0): the far branch log1p(-e^a) is then
    log1p(-1) = -inf even though it is not selected, and a single torch.where turns its gradient into
    0 * inf = NaN. Values and gradients must be finite and match the float64 reference there too."""
    a = torch.tensor([-1e-8, -1e-10, -1e-12, -3e-8, -1e-7, -50.0, -1e4], dtype=D64)
    for n in (1.0, 4.0):
        length = torch.full_like(a, n)
        x = (a * n).to(dtype).requires_grad_(True)
        got = log_odds(x, length.to(dtype))
        (g,) = torch.autograd.grad(got.sum(), x)
        assert torch.isfinite(got).all() and torch.isfinite(g).all(), (got, g)
        xr = x.detach().to(D64).requires_grad_(True)
        want = ref_log_odds(xr, length)
        (gw,) = torch.autograd.grad(want.sum(), xr)
        assert_close(got, want, dtype, scale_atol=False, what=f"log_odds n={n}")
        assert_close(g, gw, dtype, scale_atol=False, what=f"log_odds grad n={n}")
    # through ORPO too: chosen near-certain, rejected not
    sw = torch.tensor([-1e-10, -1e-12], dtype=dtype, requires_grad=True)
    sl = torch.tensor([-3.0, -1e-8], dtype=dtype, requires_grad=True)
    one = torch.ones(2, dtype=dtype)
    gw_, gl_ = torch.autograd.grad(orpo_loss(sw, sl, one, one, 0.5).sum(), [sw, sl])
    assert torch.isfinite(gw_).all() and torch.isfinite(gl_).all(), (gw_, gl_)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_odds_and_orpo_at_exactly_zero_logprob_no_nan(dtype):
    one = torch.ones(3, dtype=dtype)
    s0 = torch.zeros(3, dtype=dtype, requires_grad=True)
    lo0 = log_odds(s0, one)
    assert not torch.isnan(lo0).any(), lo0
    (g,) = torch.autograd.grad(lo0.sum(), s0)
    assert not torch.isnan(g).any(), g
    # log-odds is increasing in a, so log_odds(a = 0) >= log_odds(a = -1e-7) (~16.1)
    near = log_odds(torch.full((3,), -1e-7, dtype=dtype), one)
    assert (lo0 >= near).all(), (lo0, near)
    # ORPO with S exactly 0 on either or both sides
    cases = [(0.0, 0.0), (0.0, -5.0), (-5.0, 0.0)]
    sw = torch.tensor([c[0] for c in cases], dtype=dtype, requires_grad=True)
    sl = torch.tensor([c[1] for c in cases], dtype=dtype, requires_grad=True)
    out = orpo_loss(sw, sl, one, one, 0.5)
    gw, gl = torch.autograd.grad(out.sum(), [sw, sl])
    for t, name in ((out, "value"), (gw, "grad w"), (gl, "grad l")):
        assert not torch.isnan(t).any(), f"orpo S=0 {name}: {t}"
    # chosen certain (a_w = 0) vs a_l = -5: loss ~ 0; the reverse: at least 0.5 * -log s(lo(-5) - 16.1) ~ 8
    assert out[1].item() < 1e-6
    assert out[2].item() > 0.5 * (16.1 - 5.0)


# ----------------------------------------------------------------------------------------------------
# KTO: weights, z0 clamping, z0 detached
# ----------------------------------------------------------------------------------------------------
def test_kto_weights_scale_each_kind_only():
    g = gen(5)
    u = randn(g, 3.0)
    des = torch.arange(B) % 3 == 0
    z0 = torch.tensor(0.25, dtype=D64)
    base = kto_loss(u, des, z0, 0.3)
    torch.testing.assert_close(base, ref_kto(u, des, z0, 0.3), rtol=1e-12, atol=1e-12)
    wd = kto_loss(u, des, z0, 0.3, desirable_weight=2.0)
    wu = kto_loss(u, des, z0, 0.3, undesirable_weight=3.0)
    torch.testing.assert_close(wd, torch.where(des, 2 * base, base), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(wu, torch.where(des, base, 3 * base), rtol=1e-12, atol=1e-12)
    # desirable rows decrease in u, undesirable rows increase in u
    u2 = u + 0.5
    b2 = kto_loss(u2, des, z0, 0.3)
    assert (b2[des] < base[des]).all() and (b2[~des] > base[~des]).all()


def test_kto_z0_mean_clamp_and_detach():
    for count in (torch.tensor(4.0), 4):
        x = torch.tensor([0.5, 1.5, 4.0, -1.0], dtype=torch.float32, requires_grad=True)
        z0 = kto_z0(x.sum(), count)
        assert torch.is_tensor(z0) and z0.numel() == 1
        assert z0.item() == pytest.approx(5.0 / 4.0, rel=1e-6)
        assert not z0.requires_grad, "z0 must be detached"
        # no gradient flows into z0's input through the KTO loss
        u = torch.tensor([0.3, -0.2, 1.0], requires_grad=True)
        out = kto_loss(u, torch.tensor([True, False, True]), z0, 0.5)
        out.sum().backward()
        assert x.grad is None or (x.grad == 0).all()
        assert u.grad is not None and torch.isfinite(u.grad).all()
        # negative mean is clamped to 0
        y = torch.tensor([-3.0, 1.0], requires_grad=True)
        z = kto_z0(y.sum(), torch.tensor(2.0))
        assert z.item() == 0.0 and not z.requires_grad
        # positive small mean passes through unchanged
        z = kto_z0(torch.tensor(0.03), torch.tensor(3.0))
        assert z.item() == pytest.approx(0.01, rel=1e-6)


def test_kto_z0_zero_count_is_guarded():
    """docs/algorithms.md: guard every division by a count against zero."""
    for count in (torch.tensor(0.0), 0):
        z = kto_z0(torch.tensor(0.0), count)
        assert torch.isfinite(z).all()


def test_kto_z0_is_pure(monkeypatch):
    """No collective inside: the training loop all-reduces the sums once and passes them in."""
    from nano_rlhf import dist

    def no_collective(*a, **k):
        raise AssertionError("kto_z0 must not all-reduce")
    monkeypatch.setattr(dist, "all_reduce_sum", no_collective)
    assert kto_z0(torch.tensor(6.0), torch.tensor(4.0)).item() == pytest.approx(1.5)


# ----------------------------------------------------------------------------------------------------
# NLL weight
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss,nll_coef,alpha,want", [
    ("dpo", 0.0, 1.0, 0.0), ("dpo", 0.5, 1.0, 0.5), ("ipo", 0.2, 0.3, 0.2), ("simpo", 0.0, 1.0, 0.0),
    ("simpo", 0.7, 1.0, 0.7), ("cpo", 0.0, 1.0, 1.0), ("cpo", 0.0, 0.25, 0.25), ("cpo", 0.5, 0.25, 0.75),
    ("orpo", 0.0, 0.4, 1.0), ("orpo", 0.3, 0.4, 1.3), ("hinge", 0.0, 0.5, 0.0),
    ("rdpo", 0.0, 0.5, 0.0), ("robust", 0.0, 0.5, 0.0),
])
def test_nll_weight(loss, nll_coef, alpha, want):
    opts = types.SimpleNamespace(loss=loss, nll_coef=nll_coef, alpha=alpha)
    assert nll_weight(opts) == pytest.approx(want, abs=1e-12)


# ----------------------------------------------------------------------------------------------------
# sequence_logps: shift, float32 log-softmax, selected positions
# ----------------------------------------------------------------------------------------------------
class FakeLM:
    """Stands in for GPT: forward(..., select=, targets=) takes full_logits[select] (rows in row-major (b, t)
    order) as the "hidden states" and output_weight() is the identity, so the logits token_logprobs makes of them
    are exactly full_logits[select]; it returns their log-probs at targets, as GPT.forward does. Records what it
    was given."""

    def __init__(self, full_logits):
        self.full = full_logits
        self.calls = []

    def __call__(self, input_ids, attention_mask=None, *args, select=None, targets=None, temperature=1.0,
                 with_entropy=False, **kw):
        if select is None and args:
            select = args[0]
        assert select is not None, "sequence_logps must pass select="
        # the log-probs come out of forward (what DDP hooks and --compile compiles), the output layer inside it
        assert targets is not None, "the log-probs must come from forward(..., targets=...)"
        if select.dtype != torch.bool:        # flat indices b·T + t, ascending: recorded as the same positions' mask
            mask = torch.zeros(input_ids.numel(), dtype=torch.bool)
            mask[select] = True
            select = mask.view(input_ids.shape)
        self.calls.append(dict(ids=input_ids, attn=attention_mask, select=select.clone()))
        return token_logprobs(self.full[select], self.output_weight(), targets, temperature,
                              with_entropy=with_entropy)

    def output_weight(self):
        return torch.eye(self.full.shape[-1], dtype=self.full.dtype)


def make_batch(seed, V=37, T=14):
    g = gen(seed)
    # rows: (left pad, prompt len, response len, right pad); left- and right-padded rows, a 1-token response,
    # a response that reaches the last column
    layout = [(0, 3, 5, 6), (4, 2, 8, 0), (0, 1, 1, 12), (2, 5, 7, 0), (0, 6, 4, 4), (3, 4, 3, 4)]
    Bn = len(layout)
    ids = torch.randint(0, V, (Bn, T), generator=g)
    attn = torch.zeros(Bn, T, dtype=torch.long)
    resp = torch.zeros(Bn, T, dtype=torch.long)
    for b, (lp, p, r, rp) in enumerate(layout):
        assert lp + p + r + rp == T
        attn[b, lp:lp + p + r] = 1
        resp[b, lp + p:lp + p + r] = 1
        ids[b, :lp] = V - 1               # pad id
        ids[b, lp + p + r:] = V - 1
    logits = torch.randn(Bn, T, V, generator=g, dtype=D64) * 3.0
    return ids, attn, resp, logits


def ref_sequence_logps(full_logits64, ids, resp):
    """sum over t >= 1 with resp[t] == 1 of log_softmax(logits[t - 1])[ids[t]]; and the count."""
    lp = torch.log_softmax(full_logits64, dim=-1)                     # float64
    Bn, T = ids.shape
    sums = torch.zeros(Bn, dtype=D64)
    lens = torch.zeros(Bn, dtype=D64)
    for b in range(Bn):
        for t in range(1, T):
            if resp[b, t]:
                sums[b] = sums[b] + lp[b, t - 1, ids[b, t]]
                lens[b] += 1
    return sums, lens


def expected_select(resp):
    sel = torch.zeros(resp.shape, dtype=torch.bool)
    sel[:, :-1] = resp[:, 1:].bool()
    return sel


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16])
def test_sequence_logps_matches_float64_reference(seed, logit_dtype):
    ids, attn, resp, logits = make_batch(seed)
    full = logits.to(logit_dtype).requires_grad_(logit_dtype == torch.float32)
    model = FakeLM(full)
    sums, lens = sequence_logps(model, ids, attn, resp)
    assert sums.shape == (ids.shape[0],) and lens.shape == (ids.shape[0],)
    assert sums.dtype == torch.float32, f"log-probs must be float32, got {sums.dtype}"
    # the model was asked for exactly the predicting positions t - 1 of the scored tokens t
    assert len(model.calls) == 1
    sel = model.calls[0]["select"]
    assert sel.dtype == torch.bool and sel.shape == ids.shape
    assert torch.equal(sel, expected_select(resp)), f"selected positions wrong:\n{sel.int()}\nwant\n{expected_select(resp).int()}"
    assert torch.equal(model.calls[0]["ids"], ids)
    # values: reference from the same (possibly bf16) logits, upcast to float64
    ref_logits = full.detach().to(D64).requires_grad_(True)
    want_s, want_n = ref_sequence_logps(ref_logits, ids, resp)
    torch.testing.assert_close(sums.detach().to(D64), want_s.detach(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(lens.to(D64), want_n, rtol=0, atol=0)
    # first response token is scored (its predicting position is the last prompt token)
    assert want_n.tolist() == [5, 8, 1, 7, 4, 3]
    if logit_dtype == torch.float32:
        w = torch.rand(ids.shape[0], generator=gen(seed + 50), dtype=D64)
        (g,) = torch.autograd.grad((sums.to(D64) * w).sum(), full)
        (gw,) = torch.autograd.grad((want_s * w).sum(), ref_logits)
        torch.testing.assert_close(g.to(D64), gw, rtol=1e-5, atol=1e-6)
        # no gradient at positions that do not predict a response token
        assert (g[~expected_select(resp)] == 0).all()


def test_sequence_logps_ignores_response_mask_at_position_zero():
    """A token at t = 0 has no predicting position and cannot be scored (t >= 1 only)."""
    ids, attn, resp, logits = make_batch(9)
    resp[0, 0] = 1                          # row 0 has no left padding: mark its first token
    model = FakeLM(logits.float())
    sums, lens = sequence_logps(model, ids, attn, resp)
    want_s, want_n = ref_sequence_logps(logits.float().to(D64), ids, resp)
    torch.testing.assert_close(sums.to(D64), want_s, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(lens.to(D64), want_n, rtol=0, atol=0)
    assert torch.equal(model.calls[0]["select"], expected_select(resp))


def test_sequence_logps_changes_only_with_scored_logits():
    """Perturbing logits at non-predicting positions (prompt interior, pads, last response position) changes nothing."""
    ids, attn, resp, logits = make_batch(3)
    base, _ = sequence_logps(FakeLM(logits.float()), ids, attn, resp)
    noise = torch.randn(logits.shape, generator=gen(4), dtype=D64) * 5
    keep = expected_select(resp)
    pert = torch.where(keep[..., None], logits, logits + noise)
    got, _ = sequence_logps(FakeLM(pert.float()), ids, attn, resp)
    torch.testing.assert_close(got, base, rtol=0, atol=0)


def test_sequence_logps_row_without_response_tokens():
    """A row with an empty response scores nothing: sum 0 and count 0 (and nothing NaN)."""
    ids, attn, resp, logits = make_batch(2)
    resp[2] = 0
    sums, lens = sequence_logps(FakeLM(logits.float()), ids, attn, resp)
    want_s, want_n = ref_sequence_logps(logits.float().to(D64), ids, resp)
    assert sums[2].item() == 0.0 and lens[2].item() == 0
    torch.testing.assert_close(sums.to(D64), want_s, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(lens.to(D64), want_n, rtol=0, atol=0)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_token_logps_per_token_and_one_gather(seed):
    """The one gather: column t holds log π(token t+1) where token t+1 is a response token, 0 elsewhere;
    sequence_logps is its row sum (one model call each)."""
    ids, attn, resp, logits = make_batch(seed)
    model = FakeLM(logits.float())
    lp = token_logps(model, ids, attn, resp)
    assert lp.shape == (ids.shape[0], ids.shape[1] - 1) and lp.dtype == torch.float32 and len(model.calls) == 1
    full = torch.log_softmax(logits, -1)
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            want = full[b, t - 1, ids[b, t]].item() if resp[b, t] else 0.0
            assert lp[b, t - 1].item() == pytest.approx(want, abs=2e-5), (b, t)
    sums, _ = sequence_logps(model, ids, attn, resp)
    torch.testing.assert_close(sums, lp.sum(1), rtol=1e-6, atol=FLOAT32_ATOL)
