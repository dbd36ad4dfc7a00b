"""PAFT merge tool (nano_rlhf/merge.py): TIES and task arithmetic against float64 references written from
the papers' description, the CLI end to end, bad inputs."""
import json
import math
import os

import pytest
import torch
from conftest import run, tiny_config, tiny_model

from nano_rlhf.merge import main, task_arithmetic, ties_merge
from nano_rlhf.model import GPT, ScoreModel


# ---- float64 references: plain Python over the flattened entries -----------------------------------

def ref_trim(values, density):
    """Keep the k = max(1, floor(density*n + 1/2)) largest magnitudes; every entry tied with the k-th is kept."""
    k = max(1, math.floor(density * len(values) + 0.5))
    threshold = sorted((abs(v) for v in values), reverse=True)[k - 1]
    return [v if abs(v) >= threshold else 0.0 for v in values]


def sign(v):
    return (v > 0) - (v < 0)


def ref_ties(base, thetas, weights, density, scale):
    taus = [ref_trim([t - b for t, b in zip(theta, base)], density) for theta in thetas]
    out = []
    for j, b in enumerate(base):
        elected = sign(sum(w * tau[j] for w, tau in zip(weights, taus)))
        agree = [(w, tau[j]) for w, tau in zip(weights, taus) if tau[j] != 0 and sign(tau[j]) == elected]
        merged = sum(w * v for w, v in agree) / sum(w for w, _ in agree) if agree else 0.0
        out.append(b + scale * merged)
    return out


def ties_ref_sd(base_sd, sds, weights, density, scale):
    out = {}
    for k, b in base_sd.items():
        vals = ref_ties(b.flatten().tolist(), [sd[k].flatten().tolist() for sd in sds], weights, density, scale)
        out[k] = torch.tensor(vals, dtype=torch.float64).view(b.shape)
    return out


# ---- the math ----------------------------------------------------------------------------------------

def test_ties_hand_example():
    base = {"w": torch.full((6,), 1.0, dtype=torch.float64)}
    tau1 = torch.tensor([3.0, -2.0, 2.0, 0.0, 2.0, -0.5], dtype=torch.float64)   # |.| >= 2 kept: a tie makes 4 of k=3
    tau2 = torch.tensor([-1.0, -4.0, 1.0, 0.0, -3.0, 5.0], dtype=torch.float64)  # trimmed to [0, -4, 0, 0, -3, 5]
    sds = [{"w": base["w"] + tau1}, {"w": base["w"] + tau2}]
    got = ties_merge(base, sds, [1.0, 1.0], density=0.5)["w"]
    # elected signs + - + 0 - +; entry 0: only model 1 agrees (model 2 trimmed); entry 1: both, mean -3;
    # entry 3: all zero; entry 4: model 1's +2 disagrees and is dropped (disjoint mean of model 2 alone)
    assert got.tolist() == [4.0, -2.0, 3.0, 1.0, -2.0, 6.0]
    got = ties_merge(base, sds, [3.0, 1.0], density=0.5, scale=0.5)["w"]
    # weight 3 on model 1 flips entry 4's election to +; entry 1: (3*-2 + 1*-4) / 4 = -2.5
    assert got.tolist() == [1 + 0.5 * 3, 1 - 0.5 * 2.5, 1 + 0.5 * 2, 1.0, 1 + 0.5 * 2, 1 + 0.5 * 5]


@pytest.mark.parametrize("density", [0.1, 0.35, 0.5, 1.0])
def test_ties_matches_float64_reference(density):
    g = torch.Generator().manual_seed(0)
    # integer-valued task vectors: many ties at the trim threshold and many exact sign cancellations
    base = {"a": torch.randn(7, 5, generator=g, dtype=torch.float64), "b": torch.randn(13, generator=g, dtype=torch.float64)}
    sds = [{k: v + torch.randint(-3, 4, v.shape, generator=g).double() for k, v in base.items()} for _ in range(3)]
    weights, scale = [1.0, 0.3, 2.0], 0.7                       # 0.3: not a float32 number
    got = ties_merge(base, sds, weights, density, scale)
    want = ties_ref_sd(base, sds, weights, density, scale)
    for k in base:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-12), k


