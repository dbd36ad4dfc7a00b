"""PPO-Lagrangian (Safe RLHF, Dai et al. 2024), train_ppo_lagrangian.py: its functions against float64 formulas
written from the paper and safe-rlhf's ppo_lag, and the loop end to end (the multiplier's steps, resume, DDP)."""
import json
import math

import pytest
import torch

import train_ppo_lagrangian
from conftest import metrics, prompt_rows, run, write_jsonl
from test_ppo import main_exit, ppo_args
from nano_rlhf.model import GPT, ScoreModel
from nano_rlhf.rollout import Rollout

# a verifiable cost: the share of the letter "e" in the response, minus 0.1 (so some responses are "safe", < 0)
COST = """def cost(prompts, completions):
    return [sum(ch == "e" for ch in c) / max(len(c), 1) - 0.1 for c in completions]
"""


def test_lagrangian_advantage_is_the_papers_normalised_combination():
    g = torch.Generator().manual_seed(0)
    a_r, a_c = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    for lam in (0.0, 0.3, 1.0, 7.5, 1e6):
        want = torch.tensor([[(a_r[i, t].item() - lam * a_c[i, t].item()) / (1.0 + lam) for t in range(5)]
                             for i in range(3)], dtype=torch.float64)
        assert torch.allclose(train_ppo_lagrangian.lagrangian_advantage(a_r, a_c, lam), want, rtol=1e-15, atol=1e-15)
    assert torch.allclose(train_ppo_lagrangian.lagrangian_advantage(a_r, a_c, 1e12), -a_c, atol=1e-9)   # λ → ∞: the cost alone


def test_lambda_stays_a_float32_number_without_a_cap():
    """--lambda_max inf with a cost far over its limit: λ stops at float32's largest value (it multiplies float32
    advantages) instead of e^{log λ} overflowing Python's float a few steps on (an OverflowError stack)."""
    from nano_rlhf.cli import FLOAT32_MAX
    log_lam = 0.0
    for _ in range(5):
        log_lam = train_ppo_lagrangian.lambda_step(log_lam, 10.0, 0.0, 1e3)
    assert log_lam == math.log(FLOAT32_MAX) and math.isfinite(math.exp(log_lam))


def test_lambda_step_is_gradient_ascent_on_the_lagrangian_through_log_lambda():
    """safe-rlhf: log λ a parameter, loss −(J_C − d)·e^{log λ}, one SGD step of lr η; then the cap λ_max."""
    for log_lam, j_c, d, lr in ((0.0, 0.7, 0.0, 0.1), (math.log(3.0), -0.4, 0.2, 0.05), (-2.0, 5.0, 1.0, 1.0)):
        p = torch.tensor(log_lam, dtype=torch.float64, requires_grad=True)
        (-(j_c - d) * p.exp()).backward()
        want = (p - lr * p.grad).item()
        assert train_ppo_lagrangian.lambda_step(log_lam, j_c, d, lr) == pytest.approx(want, rel=1e-15, abs=1e-15)
    assert train_ppo_lagrangian.lambda_step(0.0, 100.0, 0.0, 1.0, lambda_max=5.0) == pytest.approx(math.log(5.0))
    up, down = train_ppo_lagrangian.lambda_step(0.0, 0.5, 0.0, 0.1), train_ppo_lagrangian.lambda_step(0.0, -0.5, 0.0, 0.1)
    assert up > 0 > down and math.exp(train_ppo_lagrangian.lambda_step(-30.0, -1e3, 0.0, 0.1)) > 0    # λ never reaches 0


def test_the_kl_split_leaves_the_policy_a_kl_weight_of_half_beta_whatever_lambda():
    """GRPO with a cost: the KL penalty enters the score's advantage as −β/2·(centred Σ KL) and the cost's as
    +β/2·(centred Σ KL), so the combined advantage holds −β/2·(centred Σ KL) for any λ (safe-rlhf's split)."""
    g = torch.Generator().manual_seed(1)
    k, B, R = 4, 8, 6
    mask = torch.ones(B, R, dtype=torch.float64)
    r = Rollout(query_response=torch.zeros(B, 2 + R, dtype=torch.long), attention_mask=torch.ones(B, 2 + R),
                response_mask=mask, has_eos=torch.ones(B), completions=[""] * B,
                scores=torch.randn(B, generator=g, dtype=torch.float64),
                costs=torch.randn(B, generator=g, dtype=torch.float64),
                logprobs=-torch.rand(B, R, generator=g, dtype=torch.float64),
                ref_logprobs=-torch.rand(B, R, generator=g, dtype=torch.float64))
    beta = 0.2
    kl = (r.logprobs - r.ref_logprobs).sum(1).view(-1, k)
    centred_kl = (kl - kl.mean(1, keepdim=True)).view(-1)

    def grpo(x):
        x = x.view(-1, k)
        return ((x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-4)).view(-1)
    for lam in (0.0, 0.5, 4.0):
        t = train_ppo_lagrangian.lagrangian_targets(r, lam, beta, estimator="grpo", k=k)
        want = (grpo(r.scores) - lam * grpo(r.costs)) / (1 + lam) - beta / 2 * centred_kl
        assert torch.allclose(t.adv[:, 0], want, atol=1e-12)


def cost_args(tmp_path, sft_dir, rm_dir, out, *extra, steps=3):
    (tmp_path / "cost.py").write_text(COST)
    return ppo_args(tmp_path, sft_dir, rm_dir, out, "--cost", f"{tmp_path / 'cost.py'}:cost", "--lambda_lr", "0.5",
                    *extra, steps=steps)


def test_ppo_lagrangian_learns_lambda_trains_a_cost_critic_and_resumes_exactly(tmp_path, sft_dir, rm_dir):
    a = train_ppo_lagrangian.main(cost_args(tmp_path, sft_dir, rm_dir, "a", "--cost_limit", "-1", "--save_interval", "0",
                                 steps=4))
    m = metrics(tmp_path / "a")
    lam = [x["train/lambda"] for x in m]
    assert all(b >= a for a, b in zip(lam, lam[1:])) and lam[0] > 1.0   # every cost is above −1: λ only rises...
    assert lam[-1] == pytest.approx(5.0)                                 # ...to its cap --lambda_max 5
    costs = [x["train/cost"] for x in m]
    assert all(x["train/episode_cost"] >= min(costs) - 1e-9 for x in m) and "train/cost_value_loss" in m[0]
    assert isinstance(a.cost_critic, ScoreModel) and isinstance(a.critic, ScoreModel)   # --cost: from the policy
    train_ppo_lagrangian.main(cost_args(tmp_path, sft_dir, rm_dir, "b", "--cost_limit", "-1", "--save_interval", "0",
                             "--stop_at", "2", steps=4))
    b = train_ppo_lagrangian.main(cost_args(tmp_path, sft_dir, rm_dir, "b", "--cost_limit", "-1", "--save_interval", "0",
                                 "--resume", steps=4))
    assert b.lagrange.log_lambda == a.lagrange.log_lambda and list(b.lagrange.steps) == list(a.lagrange.steps)
    for x, y in ((a.policy, b.policy), (a.cost_critic, b.cost_critic)):
        assert all(torch.equal(p, q) for p, q in zip(x.state_dict().values(), y.state_dict().values()))
    assert metrics(tmp_path / "b")[-1]["train/lambda"] == m[-1]["train/lambda"]


def test_resume_refuses_a_changed_cost_limit(tmp_path, sft_dir, rm_dir, capfd):
    train_ppo_lagrangian.main(cost_args(tmp_path, sft_dir, rm_dir, "r", "--stop_at", "1", steps=3))
    code, err = main_exit(capfd, cost_args(tmp_path, sft_dir, rm_dir, "r", "--cost_limit", "0.5", "--resume",
                                           steps=3), train_ppo_lagrangian)
    assert code != 0 and "cost_limit 0.0 != 0.5" in err and "Traceback" not in err


@pytest.mark.parametrize("adv", ["grpo", "reinforce_pp"])
def test_the_critic_free_estimators_take_the_cost_too(tmp_path, sft_dir, rm_dir, adv):
    out = train_ppo_lagrangian.main(cost_args(tmp_path, sft_dir, rm_dir, adv, "--advantage", adv, "--cost_limit", "1",
                                   steps=2))
    assert out.cost_critic is None and out.lagrange is not None
    lam = [x["train/lambda"] for x in metrics(tmp_path / adv)]
    assert lam[1] < lam[0] < 1.0                                        # every cost is under 1: λ only falls


@pytest.mark.parametrize("extra, message", [
    (["--cost_limit", "0.5"], "PPO-Lagrangian needs a cost: --cost_model DIR"),
    (["--cost", "x.py:f", "--cost_model", "somewhere"], "pass one cost"),
    (["--cost", "nocolon"], "--cost must be module:function"),
    (["--cost_model", "/nonexistent/cost_model"], "/nonexistent/cost_model"),
    (["--cost", "x.py:f", "--lambda_init", "0"], "--lambda_init must be > 0"),
    (["--cost", "x.py:f", "--lambda_init", "6"], "--lambda_init 6 is above --lambda_max 5"),
    (["--cost", "x.py:f", "--cost_limit", "nan"], "--cost_limit"),
])
def test_bad_cost_options_are_one_line(tmp_path, sft_dir, rm_dir, capfd, extra, message):
    code, err = main_exit(capfd, ppo_args(tmp_path, sft_dir, rm_dir, "x", *extra), train_ppo_lagrangian)
    assert code != 0 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_train_ppo_names_the_script_that_has_the_cost_options(tmp_path, sft_dir, rm_dir, capfd):
    """train_ppo.py trains on the reward alone: a cost option given to it is refused in one line that names
    train_ppo_lagrangian.py, and a run one script began is not resumed by the other (a run.json of the time when
    train_ppo.py had the cost options is such a run)."""
    code, err = main_exit(capfd, ppo_args(tmp_path, sft_dir, rm_dir, "x", "--cost_model", "cm"))
    assert code == 2 and "--cost_model is an option of train_ppo_lagrangian.py" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    train_ppo_lagrangian.main(cost_args(tmp_path, sft_dir, rm_dir, "r", "--stop_at", "1", steps=2))
    code, err = main_exit(capfd, ppo_args(tmp_path, sft_dir, rm_dir, "r", "--resume"))
    assert code != 0 and "was saved by train_ppo_lagrangian.py, not train_ppo.py" in err, err
    run_json = tmp_path / "r" / "state" / "run.json"
    saved = json.loads(run_json.read_text())
    saved["identity"]["script"] = "ppo"                   # as train_ppo.py recorded a run with a cost
    run_json.write_text(json.dumps(saved))
    code, err = main_exit(capfd, cost_args(tmp_path, sft_dir, rm_dir, "r", "--resume", steps=2), train_ppo_lagrangian)
    assert code != 0 and "was saved by train_ppo.py, not train_ppo_lagrangian.py" in err, err
    assert len(err.strip().splitlines()) == 1


SPY = """import json, os, sys
import train_ppo_lagrangian
out = train_ppo_lagrangian.main(sys.argv[1:])
with open(os.path.join(os.environ["SPY_DIR"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"log_lambda": out.lagrange.log_lambda, "window": list(out.lagrange.steps),
               "critic": [p.sum().item() for p in out.cost_critic.parameters()]}, f)
"""


def test_ddp_ranks_hold_the_same_lambda_and_cost_critic(tmp_path, sft_dir, rm_dir):
    (tmp_path / "spy.py").write_text(SPY)
    write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(16))
    write_jsonl(tmp_path / "eval_prompts.jsonl", prompt_rows(4, seed=1))
    run([str(tmp_path / "spy.py")] + cost_args(tmp_path, sft_dir, rm_dir, "ddp", "--batch_size", "2", steps=3),
        nproc=2, env={"SPY_DIR": str(tmp_path)})
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0 == r1 and r0["log_lambda"] != 0.0
    assert all(n == 2 * 2 * 1 for _, n in r0["window"])          # J_C counts both ranks' episodes every step
    GPT.from_pretrained(str(tmp_path / "ddp"))


@pytest.mark.slow
def test_ppo_lagrangian_fsdp_follows_ddp(tmp_path, sft_dir, rm_dir):
    """2 FSDP ranks (policy, both critics and the frozen reference sharded) follow 2 DDP ranks step by step: the
    same rollouts (sampled on gathered weights), the same costs and so the same λ, and the same final weights."""
    from conftest import weights_close
    from test_fsdp import close_metrics, weights
    write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(16))
    write_jsonl(tmp_path / "eval_prompts.jsonl", prompt_rows(4, seed=1))
    argv = lambda out, *x: ["train_ppo_lagrangian.py"] + cost_args(tmp_path, sft_dir, rm_dir, out, "--batch_size", "2",
                                                                  "--kl_coef", "0.05", *x, steps=2)
    run(argv("ddp"), nproc=2)
    p = run(argv("fsdp", "--fsdp", "--frozen", "shard"), nproc=2)
    assert "frozen models bit-identical to the start: ref" in p.stdout
    keys = ["train/score", "train/cost", "train/episode_cost", "train/lambda", "train/kl", "train/policy_loss",
            "train/value_loss", "train/cost_value_loss", "train/grad_norm", "train/cost_critic_grad_norm"]
    close_metrics(tmp_path / "ddp", tmp_path / "fsdp", keys)
    assert weights_close(weights(tmp_path / "ddp"), weights(tmp_path / "fsdp"))


