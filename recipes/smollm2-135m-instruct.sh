#!/usr/bin/env bash
# Reproduces the drafter shipped in src/dspark/data/drafters/smollm2-135m-instruct (see its MODEL_CARD.md).
# Every step resumes after an interruption: rerun the script and it continues where it stopped.
#
# The legs, as the shipped drafter was made: (a) 1,149 steps on the target's own (Llama) layers from the first
# regenerated data set; (b) that drafter moved onto the portable Qwen3-style backbone (exportable to llama.cpp, vLLM
# and DeepSpec) and trained on for 150 steps with the second data set appended; (c) 260 more steps with the third
# (llama.cpp-regenerated) set appended and cross-entropy as the main loss term, then (d) the same run resumed to 600
# steps; (e) 1,700 steps more with the fourth set (assistant requests, code) appended; (f) 1,000 more with the fifth;
# (g) 950 more with the sixth; (h) 600 more on the same six sets with a batch of more, shorter samples and lower rates;
# (i) 600 more with the seventh set appended, the same recipe.
# By default all start from the regenerated data committed in data/ (the exact records the shipped drafter saw). REGENERATE=1 rebuilds the data from scratch instead: the prompt mix, then the target's answers on both cores
# for REGEN_SECONDS (records arrive in a machine-dependent order, so the result is similar, not identical), used by
# every leg.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/recipe}
mkdir -p "$RUN"
export OMP_NUM_THREADS=1
dspark() { .venv/bin/dspark "$@"; }

FIRST="$RUN/regen1.jsonl" DATA="$RUN/train.jsonl"
[ -f "$FIRST" ] || { zcat data/smollm2-135m-instruct-regen.jsonl.gz > "$FIRST.tmp" && mv "$FIRST.tmp" "$FIRST"; }
[ -f "$DATA" ] || { zcat data/smollm2-135m-instruct-regen.jsonl.gz data/smollm2-135m-instruct-regen2.jsonl.gz \
                    > "$DATA.tmp" && mv "$DATA.tmp" "$DATA"; }
ALL="$RUN/train3.jsonl"
[ -f "$ALL" ] || { zcat data/smollm2-135m-instruct-regen.jsonl.gz data/smollm2-135m-instruct-regen2.jsonl.gz \
                   data/smollm2-135m-instruct-regen3-llamacpp.jsonl.gz > "$ALL.tmp" && mv "$ALL.tmp" "$ALL"; }
if [ "${REGENERATE:-0}" = 1 ]; then
  DATA="$RUN/regen.jsonl" FIRST="$RUN/regen.jsonl" ALL="$RUN/regen.jsonl" ALL4="$RUN/regen.jsonl" ALL5="$RUN/regen.jsonl" \
    ALL6="$RUN/regen.jsonl"
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

# 3a. The target-family leg: 3 epochs from a feature cache built once, one thread (97 min on one Xeon core).
if [ ! -d "$RUN/drafter" ]; then
  if [ ! -f "$RUN/family/checkpoint/trainer_state.json" ]; then
    dspark train --data "$FIRST" --out "$RUN/family" --preset dspark --backbone family --num-draft-layers 2 \
      --markov-rank 64 --draft-vocab-size 8192 --target-topk 32 --num-anchors 256 --batch-size 4 --lr 1e-3 --epochs 3 \
      --feature-cache "$RUN/features" --eval-every 100 --save-every 100 --threads 1 --quiet
  else
    dspark train --out "$RUN/family" --resume --threads 1 --quiet
  fi
fi

# 3b. The portable leg: the same weights on Qwen3-style layers (new q/k norms start at one), 150 more steps on both
#     data sets at half the learning rate, float32 target run online, 2 threads (~19 s/step on 2 AVX2 cores, ~50 min).
export OMP_NUM_THREADS=2
if [ ! -f "$RUN/drafter/checkpoint/trainer_state.json" ]; then
  dspark train --data "$DATA" --out "$RUN/drafter" --init-from "$RUN/family/checkpoint" --backbone qwen3 \
    --target-topk 32 --num-anchors 256 --batch-size 4 --lr 5e-4 --max-steps 150 --target-dtype float32 --no-bf16 \
    --eval-every 50 --save-every 10 --threads 2 --quiet
