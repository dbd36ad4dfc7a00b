"""Package layout: the module dependency graph of nano_rlhf/ has no cycles (issue 24).

Every `import` / `from ... import` at any depth counts, function-local ones included: a
cycle hidden behind an import inside a function is still a cycle.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "nano_rlhf"


def _imported(node):
    """The top-level names, as written, that one import node refers to inside nano_rlhf."""
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1] for a in node.names if a.name.startswith("nano_rlhf.")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 1 or (node.level == 0 and node.module == "nano_rlhf"):
        if node.level == 1 and node.module:  # from .x import y / from .x.z import y
            return [node.module.split(".")[0]]
        return [a.name for a in node.names]  # from . import x / from nano_rlhf import x
    if node.level == 0 and node.module and node.module.startswith("nano_rlhf."):
        return [node.module.split(".")[1]]
    return []


def import_graph():
    """{module: set of nano_rlhf modules it imports}."""
    mods = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    graph = {}
    for m in sorted(mods):
        tree = ast.parse((PKG / f"{m}.py").read_text(), filename=f"nano_rlhf/{m}.py")
        graph[m] = {n for node in ast.walk(tree) for n in _imported(node) if n in mods and n != m}
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
    """The parser itself: relative, absolute and function-local imports all make edges; others do not."""
    src = ("import os\nimport nano_rlhf.a\nfrom nano_rlhf import b\nfrom nano_rlhf.c.x import y\n"
           "from . import d, e\nfrom .f import z\nfrom torch import nn\nfrom .. import nope\n"
           "def fn():\n    from .g import w\n")
    found = {n for node in ast.walk(ast.parse(src)) for n in _imported(node)}
    assert found == {"a", "b", "c", "d", "e", "f", "g"}, found
    assert "model" in import_graph()["evaluate"]


def test_package_has_no_import_cycles():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, (
        "import cycle in nano_rlhf/: " + " -> ".join(cycle)
        + "\nmove the shared piece to the module it belongs to (or a leaf) instead of a local import")


# Names that moved when a package file was split (issue 24) and stay importable from where the scripts, the
# other modules and the tests import them today: (old module, new module, names). The lead moves the imports later.
MOVED = [
    ("model", "layers", ["upcast", "in_vocabulary", "document_attention", "rope_frequencies", "_Block", "attend",
                         "is_right_padded", "padding_attention", "full_attention", "RMSNorm", "Block", "LlamaBlock"]),
    ("model", "gpt_config", ["GPTConfig", "check_config", "ARCHITECTURES"]),
    ("hf_io", "gpt_config", ["GPTConfig", "check_config", "ARCHITECTURES", "config_from_hf", "model_type_of"]),
    ("data", "jsonl", ["DataError", "KINDS", "read_jsonl", "finite_number", "validate", "load_records", "split_off",
                       "load_train_eval", "validate_listwise", "is_listwise_file", "listwise_to_pairs",
                       "validate_scored", "load_scored"]),
    ("parallel", "memory", ["FROZEN_CHOICES", "PRESETS", "STRATEGIES", "memory_plan", "preset_config", "count_params",
                            "ppo_models", "gib", "format_plan", "plan_table", "startup_plan", "main"]),
    ("parallel", "sharded", ["shard_rows", "save_sharded", "TensorSource", "read_like", "load_model",
                             "optimizer_tensors", "load_optimizer", "_optim_from_flat"]),
    ("tokenizer", "bpe", ["TRAIN_MAX_CHARS", "TRAIN_MAX_WORD", "_for_training", "fingerprint"]),
]


def test_moved_names_are_the_same_objects_at_their_old_address():
    import importlib
    for old, new, names in MOVED:
        a, b = importlib.import_module(f"nano_rlhf.{old}"), importlib.import_module(f"nano_rlhf.{new}")
        for name in names:
            assert getattr(a, name) is getattr(b, name), f"nano_rlhf.{old}.{name} is not nano_rlhf.{new}.{name}"


def test_run_methods_from_reporting_are_run_methods():
    from nano_rlhf import reporting, run
    for name in ("log", "log_samples", "_progress", "_import_backend", "_open_backend"):
        assert getattr(run.Run, name) is getattr(reporting.Reporting, name), name


def test_package_and_script_lines_fit_120_characters():
    files = sorted(PKG.glob("*.py")) + sorted(PKG.parent.glob("train_*.py"))
    long = [f"{p.relative_to(PKG.parent)}:{i}" for p in files
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > 120]
    assert not long, "lines over 120 characters: " + ", ".join(long)
