import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# every training script's module name: the tests that hold for all of them take this list, so a new script is in
SCRIPTS = sorted(name[:-3] for name in os.listdir(ROOT) if name.startswith("train_") and name.endswith(".py"))

from nano_rlhf.model import GPT, GPTConfig  # noqa: E402 (the repository root is on sys.path first)
from nano_rlhf.tokenizer import Tokenizer  # noqa: E402

# pytest.ini runs the suite on 2 xdist workers: each then computes on one thread (and so do the processes it
# starts), since two workers at 2 threads each on 2 cores lose more to contention than they gain
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config):
    """The built-in task's files (ROOT/data, what scripts run without --data read) are written once here, in the
    controlling process before any worker starts, so that no two tests generate them at the same time."""
    if hasattr(config, "workerinput"):
        return
    from nano_rlhf.tasks import synthetic
    if not os.path.isfile(os.path.join(ROOT, "data", "task.json")):      # task.json is written last
        synthetic.write_dataset(os.path.join(ROOT, "data"), seed=0)

def pytest_collection_modifyitems(config, items):
    """Tests marked gpu (tests/test_gpu.py) run only when the -m expression names them (`pytest -m gpu`, what
    bench/gpu.py runs): pytest.ini's `-m 'not gpu'` is replaced by any other -m (`-m 'not slow'`, CI's
    `-m numeric`), and they must then be deselected, never collected and skipped."""
    if "gpu" in (config.getoption("markexpr") or ""):
        return
    keep = [it for it in items if it.get_closest_marker("gpu") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if it.get_closest_marker("gpu") is not None])
        items[:] = keep


def pytest_runtest_logreport(report):
    """With NANO_RLHF_GPU_OUT set (bench/gpu.py's correctness part), each test's outcome is appended to
    outcomes.jsonl as it ends, so a run stopped at its time limit on a GPU still says what passed."""
    out = os.environ.get("NANO_RLHF_GPU_OUT")
    if not out or (report.when != "call" and report.passed):
        return
    row = {"name": report.nodeid.split("::", 1)[-1], "when": report.when, "outcome": report.outcome,
           "seconds": round(report.duration, 2)}
    if report.failed:
        row["detail"] = str(report.longrepr)[-2500:]
    with open(os.path.join(out, "outcomes.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


WORDS = ("the motor is great and the screen is bad i love this blender phone battery review write a short "
         "of it was fine nice terrible quiet loud").split()


def tiny_texts(n=300, seed=0):
    import random
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(3, 12))) + "." for _ in range(n)]


@pytest.fixture(scope="session")
def tok():
    texts = tiny_texts() + ["User: hi\nAssistant: hello\nSystem: be nice\n"] * 5
    return Tokenizer.train(texts, vocab_size=300)


def tiny_config(tok=None, **kw):
    d = dict(vocab_size=tok.vocab_size if tok else 300, block_size=64, n_layer=2, n_head=2, n_embd=32)
    d.update(kw)
    cfg = GPTConfig(**d)
    if tok is not None:
        cfg.eos_token_id, cfg.pad_token_id = tok.eos_id, tok.pad_id
    return cfg


