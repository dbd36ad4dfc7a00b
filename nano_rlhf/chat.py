"""Chat templates of real model families, rendered in Python (no Jinja engine at run time).

A HF tokenizer directory carries its chat template as Jinja text. nano_rlhf does not execute it: it
recognises the family by the text (`detect`) and renders conversations with a Python copy of that family's
rules (`render`), which the tests check against transformers' `apply_chat_template` on the real template
texts. Messages are system / user / assistant, plus tool calls and tool results (last section below).

| variant   | models           | turn                                                | quirks                    |
|-----------|------------------|-----------------------------------------------------|---------------------------|
| `chatml`  | any ChatML       | `<|im_start|>{role}\\n{content}<|im_end|>\\n`         | none                      |
| `smollm2` | SmolLM2-Instruct | ChatML                                              | default system prompt     |
| `qwen2.5` | Qwen2.5-Instruct | ChatML                                              | default system prompt     |
| `qwen3`   | Qwen3            | ChatML                                              | thinking blocks (below)   |
| `llama3`  | Llama 3.1 / 3.2  | `<|start_header_id|>{role}<|end_header_id|>\\n\\n`    | bos, dated system header  |
|           |                  | `{content}<|eot_id|>`                               |                           |

A rendering is a list of segments (text, trainable). Trainable segments are what the model must write
after the generation prompt: an assistant turn's content and the end-of-turn token that closes it
(`<|im_end|>` / `<|eot_id|>`). The generation prompt (`<|im_start|>assistant\\n`, `<|start_header_id|>assistant
<|end_header_id|>\\n\\n`) and the "\\n" ChatML writes after `<|im_end|>` are context.

Qwen3: the last assistant turn after the last user message is rendered `<think>\\n\\n</think>\\n\\n{content}`
(an empty thinking block when the data has none) while the generation prompt stops at `assistant\\n`, so
the block belongs to the trained completion; `<think>...</think>` is stripped from earlier assistant turns.
Llama 3: the rendering starts with the bos text and always has a system header with "Cutting Knowledge
Date: December 2023" and "Today Date: {date_string}" (Llama 3.1's template defaults to 26 Jul 2024, 3.2's
to the current date); no newline follows `<|eot_id|>`.

Tools. `render(..., tools=schemas)` writes the tool list where the family's template does, and renders an
assistant message's `tool_calls` ([{"type": "function", "function": {"name", "arguments"}}], as transformers and
OpenAI write them; a bare {"name", "arguments"} is read too) and `tool` messages (Llama's `ipython` too):

- `qwen` syntax (qwen2.5, qwen3; smollm2, chatml, plain borrow it): the tool list in the system turn, one JSON
  schema a line (plain: signatures, below); a call `<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>`,
  several a turn, after the turn's text; results `\n<tool_response>\n{r}\n</tool_response>`, consecutive ones in one
  user turn.
- `llama` syntax (llama3): the tool list opens the first user turn, each schema JSON indented by 4, and the system
  header gains "Environment: ipython"; a call is the whole turn, `{"name": N, "parameters": {...}}`, one a turn;
  a result is an `ipython` turn holding the result JSON-quoted (`"14"`: the template tojson's a string too).

SmolLM2's and bare ChatML's templates have no tool section: they borrow Qwen2.5's syntax (SmolLM2 with its own
default system prompt, ChatML with none, as Qwen3), which those models were not trained on. The plain template
(nano_rlhf/tokenizer.py) writes a compact tool list in its system line (`plain_tools_text`: a signature a tool,
on one line), Qwen's calls, and `Tool: {r}` lines. Llama:
the template drops an assistant message's text when it holds a call, and a second call in a turn is refused.
`parse_tool_calls` reads an assistant turn's text back into calls; `tool_turn` gives the text between the end of
an assistant turn and the next generation (the result turn(s) and the generation prompt), as `render` writes it;
`final_turn` reads the policy's final answer out of a multi-turn transcript (what the built-in verifiers score).
"""
import datetime
import json
import re
from typing import List, Optional, Tuple

