"""RLAIF labelling: sample k responses per prompt from a model, score them with a judge, write training data.

    python -m nano_rlhf.label --model out/sft --judge out/rm --format pairs --out data/rlaif.jsonl
    python train_dpo.py --init out/sft --data data/rlaif.jsonl --out_dir out/dpo_rlaif       # the AI-feedback loop
    python -m nano_rlhf.label --model out/sft --judge llm:out/sft --format pairs --out self.jsonl   # self-rewarding
    python -m nano_rlhf.label --model out/sft --pair_judge my_judges.py:prefer --format listwise --out lw.jsonl
    python -m nano_rlhf.label --model out/sft --judge out/rm --format scored --out s.jsonl   # then:
    python train_unpaired.py --method dro --data s.jsonl --out_dir out/dro_rlaif               # (or --format unpaired)

The judge (nano_rlhf/reward.py): --judge gives one score per response (a reward-model directory, gold for the
built-in task, your module:function, or llm:MODEL_DIR, an LLM-as-a-judge answering --judge_template); with
--pair_judge module:function(prompts, a, b) -> P(a ≻ b), a response's score is instead its win rate against
the other k − 1 samples of its prompt (every ordered pair asked, position bias cancelled; SPO's reward).

Formats (TRL's; a conversational prompt keeps its messages and each response becomes [assistant message]):
  pairs     {"prompt", "chosen", "rejected", "score_chosen", "score_rejected"}: the best and the worst of each
            prompt's samples; a prompt whose samples all score the same gives no pair (counted)
  listwise  {"prompt", "completions": [...], "scores": [...]}: every sample of a prompt, in sampling order
  unpaired  {"prompt", "completion", "label"}: every sample; label = score >= --threshold, or without one,
            score above its group's median (samples exactly at the median carry no label and are left out)
  scored    {"prompt", "completion", "score"}: every sample with its judge score (k = 1 allowed)
pairs is train_dpo.py's preference data, listwise train_listwise.py's, unpaired KTO's and train_unpaired.py's
(dro reads a label as ±1; npo takes label-true rows as retain data with --retain_coef, d2o takes label-false
rows only), scored train_unpaired.py --method dro's. A row carries one signal, a label or a score, never both:
DRO refuses a row with both (which one to learn from would be a guess). Empty responses are left out (the data
loaders refuse empty text); responses cut at --max_new_tokens are kept (the judge sees them as they are).

With --tools (train_ppo.py's value) the conversational prompts offer the tools and a response may call them, up
to --max_turns assistant turns (nano_rlhf.sampling.sample_responses, as in training); the judge reads the
transcript (the built-in verifiers its final answer) and each response is written as messages — assistant turns
with their `tool_calls`, a `tool` message per result — in rows that list the tools (pairs and listwise only: their
responses may hold tool turns). A sample no row can hold (an answered malformed call, an empty turn) is left out.
Sampling is pure sampling at --temperature with one seeded generator over the prompts in file order, so a
seed (and --batch_size) fixes the output byte for byte. The file is written to OUT.tmpPID and renamed.
"""
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from . import chat, dist, reward as reward_mod
from .checkpoint import atomic_write_text
from .data import default_data
from .training import check_output_file, check_vocab, fail, input_errors, load_tokenizer
from .cli import parse_args
from .data import load_records, tokenize_prompts
from .reward import LLM, load_judge, preference_matrix
from .cli import ChatTemplate
from .training import Progress
from .rollout import sample_groups
from .sampling import SamplingOptions
from .tools import load_tools


