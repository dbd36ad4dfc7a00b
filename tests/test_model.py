"""The model against HF transformers GPT-2 on the same weights, padding invariance, and generation."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_config, tiny_model
from numerics import FLOAT32_ATOL, MARGIN, assert_close64, greedy_margin
from nano_rlhf.model import GPT, GPTConfig, ScoreModel
from nano_rlhf.sampling import sample_token

pytestmark = pytest.mark.numeric     # also run under ATEN_CPU_CAPABILITY=default by .ci/run

transformers = pytest.importorskip("transformers")


def hf_lm(cfg, seed=0, cls="GPT2LMHeadModel", **kw):
    torch.manual_seed(seed)
    c = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                                n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0, eos_token_id=0, bos_token_id=0, pad_token_id=1, **kw)
    m = getattr(transformers, cls)(c).eval()
    with torch.no_grad():   # HF zero-inits biases and LayerNorms: randomise everything so no term hides
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def left_pad(ids, n_pad):
    """Row i loses its first n_pad[i] tokens and is left-padded (pad id 1) to a common width; returns
    ids, mask and HF's position ids for left padding (cumsum(mask) - 1)."""
    B, T = ids.shape
    W = T + max(n_pad)
    out = torch.ones(B, W, dtype=torch.long)
    mask = torch.zeros(B, W, dtype=torch.long)
    for i, n in enumerate(n_pad):
        row = ids[i, n:]                       # drop n tokens from the front: a shorter prompt
        out[i, W - len(row):] = row
        mask[i, W - len(row):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return out, mask, pos


@pytest.mark.parametrize("direction", ["hf_to_ours", "ours_to_hf"])
def test_logits_match_hf_gpt2(tmp_path, direction):
    cfg = tiny_config(vocab_size=97, n_layer=3, n_head=4, n_embd=48)
    if direction == "hf_to_ours":
        hf = hf_lm(cfg)
        hf.save_pretrained(tmp_path)
        ours = GPT.from_pretrained(tmp_path).eval()
    else:
        ours = tiny_model(vocab_size=97, n_layer=3, n_head=4, n_embd=48)
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        ours.save_pretrained(tmp_path)
        hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    torch.manual_seed(1)
    ids = torch.randint(2, 97, (4, 20))
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=FLOAT32_ATOL)
        # left padding: rows with 0, 3, 7 and 1 pads; HF needs explicit cumsum position ids
        pids, mask, pos = left_pad(ids, [0, 3, 7, 1])
        a, b = ours(pids, mask), hf(pids, attention_mask=mask, position_ids=pos).logits
        m = mask.bool()
        assert torch.allclose(a[m], b[m], atol=FLOAT32_ATOL)
        # and each padded row's real logits equal the unpadded row's
        for i, n in enumerate([0, 3, 7, 1]):
            alone = ours(ids[i:i + 1, n:])[0]
            assert torch.allclose(a[i][m[i]], alone, atol=FLOAT32_ATOL)


def test_right_padding_matches_unpadded():
    m = tiny_model(vocab_size=97)
    ids = torch.randint(2, 97, (3, 16))
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0
    mask[2, 5:] = 0
    padded = ids.masked_fill(mask == 0, 1)
    with torch.no_grad():
        out = m(padded, mask)
        for i in range(3):
            n = int(mask[i].sum())
            assert torch.allclose(out[i, :n], m(ids[i:i + 1, :n])[0], atol=FLOAT32_ATOL)


def test_select_returns_only_requested_positions():
    m = tiny_model(vocab_size=97)
    ids = torch.randint(2, 97, (2, 10))
    sel = torch.rand(2, 10) > 0.5
    with torch.no_grad():
        assert torch.allclose(m(ids, select=sel), m(ids)[sel], atol=1e-6)


def test_reads_the_three_hf_variants(tmp_path):
    """lm_head.weight present, no `transformer.` prefix, stale attn.bias buffers: all load to the same logits."""
    cfg = tiny_config(vocab_size=97)
    hf = hf_lm(cfg)
    hf.save_pretrained(tmp_path / "base")
    sd = load_file(tmp_path / "base" / "model.safetensors")
    ids = torch.randint(2, 97, (2, 12))
    want = hf(ids).logits
    variants = {
        "with_lm_head": dict(sd, **{"lm_head.weight": sd["transformer.wte.weight"].clone()}),
        "no_prefix": {k.replace("transformer.", "", 1): v for k, v in sd.items()},
        "attn_bias": dict(sd, **{f"transformer.h.{i}.attn.bias": torch.ones(1, 1, 64, 64).tril()
                                 for i in range(cfg.n_layer)}),
    }
    for name, v in variants.items():
        d = tmp_path / name
        d.mkdir()
        save_file(v, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text((tmp_path / "base" / "config.json").read_text())
        m = GPT.from_pretrained(d).eval()
        assert torch.allclose(m(ids), want, atol=FLOAT32_ATOL), name


def test_untied_lm_head_is_refused_unless_equal_to_wte(tmp_path):
    """tie_word_embeddings false: our GPT would silently use wte as the output layer, so a different
    lm_head.weight must be an error naming the directory; an lm_head equal to wte loads exactly."""
    cfg = tiny_config(vocab_size=97)
    hf = hf_lm(cfg, tie_word_embeddings=False)
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    hf.save_pretrained(tmp_path / "untied")
    assert "lm_head.weight" in load_file(tmp_path / "untied" / "model.safetensors")
    with pytest.raises(ValueError, match=f"{tmp_path / 'untied'}.*tie_word_embeddings"):
        GPT.from_pretrained(tmp_path / "untied")
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.transformer.wte.weight)
    hf.save_pretrained(tmp_path / "equal")
    ids = torch.randint(2, 97, (2, 12))
    with torch.no_grad():
        assert torch.allclose(GPT.from_pretrained(tmp_path / "equal").eval()(ids), hf(ids).logits, atol=FLOAT32_ATOL)


