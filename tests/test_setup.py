"""The set-up every script shares (nano_rlhf/training.py): the pieces on their own (placing and seeding, wrapping
with the script's AdamW settings, the tokenizer recorded in the run, save/resume of models, optimizers and data
order, train_config.json), then every one of the seven scripts through it: main() opens with the same five visible
steps (parse, fill the defaults, check, the process group, open the run), the same calls in every main (so --fsdp,
--lora_*, --resume and the memory plan are the same code in each) and --report_to refused the same way by each
before anything is written."""
import ast
import builtins
import json
import os
import sys
from dataclasses import dataclass

import pytest
import torch
from conftest import SCRIPTS, tiny_model

from test_lora_scripts import dpo_args, ppo_args, rm_args, sft_args
from test_online import online_args
from test_unpaired import args as unpaired_args

import train_dpo
import train_listwise
import train_online
import train_ppo
import train_ppo_lagrangian
import train_rm
import train_sft
import train_unpaired
from nano_rlhf import dist
from nano_rlhf import training
from nano_rlhf.cli import RunOptions, parse_args
from nano_rlhf.data import Batches


@dataclass
class Toy(RunOptions):
    out_dir: str = "out/toy"
    seed: int = 3
    max_steps: int = 4
    batch_size: int = 2
    grad_accum: int = 1
    lr: float = 1e-2
    weight_decay: float = 0.1


def toy(argv=()):
    opts = parse_args(Toy, list(argv))
    world = dist.setup(opts.device, timeout_minutes=opts.dist_timeout)
    return opts, world, training.open_run(opts, "toy", identity={"lr": opts.lr})


# ---- the pieces -------------------------------------------------------------------------------------

def test_place_moves_checkpoints_the_trained_only_and_seeds_per_rank(tok):
    opts = Toy(grad_checkpoint=True)
    policy, ref = tiny_model(tok), tiny_model(tok, seed=1)
    training.place(opts, dist.world(), {"policy": policy}, {"reference": ref, "absent": None})
    assert policy.gradient_checkpointing and not ref.gradient_checkpointing
    dev = dist.world().device
    assert all(p.device.type == dev.type for m in (policy, ref) for p in m.parameters())
    after = torch.rand(3)
    dist.seed_everything(3, dist.world().rank)
    assert torch.equal(after, torch.rand(3))        # seeded with --seed, for this rank


def test_wrap_takes_the_scripts_adamw_settings(tok):
    model = tiny_model(tok)
    ddp, opt = training.prepare(Toy(), model, 0.5)
    assert ddp is model                             # one process: the model itself
    groups = opt.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and groups[0]["lr"] == 0.5
    assert groups[0]["betas"] == (0.9, 0.95) and groups[0]["eps"] == 1e-8

    @dataclass
    class WithAdam(Toy):
        beta1: float = 0.8
        beta2: float = 0.99
        adam_eps: float = 1e-5
    _, opt = training.prepare(WithAdam(), model, 0.5)
    assert opt.param_groups[0]["betas"] == (0.8, 0.99) and opt.param_groups[0]["eps"] == 1e-5
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}


def test_tokenizer_is_loaded_or_the_script_s_own_and_recorded_either_way(tok, tmp_path):
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    run = type("R", (), {"identity": {}})()
    got = training.tokenizer(Toy(tokenizer=path), run)
    assert got is not tok and got.vocab_size == tok.vocab_size
    assert run.identity == {"chat_template": got.chat_template, "date_string": got.date_string}
    run.identity.clear()
    assert training.tokenizer(Toy(), run, made=got) is got and run.identity["chat_template"] == got.chat_template


