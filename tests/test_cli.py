"""Declared option ranges: the brace grammar, the one-line error (exit 2) and --help."""
import math
from dataclasses import dataclass
from typing import Literal, Optional

import pytest

from conftest import SCRIPTS
from nano_rlhf.cli import RunOptions, build_parser, parse_args, parse_range, range_violation


@dataclass
class Opts:
    lr: float = 3e-4              # peak learning rate {> 0}
    grad_accum: int = 1           # micro-steps per optimizer step {>= 1}
    label_smoothing: float = 0.0  # cDPO eps {0 <= x < 0.5}
    top_p: float = 1.0            # nucleus sampling {0 < x <= 1}
    max_len: Optional[int] = None  # cap; none = no cap {>= 1}
    temp: float = 1.0             # temperature {< inf}
    name: str = "x"               # a name, no range ({"a"} in the middle is not a range)
    loss: Literal["dpo", "ipo"] = "dpo"   # which loss


@pytest.mark.parametrize("text, conds", [
    ("{> 0}", [(">", 0.0)]), ("{>= 1}", [(">=", 1.0)]), ("{< 2.5}", [("<", 2.5)]), ("{<= -1}", [("<=", -1.0)]),
    ("{0 < x < 1}", [(">", 0.0), ("<", 1.0)]), ("{0 <= x <= 1}", [(">=", 0.0), ("<=", 1.0)]),
    ("{0 < x <= 1}", [(">", 0.0), ("<=", 1.0)]), ("{0 <= x < 0.5}", [(">=", 0.0), ("<", 0.5)]),
    ("{-inf < x < inf}", [(">", -math.inf), ("<", math.inf)]), ("{>= 1e-3}", [(">=", 1e-3)]),
    ("{>=1}", [(">=", 1.0)]), ("{ 0<x<1 }", [(">", 0.0), ("<", 1.0)]),
])
def test_every_range_form_parses(text, conds):
    assert parse_range(f"a comment {text}")[1] == conds


def test_no_range_and_bad_ranges():
    assert parse_range("plain comment") is None
    assert parse_range('{"prompt"} rows, then text') is None          # braces not at the end: not a range
    for bad in ("{> x}", "{0 < y < 1}", "{1 < x}", "{=> 1}"):
        with pytest.raises(ValueError, match="bad range"):
            parse_range(f"comment {bad}")


@pytest.mark.parametrize("rng, inside, outside", [
    ("{> 0}", [1e-9, 5], [0, -1]), ("{>= 1}", [1, 2], [0, 0.999]), ("{< 2}", [1.9, -5], [2, 3]),
    ("{<= 2}", [2, -5], [2.0001]), ("{0 < x < 1}", [0.5], [0, 1]), ("{0 <= x <= 1}", [0, 1], [-0.1, 1.1]),
    ("{0 < x <= 1}", [1, 0.1], [0, 1.5]), ("{0 <= x < 0.5}", [0, 0.49], [0.5, -0.01]),
])
def test_bounds_are_strict_or_inclusive_as_written(rng, inside, outside):
    r = parse_range(rng)
    for v in inside:
        assert range_violation("v", v, r) is None, (rng, v)
    for v in outside:
        assert range_violation("v", v, r) is not None, (rng, v)


def test_in_range_values_parse():
    o = parse_args(Opts, ["--lr", "0.1", "--label_smoothing", "0", "--top_p", "1", "--max_len", "none"])
    assert (o.lr, o.label_smoothing, o.top_p, o.max_len) == (0.1, 0.0, 1.0, None)
    assert parse_args(Opts, ["--max_len", "5"]).max_len == 5


