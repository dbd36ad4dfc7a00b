"""One reward interface for rollouts and evaluation: `scores = reward(prompts, completions)`.

    from nano_rlhf.reward import load_reward
    reward = load_reward("out/rm", tokenizer=tok, device=device)      # a reward-model directory
    reward = load_reward("gold", prompts=prompt_texts)                  # the built-in task's programmatic reward
    reward = load_reward("my_rewards:length_penalty")                   # a module on sys.path, or
    reward = load_reward("path/to/rewards.py:exact_match")              # a file
    reward(["Review the phone.\\nReview:"], [" The battery is great."])  # -> [float, ...], one per completion

prompts are the prompts exactly as given in the prompts file (a string, or a list of chat messages);
completions are the decoded response texts (no end-of-text token). A user's function receives exactly that
and returns one float per completion (a list, tuple or 1-D tensor); its answer is checked at every call and
a wrong length or type stops the run with one line naming the function.

Scores are RAW: a reward model's own output at the response's end-of-text (the chat template's end-of-turn
for a conversation). Normalising a reward model's score with the mean/std train_rm.py recorded (and clipping
it) is part of the PPO algorithm, so train_ppo.py does it (its --normalize_score / --score_clip); the recorded
statistics are available as `reward.mean`, `reward.std`. A reward model additionally offers
`score_tokens(ids, attn)` for callers that already hold the token ids (the rollout), which skips a decode/re-encode
round trip that need not give back the sampled ids.

Nothing here is specific to an algorithm. The built-in task is named here (its gold reward) and in
nano_rlhf/builtin.py (its data files), nowhere else outside nano_rlhf/synthetic.py.
"""
import importlib
import importlib.util
import math
import os
import sys

import torch

from . import synthetic
from .common import fail
from .data import pad_right

GOLD = "gold"


class RewardModel:
    """A reward-model directory (train_rm.py's output) as a reward function. Scores are read at the
    end-of-text appended after the completion, exactly where train_rm.py trained them."""

    def __init__(self, model, tokenizer, batch_size=64, mean=None, std=None):
        """model: a ScoreModel (frozen here); mean/std: the score statistics train_rm.py recorded (None = none)."""
        self.model = model.requires_grad_(False).eval()
        self.tok, self.batch_size = tokenizer, batch_size
        self.device = next(model.parameters()).device
        self.has_stats = mean is not None
        self.mean, self.std = float(mean or 0.0), float(std or 1.0)

    @classmethod
    def from_dir(cls, model_dir, tokenizer, device="cpu", batch_size=64):
        from .common import check_vocab
        from .model import ScoreModel
        model = ScoreModel.from_pretrained(model_dir, dropout=0.0).to(device)
        check_vocab(tokenizer, model.cfg, model_dir)             # it scores the policy tokenizer's ids
        stats = model.extra_config
        return cls(model, tokenizer, batch_size, stats.get("reward_mean"), stats.get("reward_std"))

    @torch.no_grad()
    def score_tokens(self, ids, attn):
        """(B,) raw scores of token sequences (left-padded prompt + right-padded response) at each row's
        last real token, which must be the end-of-text."""
        return torch.cat([self.model(ids[i:i + self.batch_size], attn[i:i + self.batch_size], end_only=True)[1].float()
                          for i in range(0, ids.shape[0], self.batch_size)])

    def __call__(self, prompts, completions):
        """Prompt and completion tokenized separately (the seam rule of the data pipeline), closed as a
        policy's sample is: end-of-text after a text prompt, the chat template's end-of-turn after a
        conversational one (where train_rm.py read the score); the prompt left-truncated when the pair exceeds
        the model's context."""
        block = self.model.cfg.block_size
        rows = []
        for p, c in zip(prompts, completions):
            end = self.tok.eos_id if isinstance(p, str) else self.tok.eot_id
            resp = self.tok.encode(c)[:block - 2] + [end]      # the end token is where the score is read
            rows.append((self.tok.render_prompt(p) + resp)[-block:])   # an over-long row loses its prompt's start
        # whole rows right-padded (plain causal attention; the score is read at each row's last real token), so
        # a row's score does not depend on what else is in the batch
        n = max(len(x) for x in rows)
        ids = pad_right(rows, self.tok.pad_id, n).to(self.device)
        attn = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x in rows], device=self.device)
        return self.score_tokens(ids, attn).tolist()


