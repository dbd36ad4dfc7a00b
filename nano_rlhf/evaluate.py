"""Sample from a policy and score it.

    python -m nano_rlhf.evaluate --model out/ppo --prompts data/eval_prompts.jsonl --out samples.jsonl \\
        [--ref out/sft] [--reward_model out/rm] [--reward my_rewards.py:score] [--baseline out/sft/samples.jsonl] \\
        [--summary summary.json]

Prints: the gold reward as mean ± standard error (only when every prompt is the built-in task's), win rate
against --baseline (on the gold reward, or on --reward; ties count one half), reward-model score (with
--reward_model), your reward (with --reward module:function), the mean cost and the share of unsafe responses,
cost > 0 (with --cost module:function, Safe RLHF's reading), KL to --ref, mean response length, end-of-text
rate. Every reward goes through nano_rlhf.reward, the interface train_ppo.py uses.

With a verifier as --reward, `--pass_k 1,8` adds pass@k for each k: the unbiased estimate of Chen et al. 2021
from the n = --samples_per_prompt samples of each prompt (n >= k; a sample passes when its reward is at least
--pass_threshold), averaged over prompts with its standard error over prompts. When the reward's module also
defines `answer(completion) -> str | None` (the final answer it would check, e.g. nano_rlhf.tasks.reasoning.answer),
maj@k is added too: the share of prompts whose majority answer among k samples is correct (self-consistency,
Wang et al. 2023), averaged over k-subsets of the n samples as pass@k is (`maj_at_k`). With n >= 2, the
zero-spread share is the share of prompts whose samples all pass or all fail: GRPO's and RLOO's advantages are
0 on every one of them (what DAPO's dynamic sampling drops).

    python -m nano_rlhf.evaluate --model out/rsft --prompts data/reasoning/eval_prompts.jsonl \\
        --reward nano_rlhf.tasks.reasoning:reward --samples_per_prompt 8 --pass_k 1,8

Conversational prompts (a list of messages) are rendered with the model's own chat template (recognised from
its tokenizer_config.json; --chat_template names one, --date_string fixes Llama 3's date) and a response ends
at the first stop token: end-of-text or the template's end-of-turn (<|eot_id|>, <|im_end|>), both counted in
the end-of-text rate.

With --tools (train_ppo.py's value: calculator, module:NAME, path/to/file.py:NAME) the conversational prompts
offer the tools and a response may call them, up to --max_turns assistant turns, --max_new_tokens bounding the
sampled and the tool tokens together (nano_rlhf.sampling.generate_turns, as in training). A sample's completion
is the transcript (tool calls and results in the template's markup; the built-in verifiers score its final
turn); its KL counts only the tokens the policy sampled; `tool_calls` and `malformed_calls` count the calls it
wrote (written_calls), and the summary adds tool calls per answer and the share of malformed calls.

Default decoding is pure sampling at temperature 1 — the distribution RLHF optimises. Greedy decoding
(--temperature 0) hides how much probability the policy still puts on bad answers.

KL to the reference is the sequence-level estimate Σ_t [log π(y_t) − log π_ref(y_t)] over the sampled
response tokens (end-of-text included), averaged over samples: an unbiased estimate of KL(π ‖ π_ref).
"""
import json
import os
import sys
from dataclasses import dataclass, replace
from typing import Literal, Optional

import torch

from . import chat, dist, parallel
from . import reward as reward_mod
from .checkpoint import atomic_write_text
from .data import default_data
from .training import check_output_file, check_vocab, fail, load_tokenizer
from .cli import ChatTemplate, parse_args
from .data import DataError, load_records, tokenize_prompts
from .model import GPT
from .training import Progress
from .rollout import sample_groups
from .sampling import SamplingOptions
from .summary import format_summary, format_table, summarize
from .tools import load_tools


def response_logprobs(model, ids, attn, response_mask, temperature=1.0):
    """log π(y_t | ...) at temperature τ for each response token, (B, R) float32 (float64 for a float64 model), 0
    where response_mask is 0: train_ppo.py's contract (its copy adds the entropy). ids = [left-padded prompt (P) |
    response (R)]; the hidden state at position P−1+t predicts response token t, and only those positions go through
    the output layer, in chunks (token_logprobs), so a real vocabulary's logits stay bounded."""
    B, T = ids.shape
    R = response_mask.shape[1]
    rows, cols = response_mask.nonzero(as_tuple=True)             # the response tokens, row by row
    positions = (rows * T + (T - R - 1) + cols).to(ids.device)    # b·T + P−1+t: the predicting positions
    # through forward (not hidden_states): module hooks fire — an offloaded frozen model comes to the device,
    # an FSDP root gathers — and the output layer runs inside it
    lp = model(ids, attn, select=positions, targets=ids.flatten()[positions + 1], temperature=temperature)
    return torch.zeros(B * R, device=ids.device, dtype=lp.dtype).index_copy_(0, (rows * R + cols).to(ids.device),
                                                                           lp).view(B, R)


