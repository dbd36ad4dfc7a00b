"""Pictures of a pipeline run: training curves from each run's metrics.jsonl, and gold reward against KL to
the SFT policy for every evaluated policy (from results.json).

    python -m nano_rlhf.plot --out_dir out            # writes out/plots/*.png
    python -m nano_rlhf.plot --runs out/ppo --out_dir out/ppo

matplotlib is optional (pip install matplotlib); without it this prints a one-line note and exits 0.
"""
import argparse
import json
import os
import sys

CURVES = {  # run kind -> [(panel title, [metric keys])]
    "ppo": [("reward (raw: reward model or function)", ["train/rm_score_raw", "eval/rm_score", "eval/reward"]),
            ("gold reward", ["train/gold_reward", "eval/gold_reward"]),
            ("KL to reference (per sequence)", ["train/kl", "eval/kl"]),
            ("entropy (per token)", ["train/entropy"]),
            ("groups without reward spread (share)", ["train/zero_spread"])],
    "loss": [("loss", ["train/loss", "eval/loss"]),
             ("accuracy", ["train/accuracy", "eval/accuracy", "train/reward_accuracy", "eval/reward_accuracy"]),
             ("implicit rewards (DPO family)",
              ["train/rewards_chosen", "train/rewards_rejected", "train/reward_margin"])],
}


def read_metrics(path):
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


def series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(plt, run_dir, out_png):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        print(f"note: {path} not found; skipped", file=sys.stderr)
        return None
    rows = read_metrics(path)
    kind = "ppo" if any("train/kl_coef" in r for r in rows) else "loss"
    panels = [(t, ks) for t, ks in CURVES[kind] if any(series(rows, k)[0] for k in ks)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (title, keys) in zip(axes[0], panels):
        for k in keys:
            x, y = series(rows, k)
            if x:
                ax.plot(x, y, marker="o" if len(x) < 30 else None, ms=3, label=k)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(os.path.basename(os.path.normpath(run_dir)), fontsize=11)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def plot_results(plt, results, out_png):
    """Gold reward (± s.e.) against KL to the SFT policy, one point per policy."""
    rows = [r for r in results if "gold_reward" in r and "kl" in r]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 4))
    xs, ys = [r["kl"] for r in rows], [r["gold_reward"] for r in rows]
    dx, dy = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    placed = []
    for r in rows:
        ax.errorbar(r["kl"], r["gold_reward"], yerr=r.get("gold_reward_se", 0), fmt="o", capsize=3)
        # a label near an earlier one goes below its point instead of above, so two close policies stay legible
        near = sum(abs(r["kl"] - x) < 0.12 * dx and abs(r["gold_reward"] - y) < 0.06 * dy for x, y in placed)
        ax.annotate(r["name"], (r["kl"], r["gold_reward"]), textcoords="offset points",
                    xytext=(5, 4 - 12 * near), fontsize=8)
        placed.append((r["kl"], r["gold_reward"]))
    ax.set_xlabel("KL(policy ‖ SFT) per response (nats)")
    ax.set_ylabel("mean gold reward on held-out prompts")
    ax.set_title("What each algorithm buys, and what it costs", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def plot_overoptimization(plt, run_dir, out_png):
    """Gao et al. (2023), Fig. 1 in small: proxy (reward-model) score and gold reward on held-out prompts
    against the KL the policy has moved from its start, from a PPO run's periodic evaluations."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    rows = [r for r in read_metrics(path) if "eval/rm_score" in r and "eval/gold_reward" in r]
    if len(rows) < 3:
        return None
    kl = [max(r.get("eval/kl", 0.0), 0.0) ** 0.5 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(kl, [r["eval/rm_score"] for r in rows], "o-", color="tab:orange", label="reward-model score (proxy)")
    ax.plot(kl, [r["eval/gold_reward"] for r in rows], "s-", color="tab:blue", label="gold reward")
    last_x = None
    for r, x in zip(rows, kl):                    # label a few steps, never two that would overlap
        if last_x is None or x - last_x > 0.12 * (kl[-1] - kl[0] or 1.0):
            ax.annotate(f"step {r['step']}", (x, r["eval/gold_reward"]), textcoords="offset points", xytext=(3, -12),
                        fontsize=7, color="gray")
            last_x = x
    ax.set_xlabel("sqrt(KL(policy ‖ SFT)) per response")
    ax.set_ylabel("mean score on held-out prompts")
    ax.set_title(f"Reward-model over-optimisation ({os.path.basename(os.path.normpath(run_dir))})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out", help="pipeline output directory (runs are its subdirectories)")
    p.add_argument("--runs", nargs="*", default=None, help="run directories to plot (default: every subdirectory "
                   "of --out_dir with a metrics.jsonl)")
    p.add_argument("--results", default="", help="results JSON of nano_rlhf.evaluate (default: OUT_DIR/results.json)")
    a = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install matplotlib); no plots written")
        return []
    runs = a.runs if a.runs is not None else sorted(
        os.path.join(a.out_dir, d) for d in os.listdir(a.out_dir)
        if os.path.isfile(os.path.join(a.out_dir, d, "metrics.jsonl")))
    plots = os.path.join(a.out_dir, "plots")
    os.makedirs(plots, exist_ok=True)
    written = []
    # every run gets its curves; a run with periodic proxy and gold evaluations (RL against a reward model on
    # the built-in task) also gets the Gao et al. plot (plot_overoptimization returns None for the others)
    for r in runs:
        name = os.path.basename(os.path.normpath(r))
        written += [png for png in (plot_run(plt, r, os.path.join(plots, f"{name}.png")),
                                    plot_overoptimization(plt, r, os.path.join(plots, f"overoptimization_{name}.png")))
                    if png]
    results = a.results or os.path.join(a.out_dir, "results.json")
    if os.path.isfile(results):
        with open(results) as f:
            png = plot_results(plt, json.load(f), os.path.join(plots, "gold_vs_kl.png"))
        if png:
            written.append(png)
    for w in written:
        print(f"wrote {w}")
    if not written:
        print(f"note: nothing to plot under {a.out_dir}", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
