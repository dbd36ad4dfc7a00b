"""Verifiable instruction following: prompts that carry constraints code can check, and the checker as an ordinary
reward function, for aligning a real chat model on something a user recognises.

    python -m nano_rlhf.tasks.ifeval --out_dir data/ifeval         # train.jsonl, eval.jsonl (held out), task.json
    python train_ppo.py --init MODEL --prompts data/ifeval/train.jsonl --advantage grpo \\
        --reward nano_rlhf.tasks.ifeval:reward ...
    python -m nano_rlhf.label --judge nano_rlhf.tasks.ifeval:reward ...                  # self-sampled pairs for DPO
    python -m nano_rlhf.evaluate --model OUT --prompts data/ifeval/eval.jsonl --reward nano_rlhf.tasks.ifeval:strict
    python -m nano_rlhf.tasks.ifeval --report START.jsonl OUT.jsonl [...]   # per kind, loose, equal length, paired
    python -m nano_rlhf.tasks.ifeval --out_dir data/ifeval_held --seed 1 --n_eval 480 --held_out_kinds_only
        # a larger test of the held-out kinds alone (80 prompts each), from another seed's draws

The constraints (CONSTRAINTS) are our own wording of Google's IFEval instruction classes (Zhou et al. 2023: length,
keywords, case, start/end, punctuation, format, content, combination; language detection left out: it needs a
detector model) plus HELD_OUT kinds in the spirit of IFBench (Pyatkin et al. 2025) that no training prompt ever
carries. Each kind is stated by several phrasings; its last phrasing is kept for evaluation. The checker reads the
constraints back from the prompt text alone (`parse`), so it is a reward(prompts, completions) like any other.

`reward` is the share of a prompt's constraints met (the partial credit IFBench's RLVR uses; a dense signal for
RL); `strict` is 1 only when all are (IFEval's prompt-level strict accuracy); `loose` is IFEval's loose variant
(the answer also counts when it meets them with its first or last line dropped or markdown asterisks removed). A
malformed answer scores 0, never an error; a prompt with no constraint this module wrote scores 0.

Prompt sources: a request (a task family applied to a topic) with one to three compatible constraints. The
evaluation file uses task families, topics and phrasings training never saw; a third of its prompts carry a
HELD_OUT kind (see `write_prompts`), or every one with --held_out_kinds_only.
"""
import argparse
import json
import math
import os
import random
import re
from dataclasses import dataclass
from typing import Callable

from ..chat import final_turn
from .common import mean_se, prompt_text

# ---- the constraints ------------------------------------------------------------------------------------------

_SLOT = {"n": r"\d{1,4}", "m": r"\d{1,4}", "word": r"[A-Za-z][A-Za-z'-]*", "word2": r"[A-Za-z][A-Za-z'-]*",
         "phrase": r"[^\"\n]{1,60}", "letter": r"[a-z]"}


@dataclass(frozen=True)
class Kind:
    name: str
    phrasings: tuple          # templates: {n} {m} a number, {word} {word2} a word, {phrase} text, {letter}
    sample: Callable          # rng -> {slot: value}
    check: Callable           # (answer, args) -> bool; args also holds "request" (the prompt minus constraints)
    tags: frozenset = frozenset()     # two kinds sharing a tag contradict each other (never in one prompt)
    held_out: bool = False    # never in a training prompt


def _words(t):
    return re.findall(r"\b\w[\w'-]*\b", t)


def _sentences(t):
    return [s for s in re.split(r"(?<=[.!?])\s+", t.strip()) if re.search(r"\w", s)]


def _paragraphs(t, sep):
    parts = re.split(r"\n\s*\*\*\*\s*\n" if sep == "***" else r"\n\s*\n", t.strip())
    return [p for p in parts if p.strip()]


def _json(t):
    s = t.strip()
    fence = re.fullmatch(r"```(?:json|JSON)?\s*(.*?)\s*```", s, re.S)
    try:
        json.loads(fence.group(1) if fence else s)
        return True
    except (ValueError, RecursionError):
        return False


