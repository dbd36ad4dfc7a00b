"""The command line: the options dataclass at the top of each script is its command line, and the run options
every script shares are declared once at the bottom of this file.

    @dataclass
    class Options:
        lr: float = 3e-4          # peak learning rate
        loss: Literal["dpo", "ipo"] = "dpo"   # which loss

becomes `--lr 0.0003 --loss ipo`; the trailing comment of each field is its `--help` line, shown with
its default. Booleans take `--flag`, `--flag true` or `--flag false`; `Literal[...]` gives choices;
`Optional[int] = None` takes an int or `none`.

A help line too long for one line continues on the lines below, each only a comment starting under the first:

    lora_targets: str = ""    # comma list of nn.Linear names to adapt;
                              # empty = attention + MLP

A comment may end with a range in braces, which parse_args enforces before anything else runs (and
--help shows, as part of the comment):

    lr: float = 3e-4            # peak learning rate {> 0}
    top_p: float = 1.0          # nucleus sampling {0 < x <= 1}

Forms: {> a} {>= a} {< b} {<= b} {a < x < b} {a <= x <= b} {a < x <= b} {a <= x < b}; a, b are numbers,
`inf` and `-inf` among them. `none` is always allowed for an Optional field. A violation prints one line,
`error: --lr must be > 0 (got -1.0)`, and exits with status 2 (argparse's status for a bad command line).
A float option never takes `nan` (it fails no comparison), nor `inf` / `-inf` unless its range includes them as a
bound (`score_clip ... {0 < x <= inf}`: an open range like {> 0} refuses them), nor a value float32 cannot hold
(beyond ±3.4e38, or non-zero below 1.4e-45: see FLOAT32_MAX). A `seed` is an int in [0, 2**63).

A comment may also say when the option applies, in brackets: `[with NAME]` (NAME is true, non-zero or non-empty),
`[with NAME=a|b]`, `[with NAME!=a]`, `[with NAME>0]`, several joined by ` and ` or by ` or `; to mix them, the
or-groups take parentheses, `[with (a or b) and c]` (a mix without them is refused, as is any other nesting: a
reader never has to know which binds tighter). An option given on the command line (whatever its value, the
default included) where its condition is false would be silently ignored, so parse_args refuses it: one line,
`error: --dual_clip applies only with --policy_loss dual_clip (got ppo)`, exit 2.
--help shows the condition as written.

Everything here is read from the class's source, so an Options class must be defined in a file: one whose source
cannot be read (made with exec, in a REPL) is refused, never parsed without its help, ranges and conditions.
"""
import argparse
import dataclasses
import functools
import inspect
import io
import math
import operator
import re
import sys
import tokenize
import typing
from dataclasses import dataclass
from typing import Literal


def _field_comments(cls):
    """{field name: trailing comment} read from the source of cls and of every dataclass it inherits from, base
    classes first, so a field a script inherits from the run options keeps its --help and its range, and a field
    a subclass declares again takes the subclass's comment."""
    return dict(_comments_of(cls))


@functools.lru_cache(maxsize=None)
def _comments_of(cls):
    """_field_comments, read once per class (tokenizing a class's source costs ~30 ms; a parse asks four times)."""
    comments = {}
    for c in reversed(cls.__mro__):
        if dataclasses.is_dataclass(c):
            comments.update(_own_field_comments(c))
    return comments


