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


TIMEOUT_SCRIPT = """import sys, time
from nano_rlhf import dist
world = dist.setup("cpu", timeout_minutes=3 / 60)       # 3 seconds
assert dist.world() is world
if world.rank == 1:
    time.sleep(7)                                       # a hung rank: joins nothing for 7 s
    sys.exit(0)
t0 = time.time()
try:
    dist.all_reduce_sum(1.0)
except Exception as e:
    print(f"collective failed after {time.time() - t0:.1f}s: {type(e).__name__}", flush=True)
    print(str(e).splitlines()[0], file=sys.stderr, flush=True)
    sys.exit(3)
print("unreachable", flush=True)
"""


def test_dist_timeout_reaches_the_process_group(tmp_path):
    """A rank that never joins makes the others' collective fail after --dist_timeout, not hang."""
    (tmp_path / "hang.py").write_text(TIMEOUT_SCRIPT)
    p = run([str(tmp_path / "hang.py")], nproc=2, check=False, timeout=120)
    assert p.returncode != 0 and "unreachable" not in p.stdout
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("collective failed")]
    assert line, p.stdout + p.stderr
    # the 3 s timeout, not the default 10 min (then it would fail only when rank 1 exits, at 7 s)
    assert 2.5 <= float(line[0].split("after ")[1].split("s")[0]) < 6


def test_ddp_scale_is_the_world_size():
    from nano_rlhf import dist
    assert dist.setup("cpu") is dist.world() and dist.ddp_scale() == dist.world().world_size == 1


CLEANUP_SCRIPT = """import torch
from nano_rlhf import dist
ctx = dist.setup("cpu")
m = dist.wrap_ddp(torch.nn.Linear(4, 4))
m(torch.randn(2, 4)).sum().backward()
assert "reducer" in m.__dict__
dist.cleanup()
held = [name for name in ("logger", "reducer", "process_group") if name in m.__dict__]
import sys
sys.stdout.write(f"rank {ctx.rank} still held: {held}\\n")     # one write: the ranks share stdout
"""


def test_cleanup_makes_ddp_wrappers_let_go_of_the_group(tmp_path):
    """After cleanup no DDP wrapper still holds the process group (through its reducer or logger), so the group's
    C++ teardown happens inside cleanup on every rank, not later when Python frees a wrapper (docs/safety.md)."""
    (tmp_path / "cleanup.py").write_text(CLEANUP_SCRIPT)
    p = run([str(tmp_path / "cleanup.py")], nproc=2)
    assert p.stdout.count("still held: []") == 2, p.stdout + p.stderr
