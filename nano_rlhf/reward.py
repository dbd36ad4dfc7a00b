"""Rewards and judges: one reward interface for rollouts and evaluation, `scores = reward(prompts, completions)`,
and the judges of the online and self-play methods (second half of this file).

    from nano_rlhf.reward import load_reward
    reward = load_reward("out/rm", tokenizer=tok, device=device)      # a reward-model directory
    reward = load_reward("gold", prompts=prompt_texts)                  # the built-in task's programmatic reward
    cost = load_reward("nano_rlhf.reward:gold_cost", flag="--cost")     # its gold cost (the --harm data's)
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

Nothing here is specific to an algorithm. The built-in task is named here (its gold reward and gold cost) and in
nano_rlhf/data.py (its data files), nowhere else outside nano_rlhf/tasks/synthetic.py.
"""
import importlib
import importlib.util
import json
import math
import os
import re
import sys

import torch

from .tasks import synthetic
from .training import fail
from .checkpoint import sha256_file
from .cli import moved_module
from .data import default_path, finite_number, pad_right
from .sampling import generate, SamplingOptions

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
    def from_dir(cls, model_dir, tokenizer, device="cpu", batch_size=64, kind="reward"):
        """kind: what the caller needs, "reward" or "cost"; a directory of the other kind is refused in one line
        (train_rm.py records "score_kind": "cost" in a cost model's config.json; without it, a reward model)."""
        from .training import check_vocab
        from .model import ScoreModel
        model = ScoreModel.from_pretrained(model_dir, dropout=0.0).to(device)
        stats = model.extra_config
        recorded = stats.get("score_kind", "reward")
        if recorded != kind:
            fail(f"{model_dir} is a cost model (its config.json says \"score_kind\": \"cost\"), given where a "
                 "reward model is needed" if recorded == "cost" else
                 f"{model_dir} is not a cost model (its config.json has no \"score_kind\": \"cost\"; train_rm.py "
                 "--objective cost writes one), given where a cost model is needed")
        check_vocab(tokenizer, model.cfg, model_dir)             # it scores the policy tokenizer's ids
        if kind == "cost":       # a cost is read raw: 0 is its safe/unsafe boundary, nothing to normalise by
            return cls(model, tokenizer, batch_size)
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


def builtin_gold(prompts, cost=False):
    """The gold reward of these prompts if the task has one (every prompt is the built-in task's): the reward
    function `gold` (cost=True: the cost function `gold_cost`), else None. Callers show or log a gold figure only
    where it means something."""
    if prompts and all(synthetic.is_task_prompt(p) for p in prompts):
        return gold_cost if cost else gold
    return None


def gold(prompts, completions):
    """The built-in task's programmatic (gold) reward as an ordinary reward function, one float per completion;
    a prompt that is not the task's raises ValueError."""
    bad = next((p for p in prompts if not synthetic.is_task_prompt(p)), None)
    if bad is not None:
        raise ValueError(f"--reward gold scores the built-in task's prompts only; not one of them: {bad!r}")
    return [synthetic.gold_reward(p, c) for p, c in zip(prompts, completions)]


def gold_cost(prompts, completions):
    """The built-in task's gold cost (its harm dimension, python -m nano_rlhf.tasks.synthetic --harm) as an ordinary
    cost function, one float per completion, > 0 = unsafe: `--cost nano_rlhf.reward:gold_cost`. A prompt that is
    not the task's raises ValueError."""
    bad = next((p for p in prompts if not synthetic.is_task_prompt(p)), None)
    if bad is not None:
        raise ValueError(f"gold_cost scores the built-in task's prompts only; not one of them: {bad!r}")
    return [synthetic.harm_cost(p, c) for p, c in zip(prompts, completions)]


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
        out = as_list(out)
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


def as_list(out):
    """A user's answer as a list when it is a 1-D tensor or numpy array (one number per item); anything else as it
    is, for the checks to describe (kind_of)."""
    if (torch.is_tensor(out) or type(out).__module__ == "numpy") and getattr(out, "ndim", None) == 1:
        return out.tolist()
    return out


def kind_of(x):
    """What a user's function returned, in words: the type, for a tensor or array its shape, or for a list the
    first element that is no number."""
    if hasattr(x, "ndim") and hasattr(x, "shape"):
        return f"a {x.ndim}-D {type(x).__name__} of shape {tuple(x.shape)}"
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
    module, fn = load_object(spec, flag)
    if not callable(fn):
        where, name = spec.rsplit(":", 1)
        fail(f"{flag} {spec}: {where}.{name} is a {type(fn).__name__}, not a function")
    return _Checked(fn, spec, flag, module)


