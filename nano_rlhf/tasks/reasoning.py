"""A verifiable reasoning task: short multi-step arithmetic, worked step by step, checked by code.

    python -m nano_rlhf.tasks.reasoning --out_dir data/reasoning [--seed 0]   # sft.jsonl, sft_eval.jsonl,
                                                                    # prompts.jsonl, eval_prompts.jsonl, task.json
    python train_sft.py --data data/reasoning/sft.jsonl --eval_data data/reasoning/sft_eval.jsonl --out_dir out/rsft
    python -m nano_rlhf.evaluate --model out/rsft --prompts data/reasoning/eval_prompts.jsonl \\
        --reward nano_rlhf.tasks.reasoning:reward --samples_per_prompt 8 --pass_k 1,8
    python train_ppo.py --init out/rsft --prompts data/reasoning/prompts.jsonl --advantage grpo \\
        --reward nano_rlhf.tasks.reasoning:reward ...

Prompt:      "Compute 7 + 5 * 3 - 4.\\nSolution:"   (4 phrasings; 2 to 4 operands from 1 to 9; +, - and *)
Completion:  " 5 * 3 = 15. 7 + 15 = 22. 22 - 4 = 18. Answer: 18"

The steps follow the school order of operations (every * left to right, then + and - left to right); every
intermediate value of a generated problem is in [0, 99], so numbers stay one or two digits and a response stays
under ~40 tokens of the 4-layer model's tokenizer. The final answer is "Answer: N" or "(So) the answer is N." —
`answer` reads it back; several answer statements that disagree count as none (a hedge earns nothing).

The verifier (`reward(prompts, completions)`, the interface of `--reward module:function`) needs nothing but the
prompt text: it reads the last arithmetic expression in the prompt (a string, or the last user message of a
conversation), evaluates it exactly, and gives 1.0 when the completion's answer equals it, else 0.0 — a
malformed answer, a prompt without an expression or a non-string completion is 0.0, never an error. The task is
outcome-only (Cobbe et al. 2021; DeepSeekMath's GRPO, Shao et al. 2024): the steps are not graded.

SFT demonstrations are deliberately imperfect, so that SFT leaves room for RL: a share `wrong_rate` (default 25%)
of the answered demonstrations end with a wrong answer — mostly an arithmetic slip in one step that later steps
carry forward (so the earlier steps stay right), sometimes a slip copying the final value — a share
`malformed_rate` (5%) stop after the steps without an answer statement, and 10% skip the steps and answer at
once. Step and answer formats vary. task.json records the share the verifier accepts.

Tool demonstrations (`--tool_rate R`, default 0: the files above, byte for byte): the same problems and phrasings
written as conversations for `--tools calculator` — prompts as one user turn, SFT rows as `messages` with the
calculator's schema in `tools` — where a share R of the demonstrations call the calculator: on the whole expression
(then state its value; every problem of one step, and half of the longer ones), or on the first step only (then work
the rest by hand, a later step slipping with probability `wrong_rate`, carried forward; no skipped steps, no copying
slip, always an answer statement). The other demonstrations are the tool-free ones, unchanged. Tool decisions draw
from their own random stream, so the problems are those of the tool-free files at the same seed.

Held out: a problem (its operands and operators, whatever the phrasing) is an evaluation problem when a fixed
hash of it falls in EVAL_SHARE; eval_prompts.jsonl draws only those (distinct ones), sft*.jsonl and
prompts.jsonl never. The split does not depend on --seed, so no seed's training data holds another seed's
evaluation problems.
"""
import argparse
import hashlib
import json
import os
import random
import re
from fractions import Fraction

from ..chat import final_turn
from ..cli import OneLineErrors
from .common import prompt_text   # a string prompt, or a conversation's last user message

OPS = "+-*"
MAX_VALUE = 99                     # every intermediate value of a generated problem is in [0, MAX_VALUE]
N_OPERANDS = {2: 0.3, 3: 0.4, 4: 0.3}
EVAL_SHARE = 1 / 8                 # share of all problems held out for evaluation
PHRASINGS = ["Compute {}.", "What is {}?", "Calculate {}.", "Work out {}."]
SUFFIX = "\nSolution:"
ANSWER_FORMATS = [("Answer: {}", 0.5), ("So the answer is {}.", 0.3), ("The answer is {}.", 0.2)]
SKIP_STEPS = 0.10                  # share of demonstrations that answer without steps