@torch.no_grad()
def sample_and_score(model, tok, prompts, sampling=SamplingOptions(max_new_tokens=48), *, samples_per_prompt=1,
                     seed=0, batch_size=64, ref=None, rewards=None, progress=None, tools=None, max_turns=1):
    """Generate for every prompt (records with "prompt") and score; returns one dict per sample.
    sampling: nano_rlhf.sampling.SamplingOptions (its stop_ids and pad_id default to the tokenizer's; each
    response is cut after its first stop token). seed: one generator for the whole call. rewards: {column
    name: reward(prompts, completions)} (nano_rlhf.reward); a reward model scores the very token ids sampled.
    ref: the reference for the KL column (the model itself: KL 0 without a forward). progress: a
    run.Progress told of each batch (the command line's; the training loops' evaluations print nothing). tools (a
    nano_rlhf.tools.ToolBox): the prompts offer them and a response may call them, up to max_turns assistant
    turns (its completion holds the tool turns; its KL counts only the tokens the policy sampled; its record
    counts the calls it wrote, `tool_calls`, and the malformed ones, `malformed_calls`: see written_calls)."""
    model.eval()
    sampling = replace(sampling, stop_ids=tok.stop_ids if sampling.stop_ids is None else sampling.stop_ids,
                       pad_id=tok.pad_id if sampling.pad_id is None else sampling.pad_id)
    max_prompt = model.cfg.block_size - sampling.max_new_tokens
    if max_prompt < 1:
        raise ValueError(f"--max_new_tokens {sampling.max_new_tokens} leaves no room for a prompt in block_size "
                         f"{model.cfg.block_size}")
    items, _ = tokenize_prompts(prompts, tok, max_prompt, tools=None if tools is None else tools.schemas)
    work = [(i, j) for i in range(len(items)) for j in range(samples_per_prompt)]
    # the generator and the samples live where the model does (a CPU generator cannot draw on CUDA)
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    rewards = rewards or {}
    # log-probs at the sampling temperature; greedy decoding has none, so the KL is that of the plain softmax
    temperature = sampling.temperature or 1.0
    out = []
    for s in range(0, len(work), batch_size):
        chunk = work[s:s + batch_size]
        # end-of-text or the template's end-of-turn ends a response; its mask covers it, the padding after it not
        r = sample_groups([items[i] for i, _ in chunk], model, tok, sampling, 1, gen, tools=tools, max_turns=max_turns)
        seq, full_attn, response_mask, actions = r.query_response, r.attention_mask, r.response_mask, r.actions
        resp, length, has_eos = seq[:, r.query_len:], response_mask.sum(1).long(), r.has_eos.bool()
        kl = None
        if ref is model:     # the policy is its own reference (a table's start row): the KL is 0, no forward needed
            kl = torch.zeros(len(chunk))
        elif ref is not None:
            lp = response_logprobs(model, seq, full_attn, response_mask, temperature)
            rlp = response_logprobs(ref, seq, full_attn, response_mask, temperature)
            kl = ((lp - rlp) * actions).sum(1)
        texts = r.completions
        calls = [written_calls(tok, resp[b, :length[b]].tolist(), actions[b, :length[b]].long().tolist())
                 for b in range(len(chunk))] if tools is not None else None
        chunk_prompts = [prompts[i]["prompt"] for i, _ in chunk]
        scores = {name: (fn.score_tokens(seq, full_attn).tolist() if isinstance(fn, reward_mod.RewardModel)
                         else fn(chunk_prompts, texts)) for name, fn in rewards.items()}
        if progress is not None:
            progress.update(len(chunk))
        for b, (i, j) in enumerate(chunk):
            rec = {"prompt": prompts[i]["prompt"], "completion": texts[b], "sample": j,
                   "length": int(length[b]), "eos": bool(has_eos[b])}
            rec.update({name: float(s[b]) for name, s in scores.items()})
            if kl is not None:
                rec["kl"] = float(kl[b])
            if calls is not None:
                rec["tool_calls"] = len(calls[b])
                rec["malformed_calls"] = sum("error" in c for c in calls[b])
            out.append(rec)
    return out


