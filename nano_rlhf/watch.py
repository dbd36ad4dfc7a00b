"""Watching a run that trains on its own samples (train_online.py, train_ppo.py) for the failures that raise no
error: the responses collapse, the judge's score runs far beyond anything it gave the starting policy, or the KL
to the initial reference jumps (train_online.py's --kl_warn: kl_jump, KLWatch).

Each is a shape of reward hacking (Gao et al. 2023): a judge is trusted only near the responses it was built
on, and a policy optimised against it finds where it is wrong — often very short or empty answers, or one
answer repeated, that a reward model scores highly because it never saw them. The run's own figures show it
(train/response_length, train/score) but nobody reads every curve, so each warning is printed once, naming the
step, on stderr. The rules are pure functions; check_step (at the end) sums a step's counts over ranks and
prints what they say.

The thresholds, stated (docs/algorithms.md, "Online and self-play methods"):
  collapse  the step's responses are on average shorter than COLLAPSE_MIN_LENGTH tokens (the stop token not
            counted), or more than COLLAPSE_SHARE of them are empty, or more than COLLAPSE_SHARE of them repeat
            another response of their own group (several samples of one prompt; not checked with one sample a
            prompt)
  no signal every one of the run's first FLAT_STEPS steps has no reward spread to learn from: with several samples
            a prompt, every group's samples score the same (GRPO's, RLOO's, Dr. GRPO's advantages are all 0; a pair
            method finds no pair); with one, every score of the step is the same. E.g. a verifier that never
            passes on these prompts: the policy gradient is 0 and the run would only drift with the KL term
  masked    every one of the run's first FLAT_STEPS steps trained on no token: every response was masked out of the
            policy loss (--overlong mask with responses that all run to --max_new_tokens, --rollout_correction mask
            rejecting every one): the update is 0 whatever the reward
  score     the step's mean judge score leaves mean₀ ± n·sd₀, mean₀ and sd₀ the mean and per-response standard
            deviation of the scores of the run's first step (the starting policy's samples), n = --score_warn.
            A step's mean over B responses has a spread of about sd₀/√B, so an honest step sits well inside;
            a reward in [0, 1] with sd₀ near ½ cannot leave at n = 3, and is not meant to (nothing to hack).
  kl        the step's KL to the initial reference is above --kl_warn nats and 3 × the median of the last 10 steps'
            (given 5 of them): a sudden run-away, not a slow drift (kl_jump says why)
"""
import math
import sys
from dataclasses import dataclass, field
from statistics import median
from typing import Optional

import torch

from . import dist

COLLAPSE_MIN_LENGTH = 2.0
COLLAPSE_SHARE = 0.5
FLAT_STEPS = 5


def response_counts(lengths, completions, group_size=1):
    """[responses, Σ length, empty, duplicates] of one rank's responses, to be summed over ranks. lengths: tokens
    before the stop token per response; completions: their texts, groups of group_size consecutive responses
    (one prompt's samples); empty = nothing but white space; a duplicate = a response whose text (stripped)
    another response earlier in its group already has."""
    lengths = [float(x) for x in lengths]
    texts = [c.strip() for c in completions]
    empty = sum(1 for t in texts if not t)
    duplicates = 0
    if group_size > 1:
        for g in range(0, len(texts), group_size):
            group = texts[g:g + group_size]
            duplicates += len(group) - len(set(group))
    return [float(len(texts)), sum(lengths), float(empty), float(duplicates)]


def collapse(counts, group_size=1) -> Optional[str]:
    """What collapsed, in words (None when nothing did), from response_counts summed over ranks."""
    n, total_length, empty, duplicates = counts
    if n <= 0:
        return None
    if total_length / n < COLLAPSE_MIN_LENGTH:
        return f"the responses average {total_length / n:.2f} tokens (under {COLLAPSE_MIN_LENGTH:g})"
    if empty / n > COLLAPSE_SHARE:
        return f"{empty / n:.0%} of the responses are empty"
    if group_size > 1 and duplicates / n > COLLAPSE_SHARE:
        return f"{duplicates / n:.0%} of the responses repeat another sample of their prompt"
    return None


