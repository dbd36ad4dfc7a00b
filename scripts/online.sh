#!/usr/bin/env bash
# Online DPO and DNO with a reward-model judge, against offline DPO at the same number of updates, several training
# seeds, on two tasks: the built-in reviews and scripts/recipes.py (a task outside the package: different prompts,
# answers of 4 to 13 words, its own reward model). The default (soft labels, the judge's own probability, on every
# pair, with the pairs the reward model was fitted to beside them) and the two defaults before it (the same online
# only; hard labels on best vs worst), so the table shows what each change bought. Every policy is judged by the
# task's gold reward on held-out prompts.
#
#   bash scripts/online.sh                          # both tasks, seeds 0 1 2, 150 updates (~75 min on 2 cores)
#   TASKS=recipes SEEDS=0 bash scripts/online.sh     # one task, one seed
#   STEPS=500 OUT=out/online500 bash scripts/online.sh   # the longer budget
#   TINY=1 bash scripts/online.sh                   # a smoke run of a minute or two
#   TRL_PYTHON=/tmp/trlenv/bin/python bash scripts/online.sh   # with TRL's online DPO (bench/trl_online_dpo.py)
#
# Stages resume: a stage whose output directory holds its model is skipped; each seed's evaluation scores every
# variant trained under OUT. Runs go JOBS at a time (default 2), one thread each. Each online step: 16 prompts x 4
# samples (every pair of a group, or best vs worst), by default also 16 of the reward model's pairs; offline DPO: 16
# pairs a step from the task's preference file. Everything else at the scripts' defaults.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-out/online}
PY=${PYTHON:-python}
SEEDS=${SEEDS:-0 1 2}
TASKS=${TASKS:-builtin recipes}
VARIANTS=${VARIANTS:-offline_dpo online_dpo dno online_dpo_online_only dno_iterative online_dpo_hard}
case " $VARIANTS " in *" trl_online_dpo "*) ;; *) if [ -n "${TRL_PYTHON:-}" ]; then VARIANTS="$VARIANTS trl_online_dpo"; fi ;; esac
STEPS=${STEPS:-150}
JOBS=${JOBS:-2}
if [ "${TINY:-0}" = "1" ]; then
  SFT="--max_steps 30 --eval_interval 0"; RM="--max_steps 10"; STEPS=2; EVAL="--batch_size 32"
  BUILTIN_DATA="--n_sft 600 --n_pref 400 --n_unpaired 400 --n_prompts 200 --n_eval_prompts 32 --n_listwise 200"
else
  SFT=""; RM=""; EVAL=""; BUILTIN_DATA=""
fi
ONLINE="--max_steps $STEPS --batch_size 16 --eval_interval 0 --save_interval 0"
declare -A METHOD=(
  [online_dpo]="train_online.py $ONLINE"
  [dno]="train_online.py $ONLINE --method dno"
  # DNO as its paper iterates: the reference becomes the policy every 50 steps (3 iterations in 150 steps)
  [dno_iterative]="train_online.py $ONLINE --method dno --ref_update_every 50"
  # the default before the hybrid objective: soft labels on every pair, no offline pairs, lr 5e-5
  [online_dpo_online_only]="train_online.py $ONLINE --offline_data= --lr 5e-5"
  # the first default: the order of best vs worst taken as certain (TRL's hard labels), online pairs only, lr 5e-5
  [online_dpo_hard]="train_online.py $ONLINE --labels hard --pairs best_worst --offline_data= --lr 5e-5"
  [dno_hard]="train_online.py $ONLINE --method dno --labels hard --pairs best_worst --offline_data= --lr 5e-5"
)

run() { echo "+ $*"; "$@"; }
spawn() { while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done; ( "$@" ) & }
done_model() { [ -f "$1/model.safetensors" ]; }
timed() {     # timed DIR NAME ARGS...: one stage, its wall-clock seconds into DIR/times.tsv
  local dir=$1 name=$2 t0=$SECONDS; shift 2
  export OMP_NUM_THREADS=1
  run "$@"
  printf '%s\t%s\n' "$name" $((SECONDS - t0)) >> "$dir/times.tsv"
}

for task in $TASKS; do
  T="$OUT/$task"; D="$T/data"; mkdir -p "$T"
  if [ "$task" = builtin ]; then
    run $PY -m nano_rlhf.tasks.synthetic --out_dir "$D" $BUILTIN_DATA
    GOLD=nano_rlhf.reward:gold
  else
    run $PY scripts/recipes.py "$D"
    GOLD=scripts/recipes.py:reward
  fi
  done_model "$T/sft" || run $PY train_sft.py --data "$D/sft.jsonl" --eval_data "$D/sft_eval.jsonl" --out_dir "$T/sft" \
    --overwrite --save_interval 0 $SFT
  done_model "$T/rm" || run $PY train_rm.py --init "$T/sft" --data "$D/preference.jsonl" \
    --eval_data "$D/preference_eval.jsonl" --out_dir "$T/rm" --overwrite $RM
  COMMON="--init $T/sft --prompts $D/prompts.jsonl --eval_prompts $D/eval_prompts.jsonl --judge $T/rm"
  for seed in $SEEDS; do
    S="$T/seed$seed"; mkdir -p "$S"; touch "$S/times.tsv"
    for v in $VARIANTS; do
      if done_model "$S/$v"; then echo "reusing $S/$v"; continue; fi
      if [ "$v" = trl_online_dpo ]; then
        spawn timed "$S" "$v" "$TRL_PYTHON" bench/trl_online_dpo.py --init "$T/sft" --prompts "$D/prompts.jsonl" \
          --judge "$T/rm" --max_steps "$STEPS" --batch_size 16 --seed "$seed" --out_dir "$S/$v"
      elif [ "$v" = offline_dpo ]; then
        spawn timed "$S" "$v" $PY train_dpo.py --init "$T/sft" --data "$D/preference.jsonl" \
          --eval_data "$D/preference_eval.jsonl" --max_steps "$STEPS" --batch_size 16 --eval_interval 0 \
          --save_interval 0 --seed "$seed" --out_dir "$S/$v" --overwrite
      else
        spawn timed "$S" "$v" $PY ${METHOD[$v]} $COMMON --seed "$seed" --out_dir "$S/$v" --overwrite
      fi
    done
  done
  while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n; done
  summaries=()
  for seed in $SEEDS; do
    S="$T/seed$seed"; models=("$T/sft")
    # every variant trained under OUT (an earlier call's too), so a later call adds rows instead of dropping them
    for v in offline_dpo online_dpo dno online_dpo_online_only dno_iterative online_dpo_hard dno_hard trl_online_dpo; do
      done_model "$S/$v" && models+=("$S/$v")
    done
    run $PY -m nano_rlhf.evaluate --model "${models[@]}" --ref "$T/sft" --reward_model "$T/rm" --reward "$GOLD" \
      --prompts "$D/eval_prompts.jsonl" --summary "$S/results.json" --overwrite --times "$S/times.tsv" $EVAL
    summaries+=("$S/results.json")
  done
  run $PY -m nano_rlhf.summary --baseline sft --key reward --out "$T/results.json" "${summaries[@]}"
done
case " $TASKS " in *" builtin "*)
  run $PY scripts/online_curves.py --out_dir "$OUT/builtin" --png "$OUT/online_curves.png" ;;
esac
