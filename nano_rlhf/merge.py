"""Merge models fine-tuned from one base: task arithmetic and TIES, for PAFT.

PAFT (Pentyala et al. 2024, "PAFT: A Parallel Training Paradigm for Effective LLM Fine-Tuning") trains SFT
and preference optimisation (DPO, ...) in parallel from the same base model instead of one after the
other, then merges the two. Both merges work on task vectors, what fine-tuning added to the base:

    tau_i = theta_i - theta_base
    task arithmetic (Ilharco et al. 2023):  theta = theta_base + sum_i w_i tau_i
    TIES (Yadav et al. 2023, "TIES-Merging"):
      1. trim:  keep the top-`density` fraction of each tau_i by magnitude (per tensor), zero the rest
      2. elect: gamma = sign(sum_i w_i trim(tau_i)), one sign per parameter
      3. disjoint mean: merged = sum_{i in A} w_i trim(tau_i) / sum_{i in A} w_i,  A = {i: sign(trim(tau_i)) = gamma}
                (only models whose kept entry agrees with the elected sign; 0 where none does)
      theta = theta_base + scale * merged

Choices where the paper leaves room (each tested against a float64 reference written from this text):
- Trim count k = max(1, floor(density * n + 1/2)) for a tensor of n entries (nearest integer, halves up);
  every entry whose magnitude is >= the k-th largest is kept, so ties at the threshold are all kept and
  the result does not depend on the order of the entries.
- Weights enter TIES as copies would: a model with weight 2 counts like two copies of it, in the sign
  election and in the mean (the paper has no weights; with equal weights this is the paper's rule). TIES
  weights must be positive; task arithmetic accepts any (a negative weight subtracts a task).
- Everything is computed in float64 and rounded once to the base's dtype. Tensors that are not floating
  point are copied from the base.

Usage:
    python -m nano_rlhf.merge --base out/base --models out/sft out/dpo --method ties --density 0.2 --out_dir out/paft
    python -m nano_rlhf.merge --base out/base --models out/sft out/dpo --weights 0.5 0.5 --method task_arithmetic \
        --out_dir out/avg

The output is written with the base's class (policy or reward model) as an HF directory plus the base's
tokenizer files (else the first model's) and merge_config.json (the options). Every input and option is checked,
and the models are loaded and merged, before anything in --out_dir is touched. --out_dir may not be, hold or lie
inside an input model; the models must share one tokenizer (nano_rlhf.tokenizer.mismatch). The merge holds
--out_dir's lock (the one a training run holds: checkpoint.OutDirLock), so it is refused while a run writes there
and no run starts there while it writes. The files are built in OUT/.merge.tmp.*, then the previous ones of those
names (a training run's or a merge's; with --overwrite) are moved aside, the new ones moved in, and the previous
ones deleted; anything else in --out_dir is left alone.
"""
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from . import tokenizer as tokenizer_mod
from .checkpoint import RUN_FILES, OutDirLock
from .cli import parse_args
from .model import GPT, ScoreModel, non_finite
from .training import fail

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# What a merge writes into --out_dir; with the files of a training run, what --overwrite replaces (and nothing else)
MERGE_FILES = ("config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES, "merge_config.json")
REPLACED = tuple(dict.fromkeys(RUN_FILES + MERGE_FILES))


# ---- the merges: pure functions on state dicts ---------------------------------------------------

def _check_keys(base_sd, sds, weights):
    if len(sds) != len(weights):
        raise ValueError(f"{len(sds)} models but {len(weights)} weights")
    for i, sd in enumerate(sds):
        if sd.keys() != base_sd.keys():
            extra, missing = sorted(sd.keys() - base_sd.keys()), sorted(base_sd.keys() - sd.keys())
            raise ValueError(f"model {i}: keys differ from the base (missing {missing[:3]}, extra {extra[:3]})")
        for k, v in sd.items():
            if v.shape != base_sd[k].shape:
                raise ValueError(f"model {i}: {k} has shape {tuple(v.shape)}, the base {tuple(base_sd[k].shape)}")


def task_arithmetic(base_sd, sds, weights):
    """theta_base + sum_i w_i (theta_i - theta_base), per tensor, in float64 -> the base's dtype."""
    _check_keys(base_sd, sds, weights)
    out = {}
    for k, b in base_sd.items():
        if not b.is_floating_point():
            out[k] = b.clone()
            continue
        b64 = b.double()
        acc = b64.clone()
        for sd, w in zip(sds, weights):
            acc += float(w) * (sd[k].double() - b64)
        out[k] = acc.to(b.dtype)
    return out


def trim(tau, density):
    """Zero all but the top-`density` fraction of entries by magnitude; ties at the threshold are kept."""
    n = tau.numel()
    k = max(1, math.floor(density * n + 0.5))
    if k >= n:
        return tau.clone()
    mag = tau.abs().flatten()
    threshold = torch.kthvalue(mag, n - k + 1).values       # the k-th largest magnitude
    return torch.where(tau.abs() >= threshold, tau, torch.zeros_like(tau))


def ties_tensor(base, thetas, weights, density, scale=1.0):
    """TIES on one tensor, float64: trim, elect a sign, disjoint weighted mean; base + scale * merged."""
    b = base.double()
    kept = [float(w) * trim(t.double() - b, density) for t, w in zip(thetas, weights)]   # w_i trim(tau_i)
    elected = torch.sign(sum(kept))
    num, den = torch.zeros_like(b), torch.zeros_like(b)
    for wt, w in zip(kept, weights):
        agree = (torch.sign(wt) == elected) & (wt != 0)        # a trimmed (zero) entry never votes
        num += torch.where(agree, wt, 0.0)
        den += agree.double() * float(w)     # (torch.where with two scalars would round w to float32)
    merged = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)   # 0 where no model agrees
    return b + scale * merged


