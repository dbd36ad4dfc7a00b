"""Independent float64 oracles for the RLVR-variant losses in train_ppo.py: dual-clip PPO, GSPO, CISPO, the
three loss aggregations, DAPO's soft overlong punishment, the sampler/trainer rollout correction (TIS / mask)
and the KL estimators used as a loss.

Written from the papers' equations and the functions' signatures and docstrings only, without reading their
bodies:
  dual-clip     Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5
  GSPO          Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7 (GSPO-token form)
  CISPO         MiniMax-M1 technical report 2025, eq. 4
  aggregation   DAPO eq. 8 (token mean), GRPO eq. 3 (sequence mean of token means), Dr. GRPO (constant L_max)
  overlong      DAPO (Yu et al. 2025) eq. 13
  TIS / mask    Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"
  k1 / k2 / k3  Schulman 2020, "Approximating KL divergence"
Every oracle is either a plain Python loop over floats or the paper's objective written directly in float64 and
differentiated by autograd (a graph of its own, never the function under test). Padding entries of the inputs
hold finite garbage, so that any leak of padding into the valid outputs, or any gradient into padding, shows.
"""
import math

import pytest
import torch

import train_ppo
from numerics import FLOAT32_ATOL, assert_close64

pytestmark = pytest.mark.numeric     # also run under ATEN_CPU_CAPABILITY=default by .ci/run

D = torch.float64


def T(x):
    return torch.as_tensor(x, dtype=D)


def lens_mask(lens, R):
    return (torch.arange(R)[None, :] < torch.tensor(lens)[:, None]).to(D)


def assert_zero(x, what=""):
    """An exact-zero expectation (a gradient that must vanish): float64 rounding only."""
    assert x.dtype == D
    torch.testing.assert_close(x, torch.zeros_like(x), rtol=0, atol=1e-12, msg=what)


# ----------------------------------------------------------------------------- 1. dual-clip PPO
RHOS = [0.3, 0.7, 0.95, 1.1, 1.25, 1.5, 2.5, 3.5, 6.0]
ADVS = [-1.7, -0.4, 0.0, 0.6, 1.3]


def grid(rhos=RHOS, advs=ADVS, seed=0):
    """(old_logp, logp leaf, adv) over the grid ρ × A; logp = old + log ρ, old < 0 (a log-probability)."""
    torch.manual_seed(seed)
    rho = T(rhos)[None, :].expand(len(advs), -1)
    adv = T(advs)[:, None].expand(-1, len(rhos)).contiguous()
    old = -torch.rand(rho.shape, dtype=D) * 3 - 0.05
    logp = (old + rho.log()).detach().requires_grad_()
    return old, logp, adv


def paper_dual_clip(logp, old, adv, eps_low, eps_high, c):
    """−(eq. 5): A < 0: max(min(ρA, clip(ρ)A), cA); A ≥ 0: min(ρA, clip(ρ)A)."""
    rho = torch.exp(logp - old)
    surr = torch.minimum(rho * adv, rho.clamp(1 - eps_low, 1 + eps_high) * adv)
    return -torch.where(adv < 0, torch.maximum(surr, c * adv), surr)


