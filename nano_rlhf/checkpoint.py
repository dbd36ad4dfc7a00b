"""Model directories and resumable training state: safetensors for tensors, JSON for everything else.
No pickle anywhere, so loading a checkpoint can never execute code.

out_dir/
  config.json, model.safetensors                   the model (HF-loadable), each file replaced atomically
  tokenizer.json, tokenizer_config.json             the tokenizer and the names of its special tokens
  train_config.json, metrics.jsonl                  options of the run, one JSON object per logged step
  state/                                            everything --resume needs:
    model_<name>.safetensors                        weights of each trained model (our key names)
    optim_<name>.safetensors + optim_<name>.json    optimizer tensors + param groups / scalars
      (under --fsdp: model_<name>.rank<r>.safetensors + model_<name>.json, optim_<name>.rank<r>.safetensors +
       optim_<name>.json: each rank's shards and an index of global shapes; load_state reads either
       layout on any number of ranks)
    rng_rank<r>.safetensors + rng_rank<r>.json      RNG states of every rank (torch, cuda, python, numpy)
    meta.json                                       step, data position, KL controller, ... (script-defined)
    run.json                                        what defines the run (nano_rlhf.training checks it on --resume)
  samples.jsonl, tensorboard/                       sampled completions; the --report_to tensorboard mirror
  adapter/                                          --lora_r runs: the adapters alone, in PEFT's layout
  value/, d2o_samples.jsonl                         train_unpaired.py: DRO's value model, D2O's reference samples
  .lock                                             pid + host of the run using out_dir (held with flock)

The state directory is written to `state.tmp/`, then swapped in with renames (state -> state.old,
state.tmp -> state, delete state.old). A crash at any point leaves a complete `state/` or `state.old/`,
and `load_state` takes whichever is complete.
"""
import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import socket

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from . import dist, lora, parallel


# ---- Small file helpers: the state directory's error, its JSON reader, and atomic writes (a temporary file, fsync,
# rename) -------------------------------------------------------------------------------------------------------
class StateError(ValueError):
    """A missing, truncated or corrupt file in a state directory (a ValueError, so run.input_errors
    turns it into one line)."""


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise StateError(f"{path}: missing; the saved state is incomplete") from None
    except (OSError, ValueError) as e:
        raise StateError(f"{path}: unreadable or corrupt ({e}); the saved state is damaged") from None


def atomic_write_text(path, text):
    """path holds text whole, or (on any failure: a full disk, an interrupt) is as it was: written to a temporary
    file beside it, then renamed over it; the temporary file never outlives a failure."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")

# A function returning the run's identity record, registered by nano_rlhf.training.open_run(); save_state writes it
# into every state directory as run.json, inside the atomic swap, so a state never exists without it.
RUN_INFO = None


def _read_tensors(path):
    if not os.path.isfile(path):
        raise StateError(f"{path}: missing; the saved state is incomplete")
    try:
        return load_file(path)
    except Exception as e:      # safetensors raises its own error types for truncated / bad headers
        raise StateError(f"{path}: unreadable or corrupt ({type(e).__name__}: {e}); the saved state is damaged") \
            from None


def export_pad_id(cfg, tokenizer=None):
    """The pad_token_id an exported config.json states: the tokenizer's pad (nano_rlhf.tokenizer's one rule), so
    the directory's config, generation_config and tokenizer_config agree. An out-of-vocabulary pad (a tokenizer
    with no spare special token) is not exported for the Llama family, whose transformers embedding refuses a
    padding_idx past its rows; GPT-2 keeps it, as transformers' GPT-2 accepts it and always has here."""
    pad = tokenizer.pad_id if tokenizer is not None else cfg.pad_token_id
    if pad is not None and pad >= cfg.vocab_size and cfg.model_type != "gpt2":
        return None
    return pad


def save_model_dir(out_dir, model, tokenizer=None, **extra_config):
    """The model as a HF directory (config.json, model.safetensors) plus tokenizer.json; rank 0 writes it.
    A FSDP-sharded model is gathered first (collective: then every rank must call this). A model with LoRA
    adapters is written merged (W + (alpha / r) B A: an ordinary checkpoint for transformers), plus the adapters
    alone in PEFT's layout in out_dir/adapter (base_model_name_or_path: the base directory lora.attach was given;
    a score model's adapter is SEQ_CLS)."""
    if parallel.is_sharded(model):
        model = parallel.plain_copy(model)
    if not dist.world().is_main:
        return
    adapted = dist.unwrap(model) if lora.lora_modules(model) else None
    if adapted is not None:
        model = lora.merged_copy(adapted)
    os.makedirs(out_dir, exist_ok=True)
    cfg = dist.unwrap(model).cfg
    stop_ids = set(getattr(tokenizer, "stop_ids", None) or [])
    ends = sorted(stop_ids | ({cfg.eos_token_id} if cfg.eos_token_id is not None else set())
                  | set(cfg.eos_token_ids or []))
    if ends:
        # end-of-text and end-of-turn (<|im_end|>, <|eot_id|>) and every end id the checkpoint listed: HF's
        # generate stops at any id of a list, so the exported model stops where ours and the original do
        extra_config.setdefault("eos_token_id", ends if len(ends) > 1 else ends[0])
    extra_config.setdefault("pad_token_id", export_pad_id(cfg, tokenizer))
    dist.unwrap(model).save_pretrained(out_dir, **extra_config)
    if tokenizer is not None:
        tokenizer.save(os.path.join(out_dir, "tokenizer.json"))     # + tokenizer_config.json, each atomic
    if adapted is not None:
        lora.save_peft_adapter(adapted, os.path.join(out_dir, lora.ADAPTER_DIR), getattr(adapted, "lora_base", ""),
                               task_type="SEQ_CLS" if getattr(adapted, "head", "lm") == "score" else "CAUSAL_LM")


