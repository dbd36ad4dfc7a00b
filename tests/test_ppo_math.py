"""Independent float64 oracle for the PPO / critic-free math in train_ppo.py.

Written from docs/algorithms.md (sections #ppo and #critic-free-estimators) and the
functions' documented contract only, without reading their bodies. Every oracle is a plain Python
loop over floats, straight from the equations. Responses are right-padded; padding entries of the
inputs are filled with garbage so that any leak of padding into valid outputs is caught.
"""
import math

import pytest
import torch

import train_ppo

pytestmark = pytest.mark.numeric     # also run under ATEN_CPU_CAPABILITY=default by .ci/run

D = torch.float64
ATOL = 1e-10
SHAPES = [(1, 1), (3, 5), (4, 9), (7, 16)]


def make_mask(B, R, g, min_len=1):
    lens = torch.randint(min_len, R + 1, (B,), generator=g)
    lens[0] = R  # always one full row
    return (torch.arange(R)[None, :] < lens[:, None]).to(D), lens.tolist()


def rand(shape, g, scale=1.0):
    return torch.randn(shape, generator=g, dtype=D) * scale


def garbage(x, mask):
    return torch.where(mask.bool(), x, torch.full_like(x, 1e3))


def close(got, exp, atol=ATOL):
    exp = torch.as_tensor(exp, dtype=D)
    assert got.shape == exp.shape, (got.shape, exp.shape)
    torch.testing.assert_close(got.to(D), exp, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- oracles
def o_gae(r, v, lens, gamma, lam):
    B, R = len(r), len(r[0])
    A, G = [[0.0] * R for _ in range(B)], [[0.0] * R for _ in range(B)]
    for b in range(B):
        nxt_a = nxt_v = 0.0
        for t in reversed(range(lens[b])):
            delta = r[b][t] + gamma * nxt_v - v[b][t]
            A[b][t] = delta + gamma * lam * nxt_a
            G[b][t] = A[b][t] + v[b][t]
            nxt_a, nxt_v = A[b][t], v[b][t]
    return A, G


def o_rtg(r, lens, gamma):
    out = [[0.0] * len(r[0]) for _ in r]
    for b in range(len(r)):
        for t in range(lens[b]):
            out[b][t] = sum(gamma ** (s - t) * r[b][s] for s in range(t, lens[b]))
    return out


def o_policy(lp, olp, a, cl, ch):
    """(loss, d loss / d logp) per element."""
    rho = math.exp(lp - olp)
    unclipped, clipped = -a * rho, -a * min(max(rho, 1 - cl), 1 + ch)
    outside = rho < 1 - cl or rho > 1 + ch
    grad = 0.0 if (clipped > unclipped and outside) else -a * rho
    return max(unclipped, clipped), grad, rho


def o_value(v, vo, g, eps):
    vc = vo + min(max(v - vo, -eps), eps)
    lu, lc = (v - g) ** 2, (vc - g) ** 2
    outside = abs(v - vo) > eps
    grad = 0.0 if (lc > lu and outside) else (v - g)
    return 0.5 * max(lu, lc), grad, lc > lu


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("seed", [0, 1])
def test_kl_estimate(seed):
    g = torch.Generator().manual_seed(seed)
    lp, rl = rand((4, 7), g), rand((4, 7), g)
    k1 = [[a - b for a, b in zip(x, y)] for x, y in zip(lp.tolist(), rl.tolist())]
    k3 = [[math.exp(-d) - 1 + d for d in row] for row in k1]
    close(train_ppo.kl_estimate(lp, rl), k1)
    close(train_ppo.kl_estimate(lp, rl, kind="k1"), k1)
    close(train_ppo.kl_estimate(lp, rl, kind="k3"), k3)
    assert (train_ppo.kl_estimate(lp, rl, kind="k3") >= 0).all()


@pytest.mark.parametrize("B,R", SHAPES)
def test_token_rewards(B, R):
    """Rows of every length, empty ones included (B > 2): an empty row gets no reward at all."""
    g = torch.Generator().manual_seed(B * 100 + R)
    mask, lens = make_mask(B, R, g, min_len=0 if B > 2 else 1)
    if B > 2:
        mask[1], lens[1] = 0.0, 0                  # always one empty row
    score, kl, beta = rand((B,), g), garbage(rand((B, R), g), mask), 0.07
    exp = [[0.0] * R for _ in range(B)]
    for b in range(B):
        for t in range(lens[b]):
            exp[b][t] = -beta * kl[b, t].item() + (score[b].item() if t == lens[b] - 1 else 0.0)
    close(train_ppo.token_rewards(score, kl, mask, beta), exp)


@pytest.mark.parametrize("B,R", SHAPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae(B, R, gamma, lam):
    g = torch.Generator().manual_seed(B * 100 + R)
    mask, lens = make_mask(B, R, g, min_len=0 if B > 2 else 1)
    r, v = garbage(rand((B, R), g), mask), garbage(rand((B, R), g), mask)
    A, G = train_ppo.gae(r, v, mask, gamma=gamma, lam=lam)
    eA, eG = o_gae(r.tolist(), v.tolist(), lens, gamma, lam)
    close(A, eA)
    close(G, eG)


@pytest.mark.parametrize("B,R", SHAPES)
def test_gae_special_cases(B, R):
    """lam=1, gamma=1: A = Monte-Carlo return - V; lam=0: A = one-step TD error."""
    g = torch.Generator().manual_seed(7 + B * R)
    mask, lens = make_mask(B, R, g)
    r, v = garbage(rand((B, R), g), mask), garbage(rand((B, R), g), mask)
    A, G = train_ppo.gae(r, v, mask, gamma=1.0, lam=1.0)
    mc = torch.tensor(o_rtg(r.tolist(), lens, 1.0), dtype=D)
    close(A, (mc - v) * mask)
    close(G, mc)
    A0, _ = train_ppo.gae(r, v, mask, gamma=0.9, lam=0.0)
    td = [[0.0] * R for _ in range(B)]
    for b in range(B):
        for t in range(lens[b]):
            nv = v[b, t + 1].item() if t + 1 < lens[b] else 0.0
            td[b][t] = r[b, t].item() + 0.9 * nv - v[b, t].item()
    close(A0, td)


@pytest.mark.parametrize("B,R", SHAPES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reward_to_go(B, R, gamma):
    g = torch.Generator().manual_seed(B * 10 + R)
    mask, lens = make_mask(B, R, g, min_len=0 if B > 2 else 1)
    r = garbage(rand((B, R), g), mask)
    close(train_ppo.reward_to_go(r, mask, gamma=gamma), o_rtg(r.tolist(), lens, gamma))


def o_whiten(x, lens, R):
    vals = [x[b][t] for b in range(len(x)) for t in range(lens[b])]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((u - mean) ** 2 for u in vals) / (n - 1)  # Bessel
    return [[(x[b][t] - mean) / math.sqrt(var + 1e-8) if t < lens[b] else 0.0 for t in range(R)]
            for b in range(len(x))]


WHITEN_SHAPES = [(2, 3), (4, 9), (7, 16)]


def whiten(x, mask):
    """masked_whiten with the statistics of x itself (one rank), as the loop computes them: n and Σx, then
    the squared deviations around that mean."""
    n, total = train_ppo.masked_sums(x, mask)
    mean = total / n
    return train_ppo.masked_whiten(x, mask, n, mean, train_ppo.masked_sq_dev(x, mask, mean))


@pytest.mark.parametrize("B,R", WHITEN_SHAPES)
def test_masked_sums(B, R):
    g = torch.Generator().manual_seed(B + R)
    mask, lens = make_mask(B, R, g)
    x = garbage(rand((B, R), g), mask)
    vals = [x[b, t].item() for b in range(B) for t in range(lens[b])]
    close(train_ppo.masked_sums(x, mask), [len(vals), sum(vals)])
    close(train_ppo.masked_sq_dev(x, mask, torch.tensor(0.5, dtype=D)), sum((v - 0.5) ** 2 for v in vals))


@pytest.mark.parametrize("B,R", WHITEN_SHAPES)
def test_masked_whiten_formula(B, R):
    """Mean/Bessel-variance/eps/padding, on well-conditioned data, at float32-statistics tolerance."""
    g = torch.Generator().manual_seed(B + R)
    mask, lens = make_mask(B, R, g)
    x = garbage(rand((B, R), g, 3.0) + 5.0, mask)
    close(whiten(x, mask), o_whiten(x.tolist(), lens, R), atol=1e-6)


@pytest.mark.parametrize("B,R", WHITEN_SHAPES)
def test_masked_whiten_float64(B, R):
    g = torch.Generator().manual_seed(B + R)
    mask, lens = make_mask(B, R, g)
    x = garbage(rand((B, R), g, 3.0) + 5.0, mask)
    close(whiten(x, mask), o_whiten(x.tolist(), lens, R))


@pytest.mark.parametrize("B,R", WHITEN_SHAPES)
def test_masked_whiten_global_statistics(B, R):
    """Two 'ranks' holding halves of the batch: their summed masked_sums, then their summed masked_sq_dev
    around that global mean, whiten each half exactly as the whole batch is whitened at once (what the loop's
    two all-reduces give under DDP)."""
    g = torch.Generator().manual_seed(10 * B + R)
    mask, lens = make_mask(B, R, g)
    x = garbage(rand((B, R), g, 2.0) - 1.0, mask)
    h = B // 2
    n, total = train_ppo.masked_sums(x[:h], mask[:h]) + train_ppo.masked_sums(x[h:], mask[h:])
    mean = total / n
    sq_dev = train_ppo.masked_sq_dev(x[:h], mask[:h], mean) + train_ppo.masked_sq_dev(x[h:], mask[h:], mean)
    halves = torch.cat([train_ppo.masked_whiten(x[:h], mask[:h], n, mean, sq_dev),
                        train_ppo.masked_whiten(x[h:], mask[h:], n, mean, sq_dev)])
    close(halves, o_whiten(x.tolist(), lens, R))


def test_masked_whiten_offset_float32():
    """mean ≫ std (un-centred reward-to-go) with float32 advantages: exact to float32 output precision."""
    g = torch.Generator().manual_seed(1)
    mask, lens = make_mask(8, 32, g)
    x = garbage(rand((8, 32), g) + 1000.0, mask).float()
    exp = o_whiten(x.double().tolist(), lens, 32)
    close(whiten(x, mask.float()), exp, atol=1e-3)


@pytest.mark.parametrize("mean,std", [(1e5, 1e-2), (1e6, 1e-1), (1e7, 1.0)])
def test_masked_whiten_far_offset(mean, std):
    """|mean| ≫ std (mean/std = 1e7): the variance is Σ(x − μ)² in a second pass, as documented. The one-pass
    Σx² − n·μ² cancels catastrophically even in float64: 1e-2 off the two-pass float64 reference here."""
    g = torch.Generator().manual_seed(2)
    mask, lens = make_mask(16, 32, g, min_len=8)
    x = garbage(rand((16, 32), g, std) + mean, mask)
    close(whiten(x, mask), o_whiten(x.tolist(), lens, 32), atol=1e-6)


def sq_dev(x, mask):
    n, total = train_ppo.masked_sums(x, mask)
    return train_ppo.masked_sq_dev(x, mask, total / n)


@pytest.mark.parametrize("B,R,offset", [(2, 3, 0.0), (4, 9, 0.0), (7, 16, 0.0), (7, 16, 1e7)])
def test_explained_variance(B, R, offset):
    """1 − Var(G − V)/Var(G) over the valid tokens (population variances), from the squared deviations; with
    returns far from 0 (offset 1e7 ≫ their std 1) as well, where a one-pass variance would be ~1% off."""
    g = torch.Generator().manual_seed(3 * B + R)
    mask, lens = make_mask(B, R, g)
    G, V = garbage(rand((B, R), g) + offset, mask), garbage(rand((B, R), g) + offset, mask)
    gs = [G[b, t].item() for b in range(B) for t in range(lens[b])]
    ds = [G[b, t].item() - V[b, t].item() for b in range(B) for t in range(lens[b])]
    pvar = lambda xs: sum((u - sum(xs) / len(xs)) ** 2 for u in xs) / len(xs)
    got = train_ppo.explained_variance(sq_dev(G, mask), sq_dev(G - V, mask))
    assert got == pytest.approx(1 - pvar(ds) / pvar(gs), abs=1e-9)
    assert math.isnan(train_ppo.explained_variance(sq_dev(G * 0 + 2, mask), sq_dev(G - V, mask)))


@pytest.mark.parametrize("groups,k", [(1, 2), (3, 4), (5, 3)])
def test_critic_free(groups, k):
    g = torch.Generator().manual_seed(groups * k)
    Rw = rand((groups * k,), g)
    Rw[:k] = 0.25  # first group: all equal
    rl, gr, dr = [], [], []
    for j in range(groups):
        grp = Rw[j * k:(j + 1) * k].tolist()
        mean = sum(grp) / k
        std = math.sqrt(sum((u - mean) ** 2 for u in grp) / (k - 1))
        for i, u in enumerate(grp):
            rl.append(u - (sum(grp) - u) / (k - 1))
            gr.append(0.0 if len(set(grp)) == 1 else (u - mean) / (std + 1e-4))
            dr.append(u - mean)
    close(train_ppo.rloo_advantages(Rw, k), rl)
    got = train_ppo.grpo_advantages(Rw, k)
    close(got, gr)
    assert (got[:k] == 0).all(), got[:k]  # exact zeros, not float noise
    close(train_ppo.dr_grpo_advantages(Rw, k), dr)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo"])
def test_group_advantage_keeps_the_kl_penalty_outside_the_group(estimator):
    """With the KL in the reward, the scores get the estimator's statistic and the sequence's KL penalty
    p_i = −β·Σ_t k1_t only its baseline (GRPO and Dr. GRPO: minus the group's mean; RLOO: minus the mean of the
    others), never a division by the scores' spread: a group whose scores are all equal (rows 0-2) trains on its
    centred KL penalty alone, unscaled. Oracle: Python loops from the formulas, float64."""
    g = torch.Generator().manual_seed(5)
    k, R, beta = 3, 4, 0.05
    lens = [4, 2, 3, 1, 4, 3]
    mask = torch.tensor([[1.0 if t < L else 0.0 for t in range(R)] for L in lens], dtype=D)
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0], dtype=D)
    logp, ref = rand((6, R), g, 0.5), rand((6, R), g, 0.5)
    r = train_ppo.Rollout(query_response=torch.zeros(6, R + 2, dtype=torch.long), attention_mask=None,
                          response_mask=mask, logprobs=logp, ref_logprobs=ref, values=None, scores=scores,
                          raw_scores=scores, gold=None, has_eos=torch.ones(6, dtype=D), completions=[""] * 6)
    got = train_ppo.advantages(r, estimator=estimator, beta=beta, k=k)
    pen = [-beta * sum((logp[i, t] - ref[i, t]).item() for t in range(lens[i])) for i in range(6)]
    want = []
    for j in range(0, 6, k):
        grp, pg = scores[j:j + k].tolist(), pen[j:j + k]
        mean = sum(grp) / k
        std = math.sqrt(sum((u - mean) ** 2 for u in grp) / (k - 1))
        for i in range(j, j + k):
            s, p = grp[i - j], pg[i - j]
            a = {"grpo": (0.0 if len(set(grp)) == 1 else (s - mean) / (std + 1e-4)) + p - sum(pg) / k,
                 "rloo": (s + p) - (sum(grp) + sum(pg) - s - p) / (k - 1),
                 "dr_grpo": (s + p) - (sum(grp) + sum(pg)) / k}[estimator]
            want.append([a if t < lens[i] else 0.0 for t in range(R)])
    close(got.adv, want)
    close(got.kl_penalty, pen)
    if estimator == "grpo":     # the zero-spread group: its KL penalty minus the group's mean, nothing else
        centred = torch.tensor(pen[:3], dtype=D) - sum(pen[:3]) / 3
        close(got.adv[:3, 0], centred)
    # with the KL in the loss, the advantage is the scores' statistic alone
    in_loss = train_ppo.advantages(r, estimator=estimator, beta=beta, k=k, kl_in_loss=True)
    stat = {"grpo": train_ppo.grpo_advantages, "rloo": train_ppo.rloo_advantages,
            "dr_grpo": train_ppo.dr_grpo_advantages}[estimator](scores, k)
    assert torch.equal(in_loss.adv, stat[:, None] * mask)


def test_grpo_exact_zero_awkward_values():
    Rw = torch.tensor([0.1, 0.1, 0.1, 1 / 3, 1 / 3, 1 / 3, 0.7, 0.7, 0.7], dtype=D)
    assert (train_ppo.grpo_advantages(Rw, 3) == 0).all()
    assert (train_ppo.grpo_advantages(Rw.float(), 3) == 0).all()


@pytest.mark.parametrize("cl,ch", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)])
def test_policy_loss(cl, ch):
    g = torch.Generator().manual_seed(int(ch * 100))
    rhos = [1 + ch, 1 - cl, 1 + ch + 1e-6, 1 + ch - 1e-6, 1 - cl + 1e-6, 1 - cl - 1e-6, 1.0, 2.0, 0.5]
    rhos += torch.exp(rand((40,), g, 0.4)).tolist()
    advs = [1.3, -0.7] + rand((8,), g).tolist()
    pairs = [(r, a) for r in rhos for a in advs] + [(1.5, 0.0)]
    old = rand((len(pairs),), g)
    lp = (old + torch.tensor([math.log(r) for r, _ in pairs], dtype=D)).requires_grad_(True)
    adv = torch.tensor([a for _, a in pairs], dtype=D)
    loss, ratio = train_ppo.policy_loss(lp, old, adv, clip_low=cl, clip_high=ch)
    (glp,) = torch.autograd.grad(loss.sum(), lp)
    exp = [o_policy(a_, b_, c_, cl, ch) for a_, b_, c_ in zip(lp.tolist(), old.tolist(), adv.tolist())]
    close(loss.detach(), [e[0] for e in exp])
    close(ratio.detach(), [e[2] for e in exp])
    # exact-boundary points: any subgradient is fine, compare gradients elsewhere only
    rr = ratio.detach()
    off = ((rr - (1 + ch)).abs() > 1e-12) & ((rr - (1 - cl)).abs() > 1e-12)
    close(glp[off], torch.tensor([e[1] for e in exp], dtype=D)[off])
    # explicit sanity: zero gradient exactly where clipped branch is strictly active
    assert (glp[(adv > 0) & (ratio.detach() > 1 + ch + 1e-9)] == 0).all()
    assert (glp[(adv < 0) & (ratio.detach() < 1 - cl - 1e-9)] == 0).all()


