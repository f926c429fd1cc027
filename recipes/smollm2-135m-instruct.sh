#!/usr/bin/env bash
# Reproduces the drafter shipped in src/dspark/data/drafters/smollm2-135m-instruct (see its MODEL_CARD.md).
# Every step resumes after an interruption: rerun the script and it continues where it stopped.
#
# By default training starts from the regenerated data committed in data/ (the exact records the shipped drafter
# saw). REGENERATE=1 rebuilds that data from scratch instead: the prompt mix, then the target's answers on both
# cores for REGEN_SECONDS (records arrive in a machine-dependent order, so the result is similar, not identical).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/recipe}
mkdir -p "$RUN"
export OMP_NUM_THREADS=1
dspark() { .venv/bin/dspark "$@"; }

DATA=data/smollm2-135m-instruct-regen.jsonl.gz
if [ "${REGENERATE:-0}" = 1 ]; then
  DATA="$RUN/regen.jsonl"
  # 1. Prompt mix (chat / math / code / instructions), checked against the evaluation sets.
  [ -f "$RUN/prompts.jsonl" ] || dspark prompts --out "$RUN/prompts.jsonl" --count 20000 --seed 0
  # 2. The target answers them (greedy, bfloat16), one half per core, for a fixed time budget.
  if [ ! -f "$DATA" ]; then
    half=$(( $(wc -l < "$RUN/prompts.jsonl") / 2 ))
    head -n "$half" "$RUN/prompts.jsonl" > "$RUN/prompts.a.jsonl"
    tail -n +$((half + 1)) "$RUN/prompts.jsonl" > "$RUN/prompts.b.jsonl"
    for part in a b; do
      core=$([ $part = a ] && echo 0 || echo 1)
      taskset -c $core timeout "${REGEN_SECONDS:-2700}" .venv/bin/dspark regenerate --threads 1 --dtype bfloat16 \
        --batch-size 64 --max-new-tokens 384 --prompts "$RUN/prompts.$part.jsonl" --out "$RUN/regen.$part.jsonl" &
    done
    wait || true  # the time budget ends regeneration; what is written is complete records
    cat "$RUN/regen.a.jsonl" "$RUN/regen.b.jsonl" > "$DATA"
  fi
fi

# 3. Train one process on one core from a feature cache built once (the shipped run; ~1150 steps, ~85 min).
#    With two free cores, `.venv/bin/torchrun --nproc_per_node=2 -m dspark.cli train ...` halves the wall time
#    (global batch 8 instead of 4, so the curve is not step-for-step the same).
TRAIN=(--data "$DATA" --out "$RUN/drafter" --preset dspark --num-draft-layers 2 --markov-rank 64
       --draft-vocab-size 8192 --target-topk 32 --num-anchors 256 --batch-size 4 --lr 1e-3 --epochs 3
       --feature-cache "$RUN/features" --eval-every 100 --save-every 100 --threads 1 --quiet)
if [ -f "$RUN/drafter/checkpoint/trainer_state.json" ]; then TRAIN=(--out "$RUN/drafter" --resume --threads 1 --quiet); fi
dspark train "${TRAIN[@]}"

# 4. Calibrate the confidence head on held-out prompts (not the evaluation sets) and ship it in bfloat16.
OUT=${OUT:-$RUN/shipped}
dspark export "$RUN/drafter/checkpoint" "$OUT" --dtype bfloat16 --overwrite
dspark calibrate --drafter "$OUT" --data data/calibration-prompts.jsonl --limit 40 --max-new-tokens 64 --dtype float32 \
  --out "$OUT/calibration.json" --plot "$OUT/calibration.png"
