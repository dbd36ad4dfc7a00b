"""The start-up weight check: ranks that hold different weights stop with a clear error, not a silent
average of gradients of two different models."""
import os
import shutil
import sys

import pytest

from conftest import run, run_or_dump

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


END_SCRIPT = """import sys
import torch
from nano_rlhf import dist
from nano_rlhf.training import fail
ctx = dist.setup("cpu")
out = [torch.zeros(2) for _ in range(2)]
torch.distributed.all_gather(out, torch.ones(2))     # a collective whose tensors a gloo worker drops late
if sys.argv[1] == "fail":
    fail("this input is wrong", code=3)
dist.cleanup()
sys.stdout.write(f"rank {ctx.rank} after cleanup\\n")   # one write (the ranks share stdout), buffered: the hard
                                                      # exit must flush it
if sys.argv[1] == "raise":
    raise RuntimeError("after the end")
"""


@pytest.mark.parametrize("how,code", [("clean", 0), ("raise", 1), ("fail", 3)])
def test_a_multi_process_run_ends_with_its_own_exit_code_and_output(tmp_path, how, code):
    """A multi-process run leaves without the interpreter's finalization (dist._leave_without_finalizing: a gloo
    worker can abort it there): still with every printed line, with 0 after a clean end, 1 after an uncaught
    exception, and fail()'s code and one line after an error."""
    (tmp_path / "end.py").write_text(END_SCRIPT)
    p = run([str(tmp_path / "end.py"), how], nproc=2, check=False)
    assert p.returncode == (0 if code == 0 else 1), p.stdout + p.stderr       # torchrun: 1 when a rank failed
    if how == "fail":
        assert "error: this input is wrong" in p.stderr and "exitcode  : 3" in p.stderr
    else:
        assert sorted(ln for ln in p.stdout.splitlines() if "after cleanup" in ln) == \
            ["rank 0 after cleanup", "rank 1 after cleanup"]
    if how == "raise":
        assert "RuntimeError: after the end" in p.stderr and "exitcode  : 1" in p.stderr
    assert "terminate called" not in p.stderr


PEER_SCRIPT = """import os, sys
from nano_rlhf import dist
from nano_rlhf.training import fail
ctx = dist.setup("cpu")
dist.all_reduce_sum(1.0)
if ctx.rank == 1:
    if sys.argv[1] == "fail":            # what a user reward that raises becomes (reward.py)
        fail("--reward r.py:score raised ValueError: rank one is broken (at r.py:4 in score)")
    if sys.argv[1] == "raise":           # a bug: its stack on its own rank
        raise ValueError("a bug on rank one")
    os.kill(os.getpid(), 9)              # killed: no word left
dist.all_reduce_sum(1.0)                 # rank 0 waits here for a rank that is gone
print("unreachable", flush=True)
"""


@pytest.mark.parametrize("how", ["fail", "raise", "kill"])
def test_a_rank_that_fails_alone_is_named_by_the_others_in_one_line(tmp_path, how):
    """Rank 1 fails while rank 0 waits in a collective: rank 0 prints one line naming rank 1 and its error (left in
    torchrun's store), or that a rank is gone when it left none (killed), instead of gloo's "Connection reset by
    peer" stack; only a bug shows a stack, on its own rank. ("[rankN]:" marks what a rank's own excepthook
    printed; torchrun's launcher adds its own report after.)"""
    (tmp_path / "peer.py").write_text(PEER_SCRIPT)
    p = run([str(tmp_path / "peer.py"), how], nproc=2, check=False, timeout=120)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert p.returncode != 0 and "unreachable" not in p.stdout and "[rank0]" not in p.stderr, p.stderr
    if how == "kill":
        assert errors == [errors[0]] and errors[0].startswith("error: rank 0 stopped: a collective failed because "
                                                              "another rank is gone"), p.stderr
        return
    said = ("--reward r.py:score raised ValueError: rank one is broken (at r.py:4 in score)" if how == "fail"
            else "ValueError: a bug on rank one")
    assert f"error: rank 1 failed: {said}; rank 0 stopped with it" in errors, p.stderr
    assert ("[rank1]: Traceback" in p.stderr) == (how == "raise"), p.stderr


ABORTS_ONCE = """import os, sys
out, tries = sys.argv[2], sys.argv[3]
n = int(open(tries).read()) + 1 if os.path.exists(tries) else 1
open(tries, "w").write(str(n))
if os.path.exists(os.path.join(out, "saved")):
    sys.exit("error: --out_dir already holds a run")       # what a script says to a rerun into its own output
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "saved"), "w").write("x")
if n == 1:
    sys.stderr.write("terminate called without an active exception\\n")
    sys.exit(134)
"""


def test_a_teardown_abort_is_rerun_once_from_the_output_directory_as_it_was(tmp_path):
    """tests/conftest.py's rerun of a multi-process run that aborted in C++: the rerun finds --out_dir as the first
    attempt found it (here: absent), and the first failure is a warning, not hidden."""
    (tmp_path / "aborts.py").write_text(ABORTS_ONCE)
    cmd = [sys.executable, str(tmp_path / "aborts.py"), "--out_dir", str(tmp_path / "out"), str(tmp_path / "tries")]
    with pytest.warns(UserWarning, match="retried once after a teardown-shaped failure"):
        p = run_or_dump(cmd, str(tmp_path), dict(os.environ), 60, retry_teardown=True)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "tries").read_text() == "2" and (tmp_path / "out" / "saved").exists()
    (tmp_path / "tries").unlink()
    shutil.rmtree(tmp_path / "out")
    p = run_or_dump(cmd, str(tmp_path), dict(os.environ), 60)          # no rerun unless asked
    assert p.returncode == 134 and (tmp_path / "tries").read_text() == "1"
