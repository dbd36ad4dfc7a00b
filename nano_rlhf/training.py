"""A training run's life cycle around the loop: out_dir safety, the lock, the resume identity, the end of each step
(eval / log / save / stop), what a run writes as it goes (metrics, samples, the progress line, --report_to), the
training state (resume, save, the end), and cleaning up after a failed start; beside it the pieces of set-up every
script shares (the tokenizer, placing, wrapping, the memory plan). Not algorithm.

A script's main() reads, in order (`from nano_rlhf import training`; `run` is the Run):

    opts = parse_args(Options, argv, __doc__)      # each option's range and [with ...] refused here
    fill_defaults(opts)                            # the defaults that depend on other options
    check_options(opts)                            # --device and the rules between options; only refuses
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    run = training.open_run(opts, "dpo", **run_record(opts), show=[...], loss_keys=[...])
    tok = training.tokenizer(opts, run)
    ... the script's own models and data, in its own order ...
    training.place(opts, world, {"policy": policy}, {"reference model": ref})   # device, same weights, seeds
    ref = training.frozen(opts, ref)                                         # --fsdp / --frozen / --offload_frozen
    ddp, optimizer = training.prepare(opts, policy, opts.lr)                 # compile, DDP / FSDP, AdamW
    training.plan(opts, {"policy": policy, "ref": ref})                      # the memory plan
    run.resume({"policy": policy}, {"policy": optimizer}, data={"data": batches})
    ... the loop: run.end_of_step(..., save=...) with run.save(...) inside save ...
    run.finish({"policy": policy}, {"reference": ref}, saved="saved out/dpo ...")

So --fsdp, --lora_* (only the adapters in the state), --report_to, --resume / --overwrite, the same-weights
check, the seeding, the memory plan and train_config.json are the same code in every script. What differs stays
visible in the script: which inputs it reads and in what order (that order decides which bad input a user is
told about first: train_sft.py and train_rm.py validate every data line before the run opens), what it computes
between placing and wrapping (train_dpo.py's precomputed reference log-probs, train_unpaired.py's D2O samples),
and its loop.

The Run (open_run) owns out_dir and the loop's bookkeeping; `run.end_of_step(step, metrics,
evaluate=..., save=...)` returns True when the run should stop.

Only rank 0 touches the file system; the other ranks only take part in the collectives (a broadcast of rank 0's
verdict, so every rank stops with the same one-line error).

out_dir rules: it may not be (or be inside) an input directory; one holding a run (any of
checkpoint.RUN_FILES) needs --resume or --overwrite. --overwrite first moves those files, and only those, aside
(out_dir/.overwritten.PID) and deletes them at the new run's first save or normal end; a run that fails before
then (a bad --data found after start-up, a crash while loading) puts them back, so nothing is lost to a run that
never produced anything. An input file of the run directly in out_dir under one of those names (--tokenizer
out_dir/tokenizer.json) is refused. A lock (out_dir/.lock, flock) keeps a second run out. A run that ends in an
error before its first save removes what it created (out_dir itself if it created it). --resume compares the
saved identity (state/run.json) with this run's: every option but cli.CHANGEABLE must match (an option
added later is compared unless it is declared changeable there), the global batch and what the script resolved
included, the data files' sha256, and the sha256 of every input (checkpoint.input_sha256: a reference, reward
model or judge replaced at the same path would otherwise be taken, and the run go on against another model).
"""
import atexit
import contextlib
import importlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from . import checkpoint, dist, lora, parallel
from .checkpoint import atomic_write_text, find_state, input_sha256, OutDirLock, RUN_FILES, save_state, sha256_file
from .cli import CHANGEABLE, moved_module, save_config, to_dict
from .data import DataError, default_data, load_train_eval
from .model import GPT, non_finite, set_logits_budget

_current = None          # the live Run of this process (fail aborts it)


def fail(msg: str, code: int = 1):
    """Print one clear line to stderr and exit non-zero (all ranks do the same). Under torchrun the line is left
    for the other ranks too: one that fails alone is named by them (dist.announce_failure)."""
    store = dist.announce_failure(msg)
    print(f"error: {msg}", file=sys.stderr, flush=True)
    if _current is not None:       # the live Run (if any) releases its lock and undoes a run that saved nothing
        _current.abort()
    several = dist.world().world_size > 1
    dist.cleanup(sync=False)
    if several:                    # the interpreter's finalization can abort a rank (dist._leave_without_finalizing)
        dist.wait_until_named(store)
        dist.end_process(code)
    sys.exit(code)


def check_finite(value: float, step: int, out_dir: str, what="loss"):
    if not math.isfinite(value):
        fail(f"non-finite {what} ({value}) at step {step}; stopping. The last good checkpoint "
             f"(if any) is in {out_dir}/state and can be resumed with --resume")


def _inside(path, parent):
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def _no_state(out_dir):
    """--resume's refusal of an out_dir without a checkpoint, naming a run an --overwrite run set aside and never
    gave back (killed before its first save: SIGKILL, SIGTERM) and how to get it back."""
    msg = f"--resume: {out_dir} has no saved state to resume from (no {out_dir}/state/meta.json)"
    kept = sorted(n for n in os.listdir(out_dir) if n.startswith(".overwritten.")
                  and find_state(os.path.join(out_dir, n)) is not None) if os.path.isdir(out_dir) else []
    if kept:
        aside = os.path.join(out_dir, kept[-1])
        msg += (f"; {aside} holds the run that an --overwrite run set aside and was killed before its first save: "
                f"to resume that run, move its files back (mv {aside}/* {out_dir}/ && rmdir {aside})")
    return msg


