"""Checkpoints with the special-token layouts real families ship (tests/hf_fixtures.py SHIPPED: SmolLM2's pad =
eos, Llama 3.2's missing pad and eos list, Qwen2.5/3's separate pad): padding never reaches an embedding row
that does not exist, mixed-length batches work in every script and in evaluate, and every output directory
loads in transformers with our logits / scores, a pad_token_id inside the vocabulary that the tokenizer agrees
with, and generation_config.json keeping the checkpoint's stop ids."""
import json
import os

import pytest
import torch

from conftest import run
from hf_fixtures import SHIPPED, make_hf_dir, pref_rows, prompt_rows, sft_rows, unpaired_rows, write_jsonl
from nano_rlhf.data import collate_prompts
from nano_rlhf.model import GPT, ScoreModel
from nano_rlhf.training import load_tokenizer
from numerics import FLOAT32_ATOL, MARGIN, greedy_margin

transformers = pytest.importorskip("transformers")

PAD = {"smollm2": "<|endoftext|>", "llama3.2": "<|finetune_right_pad_id|>", "qwen2.5": "<|endoftext|>",
       "qwen3": "<|endoftext|>"}
SHIPPED_EOS = {"smollm2": ["<|im_end|>"], "llama3.2": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
               "qwen2.5": ["<|im_end|>", "<|endoftext|>"], "qwen3": ["<|im_end|>", "<|endoftext|>"]}


@pytest.fixture(scope="module", params=SHIPPED)
def layout(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(name.replace(".", "_"))
    d = make_hf_dir(root / "model", name)
    rm = make_hf_dir(root / "rm", name, head="score", seed=1)
    write_jsonl(root / "sft.jsonl", sft_rows(16))
    write_jsonl(root / "pref.jsonl", pref_rows(16))
    write_jsonl(root / "unpaired.jsonl", unpaired_rows(16))
    write_jsonl(root / "prompts.jsonl", prompt_rows(8))
    return name, d, rm, root


def test_one_pad_rule(layout):
    """The pad is an in-vocabulary special token that never occurs in a rendered row: the declared pad when it is
    not a stop token (Qwen), a pad-named token (Llama 3.2), else an unused special token (SmolLM2, whose
    declared pad is its eos)."""
    name, d, _, _ = layout
    tok = load_tokenizer("", d)
    assert tok.pad_token == PAD[name] and tok.pad_id < tok.vocab_size
    assert tok.pad_id not in tok.stop_ids and tok.pad_id != tok.bos_id
    rendered = tok.encode_conversation(sft_rows(3)[2]["messages"])[0]
    assert tok.pad_id not in rendered


def test_mixed_length_batch_generates_transformers_greedy(layout):
    """Four chat prompts of different lengths, left-padded with the tokenizer's pad, greedy: the tokens
    transformers' generate gives each prompt alone (no padding on its side)."""
    name, d, _, _ = layout
    tok = load_tokenizer("", d)
    ours = GPT.from_pretrained(d).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    users = ["hi.", "write a short review of the phone.", "the motor is great and the screen is bad.",
             "write a short review of the blender and the battery, it was fine and quiet."]
    prompts = [tok.render_prompt([{"role": "user", "content": u}]) for u in users]
    assert len({len(p) for p in prompts}) == 4
    ids, mask = collate_prompts(prompts, tok.pad_id)
    got = ours.generate(ids, mask, 8, temperature=0, eos_token_id=tok.stop_ids, pad_token_id=tok.pad_id)
    assert greedy_margin(ours, got, mask, (got[:, ids.shape[1]:] != tok.pad_id).long()) > MARGIN
    for i, p in enumerate(prompts):
        want = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=tok.stop_ids,
                           pad_token_id=tok.pad_id)[0, len(p):].tolist()
        new = got[i, ids.shape[1]:].tolist()
        assert new[:len(want)] == want and all(t == tok.pad_id for t in new[len(want):])


def test_evaluate_on_mixed_length_prompts(layout, tmp_path):
    name, d, rm, root = layout
    p = run(["-m", "nano_rlhf.evaluate", "--model", d, "--prompts", str(root / "prompts.jsonl"), "--temperature",
             "0", "--max_new_tokens", "6", "--reward_model", rm, "--out", str(tmp_path / "s.jsonl")])
    assert p.returncode == 0
    assert len(open(tmp_path / "s.jsonl").read().splitlines()) == 8


def script_args(script, d, rm, root, out):
    common = ["--init", d, "--out_dir", str(out), "--max_steps", "2", "--batch_size", "4", "--warmup_steps", "0",
              "--log_interval", "1", "--eval_interval", "0", "--lr", "1e-3"]
    if script == "train_ppo.py":
        return common[:6] + ["--batch_size", "2", "--samples_per_prompt", "2", "--max_new_tokens", "6",
                             "--advantage", "grpo", "--reward_model", rm, "--prompts", str(root / "prompts.jsonl"),
                             "--eval_prompts", str(root / "prompts.jsonl"), "--eval_samples", "2",
                             "--eval_interval", "0", "--warmup_steps", "0"]
    if script == "train_unpaired.py":
        return common + ["--data", str(root / "unpaired.jsonl"), "--method", "npo", "--retain_coef", "1"]
    data = {"train_sft.py": "sft.jsonl"}.get(script, "pref.jsonl")
    return common + ["--data", str(root / data), "--eval_fraction", "0.2"]