# ---- optimizer and RNG state <-> (tensors, json) ------------------------------------------------

def _optim_to_flat(opt):
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v.detach().to("cpu").contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _rng_state(generators):
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    for name, g in (generators or {}).items():
        tensors[f"gen.{name}"] = g.get_state()
    py = random.getstate()
    npst = np.random.get_state()
    meta = {"python": [py[0], list(py[1]), py[2]],
            "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])]}
    return tensors, meta


def _set_rng_state(tensors, meta, generators):
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda"))]
        if states:
            torch.cuda.set_rng_state_all(states)
    for name, g in (generators or {}).items():
        if f"gen.{name}" in tensors:
            g.set_state(tensors[f"gen.{name}"])
    p = meta["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


# ---- resumable state --------------------------------------------------------------------------

def save_state(out_dir, models: dict, optimizers: dict, meta: dict, generators: dict = None):
    """Write out_dir/state atomically. Collective: every rank must call it (each saves its RNG).
    Also writes run.json (the run identity registered by nano_rlhf.training.open_run), when there is one."""
    ctx = dist.world()
    final, tmp, old = (os.path.join(out_dir, s) for s in ("state", "state.tmp", "state.old"))
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    for name, m in models.items():
        if parallel.is_sharded(m):      # FSDP: every rank writes its shards (save_sharded)
            save_sharded(tmp, f"model_{name}", dist.unwrap(m).state_dict())
        elif ctx.is_main:
            sd = {k: v.detach().to("cpu").contiguous() for k, v in dist.unwrap(m).state_dict().items()}
            save_file(sd, os.path.join(tmp, f"model_{name}.safetensors"))
    for name, opt in optimizers.items():
        if any(parallel.is_sharded(p) for g in opt.param_groups for p in g["params"]):
            tensors, ometa = optimizer_tensors(opt)
            save_sharded(tmp, f"optim_{name}", tensors, ometa)
        elif ctx.is_main:
            tensors, ometa = _optim_to_flat(opt)
            save_file(tensors, os.path.join(tmp, f"optim_{name}.safetensors"))
            write_json(os.path.join(tmp, f"optim_{name}.json"), ometa)
    dist.barrier()
    tensors, rmeta = _rng_state(generators)
    save_file(tensors, os.path.join(tmp, f"rng_rank{ctx.rank}.safetensors"))
    write_json(os.path.join(tmp, f"rng_rank{ctx.rank}.json"), rmeta)
    dist.barrier()
    if ctx.is_main:
        if RUN_INFO is not None:
            write_json(os.path.join(tmp, "run.json"),
                       dict(RUN_INFO(), world_size=ctx.world_size, step=meta.get("step")))
        write_json(os.path.join(tmp, "meta.json"), dict(meta, world_size=ctx.world_size))  # written last
        if os.path.isdir(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def find_state(out_dir):
    """The newest complete state directory (state/, else state.old/ after a crash mid-swap), or None."""
    for name in ("state", "state.old"):
        d = os.path.join(out_dir, name)
        if os.path.isfile(os.path.join(d, "meta.json")):
            return d
    return None


def load_state(out_dir, models: dict, optimizers: dict, generators: dict = None) -> dict:
    """Restore models, optimizers and this rank's RNG from out_dir/state; returns meta.json.
    A missing, truncated or corrupt file raises StateError naming it. RNG: with the world size it was
    saved with, this rank's RNG file must exist; with another world size the RNG streams restart (a note)."""
    d = find_state(out_dir)
    if d is None:
        raise FileNotFoundError(f"{out_dir}: no saved state to resume from (expected {out_dir}/state/meta.json)")
    meta = _read_json(os.path.join(d, "meta.json"))
    step = meta.get("step") if isinstance(meta, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:     # a hand-edited or foreign meta.json
        raise StateError(f"{os.path.join(d, 'meta.json')}: \"step\" is {step!r}, not a count of steps done (an "
                         f"integer >= 0)")
    for name, m in models.items():
        path = os.path.join(d, f"model_{name}.safetensors")
        if parallel.is_sharded(m) or not os.path.isfile(path):      # sharded now, or saved sharded
            try:
                load_model(TensorSource(d, f"model_{name}"), m)
            except RuntimeError as e:
                raise StateError(f"{d}/model_{name}: does not fit the model ({str(e).splitlines()[0]})") from None
            continue
        try:
            dist.unwrap(m).load_state_dict(_read_tensors(path))
        except RuntimeError as e:       # missing / unexpected keys, shape mismatch
            raise StateError(f"{path}: does not fit the model ({str(e).splitlines()[0]})") from None
    for name, opt in optimizers.items():
        tpath, jpath = (os.path.join(d, f"optim_{name}.{ext}") for ext in ("safetensors", "json"))
        sharded_now = any(parallel.is_sharded(p) for g in opt.param_groups for p in g["params"])
        try:
            if sharded_now or not os.path.isfile(tpath):
                load_optimizer(TensorSource(d, f"optim_{name}"), opt, _read_json(jpath))
            else:
                _optim_from_flat(opt, _read_tensors(tpath), _read_json(jpath))
        except StateError:
            raise
        except (KeyError, TypeError, IndexError, RuntimeError, ValueError) as e:   # ValueError: a group's size
            raise StateError(f"{tpath}: does not fit the optimizer ({type(e).__name__}: {e})") from None
    rank, world_size = dist.world().rank, dist.world().world_size
    rpath, rjson = os.path.join(d, f"rng_rank{rank}.safetensors"), os.path.join(d, f"rng_rank{rank}.json")
    if meta.get("world_size") == world_size:
        try:
            _set_rng_state(_read_tensors(rpath), _read_json(rjson), generators)
        except StateError:
            raise
        except (KeyError, TypeError, IndexError, RuntimeError, ValueError) as e:
            raise StateError(f"{rpath}: does not hold a usable RNG state ({type(e).__name__}: {e})") from None
    else:
        dist.print0(f"note: resuming with {world_size} ranks from a state saved with "
                    f"{meta.get('world_size')}: RNG streams restart (data order is unaffected)")
    return meta


# ---- out_dir: what a run is, and the lock ---------------------------------------------------------

# Everything this project writes into an out_dir: a directory holding any of these holds a run.
RUN_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "train_config.json",
             "metrics.jsonl", "samples.jsonl", "tensorboard", "state", "state.old", "state.tmp",
             "adapter",          # a LoRA run's adapters in PEFT's layout (nano_rlhf/lora.py)
             "value", "d2o_samples.jsonl")   # train_unpaired.py: DRO's value model, D2O's reference samples


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# The files of a model directory that its loaders read (model, tokenizer): what --resume checks of a frozen input.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja")


def input_sha256(path):
    """sha256 of an input of a run (streamed, every byte): a file's content, or for a model directory each of its
    MODEL_FILES and weights (*.safetensors, *.safetensors.index.json) by name and content. A training run's
    logs and state/ beside the model are left out (they change when its training goes on, the model only
    when it saves). None when the path is neither."""
    if os.path.isfile(path):
        return sha256_file(path)
    if not os.path.isdir(path):
        return None
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full) and (name in MODEL_FILES or name.endswith((".safetensors", ".safetensors.index.json"))):
            h.update(f"{name}\0{sha256_file(full)}\0".encode())
    return h.hexdigest()


class OutDirLock:
    """An exclusive lock on out_dir/.lock. flock is released by the kernel when its holder dies, so a lock
    file left by a killed run is simply taken over; the file's content (pid, host) names the holder."""

    def __init__(self, out_dir):
        self.path, self.fd = os.path.join(out_dir, ".lock"), None

    def acquire(self):
        """None when taken, else the one-line reason (held by a live run; out_dir not writable)."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                return f"--out_dir {os.path.dirname(self.path)}: not writable ({e.strerror or e})"
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = os.read(fd, 200).decode(errors="replace").split()
                os.close(fd)
                who = f"pid {held[0]}" + (f" on {held[1]}" if len(held) > 1 and held[1] != socket.gethostname()
                                         else "") if held else "another process"
                return (f"{os.path.dirname(self.path)} is in use by another run ({who}); wait for it to end "
                        "or choose another --out_dir")
            # the holder may have unlinked the file between our open and flock: then lock the new file
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            old = os.read(fd, 200).decode(errors="replace").split()
            if old and old[0] != str(os.getpid()):
                print(f"note: taking over the stale lock {self.path} (pid {old[0]} is not running)", flush=True)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            self.fd = fd
            return None

    def release(self):
        if self.fd is not None:
            try:
                os.remove(self.path)
            except OSError:
                pass
            os.close(self.fd)       # closing drops the flock
            self.fd = None


# ---- Sharded checkpoints without pickle: per-rank safetensors files and a JSON index (parallel.py shards the
# models; the functions above decide what a run's state holds).
#
# Each rank writes its own shards (`<name>.rank<r>.safetensors`) and rank 0 a JSON index (global
# shapes, how many ranks); nothing is pickled. A state saved by N ranks (or by one process, unsharded) loads on
# M ranks: each rank reads, from whichever files hold them, only the rows of its own shard (FSDP2 shards dim 0
# in torch.chunk's pieces: ceil(n / world) rows per rank, the last ranks fewer or none).
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
