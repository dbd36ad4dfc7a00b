"""nano_rlhf.reward: one interface (reward model directory, gold, a user's function) and its one-line errors."""
import pytest
import torch

from conftest import run
from numerics import FLOAT32_ATOL  # float32 values of order one: see tests/numerics.py
from nano_rlhf.tasks import synthetic
from nano_rlhf.data import collate_prompts
from nano_rlhf.model import ScoreModel
from nano_rlhf.reward import RewardModel, builtin_gold, load_reward

TASK = synthetic.make_prompt("blender")
OTHER = "write a short review of the moon."


def test_reward_model_text_call_equals_its_score_at_the_end_of_text(tok, rm_dir):
    """reward(prompts, completions) scores prompt + completion + end-of-text, each row alone and unpadded, and
    score_tokens gives the same on the padded batch; mean/std are the statistics train_rm.py recorded."""
    reward = load_reward(rm_dir, tokenizer=tok)
    assert isinstance(reward, RewardModel) and (reward.mean, reward.std) == (0.1, 0.5)
    prompts, completions = ["write a short review of the phone.", "review"], [" the screen is great.", " bad"]
    got = reward(prompts, completions)
    rm = ScoreModel.from_pretrained(rm_dir).eval()
    for p, c, score in zip(prompts, completions, got):
        ids = torch.tensor([tok.encode(p) + tok.encode(c) + [tok.eos_id]])
        with torch.no_grad():
            assert score == pytest.approx(rm(ids)[1].item(), abs=1e-5)
    q, qm = collate_prompts([tok.encode(p) for p in prompts], tok.pad_id)
    r = [tok.encode(c) + [tok.eos_id] for c in completions]
    n = max(map(len, r))
    ids = torch.cat([q, torch.tensor([x + [tok.pad_id] * (n - len(x)) for x in r])], 1)
    attn = torch.cat([qm, torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x in r])], 1)
    assert torch.allclose(reward.score_tokens(ids, attn), torch.tensor(got), atol=FLOAT32_ATOL)


def test_gold_only_on_the_builtin_task():
    assert builtin_gold([TASK, TASK]) is not None and builtin_gold([TASK, OTHER]) is None
    gold = load_reward("gold", prompts=[TASK])
    assert gold([TASK], [" The motor is great."]) == [synthetic.gold_reward(TASK, " The motor is great.")]
    with pytest.raises(ValueError, match="built-in task"):
        gold([OTHER], [" fine."])


def test_gold_through_the_reward_interface_is_the_tasks_gold_reward():
    """The gold reward is an ordinary reward function: load_reward("gold") and builtin_gold give the same one,
    and it scores every completion as synthetic.gold_reward does (varied prompts, products and styles)."""
    import random
    rng = random.Random(0)
    prompts = [synthetic.train_prompt(rng) for _ in range(60)] + [synthetic.make_prompt("kettle", 26)]
    completions = [synthetic.sample_response(rng, synthetic.parse_product(p), ("sft", "pair")[i % 2])
                   for i, p in enumerate(prompts)]
    gold = load_reward("gold", prompts=prompts)
    assert gold is builtin_gold(prompts)
    want = [synthetic.gold_reward(p, c) for p, c in zip(prompts, completions)]
    assert gold(prompts, completions) == want and len(set(want)) > 5       # exact: the same function's floats


def test_user_function_from_a_file_and_a_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def length(prompts, completions):\n"
                                            "    return [float(len(c)) for c in completions]\n")
    by_file = load_reward(f"{tmp_path / 'my_rewards.py'}:length")
    assert by_file(["a", "b"], ["xy", "xyz"]) == [2.0, 3.0]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:length")(["a"], ["hello"]) == [5.0]


USER = """
import torch
def ok(prompts, completions): return torch.ones(len(completions))
def short(prompts, completions): return [1.0]
def text(prompts, completions): return ["good"] * len(completions)
def nan(prompts, completions): return [float("nan")] * len(completions)
def huge(prompts, completions): return [1e300] * len(completions)
def quits(prompts, completions): import sys; sys.exit(0)
def quits3(prompts, completions): raise SystemExit(3)
NOT_CALLABLE = 3
"""