def _saved_step(out_dir):
    """The step of out_dir's complete checkpoint (state/meta.json, else state.old/'s), or None."""
    d = find_state(out_dir)
    try:
        return int(checkpoint._read_json(os.path.join(d, "meta.json"))["step"]) if d else None
    except (checkpoint.StateError, KeyError, TypeError, ValueError):
        return None


def _step_of(line):
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")       # a line cut by a crash: drop it


def _collective_check(fn, every_rank=False):
    """Run fn() (it returns an error message or None) on rank 0, or with every_rank on every rank (a check of
    each rank's own files); every rank then fails with that message (the lowest failing rank's). A bug (an
    exception) in fn is re-raised on its rank after the others were told, so no rank waits for it."""
    msg, bug = None, None
    if every_rank or dist.world().is_main:
        try:
            msg = fn()
        except Exception as e:
            msg, bug = f"rank {dist.world().rank} failed in a start-up check ({type(e).__name__}: {e})", e
    msg = dist.first_problem(msg) if every_rank else dist.broadcast_object(msg)
    if bug is not None:
        raise bug
    if msg:
        fail(msg)


class Run:
    def __init__(self, opts, script, identity, inputs, data_files, max_steps, show, loss_keys):
        self.opts, self.out_dir, self.max_steps = opts, opts.out_dir, max_steps
        # every option but CHANGEABLE, then what the script adds (values resolved later: the training length...)
        self.identity = {"script": script, **{k: v for k, v in to_dict(opts).items() if k not in CHANGEABLE},
                         **identity}
        self.inputs = {k: v for k, v in (inputs or {}).items() if v}
        self.data_files = {k: v for k, v in (data_files or {}).items() if v}
        self.step, self.meta = 0, {}
        self.done_step, self.saved_step = 0, None   # the last step finished and the last one saved (Ctrl-C says)
        self.input_sha = {}                         # {input name: sha256}, taken at start (rank 0) before loading
        self.show = list(show)                      # keys of the progress line, in order
        self.loss_keys = list(loss_keys)            # a non-finite value of one of them stops the run
        self.main = dist.world().is_main
        self.report_to = getattr(opts, "report_to", "none")
        self.saved = self.finished = False
        self.created_dir, self.before = None, None  # what to remove if the run fails before its first save
        self.set_aside = None                       # --overwrite: the previous run's files until the first save
        self.lock = OutDirLock(self.out_dir)
        self.writer = self.wandb = None
        self.t0, self.step0 = time.time(), 0

    # ---- start-up checks (rank 0) ------------------------------------------------------------------
    def _check_out_dir(self):
        o, out = self.opts, self.out_dir
        resume, overwrite = getattr(o, "resume", False), getattr(o, "overwrite", False)
        for name, path in self.inputs.items():
            if os.path.isfile(path):
                if (os.path.realpath(os.path.dirname(os.path.abspath(path))) == os.path.realpath(out)
                        and os.path.basename(path) in RUN_FILES):
                    return (f"--{name} {path} is a file of the run in --out_dir {out}; copy it elsewhere or "
                            "choose another --out_dir")
            elif _inside(out, path):
                return f"--out_dir {out} is, or is inside, the input --{name} {path}; choose another --out_dir"
        missing = self.report_to != "none" and self._import_backend()
        if missing:
            return missing
        if not os.path.isdir(out):
            top = os.path.abspath(out)               # the outermost directory this run creates
            while not os.path.exists(os.path.dirname(top)):
                top = os.path.dirname(top)
            try:
                os.makedirs(out)
            except OSError as e:
                return f"--out_dir {out}: cannot be created ({e.strerror or e})"
            self.created_dir = top
        self.before = set(os.listdir(out))
        msg = self.lock.acquire()
        if msg:
            self._remove_created()
            return msg
        present = sorted(self.before & set(RUN_FILES))
        if resume and find_state(out) is None:
            return _no_state(out)
        if present and not resume and not overwrite:
            return (f"--out_dir {out} already holds a run ({', '.join(present)}); pass --resume to continue it "
                    "or --overwrite to replace it")
        if present and overwrite:
            print(f"note: --overwrite: the previous run's files in {out} ({', '.join(present)}) are replaced at "
                  "this run's first save (kept if it fails before)", flush=True)
            self.set_aside = tempfile.mkdtemp(prefix=".overwritten.", dir=out)
            self.before |= {os.path.basename(self.set_aside)}       # never "created by this run": not removed
            for name in present:
                os.replace(os.path.join(out, name), os.path.join(self.set_aside, name))
                self.before.discard(name)
        stale = sorted(n for n in self.before if n.startswith(".overwritten.")
                       and os.path.join(out, n) != self.set_aside)
        if stale:
            print(f"warning: {out} holds {', '.join(stale)}: the files of a run replaced by an --overwrite run that "
                  "was killed before its first save; move them back or delete them", flush=True)
        return None

    def _drop_set_aside(self):
        """The new run has saved: the previous run's files go for good."""
        if self.set_aside is not None and self.main:
            shutil.rmtree(self.set_aside, ignore_errors=True)
        self.set_aside = None

    def _restore_set_aside(self):
        """The run failed before saving anything: the previous run's files come back."""
        if self.set_aside is None or not os.path.isdir(self.set_aside):
            return
        for name in os.listdir(self.set_aside):
            dst = os.path.join(self.out_dir, name)
            if not os.path.exists(dst):
                os.replace(os.path.join(self.set_aside, name), dst)
        shutil.rmtree(self.set_aside, ignore_errors=True)
        self.set_aside = None

    def record(self):
        """run.json's content (written by checkpoint.save_state with every save). The data hashes are taken
        at the first save, not when the run opens: the files may be generated after it (the built-in task)."""
        if not hasattr(self, "_sha"):
            self._sha = self._data_sha()
        return {"identity": self.identity, "data_sha256": self._sha, "inputs_sha256": self.input_sha,
                "options": to_dict(self.opts)}

    # ---- resume ------------------------------------------------------------------------------------
    def _data_sha(self):
        return {k: (sha256_file(p) if os.path.isfile(p) else None) for k, p in self.data_files.items()}

    def _identity_diff(self):
        """None when the saved run.json describes this run, else the one-line refusal."""
        d = find_state(self.out_dir)
        if d is None:
            return _no_state(self.out_dir)
        path = os.path.join(d, "run.json")
        if not os.path.isfile(path):
            return f"--resume: {path}: missing (a state saved without a run identity cannot be checked)"
        try:
            saved = checkpoint._read_json(path)
            was, now = saved["identity"], json.loads(json.dumps(self.identity))
            if was.get("script") != now["script"]:
                return (f"--resume: {self.out_dir} was saved by train_{was.get('script')}.py, not train_{now['script']}"
                        ".py: a run goes on only under the script that began it")
            old = next(((k, v) for k, v in was.items() if moved_module(v)), None)
            if old is not None:        # a record made before a module moved: its specs name the old address
                (k, v), (before, after) = old, moved_module(old[1])
                return (f"--resume: {self.out_dir} was saved with --{k} {v}, and {before} is now {after}: a run "
                        f"cannot continue across the move; start a new one with --{k} {v.replace(before, after, 1)}")
            diffs = [f"{k} {was.get(k)!r} != {now.get(k)!r}" for k in sorted(set(was) | set(now))
                     if k not in CHANGEABLE and was.get(k) != now.get(k)]
            was_sha, sha = saved["data_sha256"], self._data_sha()
            changed = self._inputs_changed(saved["inputs_sha256"])
        except checkpoint.StateError as e:
            return f"--resume: {e}"
        except (KeyError, TypeError, AttributeError) as e:
            return f"--resume: {path}: malformed ({type(e).__name__}: {e})"
        bad = [os.path.basename(self.data_files.get(k, k)) for k in sorted(set(was_sha) | set(sha))
               if was_sha.get(k) != sha.get(k)]
        if bad:
            diffs.append(f"data sha256 differs ({', '.join(bad)})")
        if changed and not diffs:
            return (f"--resume: the input {changed} changed since {self.out_dir} was saved (sha256 of its files "
                    "differs): the run would go on against another model; restore it or start a new run")
        if changed:
            diffs.append(f"input {changed} changed (sha256)")
        if diffs:
            return f"--resume: {self.out_dir} was saved by a different run (saved != now): {'; '.join(diffs)}"
        return None

    def _inputs_changed(self, was):
        """'--ref DIR, ...' naming each input whose sha256 differs from the saved one, or ''."""
        if not isinstance(was, dict):
            raise TypeError(f"inputs_sha256 is a {type(was).__name__}")
        now = self.input_sha
        return ", ".join(f"--{k} {self.inputs[k]}" if k in self.inputs else f"--{k} (an input of the saved run only)"
                         for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))

    def _restore(self, models, optimizers, generators=None):
        """Check the saved run is this run, then restore models, optimizers and RNG (checkpoint.load_state);
        returns meta (also run.meta) and sets run.step. Collective: each rank reads its own files (its RNG, its
        FSDP shards), so a damaged one fails one rank; the ranks then share their problems and every rank stops
        with the same line (alone, that rank exited and the others died in their next collective)."""
        _collective_check(self._identity_diff)

        def load():    # load_state has no collective inside, so a rank failing in it cannot strand the others
            try:
                self.meta = checkpoint.load_state(self.out_dir, models, optimizers, generators)
            except (checkpoint.StateError, FileNotFoundError) as e:
                return f"--resume: {e}"
        _collective_check(load, every_rank=True)
        self.step = self.step0 = self.done_step = self.saved_step = int(self.meta["step"])
        if self.main:          # drop what was logged after the checkpoint: those steps are about to be redone
            for name in ("metrics.jsonl", "samples.jsonl"):
                path = os.path.join(self.out_dir, name)
                if os.path.isfile(path):
                    with open(path) as f:
                        keep = [ln for ln in f if _step_of(ln) <= self.step]
                    atomic_write_text(path, "".join(keep))
        return self.meta

    # ---- the end of a step -------------------------------------------------------------------------
    def _due(self, interval, step):
        return (interval and step % interval == 0) or step == self.max_steps

    def end_of_step(self, step, metrics, evaluate=None, save=None):
        """Eval, log, save as due at `step` (the number of optimizer steps done); True when the loop must stop.
        evaluate() -> dict of eval metrics (called on every rank); save(step) writes the checkpoint (every rank)."""
        o = self.opts
        self.done_step = step
        for key in self.loss_keys:
            if key in metrics:
                check_finite(float(metrics[key]), step, self.out_dir, key.split("/")[-1].replace("_", " "))
        # save, then evaluate: a failure in the evaluation (a user's reward, an overflow) costs no training
        stop_at = getattr(o, "stop_at", 0)
        if save is not None and (self._due(getattr(o, "save_interval", 0), step) or step == stop_at):
            self._guarded_save(save, step)
            self.saved, self.saved_step = True, step
            self._drop_set_aside()
        eval_due = evaluate is not None and self._due(getattr(o, "eval_interval", 0), step)
        if eval_due:
            metrics.update(evaluate())
        if eval_due or self._due(getattr(o, "log_interval", 1), step):
            self.log(step, metrics)
            self._progress(step, metrics)
        if step == stop_at and step < self.max_steps:
            dist.print0(f"stopping at step {step} (--stop_at); continue with --resume")
        return step == stop_at or step >= self.max_steps

    def _guarded_save(self, save, step):
        """save(step); a write that fails (a full disk, a directory gone read-only) is one line, not a stack: the
        temporaries of the save go (state.tmp/, this process's FILE.tmpPID files) and the last complete
        checkpoint, named, stays to --resume from."""
        try:
            save(step)
        except OSError as e:
            last = None
            if self.main:
                shutil.rmtree(os.path.join(self.out_dir, "state.tmp"), ignore_errors=True)
                suffix = f".tmp{os.getpid()}"
                for folder, dirs, files in os.walk(self.out_dir):
                    dirs[:] = [d for d in dirs if not d.startswith(".overwritten.")]
                    for name in files:
                        if name.endswith(suffix):
                            os.remove(os.path.join(folder, name))
                last = _saved_step(self.out_dir)
            if last is not None:        # a complete checkpoint (this step's state may be): never undone
                self.saved, self.saved_step = True, last
            kept = (f"the last complete checkpoint is step {last}: free space and continue with --resume"
                    if last is not None else "nothing was saved")
            fail(f"step {step}: writing the checkpoint to {self.out_dir} failed ({e.strerror or e}); {kept}")

    # ---- the training state: resume, save, the end ----------------------------------------------------
    def set_max_steps(self, max_steps):
        """The run's length when the script derives it from the data after the run opened (--epochs: the
        steps an epoch takes are known once the data is tokenized, which needs the run's tokenizer)."""
        self.max_steps = max_steps

    def resume(self, models, optimizers, data=None, generators=None, **config):
        """--resume: the saved run checked to be this one, then models ({name: model}; under LoRA only the
        adapters are in the state), optimizers, generators and each data order in `data` ({meta key: object with
        load_state_dict}) restored; returns the saved meta ({} on a fresh start). Then rank 0 writes
        out_dir/train_config.json: the resolved options, the world size and `config`."""
        meta = {}
        if self.opts.resume:
            meta = self._restore({k: lora.checkpointed(m) for k, m in models.items()}, optimizers, generators)
            for key, order in (data or {}).items():
                order.load_state_dict(meta[key])
        world = dist.world()
        if world.is_main:
            save_config(self.opts, os.path.join(self.out_dir, "train_config.json"), world_size=world.world_size,
                        **config)
        return meta

    def save(self, step, models, optimizers, data=None, generators=None, **meta):
        """The training state at `step` into out_dir/state (collective): models (LoRA: the adapters),
        optimizers, generators, each data order's state_dict() under its key in `data`, and any other meta. A
        model holding a non-finite weight (an overflow the loss did not show) is refused with one line before
        anything is written: the previous checkpoint and model directory stay as they were."""
        for name, m in models.items():
            bad = dist.all_reduce_sum(float(len(non_finite(dist.unwrap(m).state_dict()))))
            if bad:
                fail(f"step {step}: the {name} model holds non-finite weights ({bad:.0f} tensors); not saved: the "
                     f"last checkpoint in {self.out_dir}/state (if any) is kept and can be resumed with a lower --lr")
        meta = {"step": step, **{k: order.state_dict() for k, order in (data or {}).items()}, **meta}
        save_state(self.out_dir, {k: lora.checkpointed(m) for k, m in models.items()}, optimizers, meta, generators)

    def finish(self, trained, frozen=None, saved=""):
        """The end of a run: every trained model still the same on every rank (DDP kept them in lock-step:
        proven), every frozen model bit-identical to its start (those frozen() placed), the `saved` line printed,
        then the run closed."""
        for name, m in trained.items():
            if m is not None:
                dist.check_same_weights(m, name)
        if frozen:
            parallel.check_frozen(frozen)
        if saved:
            dist.print0(saved)
        self.close()

    def close(self):
        """Normal end: close the backend, release the lock, tear down the process group. Collective."""
        global _current
        self.finished = True
        dist.barrier()
        self._drop_set_aside()
        self._close()
        dist.cleanup()
        _current = None

    def _close(self):
        if checkpoint.RUN_INFO == self.record:
            checkpoint.RUN_INFO = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        self.lock.release()

    def _remove_created(self):
        """Undo what this run wrote into out_dir (nothing was saved yet): the directories this run created,
        else the entries of out_dir that were not there before. Nothing before out_dir was looked at."""
        if self.created_dir is not None:
            shutil.rmtree(self.out_dir, ignore_errors=True)
            d = os.path.dirname(os.path.abspath(self.out_dir))
            while len(d) >= len(self.created_dir) and os.path.isdir(d) and not os.listdir(d):
                os.rmdir(d)                 # parents this run created, unless something else is in them now
                d = os.path.dirname(d)
        elif self.before is not None and os.path.isdir(self.out_dir):
            for name in set(os.listdir(self.out_dir)) - self.before:
                p = os.path.join(self.out_dir, name)
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)

    def abort(self):
        """Error exit (fail, an exception, an exit without finish()): release the lock and, when
        nothing was saved by a from-scratch run, remove what it wrote."""
        global _current
        if self.finished:
            return
        self.finished = True
        if self.main:
            # files first, the lock last: no other run may start in out_dir while its files are being put back;
            # this run's new files go before the previous run's come back (they share names)
            if not self.saved and not getattr(self.opts, "resume", False):
                self._remove_created()
                self._restore_set_aside()
            else:
                self._drop_set_aside()
            self._close()
        if _current is self:
            _current = None

    # ---- what it writes as it goes: metrics.jsonl, samples.jsonl, the progress line, and their mirror in
    # TensorBoard or Weights & Biases (--report_to; _import_backend checks it at start-up, _open_backend opens it)
    def _import_backend(self):
        module = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}.get(self.report_to)
        if module is None:
            return f"--report_to must be none, tensorboard or wandb (got {self.report_to!r})"
        try:        # a probe at start-up: the backend is opened (and used) only by _open_backend
            importlib.import_module(module)
        except ImportError:
            return f"--report_to {self.report_to} needs the {self.report_to} package: pip install {self.report_to}"
        return None

    def _open_backend(self):
        if self.report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(self.out_dir, "tensorboard"))
        elif self.report_to == "wandb":
            import wandb
            self.wandb = wandb
            wandb.init(project="nano_rlhf", name=os.path.basename(os.path.abspath(self.out_dir)),
                       config=to_dict(self.opts))

    def log(self, step, metrics):
        """Append metrics to out_dir/metrics.jsonl and mirror them to --report_to (rank 0)."""
        if not self.main:
            return
        rec = {"step": step, **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}}
        with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.writer is not None:
            for k, v in numbers.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def _progress(self, step, metrics):
        """`step 120/1000 | loss 1.234 | ... | 12,345 tok/s | eta 1m05s` (rank 0)."""
        if not self.main:
            return
        parts = [f"step {step}/{self.max_steps}"]
        for k in self.show:
            if k in metrics:
                v, name = metrics[k], k.replace("train/", "").replace("/", "_")
                parts.append(f"{name} {v:.4g}" if isinstance(v, float) else f"{name} {v}")
        if "train/tokens_per_s" in metrics:
            parts.append(f"{metrics['train/tokens_per_s']:,.0f} tok/s")
        if step > self.step0:
            eta = (time.time() - self.t0) / (step - self.step0) * max(0, self.max_steps - step)
            parts.append(f"eta {int(eta // 60)}m{int(eta % 60):02d}s")
        print(" | ".join(parts), flush=True)

    def log_samples(self, step, rows):
        """Sampled completions (dicts with prompt, completion, score, ...) -> out_dir/samples.jsonl and the
        --report_to backend (a W&B table / TensorBoard markdown text) (rank 0)."""
        if not self.main or not rows:
            return
        with open(os.path.join(self.out_dir, "samples.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")
        cols = list(dict.fromkeys(k for r in rows for k in r))
        if self.writer is not None:
            cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")
            table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            table += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
            self.writer.add_text("samples", "\n".join(table), step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log({"samples": self.wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])},
                           step=step)



