"""The figures of a set of scored samples: means with standard errors, win rate against a baseline, pass@k and
maj@k (per prompt, then over prompts), the zero-spread share, and the one-line and markdown tables that
nano_rlhf.evaluate prints. Pure functions over sample records ({"prompt", "sample", "length", "eos", and the
reward columns}); nothing here samples or loads a model.
"""
import itertools
import math
import random

from .tasks.common import mean_se


def pass_at_k(n, c, k):
    """The unbiased pass@k estimate from n samples of which c are correct (Chen et al. 2021, eq. 1):
    1 − C(n−c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold a correct one.
    Computed as their numerically stable product 1 − Π_{i=n−c+1}^{n} (1 − k/i): no huge binomials, exact
    at 1.0 when every k-subset holds a correct sample (n − c < k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


MAJ_SUBSETS = 4096       # maj@k averages over every k-subset up to this many, else over this many seeded ones


def maj_at_k(answers, correct, k, max_subsets=MAJ_SUBSETS, seed=0):
    """Majority-vote accuracy (maj@k, self-consistency: Wang et al. 2023) of one prompt from its n >= k samples:
    the expected correctness of the most common answer among k samples drawn without replacement.

    answers: the n extracted answers (None: the sample states none; it does not vote); correct: the n
    verifier verdicts (truthy = correct). An answer is correct when the samples holding it are (their mean, so
    a verifier that disagrees with itself on one answer gives partial credit). A tie at the top counts the mean
    correctness of the tied answers (a uniformly random tie-break, in expectation); a subset with no answer
    counts 0. Like pass@k it is averaged over k-subsets rather than read off the first k samples (a lower
    variance estimate of the same expectation): exactly over all C(n, k) of them when there are at most
    max_subsets, else over max_subsets drawn at random with `seed`."""
    n = len(answers)
    if len(correct) != n or not 1 <= k <= n:
        raise ValueError(f"maj@k needs n >= k >= 1 samples and one verdict per answer (n={n}, k={k})")
    verdicts = {}
    for a, ok in zip(answers, correct):
        if a is not None:
            verdicts.setdefault(a, []).append(float(ok))
    worth = {a: sum(v) / len(v) for a, v in verdicts.items()}

    def vote(subset):
        counts = {}
        for i in subset:
            if answers[i] is not None:
                counts[answers[i]] = counts.get(answers[i], 0) + 1
        if not counts:
            return 0.0
        top = max(counts.values())
        tied = [a for a, c in counts.items() if c == top]
        return sum(worth[a] for a in tied) / len(tied)

    if math.comb(n, k) <= max_subsets:
        subsets = itertools.combinations(range(n), k)
        total = math.comb(n, k)
    else:
        rng = random.Random(seed)
        subsets = (rng.sample(range(n), k) for _ in range(max_subsets))
        total = max_subsets
    return sum(vote(s) for s in subsets) / total


def by_prompt(samples):
    """Sample records grouped per prompt: consecutive runs that start at sample 0 (sample_and_score's order)."""
    groups = []
    for r in samples:
        if r["sample"] == 0 or not groups:
            groups.append([])
        groups[-1].append(r)
    return groups


def summarize(samples, baseline=None, pass_k=(), pass_threshold=1.0):
    """Aggregate figures of a list of sample records (and win rate against baseline records). pass_k: the k of
    pass@k (and of maj@k when the records hold an "answer") on the "reward" column, a sample passing when its
    reward >= pass_threshold; per prompt, then mean and standard error over prompts."""
    s = {"n": len(samples), "length": sum(r["length"] for r in samples) / len(samples),
         "eos_rate": sum(r["eos"] for r in samples) / len(samples)}
    for key in ("gold_reward", "reward", "rm_score", "cost", "kl"):
        if samples and key in samples[0]:
            s[key], s[key + "_se"] = mean_se([r[key] for r in samples])
    if samples and "cost" in samples[0]:         # Safe RLHF's reading of a cost: above 0 is unsafe
        s["unsafe_share"], s["unsafe_share_se"] = mean_se([float(r["cost"] > 0) for r in samples])
    if samples and "tool_calls" in samples[0]:     # tool use (evaluate --tools): calls written per response, and
        # the share of them that were malformed (0 when none was written)
        s["tool_calls"], s["tool_calls_se"] = mean_se([r["tool_calls"] for r in samples])
        n_calls = sum(r["tool_calls"] for r in samples)
        s["malformed_share"] = sum(r["malformed_calls"] for r in samples) / n_calls if n_calls else 0.0
    if samples and "answer" in samples[0]:
        # the share of samples that state an answer at all: beside pass@1, it tells a format-only gain (more
        # answers that parse) from a better one (more answers that are right)
        s["answered"] = sum(r["answer"] is not None for r in samples) / len(samples)
    groups = by_prompt(samples) if pass_k else []
    if groups and min(len(g) for g in groups) > 1:
        # prompts whose samples all pass or all fail: a group-relative advantage (GRPO, RLOO) is 0 on every one of
        # them, so this is the share of such prompts that would teach nothing (DAPO's dynamic sampling drops them)
        same = [len({r["reward"] >= pass_threshold for r in g}) == 1 for g in groups]
        s["zero_spread"] = sum(same) / len(same)
    for k in pass_k:
        ok = [[r["reward"] >= pass_threshold for r in g] for g in groups]
        s[f"pass@{k}"], s[f"pass@{k}_se"] = mean_se([pass_at_k(len(o), sum(o), k) for o in ok])
        if "answer" in samples[0]:
            s[f"maj@{k}"], s[f"maj@{k}_se"] = mean_se([maj_at_k([r["answer"] for r in g], o, k)
                                                       for g, o in zip(groups, ok)])
    judge = next((k for k in ("gold_reward", "reward") if k in s and baseline and k in baseline[0]), None)
    if baseline is not None and judge is not None:
        if len(baseline) != len(samples) or any(a["prompt"] != b["prompt"] for a, b in zip(samples, baseline)):
            raise ValueError("--baseline samples must come from the same prompts file and --samples_per_prompt")
        wins = [1.0 if a[judge] > b[judge] else 0.5 if a[judge] == b[judge] else 0.0 for a, b in zip(samples, baseline)]
        s["win_rate"], s["win_rate_se"] = mean_se(wins)
    return s


def pass_keys(s):
    """The pass@k and maj@k figures of a summary, in order (pass@1, pass@8, maj@1, maj@8)."""
    keys = [key for key in s if key.startswith(("pass@", "maj@")) and not key.endswith("_se")]
    return sorted(keys, key=lambda key: (key.startswith("maj@"), int(key.split("@")[1])))


def format_summary(name, s):
    cols = [name]
    if "gold_reward" in s:
        cols.append(f"gold {s['gold_reward']:+.3f} ± {s['gold_reward_se']:.3f}")
    if "reward" in s:
        cols.append(f"reward {s['reward']:+.3f} ± {s['reward_se']:.3f}")
    if "win_rate" in s:
        cols.append(f"win {100 * s['win_rate']:.1f}%")
    cols += [f"{key} {s[key]:.3f} ± {s[key + '_se']:.3f}" for key in pass_keys(s)]
    if "answered" in s:
        cols.append(f"answered {100 * s['answered']:.1f}%")
    if "rm_score" in s:
        cols.append(f"rm {s['rm_score']:+.3f}")
    if "cost" in s:
        cols.append(f"cost {s['cost']:+.3f} ± {s['cost_se']:.3f} | unsafe {100 * s['unsafe_share']:.1f}%")
    if "kl" in s:
        cols.append(f"kl {s['kl']:.3f}")
    if "zero_spread" in s:
        cols.append(f"zero-spread {100 * s['zero_spread']:.1f}%")
    if "tool_calls" in s:
        cols.append(f"calls {s['tool_calls']:.2f} | malformed {100 * s['malformed_share']:.1f}%")
    cols += [f"len {s['length']:.1f}", f"eos {100 * s['eos_rate']:.1f}%"]
    return " | ".join(cols)


def format_table(rows):
    """A markdown table: policy, gold reward ± s.e., win rate vs the baseline, RM score, cost and unsafe share, KL,
    length, eos rate."""
    cols = [("policy", lambda r: r["name"])]
    if "gold_reward" in rows[0]:
        cols.append(("gold reward", lambda r: f"{r['gold_reward']:+.3f} ± {r['gold_reward_se']:.3f}"))
    if "reward" in rows[0]:
        cols.append(("reward", lambda r: f"{r['reward']:+.3f} ± {r['reward_se']:.3f}"))
    if "win_rate" in rows[0]:
        cols.append(("win rate vs " + rows[0]["name"], lambda r: f"{100 * r['win_rate']:.1f}%"))
    cols += [(key, lambda r, key=key: f"{r[key]:.3f} ± {r[key + '_se']:.3f}") for key in pass_keys(rows[0])]
    if "answered" in rows[0]:
        cols.append(("answers that parse", lambda r: f"{100 * r['answered']:.0f}%"))
    if "rm_score" in rows[0]:
        cols.append(("RM score", lambda r: f"{r['rm_score']:+.3f}"))
    if "cost" in rows[0]:
        cols += [("cost", lambda r: f"{r['cost']:+.3f} ± {r['cost_se']:.3f}"),
                 ("unsafe", lambda r: f"{100 * r['unsafe_share']:.1f}%")]
    if "kl" in rows[0]:
        cols.append(("KL to ref", lambda r: f"{r['kl']:.3f}"))
    if "zero_spread" in rows[0]:
        cols.append(("zero-spread prompts", lambda r: f"{100 * r['zero_spread']:.0f}%"))
    if "tool_calls" in rows[0]:
        cols += [("tool calls / answer", lambda r: f"{r['tool_calls']:.2f}"),
                 ("malformed calls", lambda r: f"{100 * r['malformed_share']:.1f}%")]
    cols += [("length", lambda r: f"{r['length']:.1f}"), ("eos rate", lambda r: f"{100 * r['eos_rate']:.0f}%")]
    if any("train_seconds" in r for r in rows):
        cols.append(("training time", lambda r: f"{r['train_seconds']:.0f} s" if "train_seconds" in r else "—"))
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in rows]
    return "\n".join(lines)


