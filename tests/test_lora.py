"""LoRA (nano_rlhf/lora.py): exact at step 0, only adapters train, the base is untouched and recoverable,
merging is exact and exports a plain HF model, the PEFT layout loads in peft."""
import copy
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import tiny_config, tiny_model
from numerics import FLOAT32_ATOL  # float32 values of order one: see tests/numerics.py

from nano_rlhf.lora import (Adapters, BaseView, LoRALinear, adapter_state_dict, adapters_disabled, apply_lora,
                            checkpointed, lora_modules, lora_parameters, merge_lora, merged_copy, parse_targets,
                            save_peft_adapter, trainable_and_frozen_bytes)
from nano_rlhf.model import ScoreModel

pytestmark = pytest.mark.numeric     # also run under ATEN_CPU_CAPABILITY=default by .ci/run

R, ALPHA = 4, 8.0


def ids(B=3, T=12, V=300, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def randomize_adapters(model, seed=1):
    """B = 0 at init makes every adapter a no-op; give B values so the tests see a real update."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)


def lm_loss(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def test_layer_is_its_formula():
    torch.manual_seed(0)
    lin = nn.Linear(6, 5)
    m = LoRALinear(lin, r=2, alpha=3.0)
    nn.init.normal_(m.lora_B)
    x = torch.randn(4, 6)
    want = lin(x) + x @ m.lora_A.T @ m.lora_B.T * (3.0 / 2)
    assert torch.allclose(m(x), want, atol=1e-6)
    assert torch.allclose(F.linear(x, m.weight, m.bias), want, atol=1e-6)   # the .weight property agrees
    assert m.lora_A.shape == (2, 6) and m.lora_B.shape == (5, 2)


def test_step0_logits_equal_base():
    base = tiny_model()
    model = copy.deepcopy(base)
    names = apply_lora(model, R, ALPHA)
    assert names == [f"transformer.h.{i}.{s}" for i in range(2) for s in ("attn.c_attn", "attn.c_proj",
                                                                            "mlp.c_fc", "mlp.c_proj")]
    x = ids()
    assert torch.equal(model(x), base(x))


def test_only_adapters_trainable_and_in_optimizer():
    model = tiny_model()
    apply_lora(model, R, ALPHA, targets=("c_attn", "c_fc"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"transformer.h.{i}.{s}.lora_{ab}" for i in range(2) for s in ("attn.c_attn", "mlp.c_fc")
                         for ab in "AB"}
    opt = torch.optim.AdamW(lora_parameters(model))
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in model.parameters() if p.requires_grad}
    assert set(adapter_state_dict(model)) == trainable


def test_training_leaves_base_bit_identical():
    base = tiny_model()
    model = copy.deepcopy(base)
    apply_lora(model, R, ALPHA, dropout=0.1)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    model.train()
    x = ids(B=4, T=16)
    first = None
    for _ in range(5):
        loss = lm_loss(model, x)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert lm_loss(model, x).item() < first                          # the adapters did learn
    sd = model.state_dict()
    for k, v in before.items():   # c_attn.weight now lives at c_attn.base.weight
        key = k if k in sd else k.replace(".weight", ".base.weight").replace(".bias", ".base.bias")
        assert torch.equal(sd[key], v), key
    assert any(m.lora_B.abs().sum() > 0 for _, m in lora_modules(model))


def test_adapters_disabled_is_the_base_model():
    base = tiny_model()
    model = copy.deepcopy(base)
    apply_lora(model, R, ALPHA)
    randomize_adapters(model)
    x = ids()
    adapted = model(x)
    assert not torch.allclose(adapted, base(x))
    with adapters_disabled(model):
        assert torch.equal(model(x), base(x))
    assert torch.equal(model(x), adapted)                             # switched back on afterwards
    with pytest.raises(ValueError, match="no LoRA adapters"):
        with adapters_disabled(base):
            pass


def test_merge_is_exact():
    model = tiny_model()
    apply_lora(model, R, ALPHA)
    randomize_adapters(model)
    x = ids()
    adapted = model(x)
    expect = {n: m.base.weight.detach() + (m.lora_B.detach() @ m.lora_A.detach()) * (ALPHA / R)
              for n, m in lora_modules(model)}
    merge_lora(model)
    assert not lora_modules(model)
    for n, w in expect.items():
        mod = model.get_submodule(n)
        assert type(mod) is nn.Linear and torch.equal(mod.weight, w), n
    assert all(p.requires_grad for p in model.parameters())
    assert torch.allclose(model(x), adapted, atol=FLOAT32_ATOL)


def test_merged_copy_leaves_adapters():
    model = tiny_model()
    apply_lora(model, R, ALPHA)
    randomize_adapters(model)
    x = ids()
    adapted = model(x)
    plain = merged_copy(model)
    assert not lora_modules(plain) and len(lora_modules(model)) == 8
    assert torch.equal(model(x), adapted) and torch.allclose(plain(x), adapted, atol=FLOAT32_ATOL)


def test_merged_model_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_model()
    apply_lora(model, R, ALPHA)
    randomize_adapters(model)
    x = ids()
    adapted = model(x)
    merge_lora(model).save_pretrained(str(tmp_path))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, adapted, atol=1e-4)


def test_bad_target_names_it():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"'q_proj'.*c_attn"):
        apply_lora(model, R, ALPHA, targets=("c_attn", "q_proj"))
    with pytest.raises(ValueError, match="'head'"):
        apply_lora(model, R, ALPHA, trainable=("head",))
    assert all(p.requires_grad for p in model.parameters())           # nothing was changed by the failed calls
    apply_lora(model, R, ALPHA)
    with pytest.raises(ValueError, match="already"):
        apply_lora(model, R, ALPHA)


def test_score_model_keeps_head_trainable():
    torch.manual_seed(0)
    rm = ScoreModel(tiny_config()).eval()
    apply_lora(rm, R, ALPHA, trainable=("score",))
    assert rm.score.weight.requires_grad and not rm.transformer.wte.weight.requires_grad
    assert any(p is rm.score.weight for p in lora_parameters(rm))
    assert "score.weight" in adapter_state_dict(rm)
    head = rm.score.weight.detach().clone()
    opt = torch.optim.AdamW(lora_parameters(rm), lr=1e-2)
    x = ids()
    for _ in range(3):
        _, end = rm(x)
        loss = (end - 1.0).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not torch.equal(rm.score.weight, head)
    # the end-only path reads c_attn.weight directly: it must see the adapted weight, not the base one
    mask = torch.ones_like(x)
    mask[0, -3:] = 0
    with torch.no_grad():
        _, full = rm(x, mask)
        _, end_only = rm(x, mask, end_only=True)
    assert torch.allclose(full, end_only, atol=FLOAT32_ATOL)


def test_peft_key_names_llama_style(tmp_path):
    """Llama-family names (a stand-in module tree named like HF's): nn.Linear layout, fan_in_fan_out false."""
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()

    class Trunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer()])

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Trunk()

    toy = Toy()
    assert apply_lora(toy, 2, 4) == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"]
    save_peft_adapter(toy, str(tmp_path), "some/llama")
    from safetensors.torch import load_file
    keys = sorted(load_file(str(tmp_path / "adapter_model.safetensors")))
    assert keys[0] == "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight" and len(keys) == 4
    cfg = json.load(open(tmp_path / "adapter_config.json"))
    assert cfg["fan_in_fan_out"] is False and cfg["target_modules"] == ["o_proj", "q_proj"]