# the built-in calculator's schema as nano_rlhf.tools.json_schema builds it (a test pins them equal): written out
# so that this data tool does not import torch
CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": 'numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 12 / 5"'}},
        "required": ["expression"]}, "return": {"type": "string"}}}

_EXPR = re.compile(r"-?\d+(?:\s*[-+*×]\s*-?\d+)+")
_TOKEN = re.compile(r"\d+|[-+*×]")
# "Answer: 18", "answer is 18", "The answer is: -3", "**Answer:** 18"; the number must not run on into digits
_ANSWER = re.compile(r"\banswer\s*(?:is\s*:?|:)\s*\**\s*(-?\d+(?:\.\d+)?)(?![\d])", re.I)


# ---- problems and their steps -------------------------------------------------------------------

def steps(nums, ops, slip=None):
    """The worked steps [(a, op, b, result), ...] and the final value, in the school order of operations.
    slip = (step index, delta): that step's result is off by delta and the later steps carry the wrong value
    forward (an imperfect demonstration)."""
    nums, ops, out = list(nums), list(ops), []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, op, b = nums[i], ops[i], nums[i + 1]
        c = a * b if op == "*" else a + b if op == "+" else a - b
        if slip is not None and slip[0] == len(out):
            c += slip[1]
        out.append((a, op, b, c))
        nums[i:i + 2] = [c]
        del ops[i]
    return out, nums[0]


def expression(nums, ops):
    return " ".join([str(nums[0])] + [f"{o} {n}" for o, n in zip(ops, nums[1:])])


def is_eval_problem(nums, ops):
    """Whether a problem is held out for evaluation: a fixed hash of its expression (not of the seed)."""
    h = hashlib.sha256(("reasoning:" + expression(nums, ops)).encode()).digest()
    return int.from_bytes(h[:8], "big") < EVAL_SHARE * 2 ** 64


def sample_problem(rng, held_out):
    """(operands, operators) with every intermediate value in [0, MAX_VALUE], from the held-out problems when
    held_out, else from the rest (rejection sampling: about 60% of draws are kept)."""
    while True:
        n = rng.choices(list(N_OPERANDS), list(N_OPERANDS.values()))[0]
        nums = [rng.randint(1, 9) for _ in range(n)]
        ops = [rng.choice(OPS) for _ in range(n - 1)]
        work, _ = steps(nums, ops)
        if all(0 <= c <= MAX_VALUE for *_, c in work) and is_eval_problem(nums, ops) == held_out:
            return nums, ops


def make_prompt(nums, ops, phrasing=0):
    return PHRASINGS[phrasing].format(expression(nums, ops)) + SUFFIX


# ---- reading prompts and answers back -----------------------------------------------------------

def solve(prompt):
    """The exact value of the last arithmetic expression in a prompt (+, -, * or ×, integers, the usual
    precedence), or None when it has none."""
    found = _EXPR.findall(prompt_text(prompt))
    if not found:
        return None
    toks = _TOKEN.findall(found[-1])
    # a leading minus belongs to the first operand ("-3 + 4"); after an operator, to the next operand
    vals, ops, sign = [], [], 1
    for t in toks:
        if t.isdigit():
            vals.append(sign * int(t))
            sign = 1
        elif len(vals) == len(ops):          # an operator where an operand is due: a sign
            sign = -sign if t == "-" else sign
        else:
            ops.append("*" if t == "×" else t)
    if len(vals) != len(ops) + 1 or len(vals) > 64:
        return None
    return steps(vals, ops)[1]


def answer(completion):
    """The final answer a completion states ("Answer: N" or "the answer is N"), normalised ("18", "-3",
    "2.5"), or None: no answer statement, a non-string, or statements that disagree. Of a tool-use transcript, the
    final assistant turn's (chat.final_turn): what maj@k votes on too."""
    if not isinstance(completion, str):
        return None
    completion = final_turn(completion)
    values = {Fraction(m) for m in _ANSWER.findall(completion)}
    if len(values) != 1:
        return None
    v = values.pop()
    return str(v.numerator) if v.denominator == 1 else str(float(v))


def reward(prompts, completions):
    """1.0 for each completion whose final answer equals its prompt's value, else 0.0 (never raises). A multi-turn
    completion (with --tools) is judged by its final assistant turn alone (`answer`): a number that only a tool
    turn or a tool call states is not the policy's answer."""
    out = []
    for p, c in zip(prompts, completions):
        truth, got = solve(p), answer(c)
        out.append(float(truth is not None and got is not None and Fraction(got) == truth))
    return out


