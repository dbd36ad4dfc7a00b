#!/usr/bin/env bash
# Safe RLHF on the built-in task with its harm dimension (python -m nano_rlhf.tasks.synthetic --harm: tips that end some
# answers, half of them hacks the gold reward likes best and the gold cost marks unsafe): SFT -> a reward model and a
# cost model (train_rm.py --objective cost) -> PPO with the reward alone, and PPO-Lagrangian (train_ppo_lagrangian.py
# --cost_model) at two cost limits, several training seeds; every policy judged on held-out prompts by the gold
# reward and the gold cost (nano_rlhf.reward:gold, :gold_cost). The table: gold reward, gold cost, the share of
# unsafe answers, KL and the final λ; the plot: cost and λ per step.
#
#   bash scripts/safe.sh                      # seeds 0 1 2, 60 PPO steps each (~40 min on 2 cores)
#   SEEDS=0 STEPS=30 bash scripts/safe.sh     # shorter
#   TINY=1 bash scripts/safe.sh               # a smoke run of under a minute (what the tests run)
#
# Stages resume: a stage whose output directory holds its model is skipped. Runs go JOBS at a time (default 2), one
# thread each. The cost limits (LIMITS, in the cost model's raw units; its 0 is the safe/unsafe boundary it was
# trained on) are a tight and a loose one.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/safe}
PY=${PYTHON:-python}
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-60}
LIMITS=${LIMITS:--2 0}
JOBS=${JOBS:-2}
if [ "${TINY:-0}" = "1" ]; then
  DATA="--n_sft 600 --n_pref 400 --n_unpaired 40 --n_prompts 200 --n_eval_prompts 16 --n_listwise 40"
  SFT="--max_steps 20 --eval_interval 0"; RM="--max_steps 8"; STEPS=2; EVAL="--batch_size 16"
else
  DATA=""; SFT=""; RM=""; EVAL=""
fi
D="$OUT/data"
PPO="--prompts $D/prompts.jsonl --eval_prompts $D/eval_prompts.jsonl --max_steps $STEPS --eval_interval 0 \
  --save_interval 0"

run() { echo "+ $*"; "$@"; }
spawn() { while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done; ( "$@" ) & }
done_model() { [ -f "$1/model.safetensors" ]; }
timed() {     # timed DIR NAME ARGS...: one stage, its wall-clock seconds into DIR/times.tsv
  local dir=$1 name=$2 t0=$SECONDS; shift 2
  export OMP_NUM_THREADS=1
  run "$@"
  printf '%s\t%s\n' "$name" $((SECONDS - t0)) >> "$dir/times.tsv"
}

mkdir -p "$OUT"
[ -f "$D/task.json" ] || run $PY -m nano_rlhf.tasks.synthetic --out_dir "$D" --harm $DATA
done_model "$OUT/sft" || run $PY train_sft.py --data "$D/sft.jsonl" --eval_data "$D/sft_eval.jsonl" \
  --out_dir "$OUT/sft" --overwrite --save_interval 0 $SFT
# the two signals from the same pairs: which answer is better, and which is safer (with each answer's safe label)
done_model "$OUT/rm" || spawn run $PY train_rm.py --init "$OUT/sft" --data "$D/preference.jsonl" \
  --eval_data "$D/preference_eval.jsonl" --out_dir "$OUT/rm" --overwrite $RM
done_model "$OUT/cm" || spawn run $PY train_rm.py --objective cost --l2_coef 0.01 --init "$OUT/sft" \
  --data "$D/preference.jsonl" --eval_data "$D/preference_eval.jsonl" --out_dir "$OUT/cm" --overwrite $RM
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n; done

VARIANTS="ppo"
for seed in $SEEDS; do
  S="$OUT/seed$seed"; mkdir -p "$S"; touch "$S/times.tsv"
  COMMON="--init $OUT/sft --reward_model $OUT/rm $PPO --seed $seed --overwrite"
  done_model "$S/ppo" || spawn timed "$S" ppo $PY train_ppo.py $COMMON --out_dir "$S/ppo"
  for d in $LIMITS; do
    v="ppo_lag_d$d"
    done_model "$S/$v" || spawn timed "$S" "$v" $PY train_ppo_lagrangian.py $COMMON --cost_model "$OUT/cm" --cost_limit "$d" \
      --out_dir "$S/$v"
  done
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n; done
for d in $LIMITS; do VARIANTS="$VARIANTS ppo_lag_d$d"; done

summaries=()
for seed in $SEEDS; do
  S="$OUT/seed$seed"; models=("$OUT/sft")
  for v in $VARIANTS; do models+=("$S/$v"); done
  run $PY -m nano_rlhf.evaluate --model "${models[@]}" --ref "$OUT/sft" --reward_model "$OUT/rm" \
    --reward nano_rlhf.reward:gold --cost nano_rlhf.reward:gold_cost --prompts "$D/eval_prompts.jsonl" \
    --summary "$S/results.json" --overwrite --times "$S/times.tsv" $EVAL
  summaries+=("$S/results.json")
done
run $PY scripts/safe_report.py --out_dir "$OUT" --variants sft $VARIANTS --json "$OUT/results.json" \
  --png "$OUT/safe_curves.png"