def load_object(spec, flag="--reward", expected="module:function or path/to/file.py:function"):
    """(module, object) named by `module:NAME` or `path/to/file.py:NAME`, imported at start-up; one-line errors
    (naming flag) for a missing module, file or name. A file is imported under a private module name, once per
    call (its top-level code runs again)."""
    where, name = spec.rsplit(":", 1)
    if not where or not name:
        fail(f"{flag} {spec}: expected {expected}")
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    moved = None if is_file else moved_module(where)
    if moved:
        fail(f"{flag} {spec}: {moved[0]} is now {moved[1]}: {flag} {spec.replace(moved[0], moved[1], 1)}")
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
    obj = getattr(module, name, None)
    if obj is None:
        fail(f"{flag} {spec}: {where} has no {name!r}")
    return module, obj


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


# ---- Judges for the online and self-play methods: scores for single responses, and P(a ≻ b) for pairs.
#
#     from nano_rlhf.reward import load_judge
#     judge = load_judge("out/rm", tokenizer=tok, device=device)            # a reward-model directory
#     judge = load_judge("gold", prompts=prompt_texts)                       # the built-in task's reward
#     judge = load_judge("my_judges:score")                                  # a pointwise function (as --reward)
#     judge = load_judge("out/rm", pair_spec="my_judges:prefer")             # plus a pairwise function
#     judge = load_judge("llm:out/sft", template="my_template.txt")          # LLM-as-a-judge (greedy answer, 1-10)
#     judge.scores(prompts, completions)          # (N,) float64 tensor, one score per completion
#     judge.preference(prompts, a, b)             # (N,) float64 tensor, P(a[i] ≻ b[i]) for each i
#     symmetric_preference(judge, prompts, a, b)  # the same, a pairwise judge asked in both orders (no position bias)
#     preference_matrix(judge, prompts, completions, k)   # (G, k, k) P(y_i ≻ y_j) within each group of k samples
#
# A pointwise judge is anything `nano_rlhf.reward.load_reward` accepts. A pairwise judge is a user's
# `module:function(prompts, a, b) -> list[float]` returning P(a[i] ≻ b[i]) in [0, 1] for each i (one call for a
# whole batch of pairs, like the reward functions). Methods that need a preference take it from the pairwise
# judge when one is given, otherwise from the pointwise scores under Bradley–Terry: P(a ≻ b) = σ(r(a) − r(b)).
#
# LLM-as-a-judge (`llm:MODEL_DIR`, a pointwise judge): each (prompt, response) is written into a template
# (`{prompt}` and `{response}` placeholders; default templates/judge_default.txt, asking for a score from 1 to
# 10), sent as one user message through the judge model's own chat template, and answered greedily; the score
# is the first number of the answer inside [1, 10]. An answer without one scores the lowest grade (1) and is
# counted in a warning: a policy must gain nothing by confusing its judge (a self-rewarding policy, whose
# judge is its own starting point `llm:out/sft`, could otherwise learn to).
def bradley_terry(r_a, r_b):
    """P(a ≻ b) = σ(r_a − r_b) (Bradley & Terry 1952; the model a reward model is trained under)."""
    return torch.sigmoid(torch.as_tensor(r_a, dtype=torch.float64) - torch.as_tensor(r_b, dtype=torch.float64))


class _CheckedPairwise:
    """A user's pairwise function with its answers checked at every call: one probability per pair."""

    def __init__(self, fn, spec):
        self.fn, self.name = fn, spec

    def __call__(self, prompts, a, b):
        try:
            out = self.fn(list(prompts), list(a), list(b))
        except Exception as e:      # the user's code: their error and where, in one line, not our stack
            fail(raised("--pair_judge", self.name, e))
        except SystemExit as e:
            fail(exited("--pair_judge", self.name, e))
        out = as_list(out)
        if not isinstance(out, (list, tuple)) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                         for x in out):
            fail(f"--pair_judge {self.name}: must return a list of probabilities (one per pair), got "
                 f"{kind_of(out)}")
        if len(out) != len(a):
            fail(f"--pair_judge {self.name}: returned {len(out)} probabilities for {len(a)} pairs")
        bad = next((x for x in out if not (finite_number(x) and 0.0 <= x <= 1.0)), None)
        if bad is not None:
            fail(f"--pair_judge {self.name}: returned {bad}, not a probability in [0, 1]")
        return [float(x) for x in out]


