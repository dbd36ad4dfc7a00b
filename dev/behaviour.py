"""Record what every training script does on short seeded runs, so that a refactor can be proven not to change it.

    python dev/behaviour.py record before.json            # every run (2-3 minutes on 2 CPU cores)
    python dev/behaviour.py record after.json --only ppo_grpo,dpo_ipo   # some runs (and the inputs they need)
    python dev/behaviour.py compare before.json after.json   # one line per run: same / DIFFERENT; exit 1 on any
    python dev/behaviour.py list                          # the runs and their commands

`record` builds the shared inputs once in a fresh temporary directory (the built-in task's data, a tiny SFT policy,
a tiny reward model: seeded, and recorded as runs themselves, since every other run starts from their bytes), then
runs each configuration of the list below for a few steps: a tiny GPT (2 layers, width 32), CPU, float32, one
thread. Every run is a subprocess through the public command line only (`python train_X.py ...`,
`python -m nano_rlhf.X ...`, from the repository root), so the script works whatever the package's inner layout
is. Each run's output directory is summarised as

    {"command": [...], "returncode": 0, "metrics_sha256": ..., "metrics_lines": N, "files": {path: sha256}}

metrics_sha256 hashes metrics.jsonl with the timing keys (VOLATILE_KEYS) dropped from every line; files hashes
every other file the run wrote (model.safetensors, the checkpoint under state/, samples, configs). The temporary
directory's path is written as $WORK in commands and replaced by $WORK in the files' bytes before hashing
(train_config.json records --out_dir), so records made in different directories compare equal.

Runs that do not depend on each other go --jobs at a time (default 2): each is single-threaded and seeded, so its
bytes do not depend on what runs beside it. `compare` checks command, exit status, metrics and every file; a
difference names what differed. Records are comparable only from the same machine kind and torch version (float
rounding differs between CPU kinds); `record` prints both.

--root names the repository to run (default: the one holding this file, else the current directory), so a copy of
this script outside the repository works on any checkout: `python behaviour.py record a.json --root /path/to/repo`.
"""
import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

# Keys of metrics.jsonl whose values are measured times, found by recording every run twice at the same commit
# (once 2 runs at a time, once one at a time) and comparing the two metrics.jsonl of each run key by key: these
# four were the only keys that differed, and they differed in every run that logs them (the seconds a step, its
# rollout or its tokens took depend on the machine's load, not on the code's behaviour). Every other key, and
# every file a run writes, was byte-identical. (train_ppo.py also logs train/generate_compile_time, a time, but
# only with --compile_rollout, which no run here uses: add it here if a run with that flag is added.)
VOLATILE_KEYS = frozenset({
    "train/tokens_per_s",        # train_sft, train_rm, train_dpo, train_listwise, train_unpaired: throughput
    "train/step_time",           # train_ppo, train_online: seconds of the step
    "train/generate_time",       # train_ppo, train_online: seconds of its sampling
    "time/rollout_frac",         # train_online: generate_time / step_time
})

WORK = "$WORK"            # how the temporary directory is written in records (commands and hashed bytes)
TIMEOUT_S = 600           # one run's limit: a hang is a failed run, not a stuck record

# ---- the runs ------------------------------------------------------------------------------------------------
# Tiny shapes, as tests/conftest.py makes them: 2 layers, 2 heads, width 32, vocabulary 300, context 64.
# The data is small but enough for every script's few steps and its held-out split.
DATA = ["--n_sft", "1000", "--n_pref", "300", "--n_unpaired", "100", "--n_prompts", "64", "--n_eval_prompts", "8",
        "--n_listwise", "60", "--seed", "0"]
# SFT long enough (80 steps) that the policy ends some responses with end-of-text: the RL runs then see both
# finished and cut responses (--overlong, missing_eos_penalty, dynamic sampling's non-constant groups)
SFT = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--vocab_size", "300", "--batch_size", "16",
       "--max_steps", "80", "--warmup_steps", "5", "--log_interval", "1", "--eval_interval", "0", "--seed", "0",
       "--device", "cpu"]
