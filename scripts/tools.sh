#!/usr/bin/env bash
# Tool-use RL on the reasoning task: GRPO whose rollouts may call the built-in calculator against GRPO without tools,
# from the same SFT budget, several training seeds each, judged by held-out pass@1 and pass@8 of the task's
# verifier (which reads only the policy's final answer, never a tool turn).
#
#   bash scripts/tools.sh                      # seeds 0 1 2 (about an hour on 2 cores)
#   SEEDS=0 bash scripts/tools.sh              # one seed
#   TINY=1 bash scripts/tools.sh               # a smoke run of a minute or two (what the tests run)
#
# The tool-free arm is scripts/reasoning.sh's GRPO row, run by that script into $OUT/notools (its SFT, its setting,
# its evaluation). The tool arm differs in the data and what a rollout may do, nothing else:
#   data: python -m nano_rlhf.tasks.reasoning --tool_rate 0.2 — the same problems and phrasings as conversations offering
#         the calculator, a fifth of the demonstrations calling it (on the whole expression, or on the first step
#         only and then by hand); the other demonstrations are the tool-free ones.
#   SFT:  the same 2400 steps, batch and model; block_size 128 instead of 64, the longest trajectory (tool list,
#         call, tool turn, answer: 95 tokens) fitting whole.
#   RL:   the same GRPO (150 steps x 16 prompts x 8 samples, lr 5e-5, β 0.04 in the loss) with --tools calculator,
#         --max_turns 3 and a budget of 64 tokens for the sampled and tool tokens together (48 without tools).
# The table: pass@1, pass@8, tool calls per answer, share of malformed calls, KL, share of answers cut by the budget,
# training time; the plot: training reward and tool calls per step (scripts/tools_report.py).
#
# Stages resume: a stage whose output directory holds its model is skipped. Runs go JOBS at a time (default 2), one
# thread each.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/tools}
PY=${PYTHON:-python}
SEEDS=${SEEDS:-0 1 2}
JOBS=${JOBS:-2}
TOOL_RATE=${TOOL_RATE:-0.2}
DATA=${DATA:-data/reasoning_tools}
if [ "${TINY:-0}" = "1" ]; then
  DATA_ARGS="--n_sft 400 --n_prompts 64 --n_eval_prompts 16"; SFT="--max_steps 20 --eval_interval 0"
  RL="--max_steps 2 --batch_size 2 --samples_per_prompt 4"
  EVAL="--samples_per_prompt 4 --pass_k 1,4"
else
  DATA_ARGS=""; SFT="--max_steps 2400 --eval_interval 400"
  RL="--max_steps 150 --batch_size 16 --samples_per_prompt 8"
  EVAL="--samples_per_prompt 8 --pass_k 1,8"
fi
TOOLS="--tools calculator --max_turns 3 --max_new_tokens 64"

run() { echo "+ $*"; "$@"; }
spawn() { while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done; ( "$@" ) & }
done_model() { [ -f "$1/model.safetensors" ]; }
mkdir -p "$OUT/tools"

# the tool-free arm: reasoning.sh's GRPO, as that script runs it
run env OUT="$OUT/notools" VARIANTS=grpo SEEDS="$SEEDS" JOBS="$JOBS" PYTHON="$PY" TINY="${TINY:-0}" \
  DATA="${FREE_DATA:-data/reasoning}" bash scripts/reasoning.sh

# the tool arm
run $PY -m nano_rlhf.tasks.reasoning --out_dir "$DATA" --tool_rate "$TOOL_RATE" $DATA_ARGS
T=$OUT/tools
if done_model "$T/sft"; then echo "reusing $T/sft"; else
  run $PY train_sft.py --data "$DATA/sft.jsonl" --eval_data "$DATA/sft_eval.jsonl" --out_dir "$T/sft" --overwrite \
    --save_interval 0 --block_size 128 $SFT
fi
timed_rl() {     # timed_rl SEED ARGS...: one RL stage, its wall-clock seconds into the seed's times.tsv
  local seed=$1 t0=$SECONDS; shift
  export OMP_NUM_THREADS=1
  run "$@"
  printf 'grpo_tools\t%s\n' $((SECONDS - t0)) >> "$T/seed$seed/times.tsv"
}
for seed in $SEEDS; do
  mkdir -p "$T/seed$seed"; touch "$T/seed$seed/times.tsv"
  if done_model "$T/seed$seed/grpo_tools"; then echo "reusing $T/seed$seed/grpo_tools"; continue; fi
  spawn timed_rl "$seed" $PY train_ppo.py --init "$T/sft" --prompts "$DATA/prompts.jsonl" \
    --eval_prompts "$DATA/eval_prompts.jsonl" --reward nano_rlhf.tasks.reasoning:reward --missing_eos_penalty none \
    --eval_interval 0 --eval_samples 16 --save_interval 0 --ppo_epochs 1 --num_minibatches 2 --lr 5e-5 $RL \
    --advantage grpo --kl_in_loss --kl_coef 0.04 $TOOLS --seed "$seed" --out_dir "$T/seed$seed/grpo_tools" --overwrite
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n; done

summaries=()
for seed in $SEEDS; do
  run $PY -m nano_rlhf.evaluate --model "$T/sft" "$T/seed$seed/grpo_tools" --ref "$T/sft" \
    --reward nano_rlhf.tasks.reasoning:reward --prompts "$DATA/eval_prompts.jsonl" $TOOLS $EVAL \
    --summary "$T/seed$seed/results.json" --overwrite --times "$T/seed$seed/times.tsv"
  summaries+=("$T/seed$seed/results.json")
done
run $PY -m nano_rlhf.summary --baseline sft --key pass@1 --out "$T/results.json" "${summaries[@]}"
run $PY scripts/tools_report.py --out_dir "$OUT" --json "$OUT/results.json" --png "$OUT/tools_curves.png"