def test_policy_loss_batched_shape():
    g = torch.Generator().manual_seed(3)
    lp, old, adv = rand((3, 6), g, 0.3), rand((3, 6), g, 0.3), rand((3, 6), g)
    loss, ratio = train_ppo.policy_loss(lp, old, adv)
    exp = [[o_policy(a, b, c, 0.2, 0.2)[0] for a, b, c in zip(*rows)]
           for rows in zip(lp.tolist(), old.tolist(), adv.tolist())]
    close(loss, exp)
    assert ratio.shape == (3, 6)


@pytest.mark.parametrize("eps", [0.2, 0.5])
def test_value_loss(eps):
    g = torch.Generator().manual_seed(int(eps * 10))
    vo, G = rand((200,), g), rand((200,), g)
    v = (vo + rand((200,), g, 0.6)).requires_grad_(True)
    loss, flag = train_ppo.value_loss(v, vo, G, clip=eps)
    (gv,) = torch.autograd.grad(loss.sum(), v)
    exp = [o_value(a, b, c, eps) for a, b, c in zip(v.tolist(), vo.tolist(), G.tolist())]
    close(loss.detach(), [e[0] for e in exp])
    close(gv, [e[1] for e in exp])
    lu = torch.tensor([(a - c) ** 2 for a, c in zip(v.tolist(), G.tolist())], dtype=D)
    lc = torch.tensor([(b + min(max(a - b, -eps), eps) - c) ** 2 for a, b, c in
                       zip(v.tolist(), vo.tolist(), G.tolist())], dtype=D)
    clear = (lc - lu).abs() > 1e-9  # inside the clip range the branches tie up to rounding
    assert flag.dtype == torch.bool and flag.shape == v.shape
    assert (flag[clear] == (lc > lu)[clear]).all()
    assert any(e[2] for e in exp) and not all(e[2] for e in exp)  # both branches exercised


def test_adaptive_kl():
    ctl = train_ppo.AdaptiveKL(0.1, 6.0, 10000)
    beta = 0.1
    for kl, n in [(6.0, 256), (9.0, 256), (6.6, 512), (1.0, 128), (5.4, 256), (100.0, 1000)]:
        err = min(max(kl / 6.0 - 1, -0.2), 0.2)
        beta = beta * (1 + err * n / 10000)
        ctl.update(kl, n)
        assert abs(float(ctl.beta) - beta) < 1e-12, (kl, n, ctl.beta, beta)