def test_peft_loads_our_adapter(tmp_path):
    """peft.PeftModel on transformers' GPT-2 + our adapter directory == our adapted model."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    model = tiny_model()
    model.save_pretrained(base_dir)
    apply_lora(model, R, ALPHA, dropout=0.05)
    randomize_adapters(model)
    model.eval()
    save_peft_adapter(model, adapter_dir, base_dir)
    cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert cfg["fan_in_fan_out"] is True and cfg["peft_type"] == "LORA" and cfg["r"] == R
    hf = transformers.GPT2LMHeadModel.from_pretrained(base_dir)
    pm = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    x = ids()
    with torch.no_grad():
        assert torch.allclose(pm(x).logits, model(x), atol=FLOAT32_ATOL)
        with pm.disable_adapter():
            with adapters_disabled(model):
                assert torch.allclose(pm(x).logits, model(x), atol=FLOAT32_ATOL)


def test_peft_loads_our_reward_adapter(tmp_path):
    """SEQ_CLS with the score head as a module to save: PEFT restores the trained head too."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    torch.manual_seed(0)
    rm = ScoreModel(tiny_config(pad_token_id=0)).eval()
    rm.save_pretrained(base_dir)
    apply_lora(rm, R, ALPHA, targets=("c_attn",), trainable=("score",))
    randomize_adapters(rm)
    with torch.no_grad():
        rm.score.weight.mul_(-2.0)
    save_peft_adapter(rm, adapter_dir, base_dir, task_type="SEQ_CLS")
    hf = transformers.GPT2ForSequenceClassification.from_pretrained(base_dir)
    pm = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    x = ids().clamp(min=1)                                            # no pad ids: HF scores the last token
    with torch.no_grad():
        assert torch.allclose(pm(x).logits.squeeze(-1), rm(x)[1], atol=FLOAT32_ATOL)


