"""The rollout engine (nano_rlhf/sampling.py): prefix sharing, compaction and the compiled decode step sample
what the plain eager loop samples; the compile fallback; bf16 sampling keeps PPO's ratio exactly 1 at lr 0."""
import os

import pytest
import torch
from numerics import FLOAT32_ATOL  # float32 values of order one: see tests/numerics.py

import train_ppo
from nano_rlhf import sampling
from nano_rlhf.model import GPT, GPTConfig
from test_ppo import eos_sft_dir, metrics, ppo_args  # noqa: F401  (eos_sft_dir is a fixture)

pytestmark = pytest.mark.numeric     # also run under ATEN_CPU_CAPABILITY=default by .ci/run

V, STOPS, PAD = 61, [3, 5, 7], 1


def model(family="gpt2", seed=0, dtype=torch.float64):
    """In float64 (tests/numerics.py): the tests below assert the same *tokens* from two kernel paths (cache
    layouts, compaction, inductor's fused kernels); in float32 their logits differ by a few ulp, which flips a
    sampled token whenever a uniform number falls within that distance of a CDF boundary or two top logits
    tie within it (issue: the compiled step under ATEN_CPU_CAPABILITY=default). In float64 that distance is
    ~1e-16 and a flip has probability ~1e-12 per step; the logits are still compared per (step, row)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=V, block_size=64, n_layer=2, n_head=4, n_embd=32, model_type=family,
                    n_kv_head=2 if family != "gpt2" else None)
    # at initialisation the logits are nearly uniform: each step ends a row with P ~ 3/61, so rows end at
    # varied lengths and some never do
    return GPT(cfg).eval().to(dtype)


def prompts(groups=3, k=4, T=7, seed=0):
    """groups distinct prompts (two left-padded), each repeated k times as train_ppo's rollout lays them out."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, V, (groups, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2 % groups, :5] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    return ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)


def run(m, ids, mask, n=24, seed=0, **kw):
    kw.setdefault("temperature", 1.0)
    return m.generate(ids, mask, n, eos_token_id=STOPS, pad_token_id=PAD,
                      generator=torch.Generator().manual_seed(seed), **kw)


@pytest.fixture
def spy(monkeypatch):
    """Records (logits, uniform numbers) of every sampled step."""
    steps = []
    orig = sampling.sample_token

    def record(logits, temperature, top_k, top_p, generator, u):
        steps.append((logits.clone(), u.clone()))
        return orig(logits, temperature, top_k, top_p, generator, u)
    monkeypatch.setattr(sampling, "sample_token", record)
    return steps


def check_logits_match(eager_steps, other_steps, atol):
    """Every (step, row) the other run sampled has eager's logits at that step and row. The row of a compacted
    batch is found by its uniform number: one draw per row of the call per step, so the same (step, row)
    draws the same number in every mode."""
    assert len(eager_steps) == len(other_steps)
    for (le, ue), (lo, uo) in zip(eager_steps, other_steps):
        assert len(uo) <= len(ue)
        rows = [int((ue == x).nonzero()[0]) for x in uo]          # which row each sampled entry is
        assert len(set(rows)) == len(rows)
        torch.testing.assert_close(lo, le[rows], atol=atol, rtol=0)


def test_sample_token_with_given_uniforms_inverts_the_cdf():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.0, 0.0, 0.5]])
    u = torch.tensor([0.35, 0.49])           # cdf row 0: .1 .3 .6 1.0 -> index 2; row 1: .5 .5 .5 1 -> 0
    assert sampling.inverse_cdf_sample(probs, u=u).tolist() == [2, 0]
    # without u, one draw per row from the generator: the same numbers as torch.rand(B)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    drawn_here = sampling.inverse_cdf_sample(probs, g1)
    assert torch.equal(drawn_here, sampling.inverse_cdf_sample(probs, u=torch.rand(2, generator=g2)))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sharing_and_compaction_sample_the_plain_loops_tokens(family, spy):
    """Defaults (prefix sharing + compaction) == both off, token for token at a seed, and each (step, row)
    sees the same logits; the work really shrank (fewer prefill rows, fewer decoded rows)."""
    m = model(family)
    ids, mask = prompts()
    plain_stats, fast_stats = {}, {}
    plain = run(m, ids, mask, share_prefix=False, compact=False, stats=plain_stats)
    plain_steps = list(spy)
    spy.clear()
    fast = run(m, ids, mask, stats=fast_stats)
    assert torch.equal(fast, plain)
    check_logits_match(plain_steps, spy, atol=FLOAT32_ATOL)
    assert plain_stats["prefill_rows"] == 12 and fast_stats["prefill_rows"] == 3
    ended_early = ((fast[:, ids.shape[1]:] == PAD).sum(1) > 0).sum()
    assert ended_early >= 4, "the test needs rows that end early"
    assert fast_stats["row_steps"] < plain_stats["row_steps"] == 12 * plain_stats["steps"]