def test_written_layout_is_canonical(tmp_path):
    m = tiny_model(vocab_size=97, n_layer=2)
    m.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    assert len(sd) == 4 + 12 * 2 and "lm_head.weight" not in sd
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)      # Conv1D [in, out]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["n_positions"] == 64


@pytest.mark.parametrize("direction", ["hf_to_ours", "ours_to_hf"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_score_model_matches_hf_sequence_classification(tmp_path, padding, direction):
    """HF finds each row's last real token from pad_token_id (= 1 here; real ids are >= 2), ours from the
    mask: both read the same position whichever side the padding is on."""
    if direction == "hf_to_ours":
        hf = hf_lm(tiny_config(vocab_size=97), seed=3, cls="GPT2ForSequenceClassification", num_labels=1)
        hf.save_pretrained(tmp_path / "rm")
        ours = ScoreModel.from_pretrained(tmp_path / "rm").eval()
    else:
        lm = tiny_model(vocab_size=97)
        lm.cfg.pad_token_id, lm.cfg.eos_token_id = 1, 0
        lm.save_pretrained(tmp_path / "lm")
        torch.manual_seed(3)
        ours = ScoreModel.from_pretrained(tmp_path / "lm", new_head=True).eval()
        with torch.no_grad():
            for p in ours.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        ours.save_pretrained(tmp_path / "rm")
        hf = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    ids = torch.randint(2, 97, (3, 14))
    mask = torch.ones_like(ids)
    lens = [14, 9, 4]
    for i, n in enumerate(lens):
        if padding == "right":
            mask[i, n:] = 0
        else:
            mask[i, :14 - n] = 0
    ids = ids.masked_fill(mask == 0, 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        scores, end = ours(ids, mask)
        want = hf(ids, attention_mask=mask, position_ids=pos).logits.squeeze(-1)
    assert torch.allclose(end, want, atol=FLOAT32_ATOL)
    back = ScoreModel.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        assert torch.equal(back(ids, mask)[1], end)


def test_score_model_head_init_and_missing_head(tmp_path):
    lm = tiny_model(vocab_size=97, n_embd=64)
    lm.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no score head"):
        ScoreModel.from_pretrained(tmp_path)
    torch.manual_seed(0)
    w = torch.cat([ScoreModel.from_pretrained(tmp_path, new_head=True).score.weight.flatten() for _ in range(20)])
    assert abs(w.std().item() - 1 / 65 ** 0.5) < 0.02
    assert ScoreModel(tiny_config(vocab_size=97)).score.bias is None


def test_missing_files_give_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        GPT.from_pretrained(tmp_path)


# ---- generation -----------------------------------------------------------------------------------

def _prompts(n_pad=(0, 2, 5)):
    torch.manual_seed(5)
    ids = torch.randint(2, 97, (len(n_pad), 8))
    return left_pad(ids, list(n_pad))


def test_cached_and_uncached_greedy_identical():
    m = tiny_model(vocab_size=97)
    ids, mask, _ = _prompts()
    a = m.generate(ids, mask, 30, temperature=0, eos_token_id=0, pad_token_id=1, use_cache=True)
    b = m.generate(ids, mask, 30, temperature=0, eos_token_id=0, pad_token_id=1, use_cache=False)
    assert (a[:, ids.shape[1]:] != 0).all() and greedy_margin(m, a, mask) > MARGIN     # tests/numerics.py
    assert torch.equal(a, b) and a.shape[1] == ids.shape[1] + 30


def test_batched_left_padded_equals_one_by_one():
    m = tiny_model(vocab_size=97)
    ids, mask, _ = _prompts()
    batch = m.generate(ids, mask, 20, temperature=0, eos_token_id=None, pad_token_id=1)
    assert greedy_margin(m, batch, mask) > MARGIN                      # tests/numerics.py
    for i in range(ids.shape[0]):
        row = ids[i][mask[i].bool()][None]
        alone = m.generate(row, None, 20, temperature=0, eos_token_id=None, pad_token_id=1)
        assert torch.equal(alone[0, row.shape[1]:], batch[i, ids.shape[1]:])


def test_eos_stops_and_pads_finished_rows():
    m = tiny_model(vocab_size=97)
    ids, mask, _ = _prompts()
    greedy = m.generate(ids, mask, 12, temperature=0, pad_token_id=1)
    g0 = greedy[0, ids.shape[1]:].tolist()
    k = next(i for i in range(1, 12) if g0[i] not in g0[:i])   # first new token after the start
    eos = g0[k]                                                 # ... becomes the end-of-text
    out = m.generate(ids, mask, 12, temperature=0, eos_token_id=eos, pad_token_id=1)
    gen = out[:, ids.shape[1]:]
    for row in gen:
        hits = (row == eos).nonzero()
        if len(hits):
            assert (row[hits[0, 0] + 1:] == 1).all()
    assert gen[0, :k].tolist() == g0[:k] and gen[0, k] == eos and (gen[0, k + 1:] == 1).all()


def test_early_stop_when_all_rows_end():
    m = tiny_model(vocab_size=97)
    ids, mask, _ = _prompts((0,))
    first = int(m.generate(ids, mask, 1, temperature=0)[0, -1])
    out = m.generate(ids, mask, 20, temperature=0, eos_token_id=first, pad_token_id=1)
    assert out.shape[1] == ids.shape[1] + 1


def test_sampling_reproducible_with_generator_and_topk1_is_greedy():
    m = tiny_model(vocab_size=97)
    ids, mask, _ = _prompts()
    g = lambda s: torch.Generator().manual_seed(s)
    a = m.generate(ids, mask, 15, temperature=1.0, generator=g(1))
    b = m.generate(ids, mask, 15, temperature=1.0, generator=g(1))
    c = m.generate(ids, mask, 15, temperature=1.0, generator=g(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = m.generate(ids, mask, 15, temperature=0)
    assert torch.equal(m.generate(ids, mask, 15, temperature=0.7, top_k=1, generator=g(3)), greedy)
    assert torch.equal(m.generate(ids, mask, 15, temperature=1.0, top_p=1e-6, generator=g(3)), greedy)


def test_sample_token_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    s = sample_token(logits, 1.0, top_k=2, generator=g)
    assert set(s.tolist()) == {2, 3}
    p = torch.softmax(logits[0], -1)          # p = [.032, .087, .237, .644]: top_p 0.8 keeps {3, 2}
    s = sample_token(logits, 1.0, top_p=0.8, generator=g)
    assert set(s.tolist()) == {2, 3}
    s = sample_token(logits, 1.0, generator=g)
    freq = torch.bincount(s, minlength=4).float() / len(s)
    assert torch.allclose(freq, p, atol=0.04)


def test_prompt_too_long_for_block_size():
    m = tiny_model(vocab_size=97, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        m.generate(torch.randint(2, 97, (1, 10)), None, 10)


def test_dropout_is_configurable_and_off_by_default():
    assert GPTConfig().dropout == 0.0
    m = tiny_model(vocab_size=97, dropout=0.5).train()
    ids = torch.randint(2, 97, (2, 10))
    assert not torch.equal(m(ids), m(ids))
    m.eval()
    assert torch.equal(m(ids), m(ids))


def test_pad_id_outside_vocab_is_accepted():
    """GPT-2's tokenizer has no pad: pad = vocab_size is replaced before the embedding, always masked."""
    m = tiny_model(vocab_size=97, pad_token_id=97)
    ids = torch.randint(2, 97, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    padded = ids.masked_fill(mask == 0, 97)
    with torch.no_grad():
        out = m(padded, mask)
        assert torch.allclose(out[1, 4:], m(ids[1:, 4:])[0], atol=FLOAT32_ATOL)
    gen = m.generate(padded, mask, 5, temperature=0, eos_token_id=0, pad_token_id=97)
    assert gen.shape == (2, 15)


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_end_only_scores_equal_full_scores_with_gradients(padding):
    torch.manual_seed(0)
    m1 = ScoreModel(tiny_config(vocab_size=97, n_layer=3)).double()    # float64: tests/numerics.py
    m2 = ScoreModel(tiny_config(vocab_size=97, n_layer=3)).double()
    m2.load_state_dict(m1.state_dict())
    ids = torch.randint(2, 97, (4, 12))
    mask = None
    if padding != "none":
        mask = torch.ones_like(ids)
        for i, n in enumerate([12, 7, 3, 10]):
            if padding == "right":
                mask[i, n:] = 0
            else:
                mask[i, :12 - n] = 0
    _, full = m1(ids, mask)
    none, end = m2(ids, mask, end_only=True)
    assert none is None
    assert_close64(end, full)
    full.sum().backward()
    end.sum().backward()
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert_close64(a.grad, b.grad, msg=n)