def open_run(opts, script, identity=None, inputs=None, data_files=None, max_steps=None,
             show=("train/loss", "eval/loss"), loss_keys=("train/loss",)) -> Run:
    """Check --out_dir, take its lock, open --report_to; before any model is loaded. Collective.
    identity: what the script adds to the run's identity (compared on --resume) beyond its options, all of
    which but options.CHANGEABLE are in it already; "script" and "global_batch" (batch_size x grad_accum x
    world_size unless given) are added. inputs: {option name: directory or file} the run
    reads and never writes to; each one's sha256 is recorded and checked by --resume (pass only what is read).
    data_files: {name: path} whose sha256 is recorded at the first save; a path known only later (the
    built-in task, generated on first use) may be set in run.data_files before that. max_steps defaults to
    opts.max_steps (run.set_max_steps when the script derives it later, from --epochs). show: the metrics of the
    progress line, in order; loss_keys: the metrics whose non-finite value stops the run (checkpoint intact)."""
    global _current
    if _current is not None:          # a previous run in this process ended without finish() (tests)
        _current.abort()
    if getattr(opts, "resume", False) and getattr(opts, "overwrite", False):      # a bad command line: exit 2
        fail("--overwrite and --resume contradict each other: --resume continues the run in --out_dir", 2)
    # the log-prob operator's chunk (nano_rlhf/model.py): part of the run's identity, so a resume chunks alike
    set_logits_budget(int(getattr(opts, "logits_budget", 0.0) * 2 ** 20))
    run = Run(opts, script, dict(identity or {}), inputs, data_files,
              getattr(opts, "max_steps", 0) if max_steps is None else max_steps, show, loss_keys)
    w = dist.world()
    run.identity.setdefault("global_batch", getattr(opts, "batch_size", 1) * getattr(opts, "grad_accum", 1)
                            * w.world_size)
    _current = run
    _collective_check(run._check_out_dir)
    if run.main:
        # every byte of each input, before the script loads it: what the run is trained against (the
        # reference, reward model, judge, ...) is what --resume must find again
        run.input_sha = {k: input_sha256(p) for k, p in run.inputs.items() if os.path.exists(p)}
        checkpoint.RUN_INFO = run.record
        run._open_backend()
    return run