def tiny_model(tok=None, seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(tiny_config(tok, **kw)).eval()


def other_tokenizer(tok, model_dir):
    """Save into model_dir a tokenizer of tok's size that is not tok: two ordinary tokens swap ids (a model
    trained with it reads every one of tok's ids for either as the other token)."""
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(str(model_dir), "tokenizer.json")
    tok.save(path)
    with open(path) as f:
        d = json.load(f)
    vocab = d["model"]["vocab"]
    a, b = [t for t in sorted(vocab, key=vocab.get) if len(t) > 3][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(path, "w") as f:
        json.dump(d, f)
    return path


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def sft_rows(n=64, seed=0):
    import random
    r = random.Random(seed)
    return [{"prompt": f"write a short review of the {r.choice(['blender', 'phone'])}.",
             "completion": " " + " ".join(r.choice(WORDS) for _ in range(r.randint(2, 8))) + "."} for _ in range(n)]


def free_port():
    """A port that was free a moment ago (another process may take it before it is used: prefer
    run(..., nproc=N), which lets torchrun pick its own port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid):
    """Every process started, directly or not, by `pid` (from /proc: torchrun starts its ranks in sessions of
    their own, so a process-group signal misses them)."""
    children = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def signal_all(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


# Imported by every Python process the tests start (tests/stackdump is put on PYTHONPATH): SIGUSR1 writes the
# process's stacks (all threads) to $NANO_RLHF_STACKS/<pid>.txt and the process carries on.
STACKDUMP = os.path.join(ROOT, "tests", "stackdump")


def run_or_dump(cmd, cwd, env, timeout, retry_teardown=False):
    """subprocess.run(cmd), except that a run still going after `timeout` seconds fails with the Python stacks
    of every process it started (torchrun's ranks included), so a hang in CI says where it hung: SIGUSR1 to
    them all (tests/stackdump/sitecustomize.py makes each write its stacks to a file of its own), then SIGKILL.

    retry_teardown: a multi-process run that aborted in C++ ("terminate called", a rank killed by SIGABRT) or
    hung is run once more, from its --out_dir as it was before the first attempt (a finished run's directory would
    otherwise refuse the rerun), and the first failure is reported as a warning (pytest lists it). Both are the
    shapes of gloo's teardown races (docs/safety.md): seen about once per few full suites on a loaded 2-core
    host, after every file was saved, and never twice in a row. A real bug fails the second time too."""
    first = None
    out_dir = os.path.join(cwd, cmd[cmd.index("--out_dir") + 1]) if "--out_dir" in cmd[:-1] else None
    saved = _set_aside(out_dir) if retry_teardown and out_dir else None
    for attempt in range(2 if retry_teardown else 1):
        if attempt == 1 and out_dir:          # the rerun starts from what the first attempt found, not what it wrote
            _put_back(out_dir, saved)
        try:
            p = _run_or_dump(cmd, cwd, env, timeout)
        except AssertionError as e:          # a hang: the stacks are in the message
            if attempt == 0 and retry_teardown:
                first = str(e)
                continue
            raise
        aborted = p.returncode != 0 and ("terminate called" in p.stderr or "exitcode  : -6" in p.stderr)
        if not (aborted and retry_teardown and attempt == 0):
            break
        first = f"{' '.join(cmd)} aborted ({p.returncode}):\n{p.stderr[-4000:]}"
    if first is not None:
        import warnings
        warnings.warn(f"retried once after a teardown-shaped failure:\n{first[-6000:]}")
    return p


def _set_aside(out_dir):
    """A copy of out_dir as it is before a run (None when it does not exist), for a rerun to start from."""
    import shutil
    import tempfile
    if not os.path.isdir(out_dir):
        return None
    copy = os.path.join(tempfile.mkdtemp(prefix="out-before-"), "out")
    shutil.copytree(out_dir, copy, symlinks=True)
    return copy


def _put_back(out_dir, copy):
    import shutil
    shutil.rmtree(out_dir, ignore_errors=True)
    if copy is not None:
        shutil.copytree(copy, out_dir, symlinks=True)


def _run_or_dump(cmd, cwd, env, timeout):
    import tempfile
    stacks = tempfile.mkdtemp(prefix="stacks-")
    env = dict(env, NANO_RLHF_STACKS=stacks, PYTHONPATH=os.pathsep.join([STACKDUMP, env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        everyone = descendants(proc.pid) + [proc.pid]
        signal_all(everyone, signal.SIGUSR1)
        time.sleep(3)
        signal_all(everyone, signal.SIGKILL)
        out, err = proc.communicate()
        dumps = "".join(f"--- stacks of process {name[:-4]} ---\n" + open(os.path.join(stacks, name)).read()
                        for name in sorted(os.listdir(stacks)))
        raise AssertionError(f"{' '.join(cmd)} still running after {timeout} s\n--- stdout ---\n{out}\n"
                             f"--- stderr ---\n{err}\n{dumps}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run(args, nproc=1, cwd=ROOT, check=True, env=None, timeout=600):
    """Run a script (list of args after the script path) as a subprocess, optionally under torchrun.

    Under torchrun, --standalone makes the launcher bind its rendezvous store to port 0 (the OS picks a free
    port, atomically) and the ranks reuse that store, so no port is guessed in advance: the race of
    free_port() (another process taking the port before torchrun binds it) cannot happen. A failure shows
    the full stdout and stderr."""
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1" if nproc > 1 else "2", **(env or {}))
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] + args
    else:
        cmd = [sys.executable] + args
    p = run_or_dump(cmd, cwd, e, timeout, retry_teardown=nproc > 1 and check)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n--- stdout ---\n{p.stdout}\n"
                             f"--- stderr ---\n{p.stderr}")
    return p


def pref_rows(n=64, seed=0):
    import random
    r = random.Random(seed)
    good, bad = ["great", "nice", "quiet", "fine"], ["bad", "terrible", "loud"]
    rows = []
    for _ in range(n):
        item = r.choice(["blender", "phone", "motor", "screen"])
        rows.append({"prompt": f"write a short review of the {item}.",
                     "chosen": f" the {item} is {r.choice(good)}" + " and great" * r.randint(0, 2) + ".",
                     "rejected": f" the {item} is {r.choice(bad)}" + " and loud" * r.randint(0, 3) + "."})
    return rows


def unpaired_rows(n=64, seed=0):
    rows = []
    for i, p in enumerate(pref_rows(n, seed)):
        good = i % 2 == 0
        rows.append({"prompt": p["prompt"], "completion": p["chosen"] if good else p["rejected"], "label": good})
    return rows


@pytest.fixture(scope="session")
def sft_dir(tmp_path_factory, tok):
    """A tiny random policy saved like train_sft.py's output (model + tokenizer.json)."""
    d = tmp_path_factory.mktemp("sft")
    m = tiny_model(tok, seed=0)
    m.save_pretrained(str(d))
    tok.save(str(d / "tokenizer.json"))
    return str(d)


def prompt_rows(n=32, seed=0):
    return [{"prompt": p["prompt"]} for p in pref_rows(n, seed)]


@pytest.fixture(scope="session")
def rm_dir(tmp_path_factory, tok):
    """A tiny random reward model saved like train_rm.py's output (with score statistics)."""
    from nano_rlhf.model import ScoreModel
    d = tmp_path_factory.mktemp("rm")
    torch.manual_seed(1)
    m = ScoreModel(tiny_config(tok))
    m.save_pretrained(str(d), reward_mean=0.1, reward_std=0.5)
    tok.save(str(d / "tokenizer.json"))
    return str(d)


def eos_prone(model, tok, logit=4.0):
    """Make a tiny random policy end its responses often (P(eos) ~ 15% per token) so rollouts mix
    finished and unfinished rows."""
    with torch.no_grad():
        w = model.transformer.wte.weight[tok.eos_id]
        model.transformer.ln_f.weight.mul_(0.1)
        model.transformer.ln_f.bias.copy_(w * logit / w.dot(w))
    return model


def weights_close(a, b):
    """Two runs' weights agree up to float rounding. Adam divides by sqrt(v): a gradient element that is
    ~0 up to rounding can move by up to lr in either run, so single elements may differ by ~lr; the mean
    absolute difference stays tiny unless the runs really differ (a real bug moves most weights by ~lr)."""
    n = sum(v.numel() for v in a.values())
    mean = sum((a[k] - b[k]).abs().sum().item() for k in a) / n
    return mean < 1e-6


# ---- shared by several test files ---------------------------------------------------------------------

SMALL = dict(n_sft=50, n_pref=40, n_unpaired=20, n_prompts=10, n_eval_prompts=8, n_listwise=60)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The built-in task's files at small sizes, written once per test module."""
    from nano_rlhf.tasks import synthetic
    d = tmp_path_factory.mktemp("task")
    synthetic.write_dataset(str(d), seed=0, **SMALL)
    return d


def metrics(path):
    """A run's metrics.jsonl, one dict per logged step."""
    return [json.loads(x) for x in open(path / "metrics.jsonl")]


def one_line_error(capsys, fn, start):
    """fn() exits non-zero with exactly one stderr line starting with 'error: {start}'; returns that line."""
    with pytest.raises(SystemExit) as e:
        fn()
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {start}"), err
    return err


CRITIC_FLAGS = ("--critic_lr", "--critic_warmup_steps", "--critic_init", "--lam", "--value_clip")


def gae_only(args):
    """args without train_ppo's critic options (each flag with its value) when they choose a critic-free
    --advantage (the last one given wins): the parser refuses an option given where it does not apply."""
    adv = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--advantage"]
    if not adv or adv[-1] == "gae":
        return list(args)
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in CRITIC_FLAGS:
            skip = True
        else:
            out.append(a)
    return out


def scripted_policy(monkeypatch, script):
    """Make every row of every sampling call write `script` (nano_rlhf.sampling.sample_token replaced: the i-th
    sampled token of the call is script[i], the last one repeated after its end). Returns the position counter
    ([0]): set it back to 0 to replay the script in a second call."""
    from nano_rlhf import sampling
    step = [0]

    def scripted(logits, temperature, top_k, top_p, generator, u):
        t = script[min(step[0], len(script) - 1)]
        step[0] += 1
        return torch.full((logits.shape[0],), t, dtype=torch.long)
    monkeypatch.setattr(sampling, "sample_token", scripted)
    return step