def ties_merge(base_sd, sds, weights, density, scale=1.0):
    """TIES-merging of state dicts (see the module docstring), each tensor rounded once to the base's dtype."""
    _check_keys(base_sd, sds, weights)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if any(w <= 0 for w in weights):
        raise ValueError(f"TIES weights must be > 0, got {list(weights)}")
    out = {}
    for k, b in base_sd.items():
        if not b.is_floating_point():
            out[k] = b.clone()
            continue
        out[k] = ties_tensor(b, [sd[k] for sd in sds], weights, density, scale).to(b.dtype)
    return out


# ---- directories ----------------------------------------------------------------------------------

def model_class(model_dir):
    """GPT for a language model directory, ScoreModel for a reward model / critic (HF's architectures)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing (not a model directory)")
    with open(path) as f:
        archs = json.load(f).get("architectures") or []
    return ScoreModel if any(a.endswith("ForSequenceClassification") for a in archs) else GPT


def _config_dict(model):
    cfg = model.cfg
    d = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))
    d.pop("dropout", None)          # a training option, not the architecture (HF GPT-2 ships 0.1, ours 0.0)
    for k in ("generation", "eos_token_ids", "pad_token_id", "eos_token_id", "bos_token_id"):
        d.pop(k, None)              # token ids and generation defaults: an export restates them, the weights agree
    return d


def load_models(base_dir, model_dirs):
    """-> (base model, [state dicts of the models]); every model must have the base's class, config and
    shapes, else a ValueError naming the directory and what differs."""
    cls = model_class(base_dir)
    base = cls.from_pretrained(base_dir)
    base_cfg, base_sd = _config_dict(base), base.state_dict()
    sds = []
    for d in model_dirs:
        if model_class(d) is not cls:
            raise ValueError(f"{d}: a {model_class(d).__name__} directory, but the base {base_dir} is a {cls.__name__}")
        m = cls.from_pretrained(d)
        cfg = _config_dict(m)
        diff = [k for k in sorted(set(cfg) | set(base_cfg)) if cfg.get(k) != base_cfg.get(k)]
        if diff:
            k = diff[0]
            raise ValueError(f"{d}: config {k}={cfg.get(k)!r} differs from the base's {base_cfg.get(k)!r}")
        sd = m.state_dict()
        for k, v in sd.items():
            if k not in base_sd or v.shape != base_sd[k].shape:
                want = tuple(base_sd[k].shape) if k in base_sd else "absent"
                raise ValueError(f"{d}: {k} has shape {tuple(v.shape)}, the base's is {want}")
        missing = sorted(base_sd.keys() - sd.keys())
        if missing:
            raise ValueError(f"{d}: {missing[0]} is missing (present in the base)")
        sds.append(sd)
    return base, sds


def check_tokenizers(model_dirs):
    """One tokenizer for every model that ships one (a merge adds weights that index the same ids): a ValueError
    naming the first directory whose tokenizer.json differs from the first one's."""
    dirs = [d for d in model_dirs if os.path.isfile(os.path.join(d, "tokenizer.json"))]
    for d in dirs[1:]:
        msg = tokenizer_mod.mismatch(os.path.join(dirs[0], "tokenizer.json"), d)
        if msg:
            raise ValueError(msg)