# offline scripts (dpo, unpaired, listwise, rm): 3 logged optimizer steps, then the end-of-run evaluation
OFFLINE = ["--max_steps", "3", "--batch_size", "4", "--warmup_steps", "1", "--log_interval", "1", "--seed", "0",
           "--device", "cpu"]
# sampling scripts (ppo, online): 3 steps of 2 prompts x 4 samples, 24 new tokens, a 4-prompt evaluation at the end
ONLINE = ["--max_steps", "3", "--batch_size", "2", "--samples_per_prompt", "4", "--max_new_tokens", "24",
          "--eval_interval", "0", "--eval_samples", "4", "--seed", "0", "--device", "cpu"]
# --critic_warmup_steps 1 (gae only: a critic-free run refuses the critic's options): the default (5) would leave
# the policy untrained in 3 steps
PPO = ONLINE + ["--critic_warmup_steps", "1"]
GRPO = ONLINE + ["--advantage", "grpo"]


class Run:
    """One command. out: its output directory ($WORK/runs/NAME); needs: runs whose outputs it reads."""

    def __init__(self, name, argv, needs=("data", "sft"), mkdir=False):
        self.name, self.argv, self.needs, self.mkdir = name, argv, tuple(needs), mkdir


def runs():
    """Every run, in order. Paths are under $WORK (replaced by the real directory when run)."""
    d, r = f"{WORK}/runs/data", f"{WORK}/runs"
    sft, rm = f"{r}/sft", f"{r}/rm"
    out = lambda name: ["--out_dir", f"{r}/{name}"]
    py, m = ["python"], ["python", "-m"]
    L = [
        # the shared inputs: the built-in task's data, the SFT policy every other run starts from, the reward model
        Run("data", m + ["nano_rlhf.tasks.synthetic", "--out_dir", d] + DATA, needs=()),
        Run("sft", py + ["train_sft.py", "--data", f"{d}/sft.jsonl", "--eval_data", f"{d}/sft_eval.jsonl"]
            + out("sft") + SFT, needs=("data",)),
        Run("rm", py + ["train_rm.py", "--init", sft, "--data", f"{d}/preference.jsonl", "--eval_data",
                        f"{d}/preference_eval.jsonl"] + out("rm") + OFFLINE + ["--max_steps", "10"]),
        # train_sft.py: packed rows from scratch; a fine-tune from --init (PAFT's SFT arm, merged below)
        Run("sft_packing", py + ["train_sft.py", "--data", f"{d}/sft.jsonl", "--eval_data", f"{d}/sft_eval.jsonl"]
            + out("sft_packing") + SFT + ["--max_steps", "4", "--packing"], needs=("data",)),
        Run("sft_from_init", py + ["train_sft.py", "--init", sft, "--data", f"{d}/sft.jsonl", "--eval_data",
                                   f"{d}/sft_eval.jsonl"] + out("sft_from_init") + OFFLINE),
        # train_rm.py: its loss terms beyond Bradley-Terry (the built-in pairs have no margin field)
        Run("rm_center_l2", py + ["train_rm.py", "--init", sft, "--data", f"{d}/preference.jsonl", "--eval_data",
                                  f"{d}/preference_eval.jsonl"] + out("rm_center_l2") + OFFLINE
            + ["--center_coef", "0.01", "--l2_coef", "0.001"]),
    ]
    # train_dpo.py: every --loss (kto is a redirect to train_unpaired.py, recorded there), then its other paths.
    # robust gets a label smoothing: with none it is dpo itself
    for loss in ("dpo", "robust", "ipo", "hinge", "rdpo", "simpo", "cpo", "orpo", "tdpo"):
        extra = ["--label_smoothing", "0.1"] if loss == "robust" else []
        L.append(Run(f"dpo_{loss}", py + ["train_dpo.py", "--loss", loss, "--init", sft] + out(f"dpo_{loss}")
                     + OFFLINE + extra))
    listwise = ["--data", f"{d}/listwise.jsonl", "--eval_data", f"{d}/listwise_eval.jsonl"]
    L += [
        Run("dpo_cdpo", py + ["train_dpo.py", "--init", sft, "--label_smoothing", "0.1"] + out("dpo_cdpo") + OFFLINE),
        Run("dpo_precompute_ref", py + ["train_dpo.py", "--init", sft, "--precompute_ref"] + out("dpo_precompute_ref")
            + OFFLINE),
        Run("dpo_rpo_l1", py + ["train_dpo.py", "--init", sft, "--nll_coef", "0.5", "--l1_coef", "1e-4"]
            + out("dpo_rpo_l1") + OFFLINE),
        Run("dpo_listwise_all", py + ["train_dpo.py", "--init", sft] + listwise + ["--listwise_pairs", "all"]
            + out("dpo_listwise_all") + OFFLINE),
        Run("dpo_listwise_best_worst", py + ["train_dpo.py", "--init", sft] + listwise
            + ["--listwise_pairs", "best_worst"] + out("dpo_listwise_best_worst") + OFFLINE),
    ]
    # train_unpaired.py: every --method, NPO with retain data, KTO with precomputed reference log-probs
    unpaired = {"kto": [], "npo": [], "d2o": ["--num_samples", "2", "--max_new_tokens", "16"], "dro": [],
                "npo_retain": ["--retain_coef", "1"], "kto_precompute_ref": ["--precompute_ref"]}
    for name, extra in unpaired.items():
        L.append(Run(f"unpaired_{name}", py + ["train_unpaired.py", "--method", name.split("_")[0], "--init", sft]
                     + out(f"unpaired_{name}") + OFFLINE + extra))
    # train_listwise.py: every --loss, 2 prompts (x 4 ranked completions) a step
    for loss in ("rrhf", "pro", "lipo"):
        L.append(Run(f"listwise_{loss}", py + ["train_listwise.py", "--loss", loss, "--init", sft]
                     + out(f"listwise_{loss}") + OFFLINE + ["--batch_size", "2"]))
    # train_online.py: every --method against the reward-model judge (dno, sppo refresh their reference once),
    # then hard labels on best-vs-worst pairs, and the gold judge
    online = {"dpo": ("online_dpo", rm, []), "dno": ("dno", rm, ["--ref_update_every", "2"]),
              "sppo": ("sppo", rm, ["--ref_update_every", "2"]),
              "nash_md": ("nash_md", rm, ["--samples_per_prompt", "2"]), "cringe": ("cringe", rm, []),
              "dpo_hard_best_worst": ("online_dpo", rm, ["--labels", "hard", "--pairs", "best_worst"]),
              "dpo_gold": ("online_dpo", "gold", [])}
    for name, (method, judge, extra) in online.items():
        L.append(Run(f"online_{name}", py + ["train_online.py", "--method", method, "--judge", judge, "--init", sft]
                     + out(f"online_{name}") + ONLINE + extra, needs=("data", "sft", "rm")))
    # train_ppo.py: every --advantage; every --policy_loss and --loss_agg (on GRPO: no critic, cheaper; each
    # loss_agg where it is not the estimator's auto, dual_clip with a cap low enough to bite in 3 steps); DAPO's
    # dynamic sampling (gold reward, 2 samples a prompt: groups with no spread occur, are dropped, resampled, and
    # once fill the batch after the last round) and both --overlong treatments; both --rollout_correction kinds
    # (on a bfloat16 sampler, the mismatch they correct, with caps low enough that some tokens / sequences hit
    # them); then the KL in the loss, the adaptive KL, SPO (self-play judge) and PPO-ptx
    ppo = {"gae": PPO, "rloo": ONLINE + ["--advantage", "rloo"], "grpo": GRPO,
           "dr_grpo": ONLINE + ["--advantage", "dr_grpo"], "reinforce_pp": ONLINE + ["--advantage", "reinforce_pp"],
           "grpo_dual_clip": GRPO + ["--policy_loss", "dual_clip", "--dual_clip", "1.01"],
           "grpo_gspo": GRPO + ["--policy_loss", "gspo", "--clip_eps", "3e-4", "--clip_high", "4e-4"],
           "grpo_cispo": GRPO + ["--policy_loss", "cispo"],
           "dr_grpo_token_mean": ONLINE + ["--advantage", "dr_grpo", "--loss_agg", "token_mean"],
           "grpo_seq_mean_token_mean": GRPO + ["--loss_agg", "seq_mean_token_mean"],
           "grpo_seq_mean_token_sum_norm": GRPO + ["--loss_agg", "seq_mean_token_sum_norm"],
           "grpo_dynamic_sampling": GRPO + ["--reward", "gold", "--samples_per_prompt", "2", "--dynamic_sampling"],
           "grpo_overlong_mask": GRPO + ["--overlong", "mask", "--missing_eos_penalty", "none"],
           "grpo_overlong_penalty": GRPO + ["--overlong", "penalty", "--missing_eos_penalty", "none"],
           "grpo_tis": GRPO + ["--rollout_dtype", "bfloat16", "--rollout_correction", "tis", "--correction_cap",
                               "1.003"],
           "grpo_mask_sequence": GRPO + ["--rollout_dtype", "bfloat16", "--rollout_correction", "mask",
                                         "--correction_level", "sequence", "--correction_cap", "1.01"],
           "grpo_kl_in_loss": GRPO + ["--kl_in_loss"],
           "gae_adaptive_kl": PPO + ["--adaptive_kl"],
           "spo": GRPO + ["--reward", "selfplay", "--judge", rm],
           "gae_ptx": PPO + ["--ptx_data", f"{d}/sft.jsonl", "--ptx_coef", "0.1", "--ptx_batch_size", "4"]}
    for name, extra in ppo.items():
        L.append(Run(f"ppo_{name}", py + ["train_ppo.py", "--init", sft, "--reward_model", rm] + out(f"ppo_{name}")
                     + extra, needs=("data", "sft", "rm")))
    # train_ppo_lagrangian.py: the built-in task's gold cost as a function (under GAE, a cost critic from the
    # policy; under GRPO, none) with a limit every cost is over (λ rises, to --lambda_max), and a cost model trained
    # on the task's harm pairs (the cost critic from it; λ waits a step)
    harm = f"{r}/data_harm"
    gold_cost = ["--cost", "nano_rlhf.reward:gold_cost", "--cost_limit", "-1", "--lambda_lr", "0.5"]
    L += [Run("data_harm", m + ["nano_rlhf.tasks.synthetic", "--out_dir", harm, "--harm"] + DATA, needs=()),
          Run("cm", py + ["train_rm.py", "--objective", "cost", "--l2_coef", "0.01", "--init", sft, "--data",
                          f"{harm}/preference.jsonl", "--eval_data", f"{harm}/preference_eval.jsonl"] + out("cm")
              + OFFLINE + ["--max_steps", "10"], needs=("data_harm", "sft"))]
    lagrangian = {"gae": (PPO + gold_cost, ()), "grpo": (GRPO + gold_cost, ()),
                  "gae_cost_model": (PPO + ["--cost_model", f"{r}/cm", "--lambda_delay", "1"], ("cm",))}
    for name, (extra, needs) in lagrangian.items():
        L.append(Run(f"ppo_lagrangian_{name}", py + ["train_ppo_lagrangian.py", "--init", sft, "--reward_model", rm]
                     + out(f"ppo_lagrangian_{name}") + extra, needs=("data", "sft", "rm", *needs)))
    # the package's other command lines on the runs' outputs: merging (PAFT), evaluation, RLAIF labelling.
    # evaluate takes one model per run here: with several it writes into each model's own directory (--out
    # takes one), and the SFT policy's samples are the PPO policy's baseline for the win rate
    evaluate = lambda name: ["--ref", sft, "--reward_model", rm, "--prompts", f"{d}/eval_prompts.jsonl",
                             "--max_new_tokens", "24", "--out", f"{r}/{name}/samples.jsonl",
                             "--summary", f"{r}/{name}/summary.json", "--device", "cpu"]
    L += [
        Run("merge_ties", m + ["nano_rlhf.merge", "--base", sft, "--models", f"{r}/sft_from_init",
                               f"{r}/dpo_rpo_l1", "--method", "ties"] + out("merge_ties"),
            needs=("sft", "sft_from_init", "dpo_rpo_l1")),
        Run("evaluate_sft", m + ["nano_rlhf.evaluate", "--model", sft] + evaluate("evaluate_sft"),
            needs=("data", "sft", "rm"), mkdir=True),
        Run("evaluate_ppo_gae", m + ["nano_rlhf.evaluate", "--model", f"{r}/ppo_gae", "--baseline",
                                     f"{r}/evaluate_sft/samples.jsonl"] + evaluate("evaluate_ppo_gae"),
            needs=("data", "sft", "rm", "ppo_gae", "evaluate_sft"), mkdir=True),
        Run("label_pairs", m + ["nano_rlhf.label", "--model", sft, "--judge", rm, "--format", "pairs",
                                "--max_prompts", "8", "--max_new_tokens", "24", "--out",
                                f"{r}/label_pairs/pairs.jsonl", "--device", "cpu"],
            needs=("data", "sft", "rm"), mkdir=True),
    ]
    names = [x.name for x in L]
    assert len(set(names)) == len(names), "duplicate run names"
    return L