# ---- the same policies over several training seeds ----------------------------------------------------------

def across_seeds(per_seed, baseline, key="pass@1"):
    """One row per policy from several seeds' evaluations. per_seed: a list (one per seed) of evaluate summaries
    ({"name", key, key + "_se", ...} rows, the --summary JSON); baseline: the name of the row every other is
    compared with (the SFT policy). Returns rows {"name", "seeds", "mean", "values", "se_prompts", "sd_seeds",
    "gain", "learns"}:
      mean        the mean of key over seeds
      se_prompts  the mean over seeds of each seed's standard error over prompts (what another set of held-out
                  prompts would move a seed's figure by)
      sd_seeds    the standard deviation of key over seeds (Bessel; 0 with one seed)
      learns      the gain over the baseline exceeds twice the larger of se_prompts and sd_seeds / √seeds, and
                  every seed is above the baseline's mean: the one definition the RLVR table uses"""
    names = [r["name"] for r in per_seed[0]]
    rows = []
    base = [next(r[key] for r in seed if r["name"] == baseline) for seed in per_seed]
    base_mean = sum(base) / len(base)
    for name in names:
        vals = [next(r for r in seed if r["name"] == name) for seed in per_seed if any(r["name"] == name for r in seed)]
        x = [r[key] for r in vals]
        n = len(x)
        mean = sum(x) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in x) / (n - 1)) if n > 1 else 0.0
        se = sum(r[key + "_se"] for r in vals) / n
        gain = mean - base_mean
        learns = name != baseline and gain > 2 * max(se, sd / math.sqrt(n)) and min(x) > base_mean
        rows.append({"name": name, "seeds": n, "mean": mean, "values": x, "se_prompts": se, "sd_seeds": sd,
                     "gain": gain, "learns": learns, **{k: sum(r[k] for r in vals) / n for k in vals[0]
                                                        if k in ("kl", "answered", "length", "pass@8")}})
    return rows


