"""Guards that learning does not silently break: short runs that must raise the held-out reward that matters.
A sign error in an advantage, a loss that trains the wrong way, a mask that drops every token — all leave the
math tests green if they sit between the pieces; these runs go red.

Thresholds are argued from measured gains (several seeds, two CPU kinds), in each test's docstring, and set far
below the smallest; the same runs with the advantage's sign flipped fail them (measured, same docstring).
Not marked numeric: the figures are trajectories of seeded training, whose last bits differ between CPU kinds."""
import re

import pytest
import torch

from conftest import tiny_model, write_jsonl

REWARD = '''import re


def reward(prompts, completions):
    """1 when the word "the" appears in the completion: verifiable by code."""
    return [1.0 if re.search(r"\\bthe\\b", c) else 0.0 for c in completions]
'''


def word_prone(model, tok, word_id, logit=2.5):
    """A tiny random policy that writes token `word_id` often (~half of 8-token completions hold it), so every
    group of samples has reward spread to learn from: the output bias of eos_prone (conftest.py), for a word."""
    with torch.no_grad():
        w = model.transformer.wte.weight[word_id]
        model.transformer.ln_f.weight.mul_(0.1)
        model.transformer.ln_f.bias.copy_(w * logit / w.dot(w))
    return model


def grpo_gain(tmp_path, tok, seed, steps=12):
    """Held-out reward (64 prompts, one sample each, a fixed sampling seed) before and after GRPO on the
    verifiable reward above: (before, after)."""
    import json

    import train_ppo
    init = tmp_path / "init"
    if not (init / "model.safetensors").exists():
        word_prone(tiny_model(tok, seed=0), tok, tok.encode(" the")[0]).save_pretrained(str(init))
        tok.save(str(init / "tokenizer.json"))
        words = "review write a short note on of phone motor screen battery blender".split()
        rows = [{"prompt": " ".join(words[(i * 5 + j) % len(words)] for j in range(2 + i % 4)) + "."}
                for i in range(160)]
        write_jsonl(tmp_path / "prompts.jsonl", rows[:96])
        write_jsonl(tmp_path / "eval_prompts.jsonl", rows[96:])
        (tmp_path / "verifier.py").write_text(REWARD)
    out = tmp_path / f"grpo_{seed}"
    train_ppo.main(["--advantage", "grpo", "--reward", f"{tmp_path / 'verifier.py'}:reward", "--init", str(init),
                    "--prompts", str(tmp_path / "prompts.jsonl"), "--eval_prompts",
                    str(tmp_path / "eval_prompts.jsonl"), "--out_dir", str(out), "--max_steps", str(steps),
                    "--batch_size", "8", "--samples_per_prompt", "8", "--max_new_tokens", "8",
                    "--missing_eos_penalty", "none", "--lr", "3e-3", "--eval_interval", str(steps),
                    "--eval_samples", "64", "--save_interval", "0", "--log_interval", str(steps), "--seed", str(seed),
                    "--device", "cpu"])
    evals = [json.loads(x) for x in open(out / "metrics.jsonl") if "eval/reward" in x]
    return evals[0]["eval/reward"], evals[-1]["eval/reward"]


@pytest.mark.slow
def test_grpo_raises_the_held_out_verifiable_reward(tmp_path, tok):
    """GRPO, 12 steps x 64 samples, on a reward code checks; held-out reward 0.156 before. Measured gains, seeds
    0-5: +0.83 +0.80 +0.84 +0.83 +0.80 +0.81 (AVX-512), +0.83 +0.80 +0.84 +0.83 +0.77 +0.80
    (ATEN_CPU_CAPABILITY=default); with grpo_advantages' sign flipped −0.156 in every seed measured (the reward
    falls to 0). Threshold 0.35: under half the smallest gain."""
    before, after = grpo_gain(tmp_path, tok, seed=0)
    assert after - before > 0.35, (before, after)


