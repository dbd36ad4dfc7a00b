"""Log-prob gathers keep the model's precision: a float64 model gives float64 log-probs equal to the float32 model's
to float32 rounding, and a bfloat16 model runs and gives float32 (the log-softmax is taken in float32). Every gather
of the package and the scripts, listed here:

  train_ppo.response_logprobs (and its entropies), nano_rlhf.evaluate.response_logprobs, train_dpo.token_logps,
  train_dpo.sequence_logps, train_online.seq_logps (through train_ppo's), nano_rlhf.model.token_logprobs.

Every loss and advantage function of the scripts, listed in LOSSES below, keeps its inputs' precision the same way:
float64 inputs give float64 outputs equal to the float32 ones (a float32 buffer or constant inside would round a
float64 run, silently).

Tolerance: the float32 path rounds each of ~30 layer outputs at 2^-24 relative; log-probs of a tiny random model
are O(5), so agreement to 1e-4 absolute leaves an order of magnitude over the accumulated rounding."""
import types

import pytest
import torch

import train_dpo
import train_listwise
import train_online
import train_ppo
import train_ppo_lagrangian
import train_rm
import train_unpaired
from conftest import tiny_model
from nano_rlhf import evaluate
from nano_rlhf.model import token_logprobs

pytestmark = pytest.mark.numeric


def batch(tok):
    torch.manual_seed(0)
    ids = torch.randint(3, tok.vocab_size, (3, 12))
    attn = torch.ones_like(ids)
    attn[0, :2] = 0                                   # one left-padded prompt
    response = torch.zeros(3, 5)
    response[:, :3] = 1
    response[1, :5] = 1
    return ids, attn, response


def gathers(model, ids, attn, response):
    """{name: tensor} of every gather on one batch (response: the last 5 columns of ids)."""
    full = torch.cat([torch.zeros(3, ids.shape[1] - 5), response], 1)
    lp, ent = train_ppo.response_logprobs(model, ids, attn, response, 1.0, with_entropy=True)
    samples = types.SimpleNamespace(query_response=ids, attention_mask=attn, response_mask=response)
    with torch.no_grad():
        hidden = model(ids, attn, return_hidden=True)[:, :-1].reshape(-1, model.cfg.n_embd)
    return {"train_ppo.response_logprobs": lp, "train_ppo.response_logprobs entropy": ent,
            "evaluate.response_logprobs": evaluate.response_logprobs(model, ids, attn, response, 0.7),
            "train_dpo.token_logps": train_dpo.token_logps(model, ids, attn, full),
            "train_dpo.sequence_logps": train_dpo.sequence_logps(model, ids, attn, full)[0],
            "train_online.seq_logps": train_online.seq_logps(model, samples, types.SimpleNamespace(
                dtype="float32", temperature=1.0))[1],
            "model.token_logprobs": token_logprobs(hidden, model.output_weight(), ids[:, 1:].reshape(-1))}


def test_float64_models_give_float64_log_probs_equal_to_float32(tok):
    ids, attn, response = batch(tok)
    m32 = tiny_model(tok)
    m64 = tiny_model(tok).double()
    with torch.no_grad():
        a, b = gathers(m32, ids, attn, response), gathers(m64, ids, attn, response.double())
    for name in a:
        assert a[name].dtype == torch.float32 and b[name].dtype == torch.float64, name
        assert torch.allclose(a[name].double(), b[name], atol=1e-4, rtol=0), name


def test_bfloat16_models_run_and_give_float32_log_probs(tok):
    ids, attn, response = batch(tok)
    with torch.no_grad():
        out = gathers(tiny_model(tok).to(torch.bfloat16), ids, attn, response)
    for name, x in out.items():
        assert x.dtype == torch.float32 and torch.isfinite(x).all(), name


# ---- losses and advantages ----------------------------------------------------------------------------------------
B, R, K = 6, 5, 3


