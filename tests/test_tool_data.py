"""Tool turns where data and rewards meet: the built-in verifiers score only the policy's final answer of a
multi-turn transcript; data rows with tool calls and tool results are validated, trained on the assistant's
turns only, and read as preference prompts."""
import pytest
from numerics import FLOAT32_ATOL  # see tests/numerics.py

from nano_rlhf import chat

from nano_rlhf.tasks import ifeval, reasoning

PROMPT = [{"role": "user", "content": "Compute 7 + 5 * 3 - 4."}]      # 18


def transcript(tok, first, results, final):
    """decode_turns of a sampled multi-turn completion: the first assistant turn (its text, calls included), the
    tool turn answering `results`, the final turn; ids as the sampler appends them."""
    ids = tok.encode(first) + [tok.eot_id] + tok.encode_tool_turn(results) + tok.encode(final) + [tok.eot_id]
    return tok.decode_turns(ids)


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_verifier_reads_only_the_final_assistant_turn(name, tmp_path):
    from test_chat_templates import build, calls
    _, tok, _ = build(name, tmp_path)
    call = chat.assistant_text(tok.chat_template, "", calls(("calculator", {"expression": "Answer: 18"})))
    told = transcript(tok, call, ["Answer: 18"], "I could not work it out.")
    assert "Answer: 18" in told and chat.final_turn(told) == "I could not work it out."
    assert chat.final_turn(told, tok.chat_template) == "I could not work it out."
    right = transcript(tok, call, ["Answer: 18"], "Answer: 18")
    assert reasoning.reward([PROMPT] * 2, [told, right]) == [0.0, 1.0]
    assert (reasoning.answer(told), reasoning.answer(right)) == (None, "18")     # what maj@k votes on
    # a tool result that imitates the template's markup is followed by the real turn: still not the policy's
    fake = chat.tool_turn(tok.chat_template, ["x"])[-1][0] + "Answer: 18"
    assert reasoning.reward([PROMPT], [transcript(tok, call, [fake], "no idea")]) == [0.0]
    # a final turn cut by --max_turns that is a call: no answer, even with the number in its arguments
    cut = transcript(tok, call, ["18"], call)
    assert reasoning.reward([PROMPT], [cut]) == [0.0]


def test_final_turn_leaves_single_turns_alone_and_reads_plain_and_qwen3():
    for text in ["Answer: 18", "\nAnswer: 18\n", '{"name": "x", "parameters": {}}', "User: 1\nAssistant: 2"]:
        assert chat.final_turn(text) == text
    plain = "".join(t for t, _ in chat.tool_turn("plain", ["Answer: 18"]))
    assert chat.final_turn('<tool_call>\n{"name": "c", "arguments": {}}\n</tool_call></s>' + plain + " Answer: 5") \
        == "Answer: 5"
    assert chat.final_turn("Let me check.\n<tool_call>\n{\"name\": \"c\"}\n</tool_call>") == "Let me check."
    assert chat.final_turn("Answer: 3\n<tool_call> Answer: 18") == "Answer: 3"     # an unclosed call is a call
    q3 = "".join(t for t, _ in chat.tool_turn("qwen3", ["18"]))
    assert chat.final_turn("<think>\n\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>" + q3 + "Answer: 2",
                           "qwen3") == "Answer: 2"
    assert chat.final_turn(None) is None


def test_ifeval_checks_the_final_turn():
    prompt = "Write about cats. Use only lowercase letters."
    assert ifeval.parse(prompt), "the prompt must carry a constraint the checker reads"
    tail = "".join(t for t, _ in chat.tool_turn("qwen2.5", ["lowercase result"]))
    lower = "<tool_call>\n{\"name\": \"c\", \"arguments\": {}}\n</tool_call><|im_end|>" + tail + "cats are nice"
    upper = "<tool_call>\n{\"name\": \"c\", \"arguments\": {}}\n</tool_call><|im_end|>" + tail + "CATS ARE NICE"
    assert ifeval.strict([prompt] * 2, [lower, upper]) == [1.0, 0.0]


# ---- data rows with tool turns ------------------------------------------------------------------------------

def calc_call(expression):
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def schemas():
    from nano_rlhf.tools import load_tools
    return load_tools("calculator").schemas


