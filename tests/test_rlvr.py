"""train_ppo.py's reasoning-era variants through the command line: every flag end to end, what dynamic sampling
keeps and logs, the sampler/trainer mismatch made on purpose (a bf16 sampling copy), micro-batching invariance
of each loss aggregation, and the combinations that are refused. The math itself: tests/test_rlvr_math.py."""
import pytest
import torch

import train_ppo
from conftest import write_jsonl
from numerics import FLOAT32_ATOL  # float32 values of order one: see tests/numerics.py
from nano_rlhf.model import GPT
from test_ppo import main_exit, metrics, ppo_args

REWARD = '''def score(prompts, completions):
    """Flat (no signal) on prompts that mention 'flat'; otherwise the completion's length, which differs
    between samples almost always."""
    return [0.0 if "flat" in p else float(len(c)) for p, c in zip(prompts, completions)]
'''


def grpo(tmp_path, sft_dir, rm_dir, out, *extra, steps=2):
    return ppo_args(tmp_path, sft_dir, rm_dir, out, "--advantage", "grpo", "--samples_per_prompt", "4", *extra,
                    steps=steps)


@pytest.mark.parametrize("extra", [
    ["--policy_loss", "gspo", "--clip_eps", "3e-4", "--clip_high", "4e-4", "--overlong", "mask",
     "--missing_eos_penalty", "none", "--kl_in_loss", "--kl_loss_estimator", "k2"],
    ["--policy_loss", "cispo", "--clip_high", "0.28", "--overlong", "penalty", "--overlong_buffer", "4",
     "--missing_eos_penalty", "none", "--rollout_dtype", "bfloat16", "--rollout_correction", "tis",
     "--correction_level", "sequence"],
    ["--policy_loss", "dual_clip", "--loss_agg", "seq_mean_token_mean", "--rollout_dtype", "bfloat16",
     "--rollout_correction", "mask", "--correction_cap", "1.5", "--kl_estimator", "k2", "--advantage",
     "reinforce_pp"],
], ids=["gspo-overlong-mask-k2-loss", "cispo-overlong-penalty-tis-sequence", "dual-clip-seqmean-mask-k2"])
def test_variants_end_to_end(tmp_path, sft_dir, rm_dir, extra):
    out = train_ppo.main(grpo(tmp_path, sft_dir, rm_dir, "run", *extra))
    m = metrics(tmp_path / "run")
    assert len(m) == 2 and all(torch.isfinite(torch.tensor(x["train/policy_loss"])) for x in m)
    if "--rollout_correction" in extra:
        # the bf16 sampling copy and the float32 trainer disagree: the mismatch is measured, not zero
        assert all(x["train/sampler_abs_logratio"] > 0 and 0 <= x["train/correction_hit"] <= 1 for x in m)
    moved = GPT.from_pretrained(sft_dir).state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in out.policy.state_dict().items())


def test_a_correction_of_float32_rollouts_is_refused(tmp_path, sft_dir, rm_dir, capsys):
    """With float32 sampling the sampler is the trainer (every weight would be exactly 1): --rollout_correction
    would do nothing, so it is refused before anything is read."""
    with pytest.raises(SystemExit) as e:
        train_ppo.main(grpo(tmp_path, sft_dir, rm_dir, "run", "--rollout_correction", "tis", steps=1))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: --rollout_correction applies only with --rollout_dtype other "
                                                "than float32 (got float32)"), err
    assert not (tmp_path / "run").exists()


