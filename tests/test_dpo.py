"""train_dpo.py as a whole: the gather on a real model, the frozen reference, precomputed reference,
DDP, every --loss end to end, resume, and bad input (flags, data, models, out_dir): one line, nothing written.
KTO (train_unpaired.py --method kto, and its old command train_dpo.py --loss kto): test_kto.py."""
import json

import pytest
import torch
from safetensors.torch import load_file

import train_dpo
from conftest import pref_rows, run, tiny_model, weights_close, write_jsonl
from nano_rlhf.data import collate_pairs, tokenize_pairs
from nano_rlhf.model import GPT


def test_gather_on_real_model_right_padding_equals_unpadded(tok):
    m = tiny_model(tok)
    p, _ = tokenize_pairs(pref_rows(5), tok, 64)
    ids, attn, resp, _ = collate_pairs(p, tok.pad_id)
    with torch.no_grad():
        sums, lens = train_dpo.sequence_logps(m, ids, attn, resp)
        for i in range(ids.shape[0]):
            n = int(attn[i].sum())
            row, r = ids[i:i + 1, :n], resp[i:i + 1, :n]
            lp = torch.log_softmax(m(row)[0, :-1].double(), -1).gather(-1, row[0, 1:, None]).squeeze(-1)
            want = (lp * r[0, 1:]).sum()
            assert abs(sums[i].item() - want.item()) < 1e-4
            assert lens[i].item() == r.sum().item()       # every response token, the first one included


def dpo_args(tmp_path, sft_dir, out, loss="dpo", *extra, steps=3):
    if not (tmp_path / "pref.jsonl").exists():
        write_jsonl(tmp_path / "pref.jsonl", pref_rows(64))
        write_jsonl(tmp_path / "pref_eval.jsonl", pref_rows(8, seed=1))
    return ["--loss", loss, "--data", str(tmp_path / "pref.jsonl"), "--eval_data", str(tmp_path / "pref_eval.jsonl"),
            "--init", sft_dir, "--out_dir", str(tmp_path / out), "--max_steps", str(steps), "--batch_size", "4",
            "--log_interval", "1", "--eval_interval", "0", "--lr", "1e-3", "--warmup_steps", "0", *extra]


def metrics(path):
    return [json.loads(x) for x in open(path / "metrics.jsonl")]


def test_reference_is_frozen_and_never_optimised(tmp_path, sft_dir):
    out = train_dpo.main(dpo_args(tmp_path, sft_dir, "o", "dpo", steps=4))
    fresh = GPT.from_pretrained(sft_dir)
    for (n, a), b in zip(out.ref.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    assert all(not p.requires_grad for p in out.ref.parameters()) and not out.ref.training
    in_opt = {id(p) for g in out.optimizer.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in out.policy.parameters()}
    assert not in_opt & {id(p) for p in out.ref.parameters()}
    # and the policy did move
    assert any(not torch.equal(a, b) for a, b in zip(out.policy.state_dict().values(), fresh.state_dict().values()))


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_precomputed_reference_gives_the_same_losses(tmp_path, sft_dir, loss, capsys):
    train_dpo.main(dpo_args(tmp_path, sft_dir, "live", loss, "--eval_interval", "3"))
    capsys.readouterr()
    out = train_dpo.main(dpo_args(tmp_path, sft_dir, "pre", loss, "--eval_interval", "3", "--precompute_ref"))
    assert out.ref is None                              # the reference model was dropped
    assert "precomputing the reference's log-probs | " in capsys.readouterr().out      # the pass shows progress
    a, b = metrics(tmp_path / "live"), metrics(tmp_path / "pre")
    for x, y in zip(a, b):
        for k in x:
            if k.startswith(("train/loss", "train/reward", "eval/loss")):
                assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), k