VARIANTS = ("auto", "chatml", "smollm2", "qwen2.5", "qwen3", "llama3", "plain")
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
DATE_FORMAT = "%d %b %Y"   # the Llama 3.2 template's strftime_now format, e.g. "23 Nov 2026"
CHATML = ("chatml", "smollm2", "qwen2.5", "qwen3")
END_OF_TURN = {v: "<|im_end|>" for v in CHATML} | {"llama3": "<|eot_id|>"}
# tokens a family writes as text: each must be one token of the tokenizer, or the rendering is garbage
TOKENS = {v: ("<|im_start|>", "<|im_end|>") for v in CHATML} | {
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")}
DEFAULT_SYSTEM = {"smollm2": SMOLLM2_SYSTEM, "qwen2.5": QWEN25_SYSTEM}

Segments = List[Tuple[str, bool]]


def today() -> str:
    return datetime.datetime.now().strftime(DATE_FORMAT)


# ---- recognising a template by its text ---------------------------------------------------------

_LITERAL = re.compile(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"", re.S)
# every string literal a bare ChatML template may contain; anything else (a default system prompt, tool
# instructions, thinking rules) means rules we do not render, so such a template is not taken as ChatML
_CHATML_LITERALS = {"<|im_start|>", "<|im_end|>", "\n", "<|im_end|>\n", "<|im_start|>assistant\n", "role",
                    "content", "system", "user", "assistant", ""}


# ... and every name: a bos_token, a trim filter, a loop.first default would all change the rendering
_CHATML_NAMES = {"for", "in", "endfor", "if", "endif", "message", "messages", "add_generation_prompt"}


def _literals(text: str) -> set:
    return {(a or b).replace("\\n", "\n") for a, b in _LITERAL.findall(text)}


def _names(text: str) -> set:
    """Names used in the template's {{ }} and {% %} blocks (string literals removed)."""
    blocks = re.findall(r"\{\{(.*?)\}\}|\{%(.*?)%\}", _LITERAL.sub("''", text), re.S)
    return set(re.findall(r"[A-Za-z_]\w*", " ".join(a or b for a, b in blocks)))


def detect(text: str) -> Tuple[Optional[str], Optional[str]]:
    """(variant, the template's own default date) of a Jinja template text; (None, None) if unknown."""
    if all(s in text for s in ("<|start_header_id|>", "<|eot_id|>", "Cutting Knowledge Date: December 2023",
                               "Today Date: ")):
        if "strftime_now" in text:                      # Llama 3.2: today's date
            return "llama3", None
        m = re.search(r"set\s+date_string\s*=\s*[\"']([^\"']+)[\"']", text)
        return "llama3", m.group(1) if m else None      # Llama 3.1: a fixed "26 Jul 2024"
    if "<|im_start|>" not in text or "<|im_end|>" not in text:
        return None, None
    if all(s in text for s in ("ns.last_query_index", "loop.last or (not loop.last and reasoning_content)",
                               "<think>")):
        return "qwen3", None
    if "<think>" in text:
        return None, None
    if QWEN25_SYSTEM in text:
        return "qwen2.5", None
    if SMOLLM2_SYSTEM in text:
        return "smollm2", None
    lit = _literals(text)
    if "<|im_start|>assistant\n" in lit and lit <= _CHATML_LITERALS and _names(text) <= _CHATML_NAMES:
        return "chatml", None
    return None, None


# ---- rendering ----------------------------------------------------------------------------------

def render(variant: str, messages, add_generation_prompt: bool, bos: str = "",
           date_string: str = None, tools=None) -> Segments:
    """Segments of `messages` as the family's template renders them (see the module docstring); tools: the
    JSON schemas of the tools the model may call (None or empty: no tool list)."""
    if variant == "qwen3":
        return _qwen3(messages, add_generation_prompt, tools)
    if variant == "llama3":
        return _llama3(messages, add_generation_prompt, bos, date_string or today(), tools)
    if variant in CHATML:
        return _chatml(messages, add_generation_prompt, DEFAULT_SYSTEM.get(variant), tools)
    raise ValueError(f"no renderer for chat template {variant!r}")


def _chatml_turn(role, content):
    return [(f"<|im_start|>{role}\n{content}<|im_end|>\n", False)]


def _assistant_turn(content):
    return [("<|im_start|>assistant\n", False), (content + "<|im_end|>", True), ("\n", False)]


def _tools_system(messages, default_system, tools):
    """Qwen's system turn with the tool list: the system message (else the default one, else none) first."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else default_system
    return _chatml_turn("system", (system + "\n\n" if system else "") + tools_text(tools))


def _chatml(messages, gen, default_system, tools=None):
    out, first = [], 0
    if tools:
        out += _tools_system(messages, default_system, tools)
        first = int(bool(messages) and messages[0]["role"] == "system")
    elif default_system and messages and messages[0]["role"] != "system":
        out += _chatml_turn("system", default_system)
    for i, m in enumerate(messages[first:], first):
        if m["role"] == "assistant":
            out += _assistant_turn(assistant_text("qwen2.5", m.get("content") or "", m.get("tool_calls")))
        elif m["role"] == "tool":
            out += _tool_responses(messages, i)
        else:
            out += _chatml_turn(m["role"], m["content"])
    if gen:
        out.append(("<|im_start|>assistant\n", False))
    return out


def _tool_responses(messages, i):
    """Qwen: a run of consecutive tool messages is one user turn of <tool_response> blocks; message i's part."""
    open_ = "<|im_start|>user" if i == 0 or messages[i - 1]["role"] != "tool" else ""
    close = "<|im_end|>\n" if i == len(messages) - 1 or messages[i + 1]["role"] != "tool" else ""
    return [(open_ + "\n<tool_response>\n" + messages[i]["content"] + "\n</tool_response>" + close, False)]


def _qwen3(messages, gen, tools=None):
    out = []
    if tools:
        out += _tools_system(messages, None, tools)
    elif messages and messages[0]["role"] == "system":
        out += _chatml_turn("system", messages[0]["content"])
    last_query = len(messages) - 1          # the last user message that is not a wrapped tool response
    for i in range(len(messages) - 1, -1, -1):
        c = messages[i]["content"]
        if messages[i]["role"] == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            last_query = i
            break
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "user" or (role == "system" and i > 0):
            out += _chatml_turn(role, content)
        elif role == "tool":
            out += _tool_responses(messages, i)
        elif role == "assistant":
            reasoning = ""
            if m.get("reasoning_content") is not None:
                reasoning = m["reasoning_content"]
            elif "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            body = content
            if i > last_query and (i == len(messages) - 1 or reasoning):
                body = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
            if m.get("tool_calls"):     # the calls follow the text, after a newline only if there is text
                body += ("\n" if content else "") + "\n".join(call_text("qwen3", *_call(c)) for c in m["tool_calls"])
            out += _assistant_turn(body)
    if gen:
        out.append(("<|im_start|>assistant\n", False))
    return out


def _llama3(messages, gen, bos, date_string, tools=None):
    system = ""
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"].strip(), messages[1:]
    env = "Environment: ipython\n" if tools else ""
    out = [(bos + f"<|start_header_id|>system<|end_header_id|>\n\n{env}Cutting Knowledge Date: December 2023\n"
            f"Today Date: {date_string}\n\n{system}<|eot_id|>", False)]
    if tools:       # the tool list opens the first message after the system one, rendered as a user turn
        if not messages:
            raise ValueError("Llama 3 writes the tool list into the first user message: there is none")
        out.append(("<|start_header_id|>user<|end_header_id|>\n\n" + LLAMA_TOOLS_HEAD
                    + "".join(tojson(t, indent=4) + "\n\n" for t in tools) + messages[0]["content"].strip()
                    + "<|eot_id|>", False))
        messages = messages[1:]
    for m in messages:
        head = f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
        if m["role"] == "assistant":
            text = assistant_text("llama3", (m.get("content") or "").strip(), m.get("tool_calls"))
            out += [(head, False), (text + "<|eot_id|>", True)]
        elif m["role"] in ("tool", "ipython"):
            out.append(("<|start_header_id|>ipython<|end_header_id|>\n\n" + tojson(m["content"]) + "<|eot_id|>",
                        False))
        else:
            out.append((head + m["content"].strip() + "<|eot_id|>", False))
    if gen:
        out.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", False))
    return out


# ---- tool calls and tool results ----------------------------------------------------------------

TOOL_SYNTAX = {v: "qwen" for v in CHATML} | {"llama3": "llama", "plain": "qwen"}
QWEN_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                   "\"arguments\": <args-json-object>}\n</tool_call>")
LLAMA_TOOLS_HEAD = ("Given the following functions, please respond with a JSON for a function call with its proper "
                    "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function "
                    "name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n")


