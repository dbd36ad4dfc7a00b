"""How the suite compares numbers, so that every comparison holds on any CPU PyTorch supports (AVX2, AVX-512,
ARM, or ATEN_CPU_CAPABILITY=default's unvectorised kernels), by construction rather than by a fitted tolerance.

Two float32 computations of the same math in different orders (packed vs unpacked rows, a chunked vs a whole
log-softmax, a fused vs a plain kernel, another CPU's vector width) differ by rounding: a sum of n terms by up to
~n·u·Σ|terms| (u = 2^-24, Higham's γ_n), typically ~√n·u·Σ|terms|. That bound is relative to the *terms*, not
to the result: an entry of a gradient that is small because its terms cancel can lose every digit, so an
elementwise rtol on float32 gradients is fitted to one machine's summation order (issue: a DRO gradient entry
with relative error 0.0144 under the default kernels, 0.0026 on AVX-512, < 0.002 on AVX2).

So the rules:
- A formula, a gradient, or two layouts of one computation: run both sides in float64, models included
  (`model.double()`; the package upcasts to float32 only what is narrower, nano_rlhf.model.upcast).
  assert_close64 then allows 1e-9 relative (float64's u is 1.1e-16: a million-fold margin for sums of up to
  ~1e6 terms) plus 1e-12 of the tensor's largest entry (the cancellation case above, in float64).
- Where float32 itself is the point (parity with transformers in float32, a float32 training step), allow
  FLOAT32_ATOL on values of order one: the tiny models sum at most a few hundred terms per output
  (n_embd ≤ 64, T ≤ 64, 2-4 layers), so √n·u·|terms| stays ~1e-6 and 1e-5 is a ≥ 10× margin.
- Tokens of two kernel paths (cache vs no cache, compiled vs eager): compare in float64, where a near-tie between
  the top logits within rounding has probability ~1e-12 per step, or compare logits and the sampled
  distribution rather than argmaxes.
"""
import torch

FLOAT32_ATOL = 1e-5


def assert_close64(got, want, msg=None):
    """float64 results of the same math: 1e-9 relative, plus 1e-12 of want's largest entry (see above)."""
    assert got.dtype == torch.float64 and want.dtype == torch.float64, (got.dtype, want.dtype)
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * max(scale, 1e-300), msg=msg)


def greedy_margin(model, seq, prompt_mask, new_mask=None):
    """The smallest gap between the two largest logits at the positions that chose the greedy tokens
    seq[:, P:] (P = prompt length), from one ordinary forward over the whole sequence. Two kernel paths (cache
    or not, batched or alone, ours or transformers') choose the same greedy tokens for certain when this gap
    is far above their logits' rounding difference (FLOAT32_ATOL): assert the margin, then the equality."""
    P = prompt_mask.shape[1]
    if new_mask is None:
        new_mask = torch.ones_like(seq[:, P:])
    mask = torch.cat([prompt_mask, new_mask], 1)
    with torch.no_grad():
        logits = model(seq, mask)[:, P - 1:-1].double()                 # (B, N): position t chooses token t+1
    top2 = logits.topk(2, -1).values
    return float((top2[..., 0] - top2[..., 1])[new_mask.bool()].min())


# two paths' logits each lie within FLOAT32_ATOL of the exact ones, so a greedy choice can flip only where the
# top-2 gap is below 2·FLOAT32_ATOL; 10·FLOAT32_ATOL leaves a 5× margin
MARGIN = 10 * FLOAT32_ATOL
