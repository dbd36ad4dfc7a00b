"""Judges for the online and self-play methods: scores for single responses, and P(a ≻ b) for pairs.

    from nano_rlhf.judge import load_judge
    judge = load_judge("out/rm", tokenizer=tok, device=device)            # a reward-model directory
    judge = load_judge("gold", prompts=prompt_texts)                       # the built-in task's reward
    judge = load_judge("my_judges:score")                                  # a pointwise function (as --reward)
    judge = load_judge("out/rm", pair_spec="my_judges:prefer")             # plus a pairwise function
    judge.scores(prompts, completions)          # (N,) float64 tensor, one score per completion
    judge.preference(prompts, a, b)             # (N,) float64 tensor, P(a[i] ≻ b[i]) for each i

A pointwise judge is anything `nano_rlhf.reward.load_reward` accepts. A pairwise judge is a user's
`module:function(prompts, a, b) -> list[float]` returning P(a[i] ≻ b[i]) in [0, 1] for each i (one call for a
whole batch of pairs, like the reward functions). Methods that need a preference take it from the pairwise
judge when one is given, otherwise from the pointwise scores under Bradley–Terry: P(a ≻ b) = σ(r(a) − r(b)).
"""
import math

import torch

from . import reward as reward_mod
from .common import fail


def bradley_terry(r_a, r_b):
    """P(a ≻ b) = σ(r_a − r_b) (Bradley & Terry 1952; the model a reward model is trained under)."""
    return torch.sigmoid(torch.as_tensor(r_a, dtype=torch.float64) - torch.as_tensor(r_b, dtype=torch.float64))


class _CheckedPairwise:
    """A user's pairwise function with its answers checked at every call: one probability per pair."""

    def __init__(self, fn, spec):
        self.fn, self.name = fn, spec

    def __call__(self, prompts, a, b):
        out = self.fn(list(prompts), list(a), list(b))
        if torch.is_tensor(out):
            out = out.detach().flatten().tolist() if out.dim() <= 1 else None
        if not isinstance(out, (list, tuple)) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                         for x in out):
            fail(f"--pair_judge {self.name}: must return a list of probabilities (one per pair), got "
                 f"{type(out).__name__}")
        if len(out) != len(a):
            fail(f"--pair_judge {self.name}: returned {len(out)} probabilities for {len(a)} pairs")
        bad = next((x for x in out if not (math.isfinite(x) and 0.0 <= x <= 1.0)), None)
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


def load_judge(spec=None, pair_spec=None, *, tokenizer=None, device="cpu", prompts=None, batch_size=64):
    """spec: what load_reward accepts (a reward-model directory, "gold", module:function) or None;
    pair_spec: a pairwise module:function or None. Import/load errors are one line naming the flag."""
    if spec is None and pair_spec is None:
        fail("a judge is needed: give --judge (reward model, gold, module:function) and/or --pair_judge")
    pointwise = None if spec is None else reward_mod.load_reward(spec, tokenizer=tokenizer, device=device,
                                                                 prompts=prompts, batch_size=batch_size)
    pairwise = None
    if pair_spec is not None:
        if not reward_mod.is_function_spec(pair_spec):
            fail(f"--pair_judge {pair_spec}: expected module:function or path/to/file.py:function")
        pairwise = _CheckedPairwise(reward_mod.load_function(pair_spec, "--pair_judge").fn, pair_spec)
    return Judge(pointwise, pairwise)
