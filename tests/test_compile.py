"""--compile takes the whole forward with its output layer: one graph, no graph break, equal to eager on a CPU; the
SDPA kernel choice (model.SDPA_BACKENDS) is traced into that graph rather than breaking it."""
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from nano_rlhf import model as M
from nano_rlhf.model import GPT
from nano_rlhf.sampling import compile_problem

needs_inductor = pytest.mark.skipif(compile_problem(torch.device("cpu")) is not None,
                                    reason="torch.compile cannot run here")


def _nll_and_grads(model, bare, ids, loss_mask):
    import train_sft
    bare.zero_grad()
    nll, _ = train_sft.sft_nll(model, ids, None, loss_mask)
    nll.backward()
    return nll.detach(), [p.grad.clone() for p in bare.parameters()]


@pytest.mark.slow
@needs_inductor
@pytest.mark.parametrize("chunked", [False, True])
def test_compiled_sft_step_is_one_graph_and_equals_eager(chunked):
    """SFT's NLL through torch.compile(model), as --compile runs it: the trunk, the position selection and the
    log-prob operator (its plain path, and the many-chunk autograd.Function) in one graph with no break. The loss
    and every gradient equal eager's within float32 rounding: inductor fuses and reorders the sums (each a few
    ulp of values of order one), so 1e-5 absolute is ~100 ulp of slack, while a wrong position or a dropped
    chunk moves the loss by O(1)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(tiny_config())
    V = model.cfg.vocab_size
    ids = torch.randint(1, V, (3, 12))
    loss_mask = torch.ones(3, 12, dtype=torch.long)
    loss_mask[:, :3] = 0
    before = M.LOGITS_BUDGET
    if chunked:
        M.set_logits_budget(3 * V * 4)                # 3 positions a chunk: 27 positions in 9 chunks
    try:
        eager = _nll_and_grads(model, model, ids, loss_mask)
        compiled = _nll_and_grads(torch.compile(model), model, ids, loss_mask)
    finally:
        M.set_logits_budget(before or 0)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert abs(float(eager[0] - compiled[0])) <= 1e-5 * max(1.0, abs(float(eager[0])))
    for a, b in zip(eager[1], compiled[1]):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), (a - b).abs().max()
    torch._dynamo.reset()


@needs_inductor
def test_the_sdpa_choice_traces_into_a_graph():
    """What attend does on CUDA (sdpa_kernel with the call site's order) compiles with fullgraph=True: the
    choice never splits a compiled forward. Every order ends with the math kernel, which takes any input."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    assert all(order is None or order[-1] == SDPBackend.MATH for order in M.SDPA_BACKENDS.values())

    def causal(q):
        with sdpa_kernel(M.SDPA_BACKENDS["causal"], set_priority=True):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    q = torch.randn(2, 4, 8, 16)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(causal, fullgraph=True, backend="eager")(q), causal(q))
    torch._dynamo.reset()