def tojson(x, indent=None) -> str:
    """The templates' `tojson` as transformers defines it: json.dumps keeping non-ASCII characters."""
    return json.dumps(x, ensure_ascii=False, indent=indent)


def tools_text(tools) -> str:
    """Qwen's tool section of the system turn (also SmolLM2's and ChatML's)."""
    return QWEN_TOOLS_HEAD + "".join("\n" + tojson(t) for t in tools) + QWEN_TOOLS_TAIL


def plain_tools_text(tools) -> str:
    """The plain template's tool list: `Tools: name(arg: type, opt?: type): description; ...`. The plain
    template serves models trained here from scratch, whose context is a few hundred tokens: Qwen's section
    (~900 characters for the calculator alone) would fill it, and such a model reads the list as a fixed string."""
    def signature(t):
        f = t.get("function", t)
        params = f.get("parameters", {})
        required = set(params.get("required", []))
        args = ", ".join(f"{a}{'' if a in required else '?'}: {spec.get('type', 'any')}"
                         for a, spec in params.get("properties", {}).items())
        about = " ".join(f.get("description", "").split())       # one line, whatever the docstring's layout
        return f"{f['name']}({args})" + (f": {about}" if about else "")
    return "Tools: " + "; ".join(signature(t) for t in tools)


def _call(tool_call):
    """(name, arguments) of a message's tool call, {"function": {...}} or bare {"name", "arguments"}."""
    f = tool_call.get("function", tool_call)
    return f["name"], f.get("arguments", {})


