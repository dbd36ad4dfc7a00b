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
       optim_<name>.json: each rank's shards and an index of global shapes; nano_rlhf.parallel reads either
       layout on any number of ranks)
    rng_rank<r>.safetensors + rng_rank<r>.json      RNG states of every rank (torch, cuda, python, numpy)
    meta.json                                       step, data position, KL controller, ... (script-defined)
    run.json                                        what defines the run (nano_rlhf.run checks it on --resume)
  samples.jsonl, tensorboard/                       sampled completions; the --report_to tensorboard mirror
  adapter/                                          --lora_r runs: the adapters alone, in PEFT's layout
  value/, d2o_samples.jsonl                         train_unpaired.py: DRO's value model, D2O's reference samples
  .lock                                             pid + host of the run using out_dir (held with flock)

The state directory is written to `state.tmp/`, then swapped in with renames (state -> state.old,
state.tmp -> state, delete state.old). A crash at any point leaves a complete `state/` or `state.old/`,
and `load_state` takes whichever is complete.
"""
import fcntl
import hashlib
import os
import random
import shutil
import socket

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from . import dist, parallel, sharded
from .files import StateError, _read_json, atomic_write_text, write_json  # noqa: F401  (re-exported: they lived here)
from .sharded import _optim_from_flat

# A function returning the run's identity record, registered by nano_rlhf.run.start(); save_state writes it
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
    A FSDP-sharded model is gathered first (collective: then every rank must call this)."""
    if parallel.is_sharded(model):
        model = parallel.plain_copy(model)
    if not dist.world().is_main:
        return
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
    Also writes run.json (the run identity registered by nano_rlhf.run.start), when there is one."""
    ctx = dist.world()
    final, tmp, old = (os.path.join(out_dir, s) for s in ("state", "state.tmp", "state.old"))
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    for name, m in models.items():
        if parallel.is_sharded(m):      # FSDP: every rank writes its shards (sharded.save_sharded)
            sharded.save_sharded(tmp, f"model_{name}", dist.unwrap(m).state_dict())
        elif ctx.is_main:
            sd = {k: v.detach().to("cpu").contiguous() for k, v in dist.unwrap(m).state_dict().items()}
            save_file(sd, os.path.join(tmp, f"model_{name}.safetensors"))
    for name, opt in optimizers.items():
        if any(parallel.is_sharded(p) for g in opt.param_groups for p in g["params"]):
            tensors, ometa = sharded.optimizer_tensors(opt)
            sharded.save_sharded(tmp, f"optim_{name}", tensors, ometa)
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
                sharded.load_model(sharded.TensorSource(d, f"model_{name}"), m)
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
                sharded.load_optimizer(sharded.TensorSource(d, f"optim_{name}"), opt, _read_json(jpath))
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


# The files of a model directory that its loaders read (hf_io, tokenizer): what --resume checks of a frozen input.
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
