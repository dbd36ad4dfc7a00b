"""The table and the plot of scripts/safe.sh: PPO with the reward alone against PPO-Lagrangian at its cost limits,
each policy's held-out gold reward, gold cost, share of unsafe answers (gold cost > 0), KL and length as mean and
standard deviation over training seeds, the final λ of each Lagrangian run; per-step curves of the cost model's
mean cost, λ and the gold reward of the step's samples (mean over seeds, each seed faint behind it).

    python scripts/safe_report.py --out_dir out/safe --variants sft ppo ppo_lag_d-2 ppo_lag_d0 \\
        --json out/safe/results.json --png out/safe/safe_curves.png

Reads OUT/seed*/results.json (python -m nano_rlhf.evaluate --summary) and OUT/seed*/VARIANT/metrics.jsonl.
"""
import argparse
import glob
import json
import math
import os
import statistics

COLUMNS = [("gold reward", ("gold_reward", "reward")), ("gold cost", ("cost",)), ("unsafe", ("unsafe_share",)),
           ("KL", ("kl",)), ("length", ("length",))]
PANELS = [("train/cost", "cost model's mean cost"), ("train/lambda", "λ"), ("train/gold_reward", "gold reward")]


def metrics(run):
    path = os.path.join(run, "metrics.jsonl")
    return [json.loads(x) for x in open(path)] if os.path.exists(path) else []


def spread(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return None, None
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def table(out_dir, variants):
    seeds = sorted(glob.glob(os.path.join(out_dir, "seed*")))
    rows = []
    for v in variants:
        per_seed = []
        for s in seeds:
            found = [r for r in json.load(open(os.path.join(s, "results.json"))) if r.get("name") == v]
            if found:
                per_seed.append((s, found[0]))
        if not per_seed:
            continue
        row = {"variant": v, "seeds": len(per_seed)}
        for label, keys in COLUMNS:
            key = next((k for k in keys if k in per_seed[0][1]), None)
            row[label] = spread([r.get(key) for _, r in per_seed]) if key else (None, None)
        lams = [m[-1]["train/lambda"] for s, _ in per_seed
                for m in [[x for x in metrics(os.path.join(s, v)) if "train/lambda" in x]] if m]
        row["final λ"] = spread(lams)
        rows.append(row)
    return rows


def markdown(rows):
    heads = [label for label, _ in COLUMNS] + ["final λ"]
    lines = ["| policy | seeds | " + " | ".join(heads) + " |", "|---" * (len(heads) + 2) + "|"]
    for r in rows:
        cells = ["—" if r[h][0] is None else f"{r[h][0]:+.3f} ± {r[h][1]:.3f}" if h != "unsafe"
                 else f"{100 * r[h][0]:.1f}% ± {100 * r[h][1]:.1f}" for h in heads]
        lines.append(f"| {r['variant']} | {r['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(out_dir, variants, png):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no curves drawn (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    colours = ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange"]
    for v, colour in zip([v for v in variants if v != "sft"], colours):
        runs = [metrics(os.path.join(s, v)) for s in sorted(glob.glob(os.path.join(out_dir, "seed*")))]
        runs = [[x for x in m if "train/score" in x] for m in runs if m]
        for ax, (key, title) in zip(axes, PANELS):
            curves = [[x.get(key, float("nan")) for x in m] for m in runs]
            if not curves or all(math.isnan(y) for c in curves for y in c):
                continue
            for c in curves:
                ax.plot(range(1, len(c) + 1), c, color=colour, alpha=0.2, lw=0.8)
            n = min(len(c) for c in curves)
            ax.plot(range(1, n + 1), [statistics.mean(c[i] for c in curves) for i in range(n)], color=colour,
                    label=v, lw=1.8)
            ax.set_title(title)
            ax.set_xlabel("step")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out_dir", required=True, help="scripts/safe.sh's OUT")
    p.add_argument("--variants", nargs="+", required=True, help="the policies' names, as evaluate names them")
    p.add_argument("--json", default="", help="also write the table's rows here")
    p.add_argument("--png", default="", help="also draw the per-step curves here")
    a = p.parse_args(argv)
    rows = table(a.out_dir, a.variants)
    print(markdown(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.png:
        plot(a.out_dir, a.variants, a.png)


if __name__ == "__main__":
    main()