def test_dynamic_sampling_keeps_only_groups_with_signal(tmp_path, sft_dir, rm_dir):
    """Half the prompts give every sample the same reward: dynamic sampling logs that share of the first
    round, samples more, and trains on groups with spread only; with only flat prompts it stops at the cap
    and fills the batch with them (counted)."""
    (tmp_path / "rw.py").write_text(REWARD)
    rows = [{"prompt": f"flat question {i}" if i % 2 else f"question {i}"} for i in range(64)]
    write_jsonl(tmp_path / "mixed.jsonl", rows)
    write_jsonl(tmp_path / "flat.jsonl", [{"prompt": f"flat question {i}"} for i in range(64)])
    write_jsonl(tmp_path / "ev.jsonl", rows[:4])
    kept = []
    real = train_ppo.with_logprobs

    def spy(r, *a, **k):            # what the update trains on
        kept.append(r.scores.clone())
        return real(r, *a, **k)
    train_ppo.with_logprobs = spy
    try:
        for name, prompts in (("mixed", "mixed.jsonl"), ("flat", "flat.jsonl")):
            train_ppo.main(grpo(tmp_path, sft_dir, rm_dir, name, "--dynamic_sampling", "--max_sampling_rounds", "6",
                                "--reward", f"{tmp_path / 'rw.py'}:score", "--prompts", str(tmp_path / prompts),
                                "--eval_prompts", str(tmp_path / "ev.jsonl"), "--kl_coef", "0",
                                "--missing_eos_penalty", "none", steps=2))
    finally:
        train_ppo.with_logprobs = real
    mixed, flat = metrics(tmp_path / "mixed"), metrics(tmp_path / "flat")
    assert len(kept) == 4 and all(s.shape == (16,) for s in kept)       # always a full batch: 4 groups of 4
    assert all(bool(train_ppo.group_spread(s, 4).all()) for s in kept[:2])   # mixed: only groups with signal
    assert not any(bool(train_ppo.group_spread(s, 4).any()) for s in kept[2:])
    for x in mixed:   # shuffled batches of 4 prompts, half of all prompts flat
        assert x["train/zero_spread_groups"] in (0, 0.25, 0.5, 0.75, 1) and x["train/filled_groups"] == 0
        assert x["train/sampling_rounds"] >= 1 + (x["train/zero_spread_groups"] > 0)
    assert sum(x["train/zero_spread_groups"] for x in mixed) > 0
    for x in flat:
        assert x["train/zero_spread_groups"] == 1 and x["train/sampling_rounds"] == 6
        assert x["train/filled_groups"] == 4 and x["train/policy_loss"] == 0


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_do_not_change_the_update(tmp_path, sft_dir, rm_dir, agg):
    """A minibatch of 16 sequences as one micro-batch or as 8 of 2: the same loss, so (within float32
    rounding of a different summation order) the same weights after two steps, for every aggregation."""
    common = ("--loss_agg", agg, "--num_minibatches", "1", "--ppo_epochs", "1", "--kl_coef", "0")
    a = train_ppo.main(grpo(tmp_path, sft_dir, rm_dir, "whole", *common))
    b = train_ppo.main(grpo(tmp_path, sft_dir, rm_dir, "micro", *common, "--micro_batch_size", "2"))
    sa, sb = a.policy.state_dict(), b.policy.state_dict()
    # AdamW's first steps move each weight by about lr = 1e-3 whatever the gradient's size, so gradients equal up
    # to float32 rounding give weights equal to far below that; a different aggregation would move them apart
    assert all(torch.allclose(sa[k], sb[k], atol=FLOAT32_ATOL, rtol=0) for k in sa)
    assert metrics(tmp_path / "whole")[0]["train/policy_loss"] == pytest.approx(
        metrics(tmp_path / "micro")[0]["train/policy_loss"], abs=FLOAT32_ATOL)


@pytest.mark.parametrize("extra, message", [
    (["--policy_loss", "gspo"], "--policy_loss gspo weighs whole sequences"),
    (["--dynamic_sampling"], "--dynamic_sampling applies only with --advantage rloo or grpo or dr_grpo"),
    (["--advantage", "grpo", "--samples_per_prompt", "2", "--overlong", "mask"], "pass --missing_eos_penalty none"),
    (["--kl_loss_estimator", "k2"], "--kl_loss_estimator applies only with --kl_in_loss"),
    (["--advantage", "grpo", "--samples_per_prompt", "2", "--overlong", "penalty", "--missing_eos_penalty", "none",
      "--overlong_buffer", "99"], "--overlong_buffer 99 is longer than --max_new_tokens"),
    (["--dual_clip", "1"], "--dual_clip must be > 1"),
    (["--correction_cap", "0.5"], "--correction_cap must be > 1"),
])
def test_refused_combinations_are_one_line(tmp_path, sft_dir, rm_dir, capfd, extra, message):
    """main() in this process (test_ppo.test_a_bad_flag_is_one_line_from_the_shell runs a whole process)."""
    code, err = main_exit(capfd, ppo_args(tmp_path, sft_dir, rm_dir, "x", *extra))
    assert code != 0 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "x").exists()