def test_the_verifier_reads_words():
    ns = {}
    exec(REWARD, ns)
    assert ns["reward"](["p"] * 3, [" the phone", "theme", "x. The"]) == [1.0, 0.0, 0.0]
    assert re.search(r"\bthe\b", "of the")


# ---- the built-in task: DPO and PPO against its gold reward ----------------------------------------------

def gold_of(model_dir, task):
    """Mean gold reward of one sample (T = 1, fixed seed) for each of 256 held-out built-in prompts."""
    from nano_rlhf import reward as reward_mod
    from nano_rlhf.training import load_tokenizer
    from nano_rlhf.data import load_records
    from nano_rlhf.evaluate import sample_and_score
    from nano_rlhf.model import GPT
    from nano_rlhf.sampling import SamplingOptions
    prompts = load_records(str(task / "eval_prompts.jsonl"), "prompts")
    model = GPT.from_pretrained(str(model_dir)).eval()
    samples = sample_and_score(model, load_tokenizer("", str(model_dir)), prompts, SamplingOptions(max_new_tokens=32),
                               seed=0, rewards={"gold": reward_mod.gold})
    return sum(s["gold"] for s in samples) / len(samples)


def builtin_sft(tmp_path):
    """The built-in task at a small size and a small SFT policy trained on it (a few seconds)."""
    import train_sft
    from nano_rlhf.tasks import synthetic
    task = tmp_path / "task"
    synthetic.write_dataset(str(task), seed=0, n_sft=2000, n_pref=1000, n_unpaired=10, n_prompts=200,
                            n_eval_prompts=256, n_listwise=10)
    train_sft.main(["--data", str(task / "sft.jsonl"), "--eval_data", str(task / "sft_eval.jsonl"), "--out_dir",
                    str(tmp_path / "sft"), "--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--max_steps", "400",
                    "--batch_size", "32", "--eval_interval", "0", "--save_interval", "0", "--log_interval", "60",
                    "--seed", "0", "--device", "cpu"])
    return task, tmp_path / "sft"


def dpo_gain(tmp_path, seed, task=None, sft=None):
    import train_dpo
    if task is None:
        task, sft = builtin_sft(tmp_path)
    out = tmp_path / f"dpo_{seed}"
    train_dpo.main(["--data", str(task / "preference.jsonl"), "--eval_data", str(task / "preference_eval.jsonl"),
                    "--init", str(sft), "--out_dir", str(out), "--max_steps", "60", "--batch_size", "16",
                    "--lr", "5e-4", "--eval_interval", "0", "--save_interval", "0", "--log_interval", "60",
                    "--seed", str(seed), "--device", "cpu"])
    return gold_of(sft, task), gold_of(out, task)


def small_rm(tmp_path, task, sft):
    """A reward model trained 60 steps on the task's pairs from the SFT policy (once per tmp_path)."""
    import train_rm
    rm = tmp_path / "rm"
    if not (rm / "model.safetensors").exists():
        train_rm.main(["--data", str(task / "preference.jsonl"), "--eval_data", str(task / "preference_eval.jsonl"),
                       "--init", str(sft), "--out_dir", str(rm), "--max_steps", "60", "--batch_size", "16",
                       "--eval_interval", "0", "--save_interval", "0", "--log_interval", "60", "--seed", "0",
                       "--device", "cpu"])
    return rm


def ppo_gain(tmp_path, seed, task=None, sft=None):
    import train_ppo
    if task is None:
        task, sft = builtin_sft(tmp_path)
    rm = small_rm(tmp_path, task, sft)
    out = tmp_path / f"ppo_{seed}"
    train_ppo.main(["--init", str(sft), "--reward_model", str(rm), "--prompts", str(task / "prompts.jsonl"),
                    "--eval_prompts", str(task / "eval_prompts.jsonl"), "--out_dir", str(out), "--max_steps", "15",
                    "--batch_size", "8", "--samples_per_prompt", "4", "--max_new_tokens", "32", "--lr", "5e-4",
                    "--eval_interval", "0", "--eval_samples", "8", "--save_interval", "0", "--log_interval", "15",
                    "--seed", str(seed), "--device", "cpu"])
    return gold_of(sft, task), gold_of(out, task)


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    return builtin_sft(tmp_path_factory.mktemp("builtin"))


