#!/usr/bin/env bash
# Reproduces the drafter shipped in src/dspark/data/drafters/smollm2-135m-instruct (see its MODEL_CARD.md).
# Every step resumes after an interruption: rerun the script and it continues where it stopped.
#
# By default training starts from the regenerated data committed in data/ (the exact records the shipped drafter
# saw: regen then regen2, 2,417 answers). REGENERATE=1 rebuilds that data from scratch instead: the prompt mix, then the target's answers on both
# cores for REGEN_SECONDS (records arrive in a machine-dependent order, so the result is similar, not identical).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/recipe}
mkdir -p "$RUN"
export OMP_NUM_THREADS=1
dspark() { .venv/bin/dspark "$@"; }

DATA="$RUN/train.jsonl"
[ -f "$DATA" ] || { zcat data/smollm2-135m-instruct-regen.jsonl.gz data/smollm2-135m-instruct-regen2.jsonl.gz \
                    > "$DATA.tmp" && mv "$DATA.tmp" "$DATA"; }
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

# 3. Train from a feature cache built once (float32 target: exact on every CPU; 70 min on one core), on 2 threads.
#    The shipped run had two legs: 450 steps (cosine schedule over 450), then the same run resumed to 1,150 steps
#    (the schedule recomputed over 1,150: a warm restart), 5.6-7 s/step on 2 AVX2 cores, ~2 h in all.
#    Each leg resumes after a kill: rerun the script.
TRAIN=(--data "$DATA" --out "$RUN/drafter" --preset dspark --backbone qwen3 --num-draft-layers 2 --markov-rank 64
       --draft-vocab-size 8192 --target-topk 32 --num-anchors 256 --batch-size 4 --lr 1e-3 --max-steps 450
       --target-dtype float32 --no-bf16 --feature-cache "$RUN/features" --eval-every 100 --save-every 50
       --threads 2 --quiet)
step() { .venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1]))['loop']['step'])" \
           "$RUN/drafter/checkpoint/trainer_state.json" 2>/dev/null || echo 0; }
export OMP_NUM_THREADS=2
if [ ! -f "$RUN/drafter/checkpoint/trainer_state.json" ]; then dspark train "${TRAIN[@]}"; fi
if [ "$(step)" -lt 450 ]; then dspark train --out "$RUN/drafter" --resume --max-steps 450 --threads 2 --quiet; fi
dspark train --out "$RUN/drafter" --resume --max-steps 1150 --threads 2 --quiet

# 4. Calibrate the confidence head on held-out prompts (not the evaluation sets) and ship it in bfloat16.
OUT=${OUT:-$RUN/shipped}
dspark export "$RUN/drafter/checkpoint" "$OUT" --dtype bfloat16 --overwrite
dspark calibrate --drafter "$OUT" --data data/calibration-prompts.jsonl --limit 40 --max-new-tokens 64 --dtype float32 \
  --out "$OUT/calibration.json" --plot "$OUT/calibration.png"
