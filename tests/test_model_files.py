"""Bad model directories: every case is one ValueError/FileNotFoundError line naming the file, raised before the
model is built (the config is checked against the weights' headers, so nothing large is ever allocated)."""
import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import nano_rlhf.model as M
from nano_rlhf.model import GPT, GPTConfig, ScoreModel


def llama_cfg(**kw):
    d = dict(model_type="qwen2", vocab_size=96, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
             intermediate_size=48, attention_bias=True, eos_token_id=0, pad_token_id=1)
    d.update(kw)
    return GPTConfig(**d)


@pytest.fixture(params=["gpt2", "qwen2"])
def model_dir(request, tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, n_layer=2, n_head=2, n_embd=32) if request.param == "gpt2" else llama_cfg()
    GPT(cfg).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def edit_config(d, **changes):
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))


def fails(d, match, exc=ValueError, cls=GPT, **kw):
    """from_pretrained raises exc with one line matching `match` and naming a file of the directory."""
    with pytest.raises(exc) as e:
        cls.from_pretrained(d, **kw)
    msg = str(e.value)
    assert "\n" not in msg and str(d) in msg, msg
    assert re.search(match, msg), msg
    return msg


@pytest.mark.parametrize("keep", [0, 5, 100, -40])
def test_empty_or_truncated_weights(model_dir, keep):
    p = model_dir / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    fails(model_dir, r"model\.safetensors: .*(truncated|not a safetensors|corrupt)")


def test_corrupt_header(model_dir):
    p = model_dir / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[8:12] = b"\xff\xfe{["
    p.write_bytes(bytes(data))
    fails(model_dir, "corrupt safetensors header")


@pytest.mark.parametrize("text, match", [("{not json", r"config\.json: invalid JSON"),
                                          ("[1, 2]", r"config\.json: expected a JSON object, got a list"),
                                          ("", r"config\.json: invalid JSON")])
def test_config_not_a_json_object(model_dir, text, match):
    (model_dir / "config.json").write_text(text)
    fails(model_dir, match)


def test_missing_files(model_dir):
    (model_dir / "model.safetensors").unlink()
    fails(model_dir, r"model\.safetensors: missing", FileNotFoundError)
    (model_dir / "config.json").unlink()
    fails(model_dir, r"config\.json: missing", FileNotFoundError)


@pytest.mark.parametrize("field, value, match", [
    ("layers", "4", r"must be a positive integer, got '4'"),
    ("layers", 0, r"must be a positive integer, got 0"),
    ("heads", -2, r"must be a positive integer, got -2"),
    ("heads", 0, r"must be a positive integer, got 0"),
    ("width", 1e9, r"must be a positive integer, got 1000000000.0"),
    ("vocab", None, r"must be a positive integer, got None"),
])
def test_config_field_types(model_dir, field, value, match):
    gpt2 = json.loads((model_dir / "config.json").read_text())["model_type"] == "gpt2"
    key = {"layers": ("n_layer", "num_hidden_layers"), "heads": ("n_head", "num_attention_heads"),
           "width": ("n_embd", "hidden_size"), "vocab": ("vocab_size", "vocab_size")}[field][0 if gpt2 else 1]
    edit_config(model_dir, **{key: value})
    fails(model_dir, rf"config\.json: {key} " + match)


def test_n_head_not_dividing_n_embd(tmp_path):
    GPT(GPTConfig(vocab_size=96, n_layer=2, n_head=2, n_embd=32)).save_pretrained(tmp_path)
    edit_config(tmp_path, n_head=3)
    fails(tmp_path, r"config\.json: n_head 3 does not divide n_embd 32")
    with pytest.raises(ValueError, match="n_head 3 does not divide"):
        GPT(GPTConfig(n_head=3, n_embd=32))


