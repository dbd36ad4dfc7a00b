"""Tools a policy may call in its rollouts: user functions loaded like rewards, their JSON schemas, the built-in
calculator, and the worker processes that run a call under a time limit and an output cap.

    from nano_rlhf.tools import load_tools
    box = load_tools("calculator,my_tools.py:TOOLS")      # built-in names and module:NAME / file.py:NAME specs
    box.schemas            # [{"type": "function", "function": {...}}, ...]: render(..., tools=box.schemas)
    box.run([{"name": "calculator", "arguments": {"expression": "2*(3+4)"}}])    # -> [ToolResult("14", "ok")]
    box.close()

A spec's NAME is a list (or tuple) of functions, or one function, with a type hint on every argument and a
Google-style docstring whose `Args:` section describes each argument: the schema the model reads is built from
them (`json_schema`, the same dictionary transformers' `get_json_schema` builds). A function answers a string
(given as it is), a JSON value (given as JSON) or anything else (given as str()).

Trust model. A user's tool is trusted code, like a --reward function: it is imported into this process (to read
its schema) and into each worker, and can do anything the run can. The arguments the model writes are untrusted
input: every call goes through the same checks before any user code sees it, and a malformed call (not JSON,
no name), an unknown tool, missing, extra or mistyped arguments (checked against the schema), a tool that
raises, calls sys.exit, kills its process, runs past the time limit or answers more than the output cap
becomes a result `error: ...` that the model reads in its tool turn, and is counted in `box.counts` by kind;
none of them raises here or stops the run.

Limits, and exactly what they cover. User tools run in worker processes (`workers` of them, started with
forkserver where the platform has it, else spawn, so nothing of the trainer's state, CUDA included, is forked
into them); a call that has not answered within `timeout_s` seconds of being sent has its worker killed with
SIGKILL (its whole process group: the worker starts its own session) and a new worker started. So a tool looping
in pure Python, in C code holding the GIL, sleeping, or blocked on I/O is interrupted, and so are processes it
started in that group. Not interrupted or undone: processes that leave the group (their own setsid, daemons),
side effects already done (files written, requests sent). Not limited: the memory a tool allocates, and what it
prints (it goes to the run's own output). The output cap (`max_output_chars`) is checked in the worker before the
answer is sent, and the parent reads at most that many bytes (x4, UTF-8) from the pipe. The built-in calculator
runs in this process: it is our code, and its bounds (below) keep each call under a millisecond.
"""
import enum
import inspect
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import time
import types
import typing
from collections import Counter, deque
from fractions import Fraction
from typing import Any, NamedTuple

from . import chat
from .reward import code_file, load_object
from .training import fail

FLAG = "--tools"
TIMEOUT_S = 10.0            # per call
MAX_OUTPUT_CHARS = 4096     # per answer: about a thousand tokens of context
START_TIMEOUT_S = 120.0     # a worker's start-up: fork (or spawn) + importing the user's modules


class ToolResult(NamedTuple):
    """One call's answer as the model reads it, and its kind: "ok", or why it is an error ("malformed",
    "unknown", "arguments", "raised", "exited", "died", "timeout", "too_long")."""
    text: str
    kind: str

    @property
    def ok(self):
        return self.kind == "ok"


# ---- JSON schemas from type hints and docstrings --------------------------------------------------

class SchemaError(ValueError):
    """A function that cannot be offered as a tool (no docstring, an argument without hint or description)."""


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null",
               list: "array", tuple: "array", dict: "object"}