def test_ties_edge_cases():
    base = {"w": torch.randn(4, 4, dtype=torch.float64), "step": torch.tensor([7])}
    same = {"w": base["w"].clone(), "step": torch.tensor([9])}
    got = ties_merge(base, [same, same], [1.0, 1.0], density=0.2)
    assert torch.equal(got["w"], base["w"])                          # all-zero task vectors: the base
    assert torch.equal(got["step"], base["step"])                    # non-float tensors come from the base
    one = {"w": base["w"] + torch.randn(4, 4, dtype=torch.float64), "step": base["step"]}
    got = ties_merge(base, [one], [0.3], density=1.0)               # one model, nothing trimmed: itself
    assert torch.allclose(got["w"], one["w"], rtol=0, atol=1e-12)
    f32 = {"w": base["w"].float()}
    assert ties_merge(f32, [{"w": one["w"].float()}], [1.0], 0.5)["w"].dtype == torch.float32


def test_task_arithmetic_exact():
    g = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(6, 4, generator=g), "n": torch.tensor([3])}
    sds = [{"w": base["w"] + 0.01 * torch.randn(6, 4, generator=g), "n": torch.tensor([5])} for _ in range(3)]
    weights = [0.5, -1.0, 2.0]                                        # a negative weight subtracts a task
    got = task_arithmetic(base, sds, weights)
    b64 = base["w"].double()
    want = b64.clone()
    for sd, w in zip(sds, weights):
        want = want + w * (sd["w"].double() - b64)
    assert torch.equal(got["w"], want.float()) and got["w"].dtype == torch.float32
    assert torch.equal(got["n"], base["n"])


def test_merge_functions_reject_mismatch():
    base = {"w": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"model 0: w has shape \(4,\)"):
        task_arithmetic(base, [{"w": torch.zeros(4)}], [1.0])
    with pytest.raises(ValueError, match="density"):
        ties_merge(base, [{"w": torch.ones(3)}], [1.0], density=0.0)


# ---- the tool ----------------------------------------------------------------------------------------

def perturbed(model, seed, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tok):
    """A base policy (with tokenizer) and two 'fine-tuned' copies of it; the same for a reward model."""
    root = tmp_path_factory.mktemp("merge")
    d = {k: str(root / k) for k in ("base", "a", "b", "rm_base", "rm_a", "rm_b", "wide", "big")}
    tiny_model(tok).save_pretrained(d["base"])
    tok.save(os.path.join(d["base"], "tokenizer.json"))
    for i, k in enumerate(("a", "b")):
        perturbed(GPT.from_pretrained(d["base"]), seed=i + 1).save_pretrained(d[k])
    torch.manual_seed(3)
    ScoreModel(tiny_config(tok)).save_pretrained(d["rm_base"])
    for i, k in enumerate(("rm_a", "rm_b")):
        perturbed(ScoreModel.from_pretrained(d["rm_base"]), seed=i + 5).save_pretrained(d[k])
    tiny_model(tok, n_embd=48).save_pretrained(d["wide"])
    perturbed(GPT.from_pretrained(d["base"]), seed=7, scale=1e37).save_pretrained(d["big"])   # finite float32 deltas
    return d


def sd_of(model_dir):
    cls = ScoreModel if "rm" in os.path.basename(model_dir) else GPT
    return cls.from_pretrained(model_dir).state_dict()


def test_cli_ties_end_to_end(dirs, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = str(tmp_path / "paft")
    p = run(["-m", "nano_rlhf.merge", "--base", dirs["base"], "--models", dirs["a"], dirs["b"],
             "--weights", "1.0", "2.0", "--method", "ties", "--density", "0.3", "--out_dir", out])
    assert "merged 2 models" in p.stdout and not os.path.exists(out + ".tmp")
    want = ties_merge(sd_of(dirs["base"]), [sd_of(dirs["a"]), sd_of(dirs["b"])], [1.0, 2.0], 0.3, 1.0)
    merged = GPT.from_pretrained(out).eval()
    for k, v in merged.state_dict().items():
        assert torch.equal(v, want[k]), k
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(out, name)).read() == open(os.path.join(dirs["base"], name)).read()
    assert json.load(open(os.path.join(out, "merge_config.json")))["density"] == 0.3
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    x = torch.randint(0, merged.cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, merged(x), atol=1e-4)


