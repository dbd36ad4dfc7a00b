"""The shape of the code base ("the house"), measured from the files, for before -> after figures of a restructure.

    python dev/house.py                          # the table (about 25 s on 2 CPU cores)
    python dev/house.py --json house.json        # and the figures as JSON
    python dev/house.py --no-run                 # the static figures only (no training runs)
    python dev/house.py --steps 5 --json h.json  # also the windows of steps 3 and 4 (JSON: later_windows)
    python /elsewhere/house.py --root REPO         # from outside a repository (default: bench/.., else cwd)

Nothing is hard-coded about the package's layout: the package is every top-level directory with an __init__.py
(tests/ and bench/ excepted; --package NAME picks one), its modules are every .py file under it (recursively), and
the scripts are the repository root's train_*.py. The figures:

1. Modules crossed by one training step (PPO and DPO): the package files in which at least one Python function
   (not a module body) is called during one training step. Each script runs once in a subprocess, on CPU, on a
   tiny model and tiny data written here (an SFT model and a reward model made by train_sft.py / train_rm.py
   through their command lines, then 3 steps of train_ppo.py at its default advantage and of train_dpo.py at
   its default loss), under a sys.setprofile hook. A step is delimited by the calls of `step` on a
   torch.optim.Optimizer (the outermost such call; the optimizer that steps first is the clock): with S calls
   over a run of T = 3 steps, n = S / T calls a step, and the step window is from its call n + 1 (the first
   update of step 2) to its call 2n + 1 (the first update of step 3), i.e. one whole cycle: step 2's updates and
   bookkeeping after them (logging, end of step), then step 3's data / rollout, losses and backward. Start-up
   (imports, loading, data) and the end of the run (final evaluation, save) lie outside it. The PPO run uses
   --critic_warmup_steps 0 (otherwise its first 5 steps train only the critic and no policy update would be
   measured); both runs use --log_interval 1 (every step logs, as the logging steps of a real run do) and
   --eval_interval 0 (evaluation only at the end). "run" counts the same over the whole process, "imported"
   the package modules imported at all. If S is not a multiple of T the window falls back to n = 1 and the
   table says so. Caveats: only the main thread is profiled (a function the autograd engine or a data thread
   runs elsewhere is not seen; on CPU the backward runs in the calling thread); what a step does only at some
   steps (evaluation, checkpoints at --save_interval, warnings on a collapse, the critic warm-up) or only on
   other data (truncation, missing end-of-text) is outside the window unless the tiny run meets it; a property
   or a generator resumed counts as a call, a dataclass's generated __init__ does not (its file is "<string>").
2. Package modules: the number of .py files in the package (an __init__.py holding nothing but a docstring is
   not counted) and their total lines.
3. Longest file (package modules and scripts, by lines) and longest function (any def, methods and nested ones
   included, from its `def` line to its last line, by `ast`), with its qualified name.
4. Options per script: the `--` options in the usage line of `python train_X.py --help` (--help itself and a
   `--no-X` twin of `--X` not counted).
5. `noqa: F401` lines in the package and the scripts (listed).
6. Names defined twice: public top-level names (def, class, assignment targets; a name starting with "_" and
   `main` excepted; conditional definitions under a top-level if/try/with included) defined in more than one
   package module (listed with their modules).
7. Script-to-script imports: import statements in a train_*.py that import another train_*.py module.
8. README layout block: the lines inside the fenced block of README.md with the most ".py" occurrences (the
   block listing the package's files), fences excluded.
9. Package-to-script callbacks: the places where a script hands one of its own functions (a def of the script,
   nested ones included, a lambda, or a name bound to one) to a call it does not define itself: a package function, or a method of an
   object the package made (`run.end_of_step(evaluate=..., save=...)`). Calls into the standard library, torch
   and the builtins (`sorted(key=...)`) are not counted. Read from the syntax tree, so it sees every option path.
10. Flags declared outside their script: the fields of each script's Options whose declaration (the most derived
   class of the MRO that annotates it, the one --help reads) sits in a package module other than the shared
   run options' (the cli module): an algorithm's option living in a package room.
11. README lines: `wc -l README.md`.
"""
import argparse
import ast
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