@pytest.mark.parametrize("script", ["train_sft.py", "train_rm.py", "train_dpo.py", "train_ppo.py",
                                    "train_unpaired.py"])
def test_script_output_loads_in_transformers(layout, tmp_path, script):
    """A few steps on mixed-length rows; the output's config.json pad_token_id is the tokenizer's (inside the
    vocabulary), generation_config.json keeps the checkpoint's stop ids and sampling defaults, AutoTokenizer
    agrees, and transformers gives our logits (a causal LM) or, on a right-padded batch of two rows of different
    lengths, reads our scores at the same token (a reward model)."""
    name, d, rm, root = layout
    out = tmp_path / "out"
    run([script] + script_args(script, d, rm, root, out))
    cfg = json.loads((out / "config.json").read_text())
    tok = load_tokenizer("", str(out))
    assert cfg["pad_token_id"] == tok.pad_id < cfg["vocab_size"] and tok.pad_token == PAD[name]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.pad_token_id == tok.pad_id
    if script != "train_rm.py":          # a causal LM: its generate stops where the checkpoint's did, and ours
        gen = json.loads((out / "generation_config.json").read_text())
        vocab = tok.tk.get_vocab(with_added_tokens=True)
        eos, cfg_eos = ([v] if isinstance(v, int) else v for v in (gen["eos_token_id"], cfg["eos_token_id"]))
        assert {vocab[t] for t in SHIPPED_EOS[name]} | set(tok.stop_ids) <= set(eos) == set(cfg_eos)
        assert gen["pad_token_id"] == tok.pad_id
        shipped_gen = json.loads(open(os.path.join(d, "generation_config.json")).read())
        kept = {k: v for k, v in shipped_gen.items() if k not in ("eos_token_id", "pad_token_id")}
        assert {k: gen.get(k) for k in kept} == kept
    rows = [tok.encode_conversation(r["messages"])[0] for r in sft_rows(2)]
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_id] * (T - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    assert len({len(r) for r in rows}) == 2
    with torch.no_grad():
        if script == "train_rm.py":
            ours = ScoreModel.from_pretrained(str(out)).eval()
            hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
            torch.testing.assert_close(hf(ids, attention_mask=attn).logits.squeeze(-1), ours(ids, attn)[1],
                                       atol=FLOAT32_ATOL, rtol=0)
        else:
            ours = GPT.from_pretrained(str(out)).eval()
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
            keep = attn.bool()
            torch.testing.assert_close(hf(ids, attention_mask=attn).logits[keep], ours(ids, attn)[keep],
                                       atol=FLOAT32_ATOL, rtol=0)


def test_a_pad_named_on_the_command_line_must_not_be_a_stop_token(layout):
    from nano_rlhf.tokenizer import Tokenizer
    name, d, _, _ = layout
    path = os.path.join(d, "tokenizer.json")
    eot = {"llama3.2": "<|eot_id|>"}.get(name, "<|im_end|>")
    with pytest.raises(ValueError, match="must be different|must differ"):
        Tokenizer.from_file(path, pad_token=eot)
    other = {"llama3.2": "<|reserved_special_token_2|>", "smollm2": "<repo_name>"}.get(name, "<|endoftext|>")
    assert Tokenizer.from_file(path, pad_token=other).pad_token == other


def test_an_export_merges_with_its_base(layout, tmp_path):
    """An export restates token ids and generation defaults (pad, end ids): merge compares architectures, so a
    fine-tune of a shipped checkpoint still merges with it."""
    from nano_rlhf import merge
    from nano_rlhf.checkpoint import save_model_dir
    name, d, _, _ = layout
    save_model_dir(str(tmp_path / "ft"), GPT.from_pretrained(d), load_tokenizer("", d))
    base, states = merge.load_models(d, [str(tmp_path / "ft")])
    assert len(states) == 1


def test_gpt2_layout_never_gives_generate_an_out_of_vocabulary_pad(tmp_path):
    """GPT-2's tokenizer has one special token, so its pad lies past the vocabulary: config.json states it (as
    transformers' GPT-2 accepts), generation_config.json does not (generate feeds pads back into the embedding)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from conftest import tiny_model, tiny_texts
    from nano_rlhf.checkpoint import save_model_dir
    from nano_rlhf.tokenizer import Tokenizer
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tk.train_from_iterator(tiny_texts(), trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer(tk)
    assert tok.pad_token is None and tok.pad_id == tok.vocab_size
    model = tiny_model(vocab_size=tok.vocab_size)
    save_model_dir(str(tmp_path / "g"), model, tok)
    cfg = json.load(open(tmp_path / "g" / "config.json"))
    gen = json.load(open(tmp_path / "g" / "generation_config.json"))
    assert cfg["pad_token_id"] == tok.vocab_size and gen["pad_token_id"] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "g")).eval()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                eos_token_id=int(ids[0, 0]))            # a row ends early: its pads go back through the embedding


def test_a_reserved_special_token_is_the_first_spare_pad():
    """Llama 3.0's tokenizer has no pad-named token: the pad is a reserved token, not <|end_of_text|> (an end
    token the model may emit)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers
    from conftest import tiny_texts
    from nano_rlhf.tokenizer import Tokenizer
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|eot_id|>"]
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator(tiny_texts(), trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer(tk, eos_token="<|eot_id|>", chat_template="plain", bos_token="<|begin_of_text|>")
    assert tok.pad_token == "<|reserved_special_token_0|>"
