"""Tokenizer seam, response mask, special tokens and the chat template."""
import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from nano_rlhf.tokenizer import ASSISTANT_HEADER, Tokenizer


def test_special_tokens(tok):
    assert tok.eos_id == 0 and tok.pad_id == 1 and tok.pad_id != tok.eos_id
    assert tok.encode("the motor") and tok.eos_id not in tok.encode("the motor <|pad|>x")[:2]


def test_response_mask_covers_exactly_response_and_eos(tok):
    prompt, resp = "write a short review of the phone.", " the screen is great."
    ids, mask = tok.encode_prompt_response(prompt, resp)
    p, r = tok.encode(prompt), tok.encode(resp)
    assert ids == p + r + [tok.eos_id]                      # tokenized separately, never re-merged
    assert mask == [0] * len(p) + [1] * (len(r) + 1)
    assert sum(mask) == len(r) + 1 and ids[-1] == tok.eos_id and mask[-1] == 1


def test_seam_never_merges_across_the_boundary():
    """A BPE that knows the merge 'ab' must not merge the prompt's 'a' with the response's 'b'."""
    base = Tokenizer.train(["ab ab ab abab ab", "a b"] * 50, vocab_size=280)
    joint = base.encode("xa" + "b")
    sep = base.encode("xa") + base.encode("b")
    ids, mask = base.encode_prompt_response("xa", "b")
    assert ids[:-1] == sep and joint != sep
    assert mask.index(1) == len(base.encode("xa"))


def test_chat_template_roundtrip(tok):
    msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "review the phone"},
            {"role": "assistant", "content": "it is great."}, {"role": "user", "content": "and the motor?"},
            {"role": "assistant", "content": "quiet."}]
    ids, mask = tok.encode_conversation(msgs)
    text = tok.tk.decode(ids, skip_special_tokens=False)
    assert text == ("System: be nice\nUser: review the phone\nAssistant: it is great.<|endoftext|>"
                    "User: and the motor?\nAssistant: quiet.<|endoftext|>")
    trained = tok.tk.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == " it is great.<|endoftext|> quiet.<|endoftext|>"
    # prompt rendering + response = the same ids as the whole conversation (no header duplicated)
    p_ids, p_mask = tok.encode_prompt_response(msgs[:4], msgs[4:])
    assert p_ids == ids and p_mask[-len(tok.encode(' quiet.')) - 1:] == [1] * (len(tok.encode(' quiet.')) + 1)
    assert tok.render_prompt(msgs[:2])[-len(tok.encode(ASSISTANT_HEADER)):] == tok.encode(ASSISTANT_HEADER)
    assert tok.encode_response([{"role": "assistant", "content": "quiet."}]) == tok.encode(" quiet.") + [tok.eos_id]


def test_decode_stops_at_eos_and_drops_pad(tok):
    ids = tok.encode(" the motor") + [tok.eos_id] + tok.encode(" junk")
    assert tok.decode(ids) == " the motor"
    assert tok.decode([tok.pad_id] + tok.encode(" great")) == " great"


def test_save_load_roundtrip(tok, tmp_path):
    tok.save(str(tmp_path / "t.json"))
    t2 = Tokenizer.from_file(str(tmp_path / "t.json"))
    assert t2.info() == tok.info() and t2.encode(" the quiet phone") == tok.encode(" the quiet phone")