def _hint_schema(hint) -> dict:
    """The JSON schema of one type hint (the mapping transformers' get_json_schema uses)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return {}
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_schema([m.value for m in hint])
        if hint in _JSON_TYPES:
            return {"type": _JSON_TYPES[hint]}
        raise SchemaError(f"type hint {hint!r} has no JSON type (use int, float, str, bool, list, dict, tuple, "
                          "Literal, Optional or Union of those)")
    if origin is typing.Union or origin is getattr(types, "UnionType", None):
        subs = [_hint_schema(a) for a in args if a is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(set(s) == {"type"} and isinstance(s["type"], str) for s in subs):
            names = sorted({s["type"] for s in subs})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subs}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal:
        return _enum_schema(list(args))
    if origin is list:
        return {"type": "array", "items": _hint_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise SchemaError(f"type hint {hint!r}: a tuple needs two or more fixed element types (else use list)")
        return {"type": "array", "prefixItems": [_hint_schema(a) for a in args]}
    if origin is dict:
        return {"type": "object", "additionalProperties": _hint_schema(args[1])} if len(args) == 2 else \
            {"type": "object"}
    raise SchemaError(f"type hint {hint!r} has no JSON type")


def _enum_schema(values):
    bad = [v for v in values if type(v) not in (int, float, str, bool, type(None))]
    if not values or bad:
        raise SchemaError(f"choices {values!r} must be JSON scalars")
    types = list(dict.fromkeys(_JSON_TYPES[type(v)] for v in values))
    return {"type": types[0] if len(types) == 1 else types, "enum": values}


_SECTION = re.compile(r"^\s*(Args|Arguments|Returns|Raises|Yields|Examples?|Notes?):\s*$")
_ARG = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def parse_docstring(doc: str):
    """A Google-style docstring -> (description, {argument: description}, returns description or None).

    The description is the text before the first section header; an argument's description is the text after
    `name:` (or `name (type):`) and its more-indented continuation lines, joined by single spaces."""
    lines = inspect.cleandoc(doc).splitlines()
    description, sections, current = [], {}, None
    for line in lines:
        m = _SECTION.match(line)
        if m:
            current = {"Arguments": "Args"}.get(m.group(1), m.group(1))
            sections[current] = []
        elif current is None:
            description.append(line)
        else:
            sections[current].append(line)
    args, name, indent = {}, None, None
    for line in sections.get("Args", []):
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        m = _ARG.match(line.strip())
        if m and (indent is None or depth <= indent):
            name, indent = m.group(1), depth
            args[name] = m.group(2).strip()
        elif name is not None:
            args[name] = (args[name] + " " + line.strip()).strip()
    returns = " ".join(x.strip() for x in sections.get("Returns", []) if x.strip()) or None
    return "\n".join(description).strip(), args, returns


def json_schema(fn) -> dict:
    """{"type": "function", "function": {"name", "description", "parameters", ["return"]}} of a function, from
    its type hints and Google-style docstring; raises SchemaError naming what is missing. An argument
    description ending in `(choices: [JSON values])` becomes the argument's enum."""
    name = getattr(fn, "__name__", "")
    if not name.isidentifier():
        raise SchemaError(f"{fn!r} has no name a model can call (a lambda?): use a def")
    doc = inspect.getdoc(fn)
    if not doc:
        raise SchemaError(f"{name} has no docstring: the model reads its description from it")
    description, arg_docs, return_doc = parse_docstring(doc)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:      # a hint naming something undefined
        raise SchemaError(f"{name}: cannot read its type hints ({type(e).__name__}: {e})")
    props, required = {}, []
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        if i == 0 and p.name in ("self", "cls") and p.annotation is inspect.Parameter.empty:
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise SchemaError(f"{name}: argument {p.name} must be an ordinary named argument (a call passes JSON "
                              "keys by name)")
        if p.name not in hints:
            raise SchemaError(f"{name}: argument {p.name} has no type hint")
        if p.name not in arg_docs:
            raise SchemaError(f"{name}: the docstring's Args: section does not describe argument {p.name}")
        schema = _hint_schema(hints[p.name])
        desc = arg_docs[p.name]
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", desc, flags=re.IGNORECASE)
        if choices:
            try:
                schema["enum"] = json.loads(choices.group(1))
            except json.JSONDecodeError:
                raise SchemaError(f"{name}: the choices of {p.name} are not a JSON list: {choices.group(1)}")
            desc = desc[:choices.start()].strip()
        props[p.name] = dict(schema, description=desc)
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": props} | ({"required": required} if required else {})
    out = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:           # the model never writes it: a hint without a JSON type is left out
        try:
            out["return"] = _hint_schema(hints["return"]) | ({"description": return_doc} if return_doc else {})
        except SchemaError:
            pass
    return {"type": "function", "function": out}