@dataclass
class Options:
    model: str = "out/sft"        # policy directory to sample from (HF layout + tokenizer.json)
    prompts: str = ""             # prompts JSONL {"prompt": str or [messages]}; empty = the built-in task's prompts
    out: str = ""                 # output JSONL (required)
    format: Literal["pairs", "listwise", "unpaired", "scored"] = "pairs"  # the data kind to write (Formats, above)
    judge: str = ""               # pointwise judge: reward-model dir, gold, module:function or llm:MODEL_DIR
    pair_judge: str = ""          # pairwise judge module:function(prompts, a, b) -> P(a ≻ b); scores = win rates
    judge_template: str = ""      # --judge llm:MODEL_DIR: template with {prompt} and {response}; empty = the default
                                  # (1-10)
    samples_per_prompt: int = 4   # k responses per prompt {>= 1}
    temperature: float = 1.0      # sampling temperature (pure sampling) {> 0}
    max_new_tokens: int = 40      # response length limit (as train_ppo.py: a built-in prompt fits beside it) {>= 1}
    batch_size: int = 64          # sequences per generation batch and per judge batch {>= 1}
    threshold: Optional[float] = None  # unpaired: label = score >= this; none = above the group's median
                                       # [with format=unpaired]
    max_prompts: int = 0          # label only the first N prompts; 0 = all {>= 0}
    seed: int = 0                 # sampling seed
    chat_template: ChatTemplate = "auto"  # how conversational prompts are rendered; auto = from the tokenizer
    date_string: str = ""         # Llama 3 "Today Date"; empty = the one saved with the tokenizer, else the template's
                                  # default
    device: str = "auto"          # cpu, cuda, or auto
    overwrite: bool = False       # replace an existing --out
    tools: str = ""               # tools the policy may call, as train_ppo.py's --tools: calculator and/or
                                  # module:NAME / path/to/file.py:NAME (conversational prompts; pairs or listwise)
    max_turns: int = 4            # assistant turns a response may take, tool turns between them; --max_new_tokens
                                  # bounds sampled and tool tokens together [with tools] {>= 1}


def check_options(o):
    """Every bad flag is one line before anything is loaded or sampled."""
    if not o.out:
        fail("--out is required (the JSONL file to write)", 2)
    if os.path.isfile(o.out) and not o.overwrite:
        fail(f"--out {o.out}: exists; pass --overwrite to replace it")
    if o.prompts and os.path.exists(o.prompts) and os.path.realpath(o.prompts) == os.path.realpath(o.out):
        fail(f"--out {o.out}: is the --prompts file")
    check_output_file("--out", o.out, [o.prompts], [o.model] + ([o.judge] if os.path.isdir(o.judge or "") else []))
    if not os.path.isdir(o.model):
        fail(f"--model {o.model}: no such model directory")
    if not (o.judge or o.pair_judge):
        fail("a judge is needed: --judge (reward-model dir, gold, module:function, llm:MODEL_DIR) and/or --pair_judge",
             2)
    if o.pair_judge and not reward_mod.is_function_spec(o.pair_judge):
        fail(f"--pair_judge {o.pair_judge}: expected module:function or path/to/file.py:function", 2)
    if o.samples_per_prompt < 2 and not (o.format == "scored" or o.format == "unpaired" and o.threshold is not None):
        fail(f"--format {o.format} needs --samples_per_prompt >= 2 (it compares the samples of a prompt; "
             "only scored data, or unpaired data with --threshold, can label single samples)", 2)
    if o.pair_judge and o.samples_per_prompt < 2:
        fail("--pair_judge needs --samples_per_prompt >= 2 (a score is a win rate against the other samples)", 2)
    if dist.device_problem(o.device):
        fail(dist.device_problem(o.device), 2)
    if o.tools and o.format not in ("pairs", "listwise"):
        fail(f"--tools writes responses holding tool turns, which the pairs and listwise kinds read; --format "
             f"{o.format}'s responses are assistant messages only", 2)


@torch.no_grad()
def sample(model, tok, items, k, o, device, rm=None, progress=None, box=None):
    """k completions per tokenized prompt, prompt-major (the samples of prompt i are rows i·k … i·k + k − 1),
    each cut after its first stop token. Returns (texts, finished flags, scores): with a reward model `rm`,
    its raw scores of the very ids sampled (no decode/re-encode round trip, which need not give the sampled ids
    back), each response closed as train_rm.py scored them: a response cut at --max_new_tokens gets the end
    token (end-of-text, or the template's end-of-turn) appended, in the position the prompts left free.
    box (a ToolBox): responses call its tools, up to --max_turns turns (sampling.sample_responses); the texts are
    then transcripts (Tokenizer.decode_turns) and a fourth value gives each as messages (transcript_messages)."""
    rows = [it for it in items for _ in range(k)]
    ends = [tok.eos_id if isinstance(it["text"], str) else tok.eot_id for it in rows]
    gen = torch.Generator(device=device).manual_seed(o.seed)
    sampling = SamplingOptions(o.max_new_tokens, o.temperature, stop_ids=tok.stop_ids, pad_id=tok.pad_id)
    texts, finished, scores, messages = [], [], [], []
    for s in range(0, len(rows), o.batch_size):
        r = sample_groups(rows[s:s + o.batch_size], model, tok, sampling, 1, gen, tools=box, max_turns=o.max_turns)
        P = r.query_len
        ids, mask, resp = r.query_response[:, :P], r.attention_mask[:, :P], r.query_response[:, P:]
        ended = r.has_eos.bool()
        if box is not None:
            length, actions = r.response_mask.sum(1).long(), r.actions.long()
            messages += [transcript_messages(tok, resp[b, :length[b]].tolist(), actions[b, :length[b]].tolist(),
                                             r.tool_results) for b in range(len(resp))]
        if rm is not None:
            cut = ~ended
            end = torch.tensor(ends[s:s + o.batch_size], device=device)
            closed = torch.cat([ids, resp, torch.where(cut, end, tok.pad_id)[:, None]], 1)
            attn = torch.cat([mask, r.response_mask.long(), cut.long()[:, None]], 1)
            block = rm.model.cfg.block_size      # a judge with a shorter context reads each row's last tokens
            scores.append(rm.score_tokens(closed[:, -block:], attn[:, -block:]).double().cpu())
        finished += ended.tolist()
        texts += r.completions
        if progress is not None:
            progress.update(len(resp))
    return texts, finished, torch.cat(scores) if rm is not None else None, messages if box is not None else None


