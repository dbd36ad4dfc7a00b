"""torch.distributed helpers: set-up under torchrun, DDP wrapping, all-reduce, rank-0 printing, seeding,
sharding, and the start-up check that every rank holds the same weights.

Run as usual (`python train_x.py`) for one process, or `torchrun --nproc_per_node N train_x.py` for N.
Backend: NCCL on CUDA, gloo on CPU (so DDP also runs, and is tested, on a laptop).
"""
import atexit
import datetime
import hashlib
import os
import random
import re
import sys
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

try:        # FSDP2's sharded tensors (torch >= 2.6); absent on builds without torch.distributed
    from torch.distributed.tensor import DTensor
except ImportError:
    DTensor = None

# Every DDP wrapper wrap_ddp made in this process (weakly held): cleanup() makes them let go of the group.
_DDP_WRAPPERS = weakref.WeakSet()
# Set by cleanup(sync=True): this multi-process run ended cleanly, so its process may skip the interpreter's
# finalization (_leave_without_finalizing).
_ENDED = False


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def enabled(self):
        return self.world_size > 1


_CTX = Dist()


def keep_freed_memory():
    """glibc returns freed blocks above 32 MB (mmap threshold) and the top of the heap (trim threshold) to the
    OS, so a training step's large tensors (logits, their gradient) are page-faulted and zeroed anew every
    step: ~25k page faults per step at the reference shape. Raising both thresholds keeps that memory in the
    process (measured: ~250 faults per step, a few percent faster on CPU). Linux/glibc only; no-op elsewhere."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, ctypes.c_int(1 << 30))   # M_TRIM_THRESHOLD
        libc.mallopt(-3, ctypes.c_int(1 << 30))   # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def device_problem(device: str):
    """Why --device cannot be used on this machine (None when it can)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {device}: no CUDA GPU is available here (use --device cpu or auto)"
    if device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", device):
        return f"--device must be cpu, cuda, cuda:N or auto (got {device!r})"
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def setup(device: str = "auto", timeout_minutes: float = 10.0) -> Dist:
    """Initialise the process group when launched by torchrun (WORLD_SIZE > 1); choose the device.
    Returns THE module-global context (also `dist.world()`).

    timeout_minutes bounds how long a rank waits for the others in a collective: if one rank dies or
    hangs, the others fail with an error naming the collective after this long instead of waiting forever
    (gloo always; NCCL with its async error handling, on by default in recent torch)."""
    global _CTX
    bad = device_problem(device)
    if bad:     # before any process group: every rank stops with the same line
        print(f"error: {bad}", file=sys.stderr, flush=True)
        sys.exit(2)
    keep_freed_memory()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
        atexit.register(_leave_without_finalizing)
        sys.excepthook = _peer_failed_hook(sys.excepthook)
    _CTX = Dist(rank, local, world, torch.device(device))
    return _CTX


def cleanup(sync=True):
    """Tear down the process group. The barrier first makes every rank arrive before any connection
    closes: a rank that exits early can make gloo abort the others at teardown. sync=False on an error
    path, where the other ranks may never arrive.

    destroy_process_group only unregisters the group: its C++ object (gloo's threads and sockets) lives on
    while anything holds it, and a DDP wrapper's reducer does. Left there, the group is torn down whenever
    Python frees the wrapper, possibly after a peer has exited, where a rank can wait out the whole collective
    timeout (docs/safety.md). So the wrappers made by wrap_ddp let go of the group first, and the barrier comes
    after that: every rank drops its last extra reference while all of them are still present.

    Groups held elsewhere (FSDP2's parameter groups) outlive this call, and with them gloo's worker threads;
    a clean end therefore leaves the process without the interpreter's finalization (_leave_without_finalizing)."""
    global _ENDED
    if dist.is_initialized():
        for wrapper in list(_DDP_WRAPPERS):
            for name in ("logger", "reducer", "process_group"):     # the logger holds the reducer, which holds
                wrapper.__dict__.pop(name, None)                     # the group
        _DDP_WRAPPERS.clear()
        if sync:
            dist.barrier()
        dist.destroy_process_group()
        _ENDED = sync