def _inputs(dtype):
    """One set of inputs (the same values in either dtype): float tensors drawn in float64 and cast, masks and ids."""
    g = torch.Generator().manual_seed(0)
    x = {n: torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for n, shape in
         (("a", (B,)), ("b", (B,)), ("c", (B,)), ("ta", (B, R)), ("tb", (B, R)), ("tc", (B, R)), ("grid", (2, K)),
          ("grid2", (2, K)), ("uk", (B, K)), ("logits", (B, 11)))}
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[0, 3:] = False
    mask[1, 1:] = False
    x.update(mask=mask, lens=torch.tensor([3.0, 1.0, 5.0, 5.0, 4.0, 2.0], dtype=dtype),
             prob=torch.rand(B, generator=g, dtype=torch.float64).to(dtype),
             gmask=torch.tensor([[1, 1, 0], [1, 1, 1]]).bool(),
             desirable=torch.tensor([True, False] * (B // 2)), ids=torch.randint(0, 11, (B,), generator=g),
             ids2=torch.randint(0, 11, (B,), generator=g))
    return x


def _whiten(x):
    n, total = train_ppo.masked_sums(x["ta"], x["mask"])
    mean = total / n
    return train_ppo.masked_whiten(x["ta"], x["mask"], n, mean, train_ppo.masked_sq_dev(x["ta"], x["mask"], mean))


LOSSES = {
    "train_ppo.token_rewards": lambda x: train_ppo.token_rewards(x["a"], x["ta"], x["mask"], 0.1),
    "train_ppo.gae": lambda x: train_ppo.gae(x["ta"], x["tb"], x["mask"], 0.99, 0.95),
    "train_ppo.rloo_advantages": lambda x: train_ppo.rloo_advantages(x["a"], 3),
    "train_ppo.grpo_advantages": lambda x: train_ppo.grpo_advantages(x["a"], 3),
    "train_ppo.dr_grpo_advantages": lambda x: train_ppo.dr_grpo_advantages(x["a"], 3),
    "train_ppo.masked_whiten": _whiten,
    "train_ppo.kl_estimate k3": lambda x: train_ppo.kl_estimate(x["ta"], x["tb"], "k3"),
    "train_ppo.policy_loss": lambda x: train_ppo.policy_loss(x["ta"], x["tb"], x["tc"]),
    "train_ppo.value_loss": lambda x: train_ppo.value_loss(x["ta"], x["tb"], x["tc"])[0],
    "train_ppo.dual_clip_loss": lambda x: train_ppo.dual_clip_loss(x["ta"], x["tc"]),
    "train_ppo.gspo_loss": lambda x: train_ppo.gspo_loss(x["ta"], x["ta"] + 1e-4 * x["tb"], x["a"][:, None], x["mask"]),
    "train_ppo.cispo_loss": lambda x: train_ppo.cispo_loss(x["ta"], x["tb"], x["tc"]),
    "train_ppo.aggregate_loss": lambda x: train_ppo.aggregate_loss(x["ta"], x["mask"], "token_mean", 20, B, R),
    "train_ppo.rollout_correction": lambda x: train_ppo.rollout_correction(x["ta"], x["ta"] + 0.1 * x["tb"],
                                                                          x["mask"], "tis")[0],
    "train_ppo_lagrangian.lagrangian_advantage": lambda x: train_ppo_lagrangian.lagrangian_advantage(x["ta"], x["tb"],
                                                                                                    2.0),
    "train_dpo.dpo_loss": lambda x: train_dpo.dpo_loss(x["a"], 0.1, 0.1),
    "train_dpo.robust_loss": lambda x: train_dpo.robust_loss(x["a"], 0.1, 0.1),
    "train_dpo.ipo_loss": lambda x: train_dpo.ipo_loss(x["a"], x["b"], x["lens"], x["lens"] + 1, 0.1, 0.1),
    "train_dpo.hinge_loss": lambda x: train_dpo.hinge_loss(x["a"], 0.1),
    "train_dpo.rdpo_loss": lambda x: train_dpo.rdpo_loss(x["a"], x["lens"], x["lens"] + 1, 0.1, 0.01),
    "train_dpo.simpo_loss": lambda x: train_dpo.simpo_loss(x["a"], x["b"], x["lens"], x["lens"] + 1, 2.0, 0.5),
    "train_dpo.cpo_loss": lambda x: train_dpo.cpo_loss(x["a"], x["b"], 0.1),
    "train_dpo.orpo_loss": lambda x: train_dpo.orpo_loss(-x["a"].abs() - 1, -x["b"].abs() - 1, x["lens"],
                                                         x["lens"] + 1, 0.1),
    "train_dpo.tdpo_loss": lambda x: train_dpo.tdpo_loss(x["a"], x["b"].abs(), x["c"].abs(), 0.1, 0.5),
    "train_online.sppo_loss": lambda x: train_online.sppo_loss(x["a"], x["b"], x["prob"], 2.0),
    "train_online.nash_md_loss": lambda x: train_online.nash_md_loss(x["ta"], x["tb"], x["mask"], x["prob"], 0.1),
    "train_online.cringe_loss": lambda x: train_online.cringe_loss(x["logits"], x["ids"], x["ids2"]),
    "train_listwise.rrhf_rank_loss": lambda x: train_listwise.rrhf_rank_loss(x["grid"], x["grid2"], x["gmask"]),
    "train_listwise.pro_loss": lambda x: train_listwise.pro_loss(x["grid"], x["grid2"], x["gmask"]),
    "train_listwise.lipo_lambda_loss": lambda x: train_listwise.lipo_lambda_loss(x["grid"], x["grid2"], x["gmask"]),
    "train_unpaired.kto_loss": lambda x: train_unpaired.kto_loss(x["a"], x["desirable"], x["b"].abs().mean(), 0.1),
    "train_unpaired.npo_loss": lambda x: train_unpaired.npo_loss(x["a"], 0.1),
    "train_unpaired.d2o_loss": lambda x: train_unpaired.d2o_loss(x["uk"], x["a"], 0.1, 0.1),
    "train_unpaired.dro_loss": lambda x: train_unpaired.dro_loss(x["a"], x["b"], x["c"], 0.1),
    "train_rm.reward_loss": lambda x: train_rm.reward_loss(x["a"], x["b"], 0.5, 0.01, 0.01),
}


def _tensors(out):
    outs = out if isinstance(out, (tuple, list)) else [out]
    return [t for t in outs if torch.is_tensor(t) and t.is_floating_point()]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_and_advantage_keeps_float64_and_equals_float32(name):
    a, b = LOSSES[name](_inputs(torch.float32)), LOSSES[name](_inputs(torch.float64))
    for x, y in zip(_tensors(a), _tensors(b), strict=True):
        assert x.dtype == torch.float32 and y.dtype == torch.float64, (name, x.dtype, y.dtype)
        assert torch.allclose(x.double(), y, rtol=1e-5, atol=1e-5), (name, (x.double() - y).abs().max())
