"""Per-step curves of online DPO on the built-in task (scripts/online.sh): the reward model's mean score of the
step's samples (what the method optimises), the gold reward of the same samples (what it should raise) and the
response length, for the default (soft labels on every pair, with the judge's training pairs beside them) and the
two before it (the same online only; hard labels on best vs worst), the mean over training seeds with each seed
faint behind it.

    python scripts/online_curves.py --out_dir out/online/builtin --png docs/online_curves.png

Reads OUT/seed*/VARIANT/metrics.jsonl (train/score, train/gold_reward, train/response_length, logged every step).
A second task's curves have no gold column (train_online.py logs the gold reward of the built-in task only).
"""
import argparse
import glob
import json
import os

PANELS = [("train/score", "reward-model score (optimised)"), ("train/gold_reward", "gold reward (held back)"),
          ("train/response_length", "response length (tokens)")]
VARIANTS = [("online_dpo", "default: soft labels, every pair, + the judge's pairs", "tab:blue"),
            ("online_dpo_online_only", "soft labels, every pair, online only", "tab:green"),
            ("online_dpo_hard", "hard labels, best vs worst, online only", "tab:red")]


def curves(run):
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    rows = [r for r in rows if "train/score" in r]
    return [r["step"] for r in rows], {k: [r.get(k, float("nan")) for r in rows] for k, _ in PANELS}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out_dir", required=True, help="scripts/online.sh's task directory (OUT/builtin)")
    p.add_argument("--png", required=True)
    a = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no curves drawn (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for variant, label, colour in VARIANTS:
        runs = sorted(glob.glob(os.path.join(a.out_dir, "seed*", variant)))
        runs = [r for r in runs if os.path.exists(os.path.join(r, "metrics.jsonl"))]
        if not runs:
            continue
        data = [curves(r) for r in runs]
        n = min(len(steps) for steps, _ in data)
        for ax, (key, title) in zip(axes, PANELS):
            for steps, c in data:
                ax.plot(steps[:n], c[key][:n], color=colour, alpha=0.2, lw=0.8)
            mean = [sum(c[key][i] for _, c in data) / len(data) for i in range(n)]
            ax.plot(data[0][0][:n], mean, color=colour, lw=1.8, label=f"{label} ({len(runs)} seeds)")
            ax.set_title(title)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.png)), exist_ok=True)
    fig.savefig(a.png, dpi=110)
    print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