# ---- checking the model's arguments against a schema ---------------------------------------------

def _type_name(v) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


def _mismatch(value, schema, where) -> str:
    """Why value does not fit schema ("" when it does)."""
    if value is None and schema.get("nullable"):
        return ""
    if "anyOf" in schema:
        return "" if any(not _mismatch(value, s, where) for s in schema["anyOf"]) else \
            f"{where} must be one of {json.dumps(schema['anyOf'])}, got {_type_name(value)}"
    if "enum" in schema and not any(type(value) is type(c) and value == c for c in schema["enum"]):
        return f"{where} must be one of {json.dumps(schema['enum'])}"
    kinds = schema.get("type")
    if kinds is None:
        return ""
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not any(_is(value, k) for k in kinds):
        return f"{where} must be {' or '.join(kinds)}, got {_type_name(value)}"
    if isinstance(value, list) and "items" in schema:
        return next((e for i, v in enumerate(value) if (e := _mismatch(v, schema["items"], f"{where}[{i}]"))), "")
    if isinstance(value, list) and "prefixItems" in schema:
        if len(value) != len(schema["prefixItems"]):
            return f"{where} must hold {len(schema['prefixItems'])} items, got {len(value)}"
        return next((e for i, (v, s) in enumerate(zip(value, schema["prefixItems"]))
                     if (e := _mismatch(v, s, f"{where}[{i}]"))), "")
    if isinstance(value, dict) and "additionalProperties" in schema:
        return next((e for k, v in value.items() if (e := _mismatch(v, schema["additionalProperties"],
                                                                      f"{where}[{k!r}]"))), "")
    return ""


def _is(value, kind) -> bool:
    if kind == "number":
        return type(value) in (int, float)
    return {"integer": int, "string": str, "boolean": bool, "null": type(None), "array": list,
            "object": dict}.get(kind) is type(value)


def check_arguments(schema: dict, arguments: dict) -> str:
    """Why `arguments` (decoded JSON) do not fit a tool's schema, in a few words; "" when they do."""
    params = schema["function"]["parameters"]
    props = params.get("properties", {})
    extra = [k for k in arguments if k not in props]
    if extra:
        return f"unexpected argument {extra[0]!r} (arguments: {', '.join(props) or 'none'})"
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"missing argument {missing[0]!r}"
    return next((e for k, v in arguments.items() if (e := _mismatch(v, props[k], f"argument {k!r}"))), "")


# ---- the built-in calculator ----------------------------------------------------------------------
# Exact rational arithmetic on Fractions by a recursive-descent parser: the expression is never evaluated as
# Python. Bounds, so that no call can take long or answer much: the expression's length, each literal's digits,
# the nesting depth, and every intermediate value's numerator and denominator (MAX_BITS); a power is refused
# BEFORE it is computed when its result would exceed them ((b-1)·n + 1 bits is a lower bound on a b-bit base to
# the n), so 9**9**9 is an error in microseconds.

MAX_EXPRESSION_CHARS = 500
MAX_LITERAL_DIGITS = 100
MAX_DEPTH = 50
MAX_BITS = 1024             # about 308 decimal digits, for a numerator and for a denominator

