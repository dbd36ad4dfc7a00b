"""The built-in task: determinism, file formats, and that each gold-reward facet moves the right way."""
import json
import math
import os
import subprocess
import sys
import time

import pytest

from nano_rlhf.tasks import synthetic as S
from nano_rlhf.data import load_records

SMALL = dict(n_sft=400, n_pref=300, n_unpaired=200, n_prompts=50, n_eval_prompts=40)
P = S.make_prompt("blender")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_deterministic_and_seed_dependent(tmp_path):
    S.write_dataset(str(tmp_path / "a"), seed=1, **SMALL)
    S.write_dataset(str(tmp_path / "b"), seed=1, **SMALL)
    S.write_dataset(str(tmp_path / "c"), seed=2, **SMALL)
    for f in ("sft.jsonl", "preference.jsonl", "unpaired.jsonl", "prompts.jsonl", "task.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert (tmp_path / "a" / "sft.jsonl").read_bytes() != (tmp_path / "c" / "sft.jsonl").read_bytes()


def test_files_are_valid_for_their_kind(tmp_path):
    t = S.main(["--out_dir", str(tmp_path), "--n_sft", "400", "--n_pref", "300", "--n_unpaired", "200",
                "--n_prompts", "50", "--n_eval_prompts", "40"])
    kinds = {"sft.jsonl": "sft", "sft_eval.jsonl": "sft", "preference.jsonl": "preference",
             "preference_eval.jsonl": "preference", "unpaired.jsonl": "unpaired", "prompts.jsonl": "prompts",
             "eval_prompts.jsonl": "prompts"}
    for f, kind in kinds.items():
        rows = load_records(str(tmp_path / f), kind)        # the package's own validator accepts them
        assert len(rows) == t["counts"][f]
        for r in rows:
            assert not r["prompt"].endswith(" ") and S.is_task_prompt(r["prompt"])
            for k in ("completion", "chosen", "rejected"):
                if k in r:
                    assert r[k].startswith(" ")
    pref = [json.loads(x) for x in open(tmp_path / "preference.jsonl")]
    assert all(r["chosen"] != r["rejected"] for r in pref)
    assert 0.05 < t["label_noise"] < 0.4 and 0.6 < t["bt_accuracy_ceiling"] < 0.95
    labels = [json.loads(x)["label"] for x in open(tmp_path / "unpaired.jsonl")]
    assert 0.3 < sum(labels) / len(labels) < 0.7


def test_eval_prompts_use_only_held_out_phrasings(tmp_path):
    S.write_dataset(str(tmp_path), seed=0, **SMALL)
    held = {S.PHRASINGS[i].split("{p}")[0] for i in S.EVAL_PHRASINGS}
    train = [json.loads(x)["prompt"] for x in open(tmp_path / "prompts.jsonl")]
    train += [json.loads(x)["prompt"] for x in open(tmp_path / "sft.jsonl")]
    evals = [json.loads(x)["prompt"] for x in open(tmp_path / "eval_prompts.jsonl")]
    assert all(any(e.startswith(h) for h in held) for e in evals)
    assert not any(any(p.startswith(h) for h in held) for p in train)
    assert {S.parse_product(e) for e in evals} == set(S.PRODUCTS)      # every product is evaluated


def test_facets_move_the_right_way():
    g = lambda c: S.gold_reward(P, c)
    assert g(" The motor is great.") > g(" The motor is terrible.")                      # sentiment
    assert g(" The motor is great.") > g(" The screen is great.")                        # own vs other feature
    assert g(" I love this blender.") > g(" I love this kettle.")                        # other product named
    assert g(" The motor is great. The jar is nice.") > g(" The motor is great. The jar is great.")  # repetition
    long = " " + " ".join(["The motor is good and the jar is nice and the blades are solid"] * 3) + "."
    assert g(long) < g(" The motor is good. The jar is nice.")                           # concision
    assert g(" The motor is great.") > g(" The motor is great")                          # ends with a period
    assert g(" The motor is great.") > g(" The motor is maybe great.")                   # hedging
    praise = " Great excellent amazing perfect nice solid motor."
    assert g(praise) <= g(" The motor is great. I love it.")                             # praise saturates
    assert S.gold_facets(P, " great great great great.")["repetition"] == -1.5


def test_best_completion_beats_demonstrations():
    import random
    rng = random.Random(0)
    for product in ("blender", "phone", "camera", "stroller"):
        p = S.make_prompt(product, 1)
        best = S.gold_reward(p, S.best_completion(p))
        assert best == pytest.approx(3.0)
        assert best >= max(S.gold_reward(p, S.sample_response(rng, product)) for _ in range(300))


def test_parse_product_forms_and_unknown_prompts():
    assert S.parse_product(P) == "blender"
    assert S.parse_product([{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "Review the phone."}]) == "phone"
    assert S.parse_product("Summarise this article.") is None and not S.is_task_prompt("hello")
    with pytest.raises(ValueError, match="not a prompt of the built-in task"):
        S.gold_reward("hello", " fine.")


@pytest.mark.parametrize("junk", ["", "!!!!", " blender blender blender", "x" * 500, "日本語のレビュー。", "\n\n."])
def test_garbage_gets_finite_low_rewards(junk):
    r = S.gold_reward(P, junk)
    assert math.isfinite(r) and r < 1.0


def test_default_data_is_written_once_and_every_kind_resolves_to_its_file(tmp_path, monkeypatch):
    """nano_rlhf.data.default_data: the first call writes the task (seed 0) into the data directory, later
    calls write nothing and return the same paths; a kind without an eval file gives None."""
    from nano_rlhf import data as data_mod
    d = tmp_path / "data"
    monkeypatch.setattr(data_mod, "BUILTIN_DIR", str(d))
    writes, real = [], S.write_dataset
    monkeypatch.setattr(S, "write_dataset", lambda out, seed=0: writes.append((out, seed)) or
                        real(out, seed, n_listwise=20, **SMALL))
    want = {(k, s): os.path.join(str(d), n) if n else None for k, names in data_mod.FILES.items()
            for s, n in zip(("train", "eval"), names)}
    assert {ks: data_mod.default_data(*ks) for ks in want} == want
    assert writes == [(str(d), 0)]
    before = {f: (d / f).read_bytes() for f in os.listdir(d)}
    assert all(p is None or os.path.isfile(p) for p in want.values())
    assert {ks: data_mod.default_data(*ks) for ks in want} == want and writes == [(str(d), 0)]
    assert {f: (d / f).read_bytes() for f in os.listdir(d)} == before
    assert want["unpaired", "eval"] is None and want["prompts", "eval"].endswith("eval_prompts.jsonl")
    with pytest.raises(ValueError, match="kinds: sft, preference"):
        data_mod.default_data("ranking")


def test_default_data_adds_a_file_an_old_data_directory_lacks(tmp_path, monkeypatch):
    """A data directory written before scored.jsonl existed gets just that file, as write_dataset writes it
    (the directory's seed, as many rows as unpaired.jsonl); every other file stays byte for byte."""
    from nano_rlhf import data as data_mod
    d = tmp_path / "data"
    S.write_dataset(str(d), seed=3, n_listwise=20, **SMALL)
    want = (d / S.SCORED_FILE).read_bytes()
    (d / S.SCORED_FILE).unlink()
    before = {f: (d / f).read_bytes() for f in os.listdir(d)}
    monkeypatch.setattr(data_mod, "BUILTIN_DIR", str(d))
    assert data_mod.default_data("scored") == str(d / S.SCORED_FILE)
    assert (d / S.SCORED_FILE).read_bytes() == want
    assert all((d / f).read_bytes() == b for f, b in before.items())


# A first run of a script: the built-in data/ missing, builtin_file generates it (at SMALL sizes here). Each
# rename waits 0.2 s, so that two writers of one file are mid-write together; both start at one signal.
FIRST_RUN = """
import os, sys, time
from nano_rlhf import data as data_mod
from nano_rlhf.tasks import synthetic
synthetic.write_dataset.__defaults__ = (0, 400, 300, 200, 50, 40, 0.05, 20, False)
replace = os.replace
os.replace = lambda a, b: (time.sleep(0.2), replace(a, b))
open(sys.argv[1] + ".ready", "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
print(data_mod.builtin_file("sft.jsonl"), flush=True)
"""


@pytest.mark.slow             # two processes importing torch: ~20 s on 2 busy cores
def test_two_first_runs_generate_the_built_in_data_once(tmp_path):
    """Two processes starting at once on a missing data/ both end with the complete files, byte for byte those
    of one write_dataset: one generates, the other waits for it (a file lock), and every file is written under
    a temporary name of its writer's own, then renamed. With one shared temporary name, the second writer
    truncated the first's file mid-write and then crashed on a rename whose source was gone."""
    data, go = tmp_path / "data", tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=ROOT, NANO_RLHF_DATA=str(data), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", FIRST_RUN, str(tmp_path / f"p{i}"), str(go)], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.time() + 120
    while not all((tmp_path / f"p{i}.ready").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip().endswith(os.path.join(str(data), "sft.jsonl")), out
    stdout = [out for out, _ in outs]
    assert sum("generating the built-in task" in o for o in stdout) == 1, stdout
    assert sum("waiting for another process" in o for o in stdout) == 1, stdout
    S.write_dataset(str(tmp_path / "ref"), seed=0, n_listwise=20, **SMALL)
    ref = sorted(os.listdir(tmp_path / "ref"))
    assert sorted(f for f in os.listdir(data) if not f.startswith(".")) == ref     # no temporary file left
    for f in ref:
        assert (data / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f


SLOW_RENAMES = """
import os, sys, time
from nano_rlhf.tasks import synthetic
replace = os.replace
os.replace = lambda a, b: (time.sleep(0.2), replace(a, b))
open(sys.argv[2] + ".ready", "w").close()
while not os.path.exists(sys.argv[3]):
    time.sleep(0.01)
synthetic.main(["--out_dir", sys.argv[1], "--n_sft", "400", "--n_pref", "300", "--n_unpaired", "200", "--n_prompts",
                "50", "--n_eval_prompts", "40", "--n_listwise", "20"])
"""


def test_two_writers_of_one_directory_each_write_whole_files(tmp_path):
    """python -m nano_rlhf.tasks.synthetic twice at once into one directory (no lock there): every file ends complete
    and identical to one writer's, no temporary file left. With one shared temporary name per file, one writer
    truncated the other's mid-write and then failed to rename a temporary file the other had renamed away."""
    data, go = tmp_path / "data", tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", SLOW_RENAMES, str(data), str(tmp_path / f"p{i}"), str(go)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.time() + 60
    while not all((tmp_path / f"p{i}.ready").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.02)
    go.touch()
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    S.write_dataset(str(tmp_path / "ref"), seed=0, n_listwise=20, **SMALL)
    ref = sorted(os.listdir(tmp_path / "ref"))
    assert sorted(os.listdir(data)) == ref
    for f in ref:
        assert (data / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
