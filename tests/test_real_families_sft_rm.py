"""SFT and reward-model training from tiny checkpoints of real model families (Llama 3.1, Qwen3; built by
tests/hf_fixtures.py with transformers' random init and the family's real chat template), on conversational
data: the scripts run, their output directories load in transformers with the same logits / scores, the
saved tokenizer renders conversations with apply_chat_template as we do, packing and activation
checkpointing change nothing they should not."""
import json
import os

import pytest
import torch
from numerics import FLOAT32_ATOL  # float32 values of order one: see tests/numerics.py

from hf_fixtures import FAMILIES, make_hf_dir, pref_rows, sft_rows, write_jsonl
from nano_rlhf.data import collate_packed, collate_pairs, collate_sft, pack_sft, tokenize_pairs, tokenize_sft
from nano_rlhf.model import GPT, ScoreModel, last_token_index
from nano_rlhf.training import load_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    """(family, checkpoint directory, directory of conversational SFT and preference JSONL)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    d = make_hf_dir(root / "model", family)
    write_jsonl(root / "sft.jsonl", sft_rows(24))
    write_jsonl(root / "pref.jsonl", pref_rows(24))
    return family, d, root


def common_args(init, out, *extra, steps=2):
    return ["--init", init, "--out_dir", str(out), "--max_steps", str(steps), "--batch_size", "4",
            "--eval_fraction", "0.2", "--warmup_steps", "0", "--log_interval", "1", "--eval_interval", "0", *extra]


def sft(init, data, out, *extra, steps=2):
    import train_sft
    train_sft.main(["--data", str(data), "--lr", "1e-3", *common_args(init, out, *extra, steps=steps)])
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def rm(init, data, out, *extra, steps=2):
    import train_rm
    train_rm.main(["--data", str(data), "--lr", "1e-3", *common_args(init, out, *extra, steps=steps)])
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def assert_chat_template_works(out, messages):
    """AutoTokenizer(out).apply_chat_template gives the ids we train on (and, as a prompt, those we generate
    from)."""
    tok = load_tokenizer("", str(out))
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    got = hf_tok.apply_chat_template(messages, tokenize=True)
    got = got["input_ids"] if hasattr(got, "keys") else got
    assert got == tok.encode_conversation(messages)[0]
    prompt = hf_tok.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert prompt == tok.render_prompt(messages[:1])


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_sft_from_real_family_loads_in_transformers(family_dir, tmp_path, packing):
    family, init, root = family_dir
    out = tmp_path / "sft"
    metrics = sft(init, root / "sft.jsonl", out, *(["--packing"] if packing else []))
    assert [m["step"] for m in metrics] == [1, 2] and all(m["train/loss"] > 0 for m in metrics)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == family
    ours = GPT.from_pretrained(str(out)).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=FLOAT32_ATOL)
    # trained: the weights moved away from the initial checkpoint
    start = GPT.from_pretrained(init)
    assert not torch.equal(start.trunk.embedding.weight, ours.trunk.embedding.weight)
    assert_chat_template_works(out, sft_rows(3)[2]["messages"])


@pytest.mark.numeric
def test_packed_loss_and_gradients_equal_unpacked_with_rope(family_dir):
    """The packed loss and gradients of a real family's model (rotary positions restarting per example,
    grouped-query attention under the block-diagonal mask) equal the unpacked ones, several of the fixture's
    conversations per row. The model runs in float64: the two layouts sum in different orders, so in float32
    they differ by rounding of the order of a few ulp of each gradient's largest terms (elementwise, a small
    gradient entry can lose every digit to cancellation); in float64 the same difference is ~1e-16 relative and
    a tight tolerance checks the masking and positions, not the CPU's summation order."""
    from train_sft import sft_nll
    family, init, root = family_dir
    tok = load_tokenizer("", init)
    model = GPT.from_pretrained(init, block_size=512).double()   # rope: any context; ~70-token rows pack 3-7 per row
    model.cfg.pad_token_id = tok.pad_id
    examples = tokenize_sft(sft_rows(12), tok, 256)[0]
    packed = pack_sft(examples, 256)
    assert len(packed) < len(examples) / 2 and max(len(r[2]) for r in packed) >= 3
    results = []
    for batch in (collate_packed(packed, tok.pad_id), collate_sft(examples, tok.pad_id)):
        model.zero_grad()
        ids, attn, lm, *packing = batch
        nll, n = sft_nll(model, ids, attn, lm, *packing)
        nll.backward()
        results.append((nll.item(), n, [p.grad.clone() for p in model.parameters()]))
    (p_nll, p_n, p_g), (u_nll, u_n, u_g) = results
    assert p_n == u_n and p_nll == pytest.approx(u_nll, rel=1e-12)
    for a, b in zip(p_g, u_g):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12 * float(b.abs().max()))