else
  dspark train --out "$RUN/drafter" --resume --max-steps 150 --threads 2 --quiet
fi

# 3c. Leg 2 as shipped (bfloat16) continued on all three sets: cross-entropy on the greedy labels as the main term
#     (learned faster than the paper's 0.1 CE + 0.9 L1 here), the L1 term off; a fresh optimizer, so 10 % warm-up.
#     ~10-14 s/step on 2 AVX2 cores (the target's q is now scored once per position), ~55 min.
if [ ! -f "$RUN/leg3/checkpoint/trainer_state.json" ]; then
  [ -d "$RUN/leg2" ] || dspark export "$RUN/drafter/checkpoint" "$RUN/leg2" --dtype bfloat16
  dspark train --data "$ALL" --out "$RUN/leg3" --init-from "$RUN/leg2" --ce-weight 1.0 --tv-weight 0.0 \
    --target-topk 32 --num-anchors 256 --batch-size 4 --lr 5e-4 --warmup-ratio 0.1 --max-steps 260 \
    --target-dtype float32 --no-bf16 --eval-every 100 --save-every 10 --decode-eval-every 100 --threads 2 --quiet
else
  dspark train --out "$RUN/leg3" --resume --max-steps 260 --threads 2 --quiet
fi
# 3d. The same run resumed in its own folder (optimizer moments, data position and random state kept) for 340 more
#     steps on the same data: the cosine schedule stretched to 600 steps, so the learning rate returns to ~3.6e-4 at
#     step 260 and anneals again (the shipped run spent steps 261-270 on a 660-step stretch before settling on 600).
dspark train --out "$RUN/leg3" --resume --max-steps 600 --eval-every 100 --decode-eval-every 100 --threads 2 --quiet
# 3e. Leg 5: leg 3d as shipped (bfloat16) continued on all four sets, the fourth being MT-Bench-style assistant
#     requests and HumanEval-style code; from here on the precision follows the machine (the default): the shipped
#     legs 5-9 ran in bfloat16 on CPUs with native bfloat16 (1.5x float32 per step on an AMX Xeon); on an AVX2-only
#     EPYC a bfloat16 step took 5.5x as long as a float32 one, so float32 is chosen there; a fresh optimizer,
#     5 % warm-up, 1,700 steps (3.8 s/step on 2 AMX Xeon cores, 108 min). The shipped run was started as 2,400
#     steps and resumed with --max-steps 2000 at step 20 and 1700 at step 400 to fit the session; each resume
#     recomputes the cosine schedule (under 1 % of the learning rate at those points).
# The previous legs' training file with one more committed set appended (built once, atomically).
with_set() {  # OUT PREVIOUS SET.jsonl.gz
  [ -f "$1" ] || { { cat "$2"; zcat "$3"; } > "$1.tmp" && mv "$1.tmp" "$1"; }
}
ALL4=${ALL4:-$RUN/train1234.jsonl}
with_set "$ALL4" "$ALL" data/smollm2-135m-instruct-regen4-assist-llamacpp.jsonl.gz
if [ ! -f "$RUN/leg5/checkpoint/trainer_state.json" ]; then
  [ -d "$RUN/leg4" ] || dspark export "$RUN/leg3/checkpoint" "$RUN/leg4" --dtype bfloat16
  dspark train --data "$ALL4" --out "$RUN/leg5" --init-from "$RUN/leg4" --ce-weight 1.0 --tv-weight 0.0 \
    --target-topk 32 --num-anchors 256 --batch-size 4 --lr 5e-4 --warmup-ratio 0.05 --max-steps 1700 \
    --eval-every 300 --save-every 20 --decode-eval-every 600 --threads 2 --quiet
else
  dspark train --out "$RUN/leg5" --resume --max-steps 1700 --threads 2 --quiet