def builtin_gold(prompts):
    """The gold reward of these prompts if the task has one (every prompt is the built-in task's): the reward
    function `gold`, else None. Callers show or log a gold figure only where it means something."""
    if prompts and all(synthetic.is_task_prompt(p) for p in prompts):
        return gold
    return None


def gold(prompts, completions):
    """The built-in task's programmatic (gold) reward as an ordinary reward function, one float per completion;
    a prompt that is not the task's raises ValueError."""
    bad = next((p for p in prompts if not synthetic.is_task_prompt(p)), None)
    if bad is not None:
        raise ValueError(f"--reward gold scores the built-in task's prompts only; not one of them: {bad!r}")
    return [synthetic.gold_reward(p, c) for p, c in zip(prompts, completions)]


# The largest score a user's function may return. Scores go into float32 tensors (advantages, the PPO reward) and
# are squared and summed over a batch (standard deviations, summaries): (1e15)^2 summed over a million samples is
# 1e36, under float32's 3.4e38, so no statistic of a step can overflow; no real reward comes near it.
MAX_SCORE = 1e15


class _Checked:
    """A user's function with its answers checked at every call (a wrong length or type stops the run)."""

    def __init__(self, fn, spec, flag="--reward", module=None):
        # module: where fn was found, for optional hooks beside it (evaluate reads an `answer` function for maj@k)
        self.fn, self.name, self.flag, self.module = fn, spec, flag, module

    def __call__(self, prompts, completions):
        try:
            out = self.fn(list(prompts), list(completions))
        except Exception as e:      # the user's code: their error and where, in a few lines, not our stack
            fail(raised(self.flag, self.name, e))
        except SystemExit as e:     # sys.exit(0) in a reward would end the run "successfully" with nothing saved
            fail(exited(self.flag, self.name, e))
        if torch.is_tensor(out):
            out = out.detach().flatten().tolist() if out.dim() <= 1 else None
        if not isinstance(out, (list, tuple)) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                         for x in out):
            fail(f"{self.flag} {self.name}: must return a list of floats (one per completion), got {kind_of(out)}")
        if len(out) != len(completions):
            fail(f"{self.flag} {self.name}: returned {len(out)} scores for {len(completions)} completions")
        try:
            scores = [float(x) for x in out]
        except OverflowError:       # an int too large for a float (math.isfinite would raise on it too)
            fail(f"{self.flag} {self.name}: returned a score too large for a float "
                 f"({next(x for x in out if abs(x) > 1e308)!s:.40})")
        if not all(math.isfinite(x) for x in scores):
            bad = next(x for x in scores if not math.isfinite(x))
            fail(f"{self.flag} {self.name}: returned a non-finite score ({bad})")
        if not all(abs(x) <= MAX_SCORE for x in scores):
            bad = next(x for x in scores if abs(x) > MAX_SCORE)
            fail(f"{self.flag} {self.name}: returned {bad:g}, beyond the ±{MAX_SCORE:g} a score may be")
        return scores


def exited(flag, spec, e):
    """One line for a user's function that called sys.exit (or raised SystemExit)."""
    return f"{flag} {spec} called sys.exit({e.code!r}){_user_frames(e)}: a function must return, not end the process"


def raised(flag, spec, e):
    """One line for an exception a user's function raised: the flag and spec, the error, and where in their code."""
    return f"{flag} {spec} raised {type(e).__name__}: {_first_line(e)}{_user_frames(e)}"


def _first_line(e):
    return (str(e).strip().splitlines() or [""])[0][:300]


def _user_frames(e, n=3):
    """The last n frames of an exception's traceback, as ' (at FILE:LINE in FUNC; ...)'."""
    import traceback
    frames = traceback.extract_tb(e.__traceback__)[1:][-n:]      # [0] is our call into the user's function
    return " (at " + "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in frames) + ")" \
        if frames else ""