def _bullets(t):
    return sum(1 for line in t.splitlines() if re.match(r"\s*[*-] \S", line))


def _numbered(t):
    return [int(m.group(1)) for line in t.splitlines() if (m := re.match(r"\s*(\d+)[.)] \S", line))]


def _count_word(t, w):
    return len(re.findall(r"\b" + re.escape(w) + r"\b", t, re.I))


WORDS = ["bright", "gentle", "harbor", "silver", "journey", "simple", "window", "garden", "promise", "balance",
         "future", "careful", "energy", "quiet", "history", "signal", "market", "ladder", "shadow", "courage"]
PHRASES = ["Is there anything else I can help with?", "That is all.", "Thank you for reading.", "The end.",
           "Let me know what you think.", "Have a nice day."]
OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


def _k(name, phrasings, sample, check, tags=(), held_out=False):
    return Kind(name, tuple(phrasings), sample, check, frozenset(tags), held_out)


CONSTRAINTS = [
    # length
    _k("max_words", ["Answer in at most {n} words.", "Keep your response under {n} words.",
                     "Use no more than {n} words in total.", "Your reply must not exceed {n} words."],
       lambda r: {"n": r.choice([25, 40, 60, 80, 100])}, lambda t, a: 0 < len(_words(t)) <= a["n"], ["length"]),
    _k("min_words", ["Write at least {n} words.", "Your response should contain {n} words or more.",
                     "Make the answer no shorter than {n} words.", "Use a minimum of {n} words."],
       lambda r: {"n": r.choice([60, 80, 100, 150])}, lambda t, a: len(_words(t)) >= a["n"], ["length"]),
    _k("max_sentences", ["Answer in at most {n} sentences.", "Use no more than {n} sentences.",
                         "Keep it to {n} sentences or fewer."],
       lambda r: {"n": r.choice([2, 3, 4, 5])}, lambda t, a: 0 < len(_sentences(t)) <= a["n"], ["length"]),
    _k("paragraphs", ["Write exactly {n} paragraphs, separated by blank lines.",
                      "Your answer must have {n} paragraphs with an empty line between them.",
                      "Organise the answer into {n} paragraphs, one blank line between each."],
       lambda r: {"n": r.choice([2, 3, 4])}, lambda t, a: len(_paragraphs(t, "")) == a["n"], ["layout"]),
    _k("paragraphs_divider", ["There should be {n} paragraphs, separated by the markdown divider ***.",
                              "Write {n} paragraphs and put a line with *** between them.",
                              "Split your response into {n} paragraphs using *** on its own line as the separator."],
       lambda r: {"n": r.choice([2, 3, 4])}, lambda t, a: len(_paragraphs(t, "***")) == a["n"], ["layout"]),
    # keywords
    _k("include", ['Include the word "{word}" in your response.', 'Make sure to use the word "{word}".',
                   'Your answer must mention the word "{word}".', 'Work the word "{word}" into your reply.'],
       lambda r: {"word": r.choice(WORDS)}, lambda t, a: _count_word(t, a["word"]) > 0),
    _k("include_two", ['Include the keywords "{word}" and "{word2}".', 'Use both words "{word}" and "{word2}".',
                       'Your answer must contain the words "{word}" and "{word2}".'],
       lambda r: dict(zip(("word", "word2"), r.sample(WORDS, 2))),
       lambda t, a: _count_word(t, a["word"]) > 0 and _count_word(t, a["word2"]) > 0),
    _k("exclude", ['Do not use the word "{word}".', 'Avoid the word "{word}" entirely.',
                   'The word "{word}" must not appear in your answer.'],
       lambda r: {"word": r.choice(["the", "and", "very", "is", "it"])}, lambda t, a: _count_word(t, a["word"]) == 0
       and bool(_words(t))),
    _k("word_frequency", ['Use the word "{word}" at least {n} times.', 'The word "{word}" should appear {n} times '
                          'or more.', 'Repeat the word "{word}" at least {n} times in your answer.'],
       lambda r: {"word": r.choice(WORDS), "n": r.choice([2, 3])}, lambda t, a: _count_word(t, a["word"]) >= a["n"]),
    _k("letter_frequency", ['The letter "{letter}" should appear at least {n} times.',
                            'Use the letter "{letter}" {n} times or more.',
                            'Make sure the letter "{letter}" occurs at least {n} times in your response.'],
       lambda r: {"letter": r.choice("zqxjkvwy"), "n": r.choice([3, 5, 8])},
       lambda t, a: t.lower().count(a["letter"]) >= a["n"]),
    # case
    _k("lowercase", ["Use only lowercase letters.", "Write your entire answer in lowercase, no capital letters.",
                     "Do not use any capital letters.", "Your whole response must be in lowercase letters."],
       lambda r: {}, lambda t, a: any(c.isalpha() for c in t) and t == t.lower(), ["case"]),
    _k("uppercase", ["Write your entire answer in capital letters.", "Respond only in uppercase letters.",
                     "Use all capital letters for your whole response.", "YOUR ENTIRE RESPONSE MUST BE IN CAPITALS."],
       lambda r: {}, lambda t, a: any(c.isalpha() for c in t) and t == t.upper(), ["case"]),
    _k("capital_words", ["Use at least {n} words written entirely in capital letters.",
                         "Include {n} or more words in ALL CAPS.", "Stress at least {n} words by writing them in "
                         "all capital letters."],
       lambda r: {"n": r.choice([2, 3, 5])},
       lambda t, a: sum(1 for w in _words(t) if len(w) > 1 and w.isupper()) >= a["n"], ["case"]),
    # start and end
    _k("end_with", ['End your answer with the exact phrase "{phrase}".', 'Finish your response with "{phrase}".',
                    'The last words of your reply must be "{phrase}".', 'Close with the exact sentence "{phrase}".'],
       lambda r: {"phrase": r.choice(PHRASES)}, lambda t, a: t.strip().endswith(a["phrase"]), ["end"]),
    _k("quotation", ["Wrap your entire response in double quotation marks.",
                     "Put your whole answer inside double quotes.", "Enclose the entire reply in quotation marks."],
       lambda r: {}, lambda t, a: len(t.strip()) > 2 and t.strip()[0] == t.strip()[-1] == '"', ["start", "end"]),
    # punctuation
    _k("no_comma", ["Do not use any commas in your response.", "Avoid commas entirely.",
                    "Your answer must not contain a single comma."],
       lambda r: {}, lambda t, a: "," not in t and bool(_words(t))),
    # format
    _k("json", ["Wrap your entire output in JSON format.", "Answer with valid JSON only.",
                "Give the whole response as a JSON object.", "Format everything you write as JSON."],
       lambda r: {}, lambda t, a: _json(t), ["layout", "start", "end", "case"]),
    _k("bullets", ['Answer with exactly {n} bullet points, using markdown like "* point".',
                   "Use exactly {n} bullet points in your answer.", "Your response must be a list of exactly {n} "
                   "markdown bullet points.", "Give precisely {n} bullet points."],
       lambda r: {"n": r.choice([2, 3, 4, 5])}, lambda t, a: _bullets(t) == a["n"], ["layout"]),
    _k("title", ["Give your answer a title wrapped in double angular brackets, such as <<my title>>.",
                 "Start with a title in double angle brackets, like <<title>>.",
                 "Include a title formatted as <<title>>."],
       lambda r: {}, lambda t, a: re.search(r"<<[^\n<>]+>>", t) is not None, ["start"]),
    _k("highlight", ["Highlight at least {n} sections with markdown, i.e. *highlighted section*.",
                     "Mark at least {n} parts of your answer in italics like *this*.",
                     "Emphasise {n} or more phrases using *asterisks*."],
       lambda r: {"n": r.choice([1, 2, 3])},
       lambda t, a: len([h for h in re.findall(r"\*[^\n*]+\*", t) if h.strip("* ")]) >= a["n"]),
    _k("sections", ["Your response must have {n} sections. Mark the beginning of each section with SECTION X.",
                    "Divide the answer into {n} sections, each starting with SECTION X (X its number).",
                    "Use {n} sections, labelled SECTION 1, SECTION 2 and so on."],
       lambda r: {"n": r.choice([2, 3])}, lambda t, a: len(re.findall(r"\bSECTION\s+\d+", t)) >= a["n"], ["layout"]),
    _k("options", ["Answer with one of the following options: (\"My answer is yes.\", \"My answer is no.\", "
                   "\"My answer is maybe.\")",
                   "Reply only with one of: \"My answer is yes.\", \"My answer is no.\" or \"My answer is maybe.\"",
                   "Choose your reply from exactly these: \"My answer is yes.\" / \"My answer is no.\" / "
                   "\"My answer is maybe.\""],
       lambda r: {}, lambda t, a: t.strip() in OPTIONS),
    # content
    _k("postscript", ["At the end of your response, add a postscript starting with P.S.",
                      "Finish with a postscript that begins with P.S.", "Add a P.S. at the very end."],
       lambda r: {}, lambda t, a: re.search(r"(?:^|\n)\s*P\.\s?S\.", t) is not None, ["end"]),
    _k("placeholders", ["Include at least {n} placeholders in square brackets, such as [address].",
                        "Use {n} or more placeholders like [name] in your answer.",
                        "The response must contain at least {n} placeholders written in square brackets, e.g. "
                        "[date]."],
       lambda r: {"n": r.choice([1, 2, 3])}, lambda t, a: len(re.findall(r"\[[^\[\]\n]+\]", t)) >= a["n"]),
    # combination
    _k("repeat_request", ["First repeat the request word for word without change, then give your answer (do not "
                          "say anything before repeating the request; do not repeat this sentence).",
                          "Begin by copying the request exactly as written, then answer it (leave this sentence "
                          "out of the copy).",
                          "Start your reply with the request repeated word for word, then answer (without "
                          "repeating this instruction)."],
       lambda r: {}, lambda t, a: bool(a["request"]) and t.strip().startswith(a["request"]),
       ["start", "layout", "case"]),
    _k("two_responses", ["Give two different responses, separated by 6 asterisks: ******.",
                         "Write two different answers and put ****** between them.",
                         "Provide two distinct responses separated by a line of six asterisks (******)."],
       lambda r: {}, lambda t, a: len(parts := [p.strip() for p in t.split("******")]) == 2 and all(parts)
       and parts[0] != parts[1], ["layout", "start", "end"]),
    # held out: kinds in the spirit of IFBench, never in a training prompt
    _k("start_with", ['Begin your answer with the word "{word}".', 'The first word of your response must be "{word}".'],
       lambda r: {"word": r.choice(["Honestly", "Imagine", "Today", "Surprisingly", "Well"])},
       lambda t, a: bool(_words(t)) and _words(t)[0].lower() == a["word"].lower(), ["start"], True),
    _k("no_digits", ["Do not use any digits in your answer.", "Write numbers as words: no digits at all."],
       lambda r: {}, lambda t, a: bool(_words(t)) and not re.search(r"\d", t), (), True),
    _k("word_range", ["Your answer must have between {n} and {m} words.", "Use {n} to {m} words."],
       lambda r: dict(zip(("n", "m"), r.choice([(20, 40), (30, 60), (50, 90)]))),
       lambda t, a: a["n"] <= len(_words(t)) <= a["m"], ["length"], True),
    _k("numbered_list", ["Answer as a numbered list with exactly {n} items (1., 2., ...).",
                         "Give exactly {n} numbered points, written 1. 2. 3. and so on."],
       lambda r: {"n": r.choice([3, 4, 5])}, lambda t, a: _numbered(t) == list(range(1, a["n"] + 1)), ["layout"],
       True),
    _k("end_question", ["End your answer with a question.", "The last sentence of your reply must be a question."],
       lambda r: {}, lambda t, a: t.strip().endswith("?"), ["end"], True),
    _k("hashtags", ["Include exactly {n} hashtags, like #topic.", "Use {n} hashtags (words starting with #)."],
       lambda r: {"n": r.choice([2, 3])}, lambda t, a: len(re.findall(r"(?:^|\s)#\w+", t)) == a["n"], (), True),
]
BY_NAME = {k.name: k for k in CONSTRAINTS}
TRAIN_KINDS = [k.name for k in CONSTRAINTS if not k.held_out]
HELD_OUT = [k.name for k in CONSTRAINTS if k.held_out]


