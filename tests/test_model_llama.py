"""The Llama family (llama, qwen2, qwen3) against transformers on tiny random-init models that keep each family's
quirks: grouped-query attention (4/2 and SmolLM2's 3/1), head_dim != width/heads, q/k/v bias (Qwen2), o_proj bias
(Llama attention_bias), per-head q/k norm (Qwen3), tied and untied output layers, Llama-3 rope scaling."""
import json

import pytest
import torch

from nano_rlhf.model import GPT, GPTConfig, ScoreModel, expected_shapes, rope_frequencies, token_logprobs
from numerics import FLOAT32_ATOL, MARGIN, greedy_margin

pytestmark = pytest.mark.numeric     # also run under ATEN_CPU_CAPABILITY=default by .ci/run

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V = 128
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {   # name -> (transformers prefix, config kwargs)
    "llama_gqa_untied": ("Llama", dict(hidden_size=48, intermediate_size=96, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama_smol_3_1_tied": ("Llama", dict(hidden_size=48, intermediate_size=80, num_attention_heads=3,
                                          num_key_value_heads=1, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                          rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "llama3_scaled_bias": ("Llama", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                         num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True,
                                         rope_parameters=dict(LLAMA3))),
    "qwen2": ("Qwen2", dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("Qwen3", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}
NAMES = list(FAMILIES)


def hf_config(name, **kw):
    prefix, extra = FAMILIES[name]
    d = dict(vocab_size=V, num_hidden_layers=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
             pad_token_id=1, attention_dropout=0.0, **extra)
    d.update(kw)
    return getattr(transformers, prefix + "Config")(**d)


def hf_model(name, head="lm", seed=0, **kw):
    prefix = FAMILIES[name][0]
    torch.manual_seed(seed)
    cls = getattr(transformers, prefix + ("ForCausalLM" if head == "lm" else "ForSequenceClassification"))
    m = cls(hf_config(name, **({"num_labels": 1} if head == "score" else {}), **kw)).eval()
    with torch.no_grad():   # norms start at 1 and biases at 0: randomise everything so no term hides
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def our_config(name):
    """The GPTConfig our reader makes of the family's config (through a saved HF config)."""
    from nano_rlhf.model import config_from_hf
    return config_from_hf(hf_config(name).to_dict(), "config.json")


def randomise(model, seed=3):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def padded_batch(seed=1, lens=(20, 14, 7, 17), side="left"):
    """Ids >= 2 (1 = pad, 0 = eos), mask, and HF's position ids for the padding (cumsum(mask) - 1)."""
    torch.manual_seed(seed)
    W = max(lens)
    ids = torch.randint(2, V, (len(lens), W))
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        if side == "left":
            mask[i, W - n:] = 1
        else:
            mask[i, :n] = 1
    ids = ids.masked_fill(mask == 0, 1)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def both(name, tmp_path, direction, head="lm"):
    """(ours, transformers) holding the same weights, converted in the given direction."""
    Ours = GPT if head == "lm" else ScoreModel
    Auto = transformers.AutoModelForCausalLM if head == "lm" else transformers.AutoModelForSequenceClassification
    if direction == "hf_to_ours":
        hf = hf_model(name, head)
        hf.save_pretrained(tmp_path / "hf")
        return Ours.from_pretrained(tmp_path / "hf").eval(), hf
    cfg = our_config(name)
    cfg.pad_token_id, cfg.eos_token_id = 1, 0
    ours = randomise(Ours(cfg))
    ours.save_pretrained(tmp_path / "ours")
    return ours, Auto.from_pretrained(tmp_path / "ours").eval()


@pytest.mark.parametrize("direction", ["hf_to_ours", "ours_to_hf"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(tmp_path, name, direction):
    ours, hf = both(name, tmp_path, direction)
    ids, mask, pos = padded_batch()
    with torch.no_grad():
        full = torch.randint(2, V, (2, 24))
        assert torch.allclose(ours(full), hf(full).logits, atol=FLOAT32_ATOL)
        a, b = ours(ids, mask), hf(ids, attention_mask=mask, position_ids=pos).logits
        m = mask.bool()
        assert torch.allclose(a[m], b[m], atol=FLOAT32_ATOL)
        for i in range(ids.shape[0]):     # and each left-padded row equals the row alone
            assert torch.allclose(a[i][m[i]], ours(ids[i:i + 1, m[i]])[0], atol=FLOAT32_ATOL)


@pytest.mark.parametrize("direction", ["hf_to_ours", "ours_to_hf"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen2", "qwen3"])
def test_score_model_matches_transformers(tmp_path, name, side, direction):
    """HF reads the score at the rightmost token that is not pad_token_id (1 here, real ids >= 2); ours at the
    last mask-1 position: the same token on either padding side."""
    ours, hf = both(name, tmp_path, direction, head="score")
    assert hf.config.architectures == [f"{FAMILIES[name][0]}ForSequenceClassification"]
    ids, mask, pos = padded_batch(side=side)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=pos).logits.squeeze(-1)
        _, end = ours(ids, mask)
        _, end_only = ours(ids, mask, end_only=True)
    assert torch.allclose(end, want, atol=FLOAT32_ATOL) and torch.allclose(end_only, want, atol=FLOAT32_ATOL)


def test_reward_model_from_language_model_and_back(tmp_path):
    hf = hf_model("qwen3")
    hf.save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match="no score head"):
        ScoreModel.from_pretrained(tmp_path / "lm")
    rm = ScoreModel.from_pretrained(tmp_path / "lm", new_head=True)
    for k, v in hf.model.state_dict().items():
        assert torch.equal(rm.model.state_dict()[k], v), k
    rm.save_pretrained(tmp_path / "rm", reward_mean=0.5)
    back = GPT.from_pretrained(tmp_path / "rm", tie_word_embeddings=True)   # a reward model's trunk, as a GPT
    assert torch.equal(back.model.norm.weight, hf.model.norm.weight)
    assert ScoreModel.from_pretrained(tmp_path / "rm").extra_config == {"reward_mean": 0.5}


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(tmp_path, name):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(tmp_path)
    ids, mask, _ = padded_batch(lens=(9, 5, 12))
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                       pad_token_id=1)
    got = ours.generate(ids, mask, 12, temperature=0, pad_token_id=1)
    assert greedy_margin(ours, want, mask) > MARGIN                     # tests/numerics.py
    assert torch.equal(got, want)
    assert torch.equal(ours.generate(ids, mask, 12, temperature=0, pad_token_id=1, use_cache=False), want)


def test_generate_stops_at_any_of_several_end_tokens():
    torch.manual_seed(0)
    m = randomise(GPT(our_config("qwen2")))
    ids, mask, _ = padded_batch(lens=(6, 3))
    greedy = m.generate(ids, mask, 10, temperature=0, pad_token_id=1)[:, ids.shape[1]:]
    ends = {int(greedy[0, 2]), int(greedy[1, 4])}        # two different end tokens, one per row
    out = m.generate(ids, mask, 10, temperature=0, eos_token_id=ends, pad_token_id=1)[:, ids.shape[1]:]
    for row, g in zip(out, greedy):
        k = next(i for i, t in enumerate(g.tolist()) if t in ends)
        assert torch.equal(row[:k + 1], g[:k + 1]) and (row[k + 1:] == 1).all()


def test_kv_cache_stores_only_kv_heads():
    """A GQA cache holds n_kv_head heads; cached and uncached greedy decoding give the same tokens."""
    cfg = our_config("llama_smol_3_1_tied")
    m = randomise(GPT(cfg))
    seen = []
    orig = m.model.forward_cached

    def spy(ids, mask, pos, cache, cache_pos):
        seen.append(cache[0][0].shape)
        return orig(ids, mask, pos, cache, cache_pos)
    m.model.forward_cached = spy
    ids, mask, _ = padded_batch(lens=(8, 3, 6))
    a = m.generate(ids, mask, 15, temperature=0, pad_token_id=1)
    assert seen[0] == (3, 1, 8 + 15, 16)
    assert greedy_margin(m, a, mask) > MARGIN
    assert torch.equal(a, m.generate(ids, mask, 15, temperature=0, pad_token_id=1, use_cache=False))


def test_export_transformers_reexport_import_is_bit_exact(tmp_path):
    for name in NAMES:
        cfg = our_config(name)
        ours = randomise(GPT(cfg))
        ours.save_pretrained(tmp_path / name / "a")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name / "a")
        hf.save_pretrained(tmp_path / name / "b")
        back = GPT.from_pretrained(tmp_path / name / "b")
        sa, sb = ours.state_dict(), back.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name
        written = json.loads((tmp_path / name / "a" / "config.json").read_text())
        assert written["model_type"] == cfg.model_type and written["dtype"] == "float32"
        assert written["architectures"] == [f"{FAMILIES[name][0]}ForCausalLM"]


def test_sharded_and_bf16_checkpoints_load(tmp_path):
    hf = hf_model("llama_gqa_untied")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    ids = torch.randint(2, V, (2, 16))
    with torch.no_grad():
        assert torch.allclose(GPT.from_pretrained(tmp_path / "sharded").eval()(ids), hf(ids).logits, atol=FLOAT32_ATOL)
        hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
        ours = GPT.from_pretrained(tmp_path / "bf16").eval()
        assert ours.lm_head.weight.dtype == torch.float32
        assert torch.equal(ours.lm_head.weight, hf.lm_head.weight.float())
        # a fresh float32 load (hf.float() would keep the rotary buffer rounded to bf16)
        hf32 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
        assert torch.allclose(ours(ids), hf32(ids).logits, atol=FLOAT32_ATOL)


def test_old_style_rope_theta_and_rope_scaling_read_like_rope_parameters(tmp_path):
    """Configs written before transformers 5 keep rope_theta top-level and the scaling under rope_scaling."""
    hf = hf_model("llama3_scaled_bias")
    hf.save_pretrained(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = rp
    (tmp_path / "config.json").write_text(json.dumps(c))
    ours = GPT.from_pretrained(tmp_path).eval()
    assert ours.cfg.rope_scaling["factor"] == 4.0 and ours.cfg.rope_theta == 10000.0
    ids = torch.randint(2, V, (2, 30))
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=FLOAT32_ATOL)


def test_rope_frequencies_equal_transformers_and_llama3_changes_them():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hc = hf_config("llama3_scaled_bias")
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hc, "cpu")
    cfg = our_config("llama3_scaled_bias")
    got = rope_frequencies(cfg)
    assert torch.equal(got, want)
    plain = rope_frequencies(GPTConfig(**{**cfg.__dict__, "rope_scaling": None}))
    ratio = plain / got
    # wavelength 2*pi lies in the smoothed band (16/4, 16): slowed by less than the factor; the rest by 4
    assert 1.5 < ratio[0] < 3.5 and torch.allclose(ratio[1:], torch.full((7,), 4.0))


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen3"])
def test_expected_shapes_equal_the_built_model(name):
    cfg = our_config(name)
    for cls, head in ((GPT, "lm"), (ScoreModel, "score")):
        sd = cls(cfg).state_dict()
        assert expected_shapes(cfg, head) == {k: tuple(v.shape) for k, v in sd.items()}
    g = GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=16, bias=False)
    assert expected_shapes(g, "lm") == {k: tuple(v.shape) for k, v in GPT(g).state_dict().items()}


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_gradient_checkpointing_gives_identical_loss_and_gradients(family):
    cfg = GPTConfig(vocab_size=V, n_layer=2, n_head=2, n_embd=32) if family == "gpt2" else our_config("qwen3")
    torch.manual_seed(0)
    a = GPT(cfg)
    b = GPT(cfg)
    b.load_state_dict(a.state_dict())
    b.gradient_checkpointing = True
    assert b.set_grad_checkpointing(True).gradient_checkpointing and not a.gradient_checkpointing
    ids, mask, _ = padded_batch()
    used = []
    import torch.utils.checkpoint as ckpt
    orig = ckpt.checkpoint

    def spy(*args, **kw):
        used.append(kw.get("use_reentrant"))
        return orig(*args, **kw)
    import nano_rlhf.model as M
    M.checkpoint = spy
    try:
        losses = []
        for m in (a, b):
            logits = m(ids, mask)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
            loss.backward()
            losses.append(loss)
    finally:
        M.checkpoint = orig
    assert used == [False] * cfg.n_layer          # every block of the checkpointed model, none of the plain one
    assert torch.equal(losses[0], losses[1])
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), n