def end_process(code: int):
    """Flush stdout and stderr and end this process with `code` at once, without the interpreter's finalization
    (why: _leave_without_finalizing). For multi-process runs only: nothing after this call runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave_without_finalizing():
    """atexit hook of a multi-process run (registered by setup). A gloo group's worker threads live as long as
    the group, and a group FSDP2 holds lives until the interpreter frees everything. A worker that finishes a
    collective a moment after the main thread's wait returned still drops the work's tensors; under CPU load
    that can fall after the interpreter began finalizing, when the tensor's Python object can no longer take
    the GIL: the thread is unwound through a noexcept destructor and the process aborts ("terminate called
    without an active exception", exit -6) after it saved everything (seen in CI; gdb: ~AsyncBarrierWork ->
    ~AsyncAllgatherWork -> decref_pyobject -> PyThread_exit_thread). Once cleanup(sync=True) has run, every
    file is written and closed and every rank has passed the last barrier, so nothing is left for
    finalization to do: leave with 0, or with 1 after an uncaught exception (its traceback is already
    printed). Before a clean end (an error), this does nothing and the interpreter exits as usual."""
    if _ENDED:
        end_process(1 if hasattr(sys, "last_value") or hasattr(sys, "last_exc") else 0)


# ---- a rank that fails alone: one line on every rank, naming it ----------------------------------------------
# A rank that stops with an error (fail(), or an uncaught exception) leaves its line in the process group's store
# (torchrun's rendezvous store, held by the launcher, outlives the ranks). Its peers, blocked in a collective,
# then see the connection drop (gloo: "Connection reset by peer") and would print that stack; instead each says,
# in one line, which rank failed and why.
_FAILED = "nano_rlhf/failed/rank"
_LOST = ("gloo", "NCCL", "Connection reset", "Connection closed", "Broken pipe", "Timed out", "timed out")


_SEEN = "nano_rlhf/seen/rank"


def announce_failure(msg: str):
    """Leave this rank's error for the others; returns the store to wait_until_named with (None in a single
    process or once the group is gone)."""
    if not (dist.is_available() and dist.is_initialized()) or _CTX.world_size < 2:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_FAILED}{_CTX.rank}", msg[:2000])
        return store
    except Exception:        # the store is unreachable: the peers say that a rank is gone, without its words
        return None


def wait_until_named(store, seconds=3.0):
    """After announce_failure and the group's teardown (which breaks the peers' collectives): wait, at most
    `seconds`, until every other rank has named this one or failed itself, so that torchrun, which stops the
    other ranks once one exits, does not stop them before they said why."""
    if store is None:
        return
    deadline = time.time() + seconds
    others = [r for r in range(_CTX.world_size) if r != _CTX.rank]
    try:
        while others and time.time() < deadline:
            others = [r for r in others if not store.check([f"{_FAILED}{r}"]) and not store.check([f"{_SEEN}{r}"])]
            time.sleep(0.05)
    except Exception:
        pass


def _failed_peer():
    """(rank, its error) of the first other rank that announced one, else None."""
    try:
        store = dist.distributed_c10d._get_default_store()
        for r in range(_CTX.world_size):
            if r != _CTX.rank and store.check([f"{_FAILED}{r}"]):
                return r, store.get(f"{_FAILED}{r}").decode("utf-8", "replace")
    except Exception:
        pass
    return None


def _lost_peer(value) -> bool:
    """Is this exception a collective that broke because a peer is gone or never answered?"""
    return (isinstance(value, getattr(dist, "DistError", ())) or isinstance(value, RuntimeError)
            and any(s in str(value) for s in _LOST))


def _peer_failed_hook(previous):
    """sys.excepthook of a multi-process run: an exception raised because another rank failed is one line naming
    that rank and its error (or, when it left none, that a peer is gone); any other exception is this rank's
    own, announced to the others and shown with its stack (a bug). Ctrl-C keeps its own hook."""
    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt) or not dist.is_initialized():
            return previous(kind, value, tb)
        peer = _failed_peer()
        if peer is None and not _lost_peer(value):
            announce_failure(f"{kind.__name__}: {(str(value).splitlines() or [''])[0][:300]}")
            return previous(kind, value, tb)
        if peer is not None:
            line = f"rank {peer[0]} failed: {peer[1].removeprefix('error: ')}; rank {_CTX.rank} stopped with it"
        else:
            first = re.sub(r"^\[[^\]]*\]\s*", "", (str(value).splitlines() or [""])[0]).split(". ")[0][:200]
            line = (f"rank {_CTX.rank} stopped: a collective failed because another rank is gone or did not answer "
                    f"within --dist_timeout ({first}); see that rank's output")
        print(f"error: {line}", file=sys.stderr, flush=True)
        try:
            dist.distributed_c10d._get_default_store().set(f"{_SEEN}{_CTX.rank}", "1")   # the failed rank may go
        except Exception:
            pass
        atexit._run_exitfuncs()        # the run's clean-up (its lock, what a run that saved nothing created)
        end_process(1)                 # then no finalization: a broken gloo group can abort it
    return hook


def world() -> Dist:
    """The distributed context set by setup() (rank, local_rank, world_size, device, is_main, enabled)."""
    return _CTX


def ddp_scale() -> int:
    """DDP averages gradients over ranks; a loss written as (this rank's sum) / (global count) must be
    multiplied by this (= world_size) before backward so the averaged gradient is that of the global
    sum / global count."""
    return _CTX.world_size


def broadcast_object(obj):
    """Rank 0's `obj` on every rank (a no-op in a single process). Collective."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_problem(msg):
    """Every rank passes its problem (a message) or None; every rank gets the lowest failing rank's message, or
    None when no rank has one. Collective: a check that only some ranks fail ends on every rank at once."""
    if not dist.is_initialized():
        return msg
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, msg)
    return next((m for m in box if m), None)


