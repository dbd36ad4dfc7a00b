"""Learning curves of nano_rlhf's GRPO and TRL's GRPOTrainer on the same run (scripts/reasoning.sh with TRL_PYTHON):
the training reward (the verifier's mean over each rollout) and the KL to the SFT policy per token, against rollouts and
against wall-clock seconds, the mean over training seeds with each seed faint behind it.

    python scripts/rlvr_curves.py --out_dir out/reasoning --png docs/rlvr_curves.png

Ours: OUT/seed*/grpo/metrics.jsonl (train/rm_score_raw: the raw reward of the step's rollout; train/kl;
train/step_time). TRL's: OUT/seed*/trl_grpo/trl_log.jsonl (bench/trl_grpo.py's copy of TRL's log: one line per
optimizer step, "reward" on the first step of each generation, "kl" the token-mean k3 of each step, "wall" the
seconds since training began).
"""
import argparse
import glob
import json
import os


def ours(run):
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    rows = [r for r in rows if "train/rm_score_raw" in r]
    wall, t = [], 0.0
    for r in rows:
        t += r.get("train/step_time", 0.0)
        wall.append(t)
    # train/kl is the sequence's Σ_t k1; TRL logs a mean over tokens: compare per token
    kl = [r["train/kl"] / max(r["train/response_length"], 1.0) for r in rows]
    return [r["train/rm_score_raw"] for r in rows], kl, wall


def trl(run):
    """TRL logs every optimizer step; the reward only on the first step of each generation (rollout): one point a
    rollout, its KL the mean over the rollout's optimizer steps."""
    rows = [json.loads(x) for x in open(os.path.join(run, "trl_log.jsonl")) if '"loss"' in x]
    starts = [i for i, r in enumerate(rows) if "reward" in r] + [len(rows)]
    kl = [sum(r.get("kl", 0.0) for r in rows[a:b]) / (b - a) for a, b in zip(starts, starts[1:])]
    return [rows[i]["reward"] for i in starts[:-1]], kl, [rows[i]["wall"] for i in starts[:-1]]


def smooth(x, w=10):
    return [sum(x[max(0, i - w + 1):i + 1]) / len(x[max(0, i - w + 1):i + 1]) for i in range(len(x))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out_dir", default="out/reasoning")
    p.add_argument("--png", default="out/reasoning/plots/rlvr_curves.png")
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sides = {"nano_rlhf GRPO": (sorted(glob.glob(os.path.join(a.out_dir, "seed*", "grpo"))), ours),
             "TRL GRPOTrainer": (sorted(glob.glob(os.path.join(a.out_dir, "seed*", "trl_grpo"))), trl)}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for (name, (runs, read)), colour in zip(sides.items(), ("tab:blue", "tab:orange")):
        curves = [read(r) for r in runs if os.path.exists(os.path.join(r, "model.safetensors"))]
        if not curves:
            continue
        n = min(len(c[0]) for c in curves)
        for reward, kl, wall in curves:
            axes[0].plot(smooth(reward)[:n], color=colour, alpha=0.25, lw=0.8)
            axes[2].plot(wall[:n], smooth(reward)[:n], color=colour, alpha=0.25, lw=0.8)
        mean = [sum(smooth(c[0])[i] for c in curves) / len(curves) for i in range(n)]
        mean_kl = [sum(c[1][i] for c in curves) / len(curves) for i in range(n)]
        mean_wall = [sum(c[2][i] for c in curves) / len(curves) for i in range(n)]
        label = f"{name} ({len(curves)} seeds)"
        axes[0].plot(mean, color=colour, lw=2, label=label)
        axes[1].plot(mean_kl, color=colour, lw=2, label=label)
        axes[2].plot(mean_wall, mean, color=colour, lw=2, label=label)
    axes[0].set(title="training reward (verifier, 10-rollout mean)", xlabel="rollout (128 samples)")
    axes[1].set(title="KL per token as each logs it (ours k1, TRL k3)", xlabel="rollout", yscale="log")
    axes[2].set(title="training reward against time", xlabel="seconds of training (1 CPU thread)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.png)), exist_ok=True)
    fig.savefig(a.png, dpi=110)
    print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
