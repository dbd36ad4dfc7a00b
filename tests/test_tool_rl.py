"""train_ppo.py with --tools: a rollout whose assistant turns call tools is trained on exactly the tokens it sampled
(the tool turns are context: no KL, no policy loss), and the trainer's log-probs equal the decode's."""
import pytest
import torch
from conftest import scripted_policy
from numerics import FLOAT32_ATOL  # see tests/numerics.py

import train_ppo
from nano_rlhf import chat
from nano_rlhf.model import GPT, GPTConfig
from nano_rlhf.sampling import SamplingOptions, generate_turns
from nano_rlhf.tools import ToolEnv, load_tools


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_a_tool_rollout_trains_only_the_policys_tokens(name, tmp_path, monkeypatch):
    """A policy scripted to call the calculator, read the answer and end (sample_token replaced), through
    train_ppo's own rollout path: the ids are the sampled ones plus the tool turn, the tool turn is a hole in
    the action and policy masks, the sequence KL and the policy loss read only the actions, and the trainer's
    recomputed log-probs equal those recorded at decode time (float32 sums of a few dozen terms: 2 × the
    suite's FLOAT32_ATOL, as tests/test_turns.py argues)."""
    from test_chat_templates import build, calls
    name, tok, _ = build(name, tmp_path)
    box = load_tools("calculator")
    call = calls(("calculator", {"expression": "(3+4)*12/5"}))
    first = tok.encode(chat.assistant_text(tok.chat_template, "", call)) + [tok.eot_id]
    answer = tok.encode("It is 16.8.") + [tok.eot_id]
    tool = tok.encode_tool_turn(["16.8"])
    script = first + tool + answer
    step = scripted_policy(monkeypatch, script)
    prompt = [{"role": "user", "content": "What is (3+4)*12/5?"}]
    p_ids = tok.render_prompt(prompt, box.schemas)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=len(p_ids) + len(script) + 8, n_layer=1, n_head=2, n_embd=16)
    policy, ref = GPT(cfg).eval(), GPT(cfg).eval()
    o = train_ppo.Options(advantage="grpo", samples_per_prompt=1, micro_batch_size=1, max_new_tokens=len(script) + 8,
                          tools="calculator", max_turns=3, missing_eos_penalty=None)
    models = train_ppo.Models(policy=policy, reward=lambda p, c: [float("16.8" in x) for x in c], ref=ref, tools=box)
    r = train_ppo.rollout(lambda: [{"prompt": p_ids, "text": "What is (3+4)*12/5?"}], models, tok, o,
                          torch.Generator().manual_seed(0))
    n = int(r.response_mask[0].sum())
    assert r.query_response[0].tolist() == p_ids + script and n == len(script)
    hole = [1.0] * len(first) + [0.0] * len(tool) + [1.0] * len(answer)
    assert r.action_mask[0].tolist() == hole and r.policy_mask[0].tolist() == hole
    assert "16.8" in r.completions[0] and r.scores[0] == 1.0 and r.has_eos[0] == 1.0
    assert r.stats["tool_calls"] == 1.0 and r.stats["tool_errors"] == 0.0
    kl = ((r.logprobs - r.ref_logprobs) * torch.tensor([hole])).sum(1)
    assert torch.allclose(train_ppo.sequence_kl(r), kl, atol=0, rtol=0)         # the tool turn holds no KL
    step[0] = 0
    decoded = generate_turns(policy, torch.tensor([p_ids]), None, SamplingOptions(
        max_new_tokens=len(script) + 8, temperature=1.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id),
        ToolEnv(box, tok), 3)
    acts = decoded.policy_mask[0, :n]
    assert torch.allclose(r.logprobs[0][acts], decoded.logprobs[0, :n][acts].float(), atol=2 * FLOAT32_ATOL, rtol=0)
    # the update's policy loss sees the actions only: a tool token's log-prob has no gradient
    adv = torch.ones_like(r.response_mask)
    logp = r.logprobs.clone().requires_grad_(True)
    pg, _ = train_ppo.policy_loss(logp, r.logprobs, adv)
    train_ppo.aggregate_loss(pg, r.policy_mask, "token_mean", float(r.policy_mask.sum()), 1.0, n).backward()
    assert (logp.grad[0, len(first):len(first) + len(tool)] == 0).all() and (logp.grad[0][acts] != 0).all()
    box.close()


def test_tools_options_are_declared(tmp_path, sft_dir, rm_dir, capfd):
    from test_ppo import main_exit, ppo_args
    code, err = main_exit(capfd, ppo_args(tmp_path, sft_dir, rm_dir, "x", "--max_turns", "2"))
    assert code == 2 and "--max_turns applies only with --tools" in err
    code, err = main_exit(capfd, ppo_args(tmp_path, sft_dir, rm_dir, "x", "--tools", "nope"))
    assert code != 0 and "--tools nope" in err and "Traceback" not in err and not (tmp_path / "x").exists()