# ---- the chunked output layer ------------------------------------------------------------------

def _reference(h, w, t, temperature):
    logp = (h @ w.T / temperature).log_softmax(-1)
    return logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_token_logprobs_equal_unchunked_with_gradients(chunk):
    torch.manual_seed(0)
    h0, w0 = torch.randn(64, 16), torch.randn(300, 16)
    t = torch.randint(0, 300, (64,))
    h1, w1, h2, w2 = (x.clone().requires_grad_() for x in (h0, w0, h0, w0))
    lp, ent = token_logprobs(h1, w1, t, temperature=0.7, chunk_size=chunk, with_entropy=True)
    rlp, rent = _reference(h2, w2, t, 0.7)
    assert lp.dtype == torch.float32 and lp.shape == (64,)
    assert torch.allclose(lp, rlp, atol=FLOAT32_ATOL) and torch.allclose(ent, rent, atol=FLOAT32_ATOL)
    (lp.sum() + 0.3 * ent.sum()).backward()
    (rlp.sum() + 0.3 * rent.sum()).backward()
    assert torch.allclose(h1.grad, h2.grad, atol=FLOAT32_ATOL) and torch.allclose(w1.grad, w2.grad, atol=FLOAT32_ATOL)
    assert torch.allclose(token_logprobs(h0, w0, t, chunk_size=chunk), _reference(h0, w0, t, 1.0)[0], atol=FLOAT32_ATOL)


