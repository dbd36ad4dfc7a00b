#!/usr/bin/env bash
# The survey's methods beyond the main pipeline, on the built-in task, then one table comparing them:
#   built-in data -> SFT and reward model (scripts/pipeline.sh's, reused when present) ->
#   offline: listwise (RRHF, PRO, LiPO-λ, and DPO on the same rankings as pairs), negative-only (NPO, D2O),
#            DRO, TDPO, PAFT (SFT and DPO-with-L1 from the same model, merged)
#   online:  online DPO (reward-model judge, and gold judge), DNO, SPPO, Nash-MD, CRINGE, SPO,
#            against offline DPO at the same number of policy updates -> evaluation, exactly as pipeline.sh
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
  SINGLE="--max_steps 6"; D2O="--max_steps 6"; PAFT_SFT="--max_steps 6 --eval_interval 0"
  ONLINE="--max_steps 3 --eval_interval 0"; OFFLINE_MATCH="--max_steps 3 --batch_size 8"; SPO="--max_steps 3 --eval_interval 0"
  EVAL="--batch_size 32"
else
  DATA_ARGS=""
  # equal compute for every method: 100 steps of 32 sequences (8 prompts x 4 completions, or 16 pairs)
  SFT=""; RM=""; LIST="--max_steps 100 --batch_size 8 --eval_interval 50"; PAIRS="--max_steps 100 --batch_size 16 --eval_interval 50"
  SINGLE="--max_steps 100 --batch_size 32 --eval_interval 50"     # one response a row: 32 sequences a step
  D2O="--max_steps 100 --batch_size 8 --num_samples 3 --eval_interval 50"   # (1 + 3) sequences a row
  PAFT_SFT="--max_steps 100 --eval_interval 50"
  # online: 40 updates, each on 8 prompts x 4 fresh samples; the offline DPO it is compared with makes 40 updates
  # of 8 pairs; SPO is GRPO with 8 prompts x 8 samples (its default), 25 updates
  ONLINE="--max_steps 40 --batch_size 8 --samples_per_prompt 4 --lr 1e-4 --eval_interval 0"
  OFFLINE_MATCH="--max_steps 40 --batch_size 8"; SPO="--max_steps 25 --eval_interval 0"
  EVAL=""
fi
export NANO_RLHF_DATA="$DATA"
LISTWISE="--data $DATA/listwise.jsonl --eval_data $DATA/listwise_eval.jsonl"

run() { echo "+ $*"; "$@"; }
mkdir -p "$OUT"
: > "$OUT/survey_times.tsv"
# timed NAME CMD...: run a training stage and record its wall-clock seconds (the table prints them beside each policy)
timed() { local name=$1 t0=$SECONDS; shift; run "$@"; printf '%s\t%s\n' "$name" $((SECONDS - t0)) >> "$OUT/survey_times.tsv"; }

run $PY -m nano_rlhf.tasks.synthetic --out_dir "$DATA" $DATA_ARGS
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
  timed $loss $TRAIN train_listwise.py --loss $loss --init "$OUT/sft" $LISTWISE --out_dir "$OUT/$loss" --overwrite $LIST