@pytest.mark.parametrize("argv, line", [
    (["--lr", "-1"], "error: --lr must be > 0 (got -1.0)"),
    (["--lr", "0"], "error: --lr must be > 0 (got 0.0)"),
    (["--grad_accum", "0"], "error: --grad_accum must be >= 1 (got 0)"),
    (["--label_smoothing", "0.5"], "error: --label_smoothing must satisfy 0 <= x < 0.5 (got 0.5)"),
    (["--top_p", "0"], "error: --top_p must satisfy 0 < x <= 1 (got 0.0)"),
    (["--max_len", "0"], "error: --max_len must be >= 1 (got 0)"),
    # non-finite floats are refused by the type, before any range (NaN would pass every comparison)
    (["--temp", "inf"], "error: argument --temp: expected a finite number, got 'inf' (see --help)"),
    (["--lr", "nan"], "error: argument --lr: expected a finite number, got 'nan' (see --help)"),
])
def test_out_of_range_is_one_line_and_exit_2(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(Opts, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == line + "\n"


def test_help_shows_the_range():
    text = build_parser(Opts).format_help()
    assert "peak learning rate {> 0} (default: 0.0003)" in text
    assert "cDPO eps {0 <= x < 0.5}" in text


def test_the_scripts_options_parse_with_their_defaults():
    """Every script's defaults satisfy their own declared ranges (and no comment is a malformed range)."""
    import importlib
    for name in SCRIPTS:
        mod = importlib.import_module(name)
        parse_args(mod.Options, [])


def test_negative_exponent_and_unknown_option_are_one_line(capsys):
    """`--lr -1e-4` reaches the range check (argparse alone reads '-1e-4' as an option and prints its usage
    block); an unknown option or a bad choice is one line too."""
    import train_dpo
    from nano_rlhf.cli import parse_args
    for argv, needle in ((["--lr", "-1e-4"], "--lr must satisfy 0 < x <= 1e3 (got -0.0001)"),
                         (["--no_such_option", "1"], "unrecognized arguments: --no_such_option"),
                         (["--loss", "nope"], "argument --loss: invalid choice")):
        with pytest.raises(SystemExit) as e:
            parse_args(train_dpo.Options, argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err, err


@dataclass
class Base:
    log_interval: int = 10        # print every N steps {>= 1}
    note: float = 1.0             # said by the base {>= 0}


@dataclass
class Sub(Base):
    lr: float = 3e-4              # peak learning rate {> 0}
    note: float = 2.0             # said again by the subclass {> 1}


def test_an_inherited_field_keeps_its_help_and_range_and_a_redeclared_one_takes_the_subclass(capsys):
    text = " ".join(build_parser(Sub).format_help().split())
    assert "print every N steps {>= 1} (default: 10)" in text
    assert "said again by the subclass {> 1} (default: 2.0)" in text and "said by the base" not in text
    assert text.index("--lr") > text.index("--log_interval")      # a field's place is where it is first declared
    assert parse_args(Sub, ["--log_interval", "3"]).log_interval == 3
    with pytest.raises(SystemExit) as e:
        parse_args(Sub, ["--log_interval", "0"])
    assert e.value.code == 2 and capsys.readouterr().err == "error: --log_interval must be >= 1 (got 0)\n"
    with pytest.raises(SystemExit):
        parse_args(Sub, ["--note", "1"])       # the subclass's range, not the base's {>= 0}
    assert capsys.readouterr().err == "error: --note must be > 1 (got 1.0)\n"


@dataclass
class Group:
    temperature: float = 1.0      # an option group a package module declares for the scripts of its subject {> 0}


@dataclass
class Script(Group, RunOptions):
    lr: float = 3e-4              # peak learning rate {> 0}
    log_interval: int = 1         # said again by the script {>= 1}


def test_help_lists_the_script_s_options_and_its_option_groups_before_the_shared_run_options():
    """--help: the script's own options and an option group it takes from another module
    first, each in its declared place, then the run options every script shares (cli.RunOptions); a run option the
    script declares again is the script's."""
    text = " ".join(build_parser(Script).format_help().split())
    assert text.index("--log_interval") < text.index("--temperature") < text.index("--lr") < text.index("--device")
    assert "said again by the script {>= 1} (default: 1)" in text


@dataclass
class Wrapped:
    rank: int = 0                 # adapter rank: train rank-r adapters on the frozen model;
                                  # a reference that is --init is then the policy with adapters off;
                                  # 0 = off {>= 0}
    alpha: float = 16.0           # scale α {> 0}
    # a section note at field indentation: not the help of alpha or of what follows
    targets: str = ""             # comma list of names
    # not a continuation either (left of the comment above)
    plain: int = 1                # one line
                                  # continued under it

    dropout: float = 0.0          # after a blank line nothing continues {0 <= x < 1}


def test_a_wrapped_comment_is_one_help_line_with_its_range(capsys):
    from nano_rlhf.cli import _field_comments
    c = _field_comments(Wrapped)
    assert c["rank"] == ("adapter rank: train rank-r adapters on the frozen model; a reference that is --init is "
                         "then the policy with adapters off; 0 = off {>= 0}")
    assert c["alpha"] == "scale α {> 0}"            # the following section comment is not swallowed
    assert c["targets"] == "comma list of names"
    assert c["plain"] == "one line continued under it"
    assert c["dropout"] == "after a blank line nothing continues {0 <= x < 1}"
    text = " ".join(build_parser(Wrapped).format_help().split())
    assert "adapters off; 0 = off {>= 0} (default: 0)" in text
    with pytest.raises(SystemExit) as e:
        parse_args(Wrapped, ["--rank", "-1"])          # the range read from the comment's last line
    assert e.value.code == 2 and capsys.readouterr().err == "error: --rank must be >= 0 (got -1)\n"
    assert parse_args(Wrapped, ["--rank", "4"]).rank == 4


# ---- options that apply only with another option ([with ...]) ---------------------------------------------------

@dataclass
class Cond:
    loss: Literal["a", "b", "c"] = "a"
    cap: float = 3.0              # the cap [with loss=b|c] {> 1}
    tail: int = 0                 # the tail [with loss!=a and coef>0]
    coef: float = 0.0             # a coefficient {>= 0}
    flag: bool = False            # a switch
    level: str = "x"              # a level [with flag]


@pytest.mark.parametrize("argv,line", [
    (["--cap", "3.0"], "error: --cap applies only with --loss b or c (got a); here it would be ignored"),  # the default
    (["--ca", "5"], "error: --cap applies only with --loss b or c (got a)"),                               # abbreviated
    (["--loss", "b", "--tail", "2"], "error: --tail applies only with --loss other than a and --coef > 0 (got 0.0)"),
    (["--level", "y"], "error: --level applies only with --flag; here it would be ignored"),
    (["--flag", "false", "--level", "y"], "error: --level applies only with --flag"),
])
def test_an_option_given_where_it_does_not_apply_is_one_line_and_exit_2(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(Cond, argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(line), err


@pytest.mark.parametrize("argv", [[], ["--loss", "c", "--cap", "5"], ["--loss", "b", "--coef", "1", "--tail", "2"],
                                  ["--flag", "--level", "y"], ["--flag=true", "--level=y"]])
def test_an_option_where_it_applies_or_left_out_parses(argv):
    parse_args(Cond, argv)


def test_every_declared_condition_names_an_option_of_its_script():
    """A typo in a [with ...] would make an option always refused or never checked: every condition of every
    script's and tool's options parses and names a field of the same Options."""
    import dataclasses
    import importlib
    from nano_rlhf.cli import _field_comments, parse_condition
    modules = SCRIPTS + ["nano_rlhf.label", "nano_rlhf.evaluate", "nano_rlhf.merge"]
    seen = 0
    for name in modules:
        cls = importlib.import_module(name).Options
        fields = {f.name for f in dataclasses.fields(cls)}
        for field, comment in _field_comments(cls).items():
            for option, _, _ in (alt for alts in parse_condition(comment) or [] for alt in alts):
                assert option in fields, f"{name}.Options.{field}: [with {option} ...] names no option"
                seen += 1
    assert seen >= 30, seen


@pytest.mark.parametrize("argv,line", [
    (["--dual_clip", "5"], "error: --dual_clip applies only with --policy_loss dual_clip (got ppo)"),
    (["--correction_level", "sequence"], "error: --correction_level applies only with --rollout_correction other"),
    (["--rollout_correction", "tis"], "error: --rollout_correction applies only with --rollout_dtype other than"),
    (["--max_sampling_rounds", "5"], "error: --max_sampling_rounds applies only with --dynamic_sampling"),
    (["--overlong_buffer", "4"], "error: --overlong_buffer applies only with --overlong penalty"),
    (["--kl_in_loss", "--kl_coef", "0"], "error: --kl_in_loss applies only with --kl_coef > 0"),
    (["--advantage", "grpo", "--gamma", "0.9"], "error: --gamma applies only with --advantage gae or reinforce_pp"),
    (["--advantage", "rloo", "--lam", "0.9"], "error: --lam applies only with --advantage gae (got rloo)"),
    (["--advantage", "grpo", "--critic_warmup_steps", "0"], "error: --critic_warmup_steps applies only with"),
    (["--kl_target", "2"], "error: --kl_target applies only with --adaptive_kl"),
    (["--lora_alpha", "8"], "error: --lora_alpha applies only with --lora_r > 0"),
    (["--frozen", "replicate"], "error: --frozen applies only with --fsdp"),
    (["--judge", "gold"], "error: --judge applies only with --reward selfplay (got model)"),
])
def test_ppo_options_that_would_be_ignored_are_refused(argv, line, capsys):
    import train_ppo
    with pytest.raises(SystemExit) as e:
        parse_args(train_ppo.Options, argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(line), err


def test_no_help_line_of_an_options_class_is_lost():
    """A comment-only line right below a field's comment continues it only from that comment's column on; one
    further left would be dropped from --help, and a [with ...] or a range on it would be silently unchecked.
    A section heading (`# ---- the rollout`) is no help line."""
    import importlib
    import inspect
    import io
    import tokenize
    lost = []
    for name in SCRIPTS + ["nano_rlhf.label", "nano_rlhf.evaluate", "nano_rlhf.merge", "nano_rlhf.cli"]:
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and cls.__module__ == module.__name__ and cls.__name__.endswith("Options")):
                continue
            toks = list(tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline))
            code_rows = {t.start[0] for t in toks if t.type == tokenize.NAME}
            open_ = None
            for t in (t for t in toks if t.type == tokenize.COMMENT):
                (row, col), continues = t.start, open_ is not None and t.start[0] == open_[0] + 1
                if row in code_rows:
                    open_ = (row, col)
                elif continues and col < open_[1] and not t.string.startswith("# ----"):
                    lost.append(f"{name}.{cls.__name__}: {t.string[:50]}")
                    open_ = None
                else:
                    open_ = (row, open_[1]) if continues else None
    assert not lost, lost


# ---- list and required options (the python -m tools: evaluate --model A B, merge --weights 1 -1e-3) --------------

@dataclass
class Listed:
    models: list[str]             # one or more directories
    weights: Optional[list[float]] = None  # one per model; none = all 1 {> -10}
    scale: float = 1.0            # a scale [with models]


def test_list_and_required_options(capsys):
    o = parse_args(Listed, ["--models", "a", "b", "--weights", "1", "-1e-3", "--scale", "-2.5E+1"])
    assert (o.models, o.weights, o.scale) == (["a", "b"], [1.0, -1e-3], -25.0)      # negative numbers, any notation
    assert parse_args(Listed, ["--models", "a"]).weights is None
    for argv, line in ((["--weights", "1"], "error: the following arguments are required: --models (see --help)"),
                       (["--models", "a", "--weights", "1", "-11"], "error: --weights must be > -10 (got -11.0)"),
                       (["--models", "a", "--weights", "nan"], "error: argument --weights: expected a finite number")):
        with pytest.raises(SystemExit) as e:
            parse_args(Listed, argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith(line), err
    assert "one or more directories (required)" in " ".join(build_parser(Listed).format_help().split())


@pytest.mark.parametrize("tool, argv, line", [
    ("nano_rlhf.evaluate", ["--model", "m", "--pass_threshold", "0.5"], "--pass_threshold applies only with --pass_k"),
    ("nano_rlhf.evaluate", ["--model", "m", "--pass_k", "1"], "--pass_k applies only with --reward"),
    ("nano_rlhf.merge", ["--base", "b", "--models", "m", "--method", "task_arithmetic", "--out_dir", "o", "--scale",
                         "1.0"], "--scale applies only with --method ties (got task_arithmetic)"),
    ("nano_rlhf.label", ["--out", "o", "--threshold", "0"], "--threshold applies only with --format unpaired"),
])
def test_the_tools_read_the_same_declarations(tool, argv, line, capsys):
    """evaluate, merge and label parse their command lines from an Options class as the scripts do: an option
    given where it does not apply is the same one line, exit 2, and --help shows when it applies."""
    import importlib
    cls = importlib.import_module(tool).Options
    with pytest.raises(SystemExit) as e:
        parse_args(cls, argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith(f"error: {line}"), err
    assert "[with " in build_parser(cls).format_help()


# ---- one exit code for a bad command line ----------------------------------------------------------------------

@pytest.mark.parametrize("script, argv, line", [
    ("train_ppo", ["--advantage", "grpo", "--samples_per_prompt", "1"], "--advantage grpo needs --samples_per_prompt"),
    ("train_ppo", ["--reward", "nonsense"], "--reward must be model, gold, selfplay"),
    ("train_ppo", ["--policy_loss", "gspo"], "--policy_loss gspo weighs whole sequences"),
    ("train_ppo", ["--overlong", "mask"], "--overlong mask decides what a truncated response costs"),
    ("train_ppo", ["--fsdp", "--rollout_dtype", "bfloat16"], "--rollout_dtype bfloat16 with --fsdp"),
    ("train_ppo", ["--reward", "selfplay"], "--reward selfplay needs a judge"),
    ("train_ppo", ["--batch_size", "3", "--num_minibatches", "5"], "the rollout of "),
    ("train_ppo_lagrangian", ["--cost_model", "c", "--cost", "c.py:f"], "pass one cost"),
    ("train_ppo_lagrangian", [], "PPO-Lagrangian needs a cost"),
    ("train_online", ["--method", "sppo", "--samples_per_prompt", "1", "--judge", "gold"], "--method sppo compares"),
    ("train_online", ["--method", "cringe", "--ref_update_every", "2", "--judge", "gold"], "--ref_update_every has no"),
    ("train_online", ["--labels", "soft", "--loss", "simpo", "--judge", "gold"], "--labels soft: --loss simpo"),
    ("train_online", ["--labels", "soft", "--label_smoothing", "0.1", "--judge", "gold"], "--labels soft sets each"),
    ("train_online", ["--judge", "no/such/dir"], "--judge no/such/dir: not a directory, gold"),
    ("train_dpo", ["--loss", "tdpo", "--precompute_ref"], "--precompute_ref cannot be used with --loss tdpo"),
    ("train_unpaired", ["--method", "kto", "--batch_size", "1"], "--method kto needs --batch_size >= 2"),
    ("train_sft", ["--max_steps", "2", "--stop_at", "3"], "--stop_at 3 is past --max_steps 2"),
])
def test_every_rule_between_options_is_exit_2(script, argv, line, capsys):
    """A rule between options that a declaration cannot say, hand-written in a script's check_options, is a bad
    command line like a range or an ignored option: one line, exit 2 (they mixed 1 and 2)."""
    import importlib
    module = importlib.import_module(script)
    opts = parse_args(module.Options, argv)
    getattr(module, "fill_defaults", lambda o: None)(opts)          # as run.start does, before check_options
    with pytest.raises(SystemExit) as e:
        module.check_options(opts)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: {line}"), (e.value.code, err)


# ---- numbers a float32 tensor can hold ---------------------------------------------------------------------------

COMMANDS = {**{name: [] for name in SCRIPTS}, "nano_rlhf.evaluate": ["--model", "m"], "nano_rlhf.label": [],
            "nano_rlhf.merge": ["--base", "b", "--models", "m", "--method", "ties", "--out_dir", "o"]}


def _float_fields(cls):
    import dataclasses
    import typing
    hints = typing.get_type_hints(cls)
    floats = (float, Optional[float], list[float], Optional[list[float]])
    return [f.name for f in dataclasses.fields(cls) if hints[f.name] in floats]


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_every_float_option_takes_a_float32_number_and_nothing_beyond(module, capsys):
    """The boundary of every float option of every script and tool: float32's largest finite value and its smallest
    subnormal parse (or are refused by the option's own range or condition), one step past either is one line,
    exit 2 (a torch cast raised mid-run, or the value became 0)."""
    import importlib
    cls = importlib.import_module(module).Options
    names = _float_fields(cls)
    assert names
    for name in names:
        for value, fits in (("3.4028e38", True), ("-3.4028e38", True), ("1.5e-45", True), ("3.41e38", False),
                            ("-3.41e38", False), ("1e-46", False), ("-1e-46", False)):
            try:
                parse_args(cls, COMMANDS[module] + [f"--{name}", value])
                refused = None
            except SystemExit as e:
                refused = (e.code, capsys.readouterr().err.strip())
            if fits:
                assert refused is None or refused[0] == 2 and ("must" in refused[1] or "applies only" in refused[1]), \
                    (module, name, value, refused)
            else:
                assert refused and refused[0] == 2 and len(refused[1].splitlines()) == 1 and "float32" in refused[1], \
                    (module, name, value, refused)


@pytest.mark.parametrize("module", [m for m in sorted(COMMANDS) if m.startswith("train_")])
def test_every_learning_rate_declares_its_float32_bound(module):
    """AdamW's step lr/(1 − β1^t) is cast to float32 outside any finiteness check: each learning rate option
    declares an upper bound <= 1e3 (nano_rlhf/cli.py says why)."""
    import importlib
    from nano_rlhf.cli import _field_comments
    cls = importlib.import_module(module).Options
    rates = [n for n in _float_fields(cls) if n == "lr" or n.endswith("_lr") and n != "lambda_lr"]   # (λ's step
    # is Python arithmetic on log λ, not AdamW's)
    assert rates
    for name in rates:
        rng = parse_range(_field_comments(cls)[name])
        assert rng and any(op in ("<", "<=") and bound <= 1e3 for op, bound in rng[1]), (module, name, rng)


# ---- rules the code enforces, never a comment's wording -----------------------------------------------------

def test_an_options_class_whose_source_cannot_be_read_is_refused():
    """Help, ranges and conditions are read from the class's source: one defined with exec (a REPL, generated
    code) has none, and parsing it raises instead of silently dropping every check."""
    scope = {"dataclass": dataclass}
    exec("@dataclass\nclass Made:\n    lr: float = 0.1   # learning rate {> 0}\n", scope)
    with pytest.raises(TypeError, match="Made: its source cannot be read"):
        parse_args(scope["Made"], ["--lr", "-1"])


@dataclass
class Infinite:
    clip: float = 1.0             # inf = no clipping {0 < x <= inf}
    said: float = 1.0             # inf = no clipping, in words only {> 0}
    low: float = 0.0              # a floor {-inf <= x <= 0}


def test_inf_is_a_bound_of_the_range_not_a_phrase_of_the_help(capsys):
    """A float takes inf only where its range includes it as a bound ({0 < x <= inf}); the same words in the
    help text change nothing."""
    assert parse_args(Infinite, ["--clip", "inf"]).clip == math.inf
    assert parse_args(Infinite, ["--low", "-inf"]).low == -math.inf
    for argv, line in ((["--said", "inf"], "error: argument --said: expected a finite number, got 'inf'"),
                       (["--clip", "-inf"], "error: --clip must satisfy 0 < x <= inf (got -inf)"),
                       (["--low", "inf"], "error: --low must satisfy -inf <= x <= 0 (got inf)")):
        with pytest.raises(SystemExit) as e:
            parse_args(Infinite, argv)
        assert e.value.code == 2 and capsys.readouterr().err.startswith(line), argv


@dataclass
class Mixed:
    a: bool = False               # a
    b: bool = False               # b
    c: bool = False               # c
    both: int = 0                 # needs (a or b) and c [with (a or b) and c]
    either: int = 0               # needs a or b or c [with a or b or c]


def test_and_and_or_mix_only_with_parentheses():
    """[with (a or b) and c] is the only way to mix: the or-group in parentheses. A mix without them, a nested
    and, or an and inside the parentheses is refused, so no reader has to know which binds tighter."""
    from nano_rlhf.cli import parse_condition
    assert parse_condition("[with (a or b) and c]") == [[("a", "true", []), ("b", "true", [])], [("c", "true", [])]]
    assert parse_condition("[with a or b or c]") == [[("a", "true", []), ("b", "true", []), ("c", "true", [])]]
    assert parse_condition("[with a and b]") == [[("a", "true", [])], [("b", "true", [])]]
    for bad in ("[with a or b and c]", "[with a and b or c]", "[with (a and b) or c]", "[with ((a or b)) and c]"):
        with pytest.raises(ValueError, match="bad condition"):
            parse_condition(bad)
    parse_args(Mixed, ["--b", "--c", "--both", "1"])
    with pytest.raises(SystemExit):
        parse_args(Mixed, ["--a", "--both", "1"])


def _older_reading(text):
    """How the grammar read [with ...] before parentheses: split at ` and ` first (and bound looser than or),
    then at ` or `, parentheses dropped. Written from that rule, not from the parser."""
    from nano_rlhf.cli import _COND
    parts = []
    for part in text.replace("(", "").replace(")", "").split(" and "):
        alts = []
        for alt in part.split(" or "):
            name, op, values, gt, bound = _COND.match(alt.strip()).groups()
            alts.append((name, op or gt or "true", values.split("|") if values else [float(bound)] if gt else []))
        parts.append(alts)
    return parts


def test_every_declared_condition_means_what_it_meant_before_the_parentheses():
    """Each [with ...] of every script and command parses to the same conditions as under the older rule
    (`and` looser than `or`): adding the parentheses changed no meaning."""
    import importlib
    import re
    from nano_rlhf.cli import _field_comments, parse_condition
    seen = 0
    for name in SCRIPTS + ["nano_rlhf.label", "nano_rlhf.evaluate", "nano_rlhf.merge"]:
        for field, comment in _field_comments(importlib.import_module(name).Options).items():
            m = re.search(r"\[with ([^\[\]]+)\]", comment)
            if m:
                assert parse_condition(comment) == _older_reading(" ".join(m.group(1).split())), (name, field)
                seen += 1
    assert seen >= 60, seen