class Judge:
    """pointwise: reward(prompts, completions) -> list[float], or None; pairwise: (prompts, a, b) -> list of
    P(a ≻ b), or None. At least one of them."""

    def __init__(self, pointwise=None, pairwise=None):
        if pointwise is None and pairwise is None:
            raise ValueError("a judge needs a pointwise or a pairwise function")
        self.pointwise, self.pairwise = pointwise, pairwise

    def scores(self, prompts, completions):
        if self.pointwise is None:
            fail("this method needs a score per response, but the judge is pairwise only (give --judge too)")
        return torch.tensor(self.pointwise(list(prompts), list(completions)), dtype=torch.float64)

    def preference(self, prompts, a, b):
        if self.pairwise is not None:
            return torch.tensor(self.pairwise(list(prompts), list(a), list(b)), dtype=torch.float64)
        return bradley_terry(self.scores(prompts, a), self.scores(prompts, b))


def check_specs(spec=None, pair_spec=None, template=""):
    """One line for a judge flag that is wrong on its face, from the flags alone (nothing is loaded), so a script
    can refuse it before its output directory is touched; load_judge starts with the same checks."""
    if spec is None and pair_spec is None:
        fail("a judge is needed: give --judge (reward model, gold, module:function, llm:MODEL_DIR) and/or --pair_judge",
             2)
    if template and not (spec or "").startswith(LLM):
        fail(f"--judge_template {template}: applies only to --judge llm:MODEL_DIR", 2)
    if spec is not None and spec.startswith(LLM):
        model_dir = spec[len(LLM):]
        if not model_dir or not os.path.isdir(model_dir):
            fail(f"--judge {spec}: no such model directory {model_dir!r}")
        read_template(template or DEFAULT_TEMPLATE)
    if pair_spec is not None:
        if pair_spec.startswith(LLM):
            fail(f"--pair_judge {pair_spec}: an LLM judge gives scores, not pairwise preferences; "
                 f"use --judge {pair_spec}", 2)
        if not is_function_spec(pair_spec):
            fail(f"--pair_judge {pair_spec}: expected module:function or path/to/file.py:function", 2)


def load_judge(spec=None, pair_spec=None, *, tokenizer=None, device="cpu", prompts=None, batch_size=64,
               template=""):
    """spec: what load_reward accepts (a reward-model directory, "gold", module:function), llm:MODEL_DIR or None;
    pair_spec: a pairwise module:function or None; template: the LLM judge's template file ("" = the default).
    Import/load errors are one line naming the flag."""
    check_specs(spec, pair_spec, template)
    if spec is not None and spec.startswith(LLM):
        pointwise = LLMJudge.from_dir(spec[len(LLM):], template, device=device, spec=spec, batch_size=batch_size)
    else:
        pointwise = None if spec is None else load_reward(spec, tokenizer=tokenizer, device=device,
                                                                     prompts=prompts, batch_size=batch_size,
                                                                     flag="--judge")
    pairwise = None
    if pair_spec is not None:
        pairwise = _CheckedPairwise(load_function(pair_spec, "--pair_judge").fn, pair_spec)
    return Judge(pointwise, pairwise)


# ---- the preferences within a group of samples (self-play, labelling, online) --------------------------

def symmetric_preference(judge, prompts, a, b):
    """(N,) float64 P̃(a[i] ≻ b[i]). A pairwise judge is asked both orders in one call and the answers made
    antisymmetric, P̃(a ≻ b) = ½(P(a ≻ b) + 1 − P(b ≻ a)), as in preference_matrix: a judge that always favours
    the first answer shown gives ½, no preference. A pointwise judge's Bradley–Terry is antisymmetric already."""
    if judge.pairwise is None:
        return judge.preference(prompts, a, b)
    n = len(a)
    p = judge.preference(list(prompts) * 2, list(a) + list(b), list(b) + list(a))
    return 0.5 * (p[:n] + 1 - p[n:])