done
# the pairwise baseline on the same rankings: every pair with a higher score over a lower one (about 6 a prompt)
timed dpo_listwise $TRAIN train_dpo.py --loss dpo --init "$OUT/sft" $LISTWISE --listwise_pairs all --out_dir "$OUT/dpo_listwise" --overwrite $PAIRS
# single responses: NPO and D2O see only the undesirable half of unpaired.jsonl, DRO the scored file
# --lr 1e-4: the rate docs/results.md's NPO row was measured at (npo's default became the paper's 1e-5 later)
timed npo $TRAIN train_unpaired.py --method npo --lr 1e-4 --init "$OUT/sft" --out_dir "$OUT/npo" --overwrite $SINGLE
timed d2o $TRAIN train_unpaired.py --method d2o --init "$OUT/sft" --out_dir "$OUT/d2o" --overwrite $D2O
timed dro $TRAIN train_unpaired.py --method dro --init "$OUT/sft" --out_dir "$OUT/dro" --overwrite $SINGLE
timed tdpo $TRAIN train_dpo.py --loss tdpo --init "$OUT/sft" --out_dir "$OUT/tdpo" --overwrite $PAIRS
# PAFT: SFT and DPO (with an L1 pull towards the start) in parallel from the same model, then merged (TIES).
# The built-in task has no pretrained base, so the SFT model is the base both start from.
timed paft_sft $TRAIN train_sft.py --init "$OUT/sft" --data "$DATA/sft.jsonl" --eval_data "$DATA/sft_eval.jsonl" --out_dir "$OUT/paft_sft" --overwrite $PAFT_SFT
timed paft_dpo $TRAIN train_dpo.py --loss dpo --l1_coef 1e-4 --init "$OUT/sft" --out_dir "$OUT/paft_dpo" --overwrite $PAIRS
run $PY -m nano_rlhf.merge --base "$OUT/sft" --models "$OUT/paft_sft" "$OUT/paft_dpo" --method ties --out_dir "$OUT/paft" --overwrite
# online, judged by the trained reward model (and once by the gold reward: "online helps" vs "the judge is better");
# online DPO and DNO as the table was made: hard labels on best vs worst, online pairs only (the defaults since, soft
# labels on every pair with the judge's training pairs beside them, are scripts/online.sh's table)
PAIRWISE_AS_MEASURED="--labels hard --pairs best_worst --offline_data="
timed dpo_offline_matched $TRAIN train_dpo.py --loss dpo --init "$OUT/sft" --out_dir "$OUT/dpo_offline_matched" --overwrite $OFFLINE_MATCH
timed online_dpo $TRAIN train_online.py --method online_dpo --judge "$OUT/rm" --init "$OUT/sft" --out_dir "$OUT/online_dpo" --overwrite $ONLINE $PAIRWISE_AS_MEASURED
timed online_dpo_gold $TRAIN train_online.py --method online_dpo --judge gold --init "$OUT/sft" --out_dir "$OUT/online_dpo_gold" --overwrite $ONLINE $PAIRWISE_AS_MEASURED
timed dno $TRAIN train_online.py --method dno --judge "$OUT/rm" --ref_update_every 10 --init "$OUT/sft" --out_dir "$OUT/dno" --overwrite $ONLINE $PAIRWISE_AS_MEASURED
timed sppo $TRAIN train_online.py --method sppo --judge "$OUT/rm" --ref_update_every 10 --init "$OUT/sft" --out_dir "$OUT/sppo" --overwrite $ONLINE
timed nash_md $TRAIN train_online.py --method nash_md --judge "$OUT/rm" --init "$OUT/sft" --out_dir "$OUT/nash_md" --overwrite $ONLINE --samples_per_prompt 2
timed cringe $TRAIN train_online.py --method cringe --judge "$OUT/rm" --init "$OUT/sft" --out_dir "$OUT/cringe" --overwrite $ONLINE
timed spo $TRAIN train_ppo.py --advantage grpo --reward selfplay --judge "$OUT/rm" --init "$OUT/sft" --out_dir "$OUT/spo" --overwrite $SPO
POLICIES="rrhf pro lipo dpo_listwise npo d2o dro tdpo paft_sft paft_dpo paft dpo_offline_matched online_dpo online_dpo_gold dno sppo nash_md cringe spo"
run $PY -m nano_rlhf.evaluate --model "$OUT/sft" $(for p in $POLICIES; do echo "$OUT/$p"; done) \
  --baseline "$OUT/sft" --ref "$OUT/sft" --reward_model "$OUT/rm" --prompts "$DATA/eval_prompts.jsonl" \
  --summary "$OUT/survey.json" --overwrite --times "$OUT/survey_times.tsv" $EVAL