def test_gae_runs_through_tool_turns_as_environment_transitions():
    """The rule (docs/usage.md, tools): a tool turn's tokens are environment transitions — no KL penalty (they are
    not the policy's actions), reward 0, discounted by γ and λ like any step, valued by the critic — so GAE's
    recursion runs through them unchanged. A hand-made trajectory (act, act, tool, tool, act, end) against a float64
    recursion written from Schulman et al. 2016, eq. 16."""
    g = torch.Generator().manual_seed(3)
    R, beta, gamma, lam, score = 6, 0.2, 0.9, 0.8, 1.7
    acts = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    lp, ref = (-torch.rand(1, R, generator=g, dtype=torch.float64) for _ in range(2))
    values = torch.randn(1, R, generator=g, dtype=torch.float64)
    from nano_rlhf.rollout import Rollout
    r = Rollout(query_response=torch.zeros(1, 2 + R, dtype=torch.long), attention_mask=torch.ones(1, 2 + R),
                response_mask=torch.ones(1, R, dtype=torch.float64), has_eos=torch.ones(1), completions=[""],
                scores=torch.tensor([score], dtype=torch.float64), logprobs=lp, ref_logprobs=ref, values=values,
                action_mask=torch.tensor([acts], dtype=torch.float64))
    t = train_ppo.advantages(r, estimator="gae", beta=beta, gamma=gamma, lam=lam)
    rewards = [-beta * (lp[0, i].item() - ref[0, i].item()) * acts[i] + (score if i == R - 1 else 0.0)
               for i in range(R)]
    adv, nxt = [0.0] * R, 0.0
    for i in reversed(range(R)):
        v_next = values[0, i + 1].item() if i + 1 < R else 0.0
        nxt = rewards[i] + gamma * v_next - values[0, i].item() + gamma * lam * nxt
        adv[i] = nxt
    assert torch.allclose(t.adv[0], torch.tensor(adv, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(t.returns[0], torch.tensor(adv, dtype=torch.float64) + values[0], atol=1e-12, rtol=0)
    assert t.kl_penalty[0].item() == pytest.approx(sum(rewards) - score, abs=1e-12)   # the tool turn holds none


def tool_run_inputs(tmp_path, tok, reward_expr):
    """A tool run's inputs in tmp_path: a 1-layer policy m/ for tok, a reward r.py:reward scoring each completion x
    by reward_expr, 8 prompts asking for 6*7 (p.jsonl) and 2 of them held out (e.jsonl)."""
    from conftest import write_jsonl
    torch.manual_seed(0)
    GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=256, n_layer=1, n_head=2, n_embd=16)).save_pretrained(
        str(tmp_path / "m"))
    (tmp_path / "r.py").write_text(f"def reward(p, c):\n    return [{reward_expr} for x in c]\n")
    rows = [{"prompt": [{"role": "user", "content": f"What is 6*7? ({i})"}]} for i in range(8)]
    write_jsonl(tmp_path / "p.jsonl", rows)
    write_jsonl(tmp_path / "e.jsonl", rows[:2])