def call_text(variant: str, name: str, arguments) -> str:
    """One tool call as the assistant writes it. Arguments are written with tojson, except that Qwen3 writes
    a string as it is (its template does; Qwen2.5's quotes it)."""
    if TOOL_SYNTAX[variant] == "llama":
        return '{"name": "' + name + '", "parameters": ' + tojson(arguments) + "}"
    args = arguments if variant == "qwen3" and isinstance(arguments, str) else tojson(arguments)
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + args + "}\n</tool_call>"


def assistant_text(variant: str, content: str, tool_calls=None) -> str:
    """An assistant turn's text (after the generation prompt, before the end-of-turn token): its content,
    then its tool calls. Llama: the call alone (its template drops the text), one call a turn."""
    if not tool_calls:
        return content
    if TOOL_SYNTAX[variant] == "llama":
        if len(tool_calls) != 1:
            raise ValueError(f"Llama 3 writes one tool call per assistant turn, this one has {len(tool_calls)}")
        return call_text(variant, *_call(tool_calls[0]))
    return "\n".join(([content] if content else []) + [call_text(variant, *_call(c)) for c in tool_calls])


def tool_turn(variant: str, results) -> Segments:
    """What follows an assistant turn's end-of-turn token when its calls answered `results` (one string each),
    up to and including the next generation prompt, as `render` writes it: a list of (text, is_result) pieces,
    so that a caller can tokenize the results (untrusted text) apart from the template's own tokens."""
    if variant == "plain":     # the space goes with the result, as " 6" is one token of a BPE trained on "Tool: 6"
        return [p for r in results for p in (("Tool:", False), (" " + r, True), ("\n", False))] + \
            [("Assistant:", False)]
    if variant == "llama3":
        return [p for r in results for p in (("<|start_header_id|>ipython<|end_header_id|>\n\n", False),
                                             (tojson(r), True), ("<|eot_id|>", False))] + \
            [("<|start_header_id|>assistant<|end_header_id|>\n\n", False)]
    if variant not in CHATML:
        raise ValueError(f"no tool syntax for chat template {variant!r}")
    return [("\n<|im_start|>user", False)] + \
        [p for r in results for p in (("\n<tool_response>\n", False), (r, True), ("\n</tool_response>", False))] + \
        [("<|im_end|>\n<|im_start|>assistant\n", False)]


