"""The README and docs/ point only at what exists: every relative Markdown link and image in README.md, docs/**/*.md
and results/**/*.md names a file or folder of the repository (the #anchor stripped; http(s) and mailto links are not
followed), and every `results/...` path the README or a docs page mentions, in a link or in code, exists (a `*` in
it must match something). So a moved or renamed file fails here, not in a reader's browser."""
import glob
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("results/**/*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)           # fenced code blocks
CODE = re.compile(r"(`+).+?\1", re.S)                            # inline code spans
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+[\"'(].*?[\"')])?\s*\)")
REF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+[\"'(].*?[\"')])?\s*$", re.M)   # [name]: target
RESULTS = re.compile(r"(?<![\w/.\-])results/[^\s`'\"()\[\]<>,;|]*")


def prose(text):
    """The page without its code: links are not links inside code."""
    return CODE.sub("", FENCE.sub("", text))


def targets(text):
    """Every link and image target of a page, in order."""
    t = prose(text)
    return [m.group(1) for m in LINK.finditer(t)] + [m.group(1) for m in REF.finditer(t)]


def is_external(target):
    return re.match(r"^[a-z][a-z0-9+.\-]*:", target, re.I) is not None     # http:, https:, mailto:, ...


def results_paths(text):
    """Every results/... path mentioned, in prose, links or code, without the sentence's closing punctuation."""
    return sorted({m.group(0).rstrip(".:") for m in RESULTS.finditer(text)})


def exists(rel):
    """A path relative to the repository root exists; one with a * must match at least one path."""
    return bool(glob.glob(str(ROOT / rel))) if "*" in rel else (ROOT / rel).exists()


def test_the_pages_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/results.md", "docs/usage.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_image_resolves(page):
    broken = []
    for target in targets(page.read_text(encoding="utf-8")):
        if is_external(target):
            continue
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not path:                                             # "#anchor": this page
            continue
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


@pytest.mark.parametrize("page", [p for p in PAGES if not p.is_relative_to(ROOT / "results")],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_results_path_mentioned_exists(page):
    missing = [p for p in results_paths(page.read_text(encoding="utf-8")) if not exists(p)]
    assert not missing, f"{page.relative_to(ROOT)}: names results that are not there: {missing}"


def test_the_checks_catch_what_they_are_for():
    text = ("See [a](docs/usage.md#x), ![b](docs/gold_vs_kl.png \"t\"), [c](https://x.org/y), [d](#here), "
            "`[not a link](nowhere.md)`, `results/ifeval/s1_avx2_float32/`, results/bench/run4.*, and results/nope.\n"
            "```\n[fenced](nowhere.md)\n```\n[ref]: docs/results.md\n")
    assert targets(text) == ["docs/usage.md#x", "docs/gold_vs_kl.png", "https://x.org/y", "#here", "docs/results.md"]
    assert results_paths(text) == ["results/bench/run4.*", "results/ifeval/s1_avx2_float32/", "results/nope"]
    assert exists("results/bench/run4.*") and exists("results/ifeval/s1_avx2_float32/") and not exists("results/nope")
    assert results_paths("out/reasoning/results.json, seedN/results.json, bench/results/") == []
