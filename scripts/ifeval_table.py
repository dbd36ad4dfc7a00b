"""The tables of scripts/ifeval.sh, from one or more of its output directories (one per seed):

    python scripts/ifeval_table.py out/ifeval out/ifeval_s1 [--json results/ifeval/results.json]

Headline (greedy unless said): prompt-level strict accuracy on all held-out prompts, on those with training kinds
only and on those with a held-out kind; loose; strict at equal answer length (nano_rlhf.tasks.ifeval.equal_length: the
models' answers cut into length bins at the pooled quartiles, each model's accuracy weighted by the pooled bin
shares); instruction-level strict; mean answer length in tokens; the share of answers that never ended (cut at
the token limit) and that loop (nano_rlhf.tasks.ifeval.repetitive); the training time. With several directories each
figure is the mean over seeds with the spread (min..max) beside it; with one, the standard error over prompts.
Then each method minus the start, paired prompt by prompt (the per-prompt differences averaged over the seeds,
± the standard error over prompts), and per constraint kind the share met (greedy), held-out kinds marked. With
MODES sampled, the same prompts answered once each at the training temperature: strict, at equal length, length,
never ended, the KL to the start of those samples, and the paired differences. With MODES held, the
held-out-kinds test (every prompt opening with a kind training never saw): strict, at equal length, length, per
held-out kind, and each method minus the start paired as above, on all constraints and on the unseen one
alone. A run of some methods or of some evaluations only (scripts/ifeval.sh's ARMS, MODES) fills what it
measured; the rest reads – or is left out.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nano_rlhf.tasks.ifeval import HELD_OUT, check, differences, paired, parse

NAMES = ("start", "dpo", "grpo")


def _load(d):
    """{name: figures} of the methods one output directory evaluated (a run with ARMS=grpo has start and grpo; one
    with MODES=greedy no sampled figures: NaN), with each method's per-prompt greedy differences to the start."""
    path = os.path.join(d, "report_greedy.json")
    greedy = json.load(open(path)) if os.path.isfile(path) else {}
    path = os.path.join(d, "report_sampled.json")
    sampled = json.load(open(path)) if os.path.isfile(path) else {}
    path = os.path.join(d, "report_held.json")
    held = json.load(open(path)) if os.path.isfile(path) else {}
    times = dict(line.split("\t") for line in open(os.path.join(d, "times.tsv")).read().splitlines() if line)
    nan = float("nan")
    rows = {}
    for name in NAMES:
        gpath, spath = (os.path.join(d, mode, f"{name}.jsonl") for mode in ("greedy", "sampled"))
        if gpath not in greedy:
            continue
        g = greedy[gpath]
        start = os.path.join(d, "greedy", "start.jsonl")
        rows[name] = {"strict": g["all"]["strict"], "strict_se": g["all"]["strict_se"],
                      "seen": g["seen_kinds"]["strict"], "seen_se": g["seen_kinds"]["strict_se"],
                      "held": g["held_out_kinds"]["strict"], "held_se": g["held_out_kinds"]["strict_se"],
                      "loose": g["all"]["loose"], "equal_length": greedy.get("equal_length", {}).get("strict", {})
                      .get(gpath, nan),
                      "instruction": g["all"]["instruction_strict"], "length": g["mean_length"],
                      "never_ended": g.get("never_ended", nan), "repetitive": g["repetitive"],
                      "minutes": float(times[name]) / 60 if name in times else nan,
                      "per_kind": {k: v["met"] for k, v in g["per_kind"].items()},
                      "paired": ({grp: v["diffs"] for grp, v in paired(start, gpath).items()}
                                 if name != "start" and os.path.isfile(gpath) and os.path.isfile(start) else None)}
    for name in NAMES:     # one sample a prompt at the training temperature (MODES sampled)
        spath, sstart = os.path.join(d, "sampled", f"{name}.jsonl"), os.path.join(d, "sampled", "start.jsonl")
        if spath not in sampled:
            continue
        s, summary = sampled[spath], os.path.join(d, "sampled", f"{name}.summary.json")
        summary = json.load(open(summary))[0] if os.path.isfile(summary) else {}    # evaluate's: the KL to the start
        rows.setdefault(name, {})["sampled"] = {
            "strict": s["all"]["strict"], "strict_se": s["all"]["strict_se"],
            "seen": s["seen_kinds"]["strict"], "held": s["held_out_kinds"]["strict"],
            "equal_length": sampled.get("equal_length", {}).get("strict", {}).get(spath, nan),
            "length": s["mean_length"], "never_ended": s.get("never_ended", nan),
            "kl": summary.get("kl", nan), "kl_se": summary.get("kl_se", nan),
            "paired": ({grp: v["diffs"] for grp, v in paired(sstart, spath).items()}
                       if name != "start" and os.path.isfile(sstart) else None)}
    for name in NAMES:     # the held-out-kinds test (MODES held); a run without it has no "test" entry
        hpath, hstart = os.path.join(d, "held", f"{name}.jsonl"), os.path.join(d, "held", "start.jsonl")
        if hpath not in held:
            continue
        h = held[hpath]
        rows.setdefault(name, {})["test"] = {
            "strict": h["all"]["strict"], "strict_se": h["all"]["strict_se"], "n": h["all"]["n"],
            "equal_length": held.get("equal_length", {}).get("strict", {}).get(hpath, nan),
            "length": h["mean_length"], "never_ended": h.get("never_ended", nan),
            "per_kind": {k: h["per_kind"][k]["met"] for k in HELD_OUT if k in h["per_kind"]},
            "paired": paired(hstart, hpath)["all"]["diffs"] if name != "start" and os.path.isfile(hstart) else None}
        if rows[name]["test"]["paired"] is not None:
            rows[name]["test"]["first"] = _first_diffs(hstart, hpath)
    return rows


