"""A training run's life cycle around the loop: out_dir safety, the lock, resume checks, the end of each step
(eval / log / save / stop), and cleaning up after a failed start (what it writes as it goes, metrics and samples
and the --report_to mirror, is in reporting.py). Not algorithm; every script uses it the same way:

    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    run = run_mod.start(opts, script="sft", identity={...}, inputs={"init": opts.init}, data_files={"data": path})
    ... load data and models; run.max_steps = max_steps if derived from --epochs ...
    if opts.resume:
        meta = run.resume(models={"policy": model}, optimizers={"policy": opt})
    for step in range(run.step + 1, run.max_steps + 1):
        ... one optimizer step -> metrics ...
        if run.end_of_step(step, metrics, evaluate=evaluate_fn, save=save_fn):
            break
    run.finish()

Only rank 0 touches the file system; the other ranks only take part in the collectives (a broadcast of rank 0's
verdict, so every rank stops with the same one-line error).

out_dir rules: it may not be (or be inside) an input directory; one holding a run (any of
checkpoint.RUN_FILES) needs --resume or --overwrite. --overwrite first moves those files, and only those, aside
(out_dir/.overwritten.PID) and deletes them at the new run's first save or normal end; a run that fails before
then (a bad --data found after start-up, a crash while loading) puts them back, so nothing is lost to a run that
never produced anything. An input file of the run directly in out_dir under one of those names (--tokenizer
out_dir/tokenizer.json) is refused. A lock (out_dir/.lock, flock) keeps a second run out. A run that ends in an
error before its first save removes what it created (out_dir itself if it created it). --resume compares the
saved identity (state/run.json) with this run's: every option but options.CHANGEABLE must match (an option
added later is compared unless it is declared changeable there), the global batch and what the script resolved
included, the data files' sha256, and the sha256 of every input (checkpoint.input_sha256: a reference, reward
model or judge replaced at the same path would otherwise be taken, and the run go on against another model).
"""
import atexit
import json
import math
import os
import shutil
import sys
import tempfile
import time

from . import checkpoint, dist
from .checkpoint import RUN_FILES, OutDirLock, atomic_write_text, find_state, input_sha256, sha256_file
from .config import to_dict
from .options import CHANGEABLE     # the options a --resume may change; all others are the run's identity
from .reporting import Reporting    # metrics.jsonl, samples.jsonl, the progress line, --report_to

_current = None          # the live Run of this process (fail aborts it)