def score_moments(scores):
    """[n, Σ s, Σ s²] of one rank's judge scores, to be summed over ranks."""
    s = [float(x) for x in scores]
    return [float(len(s)), sum(s), sum(x * x for x in s)]


def flat_groups(scores, group_size):
    """[groups, groups whose scores are all equal] of one rank's scores (consecutive groups of group_size), to be
    summed over ranks; with group_size 1 nothing is counted (the step's spread is read from score_moments)."""
    if group_size <= 1:
        return [0.0, 0.0]
    s = [float(x) for x in scores]
    groups = [s[g:g + group_size] for g in range(0, len(s), group_size)]
    return [float(len(groups)), float(sum(1 for g in groups if max(g) == min(g)))]


def no_signal(moments, flat, group_size):
    """Does the step give nothing to learn from? flat: flat_groups summed over ranks; moments: score_moments summed
    (group_size 1: no spread when the population variance is 0 up to float64 rounding of the sums)."""
    if group_size > 1:
        return flat[0] > 0 and flat[1] == flat[0]
    mean, sd = mean_sd(moments)
    return moments[0] > 1 and sd <= 1e-9 * max(1.0, abs(mean))


def mean_sd(moments):
    """(mean, population sd) from score_moments summed over ranks."""
    n, total, squares = moments
    mean = total / max(n, 1.0)
    return mean, math.sqrt(max(squares / max(n, 1.0) - mean * mean, 0.0))


def score_escape(mean, reference, n_sd) -> Optional[str]:
    """Has the step's mean judge score left reference = (mean₀, sd₀) ± n_sd·sd₀? The reason in words, else None.
    A reference without spread (every first-step score equal) never triggers: no scale to measure against."""
    mean0, sd0 = reference
    if not n_sd or sd0 <= 0 or abs(mean - mean0) <= n_sd * sd0:
        return None
    return (f"the mean judge score is {mean:+.3g}, {abs(mean - mean0) / sd0:.1f} standard deviations from the "
            f"starting policy's {mean0:+.3g} (sd {sd0:.3g})")


class Watch:
    """One run's watch: the first step's score reference and which warnings were already given. Saved with the
    checkpoint (state_dict, JSON), so a resumed run compares against the same reference and warns once in all."""

    def __init__(self, n_sd):
        self.n_sd = n_sd
        self.reference = None          # (mean₀, sd₀) of the first step's scores
        self.warned = []               # kinds already warned about
        self.flat = 0                  # the run's first steps without reward spread, while they last
        self.masked = 0                # the run's first steps without a token in the policy loss, while they last

    def check(self, step, counts, group_size, moments=None, flat=None, trained=None):
        """The warnings this step newly raises (a list of lines, each naming the step); counts: response_counts,
        moments: score_moments, flat: flat_groups, trained: the tokens in the policy loss, all summed over ranks
        (moments None: no judge score this step; flat, trained None: not checked)."""
        out = []
        if trained is not None and self.masked == step - 1 and step <= FLAT_STEPS:
            self.masked += trained == 0
            if self.masked == FLAT_STEPS and "masked" not in self.warned:
                self.warned.append("masked")
                out.append(f"warning: step {step}: nothing to learn from: in each of the first {FLAT_STEPS} steps "
                           "every response was masked out of the policy loss (--overlong mask drops the responses "
                           "cut at --max_new_tokens, --rollout_correction mask those the trainer disagrees on), so "
                           "the update is 0; raise --max_new_tokens or drop the mask")
        if flat is not None and moments is not None and self.flat == step - 1 and step <= FLAT_STEPS:
            self.flat += no_signal(moments, flat, group_size)
            if self.flat == FLAT_STEPS and "no signal" not in self.warned:
                self.warned.append("no signal")
                what = "every group's samples scored the same" if group_size > 1 else "every sample scored the same"
                out.append(f"warning: step {step}: nothing to learn from: in each of the first {FLAT_STEPS} steps "
                           f"{what}, so the reward gives no gradient; check that the reward can tell these prompts' "
                           "answers apart (a verifier on prompts it cannot parse scores everything 0)")
        what = collapse(counts, group_size)
        if what and "collapse" not in self.warned:
            self.warned.append("collapse")
            out.append(f"warning: step {step}: the responses collapsed: {what}. The policy may be exploiting a "
                       "blind spot of the judge (short or repeated answers it never saw); read the samples")
        if moments is not None and moments[0] > 0:
            mean, sd = mean_sd(moments)
            if self.reference is None:
                self.reference = (mean, sd)
            else:
                what = score_escape(mean, self.reference, self.n_sd)
                if what and "score" not in self.warned:
                    self.warned.append("score")
                    out.append(f"warning: step {step}: {what}: a judge is trusted only near what it was built on; "
                               "compare train/score with an independent measure of quality")
        return out

    def state_dict(self):
        return {"reference": None if self.reference is None else list(self.reference), "warned": list(self.warned),
                "flat": self.flat, "masked": self.masked}

    def load_state_dict(self, state):
        self.reference = None if state["reference"] is None else tuple(state["reference"])
        self.warned = list(state["warned"])
        self.flat = int(state["flat"])
        self.masked = int(state["masked"])


