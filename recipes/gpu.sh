#!/usr/bin/env bash
# The GPU recipe (issue 15), as run on one H200 for legs 10-11 and 13 of the shipped drafter (model card): the target
# answers new prompts on the GPU for a fixed time, then the shipped drafter is continued on every committed set plus
# those answers, one leg per entry of STEPS. Resumable: rerun the same command after any stop.
#
#   bash recipes/gpu.sh                                    # RUN=runs/gpu
#   REGEN_MINUTES=0 STEPS="500 700" bash recipes/gpu.sh    # knobs: REGEN_MINUTES, SHARDS, SEED, MIX, STEPS, TRAIN_MINUTES,
#                                                          #        BATCH, LR, INIT, ADD_LAYERS, WIDEN_RANK, RUN, PY
#   TRAIN_MINUTES=4 STEPS=100000 bash recipes/gpu.sh       # one leg that fits 4 minutes of steps (a fixed lease)
#   SHARDS=4 REGEN_MINUTES=4 STEPS=0 bash recipes/gpu.sh   # answer only, four processes sharing the GPU
#
# It needs torch with CUDA (`pip install torch==<version>` from the CUDA index on a GPU machine, or an image that has
# it: PY=python3 with PYTHONPATH=src); the target comes from its package as everywhere, nothing is downloaded. On the
# H200 one regeneration process ran at 3.8k tokens/s (batch 512); four (SHARDS=4) at 4.9k each, 4.05M tokens in 3.5
# minutes, with the GPU's memory full (one shard's attention kernel then failed for want of workspace, so each shard
# is retried once, continuing where it stopped). Training: 0.2 s a step (64 sequences x 64 blocks) after ~20 slower
# warm-up steps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUN=${RUN:-runs/gpu}
mkdir -p "$RUN"
dspark() { "$PY" -m dspark.cli "$@"; }

# 1. New prompts (none that a committed set or the calibration prompts already hold), answered greedily in bfloat16
#    on the GPU by SHARDS processes at once (one process leaves the GPU mostly idle: each step waits on Python), each
#    on every SHARDS-th prompt; after REGEN_MINUTES no conversation starts, and a rerun continues.
SHARDS=${SHARDS:-1}
if [ "${REGEN_MINUTES:-3}" != 0 ]; then
  [ -f "$RUN/prompts.jsonl" ] || dspark prompts --out "$RUN/prompts.jsonl" --count 40000 --seed "${SEED:-16}" \
    --mix "${MIX:-assist=0.5,code=0.15,library=0.2,math=0.15}" --exclude data/*regen*.jsonl.gz data/calibration-prompts.jsonl
  pids=()
  for ((i = 0; i < SHARDS; i++)); do
    [ -f "$RUN/prompts-$i-of-$SHARDS.jsonl" ] || awk -v n="$SHARDS" -v i="$i" '(NR - 1) % n == i' "$RUN/prompts.jsonl" \
      > "$RUN/prompts-$i-of-$SHARDS.jsonl"
    regen=(dspark regenerate --prompts "$RUN/prompts-$i-of-$SHARDS.jsonl" --out "$RUN/regen-$i-of-$SHARDS.jsonl"
           --device auto --batch-size 512 --max-new-tokens 384 --max-minutes "${REGEN_MINUTES:-3}")
    { "${regen[@]}" || "${regen[@]}"; } &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # each one's failure stops the recipe
fi
[ "${STEPS:-}" != 0 ] || exit 0  # STEPS=0: answer only
DATA="$RUN/train.jsonl"
{ zcat data/smollm2-135m-instruct-regen*.jsonl.gz; cat "$RUN"/regen*.jsonl 2>/dev/null || true; } > "$DATA.tmp"
mv "$DATA.tmp" "$DATA"

# 2. Continue the drafter, one leg per entry of STEPS, each from the export of the one before (the lineage records
#    every leg); the flags of the CPU legs 8-9 with 4x the sequences per step and twice the learning rate.
#    ADD_LAYERS=N deepens the first leg's drafter by N layers that start as identities (--add-draft-layers); on
#    CPU budgets (1.5-1.7M tokens) 3 and 4 layers ended level with 2 (model card), so it is off by default.
#    WIDEN_RANK widens the first leg's Markov head (--widen-markov-rank; 0 keeps it): from scratch at equal steps the
#    paper's rank 256 beat the shipped drafter's 64 by 0.065 real τ (docs/experiments.md); a continuation needs a
#    leg's worth of new data to show it.
PREV=${INIT:-src/dspark/data/drafters/smollm2-135m-instruct}
LEG=0
for STEPS_OF_LEG in ${STEPS:-500 700}; do
  LEG=$((LEG + 1))
  OUTDIR="$RUN/leg$LEG"
  if [ -f "$OUTDIR/checkpoint/trainer_state.json" ]; then
    dspark train --out "$OUTDIR" --resume --quiet
  else
    dspark train --data "$DATA" --out "$OUTDIR" --init-from "$PREV" --device auto --ce-weight 1.0 --tv-weight 0.0 \
      --target-topk 32 --warmup-ratio 0.05 --num-anchors 64 --batch-size "${BATCH:-64}" --lr "${LR:-3e-4}" \
      --copied-lr-scale 0.1 --max-steps "$STEPS_OF_LEG" --max-minutes "${TRAIN_MINUTES:-0}" \
      --add-draft-layers "$([ $LEG = 1 ] && echo "${ADD_LAYERS:-0}" || echo 0)" \
      --widen-markov-rank "$([ $LEG = 1 ] && echo "${WIDEN_RANK:-256}" || echo 0)" \
      --eval-every "$STEPS_OF_LEG" --save-every 50 --quiet
  fi
  dspark export "$OUTDIR/checkpoint" "$OUTDIR-export" --dtype bfloat16 --overwrite
  PREV="$OUTDIR-export"
done
echo "drafter: $PREV"
echo "next: dspark calibrate --drafter $PREV --data data/calibration-prompts.jsonl --limit 40 --max-new-tokens 64 --dtype float32 --out $PREV/calibration.json"
