"""The table and the plot of scripts/tools.sh: GRPO without tools against GRPO with the calculator, each from its
SFT policy; per policy the held-out pass@1 and pass@8, tool calls per answer, the share of malformed calls, KL to
its SFT policy, the share of answers cut by the token budget, length and training time, each the mean over
training seeds (pass@k ± the standard error over prompts, pass@1's s.d. over seeds beside it; the JSON holds every
column's s.d.); per-step curves of the training reward, the tool calls per sample and the KL (mean
over seeds smoothed over 10 steps, each seed faint behind it).

    python bench/tools_report.py --out_dir out/tools --json out/tools/results.json --png out/tools/tools_curves.png

Reads OUT/{notools,tools}/seed*/results.json (python -m nano_rlhf.evaluate --summary) and the runs' metrics.jsonl.
"""
import argparse
import glob
import json
import math
import os
import statistics

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
    ap.add_argument("--json", default="", help="write the table's rows here")
    ap.add_argument("--png", default="", help="draw the curves here")
    a = ap.parse_args(argv)
    rows = table(a.out_dir)
    print(markdown(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.png and curves(a.out_dir, a.png):
        print(f"wrote {a.png}")
    return rows


if __name__ == "__main__":
    main()