def _first_diffs(base, path):
    """Per prompt, whether its first constraint (in the held-out-kinds test, the unseen kind) is met: path minus
    base (the files' prompts already matched by `paired`)."""
    rows = lambda p: [json.loads(line) for line in open(p)]
    out = []
    for a, b in zip(rows(base), rows(path)):
        kind, args = parse(a["prompt"])[0]
        out.append(int(check(kind, args, b["completion"])) - int(check(kind, args, a["completion"])))
    return out


def _paired_table(runs, mode="greedy"):
    """Each method minus the start, prompt by prompt (greedy, or with mode "sampled" the sampled answers): per
    group the per-prompt differences averaged over the seeds that ran the method (the seeds share the prompt
    file), then their mean ± standard error over prompts; each seed's own mean beside it."""
    groups = (("all", "all"), ("seen_kinds", "training kinds"), ("held_out_kinds", "held-out kinds"))
    out = [f"| method − start, paired ({mode} strict) | " + " | ".join(g for _, g in groups) + " | each seed (all) |",
           "|---|" + "---|" * (len(groups) + 1)]
    get = (lambda r: r.get("paired")) if mode == "greedy" else (lambda r: r.get("sampled", {}).get("paired"))
    for name in NAMES[1:]:
        have = [get(r[name]) for r in runs if name in r and get(r[name]) is not None]
        if not have:
            continue
        cells = []
        for g, _ in groups:
            m = differences([statistics.fmean(ds) for ds in zip(*(h[g] for h in have))])
            cells.append(f"{m['diff']:+.3f} ± {m['se']:.3f}" if m["n"] else "–")     # no prompt in the group
        seeds = ", ".join(f"{statistics.fmean(h['all']):+.3f}" for h in have)
        out.append(f"| {name} ({len(have)} seed{'s' if len(have) > 1 else ''}) | " + " | ".join(cells)
                   + f" | {seeds} |")
    return out


