"""HF model directories in and out: config.json + model.safetensors (or shards listed in
model.safetensors.index.json), for GPT-2 (GPT2LMHeadModel / GPT2ForSequenceClassification) and the Llama
family (Llama/Qwen2/Qwen3 ForCausalLM / ForSequenceClassification).

Reading checks before building anything: the config's fields and types, then every tensor's name and shape
(from the safetensors headers, without loading a tensor) against the shapes the config implies. So a config
that claims sizes its weights do not have (n_layer 100000) fails in milliseconds with one line naming the file,
instead of allocating the model. Stored weights may be float32, float16 or bfloat16; they load as float32.

Key names are HF's. GPT-2's four Conv1D matrices are stored [in, out] and transposed on the way in and out;
everything else is copied as is (the Llama family's rotate-half RoPE needs no q/k permutation).

GPTConfig and reading config.json are in gpt_config.py (re-exported here and by model.py, which builds the
models); this module imports nothing of nano_rlhf but gpt_config.
"""
import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# GPTConfig and config.json reading live in gpt_config.py; the names other files import from here stay here
from .gpt_config import (ARCHITECTURES, GPTConfig, check_config, config_from_hf,  # noqa: F401
                         model_type_of)

# The four Conv1D matrices of HF GPT-2 (stored [in, out]); everything else is copied as is.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_DTYPES = ("F32", "F16", "BF16", "F64")
_MAX_HEADER = 100_000_000


def _read_json(path, kind=dict):
    try:
        with open(path) as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    if not isinstance(obj, kind):
        raise ValueError(f"{path}: expected a JSON object, got a {type(obj).__name__}")
    return obj


# ---- weights: headers first, tensors after the check ---------------------------------------------