fi
# 3f. Leg 6: leg 5 as shipped continued on all five sets (the fifth: assistant requests and code answered by our engine
#     in bfloat16), bfloat16 as in 3e, 1,000 steps on ONE thread pinned to one core, since a second thread bought
#     only 1.2x (184 against 153 training tokens/s on an AVX-512-BF16 EPYC) and the other core regenerated the sixth
#     set meanwhile (6.7 s/step, ~100 min). The shipped run was started as 1,500 steps on two threads and resumed
#     (--resume --max-steps, --threads) with 1,200 at step 40, on one thread at step 100 and with 1,000 at step 160.
# A leg continuing the previous leg's bfloat16 export with leg 6's loss, run by LAUNCHER (the name of an array: one
# pinned thread, or torchrun over both cores); resumes where it stopped if already started.
PINNED=(taskset -c 0 .venv/bin/dspark)
BOTH_CORES=(.venv/bin/torchrun --standalone --nproc_per_node 2 -m dspark.cli)
continue_leg() {  # LAUNCHER PREVIOUS NEXT DATA STEPS [train flags: batch, learning rate, evaluations]
  local -n launch=$1
  local prev=$2 next=$3 data=$4 steps=$5
  shift 5
  if [ ! -f "$RUN/$next/checkpoint/trainer_state.json" ]; then
    [ -d "$RUN/$prev-export" ] || dspark export "$RUN/$prev/checkpoint" "$RUN/$prev-export" --dtype bfloat16
    OMP_NUM_THREADS=1 "${launch[@]}" train --data "$data" --out "$RUN/$next" --init-from "$RUN/$prev-export" \
      --ce-weight 1.0 --tv-weight 0.0 --target-topk 32 --warmup-ratio 0.05 --max-steps "$steps" \
      --save-every 20 --threads 1 --quiet "$@"
  else
    OMP_NUM_THREADS=1 "${launch[@]}" train --out "$RUN/$next" --resume --max-steps "$steps" --threads 1 --quiet
  fi
}
ALL5=${ALL5:-$RUN/train12345.jsonl}
with_set "$ALL5" "$ALL4" data/smollm2-135m-instruct-regen5-assist-bf16.jsonl.gz
LEG6_BATCH=(--num-anchors 256 --batch-size 4 --lr 5e-4)
continue_leg PINNED leg5 leg6 "$ALL5" 1000 "${LEG6_BATCH[@]}" --eval-every 300 --decode-eval-every 750
# 3g. Leg 7: leg 6 as shipped continued on all six sets (the sixth: more assistant requests and code from our engine
#     in bfloat16), the leg-6 recipe, 950 steps on one pinned thread (6-8 s/step, ~110 min).
ALL6=${ALL6:-$RUN/train123456.jsonl}
with_set "$ALL6" "$ALL5" data/smollm2-135m-instruct-regen6-assist-bf16.jsonl.gz
continue_leg PINNED leg6 leg7 "$ALL6" 950 "${LEG6_BATCH[@]}" --eval-every 475
# 3h. Leg 8: leg 7 as shipped, the same six sets, the best arm of the continue-levers ablation (64 anchors x 16
#     sequences per step, lr 1.5e-4, the layers copied from the target at a tenth of it), under torchrun on both
#     cores (8 sequences per process; ~410 training tokens/s against ~270 on one core), 600 steps (~9 s/step, ~90
#     min). The shipped run was started as 800 steps and resumed with 560 at step 40 and 600 at step 80.
continue_leg BOTH_CORES leg7 leg8 "$ALL6" 600 --num-anchors 64 --batch-size 8 --lr 1.5e-4 --copied-lr-scale 0.1 \
  --eval-every 300 --decode-eval-every 600
# 3i. Leg 9: leg 8 as shipped continued on all seven sets (the seventh: assistant requests, code and math from our
#     engine in bfloat16), leg 8's recipe and launcher, 600 steps (~8.9 s/step, ~90 min).
ALL7=${ALL7:-$RUN/train1234567.jsonl}
with_set "$ALL7" "$ALL6" data/smollm2-135m-instruct-regen7-assist-bf16.jsonl.gz
continue_leg BOTH_CORES leg8 leg9 "$ALL7" 600 --num-anchors 64 --batch-size 8 --lr 1.5e-4 --copied-lr-scale 0.1 \
  --eval-every 300
# 4. Calibrate the confidence head on held-out prompts (not the evaluation sets) and ship it in bfloat16.
OUT=${OUT:-$RUN/shipped}
dspark export "$RUN/leg9/checkpoint" "$OUT" --dtype bfloat16 --overwrite
dspark calibrate --drafter "$OUT" --data data/calibration-prompts.jsonl --limit 40 --max-new-tokens 64 --dtype float32 \
  --out "$OUT/calibration.json" --plot "$OUT/calibration.png"
