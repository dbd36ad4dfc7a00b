"""The options dataclass at the top of each script is its command line.

    @dataclass
    class Options:
        lr: float = 3e-4          # peak learning rate
        loss: Literal["dpo", "ipo"] = "dpo"   # which loss

becomes `--lr 0.0003 --loss ipo`; the trailing comment of each field is its `--help` line, shown with
its default. Booleans take `--flag`, `--flag true` or `--flag false`; `Literal[...]` gives choices;
`Optional[int] = None` takes an int or `none`.
"""
import argparse
import dataclasses
import inspect
import io
import json
import sys
import tokenize
import typing


def _field_comments(cls):
    """{field name: trailing comment} read from the class source."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments, line_names = {}, {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        row = tok.start[0]
        if tok.type == tokenize.NAME and row not in line_names:
            line_names[row] = tok.string
        elif tok.type == tokenize.COMMENT and row in line_names:
            comments[line_names[row]] = tok.string.lstrip("#").strip()
    return comments


def _bool(s):
    if isinstance(s, bool):
        return s
    v = s.lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def _optional(inner):
    def conv(s):
        return None if s.lower() in ("none", "null", "") else inner(s)
    conv.__name__ = inner.__name__
    return conv


def build_parser(cls, description=None):
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = {"default": default, "help": f"{comments.get(f.name, '')} (default: {default})"}
        origin, args = typing.get_origin(t), typing.get_args(t)
        if origin is typing.Union and type(None) in args:
            kw["type"] = _optional(next(a for a in args if a is not type(None)))
        elif origin is typing.Literal:
            kw["choices"], kw["type"] = list(args), type(args[0])
        elif t is bool:
            kw.update(type=_bool, nargs="?", const=True, metavar="BOOL")
        else:
            kw["type"] = t
        p.add_argument(f"--{f.name}", **kw)
    return p


def parse_args(cls, argv=None, description=None):
    """Parse argv (default sys.argv[1:]) into an instance of the dataclass `cls`."""
    ns = build_parser(cls, description).parse_args(sys.argv[1:] if argv is None else argv)
    return cls(**vars(ns))


def to_dict(opts):
    return dataclasses.asdict(opts)


def save_config(opts, path, **extra):
    """Write the resolved options (and any derived values) as JSON."""
    from .checkpoint import write_json
    write_json(path, dict(to_dict(opts), **extra))