def _at_exit():
    if _current is not None:
        _current.abort()


def _interrupted(kind, value, tb, _previous=sys.excepthook):
    """Ctrl-C during a run: one line saying where it stopped and what is saved, not a KeyboardInterrupt stack
    (the interpreter still exits as interrupted, 130; the atexit hook then releases the run's lock)."""
    run = _current
    if not (issubclass(kind, KeyboardInterrupt) and run is not None):
        return _previous(kind, value, tb)
    if run.main:
        saved = (f"the last checkpoint is step {run.saved_step}: continue with --resume" if run.saved_step
                 else "nothing was saved")
        print(f"interrupted at step {run.done_step + 1}; {saved}", file=sys.stderr, flush=True)


atexit.register(_at_exit)
sys.excepthook = _interrupted


# ---- A tool's progress line (evaluate, label) ------------------------------------------------------------
class Progress:
    """A long pass's progress on stderr (evaluate's and label's sampling, a script's pass before its first step:
    D2O's samples, precomputed reference log-probs): `sampling out/ppo | 120/512 samples | 8.3/s | eta 0m47s`.
    In a terminal one line updated in place at most every `every` seconds; in a log (stderr not a terminal) a plain
    line every `log_every` seconds; the last one always at done(); rank 0 only. Why: a command that samples for
    minutes and prints nothing cannot be told from a hang."""

    def __init__(self, total, what, unit="samples", stream=None, every=1.0, log_every=10.0, clock=time.time):
        import sys
        self.total, self.what, self.unit, self.clock = total, what, unit, clock
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = every if self.tty else log_every
        self.n, self.t0 = 0, clock()
        self.shown = self.t0
        self.quiet = not dist.world().is_main

    def line(self):
        elapsed = max(self.clock() - self.t0, 1e-9)
        rate = self.n / elapsed
        eta = (self.total - self.n) / rate if rate > 0 else 0.0
        return (f"{self.what} | {self.n:,}/{self.total:,} {self.unit} | {rate:.3g}/s | "
                f"eta {int(eta // 60)}m{int(eta % 60):02d}s")

    def update(self, n):
        self.n += n
        if self.clock() - self.shown >= self.every:
            self._show()

    def done(self):
        self._show()
        if self.tty and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()

    def _show(self):
        self.shown = self.clock()
        if self.quiet:
            return
        self.stream.write(("\r" + self.line() + "\033[K") if self.tty else self.line() + "\n")
        self.stream.flush()