def test_save_then_resume_restores_models_optimizers_and_data_order(tok, tmp_path):
    out = str(tmp_path / "o")
    opts, world, run = toy(["--out_dir", out])
    model = tiny_model(tok)
    _, opt = training.prepare(opts, model, opts.lr)
    batches = Batches(10, 2, 1, 0, 1, seed=0)
    model(torch.ones(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    batches.next_step()
    batches.next_step()
    run.save(2, {"policy": model}, {"policy": opt}, data={"data": batches}, extra=1.5)
    run.saved = True
    run.finish({})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    nxt = batches.next_step()

    opts, world, run = toy(["--out_dir", out, "--resume"])
    fresh = tiny_model(tok, seed=5)
    _, opt2 = training.prepare(opts, fresh, opts.lr)
    order = Batches(10, 2, 1, 0, 1, seed=0)
    meta = run.resume({"policy": fresh}, {"policy": opt2}, data={"data": order}, max_steps=4)
    assert meta["step"] == 2 and meta["extra"] == 1.5 and run.step == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    assert order.next_step() == nxt
    with open(os.path.join(out, "train_config.json")) as f:
        config = json.load(f)
    assert config["max_steps"] == 4 and config["world_size"] == 1 and config["resume"] is True
    run.finish({})


def test_resume_off_writes_the_config_and_restores_nothing(tok, tmp_path):
    opts, world, run = toy(["--out_dir", str(tmp_path / "o")])
    order = Batches(10, 2, 1, 0, 1, seed=0)
    assert run.resume({"policy": tiny_model(tok)}, {}, data={"data": order}, global_batch=2) == {}
    with open(tmp_path / "o" / "train_config.json") as f:
        assert json.load(f)["global_batch"] == 2
    run.finish({})


# ---- every script through it ------------------------------------------------------------------------

SETUP = ["parse_args", "fill_defaults", "check_options", "dist.setup", "training.open_run"]


@pytest.mark.parametrize("name", [s.removeprefix("train_") for s in SCRIPTS])
def test_every_main_opens_with_its_set_up_written_out(name):
    """main() reads parse -> fill the defaults (where a default depends on another option) -> check -> the
    process group -> (the data that must be valid first: sft, rm) -> open the run, as calls in the script, in
    that order: the order decides which bad input a user hears about first, so it stands where it is read."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f"train_{name}.py")
    main = next(n for n in ast.parse(open(path).read()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    calls = [ast.unparse(c.func) for stmt in main.body for c in ast.walk(stmt) if isinstance(c, ast.Call)]
    seen = [c for c in calls if c in SETUP]
    want = [c for c in SETUP if c != "fill_defaults" or name not in ("sft", "rm")]
    assert seen[:len(want)] == want, seen
    first_run = calls.index("training.open_run")
    assert "training.tokenizer" not in calls[:first_run] and not any("Run" in c for c in calls[:first_run])


def script_args(name, tmp_path, sft_dir, rm_dir, task_dir):
    """(module, argv) of a tiny run of the script `name`."""
    mod, argv = {
        "sft": (train_sft, lambda: sft_args(tmp_path, sft_dir, "o")),
        "rm": (train_rm, lambda: rm_args(tmp_path, sft_dir, "o")),
        "dpo": (train_dpo, lambda: dpo_args(tmp_path, sft_dir, "o")),
        "ppo": (train_ppo, lambda: ppo_args(tmp_path, sft_dir, rm_dir, "o")),
        "ppo_lagrangian": (train_ppo_lagrangian, lambda: ppo_args(tmp_path, sft_dir, rm_dir, "o", "--cost",
                                                                  "nano_rlhf.reward:gold_cost")),
        "listwise": (train_listwise, lambda: ["--loss", "lipo", "--data", str(task_dir / "listwise.jsonl"), "--init",
                                              sft_dir, "--out_dir", str(tmp_path / "o"), "--max_steps", "2",
                                              "--batch_size", "4"]),
        "unpaired": (train_unpaired, lambda: unpaired_args(tmp_path, sft_dir, "o", "dro")),
        "online": (train_online, lambda: online_args(tmp_path, sft_dir, rm_dir, "o")),
    }[name]
    return mod, argv()      # only this script's files are written (two scripts' helpers share a file name)

NAMES = [s.removeprefix("train_") for s in SCRIPTS]
# what each script places: {trained}, {frozen}, and the live models of its memory plan
PLACED = {"sft": ({"policy"}, set(), ["policy"]), "rm": ({"reward model"}, set(), ["rm"]),
          "dpo": ({"policy"}, {"reference model"}, ["policy", "ref"]),
          "ppo": ({"policy", "critic"}, {"ref"}, ["policy", "critic", "ref", "reward"]),
          "ppo_lagrangian": ({"policy", "critic", "cost critic"}, {"ref"},
                             ["policy", "critic", "cost_critic", "ref", "reward"]),     # the cost: a function
          "listwise": ({"policy"}, {"reference model"}, ["policy", "ref"]),
          "unpaired": ({"policy", "value"}, {"reference"}, ["policy", "value", "ref"]),
          "online": ({"policy"}, {"reference"}, ["policy", "ref"])}


class Planned(Exception):
    pass


@pytest.mark.parametrize("name", NAMES)
def test_every_script_sets_up_through_launch(name, tmp_path, sft_dir, rm_dir, task_dir, monkeypatch):
    """Each main places its models, wraps each trained one (DDP / FSDP, AdamW) and prints the memory plan through
    launch, in that order: --fsdp, the same-weights check, the seeding and the plan are the same code in all."""
    mod, argv = script_args(name, tmp_path, sft_dir, rm_dir, task_dir)
    calls = []
    real_place, real_wrap = training.place, training.prepare

    def place(opts, world, trained, frozen=None):
        calls.append(("place", {k for k, m in trained.items() if m is not None},
                      {k for k, m in (frozen or {}).items() if m is not None}))
        return real_place(opts, world, trained, frozen)

    def prepare(opts, model, lr):
        calls.append(("prepare", lr))
        return real_wrap(opts, model, lr)

    def plan(opts, models):
        calls.append(("plan", [k for k, m in models.items() if m is not None]))
        raise Planned
    monkeypatch.setattr(training, "place", place)
    monkeypatch.setattr(training, "prepare", prepare)
    monkeypatch.setattr(training, "plan", plan)
    with pytest.raises(Planned):
        mod.main(argv)
    trained, frozen, planned = PLACED[name]
    assert calls[0] == ("place", trained, frozen)
    assert [c[0] for c in calls[1:]] == ["prepare"] * len(trained) + ["plan"]
    assert calls[-1][1] == planned


@pytest.mark.parametrize("name", NAMES)
def test_report_to_without_its_package_is_one_line_before_anything_is_written(name, tmp_path, sft_dir, rm_dir,
                                                                               task_dir, monkeypatch, capsys):
    real = builtins.__import__

    def no_wandb(module, *a, **k):
        if module == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(module, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_wandb)
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    mod, argv = script_args(name, tmp_path, sft_dir, rm_dir, task_dir)
    with pytest.raises(SystemExit):
        mod.main(argv + ["--report_to", "wandb"])
    assert capsys.readouterr().err.strip() == "error: --report_to wandb needs the wandb package: pip install wandb"
    assert not (tmp_path / "o").exists()
