"""PPO, GRPO and evaluation from tiny checkpoints of real model families (Llama 3.1, Qwen3; built by
tests/hf_fixtures.py with transformers' random init and the family's real chat template), on conversational
prompts: rollouts end at the template's end-of-turn token and are scored there, the scripts run end to end, the
trained policy loads in transformers with our logits, and `python -m nano_rlhf.evaluate` reads such a directory."""
import json
import os
import subprocess
import sys

import pytest
import torch
from numerics import FLOAT32_ATOL  # float32 values of order one: see tests/numerics.py

import train_ppo
from conftest import gae_only
from hf_fixtures import BAD, FAMILIES, GOOD, make_hf_dir, prompt_rows, write_jsonl
from nano_rlhf.data import tokenize_prompts
from nano_rlhf.model import GPT, ScoreModel, last_token_index
from nano_rlhf.reward import load_reward
from nano_rlhf.training import load_tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TEMPLATE = {"llama": "llama3", "qwen3": "qwen3"}
# Llama 3 base checkpoints name <|end_of_text|> their eos: then end-of-text and end-of-turn are two stop ids, and a
# chat response must end at <|eot_id|>, which is not the eos
EOS = {"llama": "<|end_of_text|>", "qwen3": ""}


# A user's reward file for the fixture's review prompts: good words minus bad words. Conversational prompts
# arrive as given in the prompts file (lists of messages), which it checks.
REWARDS_PY = f"""
def review_reward(prompts, completions):
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts), prompts
    return [float(sum(c.count(w) for w in {GOOD!r}) - sum(c.count(w) for w in {BAD!r})) for c in completions]
"""


def eot_prone(model, tok, logit=3.0):
    """Make a random-init Llama-family policy end its responses often (the end-of-turn token at about
    e^logit / V per token above the others): channel 0 of the residual stream is made a large constant, so
    the final hidden state's channel 0 is nearly the same at every position, and the end-of-turn row of the
    output layer gets an extra weight there."""
    with torch.no_grad():
        emb, out = model.trunk.embedding.weight, model.output_weight()
        emb[:, 0] = 100.0
        out[:, 0] = 100.0                                  # every logit shifts alike (softmax: no change) ...
        ids = torch.randint(0, tok.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
        h0 = model.hidden_states(ids)[..., 0].mean()
        out[tok.eot_id, 0] += logit / h0                   # ... except the end-of-turn token's
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, policy dir, reward-model dir, data dir with prompts/eval_prompts JSONL), built once."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    policy = make_hf_dir(root / "policy", name)
    rm = make_hf_dir(root / "rm", name, seed=1, head="score")
    write_jsonl(root / "prompts.jsonl", prompt_rows(16))
    write_jsonl(root / "eval_prompts.jsonl", prompt_rows(4, seed=1))
    (root / "rewards.py").write_text(REWARDS_PY)
    return name, policy, rm, root


