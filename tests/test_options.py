"""The shared run options (nano_rlhf/cli.py): every script accepts exactly the flags, with the same defaults
and choices, that it accepted when each script declared its own (recorded from the scripts' parsers before the
move, in fixtures/script_flags_before_run_options.json), and the survey scripts gain the FSDP and LoRA flags."""
import importlib
import json
import os

import pytest

from nano_rlhf.cli import build_parser

BEFORE = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "script_flags_before_run_options.json")))
# what train_listwise / train_unpaired / train_online gained: train_dpo's FSDP and LoRA flags, its defaults
GAINED = {"--fsdp": [False, None], "--frozen": ["shard", ["shard", "replicate"]], "--offload_frozen": [False, None],
          "--lora_r": [0, None], "--lora_alpha": [16.0, None], "--lora_dropout": [0.0, None],
          "--lora_targets": ["", None]}
SURVEY = ("train_listwise", "train_unpaired", "train_online")
# KTO moved from train_dpo.py to train_unpaired.py
# --method kto, with the flags of its own: train_dpo lost them, train_unpaired gained them (kto-only there)
KTO_FLAGS = {"--desirable_weight": [1.0, None], "--undesirable_weight": [1.0, None]}
# (and --compile, which train_dpo.py --loss kto took: train_unpaired's methods run full-sequence forwards only)
KTO_GAINED = dict(KTO_FLAGS, **{"--precompute_ref": [False, None], "--max_length": [0, None],
                                "--compile": [False, None]})


# flags added or changed since the recording, on purpose: online DPO's soft labels on every pair by default, its
# hybrid objective with the judge's training pairs and train_dpo.py's learning rate (docs/algorithms.md, "Online
# and self-play methods"), the judge-score warning of the scripts that sample and train_rm's cost model (Safe RLHF)
LATER = {"train_online": {"--labels": ["auto", ["auto", "soft", "hard"]], "--pairs": ["all", ["all", "best_worst"]],
                          "--score_warn": [3.0, None], "--offline_data": ["judge", None],
                          "--offline_coef": [1.0, None], "--lr": [None, None]},
         "train_ppo": {"--score_warn": [3.0, None], "--cost_model": ["", None], "--cost": ["", None],
                       "--cost_limit": [0.0, None], "--lambda_init": [1.0, None], "--lambda_lr": [0.1, None],
                       "--lambda_max": [5.0, None], "--lambda_delay": [0, None], "--cost_window": [128, None],
                       "--cost_critic_init": ["auto", ["auto", "cost_model", "policy"]], "--tools": ["", None],
                       "--max_turns": [4, None]},
         "train_rm": {"--objective": ["reward", ["reward", "cost"]]}}


def after_kto_moved(script, want):
    want = dict(want)
    if script == "train_dpo":
        for k in KTO_FLAGS:
            del want[k]
        want["--loss"] = [want["--loss"][0], [c for c in want["--loss"][1] if c != "kto"]]
    if script == "train_unpaired":
        want.update(KTO_GAINED, **{"--method": [want["--method"][0], ["kto"] + want["--method"][1]]})
    return want


def flags(script):
    """{flag: [default, choices]} of a script's command line, as the recording was made."""
    p = build_parser(importlib.import_module(script).Options)
    return {a.option_strings[0]: [a.default, a.choices] for a in p._actions if a.option_strings[0] != "-h"}


@pytest.mark.parametrize("script", sorted(BEFORE))
def test_every_script_accepts_the_flags_it_did_with_the_same_defaults(script):
    want = after_kto_moved(script, dict(BEFORE[script], **(GAINED if script in SURVEY else {}),
                                        **LATER.get(script, {})))
    got = flags(script)
    assert sorted(set(got) - set(want)) == [] and sorted(set(want) - set(got)) == []
    assert {k: v for k, v in got.items() if v != want[k]} == {}


def test_script_specific_help_survives_the_move():
    """A field a script declares again keeps its own text (and default) in --help, not the shared one."""
    def help_of(script):
        return " ".join(build_parser(importlib.import_module(script).Options).format_help().split())
    assert "LoRA rank for the policy and the critic" in help_of("train_ppo")
    assert "(the score head fully)" in help_of("train_rm")
    assert "or train one on the data" in help_of("train_sft")
    assert "evaluate on held-out prompts every N steps (and at the end); 0 = end only {>= 0} (default: 20)" \
        in help_of("train_online")
    dpo = help_of("train_dpo")
    assert "print and log every N steps {>= 1} (default: 10)" in dpo and dpo.index("--loss") < dpo.index("--device")
