"""Sharded checkpoints without pickle: per-rank safetensors files and a JSON index (parallel.py shards the
models; checkpoint.py decides what a run's state holds).

Each rank writes its own shards (`<name>.rank<r>.safetensors`) and rank 0 a JSON index (global
shapes, how many ranks); nothing is pickled. A state saved by N ranks (or by one process, unsharded) loads on
M ranks: each rank reads, from whichever files hold them, only the rows of its own shard (FSDP2 shards dim 0
in torch.chunk's pieces: ceil(n / world) rows per rank, the last ranks fewer or none).
"""
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import dist
from .files import StateError, _read_json, write_json

try:        # absent on builds without torch.distributed
    from torch.distributed.tensor import DTensor
except ImportError:          # pragma: no cover
    DTensor = None


def shard_rows(n, world_size, rank):
    """Rows [start, stop) of dim 0 that `rank` holds under FSDP2's torch.chunk sharding."""
    c = -(-n // world_size) if n else 0
    return min(n, rank * c), min(n, (rank + 1) * c)


def _local(t):
    """(local tensor, global shape) of a DTensor shard, checked against shard_rows."""
    loc, shape = t.to_local(), tuple(t.shape)
    w = dist.world()
    a, b = shard_rows(shape[0], w.world_size, w.rank)
    if tuple(loc.shape) != (b - a, *shape[1:]):
        raise RuntimeError(f"unexpected FSDP shard {tuple(loc.shape)} of {shape} on rank {w.rank}")
    return loc


def save_sharded(directory, stem, tensors, extra=None):
    """Write {key: tensor or DTensor}: each rank `stem.rank<r>.safetensors` with its rows of every sharded
    tensor; rank 0 also the whole tensors that are not sharded, and `stem.json`: {"world_size", "tensors":
    {key: {"shape", "sharded"}}, **extra}. Collective; no pickle."""
    w = dist.world()
    mine, index = {}, {}
    for k, t in tensors.items():
        sharded = DTensor is not None and isinstance(t, DTensor)
        index[k] = {"shape": list(t.shape), "sharded": sharded}
        if sharded:
            mine[k] = _local(t).detach().to("cpu").contiguous()
        elif w.is_main:
            mine[k] = t.detach().to("cpu").contiguous()
    save_file(mine, os.path.join(directory, f"{stem}.rank{w.rank}.safetensors"))
    if w.is_main:
        write_json(os.path.join(directory, f"{stem}.json"),
                   {"world_size": w.world_size, "tensors": index, **(extra or {})})


class TensorSource:
    """Reads rows of saved tensors from either layout: `stem.safetensors` (whole tensors, one file) or the
    sharded one (save_sharded). Only the requested rows are read from disk (safetensors slices)."""

    def __init__(self, directory, stem):
        self.dir, self.stem, self.files = directory, stem, {}
        whole = os.path.join(directory, f"{stem}.safetensors")
        index_path = os.path.join(directory, f"{stem}.json")
        self.sharded = not os.path.isfile(whole) and os.path.isfile(index_path)
        if self.sharded:
            meta = _read_json(index_path)
            try:
                self.world = int(meta["world_size"])
                self.index = {k: (tuple(v["shape"]), bool(v["sharded"])) for k, v in meta["tensors"].items()}
            except (KeyError, TypeError, ValueError) as e:
                raise StateError(f"{index_path}: malformed ({type(e).__name__}: {e}); the saved state is damaged") \
                    from None
            self.meta = meta
        else:
            self.index = {k: (tuple(s), False) for k, s in self._open(whole).items()}
            self.meta = None

    def _open(self, path):
        """{key: shape} of a safetensors file, opened lazily (kept open)."""
        if path not in self.files:
            if not os.path.isfile(path):
                raise StateError(f"{path}: missing; the saved state is incomplete")
            try:
                f = safe_open(path, framework="pt")
                self.files[path] = (f, {k: f.get_slice(k).get_shape() for k in f.keys()})
            except Exception as e:
                raise StateError(f"{path}: unreadable or corrupt ({type(e).__name__}: {e}); the saved state is "
                                 "damaged") from None
        return self.files[path][1]

    def _slice(self, path, key, a, b):
        shapes = self._open(path)
        if key not in shapes:
            raise StateError(f"{path}: has no tensor {key!r}; the saved state is damaged")
        f = self.files[path][0]
        return f.get_tensor(key) if a is None else f.get_slice(key)[a:b]

    def keys(self):
        return list(self.index)

    def shape(self, key):
        return self.index[key][0]

    def read(self, key, a=None, b=None):
        """Rows [a, b) of dim 0 of the saved tensor `key` (all of it when a is None)."""
        shape, sharded = self.index[key]
        if not self.sharded:
            return self._slice(os.path.join(self.dir, f"{self.stem}.safetensors"), key, a, b)
        if not sharded:
            return self._slice(os.path.join(self.dir, f"{self.stem}.rank0.safetensors"), key, a, b)
        a, b = (0, shape[0]) if a is None else (a, b)
        parts = []
        for r in range(self.world):
            ra, rb = shard_rows(shape[0], self.world, r)
            lo, hi = max(a, ra), min(b, rb)
            if lo < hi:
                parts.append(self._slice(os.path.join(self.dir, f"{self.stem}.rank{r}.safetensors"), key,
                                         lo - ra, hi - ra))
        if not parts:
            return torch.empty((0, *shape[1:]))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def read_like(source, key, target):
    """The saved `key` laid out as `target`: this rank's rows when target is a shard, else all of it."""
    if key not in source.index:
        raise StateError(f"{source.dir}/{source.stem}: has no tensor {key!r}")
    if tuple(source.shape(key)) != tuple(target.shape):
        raise StateError(f"{source.dir}/{source.stem}: {key} has shape {list(source.shape(key))}, the model "
                         f"{list(target.shape)}")
    if DTensor is not None and isinstance(target, DTensor):
        w = dist.world()
        a, b = shard_rows(target.shape[0], w.world_size, w.rank)
        return source.read(key, a, b)
    return source.read(key)


@torch.no_grad()
def load_model(source, model):
    """Copy the saved tensors into the model (its shards or whole parameters); every key must match."""
    target = dist.unwrap(model).state_dict()
    missing, unexpected = sorted(set(target) - set(source.index)), sorted(set(source.index) - set(target))
    if missing or unexpected:
        raise StateError(f"{source.dir}/{source.stem}: does not fit the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    for k, t in target.items():
        value = read_like(source, k, t)
        dest = t.to_local() if DTensor is not None and isinstance(t, DTensor) else t
        dest.copy_(value.to(dest.dtype))


def optimizer_tensors(opt):
    """(tensors {pid.key: tensor or DTensor}, json meta) of an optimizer's state."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            (tensors if torch.is_tensor(v) else scalars)[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optim_from_flat(opt, tensors, meta):
    """Restore an optimizer from its flat tensors ("<param index>.<name>") and JSON meta (scalars, groups):
    checkpoint.load_state's unsharded path, and load_optimizer after reading a sharded state's tensors."""
    state = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    opt.load_state_dict({"state": state, "param_groups": groups})


def load_optimizer(source, opt, meta):
    """Restore an optimizer from a TensorSource of its tensors and its JSON meta, each state tensor laid out
    as its parameter (this rank's shard under FSDP)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    tensors = {}
    for key in source.keys():
        p = params[int(key.split(".", 1)[0])]
        if tuple(source.shape(key)) == tuple(p.shape) and len(p.shape):
            value = read_like(source, key, p)
            if DTensor is not None and isinstance(p, DTensor):
                value = DTensor.from_local(value.to(p.to_local().device), p.device_mesh, p.placements,
                                           shape=p.shape, stride=p.stride())
        else:
            value = source.read(key)
        tensors[key] = value
    _optim_from_flat(opt, tensors, meta)