def preference_matrix(judge, prompts, completions, k, scores=None):
    """(G, k, k) float64, P[g, i, j] = P(y_i ≻ y_j) for G groups of k consecutive samples (prompts repeated k
    times, as a rollout lays them out); the diagonal is ½.

    Pointwise judge: each completion is scored once (or `scores` (G·k,) is used as given: a rollout holds the
    reward model's scores of the very ids sampled), then Bradley–Terry. Pairwise judge (preferred when given):
    asked about every ordered pair i ≠ j in one call, then made antisymmetric, P̃(i ≻ j) = ½(P(i ≻ j) + 1 −
    P(j ≻ i)), so that P̃(i ≻ j) + P̃(j ≻ i) = 1 and a judge that favours a position (LLM judges often prefer
    the first answer shown) favours no sample."""
    n = len(completions)
    if n % k or len(prompts) != n:
        raise ValueError(f"preference_matrix: {len(prompts)} prompts and {n} completions do not form groups of {k}")
    G = n // k
    if judge.pairwise is None:
        s = (judge.scores(prompts, completions) if scores is None else torch.as_tensor(scores)).double().view(G, k)
        return bradley_terry(s[:, :, None], s[:, None, :])
    pairs = [(g, i, j) for g in range(G) for i in range(k) for j in range(k) if i != j]
    p = judge.preference([prompts[g * k + i] for g, i, _ in pairs], [completions[g * k + i] for g, i, _ in pairs],
                         [completions[g * k + j] for g, _, j in pairs])
    P = torch.full((G, k, k), 0.5, dtype=torch.float64)
    g, i, j = (torch.tensor(x) for x in zip(*pairs))
    P[g, i, j] = p
    return 0.5 * (P + 1 - P.transpose(1, 2))


# ---- LLM-as-a-judge --------------------------------------------------------------------------------

LLM = "llm:"
DEFAULT_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates", "judge_default.txt")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_PLACEHOLDER = re.compile(r"\{(prompt|response)\}")


def eval_columns(reward, gold=None):
    """The reward columns of a trained policy's evaluation (nano_rlhf.evaluate.sample_and_score's rewards): the
    trained reward (a reward model's raw score as rm_score, a function's as reward) and the programmatic gold
    reward when one applies to these prompts. A Judge (SPO): a win rate needs a group, so the judge's own
    pointwise score stands in (none for a pairwise-only judge)."""
    reward = reward.pointwise if isinstance(reward, Judge) else reward
    cols = {} if reward is None else {"rm_score" if isinstance(reward, RewardModel) else "reward": reward}
    if gold is not None and gold is reward:      # --reward gold (or --judge gold): one column, its name
        return {"gold_reward": gold}
    if gold is not None:
        cols["gold_reward"] = gold
    return cols


def model_dir(spec):
    """The model directory a --judge reads (a reward model, or llm:DIR), else "": an input of the run, which
    it never writes into and whose files --resume checks (nano_rlhf.training)."""
    path = spec[len(LLM):] if spec and spec.startswith(LLM) else spec
    return path if path and os.path.isdir(path) else ""


def training_pairs(spec):
    """The preference file a --judge reward model was fitted to: (path, "") when its train_config.json (train_rm.py's,
    objective reward) names one (empty: the built-in task's) that still holds what the model was trained on (the
    sha256 in its state/run.json, when kept); else ("", why not)."""
    config = os.path.join(spec, "train_config.json") if spec and os.path.isdir(spec) else ""
    if not config or not os.path.isfile(config):
        return "", "the judge records no training pairs (not a train_rm.py reward model)"
    with open(config) as f:
        trained = json.load(f)
    if trained.get("objective") != "reward":
        return "", ("the judge records no training pairs (not a train_rm.py reward model)" if "objective" not in
                    trained else f"the judge was trained as a {trained['objective']} model")
    path = trained.get("data") or default_path("preference")
    if not os.path.isfile(path):
        return "", f"the judge's training pairs {path} are not there"
    record = os.path.join(spec, "state", "run.json")
    if os.path.isfile(record):
        with open(record) as f:
            sha = json.load(f).get("data_sha256", {}).get("data")
        if sha and sha != sha256_file(path):
            return "", f"{path} changed since the judge was trained on it"
    return path, ""


def parse_score(answer, low=1.0, high=10.0):
    """The first number in `answer` that lies in [low, high] ("8", "Score: 7/10", "8.5"), or None."""
    for m in _NUMBER.finditer(answer):
        x = float(m.group())
        if low <= x <= high:
            return x
    return None