def test_prefix_sharing_alone_equals_no_sharing_on_any_row_order():
    """Shared rows need not be adjacent: the cache is expanded by each row's prompt index."""
    m = model()
    ids, mask = prompts()
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))
    ids, mask = ids[perm], mask[perm]
    st = {}
    assert torch.equal(run(m, ids, mask, compact=False, stats=st), run(m, ids, mask, compact=False, share_prefix=False))
    assert st["prefill_rows"] == 3


def test_left_padded_row_samples_as_it_does_alone():
    """A row's tokens do not depend on the padding or the other rows (greedy, compaction on)."""
    m = model("llama")
    ids, mask = prompts(k=1)
    batch = run(m, ids, mask, temperature=0)
    for b in range(len(ids)):
        alone = run(m, ids[b:b + 1, mask[b].bool()], None, temperature=0)
        n = alone.shape[1] - int(mask[b].sum())
        assert torch.equal(batch[b, ids.shape[1]:ids.shape[1] + n], alone[0, -n:])
        assert (batch[b, ids.shape[1] + n:] == PAD).all()


def test_stop_ids_end_rows_and_a_pad_outside_the_vocabulary_is_never_fed_back():
    """After a row's first stop id every position is pad, even a pad id the embedding does not have."""
    m = model()
    ids, mask = prompts()
    out = m.generate(ids, mask, 24, eos_token_id=set(STOPS), pad_token_id=V + 5,
                     generator=torch.Generator().manual_seed(0))[:, ids.shape[1]:]
    ended = 0
    for row in out.tolist():
        k = next((i for i, t in enumerate(row) if t in STOPS), None)
        if k is not None:
            ended += 1
            assert all(t == V + 5 for t in row[k + 1:]) and all(t < V for t in row[:k + 1])
    assert ended >= 4


def test_sampling_options_are_what_the_model_generate_keywords_mean():
    """sampling.generate(model, ids, mask, SamplingOptions(...)) samples what GPT.generate's keywords sample,
    seeded: every option reaches the engine."""
    m = model()
    ids, mask = prompts()
    for kw, engine in ((dict(temperature=0.8, top_k=9), {}), (dict(top_p=0.7), dict(compact=False)),
                       (dict(temperature=0), dict(use_cache=False)), ({}, dict(share_prefix=False))):
        opts = sampling.SamplingOptions(max_new_tokens=16, stop_ids=STOPS, pad_id=PAD, **kw, **engine)
        got = sampling.generate(m, ids, mask, opts, torch.Generator().manual_seed(4))
        want = run(m, ids, mask, n=16, seed=4, **kw, **engine)
        assert torch.equal(got, want)
    greedy = sampling.generate(m, ids, mask, sampling.SamplingOptions(max_new_tokens=16, temperature=0))
    assert not torch.equal(greedy, sampling.generate(m, ids, mask, sampling.SamplingOptions(
        max_new_tokens=16, temperature=1.0), torch.Generator().manual_seed(4)))


def cut_oracle(row, stops, pad):
    """The cut of one response row, written out: up to and including the first stop id."""
    n = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
    return row[:n] + [pad] * (len(row) - n), n, any(t in stops for t in row)


@pytest.mark.parametrize("stops", [[3], [3, 5, 7], 5, None, []])
def test_cut_at_stop_matches_the_written_out_rule(stops):
    """No stop token (the row is kept whole, not ended), a stop at position 0 (length 1), several stop ids, a
    stop in the last position (ended, full length), a pad id outside the vocabulary, rows of any length."""
    rows = [[3, 9, 9, 9, 9], [9, 9, 9, 9, 9], [9, 5, 3, 9, 7], [9, 9, 9, 9, 7], [7, 3, 5, 9, 9], [9, 9, 5, 5, 5]]
    pad = V + 5
    ids, mask, length, ended = sampling.cut_at_stop(torch.tensor(rows), stops, pad)
    as_list = [] if stops is None else [stops] if isinstance(stops, int) else stops
    for b, row in enumerate(rows):
        want, n, end = cut_oracle(row, as_list, pad)
        assert ids[b].tolist() == want
        assert mask[b].tolist() == [True] * n + [False] * (len(row) - n)
        assert int(length[b]) == n and bool(ended[b]) == end
    assert mask.dtype == torch.bool and length.dtype == torch.long and ended.dtype == torch.bool
    if stops == [3, 5, 7]:
        assert length.tolist() == [1, 5, 2, 5, 1, 3] and ended.tolist() == [True, False, True, True, True, True]
    empty = sampling.cut_at_stop(torch.zeros(2, 0, dtype=torch.long), STOPS, PAD)
    assert empty[0].shape == (2, 0) and empty[2].tolist() == [0, 0] and empty[3].tolist() == [False, False]


def test_cut_at_stop_leaves_generates_output_unchanged():
    """generate pads after a row's first stop id already: the cut only reads the rows (and gives the mask)."""
    m = model()
    ids, mask = prompts()
    out = run(m, ids, mask)[:, ids.shape[1]:]
    cut, keep, length, ended = sampling.cut_at_stop(out, STOPS, PAD)
    assert torch.equal(cut, out) and 0 < int(ended.sum()) < len(out)
    assert (out[~keep] == PAD).all() and int(keep.sum()) == int(length.sum())