def _own_field_comments(cls):
    """{field name: trailing comment} read from the source of this one class. A comment continues on the lines
    right below it that hold only a comment starting at its column or further right (joined with one space):

        lora_r: int = 0               # LoRA rank: train rank-r adapters on the frozen --init model;
                                      # 0 = off {>= 0}
    """
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError) as e:
        raise TypeError(f"{cls.__qualname__}: its source cannot be read ({e}); an options class is read from its "
                        "source (each field's comment is its --help, range and [with ...] condition), so define it "
                        "in a file") from None
    comments, line_names = {}, {}
    open_ = None          # (field name, row, column) of the comment the next comment-only line may continue
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        row, col = tok.start
        if tok.type == tokenize.NAME and row not in line_names:
            line_names[row] = tok.string
        elif tok.type == tokenize.COMMENT and row in line_names:
            comments[line_names[row]] = tok.string.lstrip("#").strip()
            open_ = (line_names[row], row, col)
        elif tok.type == tokenize.COMMENT:
            if open_ and row == open_[1] + 1 and col >= open_[2]:
                name = open_[0]
                comments[name] = f"{comments[name]} {tok.string.lstrip('#').strip()}".strip()
                open_ = (name, row, open_[2])
            else:
                open_ = None
    return comments


_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
_NUM = r"(-?(?:inf|\d+(?:\.\d*)?(?:e-?\d+)?|\.\d+(?:e-?\d+)?))"
_ONE_SIDED = re.compile(r"^(>=|<=|>|<)\s*" + _NUM + r"$")
_TWO_SIDED = re.compile(r"^" + _NUM + r"\s*(<=|<)\s*x\s*(<=|<)\s*" + _NUM + r"$")
_RANGE = re.compile(r"\{([^{}]*)\}\s*$")
_WITH = re.compile(r"\[with ([^\[\]]+)\]")
_COND = re.compile(r"^(\w+)\s*(?:(=|!=)\s*([\w.|-]+)|(>)\s*" + _NUM + r")?$")


def parse_range(comment: str):
    """The range a field comment ends with, as (text, [(op, bound), ...]) with every condition on x
    (`{0 <= x < 0.5}` -> [(">=", 0.0), ("<", 0.5)]), or None when the comment has no range.
    A brace group that is not a valid range is a programming error (ValueError)."""
    m = _RANGE.search(comment or "")
    if m is None:
        return None
    text = " ".join(m.group(1).split())
    one, two = _ONE_SIDED.match(text), _TWO_SIDED.match(text)
    if one:
        return text, [(one.group(1), float(one.group(2)))]
    if two:
        lo, op_lo, op_hi, hi = two.groups()
        flip = {"<": ">", "<=": ">="}          # `a < x` is `x > a`
        return text, [(flip[op_lo], float(lo)), (op_hi, float(hi))]
    raise ValueError(f"bad range {{{text}}} in option comment {comment!r}")


def allows_inf(rng):
    """True when a parsed range (parse_range) includes inf or -inf as a bound: only then may the option be ±inf."""
    return rng is not None and any(bound in (math.inf, -math.inf) and op in (">=", "<=") for op, bound in rng[1])


def range_violation(name: str, value, rng):
    """The one-line message for a value outside its declared range, or None when it is inside (a list option:
    the first of its values outside)."""
    if rng is None or value is None:
        return None
    if isinstance(value, list):
        return next(filter(None, (range_violation(name, v, rng) for v in value)), None)
    text, conds = rng
    if all(_OPS[op](value, bound) for op, bound in conds):
        return None
    what = f"be {text}" if len(conds) == 1 else f"satisfy {text}"
    return f"--{name} must {what} (got {value})"


def check_ranges(opts):
    """Exit 2 with one line on the first option outside its declared range (see the module docstring)."""
    comments = _field_comments(type(opts))
    for f in dataclasses.fields(opts):
        msg = range_violation(f.name, getattr(opts, f.name), parse_range(comments.get(f.name, "")))
        if msg:
            print(f"error: {msg}", file=sys.stderr, flush=True)
            sys.exit(2)