@pytest.mark.parametrize("eps_low,eps_high,c", [(0.2, 0.28, 3.0), (0.1, 0.2, 2.0)])
def test_dual_clip_matches_paper(eps_low, eps_high, c):
    """Values and ∇logp of dual_clip_loss(policy_loss(...)) against eq. 5 written directly. Fails if the cap
    applies to A ≥ 0 too, sits on the wrong side (cA vs −cA), or uses the wrong c; the grid has A < 0 tokens with
    ρ beyond c (capped, no gradient), between 1+ε_high and c (kept, gradient −Aρ) and below 1−ε_low."""
    old, logp, adv = grid()
    pl, _ = train_ppo.policy_loss(logp, old, adv, eps_low, eps_high)
    got = train_ppo.dual_clip_loss(pl, adv, c)
    g_got, = torch.autograd.grad(got.sum(), logp)

    lp2 = logp.detach().clone().requires_grad_()
    want = paper_dual_clip(lp2, old, adv, eps_low, eps_high, c)
    g_want, = torch.autograd.grad(want.sum(), lp2)
    assert_close64(got, want.detach())
    assert_close64(g_got, g_want)

    # hand-computed facts: A < 0, ρ = 6 > c → loss = −cA (plain PPO: −6A), no gradient
    i, j = ADVS.index(-1.7), RHOS.index(6.0)
    assert got[i, j].item() == pytest.approx(c * 1.7, rel=1e-12)
    assert pl[i, j].item() == pytest.approx(6.0 * 1.7, rel=1e-12)
    assert g_got[i, j].item() == 0.0
    # A < 0, 1 + ε_high < ρ = 1.5 < c: not capped, gradient −Aρ
    j = RHOS.index(1.5)
    assert g_got[i, j].item() == pytest.approx(1.7 * 1.5, rel=1e-12)
    # A ≥ 0: unchanged (ρ = 6 clipped at 1 + ε_high)
    pos = adv >= 0
    assert_close64(got[pos], pl[pos])
    # the dual clip is a lower bound of the objective: loss ≤ −cA wherever A < 0
    neg = adv < 0
    assert (got[neg] <= -c * adv[neg] + 1e-12).all()


def test_dual_clip_random():
    """Random ρ and A (no ties by construction of continuous draws): values and gradients against eq. 5."""
    torch.manual_seed(3)
    old = -torch.rand(6, 11, dtype=D) * 4
    logp = (old + torch.randn(6, 11, dtype=D) * 0.9).requires_grad_()
    adv = torch.randn(6, 11, dtype=D) * 2
    got = train_ppo.dual_clip_loss(train_ppo.policy_loss(logp, old, adv, 0.2, 0.3)[0], adv, 2.5)
    g_got, = torch.autograd.grad(got.sum(), logp)
    lp2 = logp.detach().clone().requires_grad_()
    want = paper_dual_clip(lp2, old, adv, 0.2, 0.3, 2.5)
    g_want, = torch.autograd.grad(want.sum(), lp2)
    assert_close64(got, want.detach())
    assert_close64(g_got, g_want)
    assert ((torch.exp(logp - old) > 2.5) & (adv < 0)).any()      # the cap is exercised