def written_calls(tok, ids, actions):
    """The tool calls a policy wrote in one multi-turn response, in order, as chat.parse_tool_calls reads them
    ({"error"} for a malformed one): those of every assistant turn (a run of sampled tokens, actions = 1) that
    ended on the template's end-of-turn, as nano_rlhf.tools.ToolEnv parses them — the last turn's too when
    --max_turns stopped the row before they could run."""
    calls, turn = [], []
    for t, a in zip(ids + [None], actions + [0]):
        if a:
            turn.append(t)
            continue
        if turn and turn[-1] == tok.eot_id:
            calls += chat.parse_tool_calls(tok.chat_template, tok.decode(turn))
        turn = []
    return calls


def eval_metrics(run, step, policy, tok, prompts, sampling, *, rewards, ref=None, gathered=(), show=0, tools=None,
                 max_turns=1):
    """A training loop's held-out evaluation: prompts sampled on rank 0 with a fixed seed (comparable across
    steps), scored by `rewards` ({column: reward function}) and with ref the KL to it; returns the means as
    {"eval/<column>": value} on rank 0 ({} on the others), logs 8 samples to the run and prints `show` of them
    (tools, max_turns: as sample_and_score).
    FSDP: rank 0 samples alone, so the policy and the `gathered` models are gathered on every rank meanwhile."""
    metrics = {}
    with parallel.gathered(policy, *gathered):
        if dist.world().is_main:
            samples = sample_and_score(policy, tok, prompts, sampling, seed=1234, ref=ref, rewards=rewards,
                                       tools=tools, max_turns=max_turns)
            metrics = {f"eval/{k}": v for k, v in summarize(samples).items() if not k.endswith("_se") and k != "n"}
            run.log_samples(step, samples[:8])
            for smp in samples[:show]:
                dist.print0(f"  sample | {smp['prompt']!r} -> {smp['completion']!r}")
    dist.barrier()
    return metrics


@dataclass
class Options:
    model: list[str]              # policy directories (HF layout of GPT-2, Llama, Qwen2/3 + tokenizer.json);
                                  # several give one table row each
    prompts: str = ""             # prompts JSONL; empty = the built-in task's eval prompts
    out: str = ""                 # samples JSONL to write (one --model only); empty = MODEL/eval_samples.jsonl for
                                  # each model (a training run's own samples.jsonl is kept)
    ref: str = ""                 # reference policy directory for the KL column
    reward_model: str = ""        # reward model directory for the RM-score column
    reward: str = ""              # your reward, module:function or path/to/file.py:function, called as
                                  # f(prompts, completions) -> list of floats, for the reward column
    cost: str = ""                # a cost, module:function or path/to/file.py:function (the built-in --harm task's:
                                  # nano_rlhf.reward:gold_cost), called as --reward is, for the cost column and the
                                  # share of unsafe responses (cost > 0)
    baseline: str = ""            # samples.jsonl of a baseline policy, or a model directory (evaluated first), for
                                  # the win-rate column
    summary: str = ""             # also write the summary figures (one entry per model) to this JSON file
    overwrite: bool = False       # replace an existing --out or --summary file (the default
                                  # MODEL/eval_samples.jsonl, this tool's own, is always rewritten)
    times: str = ""               # TSV of training wall-clock seconds (NAME<TAB>SECONDS, NAME = the model
                                  # directory's basename), shown as a column (scripts/survey.sh writes one)
    name: str = ""                # row label (one --model only); empty = the directory's name
    temperature: float = 1.0      # sampling temperature; 0 = greedy {>= 0}
    top_k: Optional[int] = None   # sample among the k most likely tokens only; none = all {>= 1}
    top_p: Optional[float] = None  # nucleus sampling threshold; none = off {0 < x <= 1}
    samples_per_prompt: int = 1   # samples per prompt {>= 1}
    pass_k: str = ""              # comma list of k (e.g. 1,8): pass@k of --reward (and maj@k when its module
                                  # defines answer()) from --samples_per_prompt >= k samples per prompt [with reward]
    pass_threshold: float = 1.0   # a sample passes (for --pass_k) when its --reward score is at least this
                                  # [with pass_k]
    max_new_tokens: int = 48      # longest response {>= 1}
    batch_size: int = 64          # prompts per generation batch {>= 1}
    seed: int = 0                 # sampling seed (the same for every model)
    compile: bool = False         # decode with a torch.compile'd static-cache step (compile time is paid once per
                                  # batch bucket)
    sample_dtype: Literal["float32", "bfloat16"] = "float32"  # dtype of the sampling copy of each model (log-probs
                                                              # for the KL column stay float32)
    device: str = "auto"          # cpu, cuda, cuda:N, or auto (a GPU when there is one)
    chat_template: ChatTemplate = "auto"  # how conversational prompts are rendered; auto = recognised from the
                                          # tokenizer's own template
    date_string: str = ""         # Llama 3 "Today Date" (e.g. "26 Jul 2024"); empty = the one saved with the
                                  # tokenizer, else the template's default
    tools: str = ""               # tools the policy may call, as train_ppo.py's --tools: calculator and/or
                                  # module:NAME / path/to/file.py:NAME (the prompts must be conversations)
    max_turns: int = 4            # assistant turns a response may take, tool turns between them; --max_new_tokens
                                  # bounds sampled and tool tokens together [with tools] {>= 1}


