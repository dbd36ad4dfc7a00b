"""python -m nano_rlhf.evaluate --tools: a policy scripted to write a malformed call, then a good one, then its
answer, on a tiny checkpoint with Qwen2.5's real template: the tool turns run, the verifier scores the final
answer, and the summary reports calls per answer and the share of malformed ones beside every usual key."""
import json

import torch
from conftest import scripted_policy

from nano_rlhf import chat, evaluate
from nano_rlhf.model import GPT, GPTConfig
from nano_rlhf.tools import load_tools



def checkpoint_and_prompt(tmp_path, tok):
    """A tiny random checkpoint beside the tokenizer build() wrote into tmp_path/m, and one maths prompt file."""
    torch.manual_seed(0)
    GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=512, n_layer=1, n_head=2, n_embd=16)).save_pretrained(
        str(tmp_path / "m"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": [{"role": "user", "content": "Compute 3 + 4 * 2."}]}) + "\n")
    return prompts

def test_evaluate_with_tools_counts_calls_and_malformed_ones(tmp_path, monkeypatch, capsys):
    from test_chat_templates import build
    _, tok, _ = build("qwen2.5", tmp_path / "m")
    box = load_tools("calculator")
    bad = "<tool_call>\nnot json\n</tool_call>"
    good = chat.assistant_text("qwen2.5", "", [{"name": "calculator", "arguments": {"expression": "3+4*2"}}])
    turns = []
    for text in (bad, good):
        (result,) = box.run(chat.parse_tool_calls("qwen2.5", text))
        turns += tok.encode(text) + [tok.eot_id] + tok.encode_tool_turn([result.text])
    assert result.text == "11"
    script = turns + tok.encode("Answer: 11") + [tok.eot_id]
    scripted_policy(monkeypatch, script)
    prompts = checkpoint_and_prompt(tmp_path, tok)
    summary = tmp_path / "s.json"
    rows = evaluate.main(["--model", str(tmp_path / "m"), "--prompts", str(prompts), "--tools", "calculator",
                          "--max_turns", "3", "--max_new_tokens", str(len(script) + 4), "--reward",
                          "nano_rlhf.tasks.reasoning:reward", "--summary", str(summary), "--out", str(tmp_path / "o.jsonl")])
    (sample,) = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert sample["completion"] == tok.decode_turns(script) and sample["eos"]
    assert (sample["tool_calls"], sample["malformed_calls"], sample["reward"]) == (2, 1, 1.0)
    (row,) = json.loads(summary.read_text())
    assert row == rows[0] and (row["tool_calls"], row["malformed_share"]) == (1.0 * 2, 0.5)
    assert {"n", "length", "eos_rate", "reward", "reward_se", "name", "model", "temperature"} <= set(row)
    assert "calls 2.00 | malformed 50.0%" in capsys.readouterr().out


def test_written_calls_reads_each_ended_turn_as_the_tool_env_does(tmp_path):
    from test_chat_templates import build
    _, tok, _ = build("qwen2.5", tmp_path)
    call = chat.assistant_text("qwen2.5", "", [{"name": "c", "arguments": {}}] * 2)
    first, tool = tok.encode(call) + [tok.eot_id], tok.encode_tool_turn(["1", "2"])
    cut = tok.encode(call)                              # a turn cut by the budget: no end-of-turn, never run
    ids = first + tool + cut
    acts = [1] * len(first) + [0] * len(tool) + [1] * len(cut)
    assert evaluate.written_calls(tok, ids, acts) == [{"name": "c", "arguments": {}}] * 2
    assert evaluate.written_calls(tok, ids + [tok.eot_id], acts + [1]) == [{"name": "c", "arguments": {}}] * 4


def test_evaluate_tool_flags_are_checked_before_any_model_loads(tmp_path, capfd):
    import pytest
    for args, words in ((["--max_turns", "2"], "--max_turns applies only with --tools"),
                        (["--tools", "nope"], "--tools nope: not a built-in tool"),
                        (["--tools", "calculator", "--max_turns", "0"], "--max_turns")):
        with pytest.raises(SystemExit) as e:
            evaluate.main(["--model", str(tmp_path / "none"), "--out", str(tmp_path / "o.jsonl")] + args)
        err = capfd.readouterr().err
        assert e.value.code != 0 and words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_label_with_tools_writes_tool_turns_as_messages(tmp_path, monkeypatch):
    """label --tools: a scripted policy calls the calculator and answers; the rows hold the response as messages
    (call, result, answer) with the tools listed, read back as listwise data whose scored tokens skip the result."""
    from test_chat_templates import build
    from nano_rlhf import label
    from nano_rlhf.data import collate_listwise, load_records, tokenize_listwise
    _, tok, _ = build("qwen2.5", tmp_path / "m")
    box = load_tools("calculator")
    call = {"name": "calculator", "arguments": {"expression": "3+4*2"}}
    text = chat.assistant_text("qwen2.5", "", [call])
    script = tok.encode(text) + [tok.eot_id] + tok.encode_tool_turn(["11"]) + tok.encode("Answer: 11") + [tok.eot_id]
    scripted_policy(monkeypatch, script)
    prompts = checkpoint_and_prompt(tmp_path, tok)
    out = tmp_path / "lw.jsonl"
    rows = label.main(["--model", str(tmp_path / "m"), "--prompts", str(prompts), "--judge",
                       "nano_rlhf.tasks.reasoning:reward", "--format", "listwise", "--samples_per_prompt", "2", "--tools",
                       "calculator", "--max_turns", "3", "--max_new_tokens", str(len(script) + 4), "--out", str(out)])
    want = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": "11"}, {"role": "assistant", "content": "Answer: 11"}]
    assert rows == [{"prompt": json.loads(prompts.read_text())["prompt"], "completions": [want, want],
                     "scores": [1.0, 1.0], "tools": box.schemas}]
    (ex,), _ = tokenize_listwise(load_records(str(out), "listwise"), tok, 4096)
    ids, _, resp, _, _ = collate_listwise([ex], tok.pad_id)
    assert ids[0][resp[0].bool()].tolist() == tok.encode(text) + [tok.eot_id] + tok.encode("Answer: 11") + [tok.eot_id]
    assert ex["completions"][0] == script                   # re-rendered: the very ids sampled, here


def test_label_tools_need_pairs_or_listwise(tmp_path, capfd):
    import pytest
    from nano_rlhf import label
    with pytest.raises(SystemExit) as e:
        label.main(["--model", str(tmp_path), "--judge", "gold", "--format", "scored", "--tools", "calculator",
                    "--out", str(tmp_path / "o.jsonl")])
    err = capfd.readouterr().err
    assert e.value.code == 2 and "--format scored's responses are assistant messages only" in err
    with pytest.raises(SystemExit):
        label.main(["--model", str(tmp_path), "--judge", "gold", "--max_turns", "2", "--out", str(tmp_path / "o")])
    assert "--max_turns applies only with --tools" in capfd.readouterr().err


def test_transcript_messages_leaves_out_what_no_row_can_hold(tmp_path):
    from test_chat_templates import build
    from nano_rlhf.label import transcript_messages
    _, tok, _ = build("qwen2.5", tmp_path)
    bad = tok.encode("<tool_call>\nnot json\n</tool_call>") + [tok.eot_id]
    good = tok.encode(chat.assistant_text("qwen2.5", "", [{"name": "c", "arguments": {}}])) + [tok.eot_id]
    answer = tok.encode("It is 1.") + [tok.eot_id]

    def messages(first, results):
        tool = tok.encode_tool_turn(results)
        ids = first + tool + answer
        return transcript_messages(tok, ids, [1] * len(first) + [0] * len(tool) + [1] * len(answer),
                                   {tuple(first): results})
    assert messages(bad, ["error: malformed tool call"]) is None           # its error answers no call
    assert [m["role"] for m in messages(good, ["1"])] == ["assistant", "tool", "assistant"]
    # a final turn's malformed call, never run, stays as the text the policy wrote
    assert transcript_messages(tok, bad, [1] * len(bad), {}) == [
        {"role": "assistant", "content": "<tool_call>\nnot json\n</tool_call>"}]