def _regex(template):
    """A phrasing's template as a regex with one named group per slot."""
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", template):
        out += [re.escape(template[pos:m.start()]), f"(?P<{m.group(1)}>{_SLOT[m.group(1)]})"]
        pos = m.end()
    return re.compile("".join(out + [re.escape(template[pos:])]))


_PATTERNS = [(k, i, _regex(p)) for k in CONSTRAINTS for i, p in enumerate(k.phrasings)]


def sentence(kind, args, phrasing=0):
    """The sentence that states a constraint (parse reads it back)."""
    return BY_NAME[kind].phrasings[phrasing].format(**args)


def parse(prompt):
    """[(kind, args), ...] of the constraints stated in a prompt, in the order they appear. args holds the slots
    (numbers as int) and "request": the prompt text with every constraint sentence removed."""
    text = prompt_text(prompt)
    found, taken = [], []
    for kind, _, pat in _PATTERNS:
        for m in pat.finditer(text):
            if not any(m.start() < e and s < m.end() for s, e in taken):    # one sentence states one constraint
                taken.append((m.start(), m.end()))
                args = {s: int(v) if s in ("n", "m") else v for s, v in m.groupdict().items()}
                found.append((m.start(), kind.name, args))
    request = text
    for s, e in sorted(taken, reverse=True):
        request = request[:s] + request[e:]
    request = re.sub(r"\s+", " ", request).strip()
    return [(name, {**args, "request": request}) for _, name, args in sorted(found, key=lambda f: f[0])]