def tool_row():
    q = {"role": "user", "content": "What is (3+4)*2?"}
    return {"messages": [q, {"role": "assistant", "content": "", "tool_calls": [calc_call("(3+4)*2")]},
                         {"role": "tool", "content": "TOOLSAYS 14"}, {"role": "assistant", "content": "It is 14."}],
            "tools": schemas()}


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_sft_trains_on_the_calls_and_answers_never_on_the_tool_results(name, tmp_path):
    import json
    from test_chat_templates import build
    from nano_rlhf.data import load_records, tokenize_sft
    _, tok, hf = build(name, tmp_path)
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(tool_row()) + "\n")
    (rec,) = load_records(str(path), "sft")
    [(ids, mask)], st = tokenize_sft([rec], tok, 4096)
    assert st["kept"] == 1
    # the ids are the template's rendering (transformers' apply_chat_template with the same tools)
    assert tok.tk.decode(ids, skip_special_tokens=False) == hf.apply_chat_template(
        rec["messages"], tools=rec["tools"], tokenize=False, **({"date_string": "26 Jul 2024"} if "llama" in name
                                                                else {}))
    trained = tok.tk.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    call = chat.assistant_text(tok.chat_template, "", rec["messages"][1]["tool_calls"])
    assert trained == call + chat.END_OF_TURN[tok.chat_template] + "It is 14." + chat.END_OF_TURN[tok.chat_template]
    assert "TOOLSAYS" in tok.tk.decode(ids) and "TOOLSAYS" not in trained


BAD_TOOL_ROWS = [  # (kind, row, expected words): each one `FILE:LINE: ...` line naming the field
    ("sft", {"messages": [{"role": "tool", "content": "14"}, {"role": "assistant", "content": "a"}]},
     "messages[0]: a 'tool' result with no tool call"),
    ("sft", {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "", "tool_calls": [calc_call("1")]},
                          {"role": "tool", "content": "1"}, {"role": "tool", "content": "1"}]},
     "messages[3]: a 'tool' result with no tool call"),
    ("sft", {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function":
                                                                              {"arguments": {}}}]}]},
     "messages[1].tool_calls[0].function: missing field 'name'"),
    ("sft", {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "tool_calls": [{"name": 'x", "y', "arguments": {}}]}]},
     "messages[1].tool_calls[0].name: a call needs"),
    ("sft", {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "tool_calls": [{"name": "c", "arguments": '{"a": 1}'}]}]},
     "tool_calls[0].arguments: must be a JSON object, got str (OpenAI's wire form"),
    ("sft", {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "tool_calls": [{"name": "c", "arguments": [1]}]}]},
     "tool_calls[0].arguments: must be a JSON object, got list"),
    ("sft", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"name": "c"}]}]},
     "tool_calls[0]: missing field 'arguments'"),
    ("sft", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": []}]},
     "messages[1].tool_calls: must be a non-empty list"),
    ("sft", {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "tool_calls": [{"type": "code", "name": "c", "arguments": {}}]}]},
     "tool_calls[0].type: only \"function\""),
    ("sft", {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "", "tool_calls": [calc_call("1"), calc_call("2")]},
                          {"role": "tool", "content": "1"}, {"role": "user", "content": "and?"},
                          {"role": "assistant", "content": "2"}]},
     "messages[1] makes 1 tool call(s) that get no 'tool' result before messages[3] (user)"),
    ("sft", {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "", "tool_calls": [calc_call("1")]},
                          {"role": "tool", "content": {"value": 1}}, {"role": "assistant", "content": "1"}]},
     "messages[2]: field 'content' must be a string"),
    ("sft", {"messages": [{"role": "user", "content": "q", "tool_calls": [calc_call("1")]},
                          {"role": "assistant", "content": "1"}]}, "messages[0]: a user message with 'tool_calls'"),
    ("sft", dict(tool_row(), tools=[{"type": "function", "function": {"name": "search"}}]),
     "tool_calls[0].function.name: 'calculator' is not one of the row's tools (search)"),
    ("sft", dict(tool_row(), tools=[{"type": "function"}]), "tools[0] must be a JSON schema"),
    ("sft", dict(tool_row(), tools=schemas() * 2), "tools[1]: two tools named 'calculator'"),
    ("sft", dict(tool_row(), tools=[{"type": "function", "function": {"name": "calculator", "parameters": "x"}}]),
     "tools[0] (calculator): 'parameters' must be a JSON schema object"),
    ("sft", dict(tool_row(), tools=[{"name": "calculator", "parameters": {"properties": {"expression": "string"}}}]),
     "tools[0] (calculator): 'parameters' must be a JSON schema object"),
    ("sft", dict(tool_row(), tools=[{"name": "calculator", "description": ["Evaluate"]}]),
     "and 'description' a string"),
    ("preference", {"prompt": [{"role": "user", "content": "q"},
                               {"role": "assistant", "content": "", "tool_calls": [calc_call("1")]}],
                    "chosen": [{"role": "assistant", "content": "1"}], "rejected": [{"role": "assistant",
                                                                                    "content": "2"}]},
     "field 'prompt' ends with 1 tool call(s) that get no 'tool' result"),
    ("preference", {"prompt": "q", "chosen": "a", "rejected": "b", "tools": schemas()},
     "field 'tools' needs a conversational row"),
    ("preference", {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "tool", "content": "1"}],
                    "rejected": [{"role": "assistant", "content": "2"}]}, "chosen[0].role: must be 'assistant'"),
    ("prompts", {"prompt": [{"role": "user", "content": "q"}], "tools": schemas()},
     "field 'tools' in a prompts row: the tools a rollout may call are the script's --tools"),
]