def test_trainable_and_frozen_bytes():
    model = tiny_model()
    total = sum(p.numel() for p in model.parameters()) * 4
    assert trainable_and_frozen_bytes(model) == (total, 0)
    apply_lora(model, R, ALPHA, targets=("c_attn",))
    # per layer: A (r, 32) and B (96, r), float32
    adapters = 2 * (R * 32 + 96 * R) * 4
    assert trainable_and_frozen_bytes(model) == (adapters, total)


def test_base_view_runs_the_base_in_eval_mode_and_restores():
    base = tiny_model(dropout=0.5)                                    # dropout: train mode would be random
    model = copy.deepcopy(base).train()
    apply_lora(model, R, ALPHA, dropout=0.1)
    randomize_adapters(model)
    view = BaseView(model)
    x = ids()
    with torch.no_grad():
        assert torch.equal(view(x), base.eval()(x))
        assert torch.equal(view.hidden_states(x), base.hidden_states(x))  # methods run with adapters off too
    assert model.training and all(m.training for m in model.modules())  # modes and switches restored
    assert all(m.enabled for _, m in lora_modules(model))
    assert view.to("cpu") is view and view.eval() is view and view.cfg is model.cfg
    assert [id(p) for p in view.parameters()] == [id(p) for p in model.parameters()]    # none of its own
    rm = ScoreModel(tiny_config())
    apply_lora(rm, R, ALPHA, trainable=("score",))
    with pytest.raises(ValueError, match="fully trained"):
        BaseView(rm)                            # a trained head is not reverted: adapters off is not the base
    with pytest.raises(ValueError, match="no LoRA"):
        BaseView(tiny_model())


def test_adapters_checkpoint_round_trip_and_mismatch():
    model = tiny_model()
    assert checkpointed(model) is model                               # no LoRA: the model itself
    apply_lora(model, R, ALPHA)
    randomize_adapters(model, seed=1)
    saved = checkpointed(model).state_dict()
    assert set(saved) == set(adapter_state_dict(model)) and all(".lora_" in k for k in saved)
    other = tiny_model()
    apply_lora(other, R, ALPHA)
    Adapters(other).load_state_dict(saved)
    x = ids()
    assert torch.equal(other(x), model(x))
    with pytest.raises(RuntimeError, match="missing"):
        Adapters(other).load_state_dict({k: v for k, v in saved.items() if "h.0." not in k})
    small = tiny_model()
    apply_lora(small, 2, ALPHA)
    with pytest.raises(RuntimeError, match="shape"):
        Adapters(small).load_state_dict(saved)


def test_parse_targets():
    assert parse_targets("") is None and parse_targets("  ") is None
    assert parse_targets("c_attn, c_fc,c_attn") == ("c_attn", "c_fc")
    with pytest.raises(ValueError, match="'attn'"):
        parse_targets("c_attn,attn")
    with pytest.raises(ValueError, match="empty name"):
        parse_targets("c_attn,")
