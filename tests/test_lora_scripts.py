"""--lora_r in the four scripts, end to end on tiny models: the base stays bit-identical, only adapters (and a
score head) are optimised, the merged export is base + (alpha / r) B A exactly and loads in transformers (and the
adapter in peft) with the adapted model's logits, DPO's and PPO's reference is the policy with its adapters off
(DPO's first loss is log 2 with zero margin), resume is exact and refuses another base, bad flags are one line."""
import json
import math
import os
import shutil

import pytest
import torch
from conftest import gae_only, pref_rows, prompt_rows, run, sft_rows, tiny_model, unpaired_rows, weights_close, write_jsonl
from numerics import FLOAT32_ATOL  # float32 values of order one: see tests/numerics.py
from safetensors.torch import load_file

import train_dpo
import train_ppo
import train_rm
import train_sft
import train_unpaired
from nano_rlhf import dist
from nano_rlhf.lora import BaseView, lora_modules, lora_parameters
from nano_rlhf.model import GPT, ScoreModel

R, ALPHA = 4, 8.0
LORA = ["--lora_r", str(R), "--lora_alpha", str(ALPHA)]


def ids(B=3, T=10, V=200, seed=0):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def base_state(model):
    """The model's tensors with the adapters left out, under the plain model's key names."""
    return {k.replace(".base.", "."): v for k, v in dist.unwrap(model).state_dict().items() if ".lora_" not in k}


def assert_base_untouched(model, fresh, skip=()):
    got, want = base_state(model), fresh.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        if k not in skip:
            assert torch.equal(got[k], v), k


def assert_only_adapters_optimised(model, optimizer, head=()):
    in_opt = [p for g in optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in in_opt} == {id(p) for p in lora_parameters(model)}
    assert {id(p) for p in in_opt} == {id(p) for p in model.parameters() if p.requires_grad}
    named = {id(p): n for n, p in model.named_parameters()}
    assert {named[id(p)] for p in in_opt if ".lora_" not in named[id(p)]} == set(head)
    assert any(m.lora_B.abs().sum() > 0 for _, m in lora_modules(model))          # the adapters did train


def assert_merged_export_exact(model, out_dir, cls=GPT):
    """out_dir's model == base + (alpha / r) B A, layer by layer and bit for bit; same logits as `model`."""
    merged = cls.from_pretrained(str(out_dir)).eval()
    mods = lora_modules(model)
    assert len(mods) > 0 and not lora_modules(merged)
    for name, m in mods:
        want = m.base.weight.detach() + (m.lora_B.detach() @ m.lora_A.detach()) * (ALPHA / R)
        assert torch.equal(merged.get_submodule(name).weight, want), name
    model.eval()
    x = ids()
    with torch.no_grad():
        a, b = (model(x), merged(x)) if cls is GPT else (model(x)[1], merged(x)[1])
    assert torch.allclose(a, b, atol=FLOAT32_ATOL)
    return merged