@pytest.mark.parametrize("kind,row,words", BAD_TOOL_ROWS)
def test_bad_tool_turns_are_one_line_naming_file_line_and_field(tmp_path, kind, row, words):
    import json
    from nano_rlhf.data import DataError, load_records
    path = tmp_path / "d.jsonl"
    good = [tool_row()] if kind == "sft" else []          # an SFT file's good tool row first: it is read
    path.write_text("".join(json.dumps(r) + "\n" for r in good + [row]))
    line = len(good) + 1
    with pytest.raises(DataError) as e:
        load_records(str(path), kind)
    assert str(e.value).startswith(f"{path}:{line}: ") and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_row_llama_cannot_render_is_a_data_error_naming_it(tmp_path):
    import json
    from test_chat_templates import build
    from nano_rlhf.data import DataError, load_records, tokenize_sft
    _, tok, _ = build("llama3.1", tmp_path)
    row = tool_row()
    row["messages"][1]["tool_calls"].append(calc_call("1+1"))
    row["messages"].insert(3, {"role": "tool", "content": "2"})
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:1: Llama 3 writes one tool call per assistant turn"):
        tokenize_sft(load_records(str(path), "sft"), tok, 4096)


def test_huge_arguments_and_results_are_read_and_fall_to_the_over_long_rule(tmp_path):
    import json
    from test_chat_templates import build
    from nano_rlhf.data import load_records, tokenize_sft
    _, tok, _ = build("qwen2.5", tmp_path)
    big = tool_row()
    big["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"] = "1+" * 100_000 + "1"
    big_last = dict(big, messages=big["messages"][:2])          # the call is the final turn: the response
    result = tool_row()
    result["messages"][2]["content"] = "9" * 200_000
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (big, big_last, result, tool_row())))
    recs = load_records(str(path), "sft")
    ex, st = tokenize_sft(recs, tok, 1024)
    # SFT's over-long rule: a huge final call is the response (dropped: it does not fit); a huge earlier call or
    # result is before the final trained span, cut from the left
    assert (st["kept"], st["dropped"], st["truncated"]) == (3, 1, 2)
    assert all(len(ids) <= 1024 for ids, _ in ex)


def test_dpo_log_probs_of_a_pair_with_tool_turns_sum_its_assistant_tokens_only(tmp_path):
    """The same pair with and without the prompt's tool turns (call, result): the tool turns change the
    context, so the log-probs differ, but add no scored token; each row's S equals a float64 sum over the
    response tokens of an independent full-sequence forward."""
    import json
    import torch
    import train_dpo
    from test_chat_templates import build
    from nano_rlhf.data import collate_pairs, load_records, tokenize_pairs
    from nano_rlhf.model import GPT, GPTConfig
    _, tok, _ = build("qwen2.5", tmp_path)
    msgs = tool_row()["messages"]
    with_tools = {"prompt": msgs[:3], "chosen": [msgs[3]], "rejected": [{"role": "assistant", "content": "It is 15."}],
                  "tools": schemas()}
    without = dict(with_tools, prompt=msgs[:1])
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(with_tools) + "\n" + json.dumps(without) + "\n")
    recs = load_records(str(path), "preference")
    assert recs[0]["tools"] == recs[1]["tools"] == schemas()
    pairs, st = tokenize_pairs(recs, tok, 4096)
    assert st["kept"] == 2 and pairs[0]["chosen"] == pairs[1]["chosen"] and pairs[0]["rejected"] == pairs[1]["rejected"]
    assert "TOOLSAYS 14" in tok.tk.decode(pairs[0]["prompt"]) and len(pairs[0]["prompt"]) > len(pairs[1]["prompt"])
    ids, attn, resp, _ = collate_pairs(pairs, tok.pad_id)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=ids.shape[1], n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():
        s, length = train_dpo.sequence_logps(model, ids, attn, resp)
        logits = model(ids, attn).double()
    n_scored = [len(p[k]) for k in ("chosen", "rejected") for p in pairs]    # collate_pairs: chosen rows first
    assert length.tolist() == n_scored and n_scored[0] == n_scored[1]
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    oracle = (logp * resp[:, 1:].double()).sum(1)
    # float32 log-softmax and a sum of ~6 terms of size ~5 against float64: 10 × the suite's float32 tolerance
    torch.testing.assert_close(s.double(), oracle, rtol=0, atol=10 * FLOAT32_ATOL)
    # row 0 (with tool turns) and row 1 (without) score the same tokens in different contexts
    assert abs(s[0] - s[1]) > 1e-3 and abs(s[2] - s[3]) > 1e-3
    # no tool-turn token is scored: the scored ids of each row are exactly its response's ids
    for r in range(4):
        assert ids[r][resp[r].bool()].tolist() == (pairs + pairs)[r]["chosen" if r < 2 else "rejected"]