def print0(*args, **kwargs):
    if _CTX.rank == 0:
        print(*args, **kwargs, flush=True)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def _reduce(x, op):
    is_tensor = torch.is_tensor(x)
    t = x.detach().clone() if is_tensor else torch.tensor(float(x), dtype=torch.float64)
    if dist.is_initialized():
        backend_ok = t.to(_CTX.device) if _CTX.device.type == "cuda" else t
        dist.all_reduce(backend_ok, op=op)
        t = backend_ok.to(t.device)
    return t if is_tensor else t.item()


def all_reduce_sum(x):
    """Sum over ranks of a tensor or a number (same type back)."""
    return _reduce(x, dist.ReduceOp.SUM)


def all_reduce_sums(named):
    """{name: this rank's sum, a number or a 0-dim tensor} -> {name: the sum over ranks, a float}, in one
    all-reduce (float64) and one read from the device."""
    return dict(zip(named, all_reduce_sum(stacked(named.values())).tolist()))


def stacked(values):
    """Numbers and 0-dim tensors -> one float64 tensor on the device of the tensors that are not on the host (the
    host's if none). What the host holds is copied there without blocking: a copy from pageable memory is staged
    at once and waits for nothing on the device."""
    values = list(values)
    devices = [v.device for v in values if torch.is_tensor(v)]
    device = next((d for d in devices if d.type != "cpu"), devices[0] if devices else torch.device("cpu"))
    return torch.stack([torch.as_tensor(v if torch.is_tensor(v) else float(v), dtype=torch.float64)
                        .to(device, non_blocking=True) for v in values])


def all_reduce_max(x):
    return _reduce(x, dist.ReduceOp.MAX)


def all_reduce_mean(x):
    s = all_reduce_sum(x)
    return s / _CTX.world_size


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch with seed + rank-dependent offset; returns the seed used.
    Ranks must differ (they sample different responses) but data order uses the shared seed."""
    s = seed + 100003 * rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return s


def rank_share(items, rank=None, world_size=None):
    """This rank's share of a sequence: items[rank::world_size]."""
    rank = _CTX.rank if rank is None else rank
    world_size = _CTX.world_size if world_size is None else world_size
    return items[rank::world_size]


def wrap_ddp(model):
    """DDP for a trainable model when distributed (a plain model otherwise)."""
    if not _CTX.enabled:
        return model
    # device_ids=None: DDP moves no inputs. The scripts copy theirs to the device without blocking, and a mask
    # kept on the host stays there for the model's padding check (a copy by DDP would make that check a read)
    wrapper = DDP(model, device_ids=None)
    _DDP_WRAPPERS.add(wrapper)
    return wrapper


def unwrap(model):
    """The bare module under DDP / torch.compile wrappers (what gets saved: no `module.`/`_orig_mod.`)."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def full_tensor(t):
    """The whole tensor of a shard (all-gather; collective) or the tensor itself."""
    return t.full_tensor() if DTensor is not None and isinstance(t, DTensor) else t


def checksum_tensor(t):
    """A tensor's full content on CPU (gathered when sharded), for weights_checksum (FSDP shards are gathered:
    the checksum is of the full weights)."""
    return full_tensor(t).detach().to("cpu").contiguous()


def weights_checksum(model) -> int:
    """A 63-bit hash of every parameter and buffer, bit-exact (of the gathered full tensors under FSDP:
    collective then)."""
    h = hashlib.sha256()
    for name, t in unwrap(model).state_dict().items():
        h.update(name.encode())
        h.update(checksum_tensor(t).view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def check_same_weights(model, what="model"):
    """Raise if any rank holds different weights than rank 0 (start-up check: every rank must start
    from identical weights or DDP would average gradients of different models)."""
    if not _CTX.enabled:
        return
    mine = torch.tensor([weights_checksum(model)], dtype=torch.int64)
    if _CTX.device.type == "cuda":
        mine = mine.to(_CTX.device)
    gathered = [torch.zeros_like(mine) for _ in range(_CTX.world_size)]
    dist.all_gather(gathered, mine)
    values = [int(g.item()) for g in gathered]
    if len(set(values)) != 1:
        bad = [r for r, v in enumerate(values) if v != values[0]]
        raise RuntimeError(f"{what}: weights differ across ranks (ranks {bad} differ from rank 0); "
                           "every rank must load the same checkpoint and use the same seed for model init")