# ----------------------------------------------------------------------------- 2. GSPO
def gspo_inputs(targets, lens, R, seed, noise=0.4, garbage=2.0):
    """Per row i: a target sequence ratio s_i; per-token log ratios log s_i + zero-mean noise over the valid
    tokens (so the mean of the log ratio is exactly log s_i, the per-token ratios are far from s_i), garbage
    in padding (logp, old and adv)."""
    torch.manual_seed(seed)
    B = len(targets)
    mask = lens_mask(lens, R)
    old = -torch.rand(B, R, dtype=D) * 3 - 0.05
    n = torch.randn(B, R, dtype=D) * noise
    n = n - (n * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    lr = torch.log(T(targets))[:, None] + n
    lr = torch.where(mask.bool(), lr, torch.randn(B, R, dtype=D) * garbage)
    logp = (old + lr).detach().requires_grad_()
    return old, logp, mask


def paper_gspo_seq(logp, old, adv_seq, mask, eps_low, eps_high):
    """GSPO's sequence-level objective J = 1/G Σ_i min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i) with
    s_i = (π_θ(y_i)/π_old(y_i))^(1/|y_i|) = exp(1/|y_i| Σ_t (log π_θ − log π_old))."""
    lr = torch.where(mask.bool(), logp - old, torch.zeros_like(logp))
    s = torch.exp(lr.sum(1) / mask.sum(1))
    J = torch.minimum(s * adv_seq, s.clamp(1 - eps_low, 1 + eps_high) * adv_seq).mean()
    return J, s


def seq_avg(per_token, mask):
    """Each sequence's mean over its valid tokens (--loss_agg seq_mean_token_mean's inner mean)."""
    return (torch.where(mask.bool(), per_token, torch.zeros_like(per_token))).sum(1) / mask.sum(1)


def check_gspo(targets, advs, lens, R, eps_low, eps_high, seed, noise=0.4, adv_pad=None):
    old, logp, mask = gspo_inputs(targets, lens, R, seed, noise)
    adv_seq = T(advs)
    adv = adv_seq[:, None].expand(-1, R).clone()
    if adv_pad is not None:                                  # garbage advantages in padding
        adv = torch.where(mask.bool(), adv, torch.full_like(adv, adv_pad))
    loss, ratio = train_ppo.gspo_loss(logp, old, adv, mask, eps_low, eps_high)
    per_seq = seq_avg(loss, mask)
    g_got, = torch.autograd.grad(per_seq.mean(), logp)

    lp2 = logp.detach().clone().requires_grad_()
    J, s = paper_gspo_seq(lp2, old, adv_seq, mask, eps_low, eps_high)
    g_want, = torch.autograd.grad(-J, lp2)
    s = s.detach()

    # value per sequence: max(−A s, −A clip(s)), and (GSPO-token: s_i,t has value s_i) the same on every token
    want_seq = torch.maximum(-adv_seq * s, -adv_seq * s.clamp(1 - eps_low, 1 + eps_high))
    assert_close64(per_seq.detach(), want_seq)
    m = mask.bool()
    assert_close64(loss.detach()[m], want_seq[:, None].expand(-1, R)[m])
    assert_close64(ratio.detach()[m], s[:, None].expand(-1, R)[m])
    # gradient of the mean over sequences of the per-sequence means == ∇(−J_GSPO); padding gets exactly 0
    assert_close64(g_got, g_want)
    assert (g_got[~m] == 0).all()
    return s, g_got, mask


def test_gspo_clip_regions():
    """Hand-placed sequence ratios, asymmetric clip (ε_low=0.1, ε_high=0.2), lengths 6,3,1,4,2,5 of R=6:
      row 0  A>0, s=1.15  kept   (a symmetric clip at ε_low would clip it; a SUM instead of the length-normalised
                                  mean would give s=1.15^6 and clip it)
      row 1  A>0, s=1.35  clipped at 1+ε_high: no gradient
      row 2  A<0, s=0.85  clipped at 1−ε_low: value −0.9A, no gradient (a swapped ε would keep it)
      row 3  A<0, s=1.5   above the range, A<0: kept, gradient
      row 4  A>0, s=0.7   below the range, A>0: kept, gradient (single token)
      row 5  A<0, s=1.02  inside the range"""
    targets = [1.15, 1.35, 0.85, 1.5, 0.7, 1.02]
    advs = [1.3, 0.7, -0.9, -1.1, 0.5, -0.4]
    lens = [6, 3, 1, 4, 2, 5]
    s, g, mask = check_gspo(targets, advs, lens, 6, 0.1, 0.2, seed=0)
    assert_close64(s, T(targets))
    zero = (g.abs() * mask).sum(1) == 0
    assert zero.tolist() == [False, True, True, False, False, False]
    # row 0: gradient −A s / |y| on each of its tokens (GSPO: −A_i s_i ∇log s_i)
    assert_close64(g[0], torch.full((6,), -1.3 * 1.15 / 6, dtype=D) / len(advs))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_random(seed):
    """Random sequence ratios around the clip range, random signs, variable lengths with garbage padding
    (advantages included), the paper's defaults ε = (3e-4, 4e-4) with per-token log ratios of a few 1e-4."""
    torch.manual_seed(100 + seed)
    B, R = 7, 9
    lens = torch.randint(1, R + 1, (B,)).tolist()
    lens[0] = R
    advs = torch.randn(B, dtype=D).tolist()
    targets = torch.exp(torch.randn(B, dtype=D) * 4e-4).tolist()
    check_gspo(targets, advs, lens, R, 3e-4, 4e-4, seed=seed, noise=5e-4, adv_pad=7.0)
    targets = torch.exp(torch.randn(B, dtype=D) * 0.3).tolist()
    check_gspo(targets, advs, lens, R, 0.2, 0.27, seed=seed, noise=0.5, adv_pad=-5.0)


def test_gspo_token_advantages():
    """GSPO-token (eq. 7) with token-wise advantages A_i,t: J = 1/G Σ_i 1/|y_i| Σ_t min(s_i,t A_i,t,
    clip(s_i,t) A_i,t), s_i,t = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)], written directly and differentiated."""
    targets, lens, R = [1.1, 0.75, 1.4, 0.98], [5, 3, 2, 4], 5
    old, logp, mask = gspo_inputs(targets, lens, R, seed=4)
    torch.manual_seed(5)
    adv = torch.randn(len(targets), R, dtype=D)
    loss, _ = train_ppo.gspo_loss(logp, old, adv, mask, 0.2, 0.3)
    per_seq = seq_avg(loss, mask)
    g_got, = torch.autograd.grad(per_seq.mean(), logp)

    lp2 = logp.detach().clone().requires_grad_()
    lr = torch.where(mask.bool(), lp2 - old, torch.zeros_like(lp2))
    s = torch.exp(lr.sum(1) / mask.sum(1))
    s_t = s.detach()[:, None] * torch.exp(lp2 - lp2.detach())
    term = torch.minimum(s_t * adv, s_t.clamp(0.8, 1.3) * adv)
    J = (torch.where(mask.bool(), term, torch.zeros_like(term)).sum(1) / mask.sum(1)).mean()
    g_want, = torch.autograd.grad(-J, lp2)
    assert_close64(per_seq.detach(), (-torch.where(mask.bool(), term, torch.zeros_like(term)).sum(1)
                                      / mask.sum(1)).detach())
    assert_close64(g_got, g_want)


# ----------------------------------------------------------------------------- 3. CISPO
@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.28), (0.3, 0.15)])
def test_cispo(eps_low, eps_high):
    """Per token −sg(clip(ρ, 1−ε_low, 1+ε_high))·A·log π: value, and ∇logp = −clip(ρ)·A on EVERY token, the
    ones outside the clip range included (where PPO's policy_loss gives 0). Fails without the stop-gradient
    (∇ would pick up −A·log π·∂clip(ρ)), with a symmetric clip (ρ = 1.25 or 0.75 sit between the two ε), or
    if clipped tokens were silenced."""
    old, logp, adv = grid()
    loss, ratio = train_ppo.cispo_loss(logp, old, adv, eps_low, eps_high)
    g_got, = torch.autograd.grad(loss.sum(), logp)
    rho = torch.exp(logp.detach() - old)
    w = rho.clamp(1 - eps_low, 1 + eps_high)
    assert_close64(loss.detach(), -w * adv * logp.detach())
    assert_close64(ratio.detach(), rho)
    assert_close64(g_got, -w * adv)

    # the contrast with PPO: outside the range on the side the min picks, PPO has no gradient, CISPO has one
    pl, _ = train_ppo.policy_loss(logp, old, adv, eps_low, eps_high)
    g_ppo, = torch.autograd.grad(pl.sum(), logp)
    silenced = ((adv > 0) & (rho > 1 + eps_high)) | ((adv < 0) & (rho < 1 - eps_low))
    assert silenced.sum() >= 4
    assert (g_ppo[silenced] == 0).all()
    assert (g_got[silenced].abs() > 0.05).all()
    assert_close64(g_got[silenced], (-w * adv)[silenced])