# the repository: the parent of this file's directory (dev/house.py), else the working directory; or --root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not glob.glob(os.path.join(ROOT, "train_*.py")):
    ROOT = os.getcwd()
STEPS = 3                       # steps of each traced run (the window is step 2 -> step 3)
NOT_PACKAGES = {"tests", "bench", "docs", "scripts"}


# ---- discovery --------------------------------------------------------------------------------------------------

def packages(spec=None):
    if spec:
        return spec.split(",")
    return sorted(d for d in os.listdir(ROOT) if d not in NOT_PACKAGES and not d.startswith(".")
                  and os.path.isfile(os.path.join(ROOT, d, "__init__.py")))


def is_empty_init(path):
    if os.path.basename(path) != "__init__.py":
        return False
    body = ast.parse(read(path)).body
    return not body or (len(body) == 1 and isinstance(body[0], ast.Expr)
                        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str))


def package_modules(pkgs):
    """Relative paths of the package's modules (empty __init__.py files left out)."""
    found = []
    for p in pkgs:
        for path in sorted(glob.glob(os.path.join(ROOT, p, "**", "*.py"), recursive=True)):
            if not is_empty_init(path):
                found.append(os.path.relpath(path, ROOT))
    return found


def scripts():
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "train_*.py")))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def nlines(path):
    return len(read(path).splitlines())


# ---- static figures ---------------------------------------------------------------------------------------------

def longest_function(paths):
    best = None
    for path in paths:
        def visit(node, prefix):
            nonlocal best
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = prefix + child.name
                    if not isinstance(child, ast.ClassDef):
                        n = child.end_lineno - child.lineno + 1
                        if best is None or n > best["lines"]:
                            best = {"name": name, "path": path, "line": child.lineno, "lines": n}
                    visit(child, name + ".")
                else:
                    visit(child, prefix)
        visit(ast.parse(read(path)), "")
    return best


def noqa_f401(paths):
    pat = re.compile(r"#\s*noqa\s*:\s*[A-Z0-9, ]*\bF401\b")
    return [f"{p}:{i}: {line.strip()}" for p in paths for i, line in enumerate(read(p).splitlines(), 1)
            if pat.search(line)]


def top_level_names(path):
    names, imported = set(), set()

    def add_target(t):
        if isinstance(t, ast.Name):
            names.add(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                add_target(e)

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    add_target(t)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                add_target(node.target)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for h in node.handlers:
                    visit(h.body)
            elif isinstance(node, ast.With):
                visit(node.body)
    visit(ast.parse(read(path)).body)
    return {n for n in names - imported if not n.startswith("_") and n != "main"}


def defined_twice(mods):
    where = {}
    for m in mods:
        for n in top_level_names(m):
            where.setdefault(n, []).append(m)
    return {n: ms for n, ms in sorted(where.items()) if len(ms) > 1}


def script_imports(scr):
    stems = {s[:-3] for s in scr}
    found = []
    for s in scr:
        for node in ast.walk(ast.parse(read(s))):
            if isinstance(node, ast.Import):
                mods = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module.split(".")[0]]
            else:
                continue
            found += [f"{s}:{node.lineno} imports {m}" for m in mods if m in stems and m != s[:-3]]
    return found


def readme_layout_block():
    path = os.path.join(ROOT, "README.md")
    if not os.path.isfile(path):
        return {"lines": 0, "start_line": None}
    blocks, start = [], None
    lines = read("README.md").splitlines()
    for i, line in enumerate(lines, 1):
        if re.match(r"\s*(```|~~~)", line):
            if start is None:
                start = i
            else:
                blocks.append((start, i))
                start = None
    best = max(blocks, key=lambda b: sum(x.count(".py") for x in lines[b[0]:b[1] - 1]), default=None)
    if best is None or not sum(x.count(".py") for x in lines[best[0]:best[1] - 1]):
        return {"lines": 0, "start_line": None}
    return {"lines": best[1] - best[0] - 1, "start_line": best[0]}


