"""The log-prob operator (nano_rlhf/model.py: token_logprobs and _TokenLogprobs) against float64 log-softmax
written here from its definition: values and gradients at odd vocabularies, with the output layer padded or not,
masked positions, temperature, entropy; the padded columns never reaching a softmax; one cast of the weight;
the weight's gradient summed in float32; the budget option in a run, under FSDP2 and LoRA."""
import pytest
import torch
from safetensors.torch import load_file

from conftest import run, sft_rows, weights_close, write_jsonl
from nano_rlhf import model as model_mod
from nano_rlhf.model import _TokenLogprobs, chunk_rows, padded_rows, token_logprobs


def reference(h, w, t, temperature):
    """float64 log p(t) and entropy of softmax(h W^T / τ), straight from the definitions."""
    z = h.double() @ w.double().T / temperature
    logp = z - z.exp().sum(-1, keepdim=True).log()
    return logp[torch.arange(len(t)), t], -(logp.exp() * logp).sum(-1)


def ops_seen(fn):
    """[(op name, input shapes)] of every aten op fn runs (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func.__name__, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))
    with Record():
        fn()
    return seen


@pytest.mark.parametrize("V", [7, 81, 1001])
@pytest.mark.parametrize("pad_to", [1, 128])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_operator_equals_float64_log_softmax(V, pad_to, temperature):
    """Chunks of 4 of 23 positions, every third position's gradient 0 (a masked loss): values to 1e-12 and
    gradients of hidden and weight to 1e-12 (float64 rounding over at most 1,001 terms), with entropy and
    without."""
    g = torch.Generator().manual_seed(V)
    N, C = 23, 5
    h = torch.randn(N, C, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(V, C, dtype=torch.float64, generator=g).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, dtype=torch.float64, generator=g), torch.randn(N, dtype=torch.float64, generator=g)
    g_lp[::3] = 0
    for with_entropy in (False, True):
        ref_lp, ref_ent = reference(h, w, t, temperature)
        out = token_logprobs(h, w, t, temperature, chunk_size=4, with_entropy=with_entropy, pad_to=pad_to)
        lp, ent = out if with_entropy else (out, None)
        assert lp.dtype == torch.float64 and lp.shape == (N,)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
        ref = (ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if with_entropy else 0)
        if with_entropy:
            torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
        for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_operator_gradcheck():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(11, 5, dtype=torch.float64, generator=g).requires_grad_()
    t = torch.randint(0, 11, (7,), generator=g)
    for with_entropy in (False, True):
        assert torch.autograd.gradcheck(lambda h, w: _TokenLogprobs.apply(h, w, t, 0.7, with_entropy, 3, 8), (h, w))


def test_padded_columns_never_reach_a_softmax():
    """V = 81 padded to 128: every op that exponentiates or reduces over the vocabulary (logsumexp, exp, log-
    softmax) sees exactly 81 columns, never 128; the product itself runs at 128 (the padding is real)."""
    h, w = torch.randn(20, 8, requires_grad=True), torch.randn(81, 8, requires_grad=True)
    t = torch.randint(0, 81, (20,))

    def fn():
        lp, ent = token_logprobs(h, w, t, 0.7, chunk_size=6, with_entropy=True, pad_to=128)
        (lp.sum() + ent.sum()).backward()
    seen = ops_seen(fn)
    widths = {s[-1] for name, shapes in seen if name.split(".")[0] in ("logsumexp", "exp", "_log_softmax")
              for s in shapes if len(s) == 2}
    assert widths == {81}, widths
    assert any(name.split(".")[0] in ("addmm", "mm") and (128, 8) in shapes for name, shapes in seen)
    assert padded_rows(w, torch.float32, 128).shape == (128, 8)
    assert torch.equal(padded_rows(w, torch.float32, 128)[81:], torch.zeros(47, 8))


def test_weight_cast_once_and_gradient_summed_in_float32():
    """Under bfloat16 autocast, 64 positions in 8 chunks: the (V, C) weight is cast to bfloat16 once for the
    forward and the backward together (not once per chunk), and its gradient reaches float32 through one float32
    buffer. Against float64 on the bf16-rounded inputs, each gradient element is a sum of 64 products whose
    factors were rounded to bf16 (relative 2^-8 each) and each chunk's partial sum too: within 3·2^-8 of
    Σ|∂L/∂z|·|h| (plus the output's float32 rounding)."""
    g = torch.Generator().manual_seed(0)
    V, C, N = 300, 16, 64
    h = torch.randn(N, C, generator=g).bfloat16().float().requires_grad_()
    w = (0.3 * torch.randn(V, C, generator=g)).bfloat16().float().requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)

    def fn():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            token_logprobs(h, w, t, chunk_size=8).sum().backward()
    seen = ops_seen(fn)
    casts = [shapes for name, shapes in seen if name.split(".")[0] == "_to_copy" and (V, C) in shapes]
    assert len(casts) == 1, casts
    assert w.grad.dtype == torch.float32
    hd, wd = h.detach().double().requires_grad_(), w.detach().double()
    z = (hd @ wd.T).requires_grad_()
    lp = z.log_softmax(-1)[torch.arange(N), t]
    dz, = torch.autograd.grad(lp.sum(), z)
    exact = dz.T @ hd
    bound = 3 * 2 ** -8 * (dz.abs().T @ hd.abs()) + 1e-6
    assert ((w.grad.double() - exact).abs() <= bound).all()


