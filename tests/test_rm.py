"""train_rm.py: score index, one concatenated forward, DDP, end to end with transformers parity."""
import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import WORDS, weights_close, pref_rows, run, tiny_model, write_jsonl
from numerics import FLOAT32_ATOL, assert_close64
from nano_rlhf.data import collate_pairs, tokenize_pairs
from nano_rlhf.model import ScoreModel
from train_rm import evaluate, pair_scores, reward_loss


def score_model(tok, seed=0):
    torch.manual_seed(seed)
    from conftest import tiny_config
    return ScoreModel(tiny_config(tok)).eval()


def pairs(tok, n=6):
    out, _ = tokenize_pairs(pref_rows(n), tok, 64)
    return out


@pytest.mark.parametrize("padding", ["right", "left"])
def test_score_is_read_at_last_real_token(tok, padding):
    m = score_model(tok)
    p = pairs(tok)
    ids, attn, _, _ = collate_pairs(p, tok.pad_id)
    if padding == "left":   # move every row's tokens to the right end
        lens = attn.sum(1)
        ids = torch.stack([torch.roll(r, int(r.shape[0] - n)) for r, n in zip(ids, lens)])
        attn = torch.stack([torch.roll(a, int(a.shape[0] - n)) for a, n in zip(attn, lens)])
    with torch.no_grad():
        _, end = m(ids, attn)
        # any change to padding positions changes nothing
        junk = torch.where(attn.bool(), ids, torch.randint(2, tok.vocab_size, ids.shape))
        assert torch.equal(m(junk, attn)[1], end)
        # the score sits on the end-of-text: replacing it changes the score
        last = (torch.arange(ids.shape[1]) * attn).argmax(1)
        assert (ids[torch.arange(len(ids)), last] == tok.eos_id).all()
        changed = ids.clone()
        changed[torch.arange(len(ids)), last] = 5
        assert (m(changed, attn)[1] - end).abs().min() > 1e-6
        # the same as scoring each row alone, unpadded
        for i in range(len(ids)):
            alone = ids[i][attn[i].bool()][None]
            assert torch.allclose(m(alone)[1], end[i:i + 1], atol=FLOAT32_ATOL)


@pytest.mark.numeric
def test_one_concatenated_forward_equals_two(tok):
    p = pairs(tok, 8)
    ids, attn, _, margin = collate_pairs(p, tok.pad_id)
    m1, m2 = score_model(tok).double(), score_model(tok).double()   # float64: see tests/numerics.py
    rw, rl = pair_scores(m1, ids, attn)
    loss1 = reward_loss(rw, rl, margin, 0.01, 0.001).mean()
    loss1.backward()
    B = len(p)
    _, ew = m2(ids[:B], attn[:B])
    _, el = m2(ids[B:], attn[B:])
    loss2 = reward_loss(ew, el, margin, 0.01, 0.001).mean()
    loss2.backward()
    assert loss1.dtype == torch.float64
    assert_close64(loss1, loss2)
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert_close64(a.grad, b.grad, msg=n)


def alone_scores(model, pairs, key):
    """float64 end scores of each pair's prompt + `key` response, each sequence scored alone and unpadded
    through ScoreModel.forward (no batching, no mask, no pair_scores)."""
    with torch.no_grad():
        return torch.tensor([model(torch.tensor([p["prompt"] + p[key]]))[1].item() for p in pairs],
                            dtype=torch.float64)


@pytest.mark.parametrize("use_margin,c,lam", [(False, 0.0, 0.0), (True, 0.0, 0.0), (True, 0.01, 0.001),
                                              (False, 0.05, 0.3)])