_TOKEN = re.compile(r"\s*(?:([0-9]+\.?[0-9]*|\.[0-9]+)|(\*\*|//|[-+*/%()]))")


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message is what the model reads)."""


class _Parser:
    """expr := term (("+" | "-") term)*;  term := factor (("*" | "/" | "//" | "%") factor)*;
    factor := ("+" | "-") factor | power;  power := atom ["**" factor];  atom := number | "(" expr ")".
    Python's precedence: -2**2 = -4, 2**-1 = 1/2, 2**3**2 = 2**9."""

    def __init__(self, text):
        self.tokens, pos = [], 0
        text = text.rstrip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m:
                c = text[pos:].lstrip()[0]
                hint = " (use ** for a power)" if c == "^" else ""
                raise CalculatorError(f"unexpected character {c!r} at position {len(text) - len(text[pos:].lstrip())}"
                                      f"{hint}: numbers, + - * / // % ** and parentheses only")
            if m.group(1) is not None and len(m.group(1).replace(".", "")) > MAX_LITERAL_DIGITS:
                raise CalculatorError(f"a number has more than {MAX_LITERAL_DIGITS} digits")
            self.tokens.append(("num", Fraction(m.group(1))) if m.group(1) is not None else ("op", m.group(2)))
            pos = m.end()
        self.i, self.depth = 0, 0

    def peek(self):
        return self.tokens[self.i][1] if self.i < len(self.tokens) and self.tokens[self.i][0] == "op" else None

    def take(self):
        self.i += 1
        return self.tokens[self.i - 1]

    def parse(self):
        if not self.tokens:
            raise CalculatorError("empty expression")
        value = self.expr()
        if self.i < len(self.tokens):
            raise CalculatorError(f"unexpected {self._shown(self.tokens[self.i])} after a complete expression")
        return value

    def expr(self):
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            value = _bounded(value + self.term() if op == "+" else value - self.term())
        return value

    def term(self):
        value = self.factor()
        while self.peek() in ("*", "/", "//", "%"):
            op, right = self.take()[1], self.factor()
            if op != "*" and right == 0:
                raise CalculatorError("division by zero")
            value = _bounded({"*": lambda: value * right, "/": lambda: value / right,
                              "//": lambda: Fraction(value // right), "%": lambda: value % right}[op]())
        return value

    def factor(self):
        if self.peek() in ("+", "-"):
            self._deeper()
            sign = self.take()[1]
            value = self.factor()
            self.depth -= 1
            return -value if sign == "-" else value
        return self.power()

    def power(self):
        base = self.atom()
        if self.peek() == "**":
            self.take()
            self._deeper()
            exponent = self.factor()
            self.depth -= 1
            return _power(base, exponent)
        return base

    def atom(self):
        if self.i >= len(self.tokens):
            raise CalculatorError("the expression ends too early")
        kind, value = self.take()
        if kind == "num":
            return value
        if value == "(":
            self._deeper()
            inner = self.expr()
            self.depth -= 1
            if self.peek() != ")":
                raise CalculatorError("a '(' is never closed")
            self.take()
            return inner
        raise CalculatorError(f"unexpected {self._shown((kind, value))}")

    def _deeper(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"nested more than {MAX_DEPTH} deep")

    @staticmethod
    def _shown(token):
        return f"'{token[1]}'" if token[0] == "op" else f"number {format_number(token[1])}"


def _bounded(x: Fraction) -> Fraction:
    if max(x.numerator.bit_length(), x.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError(f"a value is too large (more than {MAX_BITS} bits, about {int(MAX_BITS * 0.30103)} "
                              "digits)")
    return x


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("a power needs a whole exponent (the calculator is exact)")
    n = exponent.numerator
    if base == 0 and n < 0:
        raise CalculatorError("division by zero")
    if n == 0 or base == 1:
        return Fraction(1)
    if base == 0:
        return Fraction(0)
    if base == -1:
        return Fraction(-1 if n % 2 else 1)
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if (bits - 1) * abs(n) + 1 > MAX_BITS:
        raise CalculatorError(f"a power is too large (more than {MAX_BITS} bits, about {int(MAX_BITS * 0.30103)} "
                              "digits)")
    return _bounded(base ** n)


def format_number(x: Fraction) -> str:
    """An exact value as text: an integer, a terminating decimal (denominator 2^a·5^b) or a fraction p/q."""
    if x.denominator == 1:
        return str(x.numerator)
    d, twos, fives = x.denominator, 0, 0
    while d % 2 == 0:
        d, twos = d // 2, twos + 1
    while d % 5 == 0:
        d, fives = d // 5, fives + 1
    if d != 1:
        return f"{x.numerator}/{x.denominator}"
    places = max(twos, fives)
    digits = str(abs(x.numerator) * 10 ** places // x.denominator).rjust(places + 1, "0")
    return ("-" if x < 0 else "") + digits[:-places] + "." + digits[-places:]


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 12 / 5"
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    return format_number(_Parser(expression).parse())


BUILTIN = {"calculator": calculator}


# ---- running calls ------------------------------------------------------------------------------

def _as_text(out) -> str:
    """A tool's answer as text: a string as it is, a JSON value as JSON, anything else as str(); lone
    surrogates (which no tokenizer encodes) replaced."""
    if not isinstance(out, str):
        try:
            out = json.dumps(out, ensure_ascii=False)
        except (TypeError, ValueError):
            out = str(out)
    return out.encode("utf-8", "replace").decode("utf-8")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _load_specs(specs):
    """{name: function} of the user specs (each NAME a function or a list/tuple of functions)."""
    found = {}
    for spec in specs:
        _, obj = load_object(spec, FLAG, "a built-in tool name (calculator), module:NAME or path/to/file.py:NAME")
        fns = list(obj) if isinstance(obj, (list, tuple)) else [obj]
        for fn in fns:
            if not callable(fn):
                fail(f"{FLAG} {spec}: holds a {type(fn).__name__}, not a function")
            found.setdefault(getattr(fn, "__name__", ""), []).append((spec, fn))
    return found


def _serve(specs, conn, max_chars):
    """A worker: load the user's tools, answer {"name", "arguments"} requests with {"kind", "text"} (JSON both
    ways), until the parent closes the pipe."""
    if hasattr(os, "setsid"):
        os.setsid()             # its own process group: a kill reaches what the tool starts
    try:
        tools = {name: fns[0][1] for name, fns in _load_specs(specs).items()}
    except SystemExit:          # the parent loaded the same specs without error: something changed on disk
        conn.send_bytes(json.dumps({"kind": "fatal", "text": "the tools no longer load"}).encode())
        return
    conn.send_bytes(b'{"kind": "ready", "text": ""}')
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        name = request["name"]
        try:
            text, kind = _as_text(tools[name](**request["arguments"])), "ok"
            if len(text) > max_chars:
                text, kind = f"error: {name} answered {len(text):,} characters, more than the {max_chars:,} " \
                             "allowed", "too_long"
        except SystemExit as e:
            text, kind = f"error: {name} called sys.exit({e.code!r})", "exited"
        except BaseException as e:      # KeyboardInterrupt too: the tool's, not the run's
            text, kind = f"error: {name} raised {type(e).__name__}: {_first_line(e)}", "raised"
        conn.send_bytes(json.dumps({"kind": kind, "text": text}, ensure_ascii=False).encode())


class _Worker:
    def __init__(self, ctx, specs, max_chars):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(list(specs), child, max_chars), daemon=True)
        self.proc.start()
        child.close()
        self.max_bytes = 6 * max_chars + 4096     # JSON: at most 6 bytes a character (\u0001), plus the rest
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            fail(f"{FLAG}: a tool worker process did not start within {START_TIMEOUT_S:.0f} s")
        hello = self._receive()
        if hello is None or hello["kind"] != "ready":
            self.kill()
            fail(f"{FLAG}: a tool worker process could not load the tools "
                 f"({hello['text'] if hello else 'it ended'})")

    def _receive(self):
        try:
            return json.loads(self.conn.recv_bytes(self.max_bytes))
        except (EOFError, OSError, ValueError):
            return None

    def kill(self):
        if self.proc.is_alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (AttributeError, OSError):       # no process groups here, or it has not made its own yet
                self.proc.kill()
        self.proc.join()
        self.conn.close()


class ToolBox:
    """The tools of a run: their schemas (what the model reads) and `run(calls)` (what it gets back).
    Built-in tools run here; user tools in `workers` worker processes, started at the first call. With one
    worker (the default) a batch's calls run one after another in order; with more, concurrently (for tools
    that do not depend on each other's effects). A tool should be a function of its arguments: a worker's module
    state is its own and is lost when a timeout restarts it."""

    def __init__(self, specs=(), builtins=(), timeout_s=TIMEOUT_S, max_output_chars=MAX_OUTPUT_CHARS, workers=1):
        self.specs, self.timeout_s, self.max_output_chars = list(specs), float(timeout_s), int(max_output_chars)
        self.builtin = {name: BUILTIN[name] for name in builtins}
        user = _load_specs(self.specs)
        for name, fns in user.items():
            if len(fns) > 1 or name in self.builtin:
                fail(f"{FLAG}: two tools are named {name!r} ({', '.join(s for s, _ in fns)}"
                     f"{', built-in' if name in self.builtin else ''})")
        self.functions = dict(self.builtin) | {name: fns[0][1] for name, fns in user.items()}
        schemas = {}
        for name, fn in self.functions.items():
            try:
                schemas[name] = json_schema(fn)
            except SchemaError as e:
                fail(f"{FLAG}: tool {e}")
        self.by_name = schemas
        self.schemas = list(schemas.values())
        self.n_workers, self._workers = max(1, int(workers)), []
        self.counts = Counter()
        self.recent_errors = deque(maxlen=20)       # (kind, text) of the last errors, for a log line

    def names(self):
        return list(self.functions)

    def _start(self):
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if ctx.get_start_method() == "forkserver":
            ctx.set_forkserver_preload([__name__])     # the server imports this module (torch) once; forks are quick
        return ctx

    def _new_worker(self):
        if not hasattr(self, "_ctx"):
            self._ctx = self._start()
        return _Worker(self._ctx, self.specs, self.max_output_chars)

    def run(self, calls) -> list:
        """One ToolResult per call, in order. A call is {"name", "arguments"} (as chat.parse_tool_calls gives
        it) or {"error": why} for a malformed one. User tools' calls run concurrently on the workers."""
        results, queue = [None] * len(calls), deque()
        for i, call in enumerate(calls):
            if "error" in call:
                results[i] = ToolResult(f"error: {call['error']}", "malformed")
                continue
            name, args = call.get("name"), call.get("arguments")
            if name not in self.functions:
                results[i] = ToolResult(f"error: unknown tool {str(name)[:60]!r} (tools: {', '.join(self.functions)})",
                                        "unknown")
            elif not isinstance(args, dict):
                results[i] = ToolResult(f"error: {name}: the arguments must be a JSON object", "arguments")
            elif (why := check_arguments(self.by_name[name], args)):
                results[i] = ToolResult(f"error: {name}: {why}", "arguments")
            elif name in self.builtin:
                results[i] = self._run_here(name, args)
            else:
                try:            # (a value nested near the recursion limit reads but may not write)
                    queue.append((i, json.dumps({"name": name, "arguments": args}, ensure_ascii=False).encode()))
                except (ValueError, RecursionError) as e:
                    results[i] = ToolResult(f"error: {name}: unusable arguments ({type(e).__name__})", "arguments")
        if queue:
            self._run_in_workers(calls, queue, results)
        for r in results:
            self.counts[r.kind] += 1
            if not r.ok:
                self.recent_errors.append((r.kind, r.text))
        return results

    def _run_here(self, name, args):
        try:
            text = _as_text(self.builtin[name](**args))
        except Exception as e:
            return ToolResult(f"error: {name}: {_first_line(e)}", "raised")
        if len(text) > self.max_output_chars:
            return ToolResult(f"error: {name} answered {len(text):,} characters, more than the "
                              f"{self.max_output_chars:,} allowed", "too_long")
        return ToolResult(text, "ok")

    def _run_in_workers(self, calls, queue, results):
        while len(self._workers) < min(self.n_workers, len(queue)):
            self._workers.append(self._new_worker())
        free, busy = list(range(len(self._workers))), {}     # busy: worker index -> (call index, deadline)
        while queue or busy:
            while queue and free:
                w, (i, request) = free.pop(), queue.popleft()
                try:
                    self._workers[w].conn.send_bytes(request)
                except OSError:             # the worker ended between calls (a thread of a tool's): a fresh one
                    self._restart(w)
                    self._workers[w].conn.send_bytes(request)
                busy[w] = (i, time.monotonic() + self.timeout_s)
            wait = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            answered = multiprocessing.connection.wait([self._workers[w].conn for w in busy], wait)
            for w in list(busy):
                i, deadline = busy[w]
                name = calls[i]["name"]
                if self._workers[w].conn in answered:
                    reply = self._workers[w]._receive()
                    if reply is not None:
                        results[i] = ToolResult(reply["text"], reply["kind"])
                    else:           # the process ended (os._exit, a crash) or wrote past the cap
                        code = self._restart(w)
                        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                        results[i] = ToolResult(f"error: {name} ended its process ({how})", "died")
                elif time.monotonic() >= deadline:
                    self._restart(w)
                    results[i] = ToolResult(f"error: {name} did not answer within {self.timeout_s:g} s", "timeout")
                else:
                    continue
                del busy[w]
                free.append(w)

    def _restart(self, w):
        """Kill worker w (and its process group) and start a fresh one; the old one's exit code."""
        old = self._workers[w]
        old.kill()
        self._workers[w] = self._new_worker()
        return old.proc.exitcode

    def close(self):
        """Stop the workers (also done at exit: they are daemons, and a worker ends when its pipe closes)."""
        for w in self._workers:
            w.kill()
        self._workers = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class ToolEnv:
    """The env of nano_rlhf.sampling.generate_turns: for each assistant turn that just ended, its calls parsed in
    the chat template's syntax (chat.parse_tool_calls), run (the calls of all rows in one box.run, in order), and
    the tool turn's ids (tok.encode_tool_turn: the results, then the next generation prompt) — or None when the
    turn holds no call, or ended on a stop id other than the template's end-of-turn (end-of-text ends the row).
    counts: turns seen, turns with calls, calls, and the box's results by kind. results: the last call's result
    texts, a list per turn (None for a turn without calls); answered: every answered turn's ids (a tuple) -> its
    results, over the whole rollout, for a caller that writes the transcript as messages."""

    def __init__(self, box: ToolBox, tok):
        self.box, self.tok, self.counts, self.results, self.answered = box, tok, Counter(), [], {}

    def __call__(self, turns):
        found = []
        for ids in turns:
            calls = []
            if ids and ids[-1] == self.tok.eot_id:
                calls = chat.parse_tool_calls(self.tok.chat_template, self.tok.decode(ids))
            found.append(calls)
        results = iter(self.box.run([c for calls in found for c in calls]))
        self.counts.update(turns=len(turns), tool_turns=sum(map(bool, found)), calls=sum(map(len, found)))
        self.results = [[next(results).text for _ in calls] if calls else None for calls in found]
        self.answered.update({tuple(ids): texts for ids, texts in zip(turns, self.results) if texts is not None})
        return [self.tok.encode_tool_turn(texts) if texts else None for texts in self.results]


def load_tools(spec: str, timeout_s=TIMEOUT_S, max_output_chars=MAX_OUTPUT_CHARS, workers=1) -> ToolBox:
    """A ToolBox from a comma-separated --tools value: built-in names (calculator) and `module:NAME` /
    `path/to/file.py:NAME` specs. Bad specs, a function that cannot be offered (see json_schema) and two tools
    of one name stop the run with one line, before any work."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        fail(f"{FLAG}: no tool named")
    builtins = [p for p in parts if p in BUILTIN]
    bad = [p for p in parts if p not in BUILTIN and ":" not in p]
    if bad:
        fail(f"{FLAG} {bad[0]}: not a built-in tool ({', '.join(BUILTIN)}) nor module:NAME / path/to/file.py:NAME")
    if len(set(builtins)) != len(builtins):
        fail(f"{FLAG}: a built-in tool is named twice")
    return ToolBox([p for p in parts if p not in BUILTIN], builtins, timeout_s, max_output_chars, workers)


def code_files(spec: str) -> list:
    """Source files of the user tools of a --tools value (a run's identity on --resume hashes them)."""
    return [f for p in spec.split(",") if (f := code_file(p.strip()))]
