#!/usr/bin/env bash
# Reproduces the drafter shipped in src/dspark/data/drafters/smollm2-135m-instruct (see its MODEL_CARD.md).
# Every step resumes after an interruption: rerun the script and it continues where it stopped.
# CPU: each process is pinned to one core with one thread; two cores regenerate in parallel, then train with DDP.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/recipe}
PROMPTS=${PROMPTS:-20000}
mkdir -p "$RUN"
export OMP_NUM_THREADS=1
dspark() { .venv/bin/dspark "$@"; }

# 1. Prompt mix (chat / math / code / instructions), checked against the evaluation sets.
[ -f "$RUN/prompts.jsonl" ] || dspark prompts --out "$RUN/prompts.jsonl" --count "$PROMPTS" --seed 0

# 2. The target answers them (greedy, bfloat16), one half per core.
if [ ! -f "$RUN/regen.jsonl" ]; then
  head -n $((PROMPTS / 2)) "$RUN/prompts.jsonl" > "$RUN/prompts.a.jsonl"
  tail -n +$((PROMPTS / 2 + 1)) "$RUN/prompts.jsonl" > "$RUN/prompts.b.jsonl"
  for half in a b; do
    core=$([ $half = a ] && echo 0 || echo 1)
    taskset -c $core timeout "${REGEN_SECONDS:-3000}" .venv/bin/dspark regenerate --threads 1 --dtype bfloat16 \
      --batch-size 64 --max-new-tokens 384 --prompts "$RUN/prompts.$half.jsonl" --out "$RUN/regen.$half.jsonl" &
  done
  wait || true  # the time budget ends regeneration; whatever is written is complete records
  cat "$RUN/regen.a.jsonl" "$RUN/regen.b.jsonl" > "$RUN/regen.jsonl"
fi

# 3. Train with DDP on both cores from a feature cache built once.
TRAIN=(--data "$RUN/regen.jsonl" --out "$RUN/drafter" --preset dspark --num-draft-layers 2 --markov-rank 64
       --draft-vocab-size 8192 --target-topk 32 --num-anchors 256 --batch-size 4 --lr 1e-3
       --epochs "${EPOCHS:-4}" --feature-cache "$RUN/features" --eval-every 200 --save-every 100 --threads 1 --quiet)
if [ -f "$RUN/drafter/checkpoint/trainer_state.json" ]; then TRAIN=(--out "$RUN/drafter" --resume --threads 1 --quiet); fi
.venv/bin/torchrun --nproc_per_node=2 -m dspark.cli train "${TRAIN[@]}"

# 4. Ship it in bfloat16.
dspark export "$RUN/drafter/checkpoint" src/dspark/data/drafters/smollm2-135m-instruct --dtype bfloat16