_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_tool_calls(variant: str, text: str) -> list:
    """The tool calls of an assistant turn's text (without its end-of-turn token), in the variant's syntax, in
    order: each {"name": str, "arguments": dict}, or {"error": why} for a malformed one. [] = no call (the
    turn is an answer). Qwen syntax: every <tool_call>...</tool_call> block (Qwen3: after the thinking block); an
    opened block never closed is malformed. Llama: a turn whose text starts with "{" (after an optional
    <|python_tag|>) is a call: one JSON object and nothing after it."""
    if TOOL_SYNTAX.get(variant) == "llama":
        s = text.strip()
        s = s[len("<|python_tag|>"):].lstrip() if s.startswith("<|python_tag|>") else s
        if not s.startswith("{"):
            return []
        obj, end, why = _read_json(s)
        if why:
            return [{"error": why}]
        if s[end:].strip():
            return [{"error": "malformed tool call: a turn holds one JSON object "
                              '{"name": ..., "parameters": {...}} and nothing after it'}]
        return [_checked_call(obj, "parameters")]
    if TOOL_SYNTAX.get(variant) != "qwen":
        raise ValueError(f"no tool syntax for chat template {variant!r}")
    if variant == "qwen3" and "</think>" in text:
        text = text.split("</think>")[-1]
    calls = []
    for m in _QWEN_CALL.finditer(text):
        body = m.group(1).strip()
        obj, end, why = _read_json(body)
        why = why or ("" if end == len(body) else "malformed tool call: text after the JSON object")
        calls.append({"error": why} if why else _checked_call(obj, "arguments"))
    if "<tool_call>" in _QWEN_CALL.sub("", text):
        calls.append({"error": "malformed tool call: <tool_call> without </tool_call>"})
    return calls


def _read_json(s):
    """(value, end, "") of the JSON value that starts s, or (None, 0, why): a model may write anything — bad
    syntax, an integer longer than Python converts, nesting deeper than the recursion limit."""
    try:
        obj, end = json.JSONDecoder().raw_decode(s)
        return obj, end, ""
    except json.JSONDecodeError as e:
        return None, 0, f"malformed tool call: not JSON ({e.msg} at character {e.pos})"
    except (ValueError, RecursionError) as e:
        return None, 0, f"malformed tool call: unreadable JSON ({type(e).__name__}: {str(e)[:80]})"


def _checked_call(obj, key):
    """A decoded call as {"name", "arguments"}, or {"error"} when it is not an object with a string name and
    an object of arguments (under `key`, or "arguments"/"parameters"; absent = none)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return {"error": f'malformed tool call: expected {{"name": "...", "{key}": {{...}}}}'}
    args = obj.get(key, obj.get("parameters" if key == "arguments" else "arguments", {}))
    if isinstance(args, str):               # the OpenAI form writes arguments as a JSON string
        decoded, end, why = _read_json(args.strip())
        args = decoded if not why and end == len(args.strip()) else args
    if not isinstance(args, dict):
        return {"error": f"malformed tool call: {key} of {obj['name']!r} must be a JSON object"}
    return {"name": obj["name"], "arguments": args}


def _after_tool_turn(variant: str) -> str:
    """The template text that follows a tool turn's last result and opens the next assistant turn (the end of
    what tool_turn writes): the mark after which a transcript's next assistant turn starts."""
    pieces = tool_turn(variant, ["\0"])
    last = max(i for i, (_, is_result) in enumerate(pieces) if is_result)
    return "".join(t for t, _ in pieces[last + 1:])


