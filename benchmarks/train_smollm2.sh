#!/usr/bin/env bash
# Train and evaluate the SmolLM2-135M-Instruct DFlash drafter (block 16) on one or more GPUs, in resumable pieces.
#
#   OUT=runs/smollm2 [NPROC=8] [RUN_SECONDS=480] bash benchmarks/train_smollm2.sh [PROMPTS_DIR]
#
# Run the same command again until it prints "finished": every invocation continues where the last one stopped
# (prompt export, response cache and training checkpoints all resume), so the recipe fits jobs of a few minutes.
# Phases:
#  1. prompts: PROMPTS_DIR holds train.jsonl + mtbench/humaneval/gsm8k.jsonl; when omitted they are exported once
#     from the installed packages: every ShareGPT user turn, GPQA Diamond and AIME 2025 (SOURCES), the MT-Bench /
#     HumanEval / GSM8K prompts excluded from train.jsonl (40 of each held out for the eval).
#  2. responses: regenerated greedily by SmolLM2 itself (MAX_NEW new tokens, prompts <= 384 tokens). With
#     NPROC > 1 the ranks generate disjoint shards. RESPONSE_SERVER=http://HOST:PORT sends them to a running SGLang
#     server of the target instead (python -m sglang.launch_server --model-path <converted SmolLM2>; much faster).
#     GEN_SECONDS=S caps this phase in one invocation (the next one continues the cache). SAMPLES=K GEN_TEMP=T
#     (T > 0) draw K responses per prompt; a greedy cache keeps its responses and gains K - 1 samples each.
#  3. training: data-parallel over NPROC GPUs (torchrun), --resume from the newest OUT/work/drafter/checkpoint-*;
#     RUN_SECONDS=S stops one invocation after S seconds of training (a checkpoint is written). BATCH is the
#     global batch (sequences per optimizer step); GRAD_ACCUM splits each rank's share into micro-batches.
#  4. once the schedule is complete: the drafter is copied to OUT/drafter, its curves plotted (OUT/train.png) and
#     tau measured on the held-out sets (block 16 and 8, temperature 0 and 1; EVAL_SECONDS=0 skips it).
# CACHE=path.jsonl.gz keeps the regenerated responses gzip-compressed (to carry them to another machine).
# INIT_FROM=DIR starts the weights from a saved drafter (same config) instead of a fresh init.
set -euo pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-runs/smollm2-dflash}
WORK=${WORK:-$OUT/work}
NPROC=${NPROC:-1}
CACHE=${CACHE:-$WORK/responses.jsonl.gz}
EVAL_PLOT=${EVAL_PLOT-$OUT/eval.png}  # set EVAL_PLOT= to skip the plot
PROMPTS=${1:-}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
if [ -z "$PROMPTS" ]; then
  PROMPTS=$WORK/prompts
  [ -f "$PROMPTS/gsm8k.jsonl" ] || $PY -m sglang_dflash.data --out "$PROMPTS" --num-eval 40 \
    --sources "${SOURCES:-sharegpt,gpqa,aime2025}"
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu', 'x', torch.cuda.device_count())"
$PY -m sglang_dflash.assets

if [ "$NPROC" -gt 1 ]; then
  TRAIN=(torchrun --standalone --nproc-per-node "$NPROC" -m sglang_dflash.train)
else
  TRAIN=($PY -m sglang_dflash.train)
fi
COMMON=(--target smollm2 --prompts "$PROMPTS/train.jsonl" --out "$WORK/drafter" --cache "$CACHE"
  --log-json "$OUT/train_log.json" --seed 0 --max-prompt-tokens 384 --max-new-tokens "${MAX_NEW:-640}"
  --gen-batch-size "${GEN_BATCH:-768}" --gen-temperature "${GEN_TEMP:-0}" --samples-per-prompt "${SAMPLES:-1}"
  --max-seq-len 1024
  ${RESPONSE_SERVER:+--response-server "$RESPONSE_SERVER"})

# 2. responses (resumable cache; nothing left to do once complete)
"${TRAIN[@]}" "${COMMON[@]}" --generate-only ${GEN_SECONDS:+--max-gen-seconds "$GEN_SECONDS"}

# 3. training on the cached responses (--max-gen-seconds 0: generate nothing more here)
"${TRAIN[@]}" "${COMMON[@]}" --max-gen-seconds 0 --resume ${RUN_SECONDS:+--stop-after-seconds "$RUN_SECONDS"} \
  --block-size 16 --num-draft-layers "${DRAFT_LAYERS:-5}" --gamma 7 \
  --steps "${STEPS:-10000}" --batch-size "${BATCH:-64}" --grad-accum "${GRAD_ACCUM:-1}" \
  --anchors-per-seq "${ANCHORS:-64}" --lr "${LR:-6e-4}" --warmup-steps "${WARMUP:-300}" --grad-clip 1.0 \
  --checkpoint-every "${CKPT_EVERY:-500}" --log-every 25 ${INIT_FROM:+--init-from "$INIT_FROM"}
if ! $PY -c "import json, sys; sys.exit(not json.load(open('$OUT/train_log.json'))['finished'])"; then
  echo "training not finished: $OUT/train_log.json has the curves so far; run this command again to continue"
  exit 0
fi
echo "finished: $WORK/drafter"
rm -rf "$OUT/drafter" && mkdir -p "$OUT/drafter"
cp "$WORK"/drafter/*.json "$WORK"/drafter/*.safetensors "$OUT/drafter/"
rm -f "$OUT/drafter/train_log.json"
$PY benchmarks/plot_train_log.py "$OUT/train_log.json" --out "$OUT/train.png"

# 4. tau on held-out sets; config-major order and incremental JSON, so a capped run keeps what finished
# (EVAL_SECONDS=0 skips it, e.g. to evaluate elsewhere with the same sglang_dflash.eval command)
[ "${EVAL_SECONDS:-300}" = 0 ] && exit 0
timeout "${EVAL_SECONDS:-300}" $PY -m sglang_dflash.eval --target smollm2 --draft "$OUT/drafter" \
  --prompts-dir "$PROMPTS" --datasets mtbench,humaneval,gsm8k --block-sizes 16,8 --temperatures 0,1 \
  --num-prompts "${EVAL_PROMPTS:-40}" --max-new-tokens "${EVAL_NEW:-128}" --batch-size 40 \
  --out "$OUT/eval.json" ${EVAL_PLOT:+--plot "$EVAL_PLOT"} || echo "eval stopped early (exit $?); partial $OUT/eval.json kept"
