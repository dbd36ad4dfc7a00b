"""KTO as a whole, in train_unpaired.py (--method kto): the frozen reference, precomputed reference, DDP's z₀, end
to end, resume, bad input (one line, nothing written). The loss and z₀ against float64 oracles:
test_dpo_losses.py."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file

import train_dpo
import train_unpaired
from conftest import metrics, one_line_error, run, unpaired_rows, write_jsonl
from nano_rlhf.cli import parse_args
from nano_rlhf.model import GPT


def kto_args(tmp_path, sft_dir, out, *extra, steps=3):
    if not (tmp_path / "unpaired.jsonl").exists():
        write_jsonl(tmp_path / "unpaired.jsonl", unpaired_rows(64))
        write_jsonl(tmp_path / "unpaired_eval.jsonl", unpaired_rows(8, seed=1))
    return ["--method", "kto", "--data", str(tmp_path / "unpaired.jsonl"), "--eval_data",
            str(tmp_path / "unpaired_eval.jsonl"), "--init", sft_dir, "--out_dir", str(tmp_path / out), "--max_steps",
            str(steps), "--batch_size", "4", "--log_interval", "1", "--eval_interval", "0", "--lr", "1e-3",
            "--warmup_steps", "0", *extra]


# ---- the mismatched pairs ---------------------------------------------------------------------------

def test_mismatched_completions_are_a_seeded_derangement():
    examples = [{"prompt": [0], "completion": [i]} for i in range(9)]
    train_unpaired.add_mismatched(examples, seed=3, max_len=64)
    got = [e["mismatched"][0] for e in examples]
    assert sorted(got) == list(range(9)) and all(g != i for i, g in enumerate(got))   # each used once, none own
    again = [{"prompt": [0], "completion": [i]} for i in range(9)]
    train_unpaired.add_mismatched(again, seed=3, max_len=64)
    assert [e["mismatched"][0] for e in again] == got
    other = [{"prompt": [0], "completion": [i]} for i in range(9)]
    train_unpaired.add_mismatched(other, seed=4, max_len=64)
    assert [e["mismatched"][0] for e in other] != got
    assert all(e["mismatched_prompt"] == [0] for e in examples + again + other)   # rows that fit: unchanged


def test_a_mismatched_row_longer_than_the_training_length_loses_prompt_tokens_on_the_left():
    """Each example fits in 10 tokens, but a 7-token prompt with another example's 6-token completion would
    not: the mismatched row keeps the prompt's last 4 tokens, the others are untouched."""
    examples = [{"prompt": list(range(100, 107)), "completion": [1, 2, 3]},          # 7 + 3
                {"prompt": [200, 201, 202, 203], "completion": [4, 5, 6, 7, 8, 9]}]   # 4 + 6
    train_unpaired.add_mismatched(examples, seed=0, max_len=10)
    long, short = examples
    assert long["mismatched"] == [4, 5, 6, 7, 8, 9] and long["mismatched_prompt"] == [103, 104, 105, 106]
    assert short["mismatched"] == [1, 2, 3] and short["mismatched_prompt"] == [200, 201, 202, 203]
    assert all(len(e["mismatched_prompt"]) + len(e["mismatched"]) <= 10 for e in examples)


