"""The peers, measured with the settings written below: TRL 1.16 trainers, a bare HF
transformers training loop and HF generate, on the reference GPT-2 shape, float32, CPU.

Each function builds its own model and data, runs warm-up + timed steps and returns a dict with the median
step time and throughput. bench/bench.py calls each in a fresh process, back to back with nano_rlhf's rows.
Trainer step times are taken between consecutive `on_step_end` callbacks (collation and bookkeeping
included). Settings that differ from TRL's defaults (and why): float32 and no gradient
checkpointing (TRL defaults to bf16 + checkpointing even on CPU; the comparison is float32 on both sides),
constant LR 1e-4, no logging / saving / eval, torch AdamW fused, weight decay 0.01.
"""
import os
import random
import statistics
import tempfile
import time
import warnings

import torch

from bench import timeit    # bench/bench.py: warm-up, then the median of timed calls (same rule for both sides)

CFG = dict(n_layer=4, n_head=4, n_embd=256, n_positions=256, vocab_size=4096)
warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")


def _quiet():
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        import datasets
        datasets.disable_progress_bars()
    except ImportError:
        pass


def _config(**kw):
    from transformers import GPT2Config
    return GPT2Config(**CFG, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                      pad_token_id=1, **kw)


def _words(seed=0):
    """A pseudo-word text sampler over one fixed 3000-word vocabulary (the tokenizer is trained on it)."""
    v = random.Random(0)
    vocab = ["".join(v.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(v.randint(2, 9))) for _ in range(3000)]
    r = random.Random(seed)
    return lambda k: " ".join(r.choice(vocab) for _ in range(k))


def tokenizer():
    """Byte-level BPE, vocab 4096, <|endoftext|> = 0 (bos = eos), <pad> = 1, as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    text = _words(0)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator((text(60) for _ in range(3000)), trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|endoftext|>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<pad>")


class _StepTimes:
    def __init__(self):
        from transformers import TrainerCallback

        class CB(TrainerCallback):
            def on_step_end(cb, args, state, control, **kw):
                self.t.append(time.perf_counter())
        self.t, self.cb = [], CB()

    def median(self, warmup=3):
        d = [b - a for a, b in zip(self.t, self.t[1:])][warmup - 1:]
        return statistics.median(d)


def _args(cls, out, steps, batch, trl_defaults=False, **kw):
    """trl_defaults: keep TRL's CPU defaults, bf16 autocast + gradient checkpointing (faster on AVX512-BF16)."""
    return cls(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-4,
               lr_scheduler_type="constant", weight_decay=0.01, optim="adamw_torch_fused", bf16=trl_defaults,
               gradient_checkpointing=trl_defaults, use_cpu=True, report_to="none", logging_strategy="no",
               save_strategy="no", eval_strategy="no", dataloader_num_workers=0, seed=0, **kw)


def _train(make_trainer, steps):
    times = _StepTimes()
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(out, times.cb)
        trainer.train()
    return times.median()


def trl_sft(steps=30, threads=2, trl_defaults=False):
    """SFTTrainer, 16 sequences x 128 tokens per step (texts long enough that every row is truncated)."""
    torch.set_num_threads(threads)
    _quiet()
    from datasets import Dataset
    from transformers import GPT2LMHeadModel
    from trl import SFTConfig, SFTTrainer
    tok, text = tokenizer(), _words(seed=1)
    ds = Dataset.from_dict({"text": [text(300) for _ in range(16 * (steps + 4))]})
    torch.manual_seed(0)

    def make(out, cb):
        args = _args(SFTConfig, out, steps, 16, trl_defaults, max_length=128, packing=False, dataset_text_field="text")
        return SFTTrainer(GPT2LMHeadModel(_config()), args=args, train_dataset=ds, processing_class=tok, callbacks=[cb])
    t = _train(make, steps)
    return {"s_per_step": t, "tokens_per_s": 16 * 128 / t,
            "settings": f"SFTTrainer {'bf16 + grad ckpt' if trl_defaults else 'fp32, no grad ckpt'}, 16x128"}


def trl_reward(steps=30, threads=2):
    """RewardTrainer, 8 pairs of exactly 128 pre-tokenised tokens (RewardTrainer drops over-long pairs)."""
    torch.set_num_threads(threads)
    _quiet()
    from datasets import Dataset
    from transformers import GPT2ForSequenceClassification
    from trl import RewardConfig, RewardTrainer
    tok = tokenizer()
    r = random.Random(0)
    rows = [{"chosen_ids": [r.randrange(2, 4096) for _ in range(127)] + [0],
             "rejected_ids": [r.randrange(2, 4096) for _ in range(127)] + [0]} for _ in range(8 * (steps + 4))]
    torch.manual_seed(0)

    def make(out, cb):
        args = _args(RewardConfig, out, steps, 8, max_length=128)
        model = GPT2ForSequenceClassification(_config(num_labels=1))
        return RewardTrainer(model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                             callbacks=[cb])
    t = _train(make, steps)
    return {"s_per_step": t, "pairs_per_s": 8 / t, "tokens_per_s": 16 * 128 / t}


