"""Damaged state directories: every missing, truncated or corrupt file is a StateError (a ValueError, so the
scripts' input_errors() turns it into one line) naming the file, never a raw library exception."""
import json
import os

import pytest
import torch

from nano_rlhf import checkpoint
from nano_rlhf.checkpoint import StateError, load_state, save_state


def _setup(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    out = str(tmp_path / "out")
    os.makedirs(out)
    save_state(out, {"m": m}, {"m": opt}, {"step": 1})
    return out, m, opt


def _fresh():
    m = torch.nn.Linear(3, 2)
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)


def test_round_trip(tmp_path):
    out, m, opt = _setup(tmp_path)
    m2, opt2 = _fresh()
    assert load_state(out, {"m": m2}, {"m": opt2})["step"] == 1
    assert torch.equal(m.weight, m2.weight)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])


def _truncate(path):
    with open(path, "rb+") as f:
        f.truncate(os.path.getsize(path) // 2)


def _garble(path):
    with open(path, "w") as f:
        f.write('{"step": 1,')


@pytest.mark.parametrize("name, damage, words", [
    ("model_m.safetensors", _truncate, "unreadable or corrupt"),
    ("model_m.safetensors", os.remove, "missing"),
    ("optim_m.safetensors", _truncate, "unreadable or corrupt"),
    ("optim_m.json", os.remove, "missing"),
    ("optim_m.json", _garble, "unreadable or corrupt"),
    ("meta.json", _garble, "unreadable or corrupt"),
    ("rng_rank0.safetensors", os.remove, "missing"),
    ("rng_rank0.json", _garble, "unreadable or corrupt"),
])
def test_damaged_file_is_one_line_naming_it(tmp_path, name, damage, words):
    out, _, _ = _setup(tmp_path)
    path = os.path.join(out, "state", name)
    damage(path)
    m2, opt2 = _fresh()
    with pytest.raises(StateError) as e:
        load_state(out, {"m": m2}, {"m": opt2})
    msg = str(e.value)
    assert msg.startswith(path + ": ") and words in msg and "\n" not in msg


@pytest.mark.parametrize("step", ["two", -5, 1.5, True, None])
def test_a_meta_step_that_is_not_a_count_is_one_line(tmp_path, step):
    """A hand-edited meta.json ("step": "two", -5, ...) is a StateError naming the file, not a ValueError stack or
    a run "resuming at step -5"."""
    out, _, _ = _setup(tmp_path)
    meta_path = os.path.join(out, "state", "meta.json")
    meta = json.load(open(meta_path))
    meta["step"] = step
    checkpoint.write_json(meta_path, meta)
    m2, opt2 = _fresh()
    with pytest.raises(StateError) as e:
        load_state(out, {"m": m2}, {"m": opt2})
    assert str(e.value).startswith(f'{meta_path}: "step" is {step!r}, not a count') and "\n" not in str(e.value)


def test_model_of_another_shape_is_a_state_error(tmp_path):
    out, _, _ = _setup(tmp_path)
    other = torch.nn.Linear(5, 2)
    with pytest.raises(StateError, match="model_m.safetensors: does not fit the model"):
        load_state(out, {"m": other}, {})


def test_rng_of_another_world_size_restarts_with_a_note(tmp_path, capsys):
    out, _, _ = _setup(tmp_path)
    meta_path = os.path.join(out, "state", "meta.json")
    meta = json.load(open(meta_path))
    meta["world_size"] = 2
    checkpoint.write_json(meta_path, meta)
    os.remove(os.path.join(out, "state", "rng_rank0.json"))      # not needed when the streams restart
    m2, opt2 = _fresh()
    load_state(out, {"m": m2}, {"m": opt2})
    assert "RNG streams restart" in capsys.readouterr().out


def test_run_info_is_written_inside_the_swap(tmp_path):
    out, m, opt = _setup(tmp_path)
    assert not os.path.exists(os.path.join(out, "state", "run.json"))   # no run registered
    checkpoint.RUN_INFO = lambda: {"identity": {"script": "x"}}
    try:
        save_state(out, {"m": m}, {"m": opt}, {"step": 2})
    finally:
        checkpoint.RUN_INFO = None
    rec = json.load(open(os.path.join(out, "state", "run.json")))
    assert rec == {"identity": {"script": "x"}, "world_size": 1, "step": 2}