def check(kind, args, text):
    """Whether `text` meets one constraint (never raises: a malformed answer does not)."""
    if not isinstance(text, str):
        return False
    try:
        return bool(BY_NAME[kind].check(text, {"request": "", **args}))
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return False


def _loose_variants(text):
    """IFEval's loose reading: the answer, without its first line, without its last line, without both, each
    also with markdown asterisks removed."""
    lines = text.split("\n")
    base = [text, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return base + [b.replace("*", "") for b in base]


def _met(prompt, completion, loose=False):
    cons = parse(prompt)
    completion = final_turn(completion)     # a tool-use transcript: the policy's final assistant turn only
    texts = _loose_variants(completion) if loose and isinstance(completion, str) else [completion]
    return [(kind, any(check(kind, args, t) for t in texts if t)) for kind, args in cons]


def reward(prompts, completions):
    """Share of each prompt's constraints the completion meets, in [0, 1] (0 for a prompt without any)."""
    return [sum(m for _, m in met) / len(met) if met else 0.0 for met in map(_met, prompts, completions)]


def strict(prompts, completions):
    """1.0 when a completion meets every constraint of its prompt, else 0.0 (IFEval's prompt-level strict)."""
    return [float(bool(met) and all(m for _, m in met)) for met in map(_met, prompts, completions)]


def loose(prompts, completions):
    """IFEval's prompt-level loose accuracy (see _loose_variants)."""
    return [float(bool(met) and all(m for _, m in met))
            for met in (_met(p, c, loose=True) for p, c in zip(prompts, completions))]


# ---- prompt files ---------------------------------------------------------------------------------------------

# Requests: a task family applied to a topic. The last FAMILIES_HELD_OUT families and TOPICS_HELD_OUT topics are
# evaluation only, so the held-out file's requests come from sources training never saw.
FAMILIES = ["Write a short essay about {}.", "Write a blog post about {}.", "Explain {} to a ten-year-old.",
            "Write a short story involving {}.", "Write an email to a friend about {}.", "Give some advice about {}.",
            "Write a poem about {}.", "Describe {}.", "What do you think about {}?", "Write a product description "
            "for something related to {}.", "Write a diary entry about {}.", "Give me some facts about {}.",
            "Write a social media post about {}.", "Write a short speech about {}.",
            # held out
            "Write a letter to a newspaper editor about {}.", "Write a review of {}.",
            "Summarize the pros and cons of {}.", "Write a job advertisement connected to {}.",
            "Write a riddle about {}."]
FAMILIES_HELD_OUT = 5
TOPICS = ["the ocean", "coffee", "a rainy day", "learning to ride a bike", "the moon", "a city at night",
          "winter mornings", "public libraries", "electric cars", "a favourite meal", "mountain hiking", "cats",
          "a school trip", "time management", "recycling", "the history of bread", "video games", "gardening",
          "a long train journey", "friendship", "solar power", "the first day at a new job", "street music",
          "a desert", "bees", "rivers", "chess", "birthday parties", "the internet", "autumn leaves",
          "running a marathon", "a small bakery", "space travel", "learning a language", "old photographs",
          "a farmers market", "remote work", "the rainforest", "bicycles", "a family dinner",
          # held out
          "volcanoes", "a lighthouse", "board games", "tea", "the circus", "snow", "museums", "penguins",
          "thunderstorms", "a village festival", "robots", "the postal service"]
TOPICS_HELD_OUT = 12


# pairs that contradict each other without sharing a tag (a phrase in mixed case in an all-lowercase answer, ...)
CONFLICTS = {frozenset(p) for p in [("lowercase", "end_with"), ("lowercase", "postscript"), ("lowercase", "sections"),
                                    ("uppercase", "end_with"), ("exclude", "repeat_request"),
                                    ("no_digits", "sections"), ("no_digits", "numbered_list")]}


def _compatible(kinds):
    """No two kinds share a tag or form a CONFLICTS pair, and "options" (the whole answer fixed) stands alone."""
    if "options" in kinds and len(kinds) > 1:
        return False
    return all(not (BY_NAME[a].tags & BY_NAME[b].tags) and frozenset((a, b)) not in CONFLICTS
               for i, a in enumerate(kinds) for b in kinds[i + 1:])


def make_prompt(rng, family, topic, kinds, phrasings):
    """One prompt row: the request, then one sentence per constraint (a phrasing drawn from `phrasings(kind)`)."""
    parts = [family.format(topic)]
    for k in kinds:
        parts.append(sentence(k, BY_NAME[k].sample(rng), rng.choice(phrasings(k))))
    return {"prompt": [{"role": "user", "content": " ".join(parts)}]}


def _draw_kinds(rng, pool, first=None):
    n = rng.choices([1, 2, 3], weights=[0.4, 0.4, 0.2])[0]
    kinds = [first] if first else []
    for _ in range(100):            # a kind that stands alone ("options") ends the draw early
        if len(kinds) >= n:
            break
        k = rng.choice(pool)
        if k not in kinds and _compatible(kinds + [k]):
            kinds.append(k)
    return kinds


def write_prompts(out_dir, seed=0, n_train=2048, n_eval=600, held_out_kinds_only=False):
    """train.jsonl and eval.jsonl (see the module docstring) and task.json; byte-identical at a seed.

    train: training families x training topics, one to three training kinds, each stated by any of its phrasings
    but the last. eval: held-out families x held-out topics; two thirds carry training kinds only (each stated by
    any phrasing, the unseen last one included), one third a held-out kind first (plus training kinds); with
    `held_out_kinds_only` every eval prompt has a held-out kind first, the kinds in turn (the train file is the
    same either way: it is drawn first)."""
    rng = random.Random(seed)
    fam_train, fam_eval = FAMILIES[:-FAMILIES_HELD_OUT], FAMILIES[-FAMILIES_HELD_OUT:]
    top_train, top_eval = TOPICS[:-TOPICS_HELD_OUT], TOPICS[-TOPICS_HELD_OUT:]
    train_phr = lambda k: range(max(1, len(BY_NAME[k].phrasings) - 1))
    all_phr = lambda k: range(len(BY_NAME[k].phrasings))
    train = [make_prompt(rng, rng.choice(fam_train), rng.choice(top_train), _draw_kinds(rng, TRAIN_KINDS), train_phr)
             for _ in range(n_train)]
    evals = []
    for i in range(n_eval):
        if held_out_kinds_only:
            first = HELD_OUT[i % len(HELD_OUT)]
        else:
            first = HELD_OUT[(i // 3) % len(HELD_OUT)] if i % 3 == 2 else None
        evals.append(make_prompt(rng, rng.choice(fam_eval), rng.choice(top_eval),
                                 _draw_kinds(rng, TRAIN_KINDS, first), all_phr))
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", evals)):
        tmp = os.path.join(out_dir, f".{name}.tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(tmp, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "task.json"), "w") as f:
        json.dump({"task": "ifeval", "seed": seed, "n_train": n_train, "n_eval": n_eval,
                   "held_out_kinds_only": held_out_kinds_only, "train_kinds": TRAIN_KINDS,
                   "held_out_kinds": HELD_OUT, "held_out_families": fam_eval, "held_out_topics": top_eval}, f,
                  indent=2)
    return out_dir


# ---- the report -----------------------------------------------------------------------------------------------

def _se(p, n):
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def repetitive(text, n=3):
    """A degenerate answer: at least 30 words of which fewer than half of the word n-grams are distinct (a loop);
    the check that general ability did not collapse into repetition."""
    w = _words(text.lower()) if isinstance(text, str) else []
    grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    return len(w) >= 30 and len(set(grams)) < 0.5 * len(grams)


def _groups(rows):
    held = [any(k in HELD_OUT for k, _ in parse(r["prompt"])) for r in rows]
    return {"all": list(range(len(rows))), "seen_kinds": [i for i, h in enumerate(held) if not h],
            "held_out_kinds": [i for i, h in enumerate(held) if h]}


def paired(base_path, path):
    """Prompt-level strict accuracy of `path` minus that of `base_path`, paired over the same prompts (two evaluate
    files of one prompt file, row for row): per group (all, training kinds only, a held-out kind) the mean of the
    per-prompt differences (each -1, 0 or 1), its standard error (their sample standard deviation / sqrt(n): the
    prompts both models solve or both fail add no noise, as they would to two unpaired standard errors), and the
    per-prompt differences themselves (to average over seeds before taking the error). ValueError when the two
    files do not hold the same prompts in the same order."""
    base, rows = ([json.loads(line) for line in open(f, encoding="utf-8") if line.strip()] for f in (base_path, path))
    if [r["prompt"] for r in base] != [r["prompt"] for r in rows]:
        raise ValueError(f"{path} and {base_path} do not hold the same prompts in the same order")
    a = strict([r["prompt"] for r in base], [r["completion"] for r in base])
    b = strict([r["prompt"] for r in rows], [r["completion"] for r in rows])
    return {g: differences([b[i] - a[i] for i in idx]) for g, idx in _groups(rows).items()}


def differences(diffs):
    """{"diff": mean, "se": its standard error, "n", "diffs"} of per-prompt differences (NaN when there are none)."""
    m, se = mean_se(diffs) if diffs else (float("nan"), float("nan"))
    return {"diff": m, "se": se, "n": len(diffs), "diffs": diffs}


def report(samples_path):
    """Figures of one evaluate samples file (its rows: prompt, completion, and `length`/`eos` when evaluate
    wrote them): prompt-level strict and loose accuracy with standard errors, instruction-level strict, on the
    prompts with training kinds only and on those with a held-out kind, per kind, mean length, the share of
    answers that never ended and the share that are `repetitive`."""
    rows = [json.loads(line) for line in open(samples_path, encoding="utf-8") if line.strip()]
    out = {"n": len(rows)}
    for g, idx in _groups(rows).items():
        rs = [rows[i] for i in idx]
        s = strict([r["prompt"] for r in rs], [r["completion"] for r in rs])
        lo = loose([r["prompt"] for r in rs], [r["completion"] for r in rs])
        inst = [m for r in rs for _, m in _met(r["prompt"], r["completion"])]
        p = sum(s) / len(s) if s else float("nan")
        out[g] = {"n": len(rs), "strict": p, "strict_se": _se(p, len(s)),
                  "loose": sum(lo) / len(lo) if lo else float("nan"),
                  "instruction_strict": sum(inst) / len(inst) if inst else float("nan")}
    per_kind = {}
    for r in rows:
        for kind, m in _met(r["prompt"], r["completion"]):
            per_kind.setdefault(kind, []).append(m)
    out["per_kind"] = {k: {"n": len(v), "met": sum(v) / len(v)} for k, v in sorted(per_kind.items())}
    out["repetitive"] = sum(map(repetitive, (r["completion"] for r in rows))) / len(rows) if rows else float("nan")
    lengths = [r.get("length", len(_words(r["completion"]))) for r in rows]
    out["mean_length"] = sum(lengths) / len(lengths) if lengths else float("nan")
    if rows and all("eos" in r for r in rows):
        out["never_ended"] = sum(1 for r in rows if not r["eos"]) / len(rows)
    return out


def equal_length(paths, bins=4):
    """Prompt-level strict accuracy of several samples files at equal answer length: the answers of all files
    are cut into `bins` length bins at the pooled quantiles, and each file's accuracy within a bin is weighted
    by the bin's pooled share (direct standardisation), so a model is not credited for answering shorter or
    longer than another. Bins some file has no answer in are left out (their pooled share is returned)."""
    rows = {p: [json.loads(line) for line in open(p, encoding="utf-8") if line.strip()] for p in paths}
    pooled = sorted(r.get("length", len(_words(r["completion"]))) for rs in rows.values() for r in rs)
    edges = sorted({pooled[max(0, math.ceil(len(pooled) * q / bins) - 1)] for q in range(1, bins)})   # ties merge
    bins = len(edges) + 1
    def bin_of(r):
        return sum(r.get("length", len(_words(r["completion"]))) > e for e in edges)
    acc = {p: {} for p in paths}
    for p, rs in rows.items():
        for b in range(bins):
            inside = [r for r in rs if bin_of(r) == b]
            if inside:
                acc[p][b] = sum(strict([r["prompt"] for r in inside], [r["completion"] for r in inside])) / len(inside)
    kept = [b for b in range(bins) if all(b in acc[p] for p in paths)]
    share = {b: sum(1 for rs in rows.values() for r in rs if bin_of(r) == b) / len(pooled) for b in range(bins)}
    total = sum(share[b] for b in kept)
    return {"edges": edges, "dropped_share": 1 - total,
            "strict": {p: sum(share[b] * acc[p][b] for b in kept) / total if total else float("nan") for p in paths}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="data/ifeval", help="where train.jsonl, eval.jsonl and task.json go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n_train", type=int, default=2048)
    p.add_argument("--n_eval", type=int, default=600)
    p.add_argument("--report", nargs="+", metavar="SAMPLES", help="print the figures of evaluate's samples files "
                   "(per kind, loose, held-out kinds; with several, equal length and each paired with the first) "
                   "instead of writing prompts")
    p.add_argument("--held_out_kinds_only", action="store_true", help="every eval prompt carries a held-out kind "
                   "(the kinds in turn), for a larger test of transfer to kinds training never saw")
    a = p.parse_args(argv)
    if a.report:
        for path in a.report:
            if not os.path.isfile(path):
                p.exit(2, f"error: --report {path}: no such file\n")
        out = {path: report(path) for path in a.report}
        if len(a.report) > 1:
            out["equal_length"] = equal_length(a.report)
            try:    # each later file against the first (the start), prompt by prompt
                out["paired"] = {path: {g: {k: v for k, v in d.items() if k != "diffs"}
                                        for g, d in paired(a.report[0], path).items()} for path in a.report[1:]}
            except ValueError as e:
                p.exit(2, f"error: --report: {e}\n")
        print(json.dumps(out, indent=2))
        return
    if a.n_train < 1 or a.n_eval < 1 or not 0 <= a.seed < 2 ** 63:
        p.exit(2, "error: --n_train and --n_eval must be >= 1 and --seed in [0, 2**63)\n")
    print(write_prompts(a.out_dir, a.seed, a.n_train, a.n_eval, a.held_out_kinds_only))


if __name__ == "__main__":
    main()
