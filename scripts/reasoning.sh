#!/usr/bin/env bash
# RL with verifiable rewards on the built-in reasoning task, one table: SFT, then GRPO, Dr. GRPO, DAPO, GSPO,
# CISPO, RLOO and PPO with a critic, each at the same number of sampled completions (--steps x 8 prompts x 8),
# judged by pass@1 and pass@8 of the task's verifier on held-out problems (nano_rlhf/reasoning.py).
#
#   bash scripts/reasoning.sh             # the table in docs/results.md
#   TINY=1 bash scripts/reasoning.sh      # a smoke run of a minute or two (what the tests run)
#   OUT=runs/r bash scripts/reasoning.sh  # another output directory (default: out/reasoning)
#
# Each command is printed before it runs ("+ ..."); every training stage gets --overwrite.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/reasoning}
DATA=${DATA:-data/reasoning}
PY=${PYTHON:-python}
if [ "${TINY:-0}" = "1" ]; then
  DATA_ARGS="--n_sft 400 --n_prompts 64 --n_eval_prompts 16"; SFT="--max_steps 20 --eval_interval 0"
  RL="--max_steps 2 --batch_size 2 --samples_per_prompt 4 --max_new_tokens 24"; EVAL="--samples_per_prompt 4 --pass_k 1,4"
else
  DATA_ARGS=""; SFT="--max_steps 600 --eval_interval 200"
  RL="--max_steps ${STEPS:-60} --lr 1e-4 --batch_size 8 --samples_per_prompt 8 --max_new_tokens 48"
  EVAL="--samples_per_prompt 8 --pass_k 1,8"
fi
# the same for every method: the verifier as the reward, no score normalisation to undo, no penalty that
# replaces the 0/1 reward of a truncated answer (DAPO brings its own length rule), evaluation only at the end
COMMON="--init $OUT/sft --prompts $DATA/prompts.jsonl --eval_prompts $DATA/eval_prompts.jsonl
        --reward nano_rlhf.reasoning:reward --missing_eos_penalty none --eval_interval 0 --eval_samples 16 $RL"

run() { echo "+ $*"; "$@"; }
mkdir -p "$OUT"; : > "$OUT/times.tsv"
timed() { local name=$1 t0=$SECONDS; shift; run "$@"; printf '%s\t%s\n' "$name" $((SECONDS - t0)) >> "$OUT/times.tsv"; }

run $PY -m nano_rlhf.reasoning --out_dir "$DATA" $DATA_ARGS
timed sft $PY train_sft.py --data "$DATA/sft.jsonl" --eval_data "$DATA/sft_eval.jsonl" --out_dir "$OUT/sft" --overwrite \
  --save_interval 0 $SFT
timed grpo $PY train_ppo.py $COMMON --advantage grpo --out_dir "$OUT/grpo" --overwrite
timed dr_grpo $PY train_ppo.py $COMMON --advantage dr_grpo --out_dir "$OUT/dr_grpo" --overwrite
timed dapo $PY train_ppo.py $COMMON --advantage grpo --clip_high 0.28 --dynamic_sampling --loss_agg token_mean \
  --overlong penalty --kl_coef 0 --out_dir "$OUT/dapo" --overwrite
timed gspo $PY train_ppo.py $COMMON --advantage grpo --policy_loss gspo --clip_eps 3e-4 --clip_high 4e-4 \
  --out_dir "$OUT/gspo" --overwrite
timed cispo $PY train_ppo.py $COMMON --advantage grpo --policy_loss cispo --clip_high 0.28 --out_dir "$OUT/cispo" --overwrite
timed rloo $PY train_ppo.py $COMMON --advantage rloo --out_dir "$OUT/rloo" --overwrite
timed ppo $PY train_ppo.py $COMMON --advantage gae --out_dir "$OUT/ppo" --overwrite
run $PY -m nano_rlhf.evaluate --model "$OUT/sft" "$OUT/grpo" "$OUT/dr_grpo" "$OUT/dapo" "$OUT/gspo" "$OUT/cispo" \
  "$OUT/rloo" "$OUT/ppo" --ref "$OUT/sft" --reward nano_rlhf.reasoning:reward --prompts "$DATA/eval_prompts.jsonl" \
  --summary "$OUT/results.json" --times "$OUT/times.tsv" $EVAL