def test_gpt2_style_tokenizer_without_pad(tmp_path):
    """Only <|endoftext|> (like GPT-2's): pad id becomes vocab_size, outside the vocabulary."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.add_tokens(["a", "b"])
    tk.add_special_tokens(["<|endoftext|>"])
    tk.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert t.pad_id == t.vocab_size and t.eos_id == json.loads((tmp_path / "tokenizer.json").read_text())[
        "added_tokens"][-1]["id"]


def test_missing_eos_and_bad_file(tmp_path):
    tk = HFTokenizer(models.BPE())
    tk.add_tokens(["a"])
    tk.save(str(tmp_path / "noeos.json"))
    with pytest.raises(ValueError, match="end-of-text"):
        Tokenizer.from_file(str(tmp_path / "noeos.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        Tokenizer.from_file(str(tmp_path / "bad.json"))


def custom_tokenizer_file(path, specials=("<end>", "<blank>")):
    """A byte-level BPE whose special tokens have names nano_rlhf does not guess."""
    from tokenizers import decoders, trainers
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["the motor is great and the screen is bad"] * 50,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tk.save(str(path))
    return str(path)


def test_special_token_names_from_options_persist_in_tokenizer_config(tmp_path):
    path = custom_tokenizer_file(tmp_path / "src" / "tokenizer.json")
    with pytest.raises(ValueError, match="name it with --eos_token"):
        Tokenizer.from_file(path)
    with pytest.raises(ValueError, match="no pad token '<nope>'"):
        Tokenizer.from_file(path, "<end>", "<nope>")
    tok = Tokenizer.from_file(path, "<end>", "<blank>")
    assert (tok.eos_id, tok.pad_id) == (0, 1)
    tok.save(str(tmp_path / "out" / "tokenizer.json"))
    again = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))   # no names: read from the config
    assert (again.eos_token, again.eos_id, again.pad_token, again.pad_id) == ("<end>", 0, "<blank>", 1)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (hf.eos_token, hf.pad_token, hf.pad_token_id) == ("<end>", "<blank>", 1)


def test_hf_config_with_pad_equal_to_eos_keeps_a_distinct_pad(tmp_path):
    """Many HF tokenizer_config.json files set pad = eos; nano_rlhf then pads with an id outside the vocab."""
    path = custom_tokenizer_file(tmp_path / "tokenizer.json", specials=("<|endoftext|>",))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>"}, "pad_token": "<|endoftext|>"}))
    tok = Tokenizer.from_file(path)
    assert tok.eos_id == 0 and tok.pad_id == tok.vocab_size


def test_scripts_take_eos_and_pad_names(tmp_path):
    from conftest import run, sft_rows, write_jsonl
    path = custom_tokenizer_file(tmp_path / "src" / "tokenizer.json")
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(32))
    args = ["train_sft.py", "--data", str(tmp_path / "sft.jsonl"), "--tokenizer", path, "--max_steps", "2",
            "--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--vocab_size", "300", "--eval_interval", "0",
            "--batch_size", "8"]
    p = run(args + ["--out_dir", str(tmp_path / "bad")], check=False)
    assert p.returncode != 0 and "name it with --eos_token" in p.stderr and "Traceback" not in p.stderr
    run(args + ["--out_dir", str(tmp_path / "sft"), "--eos_token", "<end>", "--pad_token", "<blank>"])
    cfg = json.loads((tmp_path / "sft" / "tokenizer_config.json").read_text())
    assert (cfg["eos_token"], cfg["pad_token"]) == ("<end>", "<blank>")
    from nano_rlhf.model import GPT
    m = GPT.from_pretrained(str(tmp_path / "sft"))
    assert (m.cfg.eos_token_id, m.cfg.pad_token_id) == (0, 1)


def test_training_on_one_huge_word_finishes(tmp_path):
    """Issue 11: BPE training time grows with the square of a word's length, and a 10-MB single-word line
    hung. The trainer now sees capped texts with long runs cut; a 2-MB word must train in seconds."""
    from nano_rlhf.tokenizer import TRAIN_MAX_CHARS, TRAIN_MAX_WORD, _for_training
    word = "".join("abcdefghij"[(i * 7 + i // 3) % 10] for i in range(2_000_000))
    pieces = list(_for_training([word]))
    assert max(map(len, pieces)) <= TRAIN_MAX_WORD and "".join(pieces) == word[:TRAIN_MAX_CHARS]
    long_runs = "a " + "x" * 300 + " " * 600 + "y"
    assert list(_for_training([long_runs])) == ["a ", "x" * 256, "x" * 44, " " * 256, " " * 256, " " * 88, "y"]
    assert list(_for_training(["the motor is great.\n"])) == ["the motor is great.\n"]   # normal text untouched
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from nano_rlhf.tokenizer import Tokenizer; "
              "w = ''.join('abcdefghij'[(i * 7 + i // 3) % 10] for i in range(2_000_000)); "
              "t = Tokenizer.train([w, 'the motor is great'], vocab_size=300); print(t.vocab_size)")
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", script, root], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and int(p.stdout) > 256, p.stderr


def test_bad_tokenizer_config_is_one_line_error_naming_it(tmp_path):
    path = custom_tokenizer_file(tmp_path / "tokenizer.json", specials=("<|endoftext|>",))
    for text, what in (("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object, got list"),
                       ('{"chat_template": 3}', "'chat_template' must be a string")):
        (tmp_path / "tokenizer_config.json").write_text(text)
        with pytest.raises(ValueError) as e:
            Tokenizer.from_file(path)
        msg = str(e.value)
        assert msg.startswith(str(tmp_path / "tokenizer_config.json")) and what in msg and "\n" not in msg


def test_bos_for_plain_text_when_the_tokenizer_adds_one(tmp_path):
    """A tokenizer.json whose post-processor prepends bos (Llama 3's): plain-text prompts and documents start
    with bos, never twice; responses never; tokenizer_config.json's add_bos_token overrides."""
    from tokenizers import processors
    path = custom_tokenizer_file(tmp_path / "tokenizer.json", specials=("<|begin_of_text|>", "<|end_of_text|>"))
    tk = HFTokenizer.from_file(path)
    tk.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                      special_tokens=[("<|begin_of_text|>", 0)])
    tk.save(path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    tok = Tokenizer.from_file(path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (0, 1, True)
    p = tok.encode("the motor")
    assert tok.render_prompt("the motor") == [0] + p and tok.render_prompt("<|begin_of_text|>the motor") == [0] + p
    assert tok.encode_prompt_response("the motor", " is great")[0] == [0] + p + tok.encode(" is great") + [1]
    assert tok.encode_text("the motor") == [0] + p + [1]
    ids, mask = tok.encode_conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert ids[0] == 0 and ids.count(0) == 1 and mask[0] == 0
    assert tok.encode_response([{"role": "assistant", "content": "yo"}]) == tok.encode(" yo") + [1]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                "add_bos_token": False}))
    assert Tokenizer.from_file(path).render_prompt("the motor") == p