# ---- hashing ---------------------------------------------------------------------------------------------------

def metrics_digest(path):
    """(sha256, lines) of metrics.jsonl with VOLATILE_KEYS dropped from every line (key order kept: it is the
    file's); (None, 0) when the run wrote none."""
    if not os.path.isfile(path):
        return None, 0
    h, n = hashlib.sha256(), 0
    with open(path) as f:
        for line in f:
            row = {k: v for k, v in json.loads(line).items() if k not in VOLATILE_KEYS}
            h.update((json.dumps(row) + "\n").encode())
            n += 1
    return h.hexdigest(), n


def files_digest(out, work):
    """{relative path: sha256} of every file under out but metrics.jsonl (hashed above without its timings),
    with the work directory's path replaced by $WORK in the bytes."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(out):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, out)
            if rel == "metrics.jsonl":
                continue
            with open(path, "rb") as f:
                data = f.read().replace(work.encode(), WORK.encode())
            found[rel] = hashlib.sha256(data).hexdigest()
    return found


# ---- record ----------------------------------------------------------------------------------------------------

def default_root():
    """The repository holding this file, else the current directory (a copy of this script outside a checkout)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return here if os.path.isfile(os.path.join(here, "train_ppo.py")) else os.getcwd()


def subprocess_env(work, root):
    """One thread everywhere (results must not depend on the thread count or on other jobs on the host), CPU only,
    the built-in task's data in the work directory (never root/data), fixed hash seed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RAYON_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0",
               NANO_RLHF_DATA=os.path.join(work, "runs", "data"), PYTHONPATH=root)
    for k in ("NANO_RLHF_GPU_OUT", "NANO_RLHF_STACKS"):      # test-suite hooks, not wanted here
        env.pop(k, None)
    return env


def execute(run, work, root, env):
    """Run one command and summarise its output directory."""
    out = os.path.join(work, "runs", run.name)
    if run.mkdir:
        os.makedirs(out, exist_ok=True)
    argv = [sys.executable if a == "python" and i == 0 else a.replace(WORK, work) for i, a in enumerate(run.argv)]
    t0 = time.time()
    with open(os.path.join(work, "logs", run.name + ".log"), "w") as log:
        try:
            rc = subprocess.run(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.time() - t0
    sha, n = metrics_digest(os.path.join(out, "metrics.jsonl"))
    files = files_digest(out, work) if os.path.isdir(out) else {}
    return {"command": run.argv, "returncode": rc, "metrics_sha256": sha, "metrics_lines": n, "files": files}, seconds


def selected(all_runs, only):
    """The runs named in --only and, transitively, the runs they need (in list order); every run without it."""
    by_name = {x.name: x for x in all_runs}
    if not only:
        return all_runs
    unknown = [n for n in only if n not in by_name]
    if unknown:
        sys.exit(f"error: no run named {', '.join(unknown)}; runs: {', '.join(by_name)}")
    keep, todo = set(), list(only)
    while todo:
        n = todo.pop()
        if n not in keep:
            keep.add(n)
            todo.extend(by_name[n].needs)
    return [x for x in all_runs if x.name in keep]


def waves(chosen):
    """Groups of runs to go in order; a run's group comes after those of every run it needs."""
    level = {}
    for x in chosen:                          # list order puts every run after what it needs
        level[x.name] = 1 + max((level[n] for n in x.needs), default=-1)
    return [[x for x in chosen if level[x.name] == k] for k in range(max(level.values()) + 1)]


