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