CALL = """import sys
from nano_rlhf.reward import load_reward
f = load_reward(sys.argv[1])
print(f(["p1", "p2"], ["a", "b"]))
"""


@pytest.mark.parametrize("spec, message", [
    ("FILE:missing", "has no 'missing'"),
    ("FILE:NOT_CALLABLE", "is a int, not a function"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("NOFILE:f", "no such file"),
    ("FILE:short", "returned 1 scores for 2 completions"),
    ("FILE:text", "must return a list of floats"),
    ("FILE:nan", "non-finite score"),
    ("FILE:huge", "returned 1e+300, beyond the ±1e+15 a score may be"),     # finite, but its square is not
    ("FILE:quits", "called sys.exit(0) (at user.py:"),       # exit 0 would end the run as a success, unsaved
    ("FILE:quits3", "called sys.exit(3)"),
])
def test_user_function_errors_are_one_line(tmp_path, spec, message):
    (tmp_path / "user.py").write_text(USER)
    (tmp_path / "call.py").write_text(CALL)
    spec = spec.replace("NOFILE", str(tmp_path / "absent.py")).replace("FILE", str(tmp_path / "user.py"))
    p = run([str(tmp_path / "call.py"), spec], check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --reward ") and message in lines[0], p.stderr


def test_user_function_may_return_a_tensor(tmp_path):
    (tmp_path / "user.py").write_text(USER)
    assert load_reward(f"{tmp_path / 'user.py'}:ok")(["p"] * 3, ["c"] * 3) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("body, message", [
    ("torch.zeros(len(completions), 2)", "got a 2-D Tensor of shape (2, 2)"),      # it said "got NoneType"
    ("torch.tensor(1.0)", "got a 0-D Tensor of shape ()"),
    ("numpy.zeros((len(completions), 1))", "got a 2-D ndarray of shape (2, 1)"),
    ("numpy.ones(len(completions))", None),                                         # 1-D: one score each
])
def test_a_tensor_or_array_answer_is_taken_when_1d_and_described_by_its_shape(tmp_path, capsys, body, message):
    (tmp_path / "shaped.py").write_text(f"import numpy, torch\ndef f(prompts, completions):\n    return {body}\n")
    f = load_reward(f"{tmp_path / 'shaped.py'}:f")
    if message is None:
        assert f(["p", "q"], ["a", "b"]) == [1.0, 1.0]
        return
    with pytest.raises(SystemExit):
        f(["p", "q"], ["a", "b"])
    err = capsys.readouterr().err.strip()
    assert err == f"error: --reward {tmp_path / 'shaped.py'}:f: must return a list of floats (one per completion), " \
                  f"{message}", err


def test_gold_refuses_other_prompts_at_load(tmp_path):
    (tmp_path / "call.py").write_text(f"from nano_rlhf.reward import load_reward\n"
                                      f"load_reward('gold', prompts=[{TASK!r}, {OTHER!r}])\n")
    p = run([str(tmp_path / "call.py")], check=False)
    assert p.returncode != 0 and p.stderr.count("\n") == 1 and "--reward gold scores the built-in task" in p.stderr


def test_reward_model_batch_of_long_prompt_and_long_response_fits_its_context(tok, rm_dir):
    """A long prompt batched with another row's long response (padding prompts and responses separately
    overflowed block_size): each score equals that row scored alone, its prompt cut from the start."""
    reward = load_reward(rm_dir, tokenizer=tok)
    block = reward.model.cfg.block_size
    long_prompt = " ".join(["write a short review of the phone."] * block)
    long_resp = " " + " ".join(["great"] * (block // 2))
    prompts, completions = [long_prompt, "review"], [" ok", long_resp]
    got = reward(prompts, completions)
    rm = ScoreModel.from_pretrained(rm_dir).eval()
    for p, c, score in zip(prompts, completions, got):
        ids = torch.tensor([(tok.encode(p) + tok.encode(c)[:block - 2] + [tok.eos_id])[-block:]])
        assert ids.shape[1] <= block
        with torch.no_grad():
            assert score == pytest.approx(rm(ids)[1].item(), abs=1e-5)