@pytest.mark.slow
def test_dpo_raises_the_held_out_gold_reward(tmp_path, builtin):
    """DPO, 60 steps x 16 pairs from a small SFT policy (gold −0.86 on 256 held-out prompts; s.e. ~0.1). Measured
    gains, seeds 0-5: +1.21 +1.06 +1.16 +1.10 +0.97 +1.39 (AVX-512; the same to ±0.005 under
    ATEN_CPU_CAPABILITY=default); with h's sign flipped in the loss: −0.61 −0.94 −0.98. Threshold 0.4. (From an
    SFT of 150 steps instead of 400 the gains spread from −0.10 to +0.69: DPO needs a policy that already writes
    the task's sentences.)"""
    before, after = dpo_gain(tmp_path, 0, *builtin)
    assert after - before > 0.4, (before, after)


@pytest.mark.slow
def test_ppo_raises_the_held_out_gold_reward(tmp_path, builtin):
    """PPO with a critic and a reward model trained 60 steps, 15 steps x 32 samples, from the same SFT policy.
    Measured gains, seeds 0-5: +1.65 +2.10 +1.44 +1.62 +1.85 +1.64 (AVX-512), +1.81 +1.84 +1.98 +1.63 +1.92 +1.60
    (ATEN_CPU_CAPABILITY=default); with GAE's advantages negated: −2.39 −0.62 −2.18. Threshold 0.6."""
    before, after = ppo_gain(tmp_path, 0, *builtin)
    assert after - before > 0.6, (before, after)


def online_dpo_gain(tmp_path, seed, task, sft, *extra):
    """Online DPO judged by a reward model trained 60 steps, 150 steps x 8 prompts x 4 samples at lr 5e-4 (a
    high rate, so that the judge's blind spots are found within seconds), from the small SFT policy."""
    import train_online
    rm = small_rm(tmp_path, task, sft)
    out = tmp_path / f"online_{seed}"
    train_online.main(["--init", str(sft), "--judge", str(rm), "--prompts", str(task / "prompts.jsonl"),
                       "--eval_prompts", str(task / "eval_prompts.jsonl"), "--out_dir", str(out), "--max_steps", "150",
                       "--batch_size", "8", "--max_new_tokens", "32", "--lr", "5e-4", "--eval_interval", "0",
                       "--eval_samples", "8", "--save_interval", "0", "--log_interval", "150", "--seed", str(seed),
                       "--device", "cpu", *extra])
    return gold_of(sft, task), gold_of(out, task)


@pytest.mark.slow
def test_online_dpo_with_a_reward_model_judge_does_not_hack_it(tmp_path, builtin):
    """Online DPO at its defaults (soft labels on every pair, beside the reward model's own training pairs) against
    a weak reward model (60 steps): the held-out gold reward must rise on the two seeds where the first default
    (hard labels, best vs worst, online pairs only) lost most of its gain to the reward model's blind spots.
    Measured gains from gold −0.86, seeds 0-5: the defaults +1.96 +1.83 +1.81 +1.93 +1.83 +1.95 (AMD EPYC);
    soft labels online only (the second default) +1.76 +1.68 +1.87 +1.95 +1.81 +1.81 (AVX-512); the first
    default +2.01 +0.25 +0.39 +1.90 +1.89 +0.19 (AVX-512; seeds 1 and 5 on the AMD host: +0.24 +0.22; its collapse
    warning fired on seeds 0 and 2: more than half the samples repeated another of their prompt). Threshold 1.0 on
    seeds 1 and 5."""
    gains = [after - before for before, after in (online_dpo_gain(tmp_path, s, *builtin) for s in (1, 5))]
    assert min(gains) > 1.0, gains