def ppo(family, out, *extra, steps=2):
    name, policy, rm, root = family
    args = ["--init", policy, "--reward_model", rm, "--prompts", str(root / "prompts.jsonl"),
            "--eval_prompts", str(root / "eval_prompts.jsonl"), "--out_dir", str(out), "--max_steps", str(steps),
            "--batch_size", "2", "--samples_per_prompt", "2", "--max_new_tokens", "8", "--eval_interval", "0",
            "--eval_samples", "2", "--lr", "1e-3", "--critic_lr", "1e-3", "--critic_warmup_steps", "0",
            "--ppo_epochs", "1", "--num_minibatches", "2"]
    if EOS[name]:
        args += ["--eos_token", EOS[name]]
    result = train_ppo.main(gae_only(args + list(extra)))
    return result, [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def check_policy_loads_in_transformers(out, name, policy):
    """The saved policy is transformers' class of the family with our logits (1e-5)."""
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [ARCH[name]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ours = GPT.from_pretrained(str(out)).eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = policy.eval()(ids)
        assert torch.allclose(hf(ids).logits, want, atol=FLOAT32_ATOL)
        assert torch.allclose(ours(ids), want, atol=FLOAT32_ATOL)


def test_rollout_ends_at_end_of_turn_and_is_scored_there(family):
    """A conversational rollout stops at the first stop id (for Llama with eos <|end_of_text|>, at <|eot_id|>,
    which is not the eos), has_eos counts it, nothing but padding follows, and the reward model's score is
    its end score of the unpadded row, read at that end-of-turn token."""
    name, policy_dir, rm_dir, root = family
    tok = load_tokenizer("", policy_dir, EOS[name])
    assert tok.eot_id in tok.stop_ids and (len(tok.stop_ids) == 2) == bool(EOS[name])
    policy = eot_prone(GPT.from_pretrained(policy_dir), tok).eval()
    prompts, _ = tokenize_prompts(prompt_rows(8), tok, 64)
    o = train_ppo.Options(samples_per_prompt=2, micro_batch_size=4, max_new_tokens=8, missing_eos_penalty=-7.0)
    models = train_ppo.Models(policy=policy, reward=load_reward(rm_dir, tokenizer=tok), ref=policy)
    r = train_ppo.rollout(lambda: prompts, models, tok, o, torch.Generator().manual_seed(0))
    P, m, finished = r.query_len, r.response_mask, r.has_eos.bool()
    assert 0 < finished.sum() < len(finished), "the test needs both finished and unfinished rows"
    rm = ScoreModel.from_pretrained(rm_dir).eval()
    stops = torch.tensor(tok.stop_ids)
    last = r.query_response[torch.arange(len(m)), last_token_index(r.query_response, r.attention_mask)]
    for i in range(len(m)):
        n, resp = int(m[i].sum()), r.query_response[i, P:]
        if finished[i]:
            assert resp[n - 1] == tok.eot_id == last[i] and not torch.isin(resp[:n - 1], stops).any()
            assert (resp[n:] == tok.pad_id).all()
            row = r.query_response[i][r.attention_mask[i].bool()][None]
            with torch.no_grad():
                assert torch.allclose(r.raw_scores[i], rm(row)[1][0], atol=FLOAT32_ATOL)
        else:
            assert n == resp.shape[0] and r.scores[i] == -7.0
    # the rollout's log-probs (token_logprobs) are the plain log-softmax of the full logits
    with torch.no_grad():
        logits = policy(r.query_response, r.attention_mask)[:, P - 1:-1].float()
        want = logits.log_softmax(-1).gather(-1, r.query_response[:, P:, None]).squeeze(-1) * m
    assert torch.allclose(r.logprobs, want, atol=FLOAT32_ATOL)


@pytest.mark.parametrize("critic_init", ["policy", "reward_model"])
def test_ppo_from_real_family_loads_in_transformers(family, tmp_path, critic_init):
    """PPO (gae, critic from the policy with a fresh head or from the reward model) for 2 steps on
    conversational prompts; the policy moved, loads in transformers, and the run records the template."""
    name, policy_dir, rm_dir, root = family
    out = tmp_path / "ppo"
    result, metrics = ppo(family, out, "--critic_init", critic_init)
    assert [m["step"] for m in metrics if "train/policy_loss" in m] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["train/value_loss"])) for m in metrics if "train/value_loss" in m)
    start = GPT.from_pretrained(policy_dir)
    assert not torch.equal(start.trunk.embedding.weight, result.policy.trunk.embedding.weight)
    check_policy_loads_in_transformers(out, name, result.policy)
    run_json = json.loads(next((out / "state").rglob("run.json")).read_text())
    assert run_json["identity"]["chat_template"] == TEMPLATE[name]
    assert run_json["identity"]["date_string"] == ("26 Jul 2024" if name == "llama" else None)


def test_grpo_with_user_reward_from_real_family(family, tmp_path):
    """GRPO with a user's reward function (a file:function spec) and a KL to the reference, 2 steps."""
    name, policy_dir, rm_dir, root = family
    out = tmp_path / "grpo"
    result, metrics = ppo(family, out, "--advantage", "grpo", "--reward", f"{root / 'rewards.py'}:review_reward",
                          "--kl_coef", "0.05")
    train = [m for m in metrics if "train/policy_loss" in m]
    assert [m["step"] for m in train] == [1, 2] and all("train/score" in m for m in train)
    assert result.critic is None and result.ref is not None
    check_policy_loads_in_transformers(out, name, result.policy)


