"""Package layout: the module dependency graph of nano_rlhf/ has no cycles; every name has one address.

Every `import` / `from ... import` at any depth counts, function-local ones included: a
cycle hidden behind an import inside a function is still a cycle.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "nano_rlhf"


def _modules():
    """{dotted name inside nano_rlhf ("model", "tasks.synthetic"): path}; a package's __init__ is not a module."""
    return {".".join(p.relative_to(PKG).with_suffix("").parts): p for p in sorted(PKG.rglob("*.py"))
            if p.name != "__init__.py"}


MODULES = _modules()
PACKAGES = {".".join(p.relative_to(PKG).parent.parts) for p in PKG.rglob("__init__.py")} - {""}


def _resolved(node, here=None):
    """[(module, name)] that one import node refers to inside nano_rlhf: the module as a dotted name (a package
    imported as such stays its name), the name imported from it (None for a module imported whole). here: the
    dotted name of the importing module (relative imports), None outside the package."""
    if isinstance(node, ast.Import):
        return [(a.name.split(".", 1)[1], None) for a in node.names if a.name.startswith("nano_rlhf.")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        if here is None:
            return []
        base = here.split(".")[:-1]
        if node.level - 1 > len(base):
            return []
        base = base[:len(base) - (node.level - 1)]
    elif node.module == "nano_rlhf" or (node.module or "").startswith("nano_rlhf."):
        base, node_module = [], node.module.split(".", 1)[1] if "." in node.module else None
        return _named(base, node_module, node.names)
    else:
        return []
    return _named(base, node.module, node.names)


def _named(base, module, names):
    prefix = ".".join(base + ([module] if module else []))
    out = []
    for a in names:          # one entry a name: (None, name) for a name nano_rlhf itself does not have
        full = f"{prefix}.{a.name}" if prefix else a.name
        out.append((full, None) if full in MODULES or full in PACKAGES else (prefix or None, a.name))
    return out


def _imported(node, here=None):
    """The nano_rlhf modules (dotted names) that one import node refers to."""
    return [m for m, _ in _resolved(node, here) if m is not None]


def import_graph():
    """{module: set of nano_rlhf modules it imports}."""
    graph = {}
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[m] = {d for node in ast.walk(tree) for d in _imported(node, m) if d in MODULES and d != m}
    return graph


def find_cycle(graph):
    """One cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_import_graph_sees_every_kind_of_import():
    """The parser itself: relative, absolute and function-local imports all make edges, a subpackage's modules by
    their dotted names; others do not."""
    src = ("import os\nimport nano_rlhf.model\nfrom nano_rlhf import dist\nfrom nano_rlhf.tasks.synthetic import x\n"
           "from . import data, chat\nfrom .cli import z\nfrom torch import nn\nfrom ... import nope\n"
           "def fn():\n    from .sampling import w\n")
    found = {n for node in ast.walk(ast.parse(src)) for n in _imported(node, "reward")}
    assert found == {"model", "dist", "tasks.synthetic", "data", "chat", "cli", "sampling"}, found
    in_task = "from ..chat import a\nfrom .common import b\nfrom . import synthetic\n"
    found = {n for node in ast.walk(ast.parse(in_task)) for n in _imported(node, "tasks.ifeval")}
    assert found == {"chat", "tasks.common", "tasks.synthetic"}, found
    assert "model" in import_graph()["evaluate"] and "tasks.common" in import_graph()["tasks.ifeval"]


def test_package_has_no_import_cycles():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, (
        "import cycle in nano_rlhf/: " + " -> ".join(cycle)
        + "\nmove the shared piece to the module it belongs to (or a leaf) instead of a local import")


def _defined(tree, probes=True):
    """The top-level names a module defines (def, class, assignment; inside a top-level if/try too), and with
    probes=True the names an optional backend gives it (`try: from torch.distributed... import DTensor`)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Try) and not probes:
            continue
        for n in ([node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                for target in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    names.update(x.id for x in ast.walk(target) if isinstance(x, ast.Name))
            elif probes and isinstance(n, ast.ImportFrom) and n.level == 0 and node is not n:
                names.update(a.asname or a.name for a in n.names)    # an optional backend probed in a try
    return names


def _trees():
    return {m: ast.parse(p.read_text(), filename=str(p)) for m, p in MODULES.items()}


def _here(f):
    """The dotted module name of a file inside the package, None for one outside it."""
    return ".".join(f.relative_to(PKG).with_suffix("").parts) if PKG in f.parents else None


def _outside_files():
    root = PKG.parent
    return sorted(root.glob("train_*.py")) + sorted((root / "tests").glob("*.py")) + sorted((root / "bench").glob("*.py")) \
        + sorted((root / "dev").glob("*.py")) + sorted((root / "scripts").glob("*.py"))


def test_every_name_is_imported_from_the_module_that_defines_it():
    """One address per name: `from nano_rlhf.X import name` (or `from .X import name`) names a module, or a
    name X defines, never one X only imports (a re-export); scripts, tests, bench/, dev/ and scripts/ are held to
    it too."""
    trees = _trees()
    defined = {m: _defined(t) for m, t in trees.items()}
    wrong = []
    for f in list(MODULES.values()) + _outside_files():
        here = _here(f)
        for n in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if not isinstance(n, ast.ImportFrom):
                continue
            for m, name in _resolved(n, here):
                if m is None:
                    wrong.append(f"{f.relative_to(PKG.parent)}:{n.lineno}: no module {name}")
                elif name is not None and (m not in defined or name not in defined[m]):
                    wrong.append(f"{f.relative_to(PKG.parent)}:{n.lineno}: {name} is not defined in nano_rlhf/"
                                 f"{m.replace('.', '/')}.py")
    assert not wrong, "\n".join(wrong)


def test_every_module_attribute_used_is_defined_there():
    """The same for `from nano_rlhf import X` / `import nano_rlhf.X as M` followed by `X.name` in the package, the
    scripts, bench/, dev/ and scripts/: name is defined in X, not merely imported there. (Tests may reach a
    module's binding of an imported name: that is how a test patches what the module calls.)"""
    trees = _trees()
    defined = {m: _defined(t) for m, t in trees.items()}
    root = PKG.parent
    files = list(MODULES.values()) + [f for f in _outside_files() if f.parent != root / "tests"]
    wrong = []
    for f in files:
        tree = ast.parse(f.read_text(), filename=str(f))
        here, alias = _here(f), {}
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                for a, (m, name) in zip(n.names, _resolved(n, here)):
                    if name is None and m in MODULES:
                        alias[a.asname or a.name] = m
            elif isinstance(n, ast.Import):
                alias.update({a.asname: a.name.split(".", 1)[1] for a in n.names
                              if a.asname and a.name.startswith("nano_rlhf.") and a.name.split(".", 1)[1] in MODULES})
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in alias:
                m = alias[n.value.id]
                if n.attr not in defined[m] and not n.attr.startswith("__"):
                    wrong.append(f"{f.relative_to(root)}:{n.lineno}: {n.value.id}.{n.attr} is not defined in "
                                 f"nano_rlhf/{m.replace('.', '/')}.py")
    assert not wrong, "\n".join(sorted(set(wrong)))


# Defined in several modules on purpose (docs/design.md lists them): the entry points of the tools (main, their
# command line and its check, as in every script), and what every task implements: its reward, its prompt, its
# files and the phrasings of its prompts.
PROTOCOL = {"main", "Options", "check_options", "reward", "make_prompt", "write_dataset", "PHRASINGS"}


def test_no_public_name_is_defined_in_two_package_modules():
    where = {}
    for m, tree in _trees().items():
        for name in _defined(tree, probes=False):
            if not name.startswith("_") and name not in PROTOCOL:
                where.setdefault(name, []).append(m)
    twice = {name: ms for name, ms in where.items() if len(ms) > 1}
    assert not twice, twice


def test_no_script_imports_another_script():
    root = PKG.parent
    scripts = {p.stem for p in root.glob("train_*.py")}
    found = [f"{p.name} imports {n}" for p in sorted(root.glob("train_*.py"))
             for node in ast.walk(ast.parse(p.read_text())) for n in _imported_scripts(node, scripts)]
    assert not found, found


COMMANDS = {"evaluate", "label", "merge", "summary", "plot"}     # python -m nano_rlhf.X: leaves of the graph
TASKS = {m for m in MODULES if m.startswith("tasks.")}            # the built-in tasks and their shared protocol


def test_no_core_module_imports_a_command():
    """The commands are leaves: a core module (neither a command nor a task) never imports one, so the
    training path does not depend on what evaluation or labelling prints."""
    graph = import_graph()
    found = sorted(f"{m} imports {c}" for m, deps in graph.items() if m not in COMMANDS | TASKS
                   for c in deps & COMMANDS)
    assert not found, found


def test_a_task_imports_only_chat_cli_and_tasks_common():
    """A task knows no model, tokenizer or training (tasks/common.py says its protocol): its package imports are
    the templates' text (chat), its command line (cli) and the shared helpers (tasks.common)."""
    graph = import_graph()
    found = sorted(f"{m} imports {d}" for m in TASKS for d in graph[m] - {"chat", "cli", "tasks.common"})
    assert not found, found
    assert sorted(MODULES) == sorted(m for m in MODULES if "." not in m or m in TASKS), "a subpackage besides tasks/"


def test_every_option_is_declared_in_its_script_or_with_the_shared_run_options():
    """An algorithm's flags live in its script (a fork edits one file): every field of a script's Options is
    declared, as --help reads it (the most derived class that annotates it), in the script itself or in
    nano_rlhf/cli.py's shared run options, never in a package room."""
    import dataclasses
    import importlib
    outside = []
    for p in sorted(PKG.parent.glob("train_*.py")):
        module = importlib.import_module(p.stem)
        for f in dataclasses.fields(module.Options):
            home = next(c for c in module.Options.__mro__ if f.name in vars(c).get("__annotations__", {}))
            if home.__module__ not in (module.__name__, "nano_rlhf.cli"):
                outside.append(f"{p.name}: --{f.name} in {home.__module__}")
    assert not outside, outside


def _imported_scripts(node, scripts):
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in scripts]
    if isinstance(node, ast.ImportFrom) and node.level == 0:
        return [node.module] if node.module in scripts else []
    return []


def test_package_and_script_lines_fit_120_characters():
    files = sorted(PKG.rglob("*.py")) + sorted(PKG.parent.glob("train_*.py"))
    long = [f"{p.relative_to(PKG.parent)}:{i}" for p in files
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > 120]
    assert not long, "lines over 120 characters: " + ", ".join(long)


# A script stands alone (every loss and gather it uses is in its own file), so a few are copies: each copy must
# stay identical to its original, so that a fix to one fails here until every copy has it.
COPIES = [("train_dpo", "train_listwise", ["_scored_logps", "row_sums", "sequence_logps"]),
          ("train_dpo", "train_unpaired", ["_scored_logps", "row_sums", "sequence_logps"]),
          ("train_dpo", "train_online", ["dpo_loss", "robust_loss", "ipo_loss", "hinge_loss", "rdpo_loss",
                                         "simpo_loss", "cpo_loss", "log_odds", "orpo_loss", "pair_loss", "nll_weight",
                                         "REFERENCE_FREE", "DEFAULT_BETA"]),
          ("train_ppo", "train_online", ["response_logprobs"]),
          ("train_ppo", "train_ppo_lagrangian", [
              "GROUP", "WHITENED", "LossAgg", "response_logprobs", "kl_estimate", "token_rewards", "gae",
              "reward_to_go", "masked_sums", "masked_sq_dev", "masked_whiten", "explained_variance", "rloo_advantages",
              "grpo_advantages", "dr_grpo_advantages", "sequence_kl", "advantages", "policy_loss", "value_loss",
              "aggregate_loss", "minibatch_counts", "AdaptiveKL", "token_mean_scale", "scores_from_reward",
              "group_spread", "ptx_backward", "whiten_over_ranks", "explained_variance_over_ranks", "LOSS_KEYS"])]


def _top_level_source(path, name):
    src = path.read_text()
    for node in ast.parse(src).body:
        targets = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if name in targets:
            return ast.get_source_segment(src, node)
    return None


def test_copied_functions_are_identical_to_their_originals():
    root = PKG.parent
    for original, copy, names in COPIES:
        for name in names:
            a = _top_level_source(root / f"{original}.py", name)
            b = _top_level_source(root / f"{copy}.py", name)
            assert a is not None and a == b, f"{copy}.py's {name} differs from {original}.py's"


def test_ci_lints_before_the_tests_and_an_unused_import_fails_it(tmp_path):
    """.ci/run runs ruff (pyproject.toml's rules: pyflakes, the import rules, no noqa the linter does not need)
    before the test suite, and with those rules an unused import is an error."""
    import shutil
    import subprocess
    root = PKG.parent
    lines = [ln.split("#")[0].strip() for ln in (root / ".ci" / "run").read_text().splitlines()]
    assert lines.index("ruff check .") < next(i for i, ln in enumerate(lines) if "pytest" in ln)
    ruff = shutil.which("ruff")
    assert ruff, "ruff is a test dependency (requirements-dev.txt)"
    (tmp_path / "bad.py").write_text("import os\n\n\ndef f():\n    return 1\n")
    p = subprocess.run([ruff, "check", "--config", str(root / "pyproject.toml"), str(tmp_path / "bad.py")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "F401" in p.stdout, p.stdout + p.stderr
    clean = subprocess.run([ruff, "check", "."], cwd=root, capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout
