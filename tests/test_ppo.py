"""train_ppo.py as a whole: rollout bookkeeping, frozen models, ratio = 1 at lr 0, DDP, every estimator."""
import json

import pytest
import torch

import train_ppo
from conftest import eos_prone, gae_only, prompt_rows, run, tiny_model, write_jsonl
from numerics import FLOAT32_ATOL  # float32 values of order one: see tests/numerics.py
from nano_rlhf.data import tokenize_prompts
from nano_rlhf.model import GPT, ScoreModel
from nano_rlhf.reward import load_reward


def ppo_args(tmp_path, sft_dir, rm_dir, out, *extra, steps=2):
    """Tiny runs: 4 prompts x 1 sample (x 4 for the group estimators), no critic warm-up (later flags win)."""
    if not (tmp_path / "prompts.jsonl").exists():
        write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(48))
        write_jsonl(tmp_path / "eval_prompts.jsonl", prompt_rows(8, seed=1))
    k = "4" if any(x in train_ppo.GROUP for x in extra) else "1"
    return gae_only(["--prompts", str(tmp_path / "prompts.jsonl"), "--eval_prompts",
                     str(tmp_path / "eval_prompts.jsonl"), "--init", sft_dir, "--reward_model", rm_dir, "--out_dir",
                     str(tmp_path / out), "--max_steps", str(steps), "--batch_size", "4", "--samples_per_prompt", k,
                     "--max_new_tokens", "12", "--eval_interval", "0", "--eval_samples", "4", "--lr", "1e-3",
                     "--critic_lr", "1e-3", "--critic_warmup_steps", "0", *extra])


def metrics(path):
    return [json.loads(x) for x in open(path / "metrics.jsonl")]


@pytest.fixture
def eos_sft_dir(tmp_path, tok):
    m = eos_prone(tiny_model(tok), tok)
    m.save_pretrained(str(tmp_path / "eos_sft"))
    tok.save(str(tmp_path / "eos_sft" / "tokenizer.json"))
    return str(tmp_path / "eos_sft")


def test_rollout_truncates_at_eos_and_scores_there(tok, rm_dir, eos_sft_dir):
    o = train_ppo.Options(samples_per_prompt=2, micro_batch_size=4, max_new_tokens=8, missing_eos_penalty=-7.0,
                          score_clip=100.0)
    policy = GPT.from_pretrained(eos_sft_dir).eval()
    rm = ScoreModel.from_pretrained(rm_dir).eval()                   # saved with reward_mean 0.1, reward_std 0.5
    prompts, _ = tokenize_prompts(prompt_rows(8), tok, 40)
    gen = torch.Generator().manual_seed(0)
    models = train_ppo.Models(policy=policy, reward=load_reward(rm_dir, tokenizer=tok), ref=policy)
    r = train_ppo.rollout(lambda: prompts, models, tok, o, gen)
    P, m = r.query_len, r.response_mask
    finished = r.has_eos.bool()
    assert 0 < finished.sum() < len(finished), "the test needs both finished and unfinished rows"
    for i in range(len(m)):
        n = int(m[i].sum())
        resp = r.query_response[i, P:]
        if finished[i]:
            assert resp[n - 1] == tok.eos_id and (resp[:n - 1] != tok.eos_id).all()
            assert (resp[n:] == tok.pad_id).all()                    # cut after the first end-of-text
            full = r.query_response[i, :P + n][r.attention_mask[i, :P + n].bool()][None]
            with torch.no_grad():
                want = (rm(full)[1] - 0.1) / 0.5                     # scored alone, unpadded, at its end-of-text
            assert torch.allclose(r.scores[i], want[0], atol=FLOAT32_ATOL)
        else:
            assert n == resp.shape[0] and r.scores[i] == -7.0      # replaced by the penalty
    # the score is the reward of the end-of-text token itself
    rewards = train_ppo.token_rewards(r.scores, torch.zeros_like(m), m, 0.1)
    last = m.sum(1).long() - 1
    assert torch.equal(rewards[torch.arange(len(m)), last], r.scores)
    assert (rewards.sum(1) == r.scores).all()


def test_lr0_first_update_has_ratio_one(tmp_path, sft_dir, rm_dir, eos_sft_dir):
    """Rollout and training log-probs agree (temperature, positions, padding): ratio 1, approx-KL 0."""
    train_ppo.main(ppo_args(tmp_path, eos_sft_dir, rm_dir, "lr0", "--lr", "0", "--critic_lr", "0", "--temperature",
                            "0.7", "--ppo_epochs", "2", "--num_minibatches", "2", "--micro_batch_size", "1", steps=2))
    for m in metrics(tmp_path / "lr0"):
        assert abs(m["train/ratio"] - 1) < 1e-6 and m["train/approx_kl"] < 1e-9 and m["train/clipfrac"] == 0
        assert m["train/kl"] == pytest.approx(0, abs=1e-5)          # policy == reference


def test_frozen_models_untouched_and_optimizers_hold_only_trainables(tmp_path, sft_dir, rm_dir):
    out = train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "ppo", steps=3))
    for frozen, src, cls in ((out.ref, sft_dir, GPT), (out.reward.model, rm_dir, ScoreModel)):
        fresh = cls.from_pretrained(src)
        assert all(torch.equal(a, b) for a, b in zip(frozen.state_dict().values(), fresh.state_dict().values()))
        assert all(not p.requires_grad for p in frozen.parameters()) and not frozen.training
    ids = lambda ps: {id(p) for p in ps}
    opt_pi, opt_v = out.optimizers["policy"], out.optimizers["critic"]
    assert ids(p for g in opt_pi.param_groups for p in g["params"]) == ids(out.policy.parameters())
    assert ids(p for g in opt_v.param_groups for p in g["params"]) == ids(out.critic.parameters())
    moved = lambda m, d, c: any(not torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                                     c.from_pretrained(d).state_dict().values()))
    assert moved(out.policy, sft_dir, GPT) and moved(out.critic, rm_dir, ScoreModel)
    m = metrics(tmp_path / "ppo")[-1]
    for k in ("train/score", "train/kl", "train/entropy", "train/approx_kl", "train/clipfrac", "train/value_clipfrac",
              "train/explained_variance", "train/response_length", "train/eos_rate", "train/kl_coef",
              "train/non_score_reward", "eval/rm_score", "eval/kl"):
        assert k in m, k


@pytest.mark.parametrize("adv", ["gae", "rloo", "grpo", "dr_grpo", "reinforce_pp"])
def test_every_estimator_end_to_end(tmp_path, sft_dir, rm_dir, adv):
    extra = ["--kl_in_loss"] if adv == "grpo" else ["--adaptive_kl", "--kl_estimator", "k3"] if adv == "reinforce_pp" else []
    out = train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, adv, "--advantage", adv, *extra))
    assert (out.critic is None) == (adv != "gae")
    m = metrics(tmp_path / adv)
    assert len(m) == 2 and all(torch.isfinite(torch.tensor(x["train/policy_loss"])) for x in m)
    GPT.from_pretrained(str(tmp_path / adv))


SPY = """import hashlib, json, os, sys
import train_ppo
texts, real = [], train_ppo.rollout
def spy(*a, **k):                        # record what this rank sampled
    r = real(*a, **k)
    texts.append(r.completions)
    return r
train_ppo.rollout = spy
out = train_ppo.main(sys.argv[1:])
digest = lambda m: hashlib.sha256(b"".join(t.numpy().tobytes() for t in m.state_dict().values())).hexdigest()
with open(os.path.join(os.environ["SPY_DIR"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"texts": texts, "policy": digest(out.policy), "critic": digest(out.critic)}, f)
"""


def test_ddp_ranks_stay_identical_though_they_sample_differently(tmp_path, sft_dir, rm_dir):
    """Same prompts on both ranks (one repeated prompt), so only the per-rank sampling seed differs: the ranks
    sample different responses of different lengths, and still hold bit-identical weights after 3 updates."""
    (tmp_path / "spy.py").write_text(SPY)
    write_jsonl(tmp_path / "prompts.jsonl", [prompt_rows(1)[0]] * 16)
    write_jsonl(tmp_path / "eval_prompts.jsonl", prompt_rows(4, seed=1))
    run([str(tmp_path / "spy.py")] + ppo_args(tmp_path, sft_dir, rm_dir, "ddp", "--batch_size", "2", steps=3),
        nproc=2, env={"SPY_DIR": str(tmp_path)})
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert len(r0["texts"]) == len(r1["texts"]) == 3
    assert r0["texts"] != r1["texts"]                          # different samples...
    assert r0["policy"] == r1["policy"] and r0["critic"] == r1["critic"]   # ...one update applied everywhere
    moved = GPT.from_pretrained(sft_dir).state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in GPT.from_pretrained(str(tmp_path / "ddp")).state_dict().items())


def test_resume_bit_exact(tmp_path, sft_dir, rm_dir):
    args = ("--adaptive_kl", "--save_interval", "0")
    train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "a", *args, steps=4))
    train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "b", *args, "--stop_at", "2", steps=4))
    out = train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "b", *args, "--resume", steps=4))
    a = GPT.from_pretrained(str(tmp_path / "a")).state_dict()
    assert all(torch.equal(a[k], v) for k, v in out.policy.state_dict().items())
    assert metrics(tmp_path / "a")[-1]["train/kl_coef"] == metrics(tmp_path / "b")[-1]["train/kl_coef"]


def test_batch_sizes_must_divide(tmp_path, sft_dir, rm_dir, capfd):
    code, err = main_exit(capfd, ppo_args(tmp_path, sft_dir, rm_dir, "x", "--batch_size", "3", "--num_minibatches", "2"))
    assert code != 0 and "does not split into --num_minibatches 2" in err
    code, err = main_exit(capfd, ppo_args(tmp_path, sft_dir, rm_dir, "x", "--advantage", "grpo", "--samples_per_prompt",
                                          "1"))
    assert code != 0 and "needs --samples_per_prompt >= 2" in err


def test_rollout_logprobs_equal_an_unpadded_forward_of_each_row(tok, eos_sft_dir):
    """An independent path: each sampled row alone, left padding stripped, a plain full forward, log-softmax of
    logits / τ. Equal to the batched, left-padded, position-shifted, select=... gather the rollout stores."""
    o = train_ppo.Options(samples_per_prompt=2, micro_batch_size=3, max_new_tokens=8, temperature=0.7)
    policy = GPT.from_pretrained(eos_sft_dir).eval()
    rows = prompt_rows(6)
    rows[0]["prompt"] = "review"                                       # prompts of very different lengths
    prompts, _ = tokenize_prompts(rows, tok, 40)
    models = train_ppo.Models(policy=policy, reward=lambda p, c: [0.0] * len(c), ref=policy)
    r = train_ppo.rollout(lambda: prompts, models, tok, o, torch.Generator().manual_seed(3))
    P, m = r.query_len, r.response_mask
    assert len({int(a[:P].sum()) for a in r.attention_mask}) > 1, "the test needs left padding"
    for i in range(len(m)):
        n = int(m[i].sum())
        ids = r.query_response[i, :P + n][r.attention_mask[i, :P + n].bool()][None]  # unpadded prompt + response
        with torch.no_grad():
            logp = torch.log_softmax(policy(ids)[0].double() / 0.7, -1)
        plen = ids.shape[1] - n
        want = logp[plen - 1:-1].gather(-1, ids[0, plen:, None]).squeeze(-1)
        assert torch.allclose(r.logprobs[i, :n].double(), want, atol=FLOAT32_ATOL)
        assert (r.logprobs[i, n:] == 0).all()


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--ptx_coef", "0.5"], "--ptx_coef applies only with --ptx_data"),
    (["--advantage", "grpo", "--kl_estimator", "k3"], "--kl_estimator applies only with --advantage gae or reinforce_pp"),
    (["--adaptive_kl", "--kl_coef", "0"], "--adaptive_kl applies only with --kl_coef > 0"),
    (["--num_minibatches", "0"], "--num_minibatches must be >= 1"),
])
def test_bad_options_exit_before_training(tmp_path, sft_dir, rm_dir, capfd, extra, message):
    """main() in this process (its exit code and the stderr file descriptor): a start-up each would be ~2.5 s;
    test_a_bad_flag_is_one_line_from_the_shell runs one whole process."""
    code, err = main_exit(capfd, ppo_args(tmp_path, sft_dir, rm_dir, "x", *extra))
    assert code != 0 and message in err and "Traceback" not in err
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def main_exit(capfd, argv, script=train_ppo):
    """(exit code, stderr) of script.main(argv), which must exit."""
    capfd.readouterr()
    with pytest.raises(SystemExit) as e:
        script.main(argv)
    assert isinstance(e.value.code, int)
    return e.value.code, capfd.readouterr().err


@pytest.mark.parametrize("extra", [
    ["--ptx_data", "SFT", "--ptx_coef", "0.5", "--clip_high", "0.28", "--entropy_coef", "0.01"],
    ["--critic_init", "policy", "--kl_coef", "0", "--kl_estimator", "k3", "--missing_eos_penalty", "none"],
    ["--advantage", "rloo", "--reward", "gold", "--prompts", "BUILTIN"],
], ids=["ptx-cliphigh-entropy", "critic-from-policy-no-ref", "rloo-gold"])
def test_option_paths_end_to_end(tmp_path, sft_dir, rm_dir, extra):
    from nano_rlhf.tasks import synthetic
    if "SFT" in extra:
        write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "review the phone", "completion": " great screen"}] * 16)
    if "BUILTIN" in extra:
        synthetic.main(["--out_dir", str(tmp_path / "task"), "--n_sft", "50", "--n_pref", "20", "--n_unpaired", "20",
                        "--n_prompts", "40", "--n_eval_prompts", "8"])
    extra = [str(tmp_path / "sft.jsonl") if x == "SFT" else str(tmp_path / "task" / "prompts.jsonl")
             if x == "BUILTIN" else x for x in extra]
    args = ppo_args(tmp_path, sft_dir, rm_dir, "run", *extra)
    if "gold" in extra:
        args += ["--eval_prompts", str(tmp_path / "task" / "eval_prompts.jsonl")]
    out = train_ppo.main(args)
    m = metrics(tmp_path / "run")
    assert len(m) == 2 and all(torch.isfinite(torch.tensor(x["train/policy_loss"])) for x in m)
    assert (out.ref is None) == ("--kl_coef" in extra)
    if "gold" in extra:
        assert "train/gold_reward" in m[-1] and "eval/gold_reward" in m[-1]


def test_ppo_ptx_resumes_exactly(tmp_path, sft_dir, rm_dir):
    """PPO-ptx: the SFT batches' order is part of the resumable state (rollout positions and PTX positions both),
    so a run stopped after step 2 and resumed ends bit-identical to the straight run."""
    rows = [{"prompt": f"review the {w}", "completion": f" {a} and {b}"} for w in ("phone", "lamp", "kettle", "desk")
            for a in ("great screen", "dim light", "quick boil") for b in ("fair price", "loud fan")]
    write_jsonl(tmp_path / "sft.jsonl", rows)
    extra = ["--ptx_data", str(tmp_path / "sft.jsonl"), "--ptx_coef", "0.5", "--ptx_batch_size", "3",
             "--save_interval", "0"]
    a = train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "a", *extra, steps=4))
    train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "b", *extra, "--stop_at", "2", steps=4))
    b = train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "b", *extra, "--resume", steps=4))
    assert all(torch.equal(p, q) for p, q in zip(a.policy.state_dict().values(), b.policy.state_dict().values()))
    la, lb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [x["train/policy_loss"] for x in la] == [x["train/policy_loss"] for x in lb]


@pytest.mark.parametrize("extra, option", [
    (["--kl_coef", "-0.5"], "--kl_coef"),
    (["--clip_eps", "-0.2"], "--clip_eps"),
    (["--eval_samples", "0"], "--eval_samples"),
    (["--log_interval", "0"], "--log_interval"),
    (["--batch_size", "0"], "--batch_size"),
    (["--lr", "-1"], "--lr"),
    (["--grad_clip", "-1"], "--grad_clip"),
    (["--max_steps", "-1"], "--max_steps"),
    (["--critic_warmup_steps", "-1"], "--critic_warmup_steps"),
    (["--eval_fraction", "1.5"], "--eval_fraction"),
    (["--reward", "nocolon"], "--reward"),
    (["--reward", "no_such_module_q:f"], "--reward"),
    pytest.param(["--device", "cuda"], "--device cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")),
])
def test_bad_flags_one_line_nothing_written(tmp_path, sft_dir, rm_dir, capfd, extra, option):
    code, err = main_exit(capfd, ppo_args(tmp_path, sft_dir, rm_dir, "x", *extra))
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("extra, option", [(["--kl_coef", "-0.5"], "--kl_coef"),
                                           (["--num_minibatches", "0"], "--num_minibatches must be >= 1")])
def test_a_bad_flag_is_one_line_from_the_shell(tmp_path, sft_dir, rm_dir, extra, option):
    p = run(["train_ppo.py"] + ppo_args(tmp_path, sft_dir, rm_dir, "x", *extra), check=False)
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], p.stderr
    assert not (tmp_path / "x").exists()


def test_ref_with_a_smaller_vocabulary_is_one_line(tmp_path, tok, sft_dir, rm_dir):
    small = tmp_path / "small"
    tiny_model(None, vocab_size=tok.vocab_size - 10).save_pretrained(str(small))
    p = run(["train_ppo.py"] + ppo_args(tmp_path, sft_dir, rm_dir, "x", "--ref", str(small)), check=False)
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and str(small) in lines[0] and "vocabulary" in lines[0], p.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_own_prompts_are_evaluated_on_a_held_out_share_of_them(tmp_path, sft_dir, rm_dir, capsys):
    """--prompts without --eval_prompts: evaluation samples come from --eval_fraction of the user's prompts,
    never from the built-in task (whose gold reward would then be computed on prompts it does not know)."""
    rows = [{"prompt": f"say something about item {i}."} for i in range(40)]
    write_jsonl(tmp_path / "own.jsonl", rows)
    args = ppo_args(tmp_path, sft_dir, rm_dir, "own")
    i = args.index("--eval_prompts")
    del args[i:i + 2]
    args[args.index("--prompts") + 1] = str(tmp_path / "own.jsonl")
    train_ppo.main(args + ["--eval_fraction", "0.1"])
    shown = [line.split("'")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("  sample |")]
    assert shown and all(s in {r["prompt"] for r in rows} for s in shown)
    last = metrics(tmp_path / "own")[-1]
    assert "eval/rm_score" in last and not any("gold" in k for k in last)


def test_critic_warmup_trains_the_critic_only(tmp_path, sft_dir, rm_dir):
    out = train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "warm", "--critic_warmup_steps", "2", steps=2))
    init = GPT.from_pretrained(sft_dir).state_dict()
    assert all(torch.equal(init[k], v) for k, v in out.policy.state_dict().items())          # policy untouched
    rm = ScoreModel.from_pretrained(rm_dir).state_dict()
    assert any(not torch.equal(rm[k], v) for k, v in out.critic.state_dict().items())       # critic trained
    assert all("train/policy_loss" not in m and "train/value_loss" in m for m in metrics(tmp_path / "warm"))


def test_advantages_leave_the_rollout_untouched():
    g = torch.Generator().manual_seed(0)
    B, R = 8, 5
    mask = (torch.arange(R)[None] < torch.randint(1, R + 1, (B,), generator=g)[:, None]).float()
    rnd = lambda *s: torch.randn(*s, generator=g)
    r = train_ppo.Rollout(query_response=torch.zeros(B, R + 3, dtype=torch.long), attention_mask=torch.ones(B, R + 3),
                          response_mask=mask, logprobs=rnd(B, R), ref_logprobs=rnd(B, R), values=rnd(B, R),
                          scores=rnd(B), raw_scores=rnd(B), gold=None, has_eos=torch.ones(B), completions=[""] * B)
    before = {k: v.clone() for k, v in vars(r).items() if torch.is_tensor(v)}
    for est in ("gae", "reinforce_pp", "rloo", "grpo", "dr_grpo"):
        out = train_ppo.advantages(r, estimator=est, beta=0.1, k=4)
        assert out.adv.shape == (B, R) and (out.adv * (1 - mask) == 0).all()
        assert (out.returns is not None) == (est == "gae")
    assert all(torch.equal(before[k], getattr(r, k)) for k in before)
    # the sequence reward's KL part: −β Σ_t k1 for the group estimators
    want = -0.1 * ((r.logprobs - r.ref_logprobs) * mask).sum(1)
    assert torch.allclose(train_ppo.advantages(r, estimator="rloo", beta=0.1, k=4).kl_penalty, want)


def test_reward_model_with_another_tokenizer_of_the_same_size_is_refused(tmp_path, tok, sft_dir, rm_dir, capsys):
    import shutil
    from conftest import other_tokenizer
    rm = tmp_path / "rm"
    shutil.copytree(rm_dir, rm)
    other_tokenizer(tok, rm)
    with pytest.raises(SystemExit) as e:
        train_ppo.main(ppo_args(tmp_path, sft_dir, str(rm), "x"))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {rm} was trained with another tokenizer than {sft_dir} "), err
    assert not (tmp_path / "x").exists()


def test_resume_refuses_a_reward_model_replaced_at_the_same_path(tmp_path, sft_dir, rm_dir, capsys):
    import os
    import shutil
    rm, out = tmp_path / "rm", tmp_path / "x"
    shutil.copytree(rm_dir, rm)
    train_ppo.main(ppo_args(tmp_path, sft_dir, str(rm), "x", "--stop_at", "1", steps=2))
    before = {f: (out / "state" / f).read_bytes() for f in os.listdir(out / "state")}
    m = ScoreModel.from_pretrained(str(rm))          # retrained in place: same path, same shape, other weights
    with torch.no_grad():
        m.score.weight.mul_(2.0)
    m.save_pretrained(str(rm), reward_mean=0.1, reward_std=0.5)
    with pytest.raises(SystemExit) as e:
        train_ppo.main(ppo_args(tmp_path, sft_dir, str(rm), "x", "--resume", steps=2))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: --resume: the input --reward_model {rm} changed since {out} was saved "), err
    assert {f: (out / "state" / f).read_bytes() for f in os.listdir(out / "state")} == before


INTERRUPT = """n = [0]
def reward(prompts, completions):
    n[0] += 1
    if n[0] == 3:
        raise KeyboardInterrupt          # what Ctrl-C does while the reward runs
    return [float(len(c) % 3) for c in completions]
"""


def test_ctrl_c_is_one_line_saying_where_it_stopped_and_what_is_saved(tmp_path, sft_dir, rm_dir):
    """Ctrl-C in step 3 of a run that saves every step: no KeyboardInterrupt stack, one line naming the step and the
    last checkpoint, the interpreter's interrupted exit (130, or -2 seen from the parent), and the run resumable."""
    import os
    import subprocess
    import sys
    (tmp_path / "kb.py").write_text(INTERRUPT)
    args = ppo_args(tmp_path, sft_dir, rm_dir, "c", "--advantage", "grpo", "--reward", f"{tmp_path / 'kb.py'}:reward",
                    "--save_interval", "1", steps=5)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "train_ppo.py", *args], cwd=root, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode in (130, -2), p.stderr
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("interrupted at step 3; the last checkpoint is step 2: continue "
                                                 "with --resume")
    assert json.load(open(tmp_path / "c" / "state" / "meta.json"))["step"] == 2


@pytest.mark.parametrize("tool", ["train_ppo", "train_sft", "evaluate", "label"])
def test_a_reward_model_as_the_policy_is_one_line(tool, tmp_path, sft_dir, rm_dir, capsys):
    """A reward-model directory where a policy goes (--init, --model) used to be sampled and trained as a language
    model from its trunk: refused in one line naming the architecture. train_rm.py may start from one."""
    import importlib
    args = {"train_ppo": lambda: ppo_args(tmp_path, sft_dir, rm_dir, "p", "--init", rm_dir),
            "train_sft": lambda: ["--init", rm_dir, "--out_dir", str(tmp_path / "s")],
            "evaluate": lambda: ["--model", rm_dir, "--out", str(tmp_path / "e.jsonl")],
            "label": lambda: ["--model", rm_dir, "--judge", "gold", "--out", str(tmp_path / "l.jsonl")]}[tool]()
    main = importlib.import_module(tool if tool.startswith("train") else f"nano_rlhf.{tool}").main
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code != 0 and len(err) == 1 and err[0].startswith(f"error: {rm_dir}: a reward model ("), err
    assert "ForSequenceClassification), not a language model" in err[0]


def test_a_failure_in_the_last_evaluation_keeps_the_trained_model(tmp_path, sft_dir, rm_dir, capsys):
    """The end of a step saves, then evaluates: a reward that raises on the held-out prompts (a user's bug, an
    overflow) stops the run with one line, and the trained model and its checkpoint are already on disk."""
    (tmp_path / "rw.py").write_text("def reward(prompts, completions):\n"
                                    "    if any('HELD OUT' in str(p) for p in prompts):\n"
                                    "        raise RuntimeError('boom')\n"
                                    "    return [float(len(c) % 3) for c in completions]\n")
    args = ppo_args(tmp_path, sft_dir, rm_dir, "run", "--advantage", "grpo", "--reward",
                    f"{tmp_path / 'rw.py'}:reward")
    write_jsonl(tmp_path / "eval_prompts.jsonl", [{"prompt": f"HELD OUT question {i}"} for i in range(4)])
    with pytest.raises(SystemExit) as e:
        train_ppo.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and "raised RuntimeError" in err[0], err
    assert (tmp_path / "run" / "model.safetensors").exists()
    assert json.load(open(tmp_path / "run" / "state" / "meta.json"))["step"] == 2