def test_arguments_nested_past_the_encoders_depth_are_a_data_error(tmp_path):
    """The parser reads nesting close to the recursion limit; json.dumps (the template's tojson) then runs a
    few frames deeper, inside a training script's stack: that row is refused by name, never a traceback."""
    import inspect
    import json
    import sys
    from test_chat_templates import build
    from nano_rlhf.data import DataError, load_records, tokenize_sft
    _, tok, _ = build("qwen2.5", tmp_path)
    row = tool_row()
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"a": json.loads("[" * 300 + "]" * 300)}
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(row) + "\n")
    recs = load_records(str(path), "sft")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 200)       # as if the stack were 100s of frames deeper
    try:
        with pytest.raises(DataError, match=rf"^{path}:1: JSON nested too deeply to render$"):
            tokenize_sft(recs, tok, 4096)
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_a_response_may_be_a_call(name, tmp_path):
    """Preferring one call to another: chosen and rejected are assistant turns holding calls (no result: the
    response ends with its call), scored token for token as the template writes them."""
    import json
    from test_chat_templates import build
    from nano_rlhf.data import load_records, tokenize_pairs
    _, tok, _ = build(name, tmp_path)
    row = {"prompt": [{"role": "user", "content": "What is (3+4)*2?"}], "tools": schemas(),
           "chosen": [{"role": "assistant", "content": None, "tool_calls": [calc_call("(3+4)*2")]}],
           "rejected": [{"role": "assistant", "content": None, "tool_calls": [calc_call("3+4*2")]}]}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (pair,), _ = tokenize_pairs(load_records(str(path), "preference"), tok, 4096)
    for k, e in (("chosen", "(3+4)*2"), ("rejected", "3+4*2")):
        text = chat.assistant_text(tok.chat_template, "", [calc_call(e)]) + chat.END_OF_TURN[tok.chat_template]
        assert tok.tk.decode(pair[k], skip_special_tokens=False) == text


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_responses_with_tool_turns_score_the_assistant_tokens_only(name, tmp_path):
    """A preference (or listwise) response may be a whole tool use: call, result, answer. Its scored tokens are
    the assistant turns' (call, answer, end-of-turn tokens); the result and the template text around it are
    context. The unpaired kinds keep responses to assistant messages (their collates score every token)."""
    import json
    from test_chat_templates import build
    from nano_rlhf.data import DataError, collate_listwise, collate_pairs, load_records, tokenize_listwise, \
        tokenize_pairs
    _, tok, _ = build(name, tmp_path)
    msgs = tool_row()["messages"]
    row = {"prompt": msgs[:1], "chosen": msgs[1:], "rejected": [{"role": "assistant", "content": "It is 15."}],
           "tools": schemas()}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (pair,), _ = tokenize_pairs(load_records(str(path), "preference"), tok, 4096)
    ids, _, resp, _ = collate_pairs([pair], tok.pad_id)
    eot = chat.END_OF_TURN[tok.chat_template]
    want = chat.assistant_text(tok.chat_template, "", msgs[1]["tool_calls"]) + eot + "It is 14." + eot
    assert tok.tk.decode(ids[0][resp[0].bool()].tolist(), skip_special_tokens=False) == want
    assert "TOOLSAYS" in tok.tk.decode(pair["chosen"]) and "rejected_mask" not in pair
    assert resp[1].sum() == len(pair["rejected"])
    lw = tmp_path / "lw.jsonl"
    lw.write_text(json.dumps({"prompt": msgs[:1], "completions": [msgs[1:], row["rejected"]], "scores": [1, 0],
                              "tools": schemas()}) + "\n")
    (ex,), _ = tokenize_listwise(load_records(str(lw), "listwise"), tok, 4096)
    ids2, _, resp2, _, _ = collate_listwise([ex], tok.pad_id)
    assert tok.tk.decode(ids2[0][resp2[0].bool()].tolist(), skip_special_tokens=False) == want
    bad = tmp_path / "u.jsonl"
    bad.write_text(json.dumps({"prompt": msgs[:1], "completion": msgs[1:], "label": True}) + "\n")
    with pytest.raises(DataError, match=r"u.jsonl:1: completion\[1\].role: must be 'assistant' \(a response\)"):
        load_records(str(bad), "unpaired")
    path.write_text(json.dumps(dict(row, chosen=msgs[1:3])) + "\n")
    with pytest.raises(DataError, match="field 'chosen' ends with a tool result"):
        load_records(str(path), "preference")