def test_grad_checkpoint_gives_the_same_first_ppo_step(family, tmp_path, monkeypatch):
    """--grad_checkpoint recomputes the blocks of the policy and the critic (counted) and gives the same
    first-step losses and gradient norms."""
    import nano_rlhf.model
    calls = []

    def counting(fn, *args, **kw):
        calls.append(fn)
        return torch.utils.checkpoint.checkpoint(fn, *args, **kw)
    monkeypatch.setattr(nano_rlhf.model, "checkpoint", counting)
    _, a = ppo(family, tmp_path / "a", "--critic_init", "policy", steps=1)
    assert not calls
    _, b = ppo(family, tmp_path / "b", "--critic_init", "policy", "--grad_checkpoint", steps=1)
    assert calls and all(isinstance(f, nano_rlhf.model._Block) for f in calls)
    for key in ("train/policy_loss", "train/value_loss", "train/entropy"):
        assert a[0][key] == pytest.approx(b[0][key], rel=1e-5, abs=1e-7)
    for key in ("train/grad_norm", "train/critic_grad_norm"):
        assert a[0][key] == pytest.approx(b[0][key], rel=1e-4)


def test_evaluate_module_on_real_family(family, tmp_path, monkeypatch):
    """`python -m nano_rlhf.evaluate` on a real-family directory with conversational prompts: the template's
    end-of-turn ends responses (the end-of-text rate counts it), KL to itself is 0, RM and user reward
    columns are filled."""
    name, policy_dir, rm_dir, root = family
    tok = load_tokenizer("", policy_dir)
    d = tmp_path / "policy"
    eot_prone(GPT.from_pretrained(policy_dir), tok).save_pretrained(str(d))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((root / "policy" / f).read_bytes())
    cmd = [sys.executable, "-m", "nano_rlhf.evaluate", "--model", str(d), "--prompts", str(root / "prompts.jsonl"),
           "--out", str(tmp_path / "s.jsonl"), "--ref", str(d), "--reward_model", rm_dir,
           "--reward", f"{root / 'rewards.py'}:review_reward", "--max_new_tokens", "8",
           "--summary", str(tmp_path / "summary.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    samples = [json.loads(x) for x in open(tmp_path / "s.jsonl")]
    assert len(samples) == 16 and all({"rm_score", "reward", "kl"} <= set(s) for s in samples)
    assert all(abs(s["kl"]) < 1e-4 for s in samples)
    (summary,) = json.loads((tmp_path / "summary.json").read_text())
    assert 0 < summary["eos_rate"] < 1
    assert all(s["length"] <= 8 and (s["eos"] or s["length"] == 8) for s in samples)
    # the same prompts, tokenized and sampled in process: every finished response ends with the end-of-turn id
    from nano_rlhf import evaluate, rollout
    from nano_rlhf.sampling import SamplingOptions
    model = GPT.from_pretrained(str(d)).eval()
    ends = []
    orig = rollout.sample_responses

    def spy(model, ids, *args, **kw):
        out = orig(model, ids, *args, **kw)
        ends.append(out[0])                      # the responses, each cut after its end
        return out
    monkeypatch.setattr(rollout, "sample_responses", spy)
    got = evaluate.sample_and_score(model, tok, prompt_rows(16), SamplingOptions(max_new_tokens=8))
    for s, row in zip(got, ends[0]):
        if s["eos"]:
            assert row[s["length"] - 1] == tok.eot_id


def test_reward_model_text_call_closes_a_conversation_with_end_of_turn(family):
    """reward(prompts, completions) with conversational prompts scores the rendered prompt + completion +
    the end-of-turn token (what a rollout samples and train_rm.py scored), not + end-of-text; a text prompt
    still gets the end-of-text."""
    name, policy_dir, rm_dir, root = family
    tok = load_tokenizer("", policy_dir, EOS[name])
    reward = load_reward(rm_dir, tokenizer=tok)
    rm = ScoreModel.from_pretrained(rm_dir).eval()
    prompts = [r["prompt"] for r in prompt_rows(3)] + ["write a short review of the phone."]
    completions = ["the motor is great.", "the screen is bad and loud.", "fine.", "the phone is nice."]
    got = reward(prompts, completions)
    for p, c, score in zip(prompts, completions, got):
        end = tok.eos_id if isinstance(p, str) else tok.eot_id
        ids = torch.tensor([tok.render_prompt(p) + tok.encode(c) + [end]])
        with torch.no_grad():
            assert score == pytest.approx(rm(ids)[1].item(), abs=1e-5)