def test_a_tool_rollout_carries_the_cost_and_keeps_the_tool_turn_out_of_the_loss(tmp_path, monkeypatch):
    """train_ppo_lagrangian's rollout with --tools, a policy scripted to call the calculator: the cost is the cost
    function's of the decoded completion, the tool turn a hole in the policy mask, and the cost's advantage
    carries no KL from it (as train_ppo's rollout, tests/test_tool_rl.py)."""
    from conftest import scripted_policy
    from test_chat_templates import build, calls
    from nano_rlhf import chat
    from nano_rlhf.model import GPTConfig
    from nano_rlhf.tools import load_tools
    _, tok, _ = build("qwen2.5", tmp_path)
    box = load_tools("calculator")
    first = tok.encode(chat.assistant_text(tok.chat_template, "", calls(("calculator", {"expression": "2+3"})))) \
        + [tok.eot_id]
    tool, answer = tok.encode_tool_turn(["5"]), tok.encode("It is 5.") + [tok.eot_id]
    script = first + tool + answer
    scripted_policy(monkeypatch, script)
    p_ids = tok.render_prompt([{"role": "user", "content": "What is 2+3?"}], box.schemas)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=len(p_ids) + len(script) + 8, n_layer=1, n_head=2, n_embd=16)
    policy, ref = GPT(cfg).eval(), GPT(cfg).eval()
    o = train_ppo_lagrangian.Options(advantage="grpo", samples_per_prompt=1, micro_batch_size=1,
                                     max_new_tokens=len(script) + 8, tools="calculator", max_turns=3,
                                     missing_eos_penalty=None, cost="x.py:f")
    cost = lambda p, c: [float(len(x)) for x in c]
    models = train_ppo_lagrangian.Models(policy=policy, reward=lambda p, c: [1.0] * len(c), cost=cost, ref=ref,
                                         tools=box)
    r = train_ppo_lagrangian.rollout([{"prompt": p_ids, "text": "What is 2+3?"}], models, tok, o,
                                     torch.Generator().manual_seed(0))
    hole = [1.0] * len(first) + [0.0] * len(tool) + [1.0] * len(answer)
    assert r.query_response[0].tolist() == p_ids + script and r.policy_mask[0].tolist() == hole
    assert r.costs.tolist() == [float(len(r.completions[0]))] and "5" in r.completions[0]
    kl = ((r.logprobs - r.ref_logprobs) * torch.tensor([hole])).sum(1)
    assert torch.equal(train_ppo_lagrangian.sequence_kl(r), kl)               # the tool turn holds no KL
    box.close()


def test_ppo_lagrangian_lora_trains_adapters_on_both_critics(tmp_path, sft_dir, rm_dir):
    """--lora_r: the policy, the reward critic and the cost critic each train their adapters (and a critic its
    head) on a frozen base, and the checkpoint holds just those tensors."""
    from safetensors.torch import load_file
    from test_lora_scripts import LORA, assert_base_untouched, assert_only_adapters_optimised
    out = train_ppo_lagrangian.main(cost_args(tmp_path, sft_dir, rm_dir, "o", *LORA, steps=2))
    assert_base_untouched(out.policy, GPT.from_pretrained(sft_dir))
    for name, critic, start in (("critic", out.critic, rm_dir), ("cost_critic", out.cost_critic, sft_dir)):
        assert_base_untouched(critic, ScoreModel.from_pretrained(start, new_head=start == sft_dir),
                              skip=("score.weight",))     # the cost critic of a --cost: from the policy
        assert_only_adapters_optimised(critic, out.optimizers[name], head=("score.weight",))
        assert set(load_file(str(tmp_path / "o" / "state" / f"model_{name}.safetensors"))) == \
            {k for k in critic.state_dict() if ".lora_" in k} | {"score.weight"}