# ---- Plumbing the scripts share that is not algorithm: input errors, optimizer groups, the LR schedule,
# tokenizer loading, precision contexts ------------------------------------------------------------------------
@contextlib.contextmanager
def input_errors():
    """Turn bad-input exceptions (DataError, missing files, bad model dirs) into a one-line exit."""
    try:
        yield
    except (DataError, FileNotFoundError, ValueError) as e:
        fail(str(e))


def adamw(model, lr, weight_decay, betas=(0.9, 0.95), eps=1e-8):
    """AdamW with weight decay on matrices only: biases, norm weights and the embeddings (GPT-2's wte, also the
    tied output layer, and wpe; the Llama family's embed_tokens) are not decayed (nanoGPT / GPT-2 practice)."""
    decay, no_decay = [], []
    for name, p in dist.unwrap(model).named_parameters():
        if not p.requires_grad:
            continue
        embedding = name.endswith(("wte.weight", "wpe.weight", "embed_tokens.weight"))
        (decay if p.dim() >= 2 and not embedding else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # CUDA: the fused kernel (one launch for every tensor; ~4x faster than foreach at 124M parameters, and it skips
    # a non-finite step on the device: step_if_finite). Elsewhere foreach=True: one kernel per group instead of a
    # Python loop over 50 tensors (and a CPU run's bytes as they were).
    fused = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {"foreach": True}))