def test_evaluate_equals_float64_hand_computation(tok, use_margin, c, lam):
    rows = pref_rows(7, seed=3)
    rows.append(dict(rows[0], rejected=rows[0]["chosen"]))         # an exact tie: not a correct ranking
    for i, r in enumerate(rows):
        r["margin"] = [0.0, 0.5, -0.3, 1.0][i % 4]
    ps, _ = tokenize_pairs(rows, tok, 64)
    m = score_model(tok)
    rw, rl = alone_scores(m, ps, "chosen"), alone_scores(m, ps, "rejected")
    assert rw[-1] == rl[-1] and ((rw - rl)[:-1].abs() > 1e-4).all()   # the accuracy below is unambiguous
    mg = torch.tensor([r["margin"] for r in rows], dtype=torch.float64) * use_margin
    d = rw - rl - mg
    loss = torch.logaddexp(torch.zeros_like(d), -d) + c * (rw + rl) ** 2 + lam / 2 * (rw ** 2 + rl ** 2)
    r = torch.cat([rw, rl])
    want = {"eval/loss": loss.mean(), "eval/accuracy": (rw > rl).double().mean(), "eval/margin": (rw - rl).mean(),
            "eval/chosen_score": rw.mean(), "eval/rejected_score": rl.mean(), "eval/score_mean": r.mean(),
            "eval/score_std": r.std()}                               # Bessel-corrected, as documented
    # batch_size 3 over 8 pairs: two full chunks and a ragged one, each right-padded to its own width
    opts = SimpleNamespace(batch_size=3, dtype="float32", use_margin=use_margin, center_coef=c, l2_coef=lam,
                           objective="reward")
    got = evaluate(m, ps, pad_id=tok.pad_id, opts=opts)
    assert 0 < want["eval/accuracy"] < 1                             # right and wrong rankings both occur
    for k, v in want.items():
        assert got[k] == pytest.approx(v.item(), abs=1e-5), k


def rm_args(tmp_path, sft_dir, out, *extra, steps=4):
    data = tmp_path / "pref.jsonl"
    if not data.exists():
        write_jsonl(data, pref_rows(80))
        write_jsonl(tmp_path / "pref_eval.jsonl", pref_rows(16, seed=1))
    return ["train_rm.py", "--data", str(data), "--eval_data", str(tmp_path / "pref_eval.jsonl"), "--init", sft_dir,
            "--out_dir", str(tmp_path / out), "--max_steps", str(steps), "--log_interval", "1", "--eval_interval", "0",
            "--warmup_steps", "1", "--lr", "1e-3", *extra]


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_process(tmp_path, sft_dir):
    run(rm_args(tmp_path, sft_dir, "one", "--batch_size", "4", "--grad_accum", "2"))
    p = run(rm_args(tmp_path, sft_dir, "two", "--batch_size", "2", "--grad_accum", "2"), nproc=2)
    assert "saved" in p.stdout
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert weights_close(a, b)
    ma = [json.loads(x) for x in open(tmp_path / "one" / "metrics.jsonl")]
    mb = [json.loads(x) for x in open(tmp_path / "two" / "metrics.jsonl")]
    for key in ("train/loss", "train/grad_norm", "train/accuracy"):
        assert [x[key] for x in ma] == pytest.approx([x[key] for x in mb], rel=1e-4), key


def test_end_to_end_and_transformers_parity(tmp_path, sft_dir):
    transformers = pytest.importorskip("transformers")
    p = run(rm_args(tmp_path, sft_dir, "rm", "--batch_size", "8", "--center_coef", "0.01", "--l2_coef", "0.001",
                    steps=8))
    out = tmp_path / "rm"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["GPT2ForSequenceClassification"] and cfg["reward_std"] > 0
    assert "eval accuracy" in p.stdout
    metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert metrics[-1]["eval/accuracy"] >= 0.5 and "train/margin" in metrics[0]
    # some eval prompts name no product of the built-in task ("the motor"): no gold figures
    assert not any(k.startswith("eval/gold") for m in metrics for k in m)
    # the saved model loads in transformers and gives the same scores
    from nano_rlhf.tokenizer import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ours = ScoreModel.from_pretrained(str(out)).eval()
    hf = transformers.GPT2ForSequenceClassification.from_pretrained(str(out)).eval()
    ids, attn, _, _ = collate_pairs(tokenize_pairs(pref_rows(4, seed=2), tok, 64)[0], tok.pad_id)
    with torch.no_grad():
        assert torch.allclose(ours(ids, attn)[1], hf(ids, attention_mask=attn).logits.squeeze(-1), atol=FLOAT32_ATOL)
    # the statistics recorded for PPO are those of the saved model on the eval set: every eval chosen and
    # rejected sequence scored alone, mean and Bessel-corrected std in float64
    evals, _ = tokenize_pairs(pref_rows(16, seed=1), tok, ours.cfg.block_size)
    r = torch.cat([alone_scores(ours, evals, "chosen"), alone_scores(ours, evals, "rejected")])
    assert len(r) == 32
    assert cfg["reward_mean"] == pytest.approx(r.mean().item(), abs=1e-5)
    assert cfg["reward_std"] == pytest.approx(r.std().item(), rel=1e-4)
    assert metrics[-1]["eval/chosen_score"] == pytest.approx(r[:16].mean().item(), abs=1e-5)


