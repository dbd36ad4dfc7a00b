"""Verifiable instruction following (IFEval-style): prompts that carry constraints code can check, and the checker
as an ordinary reward function, for aligning a real chat model on something a user recognises.

    python -m nano_rlhf.ifeval --out_dir data/ifeval            # train.jsonl, eval.jsonl (held-out), task.json
    python train_ppo.py --init MODEL --prompts data/ifeval/train.jsonl --advantage grpo \\
        --reward nano_rlhf.ifeval:reward ...
    python -m nano_rlhf.evaluate --model OUT --prompts data/ifeval/eval.jsonl --reward nano_rlhf.ifeval:strict
    python -m nano_rlhf.label --reward nano_rlhf.ifeval:reward ...     # self-sampled pairs for DPO

A prompt asks for a short piece on a topic and adds one or two constraints, each written as one fixed sentence
that `parse` reads back, so the checker needs nothing but the prompt text (the reward interface is
reward(prompts, completions) -> list of floats):
  max_words N     "Answer in at most N words."
  lowercase       "Use only lowercase letters."
  include W       'Include the word "W".'
  end_with P      'End your answer with the exact phrase "P".'
  json_keys A, B  'Answer with a JSON object that has exactly the keys "A" and "B".'
  bullets N       'Answer with exactly N bullet points, each on its own line starting with "- ".'
`reward` is the share of a prompt's constraints met (a dense signal for RL); `strict` is 1 only when all are
(IFEval's prompt-level strict accuracy). A malformed answer scores 0, never an error; a prompt with no
constraint this module wrote scores 0.

Held out: eval.jsonl uses topics train.jsonl never uses; half its prompts hold one constraint, a quarter a pair
that train.jsonl also combines, and a quarter a pair that train.jsonl never combines (HELD_OUT_PAIRS).
"""
import argparse
import json
import os
import random
import re

TOPICS = ["the ocean", "coffee", "a rainy day", "learning to ride a bike", "the moon", "a city at night",
          "winter mornings", "public libraries", "electric cars", "a favourite meal", "mountain hiking", "cats",
          "a school trip", "time management", "recycling", "the history of bread", "video games", "gardening",
          "a long train journey", "friendship", "solar power", "the first day at a new job", "street music",
          "a desert", "bees", "rivers", "chess", "birthday parties", "the internet", "autumn leaves",
          # held out (eval only)
          "volcanoes", "a lighthouse", "board games", "tea", "the circus", "snow", "museums", "penguins",
          "a bakery", "thunderstorms"]
TRAIN_TOPICS, EVAL_TOPICS = TOPICS[:30], TOPICS[30:]
WORDS = ["bright", "gentle", "quickly", "harbor", "silver", "journey", "simple", "window", "garden", "promise"]
PHRASES = ["Is there anything else?", "That is all.", "Thank you for reading.", "The end."]
KEYS = [("title", "summary"), ("name", "reason"), ("topic", "opinion"), ("question", "answer")]
KINDS = ("max_words", "lowercase", "include", "end_with", "json_keys", "bullets")
# pairs that contradict each other (a JSON object has no bullets and no closing phrase)
INCOMPATIBLE = {frozenset(p) for p in [("json_keys", "bullets"), ("json_keys", "end_with"), ("json_keys", "max_words")]}
HELD_OUT_PAIRS = {frozenset(p) for p in [("lowercase", "bullets"), ("include", "json_keys"),
                                         ("end_with", "max_words")]}


def render(kind, arg):
    """The one sentence that states a constraint (parse reads it back)."""
    if kind == "max_words":
        return f"Answer in at most {arg} words."
    if kind == "lowercase":
        return "Use only lowercase letters."
    if kind == "include":
        return f'Include the word "{arg}".'
    if kind == "end_with":
        return f'End your answer with the exact phrase "{arg}".'
    if kind == "json_keys":
        return f'Answer with a JSON object that has exactly the keys "{arg[0]}" and "{arg[1]}".'
    if kind == "bullets":
        return f'Answer with exactly {arg} bullet points, each on its own line starting with "- ".'
    raise ValueError(f"unknown constraint kind {kind!r}")


_PATTERNS = [
    ("max_words", re.compile(r"Answer in at most (\d+) words\."), lambda m: int(m.group(1))),
    ("lowercase", re.compile(r"Use only lowercase letters\."), lambda m: None),
    ("include", re.compile(r'Include the word "([^"]+)"\.'), lambda m: m.group(1)),
    ("end_with", re.compile(r'End your answer with the exact phrase "([^"]+)"\.'), lambda m: m.group(1)),
    ("json_keys", re.compile(r'Answer with a JSON object that has exactly the keys "([^"]+)" and "([^"]+)"\.'),
     lambda m: (m.group(1), m.group(2))),
    ("bullets", re.compile(r"Answer with exactly (\d+) bullet points, each on its own line starting with \"- \"\."),
     lambda m: int(m.group(1))),
]