def _top_level(text, word):
    """text split at ` word ` outside parentheses."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0 and text.startswith(f" {word} ", i):
            parts.append(text[start:i])
            start = i = i + len(word) + 2
            continue
        i += 1
    return parts + [text[start:]]


def parse_condition(comment: str):
    """The [with ...] condition of a field comment as a list of parts that must all hold, each a list of
    alternatives of which one must hold ([with (a or b) and c]: [[a, b], [c]]), each alternative (name, op,
    values) (op: "true", "=", "!=", ">"); None without one. A bracket group that does not parse, or that mixes
    `and` and `or` without parentheses around the or-groups, is a programming error (ValueError)."""
    m = _WITH.search(comment or "")
    if m is None:
        return None
    text = " ".join(m.group(1).split())
    bad = ValueError(f"bad condition [with {m.group(1)}] in option comment {comment!r}: write NAME..., joined by "
                     "`and` or by `or`, an or-group in parentheses where both are used: [with (a or b) and c]")
    parts = _top_level(text, "and")
    if len(parts) == 1:
        parts = [f"({text})"] if len(_top_level(text, "or")) > 1 else parts
    elif any(len(_top_level(p, "or")) > 1 for p in parts):
        raise bad                                                   # a or b and c: which binds tighter?
    out = []
    for part in parts:
        part = part.strip()
        inner = part[1:-1].strip() if part.startswith("(") and part.endswith(")") else part
        if "(" in inner or ")" in inner or " and " in inner:
            raise bad                                               # only or-groups nest, one level
        alternatives = []
        for alt in inner.split(" or "):
            c = _COND.match(alt.strip())
            if c is None:
                raise bad
            name, op, values, gt, bound = c.groups()
            alternatives.append((name, op or gt or "true",
                                 values.split("|") if values else [float(bound)] if gt else []))
        out.append(alternatives)
    return out


def _holds(value, op, values):
    if op == "true":
        return bool(value)
    if op == ">":
        return value is not None and value > values[0]
    text = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return (text in values) == (op == "=")


def _says(name, op, values):
    """A condition in the words of the command line: `--policy_loss dual_clip`, `--kl_coef > 0`."""
    if op == "true":
        return f"--{name}"
    if op == ">":
        return f"--{name} > {values[0]:g}"
    return f"--{name} {' or '.join(values)}" if op == "=" else f"--{name} other than {' or '.join(values)}"


def condition_violation(opts, name, given, comments):
    """The one-line message for an option given on the command line where it does not apply, or None
    (comments: _field_comments of the options' class)."""
    cond = parse_condition(comments.get(name, ""))
    if cond is None or name not in given:
        return None
    failed = [alts for alts in cond if not any(_holds(getattr(opts, n), op, v) for n, op, v in alts)]
    if not failed:
        return None
    n, op, v = failed[0][0]
    got = "" if op == "true" or len(failed[0]) > 1 else f" (got {getattr(opts, n)})"
    group = "({})" if len(cond) > 1 else "{}"          # (--cost_model or --cost) and --advantage gae
    says = " and ".join(group.format(" or ".join(_says(*c) for c in alts)) if len(alts) > 1 else _says(*alts[0])
                        for alts in cond)
    return f"--{name} applies only with {says}{got}; here it would be ignored"


def _bool(s):
    if isinstance(s, bool):
        return s
    v = s.lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


# Every float option ends up in a float32 tensor (a coefficient, a rate, a score, a temperature) or beside one,
# so its value must be a float32 number: a magnitude above float32's largest finite value cannot be stored (torch
# raises "value cannot be converted to type float without overflow", mid-run), and a non-zero one below its
# smallest subnormal is stored as 0 (a temperature of 1e-300 divides by zero). What such a value multiplies can
# still overflow: a non-finite loss stops the run and a non-finite model is never saved (training.py), each one line.
# One product is computed outside any such check: AdamW's step size lr/(1 − β1^t), a Python float torch casts to
# float32 (a "value cannot be converted" stack). 1 − β1 >= 1.1e-16 for any β1 < 1, so every learning rate declares
# {... <= 1e3}: 1e3/1.1e-16 ≈ 1e19 stays far inside float32 (tests/test_cli.py checks each option *lr has it).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45      # the smallest float32 subnormal


def _float32(v, s):
    if abs(v) > FLOAT32_MAX and v not in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{s!r} is beyond float32's range (±3.4e38), the dtype it is computed in")
    if v != 0 and abs(v) < FLOAT32_TINY:
        raise argparse.ArgumentTypeError(f"{s!r} is 0 in float32 (the dtype it is computed in); pass 0 if 0 is meant")
    return v


def finite_float(s):
    """float(s), refusing nan and ±inf, and a value float32 cannot hold (argparse turns the error into one line)."""
    v = float(s)
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return _float32(v, s)


finite_float.__name__ = "float"


def not_nan_float(s):
    """float(s), refusing nan and a finite value float32 cannot hold (for an option whose range has inf or -inf
    as a bound)."""
    v = float(s)
    if v != v:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}")
    return _float32(v, s)