def main(argv=None):
    a = parse_args(Options, argv, __doc__, prog="python -m nano_rlhf.evaluate")
    check_options(a)
    times = read_times(a.times) if a.times else {}
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    rows = []
    box = load_tools(a.tools) if a.tools else None          # a bad spec is one line, before any model loads
    try:
        prompts = load_records(a.prompts or default_data("prompts", "eval"), "prompts")
        ref = GPT.from_pretrained(a.ref, dropout=0.0).to(device).eval() if a.ref else None
        rewards = {}
        gold = reward_mod.builtin_gold([r["prompt"] for r in prompts])     # None unless every prompt is the task's
        if gold is not None:
            rewards["gold_reward"] = gold
        answer = None
        if a.reward:
            rewards["reward"] = reward_mod.load_function(a.reward)
            answer = getattr(rewards["reward"].module, "answer", None) if a.pass_k else None
            answer = checked_answer(answer, a.reward) if callable(answer) else None
        if a.cost:
            rewards["cost"] = reward_mod.load_function(a.cost, "--cost")
        sampling = SamplingOptions(a.max_new_tokens, a.temperature, a.top_k, a.top_p, compile=a.compile,
                                   dtype=getattr(torch, a.sample_dtype))
        baseline = None
        models = list(a.model)
        if a.baseline and os.path.isdir(a.baseline):
            models = [a.baseline] + [m for m in models if os.path.normpath(m) != os.path.normpath(a.baseline)]
        elif a.baseline:
            baseline = read_baseline(a.baseline)
        for d in models:
            tok = load_tokenizer("", d, chat_template=a.chat_template, date_string=a.date_string, policy=True)
            model = GPT.from_pretrained(d, dropout=0.0).to(device).eval()
            check_vocab(tok, model.cfg, d)
            if ref is not None:
                check_vocab(tok, ref.cfg, a.ref)                   # the reference scores this policy's ids
            if a.reward_model:                                     # likewise the reward model
                rewards["rm_score"] = reward_mod.load_reward(a.reward_model, tokenizer=tok, batch_size=a.batch_size,
                                                             device=device)
            same = ref is not None and os.path.realpath(d) == os.path.realpath(a.ref)
            progress = Progress(len(prompts) * a.samples_per_prompt, f"sampling {d}")
            samples = sample_and_score(model, tok, prompts, sampling, samples_per_prompt=a.samples_per_prompt,
                                       seed=a.seed, batch_size=a.batch_size, ref=model if same else ref,
                                       rewards=rewards, progress=progress, tools=box, max_turns=a.max_turns)
            progress.done()
            if answer is not None:
                for r in samples:
                    r["answer"] = answer(r["completion"])
            if a.baseline and os.path.isdir(a.baseline) and d == models[0]:
                baseline = samples
            summary = summarize(samples, baseline, a.pass_k, a.pass_threshold)
            out = a.out or os.path.join(d, EVAL_SAMPLES)
            write_output(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in samples))
            name = a.name if a.name and len(models) == 1 else os.path.basename(os.path.normpath(d))
            rows.append(dict(summary, name=name, model=d, temperature=a.temperature))
            print(format_summary(name, summary), flush=True)
    except (DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        if box is not None:
            box.close()
    for r in rows:
        if os.path.basename(os.path.normpath(r["model"])) in times:
            r["train_seconds"] = times[os.path.basename(os.path.normpath(r["model"]))]
    if len(rows) > 1:
        print()
        print(format_table(rows))
    if a.summary:
        write_output(a.summary, json.dumps(rows, indent=2) + "\n")
    return rows


def write_output(path, text):
    """A file written whole or not at all (a temporary file renamed over it); a failure (a full disk, a directory
    gone read-only) is one line and leaves the previous file, if any, as it was."""
    try:
        atomic_write_text(path, text)
    except OSError as e:
        fail(f"{path}: cannot be written ({e.strerror or e}); nothing was written there")


def read_baseline(path):
    """--baseline's samples JSONL (evaluate's own output): one JSON object with a "prompt" per line, else one line
    naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"--baseline {path}:{n}: not JSON ({e}); expected a samples file written by "
                                "nano_rlhf.evaluate, or a model directory") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise DataError(f"--baseline {path}:{n}: not a sample (a JSON object with a prompt)")
            rows.append(row)
    return rows


def checked_answer(fn, spec):
    """The reward module's answer(completion) hook, its every answer checked: a string or None, else one line."""
    where = spec.rsplit(":", 1)[0]

    def answer(completion):
        try:
            out = fn(completion)
        except Exception as e:      # the user's code: their error in a line, not our stack
            fail(f"--reward {spec}: {where}.answer raised {type(e).__name__}: {str(e)[:200]}")
        if out is not None and not isinstance(out, str):
            fail(f"--reward {spec}: {where}.answer must return a string or None, got {type(out).__name__}")
        return out
    return answer


def parse_pass_k(text, samples_per_prompt):
    """'1,8' -> (1, 8), sorted and distinct; one line for anything else, or for a k above samples_per_prompt."""
    try:
        ks = sorted({int(x) for x in text.split(",")})
    except ValueError:
        fail(f"--pass_k must be a comma list of integers, e.g. 1,8 (got {text!r})", 2)
    if ks[0] < 1:
        fail(f"--pass_k values must be >= 1 (got {text!r})", 2)
    if ks[-1] > samples_per_prompt:
        fail(f"--pass_k {ks[-1]} needs --samples_per_prompt >= {ks[-1]} (got {samples_per_prompt}): pass@k is "
             "estimated from n >= k samples of each prompt", 2)
    return tuple(ks)


def read_times(path):
    """NAME<TAB>SECONDS lines -> {name: seconds}; a bad line is one error naming FILE:LINE."""
    times = {}
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                parts = line.rstrip("\n").split("\t")
                try:
                    times[parts[0]] = float(parts[1])
                    assert len(parts) == 2
                except (IndexError, ValueError, AssertionError):
                    fail(f"--times {path}:{i}: expected NAME<TAB>SECONDS, got {line.strip()[:60]!r}")
    return times


EVAL_SAMPLES = "eval_samples.jsonl"     # the default output in each model directory (never a training file)


def check_options(a):
    """Every bad flag is one line before anything is loaded or written: the ranges and the options given where
    they do not apply are refused by the parser (Options' comments); here what a declaration cannot say."""
    if dist.device_problem(a.device):
        fail(dist.device_problem(a.device), 2)
    for flag, value, instead in (("--out", a.out, f"each writes MODEL/{EVAL_SAMPLES}"),
                                 ("--name", a.name, "each row is named after its directory")):
        if value and len(a.model) > 1:
            fail(f"{flag} applies to one --model; with {len(a.model)}, {instead}", 2)
    if a.times and not os.path.isfile(a.times):
        fail(f"--times {a.times}: no such file")
    if a.reward and not reward_mod.is_function_spec(a.reward):
        fail(f"--reward must be module:function or path/to/file.py:function (got {a.reward!r})", 2)
    if a.cost and not reward_mod.is_function_spec(a.cost):
        fail(f"--cost must be module:function or path/to/file.py:function (got {a.cost!r})", 2)
    a.pass_k = parse_pass_k(a.pass_k, a.samples_per_prompt) if a.pass_k else ()
    # checked before the models are loaded and sampled, not after minutes of sampling: no output replaces an input
    inputs = [a.prompts, a.times, a.baseline if a.baseline and os.path.isfile(a.baseline) else ""]
    dirs = list(a.model) + [a.ref, a.reward_model, a.baseline if a.baseline and os.path.isdir(a.baseline) else ""]
    if a.summary and a.out and os.path.realpath(a.summary) == os.path.realpath(a.out):
        fail(f"--summary and --out are the same file ({a.out})", 2)
    outputs = [("--summary", a.summary), ("--out", a.out)]
    for flag, path in outputs:
        if path:
            check_output_file(flag, path, inputs, [d for d in dirs if d])
            if os.path.isfile(path) and not a.overwrite:
                fail(f"{flag} {path}: exists; pass --overwrite to replace it")
    for d in a.model if not a.out else ():     # the default output, this tool's own: writable now, not after sampling
        if os.path.isdir(d) and not os.access(d, os.W_OK):
            fail(f"--model {d}: not writable, so {EVAL_SAMPLES} cannot be written there; pass --out FILE elsewhere")

if __name__ == "__main__":
    main()