def _entries(out_dir):
    """What out_dir holds, but the lock file (a killed run's stale .lock is no content)."""
    return sorted(n for n in os.listdir(out_dir) if n != ".lock")


def write_merged(base, merged_sd, out_dir, tokenizer_dirs, options, overwrite=False):
    """Save the merged model with the base's class + tokenizer files into out_dir (whose lock the caller holds):
    built in out_dir/.merge.tmp.*, then the previous files of the names a run or a merge writes moved aside, the
    new ones moved in, the previous ones deleted. A failure before the last step puts the previous files back."""
    bad = non_finite(merged_sd)
    if bad:      # weights and --scale are finite alone, their products need not be (1e308 x 1e308)
        raise ValueError(f"the merged model holds non-finite values in {len(bad)} of {len(merged_sd)} tensors "
                         f"(first: {bad[0]}): --weights / --scale overflow float32; nothing written")
    present = _entries(out_dir)
    if present and not overwrite:                   # checked up front too; a race must not lose data
        raise ValueError(f"--out_dir {out_dir} is not empty (pass --overwrite to replace it)")
    stale = [n for n in present if n.startswith((".overwritten.", ".merge.tmp."))]
    if stale:
        print(f"warning: {out_dir} holds {', '.join(stale)}: left by a run or merge that was killed while replacing "
              "files (the previous files are in .overwritten.*); move them back or delete them", flush=True)
    tmp = tempfile.mkdtemp(prefix=".merge.tmp.", dir=out_dir)
    aside, moved_in = None, []
    try:
        base.load_state_dict(merged_sd)
        base.save_pretrained(tmp)            # a reward model's reward_mean/std do not carry over to a merge
        for name in TOKENIZER_FILES:
            src = next((os.path.join(d, name) for d in tokenizer_dirs if os.path.isfile(os.path.join(d, name))), None)
            if src is not None:
                shutil.copyfile(src, os.path.join(tmp, name))
        with open(os.path.join(tmp, "merge_config.json"), "w") as f:
            f.write(json.dumps(options, indent=2) + "\n")
        old = [n for n in REPLACED if os.path.lexists(os.path.join(out_dir, n))]
        if old:
            aside = tempfile.mkdtemp(prefix=".overwritten.", dir=out_dir)
            for name in old:
                os.replace(os.path.join(out_dir, name), os.path.join(aside, name))
        for name in sorted(os.listdir(tmp)):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
            moved_in.append(name)
    except BaseException:
        for name in moved_in:                # undo: the new files out, the previous ones back
            os.remove(os.path.join(out_dir, name))
        if aside is not None:
            for name in os.listdir(aside):
                os.replace(os.path.join(aside, name), os.path.join(out_dir, name))
            os.rmdir(aside)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if aside is not None:
        shutil.rmtree(aside)


@dataclass
class Options:
    base: str                     # the model every --models entry was fine-tuned from
    models: list[str]             # fine-tuned model directories to merge
    method: Literal["task_arithmetic", "ties"]  # task_arithmetic: base + Σ w_i τ_i; ties: trim, elect a sign,
                                                # disjoint mean (the module docstring)
    out_dir: str                  # where the merged model is written
    weights: Optional[list[float]] = None  # one weight per model (ties: each > 0); none = all 1
    density: float = 0.2          # ties: the fraction of each task vector kept [with method=ties] {0 < x <= 1}
    scale: float = 1.0            # ties: λ, the merged task vector's scale (scale --weights for task arithmetic)
                                  # [with method=ties]
    overwrite: bool = False       # replace the model (and a training run's files) in a non-empty --out_dir; other
                                  # files are kept