@pytest.mark.slow
def test_resume_bit_exact(tmp_path, sft_dir):
    run(rm_args(tmp_path, sft_dir, "a", "--batch_size", "8", steps=6))
    run(rm_args(tmp_path, sft_dir, "b", "--batch_size", "8", "--stop_at", "3", steps=6))
    run(rm_args(tmp_path, sft_dir, "b", "--batch_size", "8", "--resume", steps=6))
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a crash after the last state save but before the final model save: the model directory is written
    # only once, with the score statistics, and --resume at max_steps writes it without training further
    want = json.loads((tmp_path / "b" / "config.json").read_text())
    for f in ("config.json", "model.safetensors"):
        os.remove(tmp_path / "b" / f)
    run(rm_args(tmp_path, sft_dir, "b", "--batch_size", "8", "--resume", steps=6))
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    got = json.loads((tmp_path / "b" / "config.json").read_text())
    assert got["reward_mean"] == want["reward_mean"] and got["reward_std"] == want["reward_std"]


def test_final_model_dir_written_once_with_statistics(tmp_path, sft_dir, monkeypatch):
    """No model directory without reward_mean/std is written after the last state save: a crash between
    the two would leave a final-looking model that PPO would use unnormalised."""
    import train_rm
    from nano_rlhf import training    # the scripts save their state through run.save
    events = []
    real_state, real_model_dir = training.save_state, train_rm.save_model_dir

    def save_state(*a, **k):
        events.append(("state", a[3]["step"]))
        real_state(*a, **k)

    def save_model_dir(*a, **k):
        events.append(("model", "reward_mean" in k))
        real_model_dir(*a, **k)

    monkeypatch.setattr(training, "save_state", save_state)
    monkeypatch.setattr(train_rm, "save_model_dir", save_model_dir)
    train_rm.main(rm_args(tmp_path, sft_dir, "rm", "--batch_size", "8", "--save_interval", "1", steps=2)[1:])
    assert events == [("state", 1), ("model", False), ("state", 2), ("model", True)]


def test_bad_input_exits_with_file_line(tmp_path, sft_dir):
    bad = write_jsonl(tmp_path / "bad.jsonl", [pref_rows(1)[0], {"prompt": "p", "chosen": " a"}])
    p = run(["train_rm.py", "--data", bad, "--init", sft_dir, "--out_dir", str(tmp_path / "o")], check=False)
    assert p.returncode != 0 and p.stderr.strip().endswith(f"{bad}:2: missing field 'rejected'")


def test_tokenizer_larger_than_model_vocab_exits(tmp_path, tok):
    """A tokenizer.json from another model: ids past the embedding must stop at start-up with one line."""
    small = tmp_path / "small"
    tiny_model(tok, vocab_size=tok.vocab_size - 10).save_pretrained(str(small))
    tok.save(str(small / "tokenizer.json"))
    data = write_jsonl(tmp_path / "pref.jsonl", pref_rows(8))
    p = run(["train_rm.py", "--data", data, "--init", str(small), "--out_dir", str(tmp_path / "o")], check=False)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: {small}: the tokenizer has {tok.vocab_size} tokens but the model's vocabulary only "
        f"{tok.vocab_size - 10}; pass the tokenizer.json the model was trained with (--tokenizer)")


# ---- bad flags and bad data sets: one line, before any work -----------------------------------------