def safetensors_header(path):
    """{name: (shape, dtype)} from a safetensors file's header, checking the file holds all the data it names."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if size < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes: empty or truncated)")
        n = int.from_bytes(fh.read(8), "little")
        if n > min(size - 8, _MAX_HEADER):
            raise ValueError(f"{path}: not a safetensors file or truncated (header of {n} bytes, file of {size})")
        try:
            header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            out = {k: (tuple(int(d) for d in v["shape"]), v["dtype"], v["data_offsets"]) for k, v in header.items()}
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            raise ValueError(f"{path}: corrupt safetensors header") from None
    end = max((o[1] for _, _, o in out.values()), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{path}: truncated ({size} bytes; its header names {8 + n + end})")
    return {k: (shape, dtype) for k, (shape, dtype, _) in out.items()}


def weight_files(model_dir):
    """{name: (shape, dtype, file)} over model.safetensors or the shards of model.safetensors.index.json
    (the single file wins when both exist, as in transformers)."""
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return {k: (s, d, single) for k, (s, d) in safetensors_header(single).items()}
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{single}: missing (a model directory needs config.json and model.safetensors "
                                "or model.safetensors.index.json)")
    wmap = _read_json(index).get("weight_map")
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to file names")
    out = {}
    for fname in sorted(set(wmap.values())):
        path = os.path.join(model_dir, fname)
        if os.path.basename(fname) != fname or not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: missing (listed in {index})")
        header = safetensors_header(path)
        for k in (k for k, v in wmap.items() if v == fname):
            if k not in header:
                raise ValueError(f"{index}: {k} is mapped to {fname}, which does not hold it")
            out[k] = (*header[k], path)
    return out


def _our_key(cfg, key):
    """Our (= HF canonical) name for a stored tensor; None for buffers that are not weights."""
    if key.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
        return None
    if cfg.model_type == "gpt2" and not key.startswith(("transformer.", "score.", "lm_head.")):
        return "transformer." + key          # original OpenAI layout: wte.weight, h.0..., ln_f...
    return key


def expected_shapes(cfg, head=None):
    """{name: shape} of the model the config describes (head "lm", "score" or None for the trunk only), in
    our layout (GPT-2 Conv1D as Linear [out, in]); equals the built model's state_dict shapes."""
    C, V, L = cfg.n_embd, cfg.vocab_size, cfg.n_layer
    out = {}
    if cfg.model_type == "gpt2":
        b = cfg.bias
        out.update({"transformer.wte.weight": (V, C), "transformer.wpe.weight": (cfg.block_size, C),
                    "transformer.ln_f.weight": (C,), **({"transformer.ln_f.bias": (C,)} if b else {})})
        layer = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (3 * C, C), "attn.c_attn.bias": (3 * C,),
                 "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
                 "mlp.c_fc.weight": (4 * C, C), "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (C, 4 * C),
                 "mlp.c_proj.bias": (C,)}
        prefix = "transformer.h"
        layer = {k: v for k, v in layer.items() if b or not k.endswith(".bias")}
    else:
        q, kv, F_ = cfg.n_head * cfg.hd, cfg.kv_heads * cfg.hd, cfg.ffn
        out.update({"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)})
        layer = {"input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
                 "self_attn.q_proj.weight": (q, C), "self_attn.k_proj.weight": (kv, C),
                 "self_attn.v_proj.weight": (kv, C), "self_attn.o_proj.weight": (C, q),
                 "mlp.gate_proj.weight": (F_, C), "mlp.up_proj.weight": (F_, C), "mlp.down_proj.weight": (C, F_)}
        if cfg.attention_bias:
            layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
            if cfg.model_type != "qwen2":
                layer["self_attn.o_proj.bias"] = (C,)
        if cfg.qk_norm:
            layer.update({"self_attn.q_norm.weight": (cfg.hd,), "self_attn.k_norm.weight": (cfg.hd,)})
        prefix = "model.layers"
    for i in range(L):
        out.update({f"{prefix}.{i}.{k}": v for k, v in layer.items()})
    if head == "lm" and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, C)
    if head == "score":
        out["score.weight"] = (1, C)
    return out


def read_hf_dir(model_dir, head=None, allow_missing=(), **overrides):
    """Read a HF model directory (or ours) -> (GPTConfig, raw config dict, state dict in our layout, float32).

    head: "lm" (GPT), "score" (ScoreModel) or None (trunk only); the other head's weights are dropped, so a
    reward model's trunk loads into a GPT and a language model's into a ScoreModel (allow_missing=("score.weight",)).
    overrides set config fields before the check. Every error is one line naming the file."""
    cpath = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cpath):
        raise FileNotFoundError(f"{cpath}: missing (a model directory needs config.json and model.safetensors)")
    raw = _read_json(cpath)
    cfg = config_from_hf(raw, cpath)
    cfg.generation, cfg.eos_token_ids = read_generation(model_dir, raw)
    if overrides:
        for k, v in overrides.items():
            setattr(cfg, k, v)
        check_config(cfg, f"{cpath} with {overrides}")
    files = weight_files(model_dir)
    wpath = next(iter(files.values()))[2] if files else os.path.join(model_dir, "model.safetensors")
    stored = {}                                         # our name -> (file name, shape in our layout, dtype, file)
    for k, (shape, dtype, path) in files.items():
        ours = _our_key(cfg, k)
        if ours is None:
            continue
        if dtype not in _DTYPES:
            raise ValueError(f"{path}: {k} is stored as {dtype}; only float32/float16/bfloat16 weights are supported")
        stored[ours] = (k, shape[::-1] if ours.endswith(_CONV1D) and cfg.model_type == "gpt2" else shape, path)
    block_key = re.compile(r"^(?:transformer\.h|model\.layers)\.(\d+)\.")
    layers = {int(m.group(1)) for m in map(block_key.match, stored) if m}
    if len(layers) != cfg.n_layer or (layers and max(layers) != cfg.n_layer - 1):
        held = f"{len(layers)}" if len(layers) != cfg.n_layer else f"layers numbered {sorted(layers)}"
        raise ValueError(f"{cpath}: the config says {cfg.n_layer} layers (0..{cfg.n_layer - 1}) but {wpath} "
                         f"holds {held}")
    drop = {"lm": ("score.weight",), "score": ("lm_head.weight",), None: ("score.weight", "lm_head.weight")}[head]
    lm_head = stored.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None   # tied: the embedding is it
    zero_biases = ({k: stored.pop(k) for k in [k for k in stored if k.endswith(".bias")]}
                   if cfg.model_type == "gpt2" and not cfg.bias else {})   # written as zeros for transformers
    want = expected_shapes(cfg, head)
    for k in (k for k in want if k in stored):
        _, shape, path = stored[k]
        if tuple(want[k]) != tuple(shape):
            raise ValueError(f"{path}: {k} has shape {list(shape)} but the config ({cpath}) implies {list(want[k])}")
    missing = [k for k in want if k not in stored and k not in allow_missing]
    unexpected = [k for k in stored if k not in want and k not in drop]
    if missing == ["score.weight"]:
        raise ValueError(f"{model_dir}: no score head (score.weight); is this a reward model directory?")
    if missing or unexpected:
        raise ValueError(f"{wpath}: weights do not match {cpath}: missing {len(missing)} {missing[:3]}, "
                         f"unexpected {len(unexpected)} {unexpected[:3]}")
    sd = {k: _load(cfg, k, *stored[k]) for k in want if k in stored}
    for k, entry in zero_biases.items():
        if _load(cfg, k, entry[0], entry[1], entry[2]).any():
            raise ValueError(f"{entry[2]}: {k} is not zero but the config has no biases (nano_rlhf.bias false)")
    # GPT-2 ties the output layer to wte; HF writes an untied lm_head only with tie_word_embeddings false, and
    # then one that differs from wte would load silently as the wrong output layer
    if cfg.model_type == "gpt2" and lm_head is not None and raw.get("tie_word_embeddings", True) is False:
        if not torch.equal(_load(cfg, "lm_head.weight", *lm_head), sd["transformer.wte.weight"]):
            raise ValueError(f"{model_dir}: tie_word_embeddings is false and lm_head.weight differs from the "
                             "embedding (wte); this GPT ties them, so the untied output layer cannot be loaded")
    return cfg, raw, sd