SPY = """import json, os, sys
import torch
from nano_rlhf import sampling
import train_ppo
script = json.loads(os.environ["SCRIPT_" + os.environ["RANK"]])     # each rank writes its own script
step = [0]
def scripted(logits, temperature, top_k, top_p, generator, u):
    step[0] += 1
    return torch.full((logits.shape[0],), script[min(step[0] - 1, len(script) - 1)], dtype=torch.long)
real = sampling.generate_turns
def turns(*a, **k):                      # each sampling call replays the script from its start
    step[0] = 0
    return real(*a, **k)
sampling.sample_token, sampling.generate_turns = scripted, turns
out = train_ppo.main(sys.argv[1:])
# under --fsdp a parameter is this rank's shard (and the group is gone): the saved model is the one whole copy
sharded = any(hasattr(p, "full_tensor") for p in out.policy.parameters())
digest = "sharded" if sharded else sum(p.double().sum().item() for p in out.policy.parameters())
with open(os.path.join(os.environ["SPY_DIR"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"policy": digest}, f)
"""


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_ranks_taking_different_numbers_of_turns_stay_in_step(tmp_path, sharding):
    """Two ranks, one whose policy calls the calculator (two assistant turns) and one that answers at once: no
    collective inside the rollout loop (under --fsdp the sampler reads weights gathered once, before it), so neither
    waits for the other's turns; both finish (under DDP with identical weights, which run.finish checks too; under
    FSDP there is one sharded copy) and the metrics count the calls of one rank's samples."""
    import json
    from test_chat_templates import build, calls
    from conftest import metrics, run
    name, tok, _ = build("qwen2.5", tmp_path / "m")
    call = calls(("calculator", {"expression": "6*7"}))
    answer = tok.encode("It is 42.") + [tok.eot_id]
    with_tool = tok.encode(chat.assistant_text(tok.chat_template, "", call)) + [tok.eot_id] + \
        tok.encode_tool_turn(["42"]) + answer
    tool_run_inputs(tmp_path, tok, "float('42' in x.split('tool')[-1])")
    (tmp_path / "spy.py").write_text(SPY)
    run([str(tmp_path / "spy.py"), "--init", str(tmp_path / "m"), "--prompts", str(tmp_path / "p.jsonl"),
         "--eval_prompts", str(tmp_path / "e.jsonl"), "--advantage", "grpo", "--reward", f"{tmp_path / 'r.py'}:reward",
         "--tools", "calculator", "--max_turns", "3", "--max_new_tokens", str(len(with_tool) + 4), "--batch_size", "1",
         "--samples_per_prompt", "2", "--max_steps", "2", "--eval_interval", "0", "--out_dir", str(tmp_path / "o"),
         *(["--fsdp"] if sharding == "fsdp" else [])],
        nproc=2, env={"SPY_DIR": str(tmp_path), "SCRIPT_0": json.dumps(with_tool), "SCRIPT_1": json.dumps(answer)})
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))   # both ranks finished
    assert (r0["policy"] == "sharded") == (sharding == "fsdp")
    if sharding == "ddp":
        assert r0 == r1
    m = metrics(tmp_path / "o")
    assert len(m) == 2 and all(x["train/tool_calls"] == pytest.approx(0.5) for x in m)   # rank 0: 1 a sample


TOOL_FILE = '''def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression
    """
    return "42"


TOOLS = [calculator]
'''


def test_a_tool_run_resumes_exactly_knows_its_tool_file_and_trains_lora(tmp_path, monkeypatch, capsys):
    """GRPO with a user tool file, a policy scripted to call it: stopped after step 1 and resumed, the run ends
    bit-identical to the straight run; a resume after the tool file changed is refused in one line (its source is
    part of the run's identity); with --lora_r the same run trains adapters (run.finish checks the frozen base)."""
    from test_chat_templates import build, calls
    from conftest import metrics
    from nano_rlhf import sampling
    from safetensors.torch import load_file
    _, tok, _ = build("qwen2.5", tmp_path / "m")
    script = tok.encode(chat.assistant_text(tok.chat_template, "", calls(("calculator", {"expression": "6*7"})))) + \
        [tok.eot_id] + tok.encode_tool_turn(["42"]) + tok.encode("It is 42.") + [tok.eot_id]
    step = scripted_policy(monkeypatch, script)
    real = sampling.generate_turns

    def turns(*a, **k):                  # each sampling call replays the script from its start
        step[0] = 0
        return real(*a, **k)
    monkeypatch.setattr(sampling, "generate_turns", turns)
    tool_run_inputs(tmp_path, tok, "float('42' in x)")
    (tmp_path / "t.py").write_text(TOOL_FILE)

    def main(out, *extra):
        return train_ppo.main(["--init", str(tmp_path / "m"), "--prompts", str(tmp_path / "p.jsonl"),
                               "--eval_prompts", str(tmp_path / "e.jsonl"), "--advantage", "grpo",
                               "--reward", f"{tmp_path / 'r.py'}:reward", "--tools", f"{tmp_path / 't.py'}:TOOLS",
                               "--max_turns", "3", "--max_new_tokens", str(len(script) + 4), "--batch_size", "2",
                               "--samples_per_prompt", "2", "--max_steps", "2", "--eval_interval", "0",
                               "--out_dir", str(tmp_path / out), *extra])
    main("straight")
    main("resumed", "--stop_at", "1")
    main("resumed", "--resume")
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la, lb = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    for key in ("train/policy_loss", "train/score", "train/tool_calls", "train/grad_norm"):
        assert [x[key] for x in la] == [x[key] for x in lb], key
    assert all(x["train/tool_calls"] == 1.0 for x in la)
    main("changed", "--stop_at", "1")
    (tmp_path / "t.py").write_text(TOOL_FILE.replace('"42"', '"41"'))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main("changed", "--resume")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code != 0 and len(err) == 1 and err[0].startswith("error: ") and "t.py" in err[0], err
    (tmp_path / "t.py").write_text(TOOL_FILE)
    out = main("lora", "--lora_r", "4")
    assert any("lora" in n for n, _ in out.policy.named_parameters())