# ----------------------------------------------------------------------------- 4. loss aggregation
AGG_LENS = [5, 0, 3, 7, 1, 7, 2, 4]        # row 1 fully masked
AGG_R, AGG_MAX_LEN = 7, 10                 # max_len (--max_new_tokens) ≠ R: catches using R as L_max


def o_aggregate(pt, lens, how, n_tokens, n_seqs, max_len):
    """(value, d value / d per_token) of one micro-batch's share, as Python loops from the formulas."""
    val, grad = 0.0, [[0.0] * len(row) for row in pt]
    for b, row in enumerate(pt):
        L = lens[b]
        if L == 0:
            continue
        den = {"token_mean": n_tokens, "seq_mean_token_mean": n_seqs * L,
               "seq_mean_token_sum_norm": n_seqs * max_len}[how]
        for t in range(L):
            val += row[t] / den
            grad[b][t] = 1.0 / den
    return val, grad


@pytest.mark.parametrize("how", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_aggregate_loss_shares(how, scale):
    """8 rows of variable lengths (one empty): one call on all 8 ≡ 2 calls of 4 ≡ 4 of 2 ≡ 8 of 1 (the empty
    row alone, too), each share against the oracle, the sum of the shares = the whole minibatch's loss, values
    AND gradients; the global n_tokens / n_seqs (every row, the empty one included: TRL's and verl's N) are
    passed to every call; `scale` multiplies both. Fails on a per-call normaliser, on 0/0 for the empty row, or
    on R as L_max."""
    torch.manual_seed(7)
    B, R = len(AGG_LENS), AGG_R
    mask = lens_mask(AGG_LENS, R)
    pt0 = torch.where(mask.bool(), torch.randn(B, R, dtype=D), torch.full((B, R), 50.0, dtype=D))
    n_tokens, n_seqs = float(sum(AGG_LENS)), float(len(AGG_LENS))
    counts = train_ppo.minibatch_counts(mask, mask)            # what update() all-reduces
    assert counts.tolist() == [n_tokens, n_tokens, n_seqs]
    whole, whole_g = o_aggregate(pt0.tolist(), AGG_LENS, how, n_tokens, n_seqs, AGG_MAX_LEN)
    # the whole-minibatch loss as TRL's GRPOTrainer writes it (loss_type "dapo", "grpo", "dr_grpo"): the row
    # means with lengths clamped to >= 1, averaged over ALL B rows; verl's seq-mean modes likewise over B
    rows = [[pt0[b, t].item() for t in range(L)] for b, L in enumerate(AGG_LENS)]
    paper = {"token_mean": sum(map(sum, rows)) / sum(map(len, rows)),
             "seq_mean_token_mean": sum(sum(v) / max(len(v), 1) for v in rows) / len(rows),
             "seq_mean_token_sum_norm": sum(sum(v) for v in rows) / (len(rows) * AGG_MAX_LEN)}[how]
    assert whole == pytest.approx(paper, rel=1e-12)
    for size in [8, 4, 2, 1]:
        pt = pt0.clone().requires_grad_()
        total = 0
        for s in range(0, B, size):
            share = train_ppo.aggregate_loss(pt[s:s + size], mask[s:s + size], how, n_tokens, n_seqs,
                                             AGG_MAX_LEN, scale=scale)
            want, _ = o_aggregate(pt0[s:s + size].tolist(), AGG_LENS[s:s + size], how, n_tokens, n_seqs,
                                  AGG_MAX_LEN)
            assert share.dim() == 0
            assert_close64(share.detach(), T(scale * want))
            total = total + share
        total.backward()
        assert_close64(total.detach(), T(scale * whole))
        assert_close64(pt.grad, scale * T(whole_g))
        assert (pt.grad[1] == 0).all() and (pt.grad[~mask.bool()] == 0).all()


# ----------------------------------------------------------------------------- 5. overlong penalty
@pytest.mark.parametrize("max_len,buffer", [(20, 4), (20, 3), (512, 128)])
def test_overlong_penalty(max_len, buffer):
    """DAPO eq. 13: 0 for |y| ≤ L_max − L_cache, ((L_max − L_cache) − |y|)/L_cache up to L_max, −1 beyond;
    every length from 0 to L_max + 3, boundaries included, as an integer and as a float64 tensor."""
    start = max_len - buffer

    def paper(y):
        if y <= start:
            return 0.0
        if y <= max_len:
            return (start - y) / buffer
        return -1.0

    ys = list(range(0, max_len + 4))
    want = T([paper(y) for y in ys])
    for lengths in [torch.tensor(ys), torch.tensor(ys, dtype=D)]:
        got = train_ppo.overlong_penalty(lengths, max_len, buffer)
        # the score it is added to is float32: a float32 result (it is one even for float64 lengths) is compared
        # at float32 precision, a float64 one at float64's
        if got.dtype == D:
            assert_close64(got, want)
        else:
            torch.testing.assert_close(got.to(D), want, rtol=0, atol=FLOAT32_ATOL)
        # the boundaries, by hand
        at = {y: got[i].item() for i, y in enumerate(ys)}
        assert at[start] == 0.0 and at[0] == 0.0
        assert at[start + 1] == pytest.approx(-1.0 / buffer, abs=FLOAT32_ATOL)
        assert at[start + 1] < 0
        assert at[max_len] == pytest.approx(-1.0, abs=FLOAT32_ATOL)
        assert at[max_len + 1] == pytest.approx(-1.0, abs=FLOAT32_ATOL)
        assert at[max_len + 3] == pytest.approx(-1.0, abs=FLOAT32_ATOL)


# ----------------------------------------------------------------------------- 6. rollout correction
def o_correction(lr, lens, how, level, cap):
    """(weights, share of valid tokens hit) from the per-token log ratios log π_train − log π_sampler."""
    R = len(lr[0])
    w = [[0.0] * R for _ in lr]
    hit = 0
    for b, L in enumerate(lens):
        if level == "sequence":
            ratios = [math.exp(sum(lr[b][:L]))] * L
        else:
            ratios = [math.exp(x) for x in lr[b][:L]]
        for t, r in enumerate(ratios):
            if how == "tis":
                w[b][t] = min(r, cap)
                hit += r > cap
            else:
                keep = 1.0 / cap <= r <= cap
                w[b][t] = 1.0 if keep else 0.0
                hit += not keep
    return w, hit / sum(lens)


def correction_inputs(lr, lens, pad=3.0, seed=0):
    torch.manual_seed(seed)
    B, R = len(lr), len(lr[0])
    mask = lens_mask(lens, R)
    lr_t = torch.where(mask.bool(), T(lr), torch.full((B, R), pad, dtype=D))
    sampler = -torch.rand(B, R, dtype=D) * 3 - 0.05
    train = (sampler + lr_t).detach().requires_grad_()
    return train, sampler, mask


# rows: token ratios ~1.35 but sequence ratio e^0.9 = 2.46 > C; token ratios e^1 > C and e^-0.9 < 1/C but sequence
# ratio e^0.1 inside; sequence ratio e^-0.7 = 0.497 < 1/C; an empty row. Padding log ratio +3 (e^3 = 20): it would
# push row 1's sequence ratio past C, row 2's inside.
HAND_LR = [[0.3, 0.3, 0.3, 0.0], [1.0, -0.9, 0.0, 0.0], [-0.4, -0.4, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0]]
HAND_LENS = [3, 2, 4, 0]
E = math.exp
HAND_WANT = {
    ("tis", "token"): ([[E(.3)] * 3 + [0], [2.0, E(-.9), 0, 0], [E(-.4), E(-.4), E(.1), 1.0], [0] * 4], 1 / 9),
    ("tis", "sequence"): ([[2.0] * 3 + [0], [E(.1)] * 2 + [0, 0], [E(-.7)] * 4, [0] * 4], 3 / 9),
    ("mask", "token"): ([[1.0] * 3 + [0], [0.0] * 4, [1.0] * 4, [0] * 4], 2 / 9),
    ("mask", "sequence"): ([[0.0] * 4, [1.0] * 2 + [0, 0], [0.0] * 4, [0] * 4], 7 / 9),
}


@pytest.mark.parametrize("how,level", list(HAND_WANT))
def test_rollout_correction_hand(how, level):
    """Hand-made log ratios with C = 2, expected weights and hit shares written out by hand (HAND_WANT), and
    the loop oracle agreeing with them: TIS min(ratio, C) (no lower cap), mask 1 iff ratio ∈ [1/C, C]; level
    sequence: exp(Σ_valid log ratio) for every valid token of the row; padding weight 0; detached."""
    train, sampler, mask = correction_inputs(HAND_LR, HAND_LENS)
    w, hit = train_ppo.rollout_correction(train, sampler, mask, how, level, 2.0)
    want_w, want_hit = HAND_WANT[(how, level)]
    o_w, o_hit = o_correction(HAND_LR, HAND_LENS, how, level, 2.0)
    assert_close64(T(o_w), T(want_w))
    assert o_hit == pytest.approx(want_hit, rel=1e-12)
    assert not w.requires_grad
    assert_close64(w.to(D), T(want_w))
    assert float(hit) == pytest.approx(want_hit, rel=1e-12)
    assert (w[~mask.bool()] == 0).all()


@pytest.mark.parametrize("how", ["tis", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [2.0, 1.3])
def test_rollout_correction_random(how, level, cap):
    """Random log ratios, variable lengths with an empty row, garbage padding, against the loop."""
    torch.manual_seed(11)
    B, R = 6, 8
    lens = torch.randint(1, R + 1, (B,)).tolist()
    lens[2] = 0
    lr = torch.randn(B, R, dtype=D) * 0.5
    if level == "sequence":   # shift each row so that its sum lands on both sides of log C and −log C, for both C
        m = lens_mask(lens, R)
        sums = T([-0.9, 0.4, 0.0, 0.1, 0.8, -0.2])
        lr = lr - ((lr * m).sum(1) - sums)[:, None] / m.sum(1, keepdim=True).clamp(min=1)
    lr = lr.tolist()
    train, sampler, mask = correction_inputs(lr, lens, pad=-4.0)
    w, hit = train_ppo.rollout_correction(train, sampler, mask, how, level, cap)
    o_w, o_hit = o_correction(lr, lens, how, level, cap)
    assert not w.requires_grad
    assert_close64(w.to(D), T(o_w))
    assert float(hit) == pytest.approx(o_hit, rel=1e-12, abs=1e-15)
    assert 0 < o_hit < 1                                       # the case is not trivial


# ----------------------------------------------------------------------------- 7. KL estimators as a loss
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_estimate_expected_gradient(seed):
    """π = softmax(θ) on 5 categories, fixed π_ref. The exact expectation over y ~ π of the loss's gradient
    (Σ_y sg(π(y))·∇_θ k(log π(y) − log π_ref(y)), through log π only) against closed forms:
      k1 → 0;  k2 → ∇KL(π‖π_ref) = π ⊙ (d − KL);  k3 → ∇KL(π_ref‖π) = π − π_ref.
    And the values Σ_y π(y) k(y) = KL(π‖π_ref) for k1 and k3 (unbiased), not for k2. Each gradient is also
    asserted far from the other KL's, so that mixing them up fails."""
    torch.manual_seed(seed)
    theta = torch.randn(5, dtype=D, requires_grad=True)
    logp_ref = torch.log_softmax(torch.randn(5, dtype=D), 0)[None, :]
    pi, pi_ref = torch.softmax(theta.detach(), 0), logp_ref[0].exp()
    d = torch.log(pi) - logp_ref[0]
    kl_rev = (pi * d).sum()
    g_rev = pi * (d - kl_rev)                    # ∇_θ Σ π (log π − log π_ref)
    g_fwd = pi - pi_ref                          # ∇_θ Σ π_ref (log π_ref − log π)
    assert (g_rev - g_fwd).abs().max() > 1e-2

    got = {}
    for kind in ["k1", "k2", "k3"]:
        logp = torch.log_softmax(theta, 0)[None, :]
        k = train_ppo.kl_estimate(logp, logp_ref, kind)
        expected_loss = (pi[None, :] * k).sum()  # weights sg(π): the samples' distribution is not differentiated
        g, = torch.autograd.grad(expected_loss, theta)
        got[kind] = (expected_loss.detach(), g)

    assert_zero(got["k1"][1], "k1's expected gradient is 0")
    assert_close64(got["k2"][1], g_rev)
    assert_close64(got["k3"][1], g_fwd)
    assert (got["k2"][1] - g_fwd).abs().max() > 1e-2
    assert (got["k3"][1] - g_rev).abs().max() > 1e-2
    assert_close64(got["k1"][0], kl_rev)
    assert_close64(got["k3"][0], kl_rev)
    assert_close64(got["k2"][0], (pi * d * d).sum() / 2)
    assert abs(got["k2"][0] - kl_rev) > 1e-3


def test_kl_estimate_k3_tiny_d():
    """k3 = e^−d − 1 + d for |d| ~ 1e-4..1e-5 against its Taylor series d²/2 − d³/6 + d⁴/24 − d⁵/120: the
    naive float64 exp(−d) − 1 + d loses ~1e-8..1e-7 relative here (beyond assert_close64's 1e-9); expm1 does not."""
    ds = [1e-4, -1e-4, 3e-5, -2e-5, 7e-5]
    d = T(ds)
    got = train_ppo.kl_estimate(d[None, :], torch.zeros(1, len(ds), dtype=D), "k3")[0]
    want = T([x * x / 2 - x ** 3 / 6 + x ** 4 / 24 - x ** 5 / 120 for x in ds])
    assert_close64(got, want)
    naive = torch.exp(-d) - 1 + d
    with pytest.raises(AssertionError):          # the test can tell the two apart
        assert_close64(naive, want)