def kind_of(x):
    """What a user's function returned, in words: the type, or for a list the first element that is no number."""
    if isinstance(x, (list, tuple)):
        bad = next((v for v in x if not isinstance(v, (int, float)) or isinstance(v, bool)), None)
        return f"a {type(x).__name__} holding {type(bad).__name__} {bad!r}"
    return type(x).__name__


def is_function_spec(spec):
    """`module:function` or `path/to/file.py:function` (a Windows drive letter is not a module)."""
    return ":" in spec and not os.path.isdir(spec) and len(spec.rsplit(":", 1)[0]) > 1


def code_file(spec):
    """The source file of a user function `module:function` or `path/to/file.py:function`, else "" (a reward-model
    directory, gold, llm:DIR, an empty spec). A run hashes it with its model inputs, so a --resume notices a
    reward or judge edited since the stop. Found without running the module (importlib's find_spec)."""
    if not spec or ":" not in spec or spec.startswith("llm:") or os.path.exists(spec):
        return ""
    where = spec.rsplit(":", 1)[0]
    if where.endswith(".py") or os.sep in where or "/" in where:
        return where if os.path.isfile(where) else ""
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        return ""
    return found.origin if found is not None and found.origin and os.path.isfile(found.origin) else ""


def load_function(spec, flag="--reward"):
    """Import a user's reward function at start-up; one-line errors (naming flag) for a missing module, file
    or function and for a non-callable."""
    where, name = spec.rsplit(":", 1)
    if not where or not name:
        fail(f"{flag} {spec}: expected module:function or path/to/file.py:function")
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    if is_file and not os.path.isfile(where):
        fail(f"{flag} {spec}: no such file {where}")
    try:
        if is_file:
            module_name = "_nano_rlhf_reward_" + os.path.splitext(os.path.basename(where))[0]
            loader = importlib.util.spec_from_file_location(module_name, where)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module
            loader.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())     # `python train_ppo.py --reward my_rewards:f` from the repo
            module = importlib.import_module(where)
    except ModuleNotFoundError as e:
        fail(f"{flag} {spec}: cannot import module {where!r} ({e})")
    except SyntaxError as e:
        fail(f"{flag} {spec}: {where} does not parse: {e.msg} (line {e.lineno})")
    except Exception as e:          # the module's own code raised while it was imported
        fail(f"{flag} {spec}: importing {where} raised {type(e).__name__}: {_first_line(e)}{_user_frames(e)}")
    except SystemExit as e:
        fail(f"{flag} {spec}: importing {where} called sys.exit({e.code!r}){_user_frames(e)}")
    fn = getattr(module, name, None)
    if fn is None:
        fail(f"{flag} {spec}: {where} has no {name!r}")
    if not callable(fn):
        fail(f"{flag} {spec}: {where}.{name} is a {type(fn).__name__}, not a function")
    return _Checked(fn, spec, flag, module)


def load_reward(spec, *, tokenizer=None, device="cpu", prompts=None, batch_size=64, flag="--reward"):
    """spec -> reward(prompts, completions) -> list[float].

    spec: a reward-model directory (needs tokenizer: the policy's, whose ids it scores), "gold" (the built-in
    task's reward; with prompts given, any prompt that is not the task's is refused here with one line), or
    a user's function "module:function" / "path/to/file.py:function" (imported now)."""
    if spec == GOLD:
        if prompts is not None and builtin_gold(list(prompts)) is None:
            bad = next((p for p in prompts if not synthetic.is_task_prompt(p)), None)
            fail(f"{flag} gold scores the built-in task's prompts only; this prompt is not one: {str(bad)[:80]!r} "
                 f"(use a reward model or {flag} module:function)")
        return gold
    if is_function_spec(spec):
        return load_function(spec, flag)
    if tokenizer is None:
        raise ValueError(f"{spec}: a reward model needs the tokenizer whose ids it scores")
    return RewardModel.from_dir(spec, tokenizer, device, batch_size)