@pytest.mark.parametrize("family, key, value, match", [
    ("gpt2", "n_layer", 100000, r"says 100000 layers \(0\.\.99999\) but .*model\.safetensors holds 2$"),
    ("qwen2", "num_hidden_layers", 100000, r"says 100000 layers \(0\.\.99999\) but .*model\.safetensors holds 2$"),
    ("gpt2", "n_embd", 1_000_000_000, r"transformer\.wte\.weight has shape \[96, 32\] but .* implies \[96, 1000000000\]"),
    ("qwen2", "hidden_size", 1_000_000_000, r"model\.embed_tokens\.weight has shape \[96, 32\] .* implies \[96, 1000000000\]"),
    ("gpt2", "vocab_size", 50_000_000, r"wte\.weight has shape \[96, 32\] .* implies \[50000000, 32\]"),
    ("qwen2", "vocab_size", 50_000_000, r"embed_tokens\.weight has shape \[96, 32\] .* implies \[50000000, 32\]"),
])
def test_absurd_sizes_fail_before_any_model_is_built(tmp_path, monkeypatch, family, key, value, match):
    model_dir = tmp_path / "m"
    GPT(GPTConfig(vocab_size=96, n_layer=2, n_head=2, n_embd=32) if family == "gpt2" else llama_cfg()).save_pretrained(model_dir)
    edit_config(model_dir, **{key: value})

    def never(*a, **k):
        raise AssertionError("a model was built from a config the weights contradict")
    monkeypatch.setattr(M.GPT, "__init__", never)
    monkeypatch.setattr(M.ScoreModel, "__init__", never)
    t = time.time()
    fails(model_dir, match)
    fails(model_dir, match, cls=ScoreModel, new_head=True)
    assert time.time() - t < 2.0


def test_layers_numbered_off_the_config_say_which(tmp_path):
    """2 layers in the config and 2 in the file, numbered 0 and 5: the message names the numbers (it used to say
    "the config says 2 layers but ... holds 2")."""
    from safetensors.torch import load_file, save_file
    GPT(GPTConfig(vocab_size=96, n_layer=2, n_head=2, n_embd=32)).save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    save_file({k.replace("h.1.", "h.5."): v for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    fails(tmp_path, r"says 2 layers \(0\.\.1\) but .*model\.safetensors holds layers numbered \[0, 5\]")


def test_shape_mismatch_names_the_key_and_both_shapes(tmp_path):
    GPT(llama_cfg()).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(40, 32)
    save_file(sd, tmp_path / "model.safetensors")
    fails(tmp_path, r"model\.layers\.1\.mlp\.up_proj\.weight has shape \[40, 32\] but the config .* implies \[48, 32\]")


def test_missing_and_unexpected_keys(model_dir):
    sd = load_file(model_dir / "model.safetensors")
    name = next(k for k in sd if ".1." in k and k.endswith("weight"))
    save_file({k: v for k, v in sd.items() if k != name}, model_dir / "model.safetensors")
    fails(model_dir, rf"missing 1 \['{name}'\], unexpected 0")
    save_file(dict(sd, extra=torch.zeros(3)), model_dir / "model.safetensors")
    fails(model_dir, r"missing 0 \[\], unexpected 1 \['(transformer\.)?extra'\]")


def test_unsupported_dtype(model_dir):
    sd = load_file(model_dir / "model.safetensors")
    k = next(iter(sd))
    sd[k] = sd[k].to(torch.int8)
    save_file(sd, model_dir / "model.safetensors")
    fails(model_dir, rf"{k} is stored as I8")


def test_overrides_are_checked(model_dir):
    fails(model_dir, r"n_layer must be a positive integer", n_layer=0)


@pytest.mark.parametrize("change, match", [
    ({"use_sliding_window": True}, r"use_sliding_window=true: sliding-window attention is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types .*only full_attention"),
    ({"num_experts": 8}, r"num_experts=8: mixture-of-experts models are not supported"),
    ({"num_local_experts": 4}, r"num_local_experts=4: mixture-of-experts"),
    ({"model_type": "mistral"}, r"model_type 'mistral' is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"rope_type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, r"factor must be a number, got None"),
    ({"mlp_bias": True}, r"mlp_bias=true is not supported"),
])
def test_unsupported_llama_family_configs(tmp_path, change, match):
    GPT(llama_cfg()).save_pretrained(tmp_path)
    edit_config(tmp_path, **change)
    fails(tmp_path, r"config\.json: " + match)


def drop_config_keys(d, *keys):
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in c.items() if k not in keys}))