def trl_dpo(steps=20, threads=2, precompute_ref=False):
    """DPOTrainer, 8 pairs per step: prompt of ~32 tokens, prompt + completion truncated to 128, beta 0.1,
    an explicit frozen reference (a deep copy), or precomputed reference log-probs."""
    import copy
    torch.set_num_threads(threads)
    _quiet()
    from datasets import Dataset
    from transformers import GPT2LMHeadModel
    from trl import DPOConfig, DPOTrainer
    tok, text = tokenizer(), _words(seed=2)
    # ~2.3 tokens per pseudo-word: 14 words make a prompt of about 32 tokens; completions are truncated
    rows = [{"prompt": text(14), "chosen": " " + text(80), "rejected": " " + text(80)} for _ in range(8 * (steps + 4))]
    torch.manual_seed(0)

    def make(out, cb):
        args = _args(DPOConfig, out, steps, 8, beta=0.1, max_length=128, precompute_ref_log_probs=precompute_ref)
        model = GPT2LMHeadModel(_config())
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        return DPOTrainer(model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                          callbacks=[cb])
    t = _train(make, steps)
    return {"s_per_step": t, "pairs_per_s": 8 / t, "precompute_ref": precompute_ref}


def trl_grpo(steps=15, threads=2):
    """GRPOTrainer: 4 prompts x 4 generations, prompts of exactly 32 tokens, completions forced to exactly 64
    (min_new_tokens), temperature 1, beta 0, one update per generation; reward = share of the letter "a"."""
    torch.set_num_threads(threads)
    _quiet()
    from datasets import Dataset
    from transformers import GPT2LMHeadModel
    from trl import GRPOConfig, GRPOTrainer
    tok = tokenizer()
    r = random.Random(0)
    prompts = [tok.decode([r.randrange(2, 4096) for _ in range(32)]) for _ in range(4 * (steps + 4))]
    prompts = [tok.decode(tok(p)["input_ids"][:32]) for p in prompts]

    def reward(completions, **kw):
        return [c.count("a") / max(1, len(c)) for c in completions]
    torch.manual_seed(0)

    def make(out, cb):
        args = _args(GRPOConfig, out, steps, 16, num_generations=4, max_completion_length=64, temperature=1.0,
                     beta=0.0, steps_per_generation=1, generation_kwargs={"min_new_tokens": 64, "top_k": 0},
                     log_completions=False)
        return GRPOTrainer(GPT2LMHeadModel(_config()), reward_funcs=reward, args=args,
                           train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok, callbacks=[cb])
    t = _train(make, steps)
    return {"s_per_step": t, "completions_per_s": 16 / t}


def hf_generate(model_dir=None, sampling=True, use_cache=True, calls=8, threads=2):
    """model.generate: batch 16, prompts of 32 tokens, exactly 64 new tokens (top_k 0, T = 1 when sampling)."""
    torch.set_num_threads(threads)
    _quiet()
    from transformers import GPT2LMHeadModel
    torch.manual_seed(0)
    model = (GPT2LMHeadModel.from_pretrained(model_dir) if model_dir else GPT2LMHeadModel(_config())).eval()
    ids = torch.randint(2, 4096, (16, 32), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64, use_cache=use_cache,
              pad_token_id=1, do_sample=sampling)
    if sampling:
        kw.update(top_k=0, temperature=1.0)

    def call():
        with torch.no_grad():
            model.generate(ids, **kw)
    t, _ = timeit(call, 2, calls if use_cache else 2)
    return {"s_per_call": t, "new_tokens_per_s": 16 * 64 / t}


def hf_bare_loop(variant="default", steps=30, threads=2):
    """GPT2LMHeadModel: loss = model(input_ids=b, labels=b).loss; backward; AdamW step; zero_grad (16 x 128)."""
    torch.set_num_threads(threads)
    _quiet()
    from transformers import GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config()).train()
    kw = {"foreach": True} if variant == "foreach" else {"fused": True} if variant == "fused" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **kw)
    b = torch.randint(2, 4096, (16, 128), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=b, labels=b).loss.backward()
        opt.step()
        opt.zero_grad()
    t, _ = timeit(step, 3, steps)
    return {"s_per_step": t, "tokens_per_s": 16 * 128 / t, "variant": variant}


if __name__ == "__main__":
    import json
    import sys
    for name in sys.argv[1:] or ["hf_bare_loop", "trl_sft", "trl_reward", "trl_dpo", "trl_grpo", "hf_generate"]:
        print(name, json.dumps(globals()[name]()), flush=True)