def final_turn(text: str, variant: str = None) -> str:
    """The policy's final answer in a completion: for a multi-turn transcript (Tokenizer.decode_turns: assistant
    turns and tool turns in the template's markup) the text of its last assistant turn, and of a single turn that
    turn; in both, without the turn's tool calls (a call is not an answer; a Llama turn that is a call is
    nothing). variant None: recognised from the markup (Llama's, then Qwen's, then plain's tool turns); a text
    with none is one turn, returned as it is but for Qwen-syntax calls (a single Llama turn is not read as a call:
    a JSON answer looks like one). The last assistant turn starts after the last tool turn's closing text: the sampler
    appends a tool turn whole with the next generation prompt or not at all, so a tool result that imitates the
    markup is always followed by the real one, and the text after the last mark is the policy's own."""
    if not isinstance(text, str):
        return text
    found = None
    for v in [variant] if variant else ["llama3", "qwen2.5", "plain"]:
        mark = _after_tool_turn(v)
        at = text.rfind(mark)
        # "\nAssistant:" alone is ordinary text: a plain transcript has a tool line before it
        if at >= 0 and (v != "plain" or "Tool: " in text[:at]):
            text, found = text[at + len(mark):], v
            break
    if found == "plain":
        text = text.lstrip(" ")        # the plain template writes "Assistant: " + the turn
    syntax = TOOL_SYNTAX.get(variant or found)
    # a Llama call is a whole turn of JSON: only where the markup is Llama's (an answer may be JSON too)
    if syntax == "llama" and any("error" not in c for c in parse_tool_calls("llama3", text)):
        return ""
    if syntax != "llama" and "<tool_call>" in text:
        text = re.sub(r"<tool_call>.*?(</tool_call>|$)", "", text, flags=re.S).strip("\n")
    return text


# ---- template texts nano_rlhf writes -------------------------------------------------------------
# When the variant was chosen by --chat_template rather than read from the tokenizer's own template, save()
# writes one of these, so AutoTokenizer's apply_chat_template on a trained model's directory renders what
# the model was trained on (tests check each against our renderer).

_CHATML_LOOP = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                "+ '<|im_end|>\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _with_default_system(text):
    return ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\n" + text
            + "<|im_end|>\\n' }}{%- endif %}" + _CHATML_LOOP)


_QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
    {%- if not ns.found and message.role == 'user' and not (message.content.startswith('<tool_response>')
        and message.content.endswith('</tool_response>')) %}
        {%- set ns.found = true %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}{%- set content = message.content %}{%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in message.content %}
            {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
            {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n')
                .split('<think>')[-1].lstrip('\\n') %}{%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or (not loop.last and reasoning_content)) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'
                + content.lstrip('\\n') }}
        {%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

_LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "DATE" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\nToday Date: "
    + date_string + "\\n\\n" + system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content']|trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""


def template_text(variant: str, date_string: str = None) -> str:
    """A Jinja text that renders like `variant` (Llama 3: with `date_string` as its default date)."""
    if variant == "chatml":
        return _CHATML_LOOP
    if variant in DEFAULT_SYSTEM:
        return _with_default_system(DEFAULT_SYSTEM[variant])
    if variant == "qwen3":
        return _QWEN3
    if variant == "llama3":
        return _LLAMA3.replace("DATE", date_string or today())
    raise ValueError(f"no template text for {variant!r}")
