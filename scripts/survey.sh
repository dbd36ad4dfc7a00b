#!/usr/bin/env bash
# The survey's methods beyond the main pipeline, on the built-in task, then one table comparing them:
#   built-in data -> SFT and reward model (scripts/pipeline.sh's, reused when present) -> listwise methods
#   (RRHF, PRO, LiPO-λ, and DPO on the same listwise data as pairs) -> evaluation, exactly as pipeline.sh
#
#   bash scripts/survey.sh              # a few minutes on 2 CPU cores after pipeline.sh (SFT + RM add ~3 min)
#   NPROC=2 bash scripts/survey.sh      # every training stage under torchrun with 2 processes
#   TINY=1 bash scripts/survey.sh       # a smoke run of about a minute
#   OUT=runs/a bash scripts/survey.sh   # another output directory (default: out)
#
# SFT and the reward model are trained here only when $OUT/sft or $OUT/rm holds no model yet, with the same
# commands and seeds as pipeline.sh, so the policies start from the same SFT model either way. The data step
# rewrites the built-in task at its seed: every file comes out byte for byte as before (plus the listwise ones).
# Each command is printed before it runs ("+ ..."). Results: $OUT/survey.json (pipeline.sh's stay in results.json).
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-1}
OUT=${OUT:-out}
DATA=${DATA:-data}
PY=${PYTHON:-python}
if [ "$NPROC" -gt 1 ]; then
  TRAIN="$PY -m torch.distributed.run --nproc_per_node $NPROC"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  TRAIN="$PY"
fi
# budgets: as pipeline.sh for the shared stages
if [ "${TINY:-0}" = "1" ]; then
  # pipeline.sh's TINY data (the same files), with fewer listwise rows: their eval set is what a tiny run costs
  DATA_ARGS="--n_sft 600 --n_pref 400 --n_unpaired 400 --n_prompts 200 --n_eval_prompts 32 --n_listwise 200"
  SFT="--max_steps 30 --eval_interval 0"; RM="--max_steps 10"; LIST="--max_steps 6"; PAIRS="--max_steps 6"
  EVAL="--batch_size 32"
else
  DATA_ARGS=""
  # equal compute for every method: 100 steps of 32 sequences (8 prompts x 4 completions, or 16 pairs)
  SFT=""; RM=""; LIST="--max_steps 100 --batch_size 8 --eval_interval 50"; PAIRS="--max_steps 100 --batch_size 16 --eval_interval 50"
  EVAL=""
fi
export NANO_RLHF_DATA="$DATA"
LISTWISE="--data $DATA/listwise.jsonl --eval_data $DATA/listwise_eval.jsonl"

run() { echo "+ $*"; "$@"; }

run $PY -m nano_rlhf.synthetic --out_dir "$DATA" $DATA_ARGS
if [ -f "$OUT/sft/model.safetensors" ]; then
  echo "reusing $OUT/sft"
else
  run $TRAIN train_sft.py --data "$DATA/sft.jsonl" --eval_data "$DATA/sft_eval.jsonl" --out_dir "$OUT/sft" --overwrite $SFT
fi
if [ -f "$OUT/rm/model.safetensors" ]; then
  echo "reusing $OUT/rm"
else
  run $TRAIN train_rm.py --init "$OUT/sft" --data "$DATA/preference.jsonl" --eval_data "$DATA/preference_eval.jsonl" --out_dir "$OUT/rm" --overwrite $RM
fi
for loss in rrhf pro lipo; do
  run $TRAIN train_listwise.py --loss $loss --init "$OUT/sft" $LISTWISE --out_dir "$OUT/$loss" --overwrite $LIST
done
# the pairwise baseline on the same rankings: every pair with a higher score over a lower one (about 6 a prompt)
run $TRAIN train_dpo.py --loss dpo --init "$OUT/sft" $LISTWISE --listwise_pairs all --out_dir "$OUT/dpo_listwise" --overwrite $PAIRS
run $PY -m nano_rlhf.evaluate --model "$OUT/sft" "$OUT/rrhf" "$OUT/pro" "$OUT/lipo" "$OUT/dpo_listwise" \
  --baseline "$OUT/sft" --ref "$OUT/sft" --reward_model "$OUT/rm" --prompts "$DATA/eval_prompts.jsonl" \
  --summary "$OUT/survey.json" $EVAL
