"""The table and the plot of scripts/tools.sh: GRPO without tools against GRPO with the calculator, each from its
SFT policy; per policy the held-out pass@1 and pass@8, tool calls per answer, the share of malformed calls, KL to
its SFT policy, the share of answers cut by the token budget, length and training time, each the mean over
training seeds (pass@k ± the standard error over prompts, pass@1's s.d. over seeds beside it; the JSON holds every
column's s.d.); per-step curves of the training reward, the tool calls per sample and the KL (mean
over seeds smoothed over 10 steps, each seed faint behind it); and where the tool-using policy's errors are (each
first call's kind, its share and how often it is right; pass@1 by the number of operands, with and without tools).

    python scripts/tools_report.py --out_dir out/tools --json out/tools/results.json --png out/tools/tools_curves.png

Reads OUT/{notools,tools}/seed*/results.json (python -m nano_rlhf.evaluate --summary), the runs' metrics.jsonl and
the evaluation's samples (MODEL/eval_samples.jsonl).
"""
import argparse
import glob
import json
import math
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nano_rlhf import chat

ARMS = [("notools", "sft", "SFT (no tools)"), ("notools", "grpo", "GRPO, no tools"),
        ("tools", "sft", "SFT with tool demonstrations"), ("tools", "grpo_tools", "GRPO with the calculator")]
COLUMNS = [("pass@1", lambda r: r.get("pass@1")), ("pass@8", lambda r: r.get("pass@8")),
           ("tool calls / answer", lambda r: r.get("tool_calls")),
           ("malformed calls", lambda r: r.get("malformed_share")),
           ("KL", lambda r: r.get("kl")), ("cut by budget", lambda r: 1 - r["eos_rate"]),
           ("length", lambda r: r.get("length")), ("train s", lambda r: r.get("train_seconds"))]
SMOOTH = 10
PANELS = [("train/score", "training reward (verifier)"), ("train/tool_calls", "tool calls per sample"),
          ("train/kl", "KL to the SFT policy")]