def _ids(v):
    """An id or a list of ids (HF writes either) -> list of ints; anything else -> []."""
    v = v if isinstance(v, list) else [v]
    return [int(i) for i in v if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def read_generation(model_dir, raw):
    """(the directory's generation_config.json as a dict or None, every end id that it and config.json list).
    Llama 3.2 lists three ([128001, 128008, 128009]), Qwen two; an export keeps them all, so transformers'
    generate stops where the checkpoint's authors said it should."""
    path = os.path.join(model_dir, "generation_config.json")
    gen = _read_json(path) if os.path.isfile(path) else None
    ends = _ids(raw.get("eos_token_id")) + _ids((gen or {}).get("eos_token_id"))
    return gen, sorted(set(ends)) or None


def write_generation(cfg, out_dir, ends, pad_id):
    """generation_config.json: the checkpoint's own (sampling defaults and bos kept) with the export's end ids
    and pad."""
    gen = dict(cfg.generation or {})
    gen.pop("transformers_version", None)
    gen.setdefault("bos_token_id", cfg.bos_token_id if cfg.model_type != "gpt2" else cfg.eos_token_id)
    # an out-of-vocabulary pad (GPT-2's) is not for generate, which feeds pads of finished rows back in
    gen.update(eos_token_id=ends if len(ends) != 1 else ends[0],
               pad_token_id=pad_id if pad_id is not None and pad_id < cfg.vocab_size else None)
    _atomic(os.path.join(out_dir, "generation_config.json"), lambda p: _write_text(p, json.dumps(gen, indent=2) + "\n"))


def _load(cfg, ours, key, shape, path):
    try:
        with safe_open(path, framework="pt") as fh:
            t = fh.get_tensor(key)
    except Exception as e:       # the header was valid, so this is a damaged file
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: cannot read {key} ({why})") from None
    t = t.to(torch.float32)
    return t.t().contiguous() if cfg.model_type == "gpt2" and ours.endswith(_CONV1D) else t


# ---- writing ----------------------------------------------------------------------------------

def hf_state_dict(model):
    """The model's tensors under HF names and layout, float32 on CPU."""
    import torch.nn as nn
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().to("cpu", torch.float32)
        sd[k] = v.t().contiguous() if model.cfg.model_type == "gpt2" and k.endswith(_CONV1D) else v.contiguous()
    if model.cfg.model_type == "gpt2" and not model.cfg.bias:   # HF GPT-2 always has biases: write zeros
        for name, mod in model.named_modules():
            if isinstance(mod, (nn.Linear, nn.LayerNorm)) and mod.bias is None and not name.startswith("score"):
                sd[name + ".bias"] = torch.zeros(mod.weight.shape[0])
    return sd


def hf_config(model, **extra):
    """config.json of the model as transformers 5 writes it for the class (plus `extra` keys)."""
    c = model.cfg
    if c.model_type == "gpt2":
        d = {"model_type": "gpt2", "architectures": [model.architecture], "vocab_size": c.vocab_size,
             "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
             "n_head": c.n_head, "n_inner": None, "activation_function": "gelu_new",
             "layer_norm_epsilon": c.layer_norm_epsilon, "resid_pdrop": c.dropout, "embd_pdrop": c.dropout,
             "attn_pdrop": c.dropout, "initializer_range": 0.02, "scale_attn_weights": True,
             "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
             "tie_word_embeddings": True, "use_cache": True, "dtype": "float32",
             "bos_token_id": c.eos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id,
             "nano_rlhf": {"bias": c.bias}}
    else:
        rope = {"rope_theta": c.rope_theta, "rope_type": "default"}
        if c.rope_scaling:
            rope.update(c.rope_scaling)
        d = {"architectures": [model.architecture], "model_type": c.model_type, "vocab_size": c.vocab_size,
             "hidden_size": c.n_embd, "intermediate_size": c.ffn, "num_hidden_layers": c.n_layer,
             "num_attention_heads": c.n_head, "num_key_value_heads": c.kv_heads, "head_dim": c.hd,
             "hidden_act": "silu", "max_position_embeddings": c.block_size, "rms_norm_eps": c.rms_norm_eps,
             "rope_parameters": rope, "attention_dropout": c.dropout, "initializer_range": 0.02,
             "tie_word_embeddings": c.tie_word_embeddings, "use_cache": True, "dtype": "float32",
             "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id}
        if c.model_type == "llama":
            d.update(attention_bias=c.attention_bias, mlp_bias=False, pretraining_tp=1)
        else:
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layer,
                     layer_types=["full_attention"] * c.n_layer)
            if c.model_type == "qwen3":
                d["attention_bias"] = c.attention_bias
    if model.head == "score":
        d.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, num_labels=1)
    d.update(extra)
    return d


def _atomic(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def write_hf_dir(model, out_dir, **extra_config):
    """config.json + model.safetensors (single file, float32) in the family's HF layout, each replaced atomically."""
    os.makedirs(out_dir, exist_ok=True)
    _atomic(os.path.join(out_dir, "model.safetensors"),
            lambda p: save_file(hf_state_dict(model), p, metadata={"format": "pt"}))
    cfg = hf_config(model, **extra_config)
    _atomic(os.path.join(out_dir, "config.json"), lambda p: _write_text(p, json.dumps(cfg, indent=2) + "\n"))
    if model.head != "score":
        ends = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
        write_generation(model.cfg, out_dir, [e for e in ends if e is not None], cfg["pad_token_id"])
