"""nano_rlhf.tools: schemas from type hints and docstrings (against transformers' get_json_schema), the exact
calculator and its bounds, the model's arguments checked against a schema, and the worker pool's time limit,
output cap and error turns (a tool that loops, sleeps in a child process, exits, dies, raises or floods)."""
import enum
import random
import re
import time
from fractions import Fraction
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import pytest

from nano_rlhf import tools
from nano_rlhf.tools import CalculatorError, SchemaError, calculator, check_arguments, json_schema, load_tools


# ---- schemas --------------------------------------------------------------------------------------

def simple(x: float, y: float):
    """
    A function that multiplies two numbers

    Args:
        x: The first number to multiply
        y: The second number to multiply
    """
    return x * y


def rich(query: str, k: int = 3, tags: List[str] = None, weights: Dict[str, float] = None,
         mode: Literal["fast", "slow"] = "fast", cutoff: Optional[float] = None, pair: Tuple[int, str] = (1, "a"),
         either: Union[int, str] = 0, anything: Any = None, flag: bool = False) -> List[str]:
    """Search the notes for a query,
    with a second line of description.

    Args:
        query: What to look for; a description that runs on
            over a second, more indented line.
        k: How many results
        tags: Only notes with these tags
        weights: A weight per tag
        mode: How hard to look
        cutoff: The lowest score kept, or none
        pair: A pair
        either: A number or a name
        anything: Whatever you like
        flag: A switch (choices: [true, false])

    Returns:
        The matching notes, best first.
    """


def nothing() -> str:
    """Say nothing at all."""
    return ""


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


def paint(color: Color, coats: int | None = None) -> None:
    """Paint the wall.

    Args:
        color: The color (choices: ["red", "green"])
        coats: Number of coats
    """


@pytest.mark.parametrize("fn", [simple, rich, nothing, paint, calculator])
def test_schema_equals_transformers_get_json_schema(fn):
    """Our schema builder, written apart, gives transformers' dictionary key for key and in the same order (the
    templates print it with tojson, so the order is part of the prompt)."""
    get_json_schema = pytest.importorskip("transformers.utils").get_json_schema
    ours, theirs = json_schema(fn), get_json_schema(fn)
    assert ours == theirs
    import json
    assert json.dumps(ours) == json.dumps(theirs)


def test_schema_refuses_what_a_model_could_not_call():
    def no_doc(x: int):
        return x

    def no_hint(x):
        """Doc.

        Args:
            x: a number
        """

    def undocumented(x: int, y: int):
        """Doc.

        Args:
            x: a number
        """

    def varargs(*xs: int):
        """Doc.

        Args:
            xs: numbers
        """

    def odd_type(x: set):
        """Doc.

        Args:
            x: a set
        """
    for fn, why in [(no_doc, "no docstring"), (no_hint, "no type hint"), (undocumented, "does not describe "
                    "argument y"), (varargs, "ordinary named argument"), (odd_type, "no JSON type"),
                    (lambda x: x, "a lambda")]:
        with pytest.raises(SchemaError, match=why):
            json_schema(fn)


# ---- checking arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, why", [
    ({"query": "a"}, ""),
    ({"query": "a", "k": 2, "tags": ["x"], "weights": {"x": 1}, "mode": "slow", "cutoff": None, "pair": [2, "b"],
      "either": "n", "anything": {"a": [1]}, "flag": True}, ""),
    ({"query": "a", "cutoff": 0.5}, ""),
    ({"query": "a", "weights": {"x": 1.5}}, ""),
    ({}, "missing argument 'query'"),
    ({"query": "a", "extra": 1}, "unexpected argument 'extra'"),
    ({"query": 3}, "argument 'query' must be string, got integer"),
    ({"query": "a", "k": 2.5}, "argument 'k' must be integer, got number"),
    ({"query": "a", "k": True}, "argument 'k' must be integer, got boolean"),
    ({"query": "a", "tags": ["x", 2]}, r"argument 'tags'\[1\] must be string"),
    ({"query": "a", "weights": {"x": "heavy"}}, r"argument 'weights'\['x'\] must be number"),
    ({"query": "a", "mode": "medium"}, "argument 'mode' must be one of"),
    ({"query": "a", "flag": 1}, "argument 'flag' must be one of"),
    ({"query": "a", "pair": [1]}, "argument 'pair' must hold 2 items"),
    ({"query": "a", "either": 1.5}, "argument 'either' must be integer or string"),
])
def test_arguments_are_checked_against_the_schema(args, why):
    got = check_arguments(json_schema(rich), args)
    assert (got == "") if not why else re.search(why, got), got