def transcript_messages(tok, ids, actions, seen):
    """A multi-turn response as the messages a data row holds: each assistant turn (a run of sampled ids,
    actions = 1) with its calls as `tool_calls` and its text without them as content (chat.final_turn), then a
    `tool` message per result where a tool turn follows it (`seen`: the results of each answered turn, by its
    ids). None when no data row can hold it: a malformed call that was answered (its error result answers no
    call), or an assistant turn with neither text nor calls (a result is text: the box replaces what is not).
    The data loader renders these messages again: the ids need not be the sampled ones (a call written with
    other spacing), as for any labelled text."""
    variant, out, turn = tok.chat_template, [], []
    for t, a in zip(ids + [None], actions + [0]):
        if a:
            turn.append(t)
            continue
        if not turn:
            continue
        text = tok.decode(turn)
        answered = t is not None and turn[-1] == tok.eot_id and tuple(turn) in seen
        calls = chat.parse_tool_calls(variant, text) if turn[-1] == tok.eot_id else []
        if any("error" in c for c in calls):
            if answered:
                return None
            calls = []          # the last turn's malformed call, never run: its text is the answer as written
        content = chat.final_turn(text, variant) if calls else text
        if not calls and not content.strip():
            return None
        out.append({"role": "assistant", "content": content} if not calls else
                   {"role": "assistant", "content": content, "tool_calls": [{"type": "function", "function": c}
                                                                            for c in calls]})
        if answered:
            out += [{"role": "tool", "content": r} for r in seen[tuple(turn)]]
        turn = []
    return out


def group_scores(judge, prompts, completions, k, scores=None):
    """(G, k) float64: the judge's scores (or `scores`, a reward model's of the sampled ids), or with a pairwise
    judge each sample's win rate against the other k − 1 of its group, 1/(k−1) Σ_{j≠i} P(y_i ≻ y_j)
    (preference_matrix's diagonal is exactly ½)."""
    if judge.pairwise is None:
        return (judge.scores(prompts, completions) if scores is None else scores).view(-1, k)
    return (preference_matrix(judge, prompts, completions, k).sum(-1) - 0.5) / (k - 1)