def spread(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return None, None
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def table(out_dir):
    rows = []
    for arm, name, label in ARMS:
        found = []
        for s in sorted(glob.glob(os.path.join(out_dir, arm, "seed*", "results.json"))):
            found += [r for r in json.load(open(s)) if r.get("name") == name]
        if found:
            rows.append({"policy": label, "seeds": len(found),
                         **{c: spread([f(r) for r in found]) for c, f in COLUMNS},
                         **{f"{k} s.e.": spread([r.get(f"{k}_se") for r in found])[0] for k in ("pass@1", "pass@8")}})
    return rows


def markdown(rows):
    """pass@k: mean over seeds ± the standard error over prompts (mean over seeds); then pass@1's s.d. over
    seeds; every other column the mean over seeds (its s.d. is in the JSON)."""
    heads = ["pass@1", "s.d. seeds", "pass@8"] + [c for c, _ in COLUMNS if not c.startswith("pass@")]
    lines = ["| policy | seeds | " + " | ".join(heads) + " |", "|---" * (len(heads) + 2) + "|"]
    for r in rows:
        cells = []
        for c in heads:
            if c.startswith("pass@"):
                m, se = r[c][0], r[f"{c} s.e."]
                cells.append("—" if m is None else f"{m:.3f} ± {se:.3f}" if se is not None else f"{m:.3f}")
            elif c == "s.d. seeds":
                cells.append(f"{r['pass@1'][1]:.3f}")
            else:
                m = r[c][0]
                digits = 0 if c == "train s" else 1 if c == "length" else 3
                cells.append("—" if m is None else f"{m:.{digits}f}")
        lines.append(f"| {r['policy']} | {r['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# the problem's expression in a prompt, as nano_rlhf.tasks.reasoning's verifier finds it (the last one)
EXPR = re.compile(r"-?\d+(?:\s*[-+*×]\s*-?\d+)+")
KINDS = ("whole expression", "one step", "miscopied", "malformed", "no call")


def call_kind(problem, completion):
    """How a sample used the calculator, by its first call: on the problem's whole expression, on one step of it
    (one operator, found in the problem), on anything else (a miscopied expression), with no usable `expression`
    argument (malformed: what the parser could not read, or the argument under another key), or no call."""
    calls = chat.parse_tool_calls("plain", completion)
    if not calls:
        return "no call"
    args = calls[0].get("arguments")
    expr = args.get("expression") if isinstance(args, dict) else None
    if not isinstance(expr, str):
        return "malformed"
    expr = " ".join(expr.split())
    if expr == problem:
        return "whole expression"
    return "one step" if len(expr.split()) == 3 and expr in problem else "miscopied"


def where_errors_are(out_dir):
    """Over every held-out sample of every seed's tool-using GRPO policy (its eval_samples.jsonl): the share of each
    call kind and how often it is right; and pass@1 by the number of operands, with and without tools."""
    kinds = {k: [] for k in KINDS}
    operands = {"GRPO, no tools": {}, "GRPO with the calculator": {}}
    for arm, run, label in (("notools", "grpo", "GRPO, no tools"), ("tools", "grpo_tools", "GRPO with the calculator")):
        for path in sorted(glob.glob(os.path.join(out_dir, arm, "seed*", run, "eval_samples.jsonl"))):
            for r in map(json.loads, open(path)):
                text = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]["content"]
                problem = " ".join(EXPR.findall(text)[-1].split())
                operands[label].setdefault(len(problem.split()) // 2 + 1, []).append(r["reward"])
                if arm == "tools":
                    kinds[call_kind(problem, r["completion"])].append(r["reward"])
    n = sum(len(v) for v in kinds.values())
    return {"calls": {k: {"share": len(v) / n, "right": statistics.mean(v) if v else None, "n": len(v)}
                      for k, v in kinds.items()} if n else {},
            "pass@1 by operands": {label: {str(m): statistics.mean(v) for m, v in sorted(by.items())}
                                   for label, by in operands.items() if by}}


def errors_markdown(errors):
    lines = ["| first call | share of answers | right |", "|---|---|---|"]
    for k, c in errors["calls"].items():
        lines.append(f"| {k} | {c['share']:.1%} | " + ("—" if c["right"] is None else f"{c['right']:.1%}") + " |")
    for label, by in errors["pass@1 by operands"].items():
        lines.append(f"\n{label}, pass@1 by operands: " + ", ".join(f"{m}: {v:.3f}" for m, v in by.items()))
    return "\n".join(lines)


def curves(out_dir, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    runs = [("notools", "grpo", "GRPO, no tools", "tab:blue"), ("tools", "grpo_tools", "GRPO with the calculator",
                                                                  "tab:red")]
    for arm, run, label, color in runs:
        seeds = []
        for d in sorted(glob.glob(os.path.join(out_dir, arm, "seed*", run))):
            path = os.path.join(d, "metrics.jsonl")
            if os.path.exists(path):
                seeds.append([json.loads(x) for x in open(path)])
        for ax, (key, title) in zip(axes, PANELS):
            series = [[(m["step"], m[key]) for m in ms if key in m and "step" in m] for ms in seeds]
            series = [s for s in series if s]
            for s in series:
                ax.plot(*zip(*s), color=color, alpha=0.2, lw=0.8)
            if series:      # the mean over seeds, as a trailing mean of SMOOTH steps (one step is 128 samples)
                n = min(len(s) for s in series)
                mean = [statistics.mean(s[i][1] for s in series) for i in range(n)]
                smooth = [statistics.mean(mean[max(0, i - SMOOTH + 1):i + 1]) for i in range(n)]
                ax.plot([p[0] for p in series[0][:n]], smooth, color=color, lw=1.6, label=label)
            ax.set_title(title)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=110)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out_dir", default="out/tools")
    ap.add_argument("--json", default="", help="write the table's rows and where the errors are here")
    ap.add_argument("--png", default="", help="draw the curves here")
    a = ap.parse_args(argv)
    rows, errors = table(a.out_dir), where_errors_are(a.out_dir)
    print(markdown(rows))
    if errors["calls"]:
        print("\n" + errors_markdown(errors))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"table": rows, **errors}, f, indent=1)
    if a.png and curves(a.out_dir, a.png):
        print(f"wrote {a.png}")
    return rows, errors


if __name__ == "__main__":
    main()