# ---- the calculator -------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("2+3*4", "14"), ("(2+3)*4", "20"), ("-2**2", "-4"), ("2**-1", "0.5"), ("2**3**2", "512"), ("(-2)**3", "-8"),
    ("7//2", "3"), ("-7//2", "-4"), ("-7 % 3", "2"), ("7 % -3", "-2"), ("1/3 + 1/6", "0.5"), ("0.1 + 0.2", "0.3"),
    ("(1+2)/4 - 1/3", "5/12"), ("10/4", "2.5"), ("-1/8", "-0.125"), (".5 * 4", "2"), ("3.", "3"), ("--3", "3"),
    ("+-+3", "-3"), (" 12 * ( 3 - 1 ) ", "24"), ("2**2.0", "4"), ("1/3*3", "1"), ("(-1)**(10**200)", "1"),
    ("1**(10**100)", "1"), ("0**5", "0"), ("2**1023", str(2 ** 1023)), ("7/2.5", "2.8"), ("1/7", "1/7"),
    ("-22/7", "-22/7"), ("1e", None),
])
def test_calculator_values(expression, value):
    if value is None:
        with pytest.raises(CalculatorError):
            calculator(expression)
    else:
        assert calculator(expression) == value


def test_calculator_equals_python_on_random_expressions():
    """Random expressions of small integers and all six operators against Python's own arithmetic on
    Fractions (the oracle evaluates the same text with every literal made a Fraction, here in the test only)."""
    rng = random.Random(0)

    def gen(depth):
        if depth == 0 or rng.random() < 0.3:
            return str(rng.randint(0, 30))
        op = rng.choice(["+", "-", "*", "/", "//", "%", "**"])
        left, right = gen(depth - 1), (str(rng.randint(0, 3)) if op == "**" else gen(depth - 1))
        return f"({left} {op} {right})" if rng.random() < 0.5 else f"{left}{op}{right}"

    checked = errors = 0
    for _ in range(400):
        text = ("-" if rng.random() < 0.2 else "") + gen(4)
        try:
            want = eval(re.sub(r"\d+", lambda m: f"Fraction({m.group(0)})", text), {"Fraction": Fraction})
        except ZeroDivisionError:
            with pytest.raises(CalculatorError, match="division by zero"):
                calculator(text)
            errors += 1
            continue
        if isinstance(want, float):     # int ** negative int (an int from //) is a float in Python: no oracle
            continue
        if max(want.numerator.bit_length(), want.denominator.bit_length()) > tools.MAX_BITS:
            continue
        assert Fraction(calculator(text).replace(" ", "")) == want, text
        checked += 1
    assert checked > 250 and errors > 5


@pytest.mark.parametrize("expression, why", [
    ("9**9**9", "too large"), ("2**1024", "too large"), ("(10**200)*(10**200)", "too large"),
    ("10**300 / 7**400", "too large"), ("1/0", "division by zero"), ("5//0", "division by zero"),
    ("5 % (1-1)", "division by zero"), ("0**-1", "division by zero"), ("2**0.5", "whole exponent"),
    ("2^3", "use \\*\\* for a power"), ("__import__('os')", "unexpected character '_'"),
    ("1; 2", "unexpected character ';'"), ("", "empty"), ("(1+2", "never closed"), ("1+", "ends too early"),
    ("1 2", "after a complete expression"), ("()", "unexpected"), ("(" * 60 + "1" + ")" * 60, "nested"),
    ("-" * 60 + "1", "nested"), ("1" * 101, "more than 100 digits"), ("1+" * 300 + "1", "longer than 500"),
    ("1,000", "unexpected character ','"), ("x*2", "unexpected character 'x'"),
])
def test_calculator_refuses_with_a_message_and_never_hangs(expression, why):
    t = time.perf_counter()
    with pytest.raises(CalculatorError, match=why):
        calculator(expression)
    assert time.perf_counter() - t < 0.05


# ---- the tool box: user tools in workers ----------------------------------------------------------