def test_reference_free_losses_build_no_reference(tmp_path, sft_dir):
    for loss in ("simpo", "cpo", "orpo"):
        out = train_dpo.main(dpo_args(tmp_path, sft_dir, loss, loss, steps=1))
        assert out.ref is None


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_process(tmp_path, sft_dir):
    run(["train_dpo.py"] + dpo_args(tmp_path, sft_dir, "one", "dpo", "--batch_size", "4", "--grad_accum", "2"))
    p = run(["train_dpo.py"] + dpo_args(tmp_path, sft_dir, "two", "dpo", "--batch_size", "2", "--grad_accum", "2"),
            nproc=2)
    assert "saved" in p.stdout
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    # the loss and the pre-clipping gradient norm pin the exact scale; weights up to Adam's rounding
    assert weights_close(a, b)
    la, lb = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("train/loss", "train/grad_norm"):
        assert [x[key] for x in la] == pytest.approx([x[key] for x in lb], rel=1e-4), key


@pytest.mark.slow
def test_ddp_orpo_global_nll_token_mean_and_empty_eval_shard(tmp_path, sft_dir):
    """ORPO's NLL is a token mean over all chosen tokens of the step, on all ranks: two ranks must equal one
    process with the same global batch. One eval example on two ranks leaves rank 1 an empty eval shard,
    which must contribute zeros to the all-reduced sums (not crash and hang rank 0)."""
    one_eval = write_jsonl(tmp_path / "one_eval.jsonl", pref_rows(1, seed=1))
    args = lambda out, b: dpo_args(tmp_path, sft_dir, out, "orpo", "--batch_size", b, "--grad_accum", "2",
                                   "--eval_data", one_eval)
    run(["train_dpo.py"] + args("one", "4"))
    run(["train_dpo.py"] + args("two", "2"), nproc=2)
    assert weights_close(load_file(tmp_path / "one" / "model.safetensors"),
                         load_file(tmp_path / "two" / "model.safetensors"))
    la, lb = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("train/loss", "train/nll", "train/grad_norm"):
        assert [x[key] for x in la] == pytest.approx([x[key] for x in lb], rel=1e-4), key
    for key in ("eval/loss", "eval/nll", "eval/reward_accuracy"):
        assert la[-1][key] == pytest.approx(lb[-1][key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("loss", ["dpo", "robust", "ipo", "hinge", "rdpo", "simpo", "cpo", "orpo"])
def test_every_loss_end_to_end(tmp_path, sft_dir, loss):
    extra = ["--label_smoothing", "0.1"] if loss == "robust" else ["--nll_coef", "0.5"] if loss == "dpo" else []
    out = train_dpo.main(dpo_args(tmp_path, sft_dir, loss, loss, *extra, steps=2))
    m = metrics(tmp_path / loss)
    assert len(m) == 2 and all(torch.isfinite(torch.tensor(x["train/loss"])) for x in m)
    assert "eval/loss" in m[-1]
    GPT.from_pretrained(str(tmp_path / loss))
    assert json.loads((tmp_path / loss / "train_config.json").read_text())["loss"] == loss
    assert out.options.beta == {"simpo": 2.0, "ipo": 0.5}.get(loss, 0.1)


def test_bad_input_exits_with_file_line(tmp_path, sft_dir):
    bad = write_jsonl(tmp_path / "bad.jsonl", [pref_rows(1)[0], {"prompt": "p", "chosen": " c", "rejected": 5}])
    p = run(["train_dpo.py", "--data", bad, "--init", sft_dir, "--out_dir", str(tmp_path / "o")], check=False)
    assert p.returncode != 0 and p.stderr.strip().endswith(f"{bad}:2: field 'rejected' must be a string, got int")


@pytest.mark.parametrize("loss,flag,msg", [
    ("orpo", "--label_smoothing", "--label_smoothing applies only with --loss dpo or robust (got orpo)"),
])
def test_flags_a_loss_would_ignore_are_errors(tmp_path, sft_dir, capfd, loss, flag, msg):
    """main() in this process, its exit code and the stderr file descriptor (test_bad_input_exits_with_file_line
    runs a whole process)."""
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        train_dpo.main(dpo_args(tmp_path, sft_dir, "o", loss, flag, "0.1"))
    err = capfd.readouterr().err
    assert isinstance(e.value.code, int) and e.value.code != 0, e.value.code
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {msg}"), err
    assert not (tmp_path / "o").exists()              # before any model or output directory


# ---- bad input: one line, non-zero exit, nothing written ------------------------------------------

BAD_FLAGS = [
    ("dpo", ["--beta", "0"], "--beta"),                  # zero gradient
    ("dpo", ["--beta", "-1"], "--beta"),                 # preference reversed
    ("ipo", ["--beta", "0"], "--beta"),                  # 1/(2β): ZeroDivisionError
    ("dpo", ["--grad_clip", "-1"], "--grad_clip"),
    ("dpo", ["--grad_accum", "0"], "--grad_accum"),
    ("dpo", ["--grad_accum", "-1"], "--grad_accum"),
    ("dpo", ["--max_steps", "-1"], "--max_steps"),
    ("dpo", ["--max_steps", "0", "--epochs", "0"], "--epochs"),
    ("dpo", ["--max_steps", "0", "--epochs", "-1"], "--epochs"),
    ("dpo", ["--log_interval", "0"], "--log_interval"),
    ("dpo", ["--batch_size", "0"], "--batch_size"),
    ("dpo", ["--lr", "-0.0001"], "--lr"),
    ("dpo", ["--lr", "0"], "--lr"),
    ("robust", ["--label_smoothing", "0.5"], "--label_smoothing"),   # 1/(1 − 2ε)
    ("dpo", ["--label_smoothing", "-0.1"], "--label_smoothing"),
    ("dpo", ["--eval_fraction", "1"], "--eval_fraction"),
    ("dpo", ["--dropout", "1"], "--dropout"),
    ("dpo", ["--beta2", "1"], "--beta2"),
    ("dpo", ["--warmup_steps", "-1"], "--warmup_steps"),
    ("dpo", ["--nll_coef", "-0.5"], "--nll_coef"),
    ("simpo", ["--gamma", "-1"], "--gamma"),
    ("orpo", ["--lam", "-0.1"], "--lam"),
    ("orpo", ["--label_smoothing", "0.1"], "--label_smoothing applies only with --loss dpo or robust (got orpo)"),
    ("simpo", ["--ref", "somewhere"], "--ref applies only with --loss other than simpo or cpo or orpo (got simpo)"),
    ("cpo", ["--precompute_ref"], "--precompute_ref applies only with --loss other than simpo or cpo or orpo (got cpo)"),
]


@pytest.mark.parametrize("loss,flags,msg", BAD_FLAGS, ids=[f"{l}{''.join(f)}" for l, f, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_error_before_any_work(tmp_path, sft_dir, capsys, loss, flags, msg):
    with pytest.raises(SystemExit) as e:
        train_dpo.main(dpo_args(tmp_path, sft_dir, "o", loss, *flags))
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {msg}"), err
    assert not (tmp_path / "o").exists()              # nothing written


def too_long_rows(rows, key):
    return [dict(r, **{key: r[key] + " and great" * 40}) for r in rows]


def test_empty_eval_set_is_refused(tmp_path, sft_dir, capsys):
    """Every eval example longer than the model's block_size used to give eval/loss 0.0 and
    eval/reward_accuracy 0.0: a number that looks like a result."""
    long_eval = write_jsonl(tmp_path / "long_eval.jsonl", too_long_rows(pref_rows(4, seed=1), "chosen"))
    with pytest.raises(SystemExit) as e:
        train_dpo.main(dpo_args(tmp_path, sft_dir, "o", "dpo", "--eval_data", long_eval))
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {long_eval}: no example fits"), err
    assert not (tmp_path / "o").exists()


def test_eval_fraction_taking_every_row_says_so(tmp_path, sft_dir, capsys):
    one_row = write_jsonl(tmp_path / "one.jsonl", pref_rows(1))
    args = ["--data", one_row, "--init", sft_dir, "--out_dir", str(tmp_path / "o"), "--batch_size", "2"]
    with pytest.raises(SystemExit):
        train_dpo.main(args)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --eval_fraction 0.05 holds out every row"), err


def test_reference_whose_vocabulary_the_tokenizer_overflows(tmp_path, sft_dir, tok, capsys):
    """--ref from another model: an id past its embedding would crash in the first forward."""
    small = tmp_path / "small_ref"
    tiny_model(tok, vocab_size=100).save_pretrained(str(small))
    with pytest.raises(SystemExit) as e:
        train_dpo.main(dpo_args(tmp_path, sft_dir, "o", "dpo", "--ref", str(small)))
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {small}: the tokenizer has"), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("loss", ["dpo"])
def test_stop_and_resume_equals_one_run(tmp_path, sft_dir, loss):
    train_dpo.main(dpo_args(tmp_path, sft_dir, "straight", loss, steps=4))
    train_dpo.main(dpo_args(tmp_path, sft_dir, "resumed", loss, "--stop_at", "2", steps=4))
    train_dpo.main(dpo_args(tmp_path, sft_dir, "resumed", loss, "--resume", steps=4))
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    la, lb = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [x["train/loss"] for x in la] == [x["train/loss"] for x in lb]


@pytest.mark.parametrize("flag", ["--init", "--ref"])
def test_out_dir_equal_to_an_input_is_refused(tmp_path, sft_dir, capsys, flag):
    import shutil
    model_dir = tmp_path / "model"
    shutil.copytree(sft_dir, model_dir)
    before = sorted(p.name for p in model_dir.iterdir())
    args = dpo_args(tmp_path, sft_dir, "o", "dpo") + [flag, str(model_dir), "--out_dir", str(model_dir)]
    with pytest.raises(SystemExit) as e:
        train_dpo.main(args)
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"input {flag} {model_dir}" in err, err
    assert sorted(p.name for p in model_dir.iterdir()) == before


def test_resume_with_another_loss_setting_is_refused(tmp_path, sft_dir, capsys):
    train_dpo.main(dpo_args(tmp_path, sft_dir, "o", "dpo", "--stop_at", "1", steps=2))
    with pytest.raises(SystemExit):
        train_dpo.main(dpo_args(tmp_path, sft_dir, "o", "dpo", "--resume", "--beta", "0.3", steps=2))
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "beta 0.1 != 0.3" in err, err


def test_reference_with_another_tokenizer_of_the_same_size_is_refused(tmp_path, sft_dir, tok, capsys):
    """Only sizes were compared: a reference trained with another tokenizer of the same size was taken, and
    scored every pair as other text."""
    import shutil
    from conftest import other_tokenizer
    ref = tmp_path / "ref"
    shutil.copytree(sft_dir, ref)
    other_tokenizer(tok, ref)
    with pytest.raises(SystemExit) as e:
        train_dpo.main(dpo_args(tmp_path, sft_dir, "o", "dpo", "--ref", str(ref)))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {ref} was trained with another tokenizer than {sft_dir} "), err
    assert not (tmp_path / "o").exists()


def test_resume_refuses_a_reference_replaced_at_the_same_path(tmp_path, sft_dir, capsys):
    """--resume re-reads --ref from its path: another model there (a retrained SFT) would have been taken and
    the run gone on against it. The sha256 of the reference's files is in the run's identity."""
    import os
    import shutil
    ref, out = tmp_path / "ref", tmp_path / "o"
    shutil.copytree(sft_dir, ref)
    train_dpo.main(dpo_args(tmp_path, sft_dir, "o", "dpo", "--ref", str(ref), "--stop_at", "1", steps=2))
    (ref / "metrics.jsonl").write_text("{}\n")      # a run's log beside the model is not the model: still fine
    before = {f: (out / "state" / f).read_bytes() for f in os.listdir(out / "state")}
    m = GPT.from_pretrained(str(ref))
    with torch.no_grad():
        m.transformer.wte.weight[5, 0] += 1.0
    m.save_pretrained(str(ref))
    with pytest.raises(SystemExit) as e:
        train_dpo.main(dpo_args(tmp_path, sft_dir, "o", "dpo", "--ref", str(ref), "--resume", steps=2))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: --resume: the input --ref {ref} changed since {out} was saved "), err
    assert {f: (out / "state" / f).read_bytes() for f in os.listdir(out / "state")} == before