def family_cfg(family):
    return llama_cfg(model_type=family, attention_bias=family == "qwen2", qk_norm=family == "qwen3")


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "qwen3"])
def test_config_without_model_type_is_read_by_its_architectures(tmp_path, family):
    """No model_type: the family comes from architectures (never GPT-2 by default: a Llama config read as GPT-2
    failed with 'the config says 12 layers but ... holds 0'); the model loads with the same weights."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, n_layer=2, n_head=2, n_embd=32) if family == "gpt2" else family_cfg(family)
    m = GPT(cfg)
    m.save_pretrained(tmp_path)
    drop_config_keys(tmp_path, "model_type")
    got = GPT.from_pretrained(tmp_path)
    assert got.cfg.model_type == family
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), m.state_dict().values()))
    if family == "gpt2":      # GPT-2's own keys (n_embd, n_layer): configs older than model_type
        drop_config_keys(tmp_path, "architectures")
        assert GPT.from_pretrained(tmp_path).cfg.model_type == "gpt2"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_llama_config_without_model_type_or_architectures_is_refused(tmp_path, family):
    """Llama-style keys alone cannot tell llama from qwen2/qwen3: one line naming model_type, not GPT-2."""
    GPT(family_cfg(family)).save_pretrained(tmp_path)
    drop_config_keys(tmp_path, "model_type", "architectures")
    fails(tmp_path, r"config\.json: no model_type \(nor architectures\): its keys \(hidden_size.*add \"model_type\"")
    edit_config(tmp_path, architectures=["MistralForCausalLM"])
    fails(tmp_path, r"config\.json: no model_type, and architectures \['MistralForCausalLM'\] name no one supported")
    (tmp_path / "config.json").write_text("{}")
    fails(tmp_path, r"config\.json: no model_type \(nor architectures, nor any size key\)")


def test_sharded_index_problems(tmp_path):
    GPT(llama_cfg()).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:5]}, tmp_path / "a.safetensors")
    save_file({k: sd[k] for k in keys[5:]}, tmp_path / "b.safetensors")
    (tmp_path / "model.safetensors").unlink()
    wmap = {k: "a.safetensors" if i < 5 else "b.safetensors" for i, k in enumerate(keys)}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    assert torch.equal(GPT.from_pretrained(tmp_path).model.norm.weight, sd["model.norm.weight"])
    index.write_text(json.dumps({"weight_map": dict(wmap, **{keys[0]: "b.safetensors"})}))
    fails(tmp_path, rf"index\.json: {keys[0]} is mapped to b\.safetensors, which does not hold it")
    index.write_text(json.dumps({"weight_map": dict(wmap, **{keys[0]: "c.safetensors"})}))
    fails(tmp_path, r"c\.safetensors: missing \(listed in", FileNotFoundError)
    index.write_text("{")
    fails(tmp_path, r"index\.json: invalid JSON")


def test_stale_buffers_are_ignored_and_biasless_gpt2_round_trips(tmp_path):
    """Older Llama checkpoints store rotary_emb.inv_freq; a bias-free GPT-2 is written with zero biases (HF
    GPT-2 always has them) and read back without them; a non-zero one is refused."""
    torch.manual_seed(0)
    m = GPT(llama_cfg())
    m.save_pretrained(tmp_path / "l")
    sd = load_file(tmp_path / "l" / "model.safetensors")
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(sd, tmp_path / "l" / "model.safetensors")
    assert torch.equal(GPT.from_pretrained(tmp_path / "l").model.embed_tokens.weight, m.model.embed_tokens.weight)
    g = GPT(GPTConfig(vocab_size=96, n_layer=2, n_head=2, n_embd=32, bias=False))
    g.save_pretrained(tmp_path / "g")
    sd = load_file(tmp_path / "g" / "model.safetensors")
    assert not sd["transformer.h.0.ln_1.bias"].any()
    back = GPT.from_pretrained(tmp_path / "g")
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), g.state_dict().values()))
    sd["transformer.h.1.mlp.c_fc.bias"] += 1
    save_file(sd, tmp_path / "g" / "model.safetensors")
    fails(tmp_path / "g", r"transformer\.h\.1\.mlp\.c_fc\.bias is not zero but the config has no biases")