# ---- demonstrations -----------------------------------------------------------------------------

def _slip(rng, value):
    """A nearby wrong value (off by 1, 2 or 10, the usual slips), never negative."""
    while True:
        d = rng.choice([-10, -2, -1, 1, 2, 10])
        if value + d >= 0:
            return d


def demonstration(rng, nums, ops, wrong_rate=0.25, malformed_rate=0.05):
    """(completion, kind): an imperfect worked solution. kind: "correct", "wrong" (a slip in one step carried
    forward, or in copying the final value) or "malformed" (no answer statement)."""
    malformed = rng.random() < malformed_rate
    wrong = not malformed and rng.random() < wrong_rate
    n_steps = len(ops)
    slip = None
    if wrong and rng.random() < 0.8:
        i = rng.randrange(n_steps)
        slip = (i, _slip(rng, steps(nums, ops)[0][i][3]))
    work, final = steps(nums, ops, slip)
    if wrong and slip is None:
        final += _slip(rng, final)
    sep = rng.choice([". ", ", "])
    body = sep.join(f"{a} {o} {b} = {c}" for a, o, b, c in work)
    fmt = rng.choices([f for f, _ in ANSWER_FORMATS], [w for _, w in ANSWER_FORMATS])[0]
    if malformed:
        text = body + "."
    elif rng.random() < SKIP_STEPS:
        text = fmt.format(final)
    elif sep == ", " and fmt != "Answer: {}":
        text = body + ", so the answer is " + f"{final}."
    else:
        text = body + ". " + fmt.format(final)
    return " " + text, ("malformed" if malformed else "wrong" if wrong else "correct")


def tool_demonstration(rng, nums, ops, whole, wrong_rate=0.25):
    """(assistant and tool messages, kind): a demonstration that calls the calculator on the whole expression
    (whole) or on its first step, reads the answer from the tool turn, and (first step) works the rest by hand,
    where a step slips with probability wrong_rate and the later steps carry it forward."""
    work, final = steps(nums, ops)
    if whole or len(work) == 1:
        call, value, rest, kind = expression(nums, ops), final, "", "correct"
    else:
        a, o, b, value = work[0]
        slip = None
        if rng.random() < wrong_rate:
            i = rng.randrange(1, len(work))
            slip = (i, _slip(rng, work[i][3]))
        work, final = steps(nums, ops, slip)
        call, kind = f"{a} {o} {b}", "wrong" if slip else "correct"
        rest = ". ".join(f"{a} {o} {b} = {c}" for a, o, b, c in work[1:]) + ". "
    fmt = rng.choices([f for f, _ in ANSWER_FORMATS], [w for _, w in ANSWER_FORMATS])[0]
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": call}}}]
    return [{"role": "assistant", "content": "", "tool_calls": calls}, {"role": "tool", "content": str(value)},
            {"role": "assistant", "content": rest + fmt.format(final)}], kind


# ---- files --------------------------------------------------------------------------------------

def _write(path, rows):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