def callbacks(scr, pkgs):
    found = []
    for s in scr:
        tree = ast.parse(read(s))
        own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        own |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Lambda)
                for t in n.targets if isinstance(t, ast.Name)}            # draw = lambda: ...
        external = set(dir(__builtins__)) if isinstance(__builtins__, type(sys)) else set(__builtins__)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                for a in node.names:
                    root = (module or a.name).split(".")[0]
                    if root not in pkgs:
                        external.add((a.asname or a.name).split(".")[0])
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            while isinstance(f, (ast.Attribute, ast.Call, ast.Subscript)):
                f = f.func if isinstance(f, ast.Call) else f.value
            root = f.id if isinstance(f, ast.Name) else None
            if root is None or root in external or (isinstance(node.func, ast.Name) and root in own):
                continue
            args = list(node.args) + [k.value for k in node.keywords]
            passed = [a for a in args if isinstance(a, ast.Lambda) or (isinstance(a, ast.Name) and a.id in own)]
            if passed:
                callee = ast.unparse(node.func)
                found += [f"{s}:{node.lineno} {callee}({'lambda' if isinstance(a, ast.Lambda) else a.id})"
                          for a in passed]
    return found


OUTSIDE = '''
import dataclasses, importlib, json, sys
out = {}
for s in sys.argv[1:]:
    m = importlib.import_module(s[:-3])
    cls = getattr(m, "Options", None)
    if cls is None:
        continue
    where = {}
    for f in dataclasses.fields(cls):
        home = next(c for c in cls.__mro__ if f.name in vars(c).get("__annotations__", {}))
        where[f.name] = home.__module__
    out[s] = sorted(n for n, mod in where.items() if mod != m.__name__ and not mod.endswith(".cli"))
print(json.dumps(out))
'''