def response(prompt, text):
    """A response field in the prompt's format: text, or [assistant message] for a conversation."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def records(prompts, texts, scores, o, counts, messages=None, tools=None):
    """The output rows of one format from G prompts, their G·k texts and (G, k) scores. messages: with --tools,
    each sample's transcript as messages (transcript_messages; None: no row can hold it, left out and counted
    "unwritable"), the response field of its rows, which list `tools` (the schemas)."""
    k = scores.shape[1]
    for g, prompt in enumerate(prompts):
        if messages is None:
            group = [(response(prompt, texts[g * k + i]), float(scores[g, i])) for i in range(k)]
            kept = [(r, s) for i, (r, s) in enumerate(group) if texts[g * k + i].strip()]
            counts["empty"] += k - len(kept)
        else:
            group = [(messages[g * k + i], float(scores[g, i])) for i in range(k)]
            kept = [(r, s) for r, s in group if r is not None]
            counts["unwritable"] += k - len(kept)
        extra = {"tools": tools} if tools else {}
        if o.format == "listwise":
            if len(kept) < 2:
                counts["too few"] += 1
                continue
            yield {"prompt": prompt, "completions": [r for r, _ in kept], "scores": [s for _, s in kept], **extra}
        elif o.format == "pairs":
            if not kept:
                counts["too few"] += 1
                continue
            best = max(kept, key=lambda x: x[1])        # the first of equal scores: sampling order decides
            worst = min(kept, key=lambda x: x[1])
            if best[1] == worst[1]:
                counts["ties"] += 1
                continue
            yield {"prompt": prompt, "chosen": best[0], "rejected": worst[0], "score_chosen": best[1],
                   "score_rejected": worst[1], **extra}
        elif o.format == "scored":
            for r, s in kept:
                yield {"prompt": prompt, "completion": r, "score": s}
        else:
            cut = o.threshold if o.threshold is not None else statistics.median(s for _, s in group)
            for r, s in kept:
                if o.threshold is None and s == cut:
                    counts["at median"] += 1
                    continue
                yield {"prompt": prompt, "completion": r,
                       "label": s >= cut if o.threshold is not None else s > cut}


def main(argv=None):
    o = parse_args(Options, argv, __doc__, prog="python -m nano_rlhf.label")
    check_options(o)
    t0 = time.time()
    device = torch.device("cuda" if o.device == "auto" and torch.cuda.is_available() else
                          "cpu" if o.device == "auto" else o.device)
    from .model import GPT
    box = load_tools(o.tools) if o.tools else None          # a bad spec is one line, before any model loads
    with input_errors():
        prompt_records = load_records(o.prompts or default_data("prompts"), "prompts")
        if o.max_prompts:
            prompt_records = prompt_records[:o.max_prompts]
        tok = load_tokenizer("", o.model, chat_template=o.chat_template, date_string=o.date_string,
                             policy=True)
        model = GPT.from_pretrained(o.model, dropout=0.0).to(device).eval()
        check_vocab(tok, model.cfg, o.model)
        max_prompt = model.cfg.block_size - o.max_new_tokens - 1     # one position for a reward model's end token
        if max_prompt < 1:
            raise ValueError(f"--max_new_tokens {o.max_new_tokens} leaves no room for a prompt in block_size "
                             f"{model.cfg.block_size}")
        prompts = [r["prompt"] for r in prompt_records]
        judge = load_judge(o.judge or None, o.pair_judge or None, tokenizer=tok, device=device, prompts=prompts,
                           batch_size=o.batch_size, template=o.judge_template)
        items, prompt_stats = tokenize_prompts(prompt_records, tok, max_prompt,
                                               tools=None if box is None else box.schemas)
    k = o.samples_per_prompt
    rm = judge.pointwise if judge.pairwise is None and isinstance(judge.pointwise, reward_mod.RewardModel) else None
    progress = Progress(len(items) * k, f"sampling {o.model}")
    texts, finished, rm_scores, messages = sample(model, tok, items, k, o, device, rm, progress, box)
    progress.done()
    if box is not None:
        box.close()
    t_sample = time.time() - t0
    scores = group_scores(judge, [p for p in prompts for _ in range(k)], texts, k, rm_scores)
    counts = {"empty": 0, "unwritable": 0, "too few": 0, "ties": 0, "at median": 0}
    rows = list(records(prompts, texts, scores, o, counts, messages, None if box is None else box.schemas))
    try:          # whole or not at all: a full disk leaves no half-written --out (nor a temporary file)
        atomic_write_text(o.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    except OSError as e:
        fail(f"--out {o.out}: cannot be written ({e.strerror or e}); nothing was written there")
    notes = [f"{v} {name}" for name, v in counts.items() if v]
    llm = judge.pointwise if (o.judge or "").startswith(LLM) else None
    if llm is not None and llm.unparsed:
        print(f"warning: {llm.unparsed} of {llm.answered} judge answers held no score (scored {llm.fallback:g})",
              file=sys.stderr, flush=True)
    print(f"labelled {len(prompts)} prompts x {k} samples ({prompt_stats}; eos rate "
          f"{sum(finished) / len(finished):.0%}; sampling {t_sample:.1f}s, judging {time.time() - t0 - t_sample:.1f}s)"
          f" -> {len(rows)} {o.format} rows in {o.out}" + (f" | left out: {', '.join(notes)}" if notes else ""),
          flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