def prompt_text(prompt):
    """The text the constraints are read from: a string prompt, or the last user message of a conversation."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return users[-1] if users and isinstance(users[-1], str) else ""
    return ""


def parse(prompt):
    """[(kind, arg), ...] of the constraints stated in a prompt, in the order they appear."""
    text = prompt_text(prompt)
    found = [(m.start(), kind, get(m)) for kind, pat, get in _PATTERNS for m in pat.finditer(text)]
    return [(kind, arg) for _, kind, arg in sorted(found, key=lambda f: f[0])]


def _json_object(text):
    """The completion as a JSON object (a ```json fence around it allowed), or None."""
    t = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", t, re.S)
    if fence:
        t = fence.group(1)
    try:
        obj = json.loads(t)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def check(kind, arg, text):
    """Whether `text` meets one constraint (never raises)."""
    if kind == "max_words":
        return 0 < len(text.split()) <= arg
    if kind == "lowercase":
        return any(c.isalpha() for c in text) and text == text.lower()
    if kind == "include":
        return re.search(r"\b" + re.escape(arg) + r"\b", text, re.I) is not None
    if kind == "end_with":
        return text.rstrip().endswith(arg)
    if kind == "json_keys":
        obj = _json_object(text)
        return obj is not None and set(obj) == set(arg)
    if kind == "bullets":
        return sum(1 for line in text.splitlines() if re.match(r"\s*[-*] \S", line)) == arg
    return False


def _scores(prompts, completions):
    out = []
    for p, c in zip(prompts, completions):
        cons = parse(p)
        met = [check(kind, arg, c if isinstance(c, str) else "") for kind, arg in cons]
        out.append((sum(met), len(met)))
    return out


def reward(prompts, completions):
    """Share of each prompt's constraints the completion meets, in [0, 1] (0 for a prompt without any)."""
    return [met / n if n else 0.0 for met, n in _scores(prompts, completions)]


def strict(prompts, completions):
    """1.0 when a completion meets every constraint of its prompt, else 0.0 (IFEval's prompt-level strict)."""
    return [float(n > 0 and met == n) for met, n in _scores(prompts, completions)]


# ---- prompt files -------------------------------------------------------------------------------

def _arg(kind, rng):
    return {"max_words": lambda: rng.choice([20, 30, 50]), "lowercase": lambda: None,
            "include": lambda: rng.choice(WORDS), "end_with": lambda: rng.choice(PHRASES),
            "json_keys": lambda: rng.choice(KEYS), "bullets": lambda: rng.choice([2, 3, 4])}[kind]()


def _pairs(held_out):
    pairs = [frozenset((a, b)) for i, a in enumerate(KINDS) for b in KINDS[i + 1:]]
    return [p for p in pairs if p not in INCOMPATIBLE and (p in HELD_OUT_PAIRS) == held_out]


def make_prompt(rng, topic, kinds):
    kinds = sorted(kinds, key=KINDS.index)
    head = rng.choice(["Write a short paragraph about {}.", "Describe {} briefly.", "Tell me about {}."])
    text = " ".join([head.format(topic)] + [render(k, _arg(k, rng)) for k in kinds])
    return {"prompt": [{"role": "user", "content": text}]}


def write_prompts(out_dir, seed=0, n_train=512, n_eval=256):
    """train.jsonl (train topics, one constraint or a training pair), eval.jsonl (held-out topics; see the module
    docstring) and task.json; byte-identical at a seed."""
    rng = random.Random(seed)
    train_pairs, held = _pairs(False), _pairs(True)
    train, evals = [], []
    for _ in range(n_train):
        kinds = [rng.choice(KINDS)] if rng.random() < 0.4 else sorted(rng.choice(train_pairs))
        train.append(make_prompt(rng, rng.choice(TRAIN_TOPICS), kinds))
    for i in range(n_eval):
        kinds = [KINDS[i % len(KINDS)]] if i % 2 == 0 else sorted(rng.choice(held if i % 4 == 1 else train_pairs))
        evals.append(make_prompt(rng, rng.choice(EVAL_TOPICS), kinds))
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", evals)):
        tmp = os.path.join(out_dir, f".{name}.tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(tmp, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "task.json"), "w") as f:
        json.dump({"task": "ifeval", "seed": seed, "n_train": n_train, "n_eval": n_eval,
                   "held_out_pairs": sorted(sorted(p) for p in HELD_OUT_PAIRS), "eval_topics": EVAL_TOPICS}, f,
                  indent=2)
    return out_dir


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="data/ifeval", help="where train.jsonl, eval.jsonl and task.json go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n_train", type=int, default=512)
    p.add_argument("--n_eval", type=int, default=256)
    a = p.parse_args(argv)
    if a.n_train < 1 or a.n_eval < 1 or not 0 <= a.seed < 2 ** 63:
        p.exit(2, "error: --n_train and --n_eval must be >= 1 and --seed in [0, 2**63)\n")
    print(write_prompts(a.out_dir, a.seed, a.n_train, a.n_eval))


if __name__ == "__main__":
    main()
