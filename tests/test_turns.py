"""Multi-turn rollouts (nano_rlhf.sampling.generate_turns): tool turns forced into the KV cache while other rows
decode; token-in, token-out; decode-time log-probs against a teacher-forced forward; prefix sharing, compaction,
the static-cache step and the per-step RNG rule kept (token-identical to the plain loop); the budget and turn
limits; and nano_rlhf.tools.ToolEnv between a tokenizer's turns and the tools."""
import pytest
import torch
from conftest import scripted_policy
from numerics import FLOAT32_ATOL, assert_close64  # see tests/numerics.py

from nano_rlhf import chat, sampling
from nano_rlhf.model import GPT, GPTConfig
from nano_rlhf.sampling import SamplingOptions, generate, generate_turns
from nano_rlhf.tools import ToolEnv, load_tools

pytestmark = pytest.mark.numeric

V, EOS, PAD = 61, 5, 1
EOTS = (3, 4, 6, 8)      # each ends a turn that calls a tool (several, so that turns are short); EOS ends the row
STOPS = [*EOTS, EOS]


def model(family="gpt2", seed=0, dtype=torch.float64):
    """Random weights: near-uniform logits, so each step ends a turn with P ~ 5/61 and rows take varied turns."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=V, block_size=128, n_layer=2, n_head=4, n_embd=32, model_type=family,
                    n_kv_head=2 if family != "gpt2" else None)
    return GPT(cfg).eval().to(dtype)


def prompts(groups=3, k=4, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, V, (groups, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    return ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)


class FakeEnv:
    """A deterministic environment: a turn ending on an EOT "calls a tool" and gets 2-6 context ids that depend on
    the turn (so rows differ); one ending on EOS gets None. Records what it was given and what it answered."""

    def __init__(self):
        self.calls = []

    def __call__(self, turns):
        answers = []
        for t in turns:
            assert t[-1] in STOPS and not any(x in STOPS for x in t[:-1])
            answers.append(None if t[-1] == EOS else [40 + len(t) % 7, 41, 42, 43, 44, 45][:2 + sum(t) % 5])
        self.calls.append((turns, answers))
        return answers


def run(m, ids, mask, env=None, n=60, seed=0, max_turns=4, **kw):
    kw.setdefault("temperature", 1.0)
    opts = SamplingOptions(max_new_tokens=n, stop_ids=STOPS, pad_id=PAD, **kw)
    return generate_turns(m, ids, mask, opts, env or FakeEnv(), max_turns, torch.Generator().manual_seed(seed))


def segments(mask_row):
    """[(start, end, is_policy)] runs of a row's policy mask inside its response."""
    out, start = [], 0
    for i in range(1, len(mask_row) + 1):
        if i == len(mask_row) or mask_row[i] != mask_row[start]:
            out.append((start, i, bool(mask_row[start])))
            start = i
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sharing_and_compaction_sample_the_plain_loops_turns(family):
    """Defaults (prefix sharing, compaction) against the full-forward reference loop with both off: the same
    ids, masks, turns and cuts, and log-probs equal to float64 rounding; rows with 0, 1 and several tool
    turns, and rows that end early, are all present."""
    m, (ids, mask) = model(family), prompts(k=3)
    fast_stats, plain_stats = {}, {}
    opts = SamplingOptions(max_new_tokens=48, temperature=1.0, stop_ids=STOPS, pad_id=PAD)
    fast = generate_turns(m, ids, mask, opts, FakeEnv(), 4, torch.Generator().manual_seed(0), fast_stats)
    plain = generate_turns(m, ids, mask, SamplingOptions(**{**opts.__dict__, "use_cache": False,
                                                           "share_prefix": False, "compact": False}),
                           FakeEnv(), 4, torch.Generator().manual_seed(0), plain_stats)
    for name in ("ids", "response_mask", "policy_mask", "turns", "ended", "budget_cut"):
        assert torch.equal(getattr(fast, name), getattr(plain, name)), name
    assert_close64(fast.logprobs, plain.logprobs)
    turns = fast.turns.tolist()
    assert {1, 2} <= set(turns) and max(turns) >= 3, turns
    assert fast_stats["prefill_rows"] == 3 and fast_stats["row_steps"] < 9 * fast_stats["steps"]
    assert fast_stats["tool_turns"] == sum(t - 1 for t in turns) > 0