def check_step(watch, step, lengths, completions, scores, k, trained=None):
    """This step's collapse, no-signal, masked and score warnings from the samples of every rank (collective);
    rank 0 prints them on stderr. lengths: each response's tokens, its stop token not counted; scores: the
    pointwise scores as the judge gave them (before any normalising or penalty), a flat list, or None (a pairwise
    judge); trained: this rank's tokens in the policy loss (None: every response token is)."""
    counts = response_counts(lengths, completions, k)
    flat = scores if scores is not None else []
    total = dist.all_reduce_sum(torch.tensor(counts + score_moments(flat) + flat_groups(flat, k)
                                             + [float(trained or 0)], dtype=torch.float64)).tolist()
    for line in watch.check(step, total[:4], k, total[4:7] if scores is not None else None, total[7:9],
                            total[9] if trained is not None else None):
        dist.print0(line, file=sys.stderr)


def kl_jump(history, kl, floor, factor=3.0, window=10, min_history=5):
    """Has the KL to the reference jumped? True when kl > floor nats and kl > factor × the median of the last
    `window` values of history (the previous steps' KL), given at least min_history of them. Why a median: the
    per-step KL is a k-sample Monte-Carlo estimate, and a single noisy step must neither trigger the warning nor
    hide a later jump. Why both tests: early in a run the KL starts at 0, so any growth is a large ratio (the
    floor); late, a few nats may be a normal budget, so only a sudden multiple of it is news (the ratio). A slow
    drift moves the median along with the KL and never warns; a run-away like 1 → 15 nats within a few steps
    (online DPO hacking a reward model on a held-back task, the over-optimisation of Gao et al. 2023) does."""
    recent = history[-window:]
    if len(recent) < max(min_history, 1):
        return False
    return kl > floor and kl > factor * max(median(recent), 0.0)


@dataclass
class KLWatch:
    """--kl_warn's state: train/kl of the steps so far (a resumed run starts a new history), and whether it warned."""
    history: list = field(default_factory=list)
    warned: bool = False


def watch_kl(watch: KLWatch, kl, floor, step):
    """--kl_warn: one warning (rank 0) the first time the KL to the initial reference jumps (kl_jump: above
    `floor` nats and a multiple of the previous steps' median)."""
    if not watch.warned and kl_jump(watch.history, kl, floor) and dist.world().is_main:
        watch.warned = True
        print(f"warning: step {step}: the KL to the initial reference jumped to {kl:.2f} "
              f"nats (median {median(watch.history[-10:] or [0.0]):.2f} over the previous steps): the policy "
              "may be exploiting a blind spot of the judge; compare train/score with an independent measure of "
              "quality, and see docs/algorithms.md, 'Online and self-play methods'",
              file=sys.stderr, flush=True)
    watch.history.append(kl)
