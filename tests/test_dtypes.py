"""Log-prob gathers keep the model's precision: a float64 model gives float64 log-probs equal to the float32 model's
to float32 rounding, and a bfloat16 model runs and gives float32 (the log-softmax is taken in float32). Every gather
of the package and the scripts, listed here:

  train_ppo.response_logprobs (and its entropies), nano_rlhf.evaluate.response_logprobs, train_dpo.token_logps,
  train_dpo.sequence_logps, train_online.seq_logps (through train_ppo's), nano_rlhf.model.token_logprobs.

Tolerance: the float32 path rounds each of ~30 layer outputs at 2^-24 relative; log-probs of a tiny random model
are O(5), so agreement to 1e-4 absolute leaves an order of magnitude over the accumulated rounding."""
import types

import pytest
import torch

import train_dpo
import train_online
import train_ppo
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
    samples = types.SimpleNamespace(ids=ids, attn=attn, response_mask=response)
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