def test_token_in_token_out(monkeypatch):
    """Every sampled token is in the ids where it was sampled (the step's sample_token output), every run of
    context ids is the env's answer verbatim, each turn handed to the env is the ids the row sampled, and the
    row's end is its last stop id (or the budget)."""
    sampled = []
    orig = sampling.sample_token

    def spy(logits, temperature, top_k, top_p, generator, u):
        tok = orig(logits, temperature, top_k, top_p, generator, u)
        sampled.append(tok.clone())
        return tok
    monkeypatch.setattr(sampling, "sample_token", spy)
    m, (ids, mask) = model("llama"), prompts(k=2)
    env = FakeEnv()
    out = run(m, ids, mask, env, compact=False, share_prefix=False)
    P = ids.shape[1]
    given = [t for turns, _ in env.calls for t in turns]
    answered = [a for _, answers in env.calls for a in answers if a is not None]
    seen_turns, seen_answers = [], []
    for b in range(len(ids)):
        resp, pol = out.ids[b, P:].tolist(), out.policy_mask[b].tolist()
        n = int(out.response_mask[b].sum())
        assert all(x == PAD for x in resp[n:]) and not any(pol[n:])
        for s in range(n):
            if pol[s]:
                assert resp[s] == int(sampled[s][b])
        for start, end, is_policy in segments(pol[:n]):
            (seen_turns if is_policy else seen_answers).append(resp[start:end])
        if out.ended[b]:
            assert resp[n - 1] in STOPS
    assert sorted(map(tuple, seen_answers)) == sorted(map(tuple, answered))
    assert set(map(tuple, given)) <= set(map(tuple, seen_turns))
    assert len(answered) >= 4


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decode_logprobs_equal_a_teacher_forced_forward(dtype):
    """The log-prob recorded when a token was sampled equals log_softmax(logits / T) of one forward over the
    whole sequence (what the trainer computes), at every policy token of rows with one and several tool turns.
    float64: to rounding. float32: the decode step (one query against the cache) and the full forward sum the
    same terms in other orders, so each logit differs by ~√n·u·Σ|terms| (n ≤ a few hundred here: ~1e-6,
    tests/numerics.py) and a log-softmax, 1-Lipschitz in the max-norm of its inputs for each of its two
    terms, by at most twice that: 2·FLOAT32_ATOL is a ≥ 10× margin."""
    m, (ids, mask) = model("llama", dtype=dtype), prompts()
    T = 0.7
    out = run(m, ids, mask, temperature=T)
    assert (out.turns >= 2).sum() >= 3 and (out.turns == 1).sum() >= 1
    full_mask = torch.cat([mask, out.response_mask.long()], 1)
    with torch.no_grad():
        logits = m(out.ids, full_mask)[:, ids.shape[1] - 1:-1]
    x = logits if dtype == torch.float64 else logits.float()
    want = (x / T).log_softmax(-1).gather(-1, out.ids[:, ids.shape[1]:, None]).squeeze(-1) * out.policy_mask
    if dtype == torch.float64:
        assert_close64(out.logprobs, want)
    else:
        torch.testing.assert_close(out.logprobs, want, atol=2 * FLOAT32_ATOL, rtol=0)
    assert out.policy_mask.sum() > 100 and (out.response_mask & ~out.policy_mask).sum() > 20