def format_seed_table(rows, key="pass@1"):
    """The markdown table of across_seeds: mean ± s.e. over prompts, the spread over seeds, the gain, the verdict."""
    lines = [f"| policy | {key} (mean over seeds ± s.e. over prompts) | s.d. over seeds | seeds | gain | learns | "
             "pass@8 | answers that parse | KL to SFT |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = [f"{r['pass@8']:.3f}" if "pass@8" in r else "—",
                 f"{100 * r['answered']:.0f}%" if "answered" in r else "—", f"{r['kl']:.2f}" if "kl" in r else "—"]
        lines.append(f"| {r['name']} | {r['mean']:.3f} ± {r['se_prompts']:.3f} | {r['sd_seeds']:.3f} | {r['seeds']} | "
                     f"{r['gain']:+.3f} | {'yes' if r['learns'] else 'no'} | " + " | ".join(extra) + " |")
    return "\n".join(lines)


def main(argv=None):
    """python -m nano_rlhf.summary --baseline sft SEED0.json SEED1.json ...: the --summary files of evaluate runs
    of the same policies at several training seeds, as one table with the "learns" verdict (across_seeds)."""
    import argparse
    import json

    from .checkpoint import write_json
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("summaries", nargs="+", help="evaluate --summary JSON files, one per training seed")
    p.add_argument("--baseline", default="sft", help="the row every other policy is compared with")
    p.add_argument("--key", default="pass@1", help="the figure compared (a key of the summaries)")
    p.add_argument("--out", default="", help="also write the rows as JSON here")
    a = p.parse_args(argv)
    rows = across_seeds([json.load(open(f)) for f in a.summaries], a.baseline, a.key)
    print(format_seed_table(rows, a.key))
    if a.out:
        write_json(a.out, rows)
    return rows


if __name__ == "__main__":
    main()
