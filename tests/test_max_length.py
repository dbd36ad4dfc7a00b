"""--max_length (SFT, RM, DPO) and PPO's prompt length: the training sequence length of an --init model whose
block_size is far longer than training data needs (real checkpoints declare 8k-128k positions).

Default min(block_size, 1024); an explicit value is what the data is truncated (and SFT packed) to; above the
model's block_size it is a one-line error before training. The spies below record the length each script hands
to its tokenizer function and stop the run there (no training needed to see it).
"""
import pytest

import train_dpo
import train_ppo
import train_rm
import train_sft
from conftest import pref_rows, prompt_rows, sft_rows, tiny_model, write_jsonl
from nano_rlhf.data import training_length


class _Stop(Exception):
    pass


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory, tok):
    """A tiny policy that declares 2048 positions, saved with its tokenizer (like an --init checkpoint)."""
    d = tmp_path_factory.mktemp("long")
    tiny_model(tok, block_size=2048).save_pretrained(str(d))
    tok.save(str(d / "tokenizer.json"))
    return str(d)


def _data(tmp_path):
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(40))
    write_jsonl(tmp_path / "pref.jsonl", pref_rows(40))
    write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(16))


def script_args(script, tmp_path, init):
    _data(tmp_path)
    common = ["--init", init, "--out_dir", str(tmp_path / f"out_{script}"), "--max_steps", "1", "--eval_interval", "0",
              "--warmup_steps", "0", "--batch_size", "4"]
    if script == "sft":
        return [*common, "--data", str(tmp_path / "sft.jsonl")]
    return [*common, "--data", str(tmp_path / "pref.jsonl")]


SCRIPTS = {"sft": (train_sft, "tokenize_sft"), "rm": (train_rm, "tokenize_pairs"), "dpo": (train_dpo, "tokenize_pairs")}


def lengths_used(monkeypatch, script, argv):
    """The max_len each call of the script's tokenizer function got, the run stopped at the first call."""
    module, name = SCRIPTS[script]
    seen = []

    def spy(records, tok, max_len, *a, **k):
        seen.append(max_len)
        raise _Stop
    monkeypatch.setattr(module, name, spy)
    with pytest.raises(_Stop):
        module.main(argv)
    return seen


def test_training_length_rule():
    assert training_length(0, 64, "m") == 64
    assert training_length(0, 32768, "m") == 1024
    assert training_length(300, 32768, "m") == 300
    assert training_length(64, 64, "m") == 64
    with pytest.raises(ValueError, match=r"^--max_length 65 is above the block_size 64 of m$"):
        training_length(65, 64, "m")


@pytest.mark.parametrize("script", SCRIPTS)
def test_default_and_explicit_max_length_reach_the_data(script, tmp_path, long_dir, monkeypatch):
    """A 2048-position model trains at 1024 by default, at --max_length when given (not at its block_size)."""
    argv = script_args(script, tmp_path, long_dir)
    assert lengths_used(monkeypatch, script, argv) == [1024]
    assert lengths_used(monkeypatch, script, argv + ["--max_length", "20", "--overwrite"]) == [20]


@pytest.mark.parametrize("script", SCRIPTS)
def test_max_length_above_block_size_is_one_line(script, tmp_path, long_dir, capsys):
    module = SCRIPTS[script][0]
    with pytest.raises(SystemExit) as e:
        module.main(script_args(script, tmp_path, long_dir) + ["--max_length", "4096"])
    out, err = capsys.readouterr()
    assert e.value.code != 0
    assert err.strip().splitlines()[-1] == f"error: --max_length 4096 is above the block_size 2048 of {long_dir}"
    assert "steps" not in out and not (tmp_path / f"out_{script}" / "model.safetensors").exists()


def test_from_scratch_max_length_above_block_size_fails_before_any_work(tmp_path, capsys):
    out = tmp_path / "scratch"
    with pytest.raises(SystemExit) as e:
        train_sft.main(["--out_dir", str(out), "--block_size", "64", "--max_length", "65"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --max_length 65 is above --block_size 64"
    assert not out.exists()


def test_sft_truncates_and_packs_to_max_length(tmp_path, long_dir, monkeypatch):
    """One real step: every packed row is at most --max_length tokens, some reach it, and the examples that were
    longer were cut to it (a {"text"} row keeps its beginning)."""
    data = tmp_path / "long.jsonl"
    write_jsonl(data, [{"text": " ".join(["the motor is great and the screen is bad."] * 6)}] * 4 + sft_rows(20))
    widths, packed_to = [], []
    real_collate, real_pack = train_sft.collate_packed, train_sft.pack_sft

    def collate_spy(rows, pad_id):
        out = real_collate(rows, pad_id)
        widths.append(out[0].shape[1])
        return out

    def pack_spy(examples, max_len):
        packed_to.append((max_len, max(len(e[0]) for e in examples)))
        return real_pack(examples, max_len)
    monkeypatch.setattr(train_sft, "collate_packed", collate_spy)
    monkeypatch.setattr(train_sft, "pack_sft", pack_spy)
    train_sft.main(["--init", long_dir, "--data", str(data), "--out_dir", str(tmp_path / "o"), "--max_steps", "1",
                    "--eval_interval", "0", "--warmup_steps", "0", "--batch_size", "4", "--packing",
                    "--max_length", "24"])
    assert packed_to == [(24, 24)]            # the long texts were cut to exactly 24 tokens before packing
    assert widths and max(widths) == 24


def test_ppo_prompt_length_default_follows_the_training_length(tmp_path, long_dir, rm_dir, monkeypatch, capsys):
    """PPO's --max_prompt_len 0 = min(block_size, 1024) - --max_new_tokens; prompt + new tokens past the block
    size is a one-line error."""
    _data(tmp_path)
    seen = []

    def spy(records, tok, max_prompt_len, tools=None):
        seen.append(max_prompt_len)
        raise _Stop
    argv = ["--prompts", str(tmp_path / "prompts.jsonl"), "--init", long_dir, "--reward_model", rm_dir,
            "--out_dir", str(tmp_path / "ppo"), "--max_steps", "1", "--batch_size", "4", "--samples_per_prompt", "1",
            "--max_new_tokens", "12"]
    monkeypatch.setattr(train_ppo, "tokenize_prompts", spy)
    with pytest.raises(_Stop):
        train_ppo.main(argv)
    assert seen == [1024 - 12]
    monkeypatch.undo()
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv[:-2] + ["--max_new_tokens", "40", "--max_prompt_len", "2040", "--overwrite"])
    assert e.value.code != 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: --max_prompt_len 2040 + --max_new_tokens 40 must fit in block_size 2048"