def test_grad_checkpoint_gives_the_same_first_step(family_dir, tmp_path, monkeypatch):
    """--grad_checkpoint recomputes blocks (counted: the blocks do go through torch's checkpoint) and gives
    the same first-step loss and gradient norm, in SFT and in the reward model."""
    import nano_rlhf.model
    calls = []

    def counting(fn, *args, **kw):
        calls.append(fn)
        return torch.utils.checkpoint.checkpoint(fn, *args, **kw)
    monkeypatch.setattr(nano_rlhf.model, "checkpoint", counting)
    family, init, root = family_dir
    a = sft(init, root / "sft.jsonl", tmp_path / "a", steps=1)
    assert not calls
    b = sft(init, root / "sft.jsonl", tmp_path / "b", "--grad_checkpoint", steps=1)
    assert len(calls) >= 2 and all(isinstance(f, nano_rlhf.model._Block) for f in calls)
    calls.clear()
    assert a[0]["train/loss"] == pytest.approx(b[0]["train/loss"], rel=1e-6)
    assert a[0]["train/grad_norm"] == pytest.approx(b[0]["train/grad_norm"], rel=1e-4)
    c = rm(init, root / "pref.jsonl", tmp_path / "c", steps=1)
    assert not calls
    d = rm(init, root / "pref.jsonl", tmp_path / "d", "--grad_checkpoint", steps=1)
    assert calls
    assert c[0]["train/loss"] == pytest.approx(d[0]["train/loss"], rel=1e-6)
    assert c[0]["train/grad_norm"] == pytest.approx(d[0]["train/grad_norm"], rel=1e-4)


def test_reward_model_scores_the_end_of_turn_token(family_dir):
    """For conversational pairs every scored sequence ends with the template's end-of-turn token, and the
    score is read there (the last real token of each row)."""
    family, init, root = family_dir
    tok = load_tokenizer("", init)
    assert tok.eot_token == {"llama": "<|eot_id|>", "qwen3": "<|im_end|>"}[family]
    pairs, _ = tokenize_pairs(pref_rows(6), tok, 128)
    ids, attn, _, _ = collate_pairs(pairs, tok.pad_id)
    end = ids[torch.arange(len(ids)), last_token_index(ids, attn)]
    assert (end == tok.eot_id).all()


def test_reward_model_from_real_family_matches_transformers(family_dir, tmp_path):
    family, init, root = family_dir
    out = tmp_path / "rm"
    metrics = rm(init, root / "pref.jsonl", out)
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["reward_std"] > 0
    tok = load_tokenizer("", str(out))
    assert cfg["pad_token_id"] == tok.pad_id != tok.eot_id     # transformers finds the end through the pad id
    ours = ScoreModel.from_pretrained(str(out)).eval()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    pairs, _ = tokenize_pairs(pref_rows(4, seed=3), tok, 128)
    ids, attn, _, _ = collate_pairs(pairs, tok.pad_id)
    assert not attn.all()                                        # rows of different lengths: real padding
    with torch.no_grad():
        right = hf(ids, attention_mask=attn).logits.squeeze(-1)
        assert torch.allclose(ours(ids, attn)[1], right, atol=FLOAT32_ATOL)
        # left-padded: the same rows moved right; transformers takes positions from us (counted over real tokens)
        shift = (attn == 0).sum(1)
        left_ids = torch.stack([r.roll(int(s)) for r, s in zip(ids, shift)])
        left_attn = torch.stack([r.roll(int(s)) for r, s in zip(attn, shift)])
        pos = (left_attn.cumsum(-1) - 1).clamp(min=0)
        left = hf(left_ids, attention_mask=left_attn, position_ids=pos).logits.squeeze(-1)
        assert torch.allclose(ours(left_ids, left_attn)[1], left, atol=FLOAT32_ATOL)
        assert torch.allclose(left, right, atol=FLOAT32_ATOL)
    assert_chat_template_works(out, sft_rows(1)[0]["messages"])


def test_resume_with_another_date_string_is_refused(tmp_path, capsys):
    """The Llama 3 date is part of what the data renders to: it is in the run identity, so --resume with
    another --date_string stops with one line instead of training on different tokens."""
    root = tmp_path
    init = make_hf_dir(root / "llama", "llama")
    data = write_jsonl(root / "sft.jsonl", sft_rows(16))
    sft(init, data, root / "out", "--date_string", "01 Jan 2025", "--stop_at", "1", steps=2)
    run_json = json.loads(next((root / "out" / "state").rglob("run.json")).read_text())
    assert run_json["identity"]["date_string"] == "01 Jan 2025"
    assert run_json["identity"]["chat_template"] == "llama3"
    with pytest.raises(SystemExit):
        sft(init, data, root / "out", "--resume", steps=2)       # the template's default date: 26 Jul 2024
    err = capsys.readouterr().err
    assert "error: --resume" in err and "date_string '01 Jan 2025' != '26 Jul 2024'" in err
    sft(init, data, root / "out", "--resume", "--date_string", "01 Jan 2025", steps=2)
    tok = load_tokenizer("", str(root / "out"))
    assert tok.date_string == "01 Jan 2025"        # saved with the tokenizer for the next stage