def _sampled_table(runs):
    """MODES sampled: one answer a prompt at the training temperature (the distribution the methods optimise),
    a row per model with the KL to the start of its samples, then the paired differences as for greedy."""
    have = [r for r in runs if any("sampled" in v for v in r.values())]
    if not have:
        return []
    one = len(have) == 1
    names = [n for n in NAMES if any("sampled" in r.get(n, {}) for r in have)]
    head = ["sampled at the training temperature", "strict", "training kinds", "held-out kinds", "at equal length",
            "length (tokens)", "never ended", "KL to the start (nats)"]
    out = ["", f"Sampled: the same prompts, one answer each ({len(have)} seed{'s' if len(have) > 1 else ''})", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        t = [r[name]["sampled"] for r in have if "sampled" in r.get(name, {})]
        v = lambda k: [x[k] for x in t]
        out.append("| " + " | ".join([name, _cell(v("strict"), t[0]["strict_se"] if one else None),
                                      _cell(v("seen")), _cell(v("held")), _cell(v("equal_length")),
                                      _cell(v("length"), digits=0), _cell(v("never_ended"), pct=True),
                                      _cell(v("kl"), t[0]["kl_se"] if one else None, digits=2)]) + " |")
    return out + [""] + _paired_table(have, "sampled")


def _test_table(runs):
    """The held-out-kinds test (scripts/ifeval.sh MODES held): a row per model, then each method minus the start,
    paired prompt by prompt with the differences averaged over the seeds as in _paired_table."""
    have = [r for r in runs if any("test" in v for v in r.values())]
    if not have:
        return []
    one = len(have) == 1
    names = [n for n in NAMES if any("test" in r.get(n, {}) for r in have)]
    n = have[0][names[0]]["test"]["n"]
    head = ["held-out-kinds test (greedy)", "strict", "at equal length", "length (tokens)", "never ended"] + HELD_OUT
    out = ["", f"Held-out-kinds test: {n} prompts, every one opening with a kind training never saw "
               f"({len(have)} seed{'s' if len(have) > 1 else ''})", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        t = [r[name]["test"] for r in have if "test" in r.get(name, {})]
        cells = [name, _cell([x["strict"] for x in t], t[0]["strict_se"] if one else None),
                 _cell([x["equal_length"] for x in t]), _cell([x["length"] for x in t], digits=0),
                 _cell([x["never_ended"] for x in t], pct=True)]
        cells += [_cell([x["per_kind"].get(k, float("nan")) for x in t], digits=2) for k in HELD_OUT]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "| method − start, paired (held-out-kinds test) | strict | the unseen constraint alone | each seed "
            "(strict) |", "|---|---|---|---|"]
    for name in names[1:]:
        tests = [r[name]["test"] for r in have if r.get(name, {}).get("test", {}).get("paired")]
        if tests:
            cells = []
            for key in ("paired", "first"):
                m = differences([statistics.fmean(ds) for ds in zip(*(t[key] for t in tests))])
                cells.append(f"{m['diff']:+.3f} ± {m['se']:.3f}")
            seeds = ", ".join(f"{statistics.fmean(t['paired']):+.3f}" for t in tests)
            out.append(f"| {name} ({len(tests)} seed{'s' if len(tests) > 1 else ''}) | " + " | ".join(cells)
                       + f" | {seeds} |")
    return out


def _cell(values, se=None, pct=False, digits=3):
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{x:.{digits}f}")
    values = [x for x in values if x == x]          # a seed that did not measure it (NaN) is left out
    if not values:
        return "–"
    m = statistics.fmean(values)
    if len(values) > 1:
        return f"{f(m)} ({f(min(values))}..{f(max(values))})"
    return f"{f(m)} ± {f(se)}" if se is not None else f(m)


def tables(dirs):
    runs = [_load(d) for d in dirs]
    one = len(runs) == 1
    out = []
    names = [n for n in NAMES if any("strict" in r.get(n, {}) for r in runs)]
    if names:          # a run of the greedy evaluation on the held-out prompts (MODES greedy)
        head = ["model", "strict, all", "training kinds", "held-out kinds", "loose", "strict at equal length",
                "instruction-level", "length (tokens)", "never ended", "repetitive", "train (min)"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in names:
            v = lambda k: [r[name][k] for r in runs if "strict" in r.get(name, {})]
            se = lambda k: runs[0][name][k + "_se"] if one else None
            cells = [name, _cell(v("strict"), se("strict")), _cell(v("seen"), se("seen")),
                     _cell(v("held"), se("held")), _cell(v("loose")), _cell(v("equal_length")),
                     _cell(v("instruction")), _cell(v("length"), digits=0), _cell(v("never_ended"), pct=True),
                     _cell(v("repetitive"), pct=True), "" if name == "start" else _cell(v("minutes"), digits=0)]
            out.append("| " + " | ".join(cells) + " |")
        out += [""] + _paired_table(runs)
        kinds = sorted({k for r in runs for n in names for k in r.get(n, {}).get("per_kind", {})},
                       key=lambda k: (k in HELD_OUT, k))
        out += ["", "| kind (greedy, share met) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for k in kinds:
            cells = [_cell([r[n]["per_kind"].get(k, float("nan")) for r in runs if "strict" in r.get(n, {})],
                           digits=2) for n in names]
            out.append(f"| {k}{' (held out)' if k in HELD_OUT else ''} | " + " | ".join(cells) + " |")
    out += _sampled_table(runs) + _test_table(runs)
    return "\n".join(out).strip("\n"), runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", help="scripts/ifeval.sh output directories (one per seed)")
    p.add_argument("--json", default="", help="also write the figures of every directory to this file")
    a = p.parse_args(argv)
    for d in a.dirs:
        if not any(os.path.isfile(os.path.join(d, f"report_{m}.json")) for m in ("greedy", "sampled", "held")):
            p.exit(2, f"error: {d}: no report_greedy.json, report_sampled.json or report_held.json (not a finished "
                   "scripts/ifeval.sh output)\n")
    text, runs = tables(a.dirs)
    print(text)
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(dict(zip(a.dirs, runs)), f, indent=1)


if __name__ == "__main__":
    main()