USER_TOOLS = '''
import os, subprocess, sys, time
from typing import Optional


def add(a: int, b: int = 2) -> int:
    """Add two numbers.

    Args:
        a: The first number
        b: The second number
    """
    return a + b


def spin(n: int) -> str:
    """Loop in pure Python, forever.

    Args:
        n: A start
    """
    while True:
        n += 1


def child(path: str) -> str:
    """Start a child process that would write a file in 2 s, then hang.

    Args:
        path: The file
    """
    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(2); open({path!r}, 'w').write('x')"])
    time.sleep(100)


def flood(n: int) -> str:
    """Answer n characters.

    Args:
        n: How many
    """
    print("noise on stdout " * 100)
    return "x" * n


def leave(code: int) -> str:
    """Call sys.exit.

    Args:
        code: The exit code
    """
    sys.exit(code)


def die() -> str:
    """End the process without a word."""
    os._exit(3)


def boom(why: Optional[str] = None) -> str:
    """Raise.

    Args:
        why: The message
    """
    raise RuntimeError(why or "boom")


def listing() -> list:
    """Answer a JSON value."""
    return [1, "two", {"three": 3.0}]


def controls(n: int) -> str:
    """Answer n control characters (6 bytes each in JSON) and a lone surrogate (no tokenizer encodes one).

    Args:
        n: How many
    """
    return "\\x01" * n + "\\ud800"


def vanish() -> str:
    """Answer, then end the process a moment later (a thread of the tool's)."""
    import threading
    threading.Timer(0.1, lambda: os._exit(0)).start()
    return "bye"


TOOLS = [add, spin, child, flood, leave, die, boom, listing, controls, vanish]
'''


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "user_tools.py"
    path.write_text(USER_TOOLS)
    b = load_tools(f"calculator,{path}:TOOLS", timeout_s=1.0, max_output_chars=1000, workers=2)
    yield b
    b.close()


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def test_every_bad_call_is_an_error_turn_and_counted(box):
    """One batch of calls with every kind of failure: each answer is a short `error:` line of its kind, the good
    calls around them still answer, the pool survives a kill, and the counts add up."""
    box.counts.clear()
    calls = [call("calculator", expression="(3+4)*12/5"), call("add", a=1), call("add", a=1.5),
             call("add", a=1, c=2), call("add"), call("nope"), {"error": "malformed tool call: not JSON"},
             call("spin", n=0), call("flood", n=5000), call("leave", code=0), call("die"), call("boom", why="bad\nx"),
             call("calculator", expression="9**9**9"), call("listing"), call("controls", n=999),
             call("add", a=5, b=6)]
    t = time.perf_counter()
    got = box.run(calls)
    took = time.perf_counter() - t
    assert [(r.kind, r.text) for r in got] == [
        ("ok", "16.8"), ("ok", "3"),
        ("arguments", "error: add: argument 'a' must be integer, got number"),
        ("arguments", "error: add: unexpected argument 'c' (arguments: a, b)"),
        ("arguments", "error: add: missing argument 'a'"),
        ("unknown", "error: unknown tool 'nope' (tools: calculator, add, spin, child, flood, leave, die, boom, "
                    "listing, controls, vanish)"),
        ("malformed", "error: malformed tool call: not JSON"),
        ("timeout", "error: spin did not answer within 1 s"),
        ("too_long", "error: flood answered 5,000 characters, more than the 1,000 allowed"),
        ("exited", "error: leave called sys.exit(0)"),
        ("died", "error: die ended its process (exit code 3)"),
        ("raised", "error: boom raised RuntimeError: bad"),
        ("raised", "error: calculator: a power is too large (more than 1024 bits, about 308 digits)"),
        ("ok", '[1, "two", {"three": 3.0}]'), ("ok", "\x01" * 999 + "?"), ("ok", "11")]
    # one timeout (1 s) and a few worker restarts, not a hang: ~2 s on a quiet machine, 11 s on 2 cores shared with
    # three other jobs; a hang would never return
    assert took < 60, took
    assert box.counts == {"ok": 5, "arguments": 3, "unknown": 1, "malformed": 1, "timeout": 1, "too_long": 1,
                          "exited": 1, "died": 1, "raised": 2}
    assert box.run([call("add", a=40)] * 3) == [("42", "ok")] * 3      # the restarted workers answer


def test_a_timeout_kills_the_processes_the_tool_started(box, tmp_path):
    """The kill reaches the worker's whole process group: the child the tool started never writes its file."""
    target = tmp_path / "written"
    got = box.run([call("child", path=str(target))])
    assert got[0].kind == "timeout"
    time.sleep(2.5)
    assert not target.exists()


def test_a_worker_that_ended_between_calls_is_replaced(box):
    assert box.run([call("vanish")] * 2) == [("bye", "ok")] * 2          # both workers end 0.1 s later
    time.sleep(0.5)
    assert box.run([call("add", a=1)] * 2) == [("3", "ok")] * 2


def test_load_tools_refuses_bad_specs_with_one_line(tmp_path, capsys):
    (tmp_path / "bad.py").write_text(
        "def f(x: int) -> int:\n    '''Doc.\n\n    Args:\n        x: a number\n    '''\n    return x\n"
        "def undocumented(x: int):\n    return x\n"
        "def calculator(expression: str) -> str:\n    '''Mine.\n\n    Args:\n        expression: text\n    '''\n"
        "TWICE = [f, f]\nNOT_FUNCTIONS = [f, 3]\nUNDOC = [undocumented]\nCLASH = [calculator]\n")
    bad = str(tmp_path / "bad.py")
    for spec, message in [("nope", "not a built-in tool"), (f"{bad}:TWICE", "two tools are named 'f'"),
                          (f"{bad}:NOT_FUNCTIONS", "holds a int, not a function"),
                          (f"{bad}:UNDOC", "tool undocumented has no docstring"),
                          (f"calculator,{bad}:CLASH", "two tools are named 'calculator'"),
                          (f"{bad}:MISSING", "has no 'MISSING'"), ("", "no tool named"),
                          (f"{tmp_path}/none.py:T", "no such file")]:
        with pytest.raises(SystemExit):
            load_tools(spec)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --tools") and message in err[0], (spec, err)
    box = load_tools(f"{bad}:f")          # one function is a list of one
    assert box.names() == ["f"] and box.run([call("f", x=2)]) == [("2", "ok")]
    box.close()
    assert tools.code_files(f"calculator,{bad}:f") == [bad]


def test_only_builtins_start_no_process():
    box = load_tools("calculator")
    assert box.run([call("calculator", expression="1/4")]) == [("0.25", "ok")]
    assert box._workers == [] and not hasattr(box, "_ctx")