def test_bf16_sampling_copy_follows_the_models_weights():
    """dtype=bfloat16 samples with a bf16 copy refreshed from the model on every call (not a stale one)."""
    m = model(dtype=torch.float32)           # the training dtype the copy is made from
    ids, mask = prompts(k=1)

    def bf16_greedy():
        twin = GPT(m.cfg).eval()
        twin.load_state_dict(m.state_dict())
        return run(twin.to(torch.bfloat16), ids, mask, temperature=0)
    assert torch.equal(run(m, ids, mask, temperature=0, dtype=torch.bfloat16), bf16_greedy())
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert torch.equal(run(m, ids, mask, temperature=0, dtype=torch.bfloat16), bf16_greedy())
    assert m.output_weight().dtype == torch.float32


def test_bf16_rollout_lr0_first_update_has_ratio_one(tmp_path, sft_dir, rm_dir, eos_sft_dir):  # noqa: F811
    """Tokens sampled in bf16, log-probs (π_old and π_θ) recomputed by the float32 policy: ratio exactly 1."""
    train_ppo.main(ppo_args(tmp_path, eos_sft_dir, rm_dir, "bf16", "--lr", "0", "--critic_lr", "0",
                            "--rollout_dtype", "bfloat16", "--ppo_epochs", "2", "--num_minibatches", "2",
                            "--micro_batch_size", "1", steps=2))
    for m in metrics(tmp_path / "bf16"):
        assert abs(m["train/ratio"] - 1) < 1e-6 and m["train/approx_kl"] < 1e-9 and m["train/clipfrac"] == 0


# ---- the compiled decode step ----------------------------------------------------------------------

@pytest.fixture
def fresh_compile_state(monkeypatch):
    monkeypatch.setattr(sampling, "_COMPILED", type(sampling._COMPILED)())
    monkeypatch.setattr(sampling, "_SEEN", type(sampling._SEEN)())
    monkeypatch.setattr(sampling, "_NOTICES", set())


def test_compile_unavailable_gives_one_notice_and_the_eager_tokens(monkeypatch, capsys, fresh_compile_state):
    monkeypatch.setattr(sampling, "compile_problem", lambda device: "no C++ compiler (g++) for inductor's CPU kernels")
    m = model()
    ids, mask = prompts()
    st = {}
    got = run(m, ids, mask, compile=True, stats=st)
    run(m, ids, mask, compile=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["notice: compiled decoding unavailable (no C++ compiler (g++) for inductor's CPU kernels); "
                   "decoding eagerly"]
    assert torch.equal(got, run(m, ids, mask)) and st["compiled"] is False


def test_compile_failure_gives_one_notice_and_the_eager_tokens(monkeypatch, capsys, fresh_compile_state):
    def broken_compile(fn, **kw):
        def call(*a):
            raise RuntimeError("C++ compile error: cannot find Python.h\nmore lines")
        return call
    monkeypatch.setattr(torch, "compile", broken_compile)
    m = model()
    ids, mask = prompts()
    got = run(m, ids, mask, compile=True, compact=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["notice: torch.compile failed (RuntimeError: C++ compile error: cannot find Python.h); "
                   "decoding eagerly"]
    assert torch.equal(got, run(m, ids, mask, compact=False))


def test_static_cache_step_run_eagerly_equals_the_eager_loop(monkeypatch, spy, fresh_compile_state):
    """The compiled path's own arithmetic (all cache slots attended, unwritten ones masked, bucketed
    compaction), run uncompiled: same tokens, same logits per (step, row)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    m = model("llama")
    ids, mask = prompts()
    want = run(m, ids, mask, compact=False)
    want_steps = list(spy)
    spy.clear()
    st = {}
    assert torch.equal(run(m, ids, mask, compile=True, stats=st), want)
    assert st["compiled"] and st["row_steps"] < 12 * st["steps"]
    check_logits_match(want_steps, spy, atol=FLOAT32_ATOL)


@pytest.mark.slow
@pytest.mark.skipif(sampling.compile_problem(torch.device("cpu")) is not None,
                    reason="the fallback is tested above; this needs inductor's C++ compiler")
def test_compiled_decode_equals_eager(spy, fresh_compile_state):
    """torch.compile (inductor C++): compaction off, the same tokens at a seed and logits within float
    rounding (fused kernels reorder sums: differences of a few ulp); compaction on, likewise per (step, row)."""
    m = model("llama")
    ids, mask = prompts(groups=2, k=4)
    want = run(m, ids, mask, compact=False)
    want_steps = list(spy)
    for compact in (False, True):
        spy.clear()
        st = {}
        got = run(m, ids, mask, compile=True, compact=compact, stats=st)
        if not st["compiled"] and os.environ.get("ATEN_CPU_CAPABILITY") == "default":
            # inductor's scalar-ISA C++ for float64 reductions on one thread names at::vec without its header
            # (torch 2.13): PyTorch's defect, not ours; the fallback itself is tested above
            pytest.skip("inductor cannot compile this float64 step under ATEN_CPU_CAPABILITY=default")
        assert st["compiled"] and st["compile_s"] > 0
        assert torch.equal(got, want)
        check_logits_match(want_steps, spy, atol=FLOAT32_ATOL)