def test_budget_sizes_the_chunk_and_the_plain_path_stays(monkeypatch):
    """128 MiB on a CPU (a 49,152 vocabulary: 682 positions a chunk); an explicit budget in bytes; when every
    position fits one chunk and no padding is asked for, the operator is not used (the plain computation, so
    the built-in tasks' figures keep their bytes)."""
    cpu = torch.device("cpu")
    assert chunk_rows(49152, cpu) == (128 << 20) // (4 * 49152) == 682
    model_mod.set_logits_budget(4 * 10 * 300)
    try:
        assert chunk_rows(300, cpu) == 10
    finally:
        model_mod.set_logits_budget(0)
    assert model_mod.LOGITS_BUDGET is None
    used = []
    monkeypatch.setattr(_TokenLogprobs, "apply", lambda *a: used.append(1))
    token_logprobs(torch.randn(10, 4), torch.randn(30, 4), torch.zeros(10, dtype=torch.long))
    assert used == []
    token_logprobs(torch.randn(10, 4), torch.randn(30, 4), torch.zeros(10, dtype=torch.long), chunk_size=3)
    assert used == [1]


def _metrics(path):
    import json
    return [json.loads(line) for line in open(path / "metrics.jsonl") if '"train/loss"' in line]


@pytest.mark.slow
def test_logits_budget_option_under_fsdp_and_lora(tmp_path):
    """--logits_budget 0.005 (5 KiB: 4 positions a chunk at vocabulary 300) changes nothing but rounding: an SFT
    run in one process, on 2 FSDP2 gloo ranks, and LoRA on 1 and 2 ranks each equal their one-chunk run (losses
    and gradient norms to float32 rounding over the chunks' summation order, the final weights alike)."""
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(48))

    def args(out, *extra):
        return ["train_sft.py", "--data", str(tmp_path / "sft.jsonl"), "--out_dir", str(tmp_path / out),
                "--max_steps", "3", "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--vocab_size", "300",
                "--log_interval", "1", "--warmup_steps", "1", "--batch_size", "4", *extra]
    run(args("base"))
    tk = ["--tokenizer", str(tmp_path / "base" / "tokenizer.json")]
    small = ["--logits_budget", "0.005", *tk]
    lora = ["--init", str(tmp_path / "base"), "--lora_r", "4", "--lr", "1e-2", *tk]
    runs = {"one": args("one", *tk), "one_small": args("one_small", *small),
            "fsdp_small": args("fsdp_small", "--batch_size", "2", "--fsdp", *small),
            "lora": args("lora", *lora), "lora_small": args("lora_small", *lora, "--logits_budget", "0.005"),
            "lora2_small": args("lora2_small", *lora, "--batch_size", "2", "--logits_budget", "0.005")}
    for name, a in runs.items():
        run(a, nproc=2 if name in ("fsdp_small", "lora2_small") else 1)
    for a, b in (("one", "one_small"), ("one", "fsdp_small"), ("lora", "lora_small"), ("lora", "lora2_small")):
        ma, mb = _metrics(tmp_path / a), _metrics(tmp_path / b)
        assert len(ma) == len(mb) == 3
        for key in ("train/loss", "train/grad_norm"):
            assert [m[key] for m in ma] == pytest.approx([m[key] for m in mb], rel=1e-4, abs=1e-6), (a, b, key)
        assert weights_close(load_file(tmp_path / a / "model.safetensors"), load_file(tmp_path / b / "model.safetensors"))
