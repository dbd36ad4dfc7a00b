"""The start-up weight check: ranks that hold different weights stop with a clear error, not a silent
average of gradients of two different models."""
from conftest import run

SCRIPT = """import torch
from nano_rlhf import dist
from nano_rlhf.model import GPT, GPTConfig
ctx = dist.setup("cpu")
torch.manual_seed(0)
m = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
dist.check_same_weights(m, "policy")                  # identical: passes
if ctx.rank == 1:
    with torch.no_grad():
        m.transformer.wte.weight[3, 5] += 1e-6        # one element, one rank
print("rank", ctx.rank, "first check passed", flush=True)
dist.check_same_weights(m, "policy")
print("unreachable", flush=True)
"""


def test_ranks_with_different_weights_stop_with_a_clear_error(tmp_path):
    (tmp_path / "check.py").write_text(SCRIPT)
    p = run([str(tmp_path / "check.py")], nproc=2, check=False)
    assert p.returncode != 0
    assert "first check passed" in p.stdout and "unreachable" not in p.stdout
    assert "policy: weights differ across ranks (ranks [1] differ from rank 0)" in p.stderr