def flags_outside(scr, env):
    p = subprocess.run([sys.executable, "-c", OUTSIDE, *scr], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    return json.loads(p.stdout) if p.returncode == 0 else {"error": p.stderr[-300:]}


def option_counts(scr, env):
    counts = {}
    for s in scr:
        p = subprocess.run([sys.executable, s, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
        usage = p.stdout.split("\n\n", 1)[0] if p.returncode == 0 else ""
        flags = set(re.findall(r"(?<![\w-])--([A-Za-z][\w-]*)", usage)) - {"help"}
        counts[s] = len({f for f in flags if not (f.startswith("no-") and f[3:] in flags)}) if usage else None
    return counts


# ---- the traced runs --------------------------------------------------------------------------------------------

WORDS = ("the motor is great and the screen is bad i love this blender phone battery review write a short "
         "of it was fine nice terrible quiet loud").split()


def write_data(d):
    """Tiny SFT, preference and prompt files in the formats the scripts document."""
    import random
    r = random.Random(0)
    good, bad = ["great", "nice", "quiet", "fine"], ["bad", "terrible", "loud"]

    def prompt():
        return f"write a short review of the {r.choice(['blender', 'phone', 'motor', 'screen'])}."

    def dump(name, rows):
        with open(os.path.join(d, name), "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in rows)
        return os.path.join(d, name)

    sft = [{"prompt": prompt(), "completion": " " + " ".join(r.choice(WORDS) for _ in range(r.randint(2, 8))) + "."}
           for _ in range(72)]

    def pref(n):
        rows = []
        for _ in range(n):
            p = prompt()
            item = p.split()[-1][:-1]
            rows.append({"prompt": p,
                         "chosen": f" the {item} is {r.choice(good)}" + " and great" * r.randint(0, 2) + ".",
                         "rejected": f" the {item} is {r.choice(bad)}" + " and loud" * r.randint(0, 3) + "."})
        return rows
    return {"sft": dump("sft.jsonl", sft[:64]), "sft_eval": dump("sft_eval.jsonl", sft[64:]),
            "pref": dump("pref.jsonl", pref(64)), "pref_eval": dump("pref_eval.jsonl", pref(8)),
            "prompts": dump("prompts.jsonl", [{"prompt": prompt()} for _ in range(32)]),
            "eval_prompts": dump("eval_prompts.jsonl", [{"prompt": prompt()} for _ in range(8)])}


def traced_runs(pkgs, env, log, keep=False):
    d = tempfile.mkdtemp(prefix="house-")
    try:
        return _traced_runs(d, pkgs, env, log)
    finally:
        if keep:
            log(f"kept {d}")
        else:
            shutil.rmtree(d, ignore_errors=True)


def _traced_runs(d, pkgs, env, log):
    f = write_data(d)
    sft, rm = os.path.join(d, "sft"), os.path.join(d, "rm")
    setup = [["train_sft.py", "--data", f["sft"], "--eval_data", f["sft_eval"], "--out_dir", sft, "--n_layer", "1",
              "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--vocab_size", "300", "--batch_size", "8",
              "--max_steps", "1", "--warmup_steps", "0", "--eval_interval", "0"],
             ["train_rm.py", "--init", sft, "--data", f["pref"], "--eval_data", f["pref_eval"], "--out_dir", rm,
              "--batch_size", "8", "--max_steps", "1", "--warmup_steps", "0", "--eval_interval", "0"]]
    common = ["--max_steps", str(STEPS), "--log_interval", "1", "--eval_interval", "0", "--init", sft]
    runs = {"ppo": ["train_ppo.py", *common, "--reward_model", rm, "--prompts", f["prompts"], "--eval_prompts",
                    f["eval_prompts"], "--out_dir", os.path.join(d, "ppo"), "--batch_size", "2",
                    "--samples_per_prompt", "2", "--max_new_tokens", "8", "--eval_samples", "2",
                    "--critic_warmup_steps", "0"],
            "dpo": ["train_dpo.py", *common, "--data", f["pref"], "--eval_data", f["pref_eval"], "--out_dir",
                    os.path.join(d, "dpo"), "--batch_size", "4"]}
    for cmd in setup:
        log(f"setup: {cmd[0]}")
        p = subprocess.run([sys.executable, os.path.join(ROOT, cmd[0]), *cmd[1:]], cwd=d, env=env,
                           capture_output=True, text=True, timeout=300)
        if p.returncode:
            return {k: {"error": f"setup {cmd[0]} failed:\n{p.stderr[-2000:]}"} for k in runs}
    out = {}
    for k, cmd in runs.items():
        log(f"traced: {cmd[0]}")
        trace = os.path.join(d, f"{k}.trace.json")
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--_trace", trace, "--root", ROOT,
                            "--package", ",".join(pkgs),
                            "--", os.path.join(ROOT, cmd[0]), *cmd[1:]], cwd=d, env=env, capture_output=True,
                           text=True, timeout=600)
        if p.returncode or not os.path.isfile(trace):
            out[k] = {"error": f"{cmd[0]} failed ({p.returncode}):\n{p.stderr[-2000:]}"}
            continue
        with open(trace) as fh:
            t = json.load(fh)
        out[k] = step_window(t)
        if STEPS > 3:                               # a check of the delimiting: the later windows too
            out[k]["later_windows"] = [step_window(t, j)["step_modules"] for j in range(3, STEPS)]
    return out


def step_window(t, k=2):
    """The figures of one traced run (see the docstring: the window of step k is the clock optimizer's calls
    (k-1)n+1 .. kn+1; k = 2 by default)."""
    res = {"run": len(t["run"]), "run_modules": t["run"], "imported": len(t["imported"]),
           "imported_modules": t["imported"], "optimizer_step_calls": len(t["steps"])}
    if t.get("error"):
        res["error"] = t["error"]
    clock = [seg for opt, seg in t["steps"] if opt == 0]
    if len(clock) < 2:
        res.update(step=None, step_modules=[], window="fewer than 2 optimizer steps")
        return res
    n = len(clock) // STEPS if len(clock) % STEPS == 0 else 1
    a, b = ((k - 1) * n, k * n) if len(clock) >= k * n + 1 else (len(clock) - 2, len(clock) - 1)
    mods = sorted(set().union(*(t["segments"].get(str(s), []) for s in range(clock[a], clock[b]))))
    res.update(step=len(mods), step_modules=mods, clock_calls=len(clock), calls_per_step=n,
               window=f"clock optimizer's step calls {a + 1} -> {b + 1} of {len(clock)} ({n} a step)"
               + ("" if len(clock) % STEPS == 0 else f"; {len(clock)} calls is not a multiple of {STEPS}: n = 1"))
    return res


def trace_main(out, pkgs, argv):
    """In the subprocess: run a script as __main__ under a profile hook; write which package files had a function
    called, per segment between two optimizer steps."""
    import runpy
    sys.path.insert(0, ROOT)
    import torch
    prefixes = tuple(os.path.join(ROOT, p) + os.sep for p in pkgs)
    Optimizer = torch.optim.Optimizer
    segments = {0: set()}
    state = {"seg": 0, "outer": None}
    steps, opts, run = [], {}, set()

    def hook(frame, event, arg):
        if event == "call":
            code = frame.f_code
            fn = code.co_filename
            if fn.startswith(prefixes) and code.co_name != "<module>":
                segments[state["seg"]].add(fn)
            elif code.co_name == "step" and state["outer"] is None:
                self = frame.f_locals.get("self")
                if isinstance(self, Optimizer):
                    state["outer"] = frame
                    state["seg"] += 1
                    segments[state["seg"]] = set()
                    steps.append((opts.setdefault(id(self), len(opts)), state["seg"]))
        elif event == "return" and frame is state["outer"]:
            state["outer"] = None

    sys.argv = list(argv)
    error = None
    sys.setprofile(hook)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        error = None if e.code in (0, None) else f"exit {e.code}"
    finally:
        sys.setprofile(None)
    rel = lambda fn: os.path.relpath(fn, ROOT)
    for s in segments.values():
        run |= s
    imported = sorted({rel(m.__file__) for m in list(sys.modules.values())
                       if (getattr(m, "__file__", None) or "").startswith(prefixes) and not is_empty_init(m.__file__)})
    with open(out, "w") as f:
        json.dump({"segments": {str(k): sorted(map(rel, v)) for k, v in segments.items()}, "steps": steps,
                   "run": sorted(map(rel, run)), "imported": imported, "error": error}, f)
    if error:
        sys.exit(1)


# ---- the report -------------------------------------------------------------------------------------------------

def measure(args, log):
    pkgs = packages(args.package)
    mods, scr = package_modules(pkgs), scripts()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    fig = {"commit": commit.stdout.strip() or None, "packages": pkgs}
    if not args.no_run:
        t0 = time.time()
        fig["step_modules"] = traced_runs(pkgs, env, log, args.keep)
        fig["traced_seconds"] = round(time.time() - t0, 1)
    fig["package_modules"] = {"count": len(mods), "lines": sum(map(nlines, mods)),
                              "modules": {m: nlines(m) for m in mods}}
    longest = max(mods + scr, key=nlines)
    fig["longest_file"] = {"path": longest, "lines": nlines(longest)}
    fig["longest_function"] = longest_function(mods + scr)
    log("options: --help of each script")
    fig["options"] = option_counts(scr, env)
    noqa = noqa_f401(mods + scr)
    fig["noqa_f401"] = {"count": len(noqa), "lines": noqa}
    twice = defined_twice(mods)
    fig["defined_twice"] = {"count": len(twice), "names": twice}
    imports = script_imports(scr)
    fig["script_imports"] = {"count": len(imports), "imports": imports}
    fig["readme_layout_block"] = readme_layout_block()
    cb = callbacks(scr, pkgs)
    fig["callbacks"] = {"count": len(cb), "places": cb}
    outside = flags_outside(scr, env)
    fig["flags_outside"] = {"count": sum(len(v) for v in outside.values() if isinstance(v, list)), "flags": outside}
    fig["readme_lines"] = nlines("README.md") if os.path.isfile(os.path.join(ROOT, "README.md")) else 0
    return fig


def table(fig):
    rows = []
    for k, r in fig.get("step_modules", {}).items():
        if r.get("step") is None:
            rows.append((f"modules crossed by one {k.upper()} step", "error",
                         r.get("error", r.get("window", ""))[-300:]))
            continue
        rows.append((f"modules crossed by one {k.upper()} step", r["step"],
                     ", ".join(short(m) for m in r["step_modules"])))
        rows.append((f"  {k.upper()}: whole run / imported", f"{r['run']} / {r['imported']}", r["window"]))
    pm = fig["package_modules"]
    rows.append(("package modules / their lines", f"{pm['count']} / {pm['lines']}", ""))
    rows.append(("longest file", fig["longest_file"]["lines"], fig["longest_file"]["path"]))
    lf = fig["longest_function"]
    rows.append(("longest function", lf["lines"], f"{lf['path']}:{lf['line']} {lf['name']}"))
    rows.append(("options per script", sum(v or 0 for v in fig["options"].values()),
                 ", ".join(f"{k[:-3]} {v}" for k, v in fig["options"].items())))
    rows.append(("noqa: F401 lines", fig["noqa_f401"]["count"],
                 "; ".join(x.split(": ")[0] for x in fig["noqa_f401"]["lines"])))
    dt = fig["defined_twice"]
    rows.append(("names defined twice", dt["count"],
                 "; ".join(f"{n} ({', '.join(short(m) for m in ms)})" for n, ms in dt["names"].items())))
    si = fig["script_imports"]
    rows.append(("script-to-script imports", si["count"], "; ".join(si["imports"])))
    rb = fig["readme_layout_block"]
    rows.append(("README layout block lines", rb["lines"], f"README.md:{rb['start_line']}" if rb["start_line"] else ""))
    cb = fig["callbacks"]
    by_callee = {}
    for place in cb["places"]:
        call = place.split(" ", 1)[1]
        by_callee[call] = by_callee.get(call, 0) + 1
    rows.append(("package-to-script callbacks", cb["count"], "; ".join(f"{c} x{n}" for c, n in by_callee.items())))
    fo = fig["flags_outside"]
    rows.append(("flags declared outside their script", fo["count"],
                 "; ".join(f"{k[:-3]}: {', '.join(v)}" for k, v in fo["flags"].items() if isinstance(v, list) and v)
                 or fo["flags"].get("error", "")))
    rows.append(("README lines", fig["readme_lines"], ""))
    w = max(len(r[0]) for r in rows)
    v = max(len(str(r[1])) for r in rows)
    lines = [f"house at {fig['commit']} (packages: {', '.join(fig['packages'])})"]
    for name, val, detail in rows:
        parts = textwrap.wrap(str(detail), max(40, 118 - w - v - 4)) or [""]
        lines.append(f"{name:<{w}}  {str(val):>{v}}  {parts[0]}".rstrip())
        lines += [" " * (w + v + 4) + x for x in parts[1:]]
    return "\n".join(lines)


def short(path):
    return path[:-3] if path.endswith(".py") else path


def main():
    global STEPS, ROOT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--package", help="the package directory (comma list); default: every top-level package")
    p.add_argument("--no-run", action="store_true", help="skip the traced training runs (figure 1)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--steps", type=int, default=STEPS, help="steps of each traced run (>= 3; more: the later "
                   "windows are listed in the JSON as a check)")
    p.add_argument("--keep", action="store_true", help="keep the traced runs' temporary directory")
    p.add_argument("--root", help="the repository (default: bench/..'s, else the working directory)")
    p.add_argument("--_trace", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    rest = []
    if "--" in argv:
        argv, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = p.parse_args(argv)
    STEPS = max(3, args.steps)
    ROOT = os.path.abspath(args.root) if args.root else ROOT
    if args._trace:
        return trace_main(args._trace, args.package.split(","), rest)
    log = (lambda m: None) if args.quiet else (lambda m: print(f"[house] {m}", file=sys.stderr, flush=True))
    t0 = time.time()
    fig = measure(args, log)
    fig["seconds"] = round(time.time() - t0, 1)
    print(table(fig))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