def step_if_finite(optimizer, finite):
    """optimizer.step() where `finite` (a 0-dim bool tensor) holds; otherwise nothing changes, neither the weights
    nor the moments nor the step count. The fused AdamW takes the flag on the device, as GradScaler hands it its
    found_inf, so deciding costs no host read; any other optimizer reads the flag here (free on a CPU)."""
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~finite).float()
        try:
            optimizer.step()
        finally:
            optimizer.found_inf = None
    elif bool(finite):
        optimizer.step()


def lr_at(step, max_steps, lr, warmup_steps, schedule="cosine", min_lr_ratio=0.1):
    """Linear warm-up over warmup_steps, then cosine decay to min_lr_ratio * lr (or linear to 0, or constant)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    frac = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return lr * (1.0 - frac)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def set_lr(optimizer, lr):
    for g in optimizer.param_groups:
        g["lr"] = lr


def autocast(device, dtype: str):
    """bfloat16 autocast when asked (weights stay float32); a no-op for float32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


def load_tokenizer(tokenizer_path: str, model_dir: str, eos_token: str = "", pad_token: str = "",
                   chat_template: str = "auto", date_string: str = "", policy: bool = False):
    """--tokenizer if given, else the tokenizer.json saved beside the model; --eos_token / --pad_token name
    the special tokens when neither a tokenizer_config.json nor the usual names give them; --chat_template
    names the template variant (auto: recognised from the tokenizer's own template text), --date_string fixes
    Llama 3's "Today Date" (empty: the one saved with the tokenizer, else the template's default). policy=True: the
    model directory must hold a language model, not a reward model (whose trunk would load and be sampled)."""
    from .tokenizer import Tokenizer
    path = tokenizer_path or os.path.join(model_dir, "tokenizer.json")
    if not tokenizer_path and not os.path.isdir(model_dir):
        raise FileNotFoundError(f"{model_dir}: " + ("a file, not a model directory (an HF directory with config.json"
                                                    " and the weights)" if os.path.exists(model_dir) else
                                                    "no such model directory"))
    if not tokenizer_path and os.path.isfile(os.path.join(model_dir, "adapter_config.json")) \
            and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir}: a LoRA adapter directory, not a model: a run's merged model is the "
                                f"directory above its adapter/; or pass the base model with --lora_r")
    score = score_architecture(model_dir) if policy and model_dir else ""
    if score:
        raise ValueError(f"{model_dir}: a reward model ({score}), not a language model; a policy starts from a "
                         f"*ForCausalLM directory")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing; pass --tokenizer (the tokenizer.json the model was trained with)")
    return Tokenizer.from_file(path, eos_token or None, pad_token or None, chat_template, date_string or None)