def prompt_as_text(prompt):
    """A prompt for the template's {prompt}: a string as is; a conversation as "Role: content" paragraphs."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in prompt)


def fill_template(template, prompt, response):
    """{prompt} and {response} replaced in one pass (a response that contains "{prompt}" stays as written;
    other braces in the template, e.g. a JSON example, are left alone)."""
    values = {"prompt": prompt_as_text(prompt), "response": response}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def read_template(path, flag="--judge_template"):
    """The template text; one line naming the flag if it is missing or lacks a placeholder."""
    if not os.path.isfile(path):
        fail(f"{flag} {path}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    missing = [p for p in ("{prompt}", "{response}") if p not in text]
    if missing:
        fail(f"{flag} {path}: the template must contain {{prompt}} and {{response}} (missing {', '.join(missing)})")
    return text


class LLMJudge:
    """A language model as a pointwise judge: score = the first number in [low, high] of its greedy answer to
    the template, rendered as a user message with the judge's own chat template. A frozen copy: it never
    changes during a run, even when it was loaded from the policy's own starting directory."""

    def __init__(self, model, tok, template, *, low=1.0, high=10.0, fallback=None, max_new_tokens=8,
                 batch_size=16, name="llm"):
        self.model, self.tok, self.template = model.requires_grad_(False).eval(), tok, template
        self.low, self.high = float(low), float(high)
        self.fallback = self.low if fallback is None else float(fallback)
        self.max_new_tokens, self.batch_size, self.name = max_new_tokens, batch_size, name
        self.answered = self.unparsed = self.truncated = 0   # running counts, for the warnings and the caller

    @classmethod
    def from_dir(cls, model_dir, template_path="", device="cpu", spec=None, **kw):
        from .training import load_tokenizer
        from .model import GPT
        flag = f"--judge {spec or LLM + model_dir}"
        if not model_dir or not os.path.isdir(model_dir):
            fail(f"{flag}: no such model directory {model_dir!r}")
        template = read_template(template_path or DEFAULT_TEMPLATE)
        try:
            tok = load_tokenizer("", model_dir, policy=True)
            model = GPT.from_pretrained(model_dir, dropout=0.0).to(device)
        except (ValueError, FileNotFoundError, OSError) as e:
            fail(f"{flag}: {e}")
        return cls(model, tok, template, name=flag, **kw)

    def render(self, prompt, response):
        """Ids of the judge's input: the filled template as one user message plus the generation prompt. The
        message is encoded literally: a response that writes "<|im_end|>" or "<|eot_id|>" cannot close the
        judge's user turn and forge an assistant turn (a score) of its own; it reads as that text."""
        return self.tok.render_prompt_literal([{"role": "user",
                                                "content": fill_template(self.template, prompt, response)}])

    @torch.no_grad()
    def answers(self, prompts, completions):
        """The judge's greedy answers (text up to its first stop token), one per (prompt, completion)."""
        from .data import collate_prompts
        room = self.model.cfg.block_size - self.max_new_tokens
        device = next(self.model.parameters()).device
        out = []
        for s in range(0, len(completions), self.batch_size):
            chunk = slice(s, s + self.batch_size)
            ids = [self.render(p, c) for p, c in zip(prompts[chunk], completions[chunk])]
            self.truncated += sum(len(x) > room for x in ids)
            # left-truncated, as the data pipeline truncates prompts: the question that closes the template survives
            q, mask = collate_prompts([x[-room:] for x in ids], self.tok.pad_id)
            seq = generate(self.model, q.to(device), mask.to(device), SamplingOptions(
                self.max_new_tokens, temperature=0, stop_ids=self.tok.stop_ids, pad_id=self.tok.pad_id))
            out += [self.tok.decode(row) for row in seq[:, q.shape[1]:].tolist()]
        return out

    def __call__(self, prompts, completions):
        truncated = self.truncated
        answers = self.answers(list(prompts), list(completions))
        if self.truncated > truncated:
            print(f"warning: {self.name}: {self.truncated - truncated} of {len(answers)} judge inputs were longer than "
                  f"its context ({self.model.cfg.block_size} tokens with {self.max_new_tokens} for the answer) and "
                  "lost their beginning", file=sys.stderr, flush=True)
        scores = [parse_score(a, self.low, self.high) for a in answers]
        bad = [a for a, x in zip(answers, scores) if x is None]
        self.answered += len(answers)
        self.unparsed += len(bad)
        if bad:
            print(f"warning: {self.name}: {len(bad)} of {len(answers)} answers hold no score in "
                  f"[{self.low:g}, {self.high:g}] and score {self.fallback:g} ({self.unparsed} of {self.answered} so "
                  f"far); first: {bad[0][:60]!r}", file=sys.stderr, flush=True)
        return [self.fallback if x is None else x for x in scores]