BAD_FLAGS = [  # (flags, the option the error must name)
    (["--grad_clip", "-1"], "--grad_clip"), (["--grad_accum", "0"], "--grad_accum"),
    (["--grad_accum", "-1"], "--grad_accum"), (["--max_steps", "-1"], "--max_steps"),
    (["--epochs", "0"], "--epochs"), (["--epochs", "-1"], "--epochs"), (["--log_interval", "0"], "--log_interval"),
    (["--batch_size", "0"], "--batch_size"), (["--lr", "-0.001"], "--lr"), (["--lr", "0"], "--lr"),
    (["--eval_fraction", "1.5"], "--eval_fraction"), (["--warmup_steps", "-1"], "--warmup_steps"),
    (["--center_coef", "-0.01"], "--center_coef"), (["--l2_coef", "-1"], "--l2_coef"), (["--beta1", "1"], "--beta1"),
    (["--save_interval", "-1"], "--save_interval"), (["--max_steps", "3", "--stop_at", "4"], "--stop_at"),
    (["--init", "", "--n_layer", "1"], "--tokenizer"), (["--device", "tpu"], "--device"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device")])


def run_main(argv, capsys):
    """train_rm.main(argv) in this process -> (exit code, stderr lines); 0 if it returned."""
    import train_rm
    try:
        train_rm.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("flags,option", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_before_any_work(tmp_path, sft_dir, capsys, flags, option):
    code, err = run_main(rm_args(tmp_path, sft_dir, "out")[1:] + flags, capsys)
    errors = [line for line in err if line.startswith("error:") or ": error:" in line]
    assert code != 0 and len(errors) == 1 and option in errors[0], err
    assert not (tmp_path / "out").exists()


def test_empty_eval_set_is_refused(tmp_path, sft_dir, capsys):
    long_rows = [{"prompt": "p", "chosen": " great" * 80, "rejected": " bad" * 80}] * 2
    ev = write_jsonl(tmp_path / "ev.jsonl", long_rows)
    code, err = run_main(rm_args(tmp_path, sft_dir, "o")[1:] + ["--eval_data", ev], capsys)
    assert code != 0 and err[-1] == f"error: {ev}: none of its 2 pair(s) fits in 64 tokens (each response alone is longer)"


# ---- a reward model learns a one-token difference ---------------------------------------------------

FILLER = [w for w in WORDS if w not in ("great", "bad")]


def one_word_pairs(n, seed):
    """Pairs that differ in exactly one word: chosen says "great", rejected "bad", with the same random
    filler (0-8 words) before and after it."""
    import random
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        before = "".join(" " + r.choice(FILLER) for _ in range(r.randint(0, 8)))
        after = "".join(" " + r.choice(FILLER) for _ in range(r.randint(0, 8)))
        rows.append({"prompt": "write a short review.", "chosen": f"{before} great{after}.",
                     "rejected": f"{before} bad{after}."})
    return rows


def test_reward_model_learns_a_one_token_difference(tmp_path, sft_dir):
    """From a tiny random trunk at the default learning rate and warm-up, 60 steps of 16 pairs: held-out
    pairs (new filler) are ranked right. Measured over 3 data x 2 init seeds: >= 0.995 at step 25 and 1.0
    from step 50 in all six runs (docs/design.md). What does fail is a run of very few optimizer steps, see
    test_short_run_warns."""
    import train_rm
    data = write_jsonl(tmp_path / "train.jsonl", one_word_pairs(1200, seed=0))
    held_out = write_jsonl(tmp_path / "eval.jsonl", one_word_pairs(200, seed=1))
    train_rm.main(["--data", data, "--eval_data", held_out, "--init", sft_dir, "--out_dir", str(tmp_path / "rm"),
                   "--max_steps", "60", "--batch_size", "16", "--log_interval", "60"])
    evals = [json.loads(x) for x in open(tmp_path / "rm" / "metrics.jsonl") if "eval/accuracy" in x]
    assert evals[-1]["step"] == 60 and evals[-1]["eval/accuracy"] >= 0.95, evals


def test_short_run_warns(tmp_path, sft_dir, capsys):
    """300 pairs at the default --epochs 1 are 9 optimizer steps, fewer than the 20 warm-up steps: the
    learning rate never reaches --lr and held-out accuracy on the one-word task stays at 0.67-0.80
    (27 steps: 0.995-1.0). The run says so at start-up instead of silently under-training."""
    import train_rm
    data = write_jsonl(tmp_path / "train.jsonl", one_word_pairs(300, seed=0))
    held_out = write_jsonl(tmp_path / "eval.jsonl", one_word_pairs(20, seed=1))
    train_rm.main(["--data", data, "--eval_data", held_out, "--init", sft_dir, "--out_dir", str(tmp_path / "rm"),
                   "--stop_at", "1"])
    assert ("warning: this run is 9 optimizer steps, fewer than --warmup_steps 20, so the learning rate never "
            "reaches --lr; raise --epochs or --max_steps, or lower --warmup_steps") in capsys.readouterr().err


def test_out_dir_equal_to_init_is_refused(tmp_path, sft_dir, capsys):
    """--out_dir equal to --init used to overwrite the SFT model: refused before anything is written, and
    the input model is left as it was."""
    import shutil
    init = str(tmp_path / "init")
    shutil.copytree(sft_dir, init)      # a private copy: the shared fixture must survive a regression here
    before = {f: os.path.getmtime(os.path.join(init, f)) for f in os.listdir(init)}
    args = rm_args(tmp_path, init, "o")[1:]
    args[args.index("--out_dir") + 1] = init
    code, err = run_main(args, capsys)
    assert code != 0 and err[-1] == (f"error: --out_dir {init} is, or is inside, the input --init {init}; "
                                     f"choose another --out_dir")
    assert {f: os.path.getmtime(os.path.join(init, f)) for f in os.listdir(init)} == before


def test_gold_agreement_is_pearson_and_the_reference_rankers_accuracy():
    """The optional diagnostic behind the reward(prompts, completions) interface, against float64 formulas."""
    from train_rm import gold_agreement
    g = torch.Generator().manual_seed(0)
    texts = [(f"p{i}", f"c{i}", f"r{i}") for i in range(9)]
    gold = {f"c{i}": float(i % 3) for i in range(9)} | {f"r{i}": float(i % 2) for i in range(9)}   # ties included
    calls = []

    def reward(prompts, completions):
        calls.append(prompts)
        return [gold[c] for c in completions]
    r_chosen, r_rejected = torch.randn(9, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)
    got = gold_agreement(texts, r_chosen, r_rejected, reward)
    gw = torch.tensor([gold[t[1]] for t in texts], dtype=torch.float64)
    gl = torch.tensor([gold[t[2]] for t in texts], dtype=torch.float64)
    want_corr = torch.corrcoef(torch.stack([torch.cat([r_chosen, r_rejected]), torch.cat([gw, gl])]))[0, 1]
    want_acc = ((gw > gl).double() + 0.5 * (gw == gl).double()).mean()
    assert calls == [[t[0] for t in texts]] * 2
    assert got["eval/gold_corr"] == pytest.approx(want_corr.item(), abs=1e-12)
    assert got["eval/gold_ranker_accuracy"] == pytest.approx(want_acc.item(), abs=1e-12)
    assert gold_agreement(texts, r_chosen, r_rejected, lambda p, c: [1.0] * len(c)) == {}   # constant reward: undefined


def test_gold_figures_only_where_every_eval_prompt_is_the_builtin_tasks(tmp_path, sft_dir):
    """train_rm asks the reward interface for the gold reward: on the built-in task's eval pairs it logs the
    gold reward's own accuracy on their labels; one off-task or one conversational prompt and none is logged."""
    import train_rm
    from nano_rlhf import reward
    from nano_rlhf.tasks import synthetic
    synthetic.write_dataset(str(tmp_path / "d"), seed=0, n_sft=20, n_pref=120, n_unpaired=20, n_prompts=4,
                            n_eval_prompts=4, n_listwise=8)
    rows = [json.loads(x) for x in open(tmp_path / "d" / "preference_eval.jsonl")]
    ev = [{"texts": (r["prompt"], r["chosen"], r["rejected"])} for r in rows]
    assert train_rm.gold_reference(ev) is reward.gold
    assert train_rm.gold_reference(ev + [{"texts": ("write a short review of the motor.", " a", " b")}]) is None
    chat = [{"role": "user", "content": rows[0]["prompt"]}]
    assert train_rm.gold_reference(ev + [{"texts": (chat, " a", " b")}]) is None
    train_rm.main(["--data", str(tmp_path / "d" / "preference.jsonl"), "--eval_data",
                   str(tmp_path / "d" / "preference_eval.jsonl"), "--init", sft_dir, "--out_dir", str(tmp_path / "rm"),
                   "--max_steps", "1", "--batch_size", "4", "--warmup_steps", "0"])
    final = [json.loads(x) for x in open(tmp_path / "rm" / "metrics.jsonl")][-1]
    g = [(synthetic.gold_reward(r["prompt"], r["chosen"]), synthetic.gold_reward(r["prompt"], r["rejected"]))
         for r in rows]
    want = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in g) / len(g)
    assert final["eval/gold_ranker_accuracy"] == pytest.approx(want, abs=1e-12) and "eval/gold_corr" in final