def parse_merge_args(argv=None):
    """The command line as Options: ranges and the options given where they do not apply refused by the parser
    (their comments), the rules between --weights and the other options here; each one line, exit 2."""
    a = parse_args(Options, argv, __doc__.split("\n\n")[0], prog="python -m nano_rlhf.merge")
    if a.weights is None:
        a.weights = [1.0] * len(a.models)
    if len(a.weights) != len(a.models):
        fail(f"--weights has {len(a.weights)} values for {len(a.models)} --models", 2)
    if a.method == "ties" and any(w <= 0 for w in a.weights):
        fail(f"--weights must be > 0 for ties, got {a.weights}", 2)
    return a


def check_args(a):
    """Every input and output path, before any model is loaded: a ValueError (one line, exit 1) otherwise."""
    inputs = [("--base", a.base)] + [("--models", d) for d in a.models]
    for flag, d in inputs:
        if not os.path.isdir(d):
            raise FileNotFoundError(f"{d}: no such model directory")
    if os.path.exists(a.out_dir) and not os.path.isdir(a.out_dir):
        raise ValueError(f"--out_dir {a.out_dir} is a file")
    out = os.path.realpath(a.out_dir)
    for flag, d in inputs:               # links resolved: --overwrite must never replace or hold an input
        real = os.path.realpath(d)
        if real == out:
            raise ValueError(f"--out_dir {a.out_dir} is the input {flag} {d}; choose another --out_dir")
        if _inside(real, out):
            raise ValueError(f"--out_dir {a.out_dir} holds the input {flag} {d}; choose another --out_dir")
        if _inside(out, real):
            raise ValueError(f"--out_dir {a.out_dir} is inside the input {flag} {d}; choose another --out_dir")
    if os.path.isdir(a.out_dir) and _entries(a.out_dir) and not a.overwrite:
        raise ValueError(f"--out_dir {a.out_dir} is not empty (pass --overwrite to replace it)")


def _inside(path, parent):
    return path.startswith(parent.rstrip(os.sep) + os.sep)


def take_out_dir(out_dir):
    """Create out_dir if needed and take its lock (a training run's there refuses us, and ours refuses a run);
    -> (lock, the top directory this created or None). A ValueError if a run holds it."""
    created = None
    if not os.path.isdir(out_dir):
        created = os.path.abspath(out_dir)
        while not os.path.exists(os.path.dirname(created)):
            created = os.path.dirname(created)
        try:
            os.makedirs(out_dir)
        except OSError as e:
            raise ValueError(f"--out_dir {out_dir}: cannot be created ({e.strerror or e})") from None
    lock = OutDirLock(out_dir)
    msg = lock.acquire()
    if msg:
        remove_created(out_dir, created)
        raise ValueError(msg)
    return lock, created


def remove_created(out_dir, created):
    """A merge that wrote nothing: out_dir goes, and the parents it created unless something else is in them."""
    if created is None:
        return
    shutil.rmtree(out_dir, ignore_errors=True)
    d = os.path.dirname(os.path.abspath(out_dir))
    while len(d) >= len(created) and os.path.isdir(d) and not os.listdir(d):
        os.rmdir(d)
        d = os.path.dirname(d)


def main(argv=None):
    a = parse_merge_args(argv)
    lock = created = None
    try:
        check_args(a)
        lock, created = take_out_dir(a.out_dir)
        check_tokenizers([a.base] + a.models)
        base, sds = load_models(a.base, a.models)
        if a.method == "ties":
            merged = ties_merge(base.state_dict(), sds, a.weights, a.density, a.scale)
        else:
            merged = task_arithmetic(base.state_dict(), sds, a.weights)
        options = {"method": a.method, "base": a.base, "models": a.models, "weights": a.weights}
        if a.method == "ties":
            options.update(density=a.density, scale=a.scale)
        write_merged(base, merged, a.out_dir, [a.base] + a.models, options, a.overwrite)
        created = None                   # written: the directory stays
    except (ValueError, OSError) as e:     # a bad input, or a full / unwritable disk: one line, nothing lost
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        if lock is not None:
            lock.release()
        remove_created(a.out_dir, created)       # failed before writing: what this created goes
    print(f"merged {len(a.models)} models ({a.method}) into {a.out_dir}")


if __name__ == "__main__":
    main()
