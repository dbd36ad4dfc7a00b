"""TRL's GRPOTrainer on the same run as `train_ppo.py --advantage grpo`: the same SFT directory, prompts, verifier
and budget, so the two can be compared at equal samples and at equal wall-clock. TRL is not a run-time
dependency of nano_rlhf: run this in its own virtual environment, so the tests' pinned transformers stays as it is.

    python -m venv --system-site-packages /tmp/trlenv && /tmp/trlenv/bin/pip install trl==1.16.0
    /tmp/trlenv/bin/python bench/trl_grpo.py --init out/reasoning/sft --prompts data/reasoning/prompts.jsonl \\
        --reward nano_rlhf.tasks.reasoning:reward --out_dir out/reasoning/trl_grpo --max_steps 60 --batch_size 8 \\
        --samples_per_prompt 8 --max_new_tokens 48 --lr 1e-4 --ppo_epochs 4 --num_minibatches 2 --beta 0.04
    python -m nano_rlhf.evaluate --model out/reasoning/trl_grpo ...      # the same held-out evaluation as ours

The flags mean what train_ppo.py's mean (one "step" = one rollout of batch_size x samples_per_prompt
completions, then ppo_epochs x num_minibatches optimizer steps), mapped onto GRPOConfig:
  per_device_train_batch_size = batch_size x samples_per_prompt / num_minibatches   (one optimizer step's share)
  steps_per_generation        = num_minibatches      (a generation feeds num_minibatches optimizer steps)
  num_iterations              = ppo_epochs           (TRL's μ: passes over each generation)
  max_steps                   = max_steps x ppo_epochs x num_minibatches            (TRL counts optimizer steps)
GRPOConfig fields set away from TRL's defaults, and why:
  learning_rate, lr_scheduler_type constant, warmup 0     train_ppo.py's --lr, constant schedule, no warm-up
  adam_beta2 0.95, weight_decay 0.0                         nano_rlhf's AdamW (betas 0.9, 0.95; no decay in RL)
  beta (KL coefficient), k3 in the loss                     train_ppo.py --kl_in_loss --kl_coef (TRL's placement)
  loss_type "dapo" (TRL's default)                          = train_ppo.py's token_mean (GRPO's auto)
  epsilon 0.2, max_grad_norm 1.0, temperature 1.0, top_k 0   equal to ours already (written for the record)
  bf16 False, gradient_checkpointing False                   float32 on both sides (TRL's CPU defaults are bf16 +
                                                             checkpointing, slower on a CPU without native bf16)
  max_completion_length = --max_new_tokens; num_generations = --samples_per_prompt; seed = --seed
  logging_steps 1, save_strategy "no" (the model is saved once at the end, for our evaluate)
The reward is any nano_rlhf `module:function` reward (`f(prompts, completions) -> list[float]`), called with the
prompt and completion texts TRL decodes. Writes OUT/trl_log.jsonl (TRL's log, one line per optimizer step:
reward, KL, ...) and OUT/trl_summary.json (wall-clock seconds, the settings).
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
    p.add_argument("--init", required=True, help="SFT directory (HF layout + tokenizer.json), as train_ppo --init")
    p.add_argument("--prompts", required=True, help='prompts JSONL {"prompt": str}')
    p.add_argument("--reward", required=True, help="module:function or file.py:function, as train_ppo --reward")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--max_steps", type=int, default=60, help="rollouts, as train_ppo --max_steps")
    p.add_argument("--batch_size", type=int, default=8, help="prompts per rollout")
    p.add_argument("--samples_per_prompt", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ppo_epochs", type=int, default=4)
    p.add_argument("--num_minibatches", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (k3 in the loss)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)

    import torch
    torch.set_num_threads(a.threads)
    os.environ.setdefault("TQDM_DISABLE", "1")
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from nano_rlhf.reward import load_function
    from trl_common import model_and_tokenizer, train_and_save
    transformers.logging.set_verbosity_error()

    ours, tok, model = model_and_tokenizer(a.init)
    rows = [json.loads(line) for line in open(a.prompts)]
    # TRL draws batch_size distinct prompts per generation; enough epochs of the file for every rollout
    need = a.max_steps * a.batch_size
    prompts = [rows[i % len(rows)]["prompt"] for i in range(max(need, len(rows)))]
    verifier = load_function(a.reward)

    def reward(prompts, completions, **kw):
        return [float(x) for x in verifier(list(prompts), list(completions))]
    reward.__name__ = "verifier"

    rollout = a.batch_size * a.samples_per_prompt
    if rollout % a.num_minibatches:
        sys.exit(f"error: batch_size x samples_per_prompt ({rollout}) must divide into --num_minibatches")
    args = GRPOConfig(
        output_dir=a.out_dir, max_steps=a.max_steps * a.ppo_epochs * a.num_minibatches,
        per_device_train_batch_size=rollout // a.num_minibatches, steps_per_generation=a.num_minibatches,
        num_iterations=a.ppo_epochs, num_generations=a.samples_per_prompt, max_completion_length=a.max_new_tokens,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta2=0.95, weight_decay=0.0,
        beta=a.beta, loss_type="dapo", epsilon=0.2, max_grad_norm=1.0, temperature=1.0, top_k=0,
        bf16=False, gradient_checkpointing=False, use_cpu=True, report_to="none", logging_steps=1,
        save_strategy="no", seed=a.seed, dataloader_num_workers=0)

    seconds = train_and_save(
        lambda callbacks: GRPOTrainer(model, reward_funcs=reward, args=args, processing_class=tok,
                                      train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=callbacks),
        ours, a.out_dir, vars(a), "grpo_config", args)
    print(f"TRL GRPO: {a.max_steps} rollouts in {seconds:.0f} s -> {a.out_dir}")


if __name__ == "__main__":
    main()
