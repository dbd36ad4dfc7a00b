"""Small file helpers several modules share (checkpoint, parallel, config, run): the state directory's error,
its JSON reader, and atomic writes (a temporary file, fsync, rename). A leaf: it imports nothing of nano_rlhf."""
import json
import os


class StateError(ValueError):
    """A missing, truncated or corrupt file in a state directory (a ValueError, so common.input_errors
    turns it into one line)."""


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise StateError(f"{path}: missing; the saved state is incomplete") from None
    except (OSError, ValueError) as e:
        raise StateError(f"{path}: unreadable or corrupt ({e}); the saved state is damaged") from None


def atomic_write_text(path, text):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")