def test_kto_trains_when_prompt_and_another_completion_overflow_the_block(tmp_path, sft_dir):
    """End to end: rows that each fill most of the policy's block_size, so every mismatched row (prompt of one,
    completion of another) is longer than the block and must be cut, not crash the forward."""
    block = GPT.from_pretrained(sft_dir).cfg.block_size
    rows = [{"prompt": "word " * (block // 2 + i % 3), "completion": " fine" * (block // 3 - i % 3),
             "label": i % 2 == 0} for i in range(16)]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    out = train_unpaired.main(["--method", "kto", "--data", str(data), "--init", sft_dir, "--out_dir",
                               str(tmp_path / "o"), "--batch_size", "4", "--max_steps", "2", "--eval_fraction", "0.25"])
    longest = max(len(e["mismatched_prompt"]) + len(e["mismatched"]) for e in out.train)
    assert out.options.method == "kto" and longest <= block and math.isfinite(metrics(tmp_path / "o")[-1]["train/loss"])


# ---- training -----------------------------------------------------------------------------------------

def test_reference_is_frozen_and_never_optimised(tmp_path, sft_dir):
    out = train_unpaired.main(kto_args(tmp_path, sft_dir, "o", steps=4))
    fresh = GPT.from_pretrained(sft_dir)
    for (n, a), b in zip(out.ref.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    assert all(not p.requires_grad for p in out.ref.parameters()) and not out.ref.training
    in_opt = {id(p) for g in out.optimizers["policy"].param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in out.policy.parameters()}
    assert not in_opt & {id(p) for p in out.ref.parameters()}
    assert any(not torch.equal(a, b) for a, b in zip(out.policy.state_dict().values(), fresh.state_dict().values()))


def test_precomputed_reference_gives_the_same_losses(tmp_path, sft_dir, capsys):
    train_unpaired.main(kto_args(tmp_path, sft_dir, "live", "--eval_interval", "3"))
    capsys.readouterr()
    out = train_unpaired.main(kto_args(tmp_path, sft_dir, "pre", "--eval_interval", "3", "--precompute_ref"))
    assert out.ref is None                              # the reference model was dropped
    assert "precomputing the reference's log-probs | " in capsys.readouterr().out      # the pass shows progress
    a, b = metrics(tmp_path / "live"), metrics(tmp_path / "pre")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        for k in ("train/loss", "train/kl", "train/rewards_desirable", "train/rewards_undesirable", "eval/loss"):
            if k in x:
                assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), k


def test_end_to_end_logs_kto_statistics(tmp_path, sft_dir):
    out = train_unpaired.main(kto_args(tmp_path, sft_dir, "o", "--eval_interval", "2", steps=2))
    m = metrics(tmp_path / "o")
    assert len(m) == 2 and all(torch.isfinite(torch.tensor(x["train/loss"])) for x in m)
    assert {"train/loss", "train/kl", "train/logps", "train/rewards_desirable", "train/rewards_undesirable",
            "train/grad_norm", "train/lr"} <= set(m[0])
    assert m[0]["train/loss"] == pytest.approx(0.5, abs=1e-6) and m[0]["train/kl"] == 0.0   # π = π_ref: u = z₀ = 0
    assert "eval/loss" in m[-1]
    GPT.from_pretrained(str(tmp_path / "o"))
    assert json.loads((tmp_path / "o" / "train_config.json").read_text())["method"] == "kto"
    assert out.options.beta == 0.1 and out.value is None


@pytest.mark.slow
def test_ddp_z0_is_all_reduced(tmp_path, sft_dir):
    run(["train_unpaired.py"] + kto_args(tmp_path, sft_dir, "one", "--batch_size", "4"))
    run(["train_unpaired.py"] + kto_args(tmp_path, sft_dir, "two", "--batch_size", "2"), nproc=2)
    la, lb = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    # z0 = 0 at step 1 (policy = reference); it must be > 0 on some later step, or the clamp max(0, .) would
    # hide a per-rank z0 and this test would prove nothing
    assert any(x["train/kl"] > 0.05 for x in la), [x["train/kl"] for x in la]
    # z0 is estimated per micro-batch: the same 4 examples on one rank or split over two give the same z0.
    # The logged kl is a mean of z0 over ranks, so a per-rank z0 barely moves it; the loss and the gradient
    # norm see each rank's z0 in every example's term and pin it
    for key in ("train/kl", "train/loss", "train/grad_norm"):
        assert [x[key] for x in la] == pytest.approx([x[key] for x in lb], rel=1e-4, abs=1e-6), key


def test_stop_and_resume_equals_one_run(tmp_path, sft_dir):
    train_unpaired.main(kto_args(tmp_path, sft_dir, "straight", steps=4))
    train_unpaired.main(kto_args(tmp_path, sft_dir, "resumed", "--stop_at", "2", steps=4))
    train_unpaired.main(kto_args(tmp_path, sft_dir, "resumed", "--resume", steps=4))
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    la, lb = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [x["train/loss"] for x in la] == [x["train/loss"] for x in lb]


# ---- bad input: one line, non-zero exit, nothing written ------------------------------------------------

def test_bad_input_exits_with_file_line(tmp_path, sft_dir):
    rows = [unpaired_rows(1)[0], {"prompt": "p", "completion": " c", "label": "yes"}]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    p = run(["train_unpaired.py", "--method", "kto", "--data", bad, "--init", sft_dir, "--out_dir",
             str(tmp_path / "o")], check=False)
    assert p.returncode != 0 and p.stderr.strip().endswith(f"{bad}:2: field 'label' must be true or false, got 'yes'")


BAD_FLAGS = [
    (["--desirable_weight", "0"], "--desirable_weight"),
    (["--undesirable_weight", "-1"], "--undesirable_weight"),
    (["--batch_size", "1"], "--method kto needs --batch_size >= 2"),
    (["--max_length", "-1"], "--max_length"),
    (["--max_length", "100"], "--max_length 100 is above the block_size 64"),
    (["--precompute_ref", "--offload_frozen"], "--offload_frozen: this run holds no reference model"),
    (["--alpha", "0.1"], "--alpha applies only with --method d2o (got kto)"),
    (["--tau", "0.5"], "--tau applies only with --method dro (got kto)"),
    (["--nll_coef", "0.1"], "unrecognized arguments: --nll_coef"),
]


@pytest.mark.parametrize("flags,msg", BAD_FLAGS, ids=["".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_error_before_any_work(tmp_path, sft_dir, capsys, flags, msg):
    one_line_error(capsys, lambda: train_unpaired.main(kto_args(tmp_path, sft_dir, "o", *flags)), msg)
    assert not (tmp_path / "o" / "model.safetensors").exists()


@pytest.mark.parametrize("flag", ["--desirable_weight", "--precompute_ref", "--max_length"])
def test_kto_flags_are_errors_with_other_methods(tmp_path, sft_dir, capsys, flag):
    value = {"--desirable_weight": ["2"], "--precompute_ref": [], "--max_length": ["32"]}[flag]
    args = kto_args(tmp_path, sft_dir, "o", flag, *value)
    args[args.index("kto")] = "npo"
    one_line_error(capsys, lambda: train_unpaired.main(args), f"{flag} applies only with --method kto (got npo)")
    assert not (tmp_path / "o").exists()


def too_long_rows(rows, key):
    return [dict(r, **{key: r[key] + " and great" * 40}) for r in rows]


def test_empty_eval_set_is_refused(tmp_path, sft_dir, capsys):
    """Every eval example longer than the training length used to give eval/loss 0.0: a number that looks like
    a result."""
    long_eval = write_jsonl(tmp_path / "long_eval.jsonl", too_long_rows(unpaired_rows(4, seed=1), "completion"))
    one_line_error(capsys, lambda: train_unpaired.main(kto_args(tmp_path, sft_dir, "o", "--eval_data", long_eval)),
                   f"{long_eval}: no example fits")
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_eval_fraction_taking_every_row_says_so(tmp_path, sft_dir, capsys):
    one_row = write_jsonl(tmp_path / "one.jsonl", unpaired_rows(1))
    args = ["--method", "kto", "--data", one_row, "--init", sft_dir, "--out_dir", str(tmp_path / "o"),
            "--batch_size", "2"]
    one_line_error(capsys, lambda: train_unpaired.main(args), "--eval_fraction 0.05 holds out every row")


# ---- bad flags ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,msg", [
    (["--batch_size", "1"], "--method kto needs --batch_size >= 2"),
    (["--desirable_weight", "0"], "--desirable_weight"),
])
def test_bad_flag_is_one_line_error(tmp_path, sft_dir, capsys, flags, msg):
    one_line_error(capsys, lambda: train_unpaired.main(kto_args(tmp_path, sft_dir, "o", *flags)), msg)
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_train_dpo_has_no_kto(capsys):
    """KTO is train_unpaired.py's (unpaired data); train_dpo.py's --loss refuses it like any unknown choice."""
    one_line_error(capsys, lambda: parse_args(train_dpo.Options, ["--loss", "kto"]), "argument --loss")


def test_compile_is_accepted_and_refused_with_fsdp(capsys):
    opts = parse_args(train_unpaired.Options, ["--method", "kto", "--compile"])
    assert opts.compile
    one_line_error(capsys, lambda: train_unpaired.check_options(parse_args(
        train_unpaired.Options, ["--method", "kto", "--compile", "--fsdp"])), "--compile with --fsdp")