def write_dataset(out_dir, seed=0, n_sft=20000, n_prompts=2000, n_eval_prompts=256, wrong_rate=0.25,
                  malformed_rate=0.05, eval_fraction=0.05, tool_rate=0.0):
    """Write sft.jsonl, sft_eval.jsonl (the first eval_fraction of the demonstrations), prompts.jsonl,
    eval_prompts.jsonl and task.json (last) into out_dir, each atomically; byte-identical at a seed.
    tool_rate > 0: conversations offering the calculator, that share of the demonstrations calling it.
    Returns task.json's content."""
    rng = random.Random(f"reasoning:{seed}")
    tool_rng = random.Random(f"reasoning-tools:{seed}")     # its own stream: the problems stay the same
    tools = [CALCULATOR_SCHEMA] if tool_rate > 0 else None
    sft, kinds = [], {"correct": 0, "wrong": 0, "malformed": 0}
    n_tool = 0
    for _ in range(n_sft):
        nums, ops = sample_problem(rng, held_out=False)
        completion, kind = demonstration(rng, nums, ops, wrong_rate, malformed_rate)
        prompt = make_prompt(nums, ops, rng.randrange(len(PHRASINGS)))
        if not tools:
            sft.append({"prompt": prompt, "completion": completion})
        elif tool_rng.random() < tool_rate:
            turns, kind = tool_demonstration(tool_rng, nums, ops, tool_rng.random() < 0.5, wrong_rate)
            sft.append({"messages": [{"role": "user", "content": prompt}] + turns, "tools": tools})
            n_tool += 1
        else:
            sft.append({"messages": [{"role": "user", "content": prompt},
                                     {"role": "assistant", "content": completion.lstrip(" ")}], "tools": tools})
        kinds[kind] += 1

    def prompt_row(nums, ops):
        text = make_prompt(nums, ops, rng.randrange(len(PHRASINGS)))
        return {"prompt": [{"role": "user", "content": text}] if tools else text}
    prompts = [prompt_row(*sample_problem(rng, False)) for _ in range(n_prompts)]
    evals, seen = [], set()
    while len(evals) < n_eval_prompts:         # distinct problems (there are thousands to draw from)
        nums, ops = sample_problem(rng, held_out=True)
        if expression(nums, ops) not in seen:
            seen.add(expression(nums, ops))
            evals.append(prompt_row(nums, ops))
    n_sft_eval = max(1, int(n_sft * eval_fraction))
    files = {"sft.jsonl": sft[n_sft_eval:], "sft_eval.jsonl": sft[:n_sft_eval], "prompts.jsonl": prompts,
             "eval_prompts.jsonl": evals}
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in files.items():
        _write(os.path.join(out_dir, name), rows)
    if tools:       # the prompt is the first turn; the completion, the transcript's final answer
        accepted = reward([r["messages"][0]["content"] for r in sft], [r["messages"][-1]["content"] for r in sft])
    else:
        accepted = reward([r["prompt"] for r in sft], [r["completion"] for r in sft])
    task = {"task": "reasoning", "seed": seed, "counts": {k: len(v) for k, v in files.items()},
            "demonstrations": kinds, "demo_pass_rate": sum(accepted) / len(accepted),
            "wrong_rate": wrong_rate, "malformed_rate": malformed_rate, "eval_share": EVAL_SHARE}
    if tools:
        task.update(tool_rate=tool_rate, tool_demonstrations=n_tool, tools=["calculator"])
    tmp = os.path.join(out_dir, f"task.json.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(task, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "task.json"))
    return task


def main(argv=None):
    p = OneLineErrors(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="data/reasoning", help="directory for the JSONL files and task.json")
    p.add_argument("--seed", type=int, default=0, help="everything is determined by this seed")
    p.add_argument("--n_sft", type=int, default=20000, help="SFT demonstrations (5%% become sft_eval.jsonl)")
    p.add_argument("--n_prompts", type=int, default=2000, help="RL training prompts")
    p.add_argument("--n_eval_prompts", type=int, default=256, help="held-out evaluation prompts (distinct problems)")
    p.add_argument("--wrong_rate", type=float, default=0.25, help="share of answered demonstrations whose answer "
                   "is wrong")
    p.add_argument("--malformed_rate", type=float, default=0.05, help="share of demonstrations with no answer")
    p.add_argument("--tool_rate", type=float, default=0.0, help="share of demonstrations that call the calculator; "
                   "> 0 writes conversations for --tools calculator (0: the tool-free files)")
    a = p.parse_args(argv)
    # p.error: one line and exit 2, as for a malformed flag (common.fail would import torch into this light tool)
    if a.n_sft < 2 or a.n_prompts < 1 or a.n_eval_prompts < 1:
        p.error("--n_sft must be >= 2, --n_prompts and --n_eval_prompts >= 1")
    if a.n_eval_prompts > 5000:
        p.error(f"--n_eval_prompts {a.n_eval_prompts}: at most 5000 distinct held-out problems are drawn")
    if not 0 <= a.seed < 2 ** 63:
        p.error(f"--seed must be in [0, 2**63) (got {a.seed})")
    for name in ("wrong_rate", "malformed_rate", "tool_rate"):
        if not 0 <= getattr(a, name) <= 1:
            p.error(f"--{name} must be in [0, 1] (got {getattr(a, name)})")
    if os.path.exists(a.out_dir) and not os.path.isdir(a.out_dir):
        p.error(f"--out_dir {a.out_dir}: is a file")
    t = write_dataset(a.out_dir, a.seed, a.n_sft, a.n_prompts, a.n_eval_prompts, a.wrong_rate, a.malformed_rate,
                      tool_rate=a.tool_rate)
    print(f"wrote {a.out_dir}/: " + ", ".join(f"{k} {v}" for k, v in t["counts"].items()))
    print(f"demonstrations: {t['demonstrations']} | the verifier accepts {100 * t['demo_pass_rate']:.1f}%")
    return t


if __name__ == "__main__":
    main()
