"""PPO (critic, train_ppo.py's defaults) against GRPO on a task that is NOT the built-in one, at equal
completions per step and equal steps. One command:

    python scripts/ppo_vs_grpo.py                    # ~8 minutes on 2 shared CPU cores -> runs/ppo_vs_grpo/
    python scripts/ppo_vs_grpo.py --steps 100        # longer runs
    python scripts/ppo_vs_grpo.py --old_defaults     # also PPO at the previous defaults (16 completions, lr 2e-5)

The task ("colours"): `What colour is the {thing}?` -> ` The {thing} is {colour}.`; every thing has one
(made-up) colour, and answers differ in that one word. (With bare one-word answers, ` red.`, the reward model
stays at chance after an epoch: it must tie a prompt word to the answer across the whole context; repeating
the thing next to the colour makes the pair local, and the RM reaches ~0.8-1.0 held-out accuracy.) The SFT demonstrations name the right colour 40% of the time
(else a wrong one), so the SFT policy starts well below the top; preference pairs (right vs wrong colour)
train the reward model. The gold reward (`gold` below: 1 when the answer names the thing's colour and no
other colour, else 0) only JUDGES: both RL runs are trained on the same trained reward model — one reward
signal, one budget, only the estimator differs (a learned critic vs k samples per prompt) — so the
comparison is the one a practitioner with an RM faces. The gold score is the mean over held-out prompts x 4
samples at temperature 1, computed by `python -m nano_rlhf.evaluate --reward scripts/ppo_vs_grpo.py:gold`
(the reward interface's `module:function` path).

Prints one table: gold before (SFT), after PPO and after GRPO (mean ± standard error), KL to the SFT policy,
and each run's wall-clock time. One run (seed 0, 30 steps, RM held-out accuracy 0.990):

    | policy | gold score    | KL to SFT |
    | sft    | 0.151 ± 0.026 | 0.000     |
    | ppo    | 0.193 ± 0.029 | 4.133     |
    | grpo   | 0.229 ± 0.030 | 4.006     |
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "brown", "pink"]
THINGS = ["apple", "sky", "grass", "banana", "coal", "snow", "bark", "flamingo", "cherry", "ocean", "leaf", "lemon",
          "crow", "milk", "chocolate", "rose", "tomato", "lake", "frog", "corn", "ink", "cloud", "mud", "pig"]
TRUE_COLOUR = {t: COLOURS[i % len(COLOURS)] for i, t in enumerate(THINGS)}   # a made-up world: learnt, not known
PHRASINGS = ["What colour is the {t}?", "Which colour is the {t}?", "Tell me the colour of the {t}.",
             "Name the colour of the {t}.", "The {t} has which colour?"]
_WORD = re.compile(r"[a-z]+")


def gold(prompts, completions):
    """1.0 when the completion names the prompt's thing's colour and no other colour, else 0.0."""
    out = []
    for p, c in zip(prompts, completions):
        thing = next(w for w in _WORD.findall(p.lower()) if w in TRUE_COLOUR)
        named = {w for w in _WORD.findall(c.lower()) if w in COLOURS}
        out.append(1.0 if named == {TRUE_COLOUR[thing]} else 0.0)
    return out


def prompt(thing, phrasing):
    return PHRASINGS[phrasing].format(t=thing) + "\nAnswer:"


def answer(thing, colour):
    return f" The {thing} is {colour}."


def write_task(d, seed=0):
    rng = random.Random(seed)
    os.makedirs(d, exist_ok=True)

    def rows(n, make):
        return [make() for _ in range(n)]

    def sft_row():
        t, ph = rng.choice(THINGS), rng.randrange(len(PHRASINGS))
        c = TRUE_COLOUR[t] if rng.random() < 0.4 else rng.choice([x for x in COLOURS if x != TRUE_COLOUR[t]])
        return {"prompt": prompt(t, ph), "completion": answer(t, c)}

    def pref_row():
        t, ph = rng.choice(THINGS), rng.randrange(len(PHRASINGS))
        wrong = rng.choice([x for x in COLOURS if x != TRUE_COLOUR[t]])
        return {"prompt": prompt(t, ph), "chosen": answer(t, TRUE_COLOUR[t]), "rejected": answer(t, wrong)}

    files = {"sft.jsonl": rows(3000, sft_row), "sft_eval.jsonl": rows(100, sft_row),
             "pref.jsonl": rows(3000, pref_row), "pref_eval.jsonl": rows(200, pref_row),
             "prompts.jsonl": [{"prompt": prompt(t, ph)} for t in THINGS for ph in range(len(PHRASINGS))] * 4,
             "eval_prompts.jsonl": [{"prompt": prompt(t, ph)} for t in THINGS for ph in (0, 2)]}
    for name, data in files.items():
        with open(os.path.join(d, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in data)


def sh(*args, log=None):
    cmd = [sys.executable, *args]
    print("+", " ".join(cmd), flush=True)
    t = time.time()
    with open(log, "w") if log else open(os.devnull, "w") as out:
        p = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=ROOT))
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed; see {log}")
    return time.time() - t


def evaluate(d, models, task, summary):
    sh("-m", "nano_rlhf.evaluate", "--model", *models, "--ref", models[0], "--prompts", f"{task}/eval_prompts.jsonl",
       "--reward", "scripts/ppo_vs_grpo.py:gold", "--samples_per_prompt", "4", "--max_new_tokens", "12",
       "--summary", summary, "--overwrite", "--seed", "1", log=os.path.join(d, "evaluate.log"))
    return {r["model"]: r for r in json.load(open(summary))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="runs/ppo_vs_grpo")
    p.add_argument("--steps", type=int, default=30, help="RL steps of each run")
    p.add_argument("--old_defaults", action="store_true", help="also run PPO at the previous defaults")
    a = p.parse_args(argv)
    d, task = a.out_dir, os.path.join(a.out_dir, "task")
    write_task(task)
    small = ["--n_layer", "4", "--n_head", "4", "--n_embd", "128", "--block_size", "64"]
    times = {}
    times["sft"] = sh("train_sft.py", "--data", f"{task}/sft.jsonl", "--eval_data", f"{task}/sft_eval.jsonl",
                      "--out_dir", f"{d}/sft", "--vocab_size", "512", "--max_steps", "200", "--eval_interval", "0",
                      *small, log=f"{d}/sft.log")
    times["rm"] = sh("train_rm.py", "--init", f"{d}/sft", "--data", f"{task}/pref.jsonl", "--eval_data",
                     f"{task}/pref_eval.jsonl", "--out_dir", f"{d}/rm", log=f"{d}/rm.log")
    rm_acc = [json.loads(x) for x in open(f"{d}/rm/metrics.jsonl") if "eval/accuracy" in x]
    common = ["--init", f"{d}/sft", "--reward_model", f"{d}/rm", "--prompts", f"{task}/prompts.jsonl",
              "--eval_prompts", f"{task}/eval_prompts.jsonl", "--max_new_tokens", "12", "--max_steps", str(a.steps),
              "--eval_interval", "0", "--eval_samples", "8", "--save_interval", "0"]
    runs = {"ppo": ["--advantage", "gae"],                                  # the defaults: 8 x 8, lr 2e-4, warm-up
            "grpo": ["--advantage", "grpo"]}                                # the same 8 x 8 completions, lr, β
    if a.old_defaults:
        runs["ppo_old_defaults"] = ["--advantage", "gae", "--batch_size", "16", "--samples_per_prompt", "1",
                                    "--lr", "2e-5", "--critic_warmup_steps", "0"]
    for name, extra in runs.items():
        times[name] = sh("train_ppo.py", *common, *extra, "--out_dir", f"{d}/{name}", log=f"{d}/{name}.log")
    rows = evaluate(d, [f"{d}/sft"] + [f"{d}/{n}" for n in runs], task, f"{d}/summary.json")
    print(f"\ntask: colours (not the built-in task) | RM held-out accuracy "
          f"{rm_acc[-1]['eval/accuracy'] if rm_acc else float('nan'):.3f} | {a.steps} RL steps, 64 completions a step"
          " (old defaults: 16) | gold = mean over 48 held-out prompts x 4 samples at T=1\n")
    print("| policy | gold score | KL to SFT | RL wall time |\n|---|---|---|---|")
    for n in ["sft", *runs]:
        r = rows[f"{d}/{n}"]
        print(f"| {n} | {r['reward']:.3f} ± {r['reward_se']:.3f} | {r.get('kl', 0.0):.3f} | "
              f"{times[n] if n != 'sft' else 0:.0f} s |")


if __name__ == "__main__":
    main()