def _largest_tensor(fn):
    """The largest number of elements of any tensor an op produces while fn runs (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Track(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in tree_flatten(out)[0]:
                if isinstance(x, torch.Tensor):
                    Track.biggest = max(Track.biggest, x.numel())
            return out
    with Track():
        fn()
    return Track.biggest


def test_token_logprobs_never_materialises_all_logits():
    """N = 256 positions, V = 300, width 16: all logits would be 76,800 elements; chunks of 8 keep every
    tensor of forward and backward at most 8 * 300 (or the (V, C) weight gradient, 4,800)."""
    torch.manual_seed(0)
    N, V_, C = 256, 300, 16
    h, w = torch.randn(N, C, requires_grad=True), torch.randn(V_, C, requires_grad=True)
    t = torch.randint(0, V_, (N,))

    def run(chunk):
        def fn():
            lp, ent = token_logprobs(h, w, t, chunk_size=chunk, with_entropy=True)
            (lp.sum() + ent.sum()).backward()
        return fn
    assert _largest_tensor(run(N)) >= N * V_          # the check can fail: one chunk is the whole (N, V)
    assert _largest_tensor(run(8)) <= max(8 * V_, V_ * C)


def test_hidden_states_and_output_weight_give_the_logits():
    for name in ("llama_gqa_untied", "qwen2"):
        m = randomise(GPT(our_config(name)))
        ids, mask, _ = padded_batch()
        sel = mask.bool() & (torch.rand(mask.shape) > 0.3)
        with torch.no_grad():
            logits = m(ids, mask, select=sel)
            assert torch.allclose(logits, m(ids, mask)[sel], atol=FLOAT32_ATOL)
            lp = token_logprobs(m.hidden_states(ids, mask, select=sel), m.output_weight(), ids[sel])
            assert torch.allclose(lp, logits.log_softmax(-1).gather(-1, ids[sel][:, None])[:, 0], atol=FLOAT32_ATOL)
        untied = name == "llama_gqa_untied"
        assert m.output_weight() is (m.lm_head.weight if untied else m.model.embed_tokens.weight)


def test_token_logprobs_default_chunk_follows_the_budget(monkeypatch):
    """chunk_size=None: as many positions as fit in LOGITS_BUDGET bytes of float32 logits, so the bound holds for
    any vocabulary; values and gradients equal the one-chunk computation."""
    import nano_rlhf.model as model_mod
    torch.manual_seed(0)
    N, V_, C = 256, 300, 16
    h, w = torch.randn(N, C, requires_grad=True), torch.randn(V_, C, requires_grad=True)
    t = torch.randint(0, V_, (N,))
    full = token_logprobs(h, w, t)                          # default budget: one chunk
    g_full = torch.autograd.grad(full.sum(), (h, w))
    monkeypatch.setattr(model_mod, "LOGITS_BUDGET", 4 * 10 * V_)

    def fn():
        token_logprobs(h, w, t).sum().backward()
    assert _largest_tensor(fn) <= max(10 * V_, V_ * C)
    small = token_logprobs(h, w, t)
    assert torch.allclose(small, full, atol=1e-6)
    for a, b in zip(torch.autograd.grad(small.sum(), (h, w)), g_full):
        assert torch.allclose(a, b, atol=FLOAT32_ATOL)


def test_forward_return_hidden_equals_hidden_states():
    m = randomise(GPT(our_config("qwen3")))
    ids, mask, _ = padded_batch()
    sel = mask.bool()
    with torch.no_grad():
        assert torch.equal(m(ids, mask, select=sel, return_hidden=True), m.hidden_states(ids, mask, select=sel))