def hf_logits_match(model, out_dir, base_dir, kind="lm"):
    """transformers loads the merged directory, and peft our adapter over the base directory, with the
    adapted model's logits (scores for a reward model)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cls = transformers.GPT2LMHeadModel if kind == "lm" else transformers.GPT2ForSequenceClassification
    x = ids()
    with torch.no_grad():
        ours = model(x) if kind == "lm" else model(x)[1]
        merged = cls.from_pretrained(str(out_dir)).eval()(x).logits
        # a reward model's base is an SFT (causal LM) directory: transformers then needs num_labels=1 to build
        # the one-score head that PEFT's modules_to_save overwrites with ours
        base = cls.from_pretrained(base_dir) if kind == "lm" else cls.from_pretrained(base_dir, num_labels=1)
        adapted = peft.PeftModel.from_pretrained(base, str(out_dir / "adapter")).eval()(x).logits
    if kind != "lm":
        merged, adapted = merged.squeeze(-1), adapted.squeeze(-1)
    assert torch.allclose(merged, ours, atol=FLOAT32_ATOL) and torch.allclose(adapted, ours, atol=FLOAT32_ATOL)
    cfg = json.load(open(out_dir / "adapter" / "adapter_config.json"))
    assert cfg["r"] == R and cfg["lora_alpha"] == ALPHA and cfg["base_model_name_or_path"] == base_dir


# ---- the four scripts' arguments -------------------------------------------------------------------

def sft_args(tmp_path, init, out, *extra, steps=3):
    data = tmp_path / "sft.jsonl"
    if not data.exists():
        write_jsonl(data, sft_rows(48))
    return ["--init", init, "--data", str(data), "--out_dir", str(tmp_path / out), "--max_steps", str(steps),
            "--batch_size", "8", "--lr", "1e-2", "--warmup_steps", "0", "--log_interval", "1", "--eval_interval", "0",
            *extra]


def rm_args(tmp_path, init, out, *extra, steps=3):
    data = tmp_path / "pref.jsonl"
    if not data.exists():
        write_jsonl(data, pref_rows(48))
    return ["--init", init, "--data", str(data), "--out_dir", str(tmp_path / out), "--max_steps", str(steps),
            "--batch_size", "8", "--lr", "1e-2", "--warmup_steps", "0", "--log_interval", "1", "--eval_interval", "0",
            *extra]


def dpo_args(tmp_path, init, out, loss="dpo", *extra, steps=3):
    kind = "unpaired" if loss == "kto" else "pref"
    data = tmp_path / f"{kind}.jsonl"
    if not data.exists():
        write_jsonl(data, unpaired_rows(48) if loss == "kto" else pref_rows(48))
    algo = ["--method", "kto"] if loss == "kto" else ["--loss", loss]       # KTO: train_unpaired.py
    return [*algo, "--init", init, "--data", str(data), "--out_dir", str(tmp_path / out), "--max_steps",
            str(steps), "--batch_size", "4", "--lr", "1e-2", "--warmup_steps", "0", "--log_interval", "1",
            "--eval_interval", "0", *extra]


def ppo_args(tmp_path, init, rm, out, *extra, steps=2):
    data = tmp_path / "prompts.jsonl"
    if not data.exists():
        write_jsonl(data, prompt_rows(16))
    return gae_only(["--init", init, "--reward_model", rm, "--prompts", str(data), "--out_dir", str(tmp_path / out),
                     "--max_steps", str(steps), "--batch_size", "2", "--samples_per_prompt", "2", "--max_new_tokens",
                     "6", "--ppo_epochs", "2", "--lr", "1e-2", "--critic_lr", "1e-2", "--critic_warmup_steps", "0",
                     "--eval_interval", "0", "--missing_eos_penalty", "none", *extra])  # scores that differ


def metrics(path):
    return [json.loads(x) for x in open(path / "metrics.jsonl")]


# ---- end to end, per script ----------------------------------------------------------------------

def test_sft_lora(tmp_path, sft_dir):
    out = train_sft.main(sft_args(tmp_path, sft_dir, "o", *LORA, "--lora_dropout", "0.1"))
    assert_base_untouched(out.model, GPT.from_pretrained(sft_dir))
    assert_only_adapters_optimised(out.model, out.optimizer)
    assert {n.rsplit(".", 1)[-1] for n, _ in lora_modules(out.model)} == {"c_attn", "c_proj", "c_fc"}
    assert_merged_export_exact(out.model, tmp_path / "o")
    hf_logits_match(out.model, tmp_path / "o", sft_dir)
    saved = load_file(str(tmp_path / "o" / "state" / "model_policy.safetensors"))
    assert saved and all(".lora_" in k for k in saved)            # the state holds the adapters, not the base


def test_sft_lora_targets_subset(tmp_path, sft_dir):
    out = train_sft.main(sft_args(tmp_path, sft_dir, "o", *LORA, "--lora_targets", "c_attn, c_fc", steps=1))
    assert sorted({n.rsplit(".", 1)[-1] for n, _ in lora_modules(out.model)}) == ["c_attn", "c_fc"]
    cfg = json.load(open(tmp_path / "o" / "adapter" / "adapter_config.json"))
    assert cfg["target_modules"] == ["c_attn", "c_fc"]


def test_rm_lora_trains_adapters_and_the_head(tmp_path, sft_dir):
    out = train_rm.main(rm_args(tmp_path, sft_dir, "o", *LORA))
    torch.manual_seed(0)                                   # the script's fresh head: a function of --seed 0
    fresh = ScoreModel.from_pretrained(sft_dir, new_head=True)
    assert_base_untouched(out.model, fresh, skip=("score.weight",))
    assert not torch.equal(out.model.score.weight, fresh.score.weight)
    assert_only_adapters_optimised(out.model, out.optimizer, head=("score.weight",))
    assert_merged_export_exact(out.model, tmp_path / "o", ScoreModel)
    cfg = json.load(open(tmp_path / "o" / "config.json"))
    assert "reward_mean" in cfg and "reward_std" in cfg             # PPO's normalisation survives the merge
    hf_logits_match(out.model, tmp_path / "o", sft_dir, kind="score")
    assert json.load(open(tmp_path / "o" / "adapter" / "adapter_config.json"))["modules_to_save"] == ["score"]


@pytest.mark.parametrize("loss", ["dpo", "kto"])
def test_dpo_lora_reference_is_the_policy_with_adapters_off(tmp_path, sft_dir, loss):
    out = (train_unpaired.main if loss == "kto" else train_dpo.main)(dpo_args(tmp_path, sft_dir, "o", loss, *LORA))
    # no second model: the reference is a view of the policy, holding no module of its own
    assert isinstance(out.ref, BaseView) and out.ref.model is dist.unwrap(out.policy)
    assert [v for v in vars(out.ref).values() if isinstance(v, torch.nn.Module)] == [out.ref.model]
    first = metrics(tmp_path / "o")[0]
    if loss == "dpo":       # π = π_ref at step 0 (B = 0): h = 0, so −log σ(0) = log 2 and every reward is 0
        assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert first["train/reward_margin"] == 0.0 and first["train/rewards_chosen"] == 0.0
    else:                   # u = z₀ = 0: 1 − σ(0) = ½ for every example
        assert first["train/loss"] == pytest.approx(0.5, abs=1e-6) and first["train/kl"] == 0.0
    assert metrics(tmp_path / "o")[-1]["train/loss"] != first["train/loss"]
    fresh = GPT.from_pretrained(sft_dir)
    assert_base_untouched(out.policy, fresh)
    assert_only_adapters_optimised(out.policy, out.optimizer if loss == "dpo" else out.optimizers["policy"])
    merged = assert_merged_export_exact(out.policy, tmp_path / "o")
    x = ids()
    with torch.no_grad():    # the reference still gives the base model's logits after training
        assert torch.equal(out.ref(x), fresh.eval()(x)) and not torch.allclose(merged(x), fresh(x))


def test_dpo_lora_with_another_reference_keeps_a_frozen_model(tmp_path, sft_dir):
    other = tmp_path / "ref"
    tiny_model(seed=3, vocab_size=GPT.from_pretrained(sft_dir).cfg.vocab_size).save_pretrained(str(other))
    out = train_dpo.main(dpo_args(tmp_path, sft_dir, "o", "dpo", *LORA, "--ref", str(other), steps=1))
    assert isinstance(out.ref, GPT) and not any(p.requires_grad for p in out.ref.parameters())
    # --ref naming --init itself is the initial model: the view again
    out = train_dpo.main(dpo_args(tmp_path, sft_dir, "o2", "dpo", *LORA, "--ref", sft_dir + "/", steps=1))
    assert isinstance(out.ref, BaseView)


def test_dpo_lora_precomputed_reference_equals_live(tmp_path, sft_dir):
    train_dpo.main(dpo_args(tmp_path, sft_dir, "live", "dpo", *LORA))
    out = train_dpo.main(dpo_args(tmp_path, sft_dir, "pre", "dpo", *LORA, "--precompute_ref"))
    assert out.ref is None
    for a, b in zip(metrics(tmp_path / "live"), metrics(tmp_path / "pre")):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_ppo_lora(tmp_path, sft_dir, rm_dir, estimator):
    out = train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "o", *LORA, "--advantage", estimator))
    assert isinstance(out.ref, BaseView) and out.ref.model is out.policy      # no second policy-sized model
    assert metrics(tmp_path / "o")[0]["train/kl"] == 0.0                    # π = π_ref on the first rollout
    assert_base_untouched(out.policy, GPT.from_pretrained(sft_dir))
    assert_only_adapters_optimised(out.policy, out.optimizers["policy"])
    if estimator == "gae":  # the critic: adapters on the reward model's trunk, its head fully trained
        fresh = ScoreModel.from_pretrained(rm_dir)
        assert_base_untouched(out.critic, fresh, skip=("score.weight",))
        assert not torch.equal(out.critic.score.weight, fresh.score.weight)
        assert_only_adapters_optimised(out.critic, out.optimizers["critic"], head=("score.weight",))
        assert set(load_file(str(tmp_path / "o" / "state" / "model_critic.safetensors"))) == \
            {k for k in out.critic.state_dict() if ".lora_" in k} | {"score.weight"}
    else:
        assert out.critic is None
    assert_merged_export_exact(out.policy, tmp_path / "o")
    assert os.path.isfile(tmp_path / "o" / "adapter" / "adapter_model.safetensors")


def test_ppo_lora_with_zero_kl_has_no_reference(tmp_path, sft_dir, rm_dir):
    out = train_ppo.main(ppo_args(tmp_path, sft_dir, rm_dir, "o", *LORA, "--advantage", "grpo", "--kl_coef", "0",
                                  steps=1))
    assert out.ref is None


@pytest.mark.slow
def test_dpo_lora_ddp_two_ranks_equal_one_process(tmp_path, sft_dir):
    """Under DDP the frozen base is skipped by the gradient all-reduce and the reference (the bare policy with
    adapters off, outside DDP's forward) is the same on every rank: 2 ranks follow 1 process."""
    run(["train_dpo.py"] + dpo_args(tmp_path, sft_dir, "one", "dpo", *LORA, "--batch_size", "4", "--grad_accum", "2"))
    run(["train_dpo.py"] + dpo_args(tmp_path, sft_dir, "two", "dpo", *LORA, "--batch_size", "2", "--grad_accum", "2"),
        nproc=2)
    for f in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert weights_close(*(load_file(str(tmp_path / d / f)) for d in ("one", "two"))), f
    la, lb = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("train/loss", "train/grad_norm", "train/reward_margin"):
        assert [x[key] for x in la] == pytest.approx([x[key] for x in lb], rel=1e-4, abs=1e-7), key


# ---- resume --------------------------------------------------------------------------------------

def _case(script, tmp_path, sft_dir, rm_dir, lora=None):
    """(module, args(out, *extra)) for one script, 4 steps, with `lora` flags (default LORA, with adapter
    dropout for SFT so its RNG stream matters on resume)."""
    if lora is None:
        lora = LORA + (["--lora_dropout", "0.1"] if script == "sft" else [])
    if script == "sft":
        return train_sft, lambda out, *x: sft_args(tmp_path, sft_dir, out, *lora, *x, steps=4)
    if script == "rm":
        return train_rm, lambda out, *x: rm_args(tmp_path, sft_dir, out, *lora, *x, steps=4)
    if script == "dpo":
        return train_dpo, lambda out, *x: dpo_args(tmp_path, sft_dir, out, "dpo", *lora, *x, steps=4)
    return train_ppo, lambda out, *x: ppo_args(tmp_path, sft_dir, rm_dir, out, *lora, *x, steps=4)


@pytest.mark.parametrize("script", ["sft", "rm", "dpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_lora_resume_is_exact(tmp_path, sft_dir, rm_dir, script):
    mod, args = _case(script, tmp_path, sft_dir, rm_dir)
    mod.main(args("straight"))
    mod.main(args("split", "--stop_at", "2"))
    mod.main(args("split", "--resume"))
    for name in os.listdir(tmp_path / "straight" / "state"):
        if name.startswith("model_"):
            a, b = (load_file(str(tmp_path / d / "state" / name)) for d in ("straight", "split"))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("straight", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    timing = ("train/tokens_per_s", "train/step_time", "train/generate_time")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]
    assert strip(metrics(tmp_path / "straight")) == strip(metrics(tmp_path / "split"))


def test_lora_resume_on_another_base_is_refused(tmp_path, sft_dir, capsys):
    base = tmp_path / "base"
    shutil.copytree(sft_dir, base)
    train_sft.main(sft_args(tmp_path, str(base), "o", *LORA, "--stop_at", "1"))
    changed = GPT.from_pretrained(str(base))
    with torch.no_grad():
        changed.transformer.h[0].mlp.c_fc.weight[0, 0] += 1e-3         # one weight of the base differs
    changed.save_pretrained(str(base))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_sft.main(sft_args(tmp_path, str(base), "o", *LORA, "--resume"))
    err = capsys.readouterr().err.strip()
    assert e.value.code != 0 and len(err.splitlines()) == 1
    assert err.startswith("error: --resume:") and "lora_base_checksum" in err


def test_lora_resume_without_lora_is_refused(tmp_path, sft_dir, capsys):
    train_sft.main(sft_args(tmp_path, sft_dir, "o", *LORA, "--stop_at", "1"))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train_sft.main(sft_args(tmp_path, sft_dir, "o", "--resume"))
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lora_r 4 != 0" in err


# ---- bad flags: one line, nothing written ----------------------------------------------------------

@pytest.mark.parametrize("flags, code, needle", [
    (["--lora_r", "-1"], 2, "--lora_r must be >= 0 (got -1)"),
    (["--lora_r", "4", "--lora_alpha", "0"], 2, "--lora_alpha must be > 0"),
    (["--lora_r", "4", "--lora_dropout", "1"], 2, "--lora_dropout must satisfy"),
    (["--lora_r", "4", "--lora_targets", "c_attn,qkv"], 2, "unknown module name 'qkv'"),
    (["--lora_r", "4", "--lora_targets", "c_attn,,c_fc"], 2, "an empty name"),
    (["--lora_targets", "c_attn"], 2, "--lora_targets applies only with --lora_r > 0"),
    (["--lora_r", "4", "--lora_targets", "q_proj"], 1, "--lora_targets: LoRA target 'q_proj' matches no nn.Linear"),
])
@pytest.mark.parametrize("script", ["sft", "rm", "dpo", "ppo"])
def test_bad_lora_flags_are_one_line(tmp_path, sft_dir, rm_dir, capsys, script, flags, code, needle):
    mod, args = _case(script, tmp_path, sft_dir, rm_dir, lora=flags)
    with pytest.raises(SystemExit) as e:
        mod.main(args("bad"))
    err = capsys.readouterr().err.strip()
    assert e.value.code == code and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert needle in err, err
    assert not os.path.exists(tmp_path / "bad")                 # nothing left behind


def test_lora_from_scratch_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_sft.main(["--lora_r", "4", "--out_dir", str(tmp_path / "o")])
    assert e.value.code == 2 and "needs --init" in capsys.readouterr().err


# ---- a Llama-family checkpoint: its projection names, an untied output layer, PEFT's Linear layout --------

def test_sft_lora_on_llama_loads_in_transformers_and_peft(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from hf_fixtures import make_hf_dir
    from hf_fixtures import sft_rows as chat_rows
    init = make_hf_dir(tmp_path / "llama", "llama")
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"
    out = train_sft.main(["--init", init, "--data", str(tmp_path / "chat.jsonl"), "--out_dir", str(tmp_path / "o"),
                          "--max_steps", "2", "--batch_size", "4", "--lr", "1e-2", "--warmup_steps", "0",
                          "--eval_fraction", "0.2", "--eval_interval", "0", "--packing", *LORA,
                          "--lora_targets", targets])
    names = {n.rsplit(".", 1)[-1] for n, _ in lora_modules(out.model)}
    assert names == set(targets.split(","))
    assert_base_untouched(out.model, GPT.from_pretrained(init))
    assert_only_adapters_optimised(out.model, out.optimizer)
    assert_merged_export_exact(out.model, tmp_path / "o")
    cfg = json.load(open(tmp_path / "o" / "adapter" / "adapter_config.json"))
    assert cfg["fan_in_fan_out"] is False and sorted(cfg["target_modules"]) == sorted(names)
    x = torch.randint(0, out.model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = out.model.eval()(x)
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "o")).eval()(x).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(init)
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "o" / "adapter")).eval()(x).logits
    assert torch.allclose(merged, ours, atol=FLOAT32_ATOL) and torch.allclose(adapted, ours, atol=FLOAT32_ATOL)


def test_overwrite_removes_a_lora_runs_adapter(tmp_path, sft_dir):
    train_sft.main(sft_args(tmp_path, sft_dir, "o", *LORA, steps=1))
    assert os.path.isdir(tmp_path / "o" / "adapter")
    train_sft.main(sft_args(tmp_path, sft_dir, "o", "--overwrite", steps=1))     # a full fine-tune now
    assert not os.path.exists(tmp_path / "o" / "adapter")       # no stale adapter beside the new model


def test_lora_grad_checkpoint_gives_the_same_step(tmp_path, sft_dir):
    """Activation checkpointing recomputes the blocks in backward with the base frozen (inputs that need no
    grad): the first step's loss and gradient norm are those without it."""
    train_sft.main(sft_args(tmp_path, sft_dir, "plain", *LORA, steps=1))
    train_sft.main(sft_args(tmp_path, sft_dir, "ckpt", *LORA, "--grad_checkpoint", steps=1))
    a, b = metrics(tmp_path / "plain")[0], metrics(tmp_path / "ckpt")[0]
    assert a["train/grad_norm"] > 0 and a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    assert a["train/loss"] == b["train/loss"]
