"""Chat templates of real model families, rendered in Python (no Jinja engine at run time).

A HF tokenizer directory carries its chat template as Jinja text. nano_rlhf does not execute it: it
recognises the family by the text (`detect`) and renders conversations with a Python copy of that family's
rules (`render`), which the tests check against transformers' `apply_chat_template` on the real template
texts. Only system / user / assistant messages are rendered (no tools), as the data format allows.

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
"""
import datetime
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
           date_string: str = None) -> Segments:
    """Segments of `messages` as the family's template renders them (see the module docstring)."""
    if variant == "qwen3":
        return _qwen3(messages, add_generation_prompt)
    if variant == "llama3":
        return _llama3(messages, add_generation_prompt, bos, date_string or today())
    if variant in CHATML:
        return _chatml(messages, add_generation_prompt, DEFAULT_SYSTEM.get(variant))
    raise ValueError(f"no renderer for chat template {variant!r}")


def _chatml_turn(role, content):
    return [(f"<|im_start|>{role}\n{content}<|im_end|>\n", False)]


def _assistant_turn(content):
    return [("<|im_start|>assistant\n", False), (content + "<|im_end|>", True), ("\n", False)]


def _chatml(messages, gen, default_system):
    out = []
    if default_system and messages and messages[0]["role"] != "system":
        out += _chatml_turn("system", default_system)
    for m in messages:
        out += _assistant_turn(m["content"]) if m["role"] == "assistant" else _chatml_turn(m["role"], m["content"])
    if gen:
        out.append(("<|im_start|>assistant\n", False))
    return out


def _qwen3(messages, gen):
    out = []
    if messages and messages[0]["role"] == "system":
        out += _chatml_turn("system", messages[0]["content"])
    last_query = len(messages) - 1          # the last user message that is not a wrapped tool response
    for i in range(len(messages) - 1, -1, -1):
        c = messages[i]["content"]
        if messages[i]["role"] == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            last_query = i
            break
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "user" or (role == "system" and i > 0):
            out += _chatml_turn(role, content)
        elif role == "assistant":
            reasoning = ""
            if m.get("reasoning_content") is not None:
                reasoning = m["reasoning_content"]
            elif "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == len(messages) - 1 or reasoning):
                content = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
            out += _assistant_turn(content)
    if gen:
        out.append(("<|im_start|>assistant\n", False))
    return out


def _llama3(messages, gen, bos, date_string):
    system = ""
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"].strip(), messages[1:]
    out = [(bos + "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            f"Today Date: {date_string}\n\n{system}<|eot_id|>", False)]
    for m in messages:
        head = f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
        if m["role"] == "assistant":
            out += [(head, False), (m["content"].strip() + "<|eot_id|>", True)]
        else:
            out.append((head + m["content"].strip() + "<|eot_id|>", False))
    if gen:
        out.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", False))
    return out


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