def record(args):
    import torch      # only for the environment line: the runs import their own
    root = os.path.abspath(args.root)
    if not os.path.isfile(os.path.join(root, "train_ppo.py")):
        sys.exit(f"error: {root} is not a nano_rlhf checkout (no train_ppo.py); give --root")
    chosen = selected(runs(), [n for n in args.only.split(",") if n] if args.only else [])
    work = os.path.realpath(tempfile.mkdtemp(prefix="behaviour-"))
    os.makedirs(os.path.join(work, "logs"))
    os.makedirs(os.path.join(work, "runs"))
    env = subprocess_env(work, root)
    print(f"recording {len(chosen)} runs of {root} in {work} | python {platform.python_version()} | torch "
          f"{torch.__version__} | {platform.machine()} {cpu_name()}", flush=True)
    t_start, results, failed = time.time(), {}, []
    try:
        for group in waves(chosen):
            with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                done = pool.map(lambda x: (x, execute(x, work, root, env)), group)
                for x, (res, seconds) in done:
                    results[x.name] = res
                    ok = res["returncode"] == 0
                    status = "ok" if ok else f"FAILED ({res['returncode']})"
                    print(f"  {x.name:<34} {seconds:6.1f}s  {status}", flush=True)
                    if not ok:
                        failed.append(x.name)
                        with open(os.path.join(work, "logs", x.name + ".log")) as f:
                            print("    | " + "\n    | ".join(f.read().splitlines()[-15:]), flush=True)
    finally:
        if args.keep:
            print(f"kept the work directory: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    ordered = {x.name: results[x.name] for x in chosen if x.name in results}
    with open(args.out_json, "w") as f:
        json.dump(ordered, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out_json}: {len(ordered)} runs in {time.time() - t_start:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


# ---- compare ---------------------------------------------------------------------------------------------------

def differences(a, b):
    """What differs between two records of one run, as short phrases; [] when they are the same."""
    what = [k for k in ("command", "returncode", "metrics_lines", "metrics_sha256") if a.get(k) != b.get(k)]
    fa, fb = a.get("files", {}), b.get("files", {})
    changed = sorted(p for p in set(fa) & set(fb) if fa[p] != fb[p])
    what += [f"file {p}" for p in changed]
    what += [f"only in A: {p}" for p in sorted(set(fa) - set(fb))]
    what += [f"only in B: {p}" for p in sorted(set(fb) - set(fa))]
    return what


def compare(args):
    with open(args.a) as f:
        a = json.load(f)
    with open(args.b) as f:
        b = json.load(f)
    names = list(a) + [n for n in b if n not in a]
    if args.common:
        names = [n for n in names if n in a and n in b]
    bad = 0
    for n in names:
        if n not in b or n not in a:
            print(f"{n:<34} DIFFERENT (only in {'A' if n in a else 'B'})")
            bad += 1
            continue
        what = differences(a[n], b[n])
        bad += bool(what)
        print(f"{n:<34} {'DIFFERENT (' + '; '.join(what) + ')' if what else 'same'}")
    print(f"{len(names) - bad} same, {bad} different")
    return 1 if bad else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run every configuration and write their hashes to OUT_JSON")
    r.add_argument("out_json")
    r.add_argument("--only", default="", help="comma list of run names (the runs they need run too)")
    r.add_argument("--jobs", type=int, default=2, help="runs at a time (each is single-threaded)")
    r.add_argument("--root", default=default_root(), help="the nano_rlhf checkout to run")
    r.add_argument("--keep", action="store_true", help="keep the work directory (outputs and logs) to inspect")
    c = sub.add_parser("compare", help="compare two records run by run; exit 1 on any difference")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--common", action="store_true", help="only the runs both records hold (after a --only record)")
    sub.add_parser("list", help="print each run's name and command")
    args = p.parse_args(argv)
    if args.cmd == "record":
        return record(args)
    if args.cmd == "compare":
        return compare(args)
    for x in runs():
        print(f"{x.name:<34} {' '.join(x.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
