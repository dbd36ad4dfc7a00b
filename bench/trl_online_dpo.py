"""TRL's online DPO trainer on the same run as `train_online.py --method online_dpo --judge RM_DIR`: the same SFT
directory, prompts, reward model and budget, so the two can be compared at equal updates (TRL has no offline pairs
beside the online ones: its peer row is our online-only one, `--offline_data=`). TRL is not a run-time
dependency of nano_rlhf: run this in its own virtual environment (as bench/trl_grpo.py).

    python -m venv --system-site-packages /tmp/trlenv && /tmp/trlenv/bin/pip install trl==1.16.0
    /tmp/trlenv/bin/python bench/trl_online_dpo.py --init out/sft --prompts data/prompts.jsonl --judge out/rm \\
        --out_dir out/trl_online_dpo --max_steps 150 --batch_size 16
    python -m nano_rlhf.evaluate --model out/trl_online_dpo ...      # the same held-out evaluation as ours

One step = one generation of batch_size prompts x 2 completions (TRL's only mode: a random pair, labelled by the
higher score) and one optimizer step, as train_online.py's one step per rollout. OnlineDPOConfig fields set away
from TRL's defaults, and why:
  learning_rate, lr_scheduler_type constant, warmup 0     5e-5 (the --lr train_online.py had when measured: now 1e-4),
                                                            constant, no warm-up
  adam_beta2 0.95, weight_decay 0.0                         nano_rlhf's AdamW
  temperature 1.0, max_new_tokens 40                        train_online.py's sampling (TRL: 0.9, 64)
  beta 0.1, loss_type sigmoid, missing_eos_penalty None     TRL's defaults, written for the record
  bf16 False, gradient_checkpointing False                  float32 on both sides
The judge is fed as it was trained: TRL decodes completions without the end-of-text token, and this script scores
them with nano_rlhf's reward-model wrapper (nano_rlhf.reward.RewardModel), which closes every completion with the
end token before scoring, as train_rm.py's pairs were. (Passing the reward-model directory to TRL directly would
score the text without it, where this reward model was never trained.) Writes OUT/trl_log.jsonl and
OUT/trl_summary.json (wall-clock seconds, the settings).
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # trl_common


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--init", required=True, help="SFT directory (HF layout + tokenizer.json), as train_online --init")
    p.add_argument("--prompts", required=True, help='prompts JSONL {"prompt": str}')
    p.add_argument("--judge", required=True, help="reward-model directory (train_rm.py's), as train_online --judge")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--max_steps", type=int, default=150)
    p.add_argument("--batch_size", type=int, default=16, help="prompts per step")
    p.add_argument("--max_new_tokens", type=int, default=40)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)

    import torch
    torch.set_num_threads(a.threads)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import transformers
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from nano_rlhf.reward import RewardModel
    from trl_common import model_and_tokenizer, train_and_save
    transformers.logging.set_verbosity_error()

    ours, tok, model = model_and_tokenizer(a.init)
    rows = [json.loads(line) for line in open(a.prompts)]
    need = a.max_steps * a.batch_size
    prompts = [rows[i % len(rows)]["prompt"] for i in range(max(need, len(rows)))]
    rm = RewardModel.from_dir(a.judge, ours)

    def judge(prompts, completions, **kw):
        return [float(x) for x in rm(list(prompts), list(completions))]
    judge.__name__ = "reward_model"

    args = OnlineDPOConfig(
        output_dir=a.out_dir, max_steps=a.max_steps, per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=1, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta2=0.95, weight_decay=0.0, beta=[a.beta], loss_type="sigmoid", missing_eos_penalty=None,
        temperature=1.0, max_new_tokens=a.max_new_tokens, max_grad_norm=1.0, bf16=False,
        gradient_checkpointing=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
        seed=a.seed, dataloader_num_workers=0)

    seconds = train_and_save(
        lambda callbacks: OnlineDPOTrainer(model, reward_funcs=judge, args=args, processing_class=tok,
                                           train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=callbacks),
        ours, a.out_dir, vars(a), "online_dpo_config", args)
    print(f"TRL online DPO: {a.max_steps} steps in {seconds:.0f} s -> {a.out_dir}")


if __name__ == "__main__":
    main()
