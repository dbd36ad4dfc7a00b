"""What every task shares, and the protocol a task implements.

A task is a module of nano_rlhf/tasks/ that writes its data files and scores completions, runnable as
`python -m nano_rlhf.tasks.NAME --out_dir DIR` (synthetic: the built-in reviews; reasoning: arithmetic with a
verifier; ifeval: verifiable instructions for a real model). It defines:

    make_prompt(...)               one prompt of the task, in one of its phrasings (PHRASINGS, some held out)
    write_dataset(out_dir, seed)   the JSONL files the training scripts read (nano_rlhf/data.py's kinds)
    reward(prompts, completions)   a list of floats, called as any reward is (--reward nano_rlhf.tasks.NAME:reward;
                                   the built-in task's gold reward is reward.gold, the core's one door to it)

A task imports only chat (the templates' text), cli (its command line) and this module: it knows no model, no
tokenizer and no training.
"""
import math


def prompt_text(prompt):
    """The text a task reads: a string prompt, or the last user message of a conversation."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return users[-1] if users and isinstance(users[-1], str) else ""
    return ""


def mean_se(xs):
    """The mean of xs and its standard error (sample standard deviation / √n; 0 for one value)."""
    n = len(xs)
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, math.sqrt(var / n)