def fail(msg: str, code: int = 1):
    """Print one clear line to stderr and exit non-zero (all ranks do the same)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    if _current is not None:       # the live Run (if any) releases its lock and undoes a run that saved nothing
        _current.abort()
    several = dist.world().world_size > 1
    dist.cleanup(sync=False)
    if several:                    # the interpreter's finalization can abort a rank (dist._leave_without_finalizing)
        dist.end_process(code)
    sys.exit(code)


def check_finite(value: float, step: int, out_dir: str, what="loss"):
    if not math.isfinite(value):
        fail(f"non-finite {what} ({value}) at step {step}; stopping. The last good checkpoint "
             f"(if any) is in {out_dir}/state and can be resumed with --resume")


def _inside(path, parent):
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


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


class Run(Reporting):
    def __init__(self, opts, script, identity, inputs, data_files, max_steps):
        self.opts, self.out_dir, self.max_steps = opts, opts.out_dir, max_steps
        # every option but CHANGEABLE, then what the script adds (values resolved later: the training length...)
        self.identity = {"script": script, **{k: v for k, v in to_dict(opts).items() if k not in CHANGEABLE},
                         **identity}
        self.inputs = {k: v for k, v in (inputs or {}).items() if v}
        self.data_files = {k: v for k, v in (data_files or {}).items() if v}
        self.step, self.meta = 0, {}
        self.done_step, self.saved_step = 0, None   # the last step finished and the last one saved (Ctrl-C says)
        self.input_sha = {}                         # {input name: sha256}, taken at start (rank 0) before loading
        self.show = ["train/loss", "eval/loss"]     # keys of the progress line, in order
        self.loss_key = "train/loss"                # a non-finite value of it stops the run
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
        if resume and overwrite:
            return "--overwrite and --resume contradict each other: --resume continues the run in --out_dir"
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
            return f"--resume: {out} has no saved state to resume from (no {out}/state/meta.json)"
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
        at the first save, not in start(): the files may be generated after it (the built-in task)."""
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
            return f"--resume: {self.out_dir} has no saved state to resume from (no {self.out_dir}/state/meta.json)"
        path = os.path.join(d, "run.json")
        if not os.path.isfile(path):
            return f"--resume: {path}: missing (a state saved without a run identity cannot be checked)"
        try:
            saved = checkpoint._read_json(path)
            was, now = saved["identity"], json.loads(json.dumps(self.identity))
            diffs = [f"{k} {was.get(k)!r} != {now.get(k)!r}" for k in sorted(set(was) | set(now))
                     if k not in CHANGEABLE and was.get(k) != now.get(k)]
            was_sha, sha = saved["data_sha256"], self._data_sha()
            changed = self._inputs_changed(saved.get("inputs_sha256"), path)
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

    def _inputs_changed(self, was, path):
        """'--ref DIR, ...' naming each input whose sha256 differs from the saved one, or ''. A state saved before
        inputs were checksummed has none: a note says they are not checked."""
        if was is None:
            print(f"note: --resume: {path} records no checksum of the run's inputs (saved by an earlier release); "
                  "they are not checked", flush=True)
            return ""
        if not isinstance(was, dict):
            raise TypeError(f"inputs_sha256 is a {type(was).__name__}")
        now = self.input_sha
        return ", ".join(f"--{k} {self.inputs[k]}" if k in self.inputs else f"--{k} (an input of the saved run only)"
                         for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k))

    def resume(self, models, optimizers, generators=None):
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
        for key in [self.loss_key] if isinstance(self.loss_key, str) else self.loss_key:
            if key in metrics:
                check_finite(float(metrics[key]), step, self.out_dir, key.split("/")[-1].replace("_", " "))
        eval_due = evaluate is not None and self._due(getattr(o, "eval_interval", 0), step)
        if eval_due:
            metrics.update(evaluate())
        if eval_due or self._due(getattr(o, "log_interval", 1), step):
            self.log(step, metrics)
            self._progress(step, metrics)
        stop_at = getattr(o, "stop_at", 0)
        if save is not None and (self._due(getattr(o, "save_interval", 0), step) or step == stop_at):
            save(step)
            self.saved, self.saved_step = True, step
            self._drop_set_aside()
        if step == stop_at and step < self.max_steps:
            dist.print0(f"stopping at step {step} (--stop_at); continue with --resume")
        return step == stop_at or step >= self.max_steps

    # ---- the end -----------------------------------------------------------------------------------
    def finish(self):
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
        """Error exit (common.fail, an exception, an exit without finish()): release the lock and, when
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


def start(opts, script, identity=None, inputs=None, data_files=None, max_steps=None) -> Run:
    """Check --out_dir, take its lock, open --report_to; before any model is loaded. Collective.
    identity: what the script adds to the run's identity (compared on --resume) beyond its options, all of
    which but options.CHANGEABLE are in it already; "script" and "global_batch" (batch_size x grad_accum x
    world_size unless given) are added. inputs: {option name: directory or file} the run
    reads and never writes to; each one's sha256 is recorded and checked by --resume (pass only what is read).
    data_files: {name: path} whose sha256 is recorded at the first save; a path known only later (the
    built-in task, generated on first use) may be set in run.data_files before that. max_steps defaults to
    opts.max_steps; set run.max_steps when the script derives it later (from --epochs)."""
    global _current
    if _current is not None:          # a previous run in this process ended without finish() (tests)
        _current.abort()
    run = Run(opts, script, dict(identity or {}), inputs, data_files,
              getattr(opts, "max_steps", 0) if max_steps is None else max_steps)
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
