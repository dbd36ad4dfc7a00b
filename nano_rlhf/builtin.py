"""The built-in task's door for data: the default file of each data kind, written on first use.

    from nano_rlhf.builtin import default_data
    default_data("preference")            # -> "data/preference.jsonl" (data/ generated with seed 0 if missing)
    default_data("preference", "eval")    # -> "data/preference_eval.jsonl"

Scripts and package modules ask here for their default data and ask nano_rlhf/reward.py for the gold reward
(`builtin_gold`, `load_reward("gold")`); only these two modules name the task itself (nano_rlhf/synthetic.py).
The directory is $NANO_RLHF_DATA, else data/.
"""
import json
import os

from . import dist, synthetic

BUILTIN_DIR = os.environ.get("NANO_RLHF_DATA", "data")

# data kind -> (train file, eval file); no eval file: callers split --eval_fraction off the train file
FILES = {"sft": ("sft.jsonl", "sft_eval.jsonl"), "preference": ("preference.jsonl", "preference_eval.jsonl"),
         "listwise": ("listwise.jsonl", "listwise_eval.jsonl"), "unpaired": ("unpaired.jsonl", None),
         "scored": (synthetic.SCORED_FILE, None), "prompts": ("prompts.jsonl", "eval_prompts.jsonl")}


def default_data(kind: str, split: str = "train"):
    """The built-in file of a data kind (a key of FILES) and split ("train" or "eval"), generated if missing;
    None for an eval split the task does not have. Collective: call it on every rank."""
    if kind not in FILES or split not in ("train", "eval"):
        raise ValueError(f"no built-in {split} data of kind {kind!r}; kinds: {', '.join(FILES)}")
    name = FILES[kind][split == "eval"]
    return builtin_file(name) if name else None


def default_path(kind: str, split: str = "train"):
    """Where default_data(kind, split) is, without generating anything (a run's record of its inputs)."""
    name = FILES[kind][split == "eval"]
    return os.path.join(BUILTIN_DIR, name) if name else None


def builtin_file(name: str) -> str:
    """Path of a built-in task file (data/sft.jsonl, ...), generating data/ with seed 0 on first use, and
    adding a file that a data/ written before it existed lacks (listwise, scored) at that directory's seed."""
    # Only rank 0 looks and writes; then EVERY rank meets at the barrier. If each rank decided by itself
    # whether to wait, a rank starting after rank 0 wrote task.json would skip a barrier the others are in,
    # and every later collective would pair with the wrong call (a hang). Callers call this on all ranks.
    # Two runs on one machine (or one filesystem) are serialised by a file lock in ensure_dataset.
    path = os.path.join(BUILTIN_DIR, name)
    if dist.world().is_main:
        if not os.path.isfile(os.path.join(BUILTIN_DIR, "task.json")):     # written last
            synthetic.ensure_dataset(BUILTIN_DIR, seed=0, note=dist.print0)
        if name in _ADDED_LATER and not os.path.isfile(path):
            with synthetic.generation_lock(BUILTIN_DIR):
                if not os.path.isfile(path):
                    _ADDED_LATER[name](_task_seed())
    dist.barrier()                                                   # a no-op in a single process
    return path


def _task_seed():
    with open(os.path.join(BUILTIN_DIR, "task.json")) as f:
        return json.load(f).get("seed", 0)


def _add_listwise(seed):
    dist.print0(f"writing the built-in listwise files into {BUILTIN_DIR}/ (seed {seed})")
    synthetic.write_listwise(BUILTIN_DIR, seed)


def _add_scored(seed):
    """As write_dataset would have written it: as many rows as unpaired.jsonl, at the directory's seed."""
    with open(os.path.join(BUILTIN_DIR, "unpaired.jsonl"), "rb") as f:
        synthetic.write_scored(BUILTIN_DIR, seed=seed, n=sum(1 for _ in f))


# files added to the task after data/ directories existed: written alone (every other file stays as it is)
_ADDED_LATER = {"listwise.jsonl": _add_listwise, "listwise_eval.jsonl": _add_listwise,
                synthetic.SCORED_FILE: _add_scored}
