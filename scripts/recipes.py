"""A second task, not built in, for checking that a method's defaults hold beyond the built-in reviews: name the
ingredients of a dish. Answers differ in content and in length (a dish has 2 to 6 ingredients, so the best answer
runs from 4 to 13 words), the prompts are questions, not review requests, and the reward model is trained here
on this task's pairs only, so its blind spots are its own.

    python scripts/recipes.py OUT_DIR          # writes sft, preference, prompts files (+ _eval splits) under OUT_DIR
    python -m nano_rlhf.evaluate --model M --prompts OUT_DIR/eval_prompts.jsonl --reward scripts/recipes.py:reward

Prompt:      "What goes into a pancake?\\nAnswer:"     (10 phrasings; 3 are held out for evaluation)
Completion:  " You need flour, eggs and milk."

Gold reward (`score`): +1 per ingredient of the dish named (each once), −1 per ingredient of another dish,
−0.5 per repeated mention, +0.5 for a final period (−0.5 without), −2 for fewer than 3 words, −0.25 per word
beyond 4 + 2 × the dish's ingredient count. The best answer scores the dish's ingredient count + 0.5.

SFT demonstrations are of mixed quality (some ingredients missing, a wrong one, a repeat, a filler sentence);
preference pairs are two such answers labelled by Bradley–Terry on the gold reward, P(a ≻ b) = σ(g_a − g_b), as
the built-in task labels its own (nano_rlhf/tasks/synthetic.py). Nothing here is imported by the package or the tests.
"""
import json
import math
import os
import random
import re
import sys

DISHES = {
    "pancake": ["flour", "eggs", "milk"], "omelette": ["eggs", "butter"], "guacamole": ["avocado", "lime", "salt",
    "onion"], "pesto": ["basil", "garlic", "cheese", "oil", "pine nuts"], "lemonade": ["lemons", "sugar", "water"],
    "salsa": ["tomatoes", "onion", "chili", "lime", "salt"], "hummus": ["chickpeas", "tahini", "lemon", "garlic"],
    "risotto": ["rice", "stock", "butter", "cheese", "onion", "wine"], "toast": ["bread", "butter"],
    "smoothie": ["banana", "milk", "honey"], "porridge": ["oats", "milk", "salt"], "pizza": ["dough", "tomatoes",
    "cheese", "basil"], "soup": ["stock", "carrots", "onion", "celery"], "cookies": ["flour", "butter", "sugar",
    "eggs", "chocolate"], "salad": ["lettuce", "tomatoes", "cucumber", "oil"], "tea": ["leaves", "water"],
    "curry": ["rice", "chicken", "spices", "onion", "garlic", "ginger"], "bread": ["flour", "water", "yeast",
    "salt"], "custard": ["milk", "eggs", "sugar", "vanilla"], "fries": ["potatoes", "oil", "salt"],
}
INGREDIENTS = sorted({i for v in DISHES.values() for i in v})
PHRASINGS = ["What goes into a {}?", "Which ingredients does a {} need?", "What do I need to make a {}?",
             "Name the ingredients of a {}.", "List what is in a {}.", "How is a {} made? Name its ingredients.",
             "Tell me the ingredients for a {}.",
             # held out: only in eval_prompts
             "I want to cook a {}. What should I buy?", "Ingredients of a {}, please.", "What is a {} made of?"]
HELD_OUT = 7
FILLERS = ["It is easy to make.", "Everyone likes it.", "It takes ten minutes.", "Serve it warm."]


def make_prompt(dish, phrasing):
    return PHRASINGS[phrasing].format(dish) + "\nAnswer:"


def parse_dish(prompt):
    return next((d for d in DISHES if re.search(rf"\b{d}\b", prompt)), None)


def score(prompt, completion):
    """The gold reward of one answer (see the module's docstring)."""
    dish = parse_dish(prompt)
    words = re.findall(r"[a-z]+", completion.lower())
    text = " " + " ".join(words) + " "
    own = DISHES.get(dish, [])
    r = 0.0
    for ing in INGREDIENTS:
        n = text.count(f" {ing} ")
        if n:
            r += 1.0 if ing in own else -1.0
            r -= 0.5 * (n - 1)
    r += 0.5 if completion.strip().endswith(".") else -0.5
    if len(words) < 3:
        r -= 2.0
    r -= 0.25 * max(0, len(words) - (4 + 2 * len(own)))
    return r


def reward(prompts, completions):
    """module:function reward for nano_rlhf (evaluate --reward, train_ppo --reward, train_online --judge)."""
    return [score(p, c) for p, c in zip(prompts, completions)]


def join(items):
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def sample_answer(rng, dish):
    """An SFT-quality answer: a random subset of the ingredients, sometimes a wrong one or a repeat, a filler."""
    own = DISHES[dish]
    items = rng.sample(own, rng.randint(max(1, len(own) - 2), len(own)))
    if rng.random() < 0.3:
        items.insert(rng.randrange(len(items) + 1), rng.choice([i for i in INGREDIENTS if i not in own]))
    if rng.random() < 0.1:
        items.append(rng.choice(items))
    lead = rng.choice(["You need", "Use", "It needs", "Take", "A {} needs".format(dish)])
    out = f" {lead} {join(items)}"
    out += "." if rng.random() < 0.85 else ""
    if rng.random() < 0.25:
        out += " " + rng.choice(FILLERS)
    return out


def train_prompt(rng, dish=None):
    return make_prompt(dish or rng.choice(list(DISHES)), rng.randrange(HELD_OUT))


def write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv=None):
    out = (argv or sys.argv[1:] or ["data/recipes"])[0]
    os.makedirs(out, exist_ok=True)
    rng = random.Random(0)

    def sft(n):
        rows = []
        for _ in range(n):
            dish = rng.choice(list(DISHES))
            rows.append({"prompt": train_prompt(rng, dish), "completion": sample_answer(rng, dish)})
        return rows

    def pairs(n):
        rows = []
        while len(rows) < n:
            dish = rng.choice(list(DISHES))
            p = train_prompt(rng, dish)
            a, b = sample_answer(rng, dish), sample_answer(rng, dish)
            if a == b:
                continue
            pa = 1 / (1 + math.exp(-(score(p, a) - score(p, b))))
            chosen, rejected = (a, b) if rng.random() < pa else (b, a)
            rows.append({"prompt": p, "chosen": chosen, "rejected": rejected})
        return rows

    write(os.path.join(out, "sft.jsonl"), sft(8000))
    write(os.path.join(out, "sft_eval.jsonl"), sft(256))
    write(os.path.join(out, "preference.jsonl"), pairs(6000))
    write(os.path.join(out, "preference_eval.jsonl"), pairs(256))
    write(os.path.join(out, "prompts.jsonl"), [{"prompt": train_prompt(rng)} for _ in range(2000)])
    write(os.path.join(out, "eval_prompts.jsonl"),
          [{"prompt": make_prompt(d, ph)} for ph in range(HELD_OUT, len(PHRASINGS)) for d in DISHES] +
          [{"prompt": make_prompt(d, rng.randrange(HELD_OUT))} for d in DISHES for _ in range(4)])
    print(f"wrote {out}: sft 8000, preference 6000, prompts 2000, eval_prompts {3 * len(DISHES) + 4 * len(DISHES)}")


if __name__ == "__main__":
    main()