def score_architecture(model_dir: str) -> str:
    """The *ForSequenceClassification architecture a model directory's config.json names ('' for anything else,
    an unreadable config included: reading the model reports that)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return ""
    return next((a for a in archs if isinstance(a, str) and a.endswith("ForSequenceClassification")), "")


def check_vocab(tok, cfg, where: str):
    """Stop with one line if the tokenizer makes ids the model has no embedding for (a tokenizer.json from
    another model): an id >= vocab_size would index past wte (an IndexError on CPU, a device assert on
    CUDA) long after start-up. A pad id outside the tokenizer's vocabulary is fine: the model masks it.
    When `where` is the model's directory and holds a tokenizer.json, that must be the same tokenizer
    (tokenizer.mismatch): a model trained with another tokenizer of the same size reads every id as another
    token, silently."""
    if tok.vocab_size > cfg.vocab_size:
        fail(f"{where}: the tokenizer has {tok.vocab_size} tokens but the model's vocabulary only "
             f"{cfg.vocab_size}; pass the tokenizer.json the model was trained with (--tokenizer)")
    if where and os.path.isdir(where):       # a model directory: the same size is not the same tokenizer
        from .tokenizer import mismatch
        msg = mismatch(tok, where)
        if msg:
            fail(msg)


def load_reference(ref_dir: str, tok, length: int, what: str):
    """A frozen reference policy (no dropout, no gradient, eval mode) read with the tokenizer's vocabulary checked
    and room for `length` tokens; `what` names that length in the error (e.g. "policy's 1024")."""
    ref = GPT.from_pretrained(ref_dir, dropout=0.0).requires_grad_(False).eval()
    check_vocab(tok, ref.cfg, ref_dir)
    if ref.cfg.block_size < length:
        raise ValueError(f"{ref_dir}: the reference's block_size {ref.cfg.block_size} is smaller than the {what}")
    return ref


def check_output_file(flag, path, input_files=(), input_dirs=()):
    """One line, before any work, if writing `path` would destroy an input: the same file as one of input_files
    (compared after resolving links, so a symlink to the prompts counts), or a file of a run in one of
    input_dirs (model directories: their weights, config, tokenizer, metrics, samples, state), or any file in a
    training run's state directory (a tool never writes what --resume reads). A missing or unwritable directory
    is refused too."""
    if os.path.isdir(path):
        fail(f"{flag} {path}: is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        fail(f"{flag} {path}: cannot be written (its directory {folder} does not exist or is not writable)")
    target = os.path.realpath(path)
    folder_files = set(os.listdir(os.path.dirname(target)))
    if {"meta.json", "run.json"} & folder_files and any(n.startswith("rng_rank") for n in folder_files):
        fail(f"{flag} {path}: is inside a training run's state directory (what --resume reads); write elsewhere")
    for f in input_files:
        if f and os.path.exists(f) and os.path.realpath(f) == target:
            fail(f"{flag} {path}: is an input of this command ({f}); write elsewhere")
    for d in input_dirs:
        if d and os.path.isdir(d) and os.path.dirname(target) == os.path.realpath(d):
            name = os.path.basename(target)
            if name in RUN_FILES or name.endswith((".safetensors", ".json", ".jsonl")) and os.path.exists(target):
                fail(f"{flag} {path}: would replace {name} of the model directory {d}; write elsewhere")


def check_device(device: str):
    """--device must name something this machine has: one line otherwise (before any work)."""
    bad = dist.device_problem(device)
    if bad:
        fail(bad, 2)


def derive_max_steps(opts, steps_per_epoch):
    """--max_steps, or (when it is 0) as many steps as --epochs takes; a warning when the run is shorter than
    its warm-up (a small data set at --epochs 1: the learning rate would never reach --lr; a reward model on a
    one-word preference was measured to stay at 0.67-0.80 held-out accuracy after 9 such steps)."""
    max_steps = opts.max_steps or max(1, int(opts.epochs * steps_per_epoch))
    warn_short_warmup(max_steps, opts.warmup_steps, "raise --epochs or --max_steps")
    return max_steps


def warn_short_warmup(max_steps, warmup_steps, fix="raise --max_steps"):
    """One warning (rank 0) when the run ends before its warm-up does: the learning rate never reaches --lr."""
    if max_steps < warmup_steps and dist.world().is_main:
        print(f"warning: this run is {max_steps} optimizer steps, fewer than --warmup_steps {warmup_steps}, so "
              f"the learning rate never reaches --lr; {fix}, or lower --warmup_steps", file=sys.stderr, flush=True)



def train_eval_records(opts, kind):
    """(train records, eval records, training file, eval file description) of a data kind ("sft",
    "preference"): --data and --eval_data, else the built-in task's files; with --data and no --eval_data,
    --eval_fraction of it is split off (seeded). Every line is validated here, before anything is written or
    built: a bad line is one line and exit 1 (train_sft.py and train_rm.py read their data so, before the run
    opens)."""
    with input_errors():
        data_path = opts.data or default_data(kind)
        eval_path = opts.eval_data or ("" if opts.data else default_data(kind, "eval"))
        records, eval_records = load_train_eval(kind, data=data_path, eval_data=eval_path,
                                                eval_fraction=opts.eval_fraction, seed=opts.seed)
    return records, eval_records, data_path, eval_path or f"the --eval_fraction split of {data_path}"


def tokenizer(opts, run, made=None, policy=True):
    """The tokenizer --tokenizer names (else --init's tokenizer.json), with --eos_token, --pad_token,
    --chat_template and --date_string applied, or `made`, one the script made itself (train_sft.py trains one on
    its data when neither is given); policy=False lets --init be a reward model (train_rm.py). What it resolved
    ("auto" to a template, an empty --date_string to a date) enters the run's identity: a --resume must render
    the data to the same tokens."""
    if made is not None:
        tok = made
    else:
        tok = load_tokenizer(opts.tokenizer, getattr(opts, "init", ""), opts.eos_token, opts.pad_token,
                             opts.chat_template, opts.date_string, policy)
    run.identity.update(chat_template=tok.chat_template, date_string=tok.date_string)
    return tok


def place(opts, world, trained, frozen=None):
    """The run's models on this rank's device, each the same on every rank (checked: DDP would average the
    gradients of different models), then every RNG seeded for this rank (from here on ranks differ: dropout,
    sampling). trained / frozen: {name (as errors print it): model or None}; --grad_checkpoint applies to the
    trained ones (the frozen ones run without gradients: nothing to recompute)."""
    for m in trained.values():
        if m is not None and opts.grad_checkpoint:
            m.set_grad_checkpointing(True)
    models = {k: m for k, m in {**trained, **(frozen or {})}.items() if m is not None}
    for m in models.values():
        m.to(world.device)
    for name, m in models.items():
        dist.check_same_weights(m, name)
    dist.seed_everything(opts.seed, world.rank)


def prepare(opts, model, lr):
    """A trained model ready to train -> (what its forward/backward go through, its optimizer): torch.compile'd
    with --compile, sharded with --fsdp under torchrun (FSDP2), else DDP under torchrun, else the model itself;
    AdamW (weight decay on matrices only) at peak learning rate lr with the script's --weight_decay, --beta1,
    --beta2 and --adam_eps where it has them (else 0.9, 0.95, 1e-8), built after the sharding. The model itself
    stays what is saved and evaluated."""
    wrapped = parallel.wrap(torch.compile(model) if getattr(opts, "compile", False) else model, opts.fsdp,
                            dtype=opts.dtype)
    betas = (getattr(opts, "beta1", 0.9), getattr(opts, "beta2", 0.95))
    return wrapped, adamw(model, lr, opts.weight_decay, betas, eps=getattr(opts, "adam_eps", 1e-8))


@dataclass
class Learner:
    """A trained model: the bare module (what is saved), what its forward/backward go through (DDP / FSDP, or the
    module itself in one process: prepare) and its optimizer."""
    model: torch.nn.Module
    wrapped: torch.nn.Module
    opt: torch.optim.Optimizer

    @classmethod
    def of(cls, model, lr, opts):
        return cls(model, *prepare(opts, model, lr))

    def step(self, grad_clip):
        """Clip the gradient norm (0 = off), step unless the norm is not finite (step_if_finite: decided on the
        device), zero the gradients; returns the pre-clip norm, a float64 0-dim tensor on the device (no read)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = parallel.clipped_grad_norm(params, grad_clip)
        step_if_finite(self.opt, norm.isfinite())
        self.opt.zero_grad(set_to_none=True)
        return norm.double()


def frozen(opts, model):
    """A frozen model (a reference, a reward model) placed by --fsdp / --frozen / --offload_frozen; None and
    LoRA's adapters-off view of the policy pass through. Its checksum is taken for finish()'s check."""
    return parallel.prepare_frozen(model, opts.fsdp, getattr(opts, "frozen", "shard"),
                                   getattr(opts, "offload_frozen", False), opts.dtype)


def plan(opts, models):
    """Print (rank 0) the memory plan of the run's live models {name: model or None}; the first one is the
    trained model whose sharding names the strategy."""
    first = next(m for m in models.values() if m is not None)
    strategy = "fsdp" if parallel.is_sharded(first) else "ddp"
    if hasattr(opts, "frozen"):
        dist.print0(parallel.startup_plan(models, strategy, opts.frozen, opts.offload_frozen))
    else:
        dist.print0(parallel.startup_plan(models, strategy))