def test_static_cache_step_run_eagerly_equals_the_eager_loop(monkeypatch):
    """The compiled path's arithmetic (static cache, bucketed compaction) with tool turns, run uncompiled:
    the same turns token for token."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(sampling, "_COMPILED", type(sampling._COMPILED)())
    monkeypatch.setattr(sampling, "_SEEN", type(sampling._SEEN)())
    m, (ids, mask) = model("llama"), prompts()
    want = run(m, ids, mask, compact=False)
    st = {}
    opts = SamplingOptions(max_new_tokens=60, temperature=1.0, stop_ids=STOPS, pad_id=PAD, compile=True)
    got = generate_turns(m, ids, mask, opts, FakeEnv(), 4, torch.Generator().manual_seed(0), st)
    assert st["compiled"] and st["row_steps"] < 12 * st["steps"]
    assert torch.equal(got.ids, want.ids) and torch.equal(got.policy_mask, want.policy_mask)
    assert_close64(got.logprobs, want.logprobs)


def test_one_turn_is_plain_sampling_and_the_limits_hold():
    """max_turns=1 never asks the env and samples exactly generate's tokens (the per-step draws are the same);
    max_turns=2 stops every row at two turns; a budget too small for a tool turn cuts the row after its call."""
    m, (ids, mask) = model(), prompts()
    opts = SamplingOptions(max_new_tokens=60, temperature=1.0, stop_ids=STOPS, pad_id=PAD)
    env = FakeEnv()
    one = generate_turns(m, ids, mask, opts, env, 1, torch.Generator().manual_seed(0))
    assert env.calls == [] and torch.equal(one.ids, generate(m, ids, mask, opts, torch.Generator().manual_seed(0)))
    assert torch.equal(one.policy_mask, one.response_mask) and (one.turns == 1).all()
    two = run(m, ids, mask, max_turns=2)
    assert two.turns.max() == 2 and (two.turns == 2).sum() >= 2
    st = {}
    small = generate_turns(m, ids, mask, SamplingOptions(**{**opts.__dict__, "max_new_tokens": 12}), FakeEnv(), 4,
                           torch.Generator().manual_seed(3), st)
    assert st["budget_cut"] == int(small.budget_cut.sum()) >= 1
    for b in small.budget_cut.nonzero().view(-1).tolist():   # a cut row ends on the turn whose tool did not fit
        n = int(small.response_mask[b].sum())
        assert small.ids[b, ids.shape[1] + n - 1] in EOTS and not small.ended[b]
    with pytest.raises(ValueError, match="needs an env"):
        generate_turns(m, ids, mask, opts, None, 2)


def test_tool_env_reads_calls_runs_them_and_answers_the_tool_turn(tok):
    """ToolEnv on a tokenizer's ids (the plain template): a turn with calls gets tok.encode_tool_turn of the
    results, in order; an answer, and a turn that did not end on the end-of-turn id, get None."""
    box = load_tools("calculator")
    env = ToolEnv(box, tok)
    two_calls = chat.assistant_text("plain", "Let me.", [{"name": "calculator", "arguments": {"expression": "6*7"}},
                                                          {"name": "calculator", "arguments": {"expression": "1/0"}}])
    bad = " <tool_call>{not json}</tool_call>"
    turns = [tok.encode(" " + two_calls) + [tok.eot_id], tok.encode(" It is 42.") + [tok.eot_id],
             tok.encode(bad) + [tok.eot_id], tok.encode(" " + two_calls)]
    got = env(turns)
    assert got[0] == tok.encode_tool_turn(["42", "error: calculator: division by zero"])
    assert got[1] is None and got[3] is None
    assert tok.decode(got[2]).startswith("Tool: error: malformed tool call: not JSON")
    assert env.counts == {"turns": 4, "tool_turns": 2, "calls": 3}
    assert box.counts == {"ok": 1, "raised": 1, "malformed": 1}


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_a_scripted_policy_calls_the_calculator_through_the_real_template(name, tmp_path, monkeypatch):
    """The whole path on a real family's template: a policy scripted to write a calculator call, then an answer
    (sample_token replaced by the script), generate_turns with ToolEnv: the rollout is token for token the
    prompt, the call, the tool turn and the answer, and its text is what apply_chat_template renders for that
    conversation with the tool's result; only the policy's two turns are in its mask."""
    from test_chat_templates import build, hf_tool_render, calls
    name, tok, hf = build(name, tmp_path)
    box = load_tools("calculator")
    prompt = [{"role": "user", "content": "What is (3+4)*12/5?"}]
    call = calls(("calculator", {"expression": "(3+4)*12/5"}))
    conversation = prompt + [{"role": "assistant", "content": "", "tool_calls": call},
                             {"role": "tool", "content": "16.8"}, {"role": "assistant", "content": "It is 16.8."}]
    variant = tok.chat_template
    p_ids = tok.render_prompt(prompt, box.schemas)
    first = tok.encode(chat.assistant_text(variant, "", call)) + [tok.eot_id]
    answer = tok.encode("It is 16.8.") + [tok.eot_id]
    script = first + tok.encode_tool_turn(["16.8"]) + answer
    scripted_policy(monkeypatch, script)
    torch.manual_seed(0)
    budget = len(script) + 8
    m = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=len(p_ids) + budget, n_layer=1, n_head=2, n_embd=16))
    opts = SamplingOptions(max_new_tokens=budget, temperature=1.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id)
    env = ToolEnv(box, tok)
    out = generate_turns(m.eval(), torch.tensor([p_ids]), None, opts, env, max_turns=3)
    n = int(out.response_mask[0].sum())
    assert out.ids[0].tolist() == p_ids + script and n == len(script) and bool(out.ended[0])
    assert out.policy_mask[0, :n].tolist() == [1] * len(first) + [0] * (len(script) - len(first) - len(answer)) + \
        [1] * len(answer)
    text = tok.tk.decode(out.ids[0].tolist(), skip_special_tokens=False)
    assert text + ("" if variant == "llama3" else "\n") == hf_tool_render(hf, name, conversation, False,
                                                                          tools=box.schemas)
    assert int(out.turns[0]) == 2 and env.counts == {"turns": 2, "tool_turns": 1, "calls": 1}
