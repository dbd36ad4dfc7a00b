"""train_rm.py: score index, one concatenated forward, DDP, end to end with transformers parity."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import weights_close, pref_rows, run, tiny_model, write_jsonl
from nano_rlhf.data import collate_pairs, tokenize_pairs
from nano_rlhf.model import ScoreModel
from train_rm import pair_scores, reward_loss


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
            assert torch.allclose(m(alone)[1], end[i:i + 1], atol=1e-5)


def test_one_concatenated_forward_equals_two(tok):
    p = pairs(tok, 8)
    ids, attn, _, margin = collate_pairs(p, tok.pad_id)
    m1, m2 = score_model(tok), score_model(tok)
    rw, rl = pair_scores(m1, ids, attn)
    loss1 = reward_loss(rw, rl, margin, 0.01, 0.001).mean()
    loss1.backward()
    B = len(p)
    _, ew = m2(ids[:B], attn[:B])
    _, el = m2(ids[B:], attn[B:])
    loss2 = reward_loss(ew, el, margin, 0.01, 0.001).mean()
    loss2.backward()
    assert torch.allclose(loss1, loss2, atol=1e-6)
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n


def rm_args(tmp_path, sft_dir, out, *extra, steps=4):
    data = tmp_path / "pref.jsonl"
    if not data.exists():
        write_jsonl(data, pref_rows(80))
        write_jsonl(tmp_path / "pref_eval.jsonl", pref_rows(16, seed=1))
    return ["train_rm.py", "--data", str(data), "--eval_data", str(tmp_path / "pref_eval.jsonl"), "--init", sft_dir,
            "--out_dir", str(tmp_path / out), "--max_steps", str(steps), "--log_interval", "1", "--eval_interval", "0",
            "--warmup_steps", "1", "--lr", "1e-3", *extra]


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
    # the saved model loads in transformers and gives the same scores
    from nano_rlhf.tokenizer import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ours = ScoreModel.from_pretrained(str(out)).eval()
    hf = transformers.GPT2ForSequenceClassification.from_pretrained(str(out)).eval()
    ids, attn, _, _ = collate_pairs(tokenize_pairs(pref_rows(4, seed=2), tok, 64)[0], tok.pad_id)
    with torch.no_grad():
        assert torch.allclose(ours(ids, attn)[1], hf(ids, attention_mask=attn).logits.squeeze(-1), atol=1e-5)
    # the eval statistics recorded for PPO are those of the final model
    assert abs(ours.extra_config["reward_mean"] - metrics[-1]["eval/score_mean"]) < 1e-6


def test_resume_bit_exact(tmp_path, sft_dir):
    run(rm_args(tmp_path, sft_dir, "a", "--batch_size", "8", steps=6))
    run(rm_args(tmp_path, sft_dir, "b", "--batch_size", "8", "--stop_at", "3", steps=6))
    run(rm_args(tmp_path, sft_dir, "b", "--batch_size", "8", "--resume", steps=6))
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_input_exits_with_file_line(tmp_path, sft_dir):
    bad = write_jsonl(tmp_path / "bad.jsonl", [pref_rows(1)[0], {"prompt": "p", "chosen": " a"}])
    p = run(["train_rm.py", "--data", bad, "--init", sft_dir, "--out_dir", str(tmp_path / "o")], check=False)
    assert p.returncode != 0 and p.stderr.strip().endswith(f"{bad}:2: missing field 'rejected'")
