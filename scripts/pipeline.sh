#!/usr/bin/env bash
# The whole pipeline on the built-in task, then one table comparing every policy:
#   built-in data -> SFT -> reward model -> DPO family -> PPO (reward model) -> GRPO (gold reward) -> evaluation
#
#   bash scripts/pipeline.sh              # about 10 minutes on 2 CPU cores
#   NPROC=2 bash scripts/pipeline.sh      # every training stage under torchrun with 2 processes
#   TINY=1 bash scripts/pipeline.sh       # a smoke run of about a minute (what the tests run)
#   OUT=runs/a bash scripts/pipeline.sh   # another output directory (default: out)
#   SEED=1 OUT=runs/s1 bash scripts/pipeline.sh   # another training seed (the data and evaluation stay the same)
#
# Each command is printed before it runs ("+ ..."): copy any of them to rerun one stage by hand.
# Every training stage gets --overwrite: the pipeline is meant to be rerun, replacing the previous results.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-1}
OUT=${OUT:-out}
DATA=${DATA:-data}
PY=${PYTHON:-python}
SEED=${SEED:-0}
if [ "$NPROC" -gt 1 ]; then
  TRAIN="$PY -m torch.distributed.run --nproc_per_node $NPROC"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  TRAIN="$PY"
fi
# budgets: full run, or TINY=1 for a smoke test
if [ "${TINY:-0}" = "1" ]; then
  DATA_ARGS="--n_sft 600 --n_pref 400 --n_unpaired 400 --n_prompts 200 --n_eval_prompts 32"
  SFT="--max_steps 30 --eval_interval 0"; RM="--max_steps 10"; DPO="--max_steps 6"
  PPO="--max_steps 3 --eval_interval 0"; GRPO="--max_steps 3 --eval_interval 0"; EVAL="--batch_size 32"
  OVEROPT="--max_steps 3 --eval_interval 0"
else
  DATA_ARGS=""
  # PPO/GRPO sample 64 completions a step (8 prompts x 8) at their defaults: 30-60 steps fit the time budget
  SFT=""; RM=""; DPO="--max_steps 200"; PPO="--max_steps 30 --eval_interval 10"; GRPO="--max_steps 40"; EVAL=""
  OVEROPT="--max_steps 60 --eval_interval 5"
fi
# the training seed (initialisation, data order, sampling); evaluation keeps its own fixed seed
SFT="$SFT --seed $SEED"; RM="$RM --seed $SEED"; DPO="$DPO --seed $SEED"; PPO="$PPO --seed $SEED"
GRPO="$GRPO --seed $SEED"; OVEROPT="$OVEROPT --seed $SEED"
export NANO_RLHF_DATA="$DATA"

run() { echo "+ $*"; "$@"; }

run $PY -m nano_rlhf.tasks.synthetic --out_dir "$DATA" $DATA_ARGS
run $TRAIN train_sft.py --data "$DATA/sft.jsonl" --eval_data "$DATA/sft_eval.jsonl" --out_dir "$OUT/sft" --overwrite $SFT
run $TRAIN train_rm.py --init "$OUT/sft" --data "$DATA/preference.jsonl" --eval_data "$DATA/preference_eval.jsonl" --out_dir "$OUT/rm" --overwrite $RM
for loss in dpo ipo simpo orpo; do
  run $TRAIN train_dpo.py --loss $loss --init "$OUT/sft" --out_dir "$OUT/$loss" --overwrite $DPO
done
run $TRAIN train_unpaired.py --method kto --init "$OUT/sft" --out_dir "$OUT/kto" --overwrite $DPO
run $TRAIN train_ppo.py --init "$OUT/sft" --reward_model "$OUT/rm" --out_dir "$OUT/ppo" --overwrite $PPO
run $TRAIN train_ppo.py --advantage grpo --reward gold --init "$OUT/sft" --out_dir "$OUT/grpo" --overwrite $GRPO
# the same PPO with a 5x smaller KL coefficient, for longer: the reward model gets over-optimised
run $TRAIN train_ppo.py --init "$OUT/sft" --reward_model "$OUT/rm" --out_dir "$OUT/ppo_overopt" --kl_coef 0.02 --overwrite $OVEROPT
run $PY -m nano_rlhf.evaluate --model "$OUT/sft" "$OUT/dpo" "$OUT/ipo" "$OUT/simpo" "$OUT/orpo" "$OUT/kto" "$OUT/ppo" "$OUT/grpo" "$OUT/ppo_overopt" \
  --baseline "$OUT/sft" --ref "$OUT/sft" --reward_model "$OUT/rm" --prompts "$DATA/eval_prompts.jsonl" \
  --summary "$OUT/results.json" --overwrite $EVAL
run $PY -m nano_rlhf.plot --out_dir "$OUT"
