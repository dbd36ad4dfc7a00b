"""Packaging: pyproject.toml installs the package with exactly requirements.txt's runtime dependencies and the data
files the package reads at run time; LICENSE is MIT and names the fixtures it does not cover, whose README lists
every one of them."""
import fnmatch
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:                                                   # requires-python is >= 3.10; tomllib came in 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "nano_rlhf"
FIXTURES = ROOT / "tests" / "fixtures" / "chat_templates"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(path):
    """The requirement lines of a requirements file: comments, blank lines and `-r` / `-c` lines dropped."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def _normal(req):
    """'Tokenizers >= 0.19' -> 'tokenizers>=0.19' (PEP 503 name, no spaces)."""
    name, spec = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(.*)", req.replace(" ", "")).groups()
    return re.sub(r"[-_.]+", "-", name).lower() + spec


def test_dependencies_are_requirements_txt():
    deps = [_normal(d) for d in PYPROJECT["project"]["dependencies"]]
    reqs = [_normal(r) for r in _requirements(ROOT / "requirements.txt")]
    assert sorted(deps) == sorted(reqs), (deps, reqs)
    assert {d.split(">")[0].split("=")[0] for d in deps} == {"torch", "numpy", "tokenizers", "safetensors"}


def test_metadata():
    project = PYPROJECT["project"]
    assert project["name"] == "nano_rlhf" and project["readme"] == "README.md"
    assert project["requires-python"] == ">=3.10"
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert PYPROJECT["build-system"]["build-backend"] == "setuptools.build_meta"
    assert "scripts" not in project        # the train_*.py scripts run from a clone; nothing else is installed
    assert "pytest" not in PYPROJECT.get("tool", {})     # pytest.ini stays the only pytest configuration


def test_packages_found_are_nano_rlhf_and_its_subpackages():
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert "nano_rlhf*" in include or "nano_rlhf" in include
    for d in PKG.rglob("__init__.py"):
        name = ".".join(d.parent.relative_to(ROOT).parts)
        assert any(fnmatch.fnmatchcase(name, pat) for pat in include), name
    for top in ("tests", "bench", "results", "docs", "scripts", "data"):
        assert not any(fnmatch.fnmatchcase(top, pat) for pat in include), top


def _data_files():
    """The package's non-Python files (READMEs aside): the data it reads at run time."""
    return sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*")
                  if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
                  and not p.name.lower().startswith("readme"))


def test_package_data_covers_the_files_the_code_reads():
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["nano_rlhf"]
    files = _data_files()
    assert "templates/judge_default.txt" in files
    source = "\n".join(p.read_text() for p in PKG.rglob("*.py"))
    assert "judge_default.txt" in source                 # reward.py's DEFAULT_TEMPLATE: opened at run time
    missing = [f for f in files if not any(fnmatch.fnmatchcase(f, g) for g in globs)]
    assert not missing, f"nano_rlhf/ data files not in [tool.setuptools.package-data]: {missing}"


def test_license_is_mit_and_names_the_fixtures_readme():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "the nano_rlhf authors" in text
    assert "tests/fixtures/chat_templates/README.md" in text
    assert (FIXTURES / "README.md").is_file()


def test_fixtures_readme_names_every_fixture_and_its_licence():
    readme = (FIXTURES / "README.md").read_text()
    files = sorted(p.name for p in FIXTURES.iterdir() if p.is_file() and p.name != "README.md")
    assert files, FIXTURES
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\|\s*`([^`]+)`\s*\|[^|]*\|\s*([^|]*?)\s*\|\s*$",
                                                          readme, re.M)}
    assert sorted(rows) == files, (sorted(rows), files)
    assert all(rows.values()), rows                      # each row names a licence