not_nan_float.__name__ = "float"


def seed_int(s):
    """A `seed` option: an int in [0, 2**63) (torch's generators take a signed 64-bit seed)."""
    v = int(s)
    if not 0 <= v < 2 ** 63:
        raise argparse.ArgumentTypeError(f"a seed must be in [0, 2**63), got {s!r}")
    return v


seed_int.__name__ = "int"


def _optional(inner):
    def conv(s):
        return None if s.lower() in ("none", "null", "") else inner(s)
    conv.__name__ = inner.__name__
    return conv


def build_parser(cls, description=None, prog=None):
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    p = OneLineErrors(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the fields cls declares itself (a script's algorithm and data), and those of any option group it takes from
    # outside this module, are listed in --help before the run options this module shares
    own = {name for c in cls.__mro__ if c.__module__ != __name__ for name in vars(c).get("__annotations__", {})}
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
        t = hints[f.name]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw = {"required": True, "help": f"{comments.get(f.name, '')} (required)"}
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kw = {"default": default, "help": f"{comments.get(f.name, '')} (default: {default})"}
        origin, args = typing.get_origin(t), typing.get_args(t)
        if origin is typing.Union and type(None) in args and typing.get_origin(args[0]) is list:
            t, origin, args = args[0], list, typing.get_args(args[0])     # Optional[list[X]]: none = not given
        floats = not_nan_float if allows_inf(parse_range(comments.get(f.name, ""))) else finite_float
        if origin is list:                    # list[X]: one or more values after the flag
            kw.update(nargs="+", type=floats if args[0] is float else args[0])
        elif origin is typing.Union and type(None) in args:
            inner = next(a for a in args if a is not type(None))
            kw["type"] = _optional(floats if inner is float else inner)
        elif origin is typing.Literal:
            kw["choices"], kw["type"] = list(args), type(args[0])
        elif t is bool:
            kw.update(type=_bool, nargs="?", const=True, metavar="BOOL")
        else:
            kw["type"] = floats if t is float else seed_int if (t is int and f.name == "seed") else t
        p.add_argument(f"--{f.name}", **kw)
    return p


class OneLineErrors(argparse.ArgumentParser):
    """argparse, but a bad command line is ONE line on stderr (`error: ...`, exit 2), like every other bad input,
    instead of the usage block followed by the message. A value that is a negative number in any notation
    (`-1e-3`, `-inf`) is a value, also among a list option's values (`--weights -1e-3 1`): argparse's own rule
    knows only `-1` and `-.5` and takes the others for an unknown option."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(?:\d+\.?\d*(?:e[-+]?\d+)?|\.\d+(?:e[-+]?\d+)?|inf|nan)$",
                                                   re.IGNORECASE)

    def error(self, message):
        if message.startswith("unrecognized arguments"):
            flag = next((f for f in (a.split("=")[0].lstrip("-") for a in message.split()[2:] if a.startswith("--"))
                         if f in MOVED_OPTIONS), None)
            if flag is not None:
                message += f"; --{flag} is an option of {MOVED_OPTIONS[flag]}"
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def given_options(cls, argv):
    """The names of the options argv gives (abbreviations resolved as argparse resolves them)."""
    p = build_parser(cls)
    for a in p._actions:
        a.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def parse_args(cls, argv=None, description=None, prog=None):
    """Parse argv (default sys.argv[1:]) into an instance of the dataclass `cls`: ranges first, then the options
    given where they do not apply (see the module docstring); each a one-line exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser(cls, description, prog).parse_args(argv)
    opts = cls(**vars(ns))
    check_ranges(opts)
    given, comments = given_options(cls, argv), _field_comments(cls)
    for f in dataclasses.fields(opts):
        msg = condition_violation(opts, f.name, given, comments)
        if msg:
            print(f"error: {msg}", file=sys.stderr, flush=True)
            sys.exit(2)
    return opts


def to_dict(opts):
    return dataclasses.asdict(opts)


def save_config(opts, path, **extra):
    """Write the resolved options (and any derived values) as JSON."""
    from .checkpoint import write_json
    write_json(path, dict(to_dict(opts), **extra))


# ---- The run options the scripts share, declared once: tokenizer and template, device and precision, logging,
# checkpointing and resume, FSDP and LoRA. Each script's `Options` inherits them and declares only its algorithm's
# and its data's fields:
#
#     @dataclass
#     class Options(FrozenModelOptions, RunOptions):
#         loss: Literal["dpo", "ipo"] = "dpo"   # which loss
#         ...
#
# A script whose default or help differs for one of these declares that field again (train_ppo's log_interval is
# 1, its --lora_r also adapts the critic); the parser above reads the comments through the bases, the subclass's
# last.
# The mixins are for options that only some scripts have: a frozen model to place (FrozenModelOptions), a model
# that torch.compile can take whole (CompileOption; the scripts that sample from the policy while training
# do not offer it). A script declares every option of its algorithm itself (tests/test_layout.py pins it); --help
# lists them before the ones shared here, each option in the place where it is first declared (--help,
# train_config.json and run.json follow it).
#
# A help line longer than one line continues on the comment-only lines right below it (the parser joins them).
# Modules that moved. No module stays importable at an old address (no shims): a spec that names one (--reward
# nano_rlhf.reasoning:reward, --cost, --judge, --tools) and a saved run whose record names one are refused with
# one line that gives the new name.
MOVED = {"nano_rlhf.synthetic": "nano_rlhf.tasks.synthetic", "nano_rlhf.reasoning": "nano_rlhf.tasks.reasoning",
         "nano_rlhf.ifeval": "nano_rlhf.tasks.ifeval", "nano_rlhf.run": "nano_rlhf.training"}


# Options that left a script with the family they belong to, and the script that has them now: a command line
# that still gives one to the old script is refused with the new script's name.
MOVED_OPTIONS = {name: "train_ppo_lagrangian.py (PPO-Lagrangian: a cost beside the reward)" for name in (
    "cost_model", "cost", "cost_limit", "lambda_init", "lambda_lr", "lambda_max", "lambda_delay", "cost_window",
    "cost_critic_init")}


def moved_module(text):
    """(old, new) when text names a module of MOVED (`nano_rlhf.reasoning:reward`, `nano_rlhf.reasoning.f`, the
    module itself), else None."""
    if not isinstance(text, str):
        return None
    for part in text.split(","):
        where = part.strip().split(":", 1)[0]
        for old, new in MOVED.items():
            if where == old or where.startswith(old + "."):
                return old, new
    return None


# What a --resume may change. Every other option of every script is the run's identity (nano_rlhf/training.py compares
# them all with the saved state/run.json), so an option added later is part of it unless it is named here.
CHANGEABLE = frozenset({
    # the run's course, not its math: how long, how often, where, what it reports
    "max_steps", "stop_at", "log_interval", "eval_interval", "save_interval", "report_to", "resume", "overwrite",
    "out_dir", "device", "dist_timeout",
    # batch_size x grad_accum x ranks is compared instead (the global batch: one process follows N ranks)
    "batch_size", "grad_accum",
    # the same math computed another way: speed and memory (sharding, compiling, recomputing, splitting)
    "compile", "compile_rollout", "grad_checkpoint", "fsdp", "frozen", "offload_frozen", "micro_batch_size",
    "precompute_ref", "share_prompt_prefill", "compact_rollout",
    # data files: compared by their sha256 (state/run.json's data_sha256), not by their path
    "data", "eval_data", "prompts", "eval_prompts", "ptx_data",
    # what the periodic evaluation and the warnings look at; training never reads them
    "eval_samples", "kl_warn", "score_warn", "retain_warn",
})

ChatTemplate = Literal["auto", "chatml", "smollm2", "qwen2.5", "qwen3", "llama3", "plain"]   # tokenizer.CHAT_TEMPLATES

@dataclass
class RunOptions:
    tokenizer: str = ""           # tokenizer.json; empty = the one in --init
    eos_token: str = ""           # end-of-text token name; empty = from tokenizer_config.json or the usual names
    pad_token: str = ""           # pad token name; empty = likewise (none: an id outside the vocabulary)
    chat_template: ChatTemplate = "auto"  # how conversational data is rendered;
                                          # auto = recognised from the tokenizer's own template
    date_string: str = ""         # Llama 3 "Today Date" (e.g. "26 Jul 2024"); empty = the one saved with the
                                  # tokenizer, else the template's default
    device: str = "auto"          # cpu, cuda, cuda:N, or auto
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16 = autocast (weights and log-softmax stay float32)
    grad_checkpoint: bool = False # recompute each block's activations in backward (activation memory for compute)
    logits_budget: float = 0.0    # MiB of float32 logits the log-probs hold at once (a chunk of positions, remade
                                  # in backward); 0 = 128 on a CPU, min(2048, 1/50 of the GPU) on CUDA {0 <= x <= 1e7}
    fsdp: bool = False            # shard weights, gradients and AdamW state over the ranks (FSDP2; under torchrun)
    log_interval: int = 10        # print and log every N steps {>= 1}
    eval_interval: int = 100      # evaluate every N steps (and at the end); 0 = only at the end {>= 0}
    save_interval: int = 500      # checkpoint every N steps (and at the end); 0 = only at the end {>= 0}
    resume: bool = False          # continue from out_dir/state
    stop_at: int = 0              # end this run after step N with a checkpoint (--resume later); 0 = never {>= 0}
    overwrite: bool = False       # allow a non-empty --out_dir that holds another run (never with --resume)
    report_to: Literal["none", "tensorboard", "wandb"] = "none"  # mirror metrics.jsonl to TensorBoard / W&B
    dist_timeout: float = 10.0    # minutes a rank waits for the others in a collective before the run fails
                                  # (a timedelta: at most 1e6, two years) {0 < x <= 1e6}
    lora_r: int = 0               # LoRA rank: train rank-r adapters on the frozen --init model; a reference
                                  # that is --init is then the policy with adapters off; 0 = off {>= 0}
    lora_alpha: float = 16.0      # LoRA scale α: the update is (α / r)·B·A [with lora_r>0] {> 0}
    lora_dropout: float = 0.0     # dropout on the adapters' input [with lora_r>0] {0 <= x < 1}
    lora_targets: str = ""        # comma list of nn.Linear names to adapt; empty = attention + MLP
                                  # (GPT-2: c_attn,c_proj,c_fc; Llama: q/k/v/o_proj,gate/up/down_proj) [with lora_r>0]


@dataclass
class FrozenModelOptions:
    """For the scripts that hold a frozen model (a reference, a reward model, a judge) beside the trained one."""
    frozen: Literal["shard", "replicate"] = "shard"  # the frozen reference / reward model sharded too, or whole on
                                                     # every rank [with fsdp]
    offload_frozen: bool = False  # keep the frozen models in CPU memory; they visit the GPU for their forwards


@dataclass
class CompileOption:
    """For the scripts whose trained model runs only full-sequence forwards (no sampling with it)."""
    compile: bool = False         # torch.compile the model being trained: its forward with the output layer, one graph