def test_task_arithmetic_reward_model_and_overwrite(dirs, tmp_path, capsys):
    out = str(tmp_path / "rm_avg")
    args = ["--base", dirs["rm_base"], "--models", dirs["rm_a"], dirs["rm_b"], "--weights", "0.5", "0.5",
            "--method", "task_arithmetic", "--out_dir", out]
    main(args)
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["GPT2ForSequenceClassification"]
    want = task_arithmetic(sd_of(dirs["rm_base"]), [sd_of(dirs["rm_a"]), sd_of(dirs["rm_b"])], [0.5, 0.5])
    got = ScoreModel.from_pretrained(out).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want) and "score.weight" in got
    with pytest.raises(SystemExit):                                   # a non-empty out_dir is refused ...
        main(args)
    assert "not empty" in capsys.readouterr().err
    main(args[:-4] + ["--method", "ties", "--out_dir", out, "--overwrite"])   # ... unless --overwrite
    assert json.load(open(os.path.join(out, "merge_config.json")))["method"] == "ties"
    assert sorted(os.listdir(tmp_path)) == ["rm_avg"]                 # no .tmp / .old left behind


@pytest.mark.parametrize("case, needle", [
    ("shape", "n_embd=48"),
    ("weights", "--weights has 1 values for 2 --models"),
    ("density0", "--density must satisfy 0 < x <= 1 (got 0.0)"),
    ("density2", "--density must satisfy 0 < x <= 1 (got 1.5)"),
    ("class", "a ScoreModel directory"),
    ("missing", "no such model directory"),
    ("scale_ta", "--scale applies only with --method ties (got task_arithmetic); here it would be ignored"),
    ("density_ta", "--density applies only with --method ties (got task_arithmetic)"),
    ("negative_ties", "--weights must be > 0 for ties"),
    ("overflow_ta", "the merged model holds non-finite values"),        # finite weights, an infinite product
    ("overflow_ties", "the merged model holds non-finite values"),
    ("beyond_float32", "argument --weights: '1e308' is beyond float32's range"),
])
def test_bad_inputs_one_line(dirs, tmp_path, capsys, case, needle):
    """A bad command line (a range, an option given where it does not apply, --weights against the others) is
    exit 2, as for the training scripts; a bad input or an impossible merge exit 1."""
    m = [dirs["a"], dirs["b"]]
    extra = {"shape": (["--models", dirs["a"], dirs["wide"]], "ties"),
             "weights": (["--models", *m, "--weights", "1"], "ties"),
             "density0": (["--models", *m, "--density", "0"], "ties"),
             "density2": (["--models", *m, "--density", "1.5"], "ties"),
             "class": (["--models", dirs["a"], dirs["rm_a"]], "ties"),
             "missing": (["--models", dirs["a"], str(tmp_path / "nope")], "ties"),
             "scale_ta": (["--models", *m, "--scale", "2"], "task_arithmetic"),
             "density_ta": (["--models", *m, "--density", "0.2"], "task_arithmetic"),   # the default, typed
             "negative_ties": (["--models", *m, "--weights", "1", "-1e-3"], "ties"),
             "overflow_ta": (["--models", dirs["big"], dirs["big"], "--weights", "10", "10"], "task_arithmetic"),
             "overflow_ties": (["--models", dirs["big"], dirs["b"], "--scale", "100"], "ties"),
             "beyond_float32": (["--models", *m, "--weights", "1e308", "1e308"], "task_arithmetic")}[case]
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["--base", dirs["base"], *extra[0], "--method", extra[1], "--out_dir", str(out)])
    assert e.value.code == (2 if case in ("weights", "density0", "density2", "scale_ta", "density_ta",
                                          "negative_ties", "beyond_float32") else 1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    if case in ("shape", "class"):
        assert dirs["wide" if case == "shape" else "rm_a"] in err[0]   # names the offending directory
    assert not out.exists() and not os.path.exists(str(out) + ".tmp")


# ---- nothing lost: inputs, a training run's lock, --overwrite ------------------------------------------

def merge_args(dirs, out, *extra):
    return ["-m", "nano_rlhf.merge", "--base", dirs["base"], "--models", dirs["a"], dirs["b"], "--method", "ties",
            "--out_dir", str(out), *extra]


def listing(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("case", ["holds", "inside", "link"])
def test_out_dir_holding_or_inside_an_input_is_refused(dirs, tmp_path, case, capsys):
    """--overwrite on a directory that holds an input model (or lies inside one, or links to one) is one line,
    and nothing is touched: a merge into the parent of a partner used to delete the partner with the rest."""
    import shutil
    root = tmp_path / "p"
    shutil.copytree(dirs["a"], root / "a")
    shutil.copytree(dirs["base"], root / "base")
    d = dict(dirs, a=str(root / "a"), base=str(root / "base") if case == "inside" else dirs["base"])
    out, needle = {"holds": (root, f"holds the input --models {root / 'a'}"),
                   "inside": (root / "base" / "merged", f"is inside the input --base {root / 'base'}"),
                   "link": (tmp_path / "ln", f"is the input --models {root / 'a'}")}[case]
    if case == "link":
        os.symlink(root / "a", out)
    before = listing(root)
    with pytest.raises(SystemExit) as e:
        main(merge_args(d, out, "--overwrite")[2:])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: --out_dir") and needle in lines[0], lines
    assert listing(root) == before


def test_merge_and_a_training_run_respect_each_others_lock(dirs, tmp_path, monkeypatch, capsys):
    """A merge into the directory of a run in progress is refused (it holds out_dir/.lock), and a run cannot
    start into a directory a merge is writing (the merge holds the same lock)."""
    from conftest import sft_rows, write_jsonl
    from nano_rlhf import merge
    from nano_rlhf.checkpoint import OutDirLock
    out = tmp_path / "busy"
    out.mkdir()
    (out / "model.safetensors").write_text("the run's")
    held = OutDirLock(str(out))                 # what nano_rlhf.training takes for a training run
    assert held.acquire() is None
    with pytest.raises(SystemExit) as e:
        main(merge_args(dirs, out, "--overwrite")[2:])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {out} is in use by another run (pid {os.getpid()})"), err
    held.release()
    assert (out / "model.safetensors").read_text() == "the run's"

    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(8))
    seen = {}
    load = merge.load_models

    def load_while_a_run_starts(*a):            # a training run starting while the merge works
        seen["run"] = run(["train_sft.py", "--data", data, "--out_dir", str(out), "--overwrite", "--max_steps", "1",
                           "--n_layer", "1", "--n_head", "1", "--n_embd", "8", "--vocab_size", "64"], check=False)
        return load(*a)
    monkeypatch.setattr(merge, "load_models", load_while_a_run_starts)
    main(merge_args(dirs, out, "--overwrite")[2:])
    p = seen["run"]
    assert p.returncode != 0 and p.stderr.strip() == (f"error: {out} is in use by another run (pid {os.getpid()}); "
                                                       "wait for it to end or choose another --out_dir"), p.stderr
    assert json.load(open(out / "merge_config.json"))["method"] == "ties" and not (out / ".lock").exists()


def test_overwrite_replaces_the_model_files_and_keeps_the_rest(dirs, tmp_path, monkeypatch, capsys):
    """--overwrite replaces what a run or a merge writes (a previous run's state/ included) and nothing else; a
    merge that fails while writing puts the previous files back."""
    import shutil
    from nano_rlhf import merge
    out = tmp_path / "m"
    main(merge_args(dirs, out, "--weights", "1", "1")[2:])
    (out / "notes.txt").write_text("mine")
    (out / "state").mkdir()
    (out / "state" / "meta.json").write_text("{}")
    before = {f: (out / f).read_bytes() for f in listing(out)}
    copy = shutil.copyfile
    monkeypatch.setattr(merge.shutil, "copyfile", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(SystemExit) as e:
        main(merge_args(dirs, out, "--weights", "2", "1", "--overwrite")[2:])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and err == ["error: [Errno 28] No space left"], err
    assert {f: (out / f).read_bytes() for f in listing(out)} == before      # all back, nothing half-written
    monkeypatch.setattr(merge.shutil, "copyfile", copy)
    main(merge_args(dirs, out, "--weights", "2", "1", "--overwrite")[2:])
    assert (out / "notes.txt").read_text() == "mine" and not (out / "state").exists()
    assert json.load(open(out / "merge_config.json"))["weights"] == [2.0, 1.0]
    assert sorted(os.listdir(out)) == sorted(["notes.txt", *before.keys() - {"notes.txt", "state/meta.json"}])


def test_partner_with_another_tokenizer_of_the_same_size_is_refused(dirs, tmp_path, tok, capsys):
    import shutil
    from conftest import other_tokenizer
    c = tmp_path / "c"
    shutil.copytree(dirs["b"], c)
    other_tokenizer(tok, c)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["--base", dirs["base"], "--models", dirs["a"], str(c), "--method", "ties", "--out_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {c} was trained with another tokenizer than {dirs['base']} "), err
    assert not out.exists()
