"""Tool turns where data and rewards meet: the built-in verifiers score only the policy's final answer of a
multi-turn transcript; data rows with tool calls and tool results are validated, trained on the assistant's
turns only, and read as preference prompts."""
import pytest

from nano_rlhf import chat, ifeval, reasoning

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