def test_trained_tokenizer_with_a_chat_template_has_its_tokens():
    t = Tokenizer.train(["the motor is great"] * 20, vocab_size=300, chat_template="chatml")
    assert t.chat_template == "chatml" and t.stop_ids == [0, t.eot_id] and t.encode("<|im_end|>") == [t.eot_id]
    ids, mask = t.encode_prompt_response([{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "ok"}])
    assert ids[-1] == t.eot_id and mask[-1] == 1
    with pytest.raises(ValueError, match="unknown chat template 'nope'"):
        Tokenizer.train(["x"], chat_template="nope")


def test_fingerprint_tells_another_tokenizer_of_the_same_size_apart(tok, tmp_path):
    """tokenizer.mismatch, the check behind every reference / reward model / judge / merge partner: a file
    written in another layout (merges as "a b", as older tokenizers versions wrote them) is the same tokenizer;
    two ids swapped is another one of the very same size."""
    import json
    from tokenizers import Tokenizer as HFTokenizer

    from conftest import other_tokenizer
    from nano_rlhf.tokenizer import fingerprint, mismatch
    tok.save(str(tmp_path / "same" / "tokenizer.json"))
    ours = Tokenizer.from_file(str(tmp_path / "same" / "tokenizer.json"))
    d = json.loads((tmp_path / "same" / "tokenizer.json").read_text())
    d["model"]["merges"] = [" ".join(m) for m in d["model"]["merges"]]
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "tokenizer.json").write_text(json.dumps(d, indent=1))
    other_tokenizer(tok, tmp_path / "other")
    (tmp_path / "none").mkdir()
    assert fingerprint(ours.tk) == fingerprint(tok.tk)
    assert mismatch(ours, str(tmp_path / "legacy")) is None and mismatch(ours, str(tmp_path / "none")) is None
    other = HFTokenizer.from_file(str(tmp_path / "other" / "tokenizer.json"))
    assert other.get_vocab_size() == tok.vocab_size and fingerprint(other) != fingerprint(tok.tk)
    msg = mismatch(ours, str(tmp_path / "other"))
    assert msg.startswith(f"{tmp_path / 'other'} was trained with another tokenizer than {tmp_path / 'same'} ")
    assert mismatch(str(tmp_path / "same" / "tokenizer.json"), str(tmp_path / "other")) == msg   # a path works too
