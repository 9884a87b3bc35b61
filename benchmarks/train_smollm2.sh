#!/usr/bin/env bash
# Train and evaluate the bundled SmolLM2-135M-Instruct DFlash drafter (block 16) on one GPU.
#
#   OUT=runs/smollm2 bash benchmarks/train_smollm2.sh [PROMPTS_DIR]
#
# PROMPTS_DIR holds train.jsonl + mtbench/humaneval/gsm8k.jsonl as written by
#   python -m sglang_dflash.data --out PROMPTS_DIR --num-eval 40
# (exported on the fly from the installed dataset packages when omitted).
# Steps: convert the GGUF target (sglang_dflash.assets), regenerate ShareGPT responses with SmolLM2 itself
# (greedy, eval sets excluded), train the drafter, measure tau (block 16 and 8, temperature 0 and 1).
# RESPONSE_SERVER=http://HOST:PORT regenerates the responses through a running SGLang server of the target
# (python -m sglang.launch_server --model-path <converted SmolLM2>) instead of transformers' generate.
# CACHE=path.jsonl.gz keeps the regenerated responses gzip-compressed (to carry them to another machine).
# GEN_SECONDS / TRAIN_SECONDS / EVAL_SECONDS cap the phases (the run that produced the bundled drafter used the
# defaults below on one H200; train_log.json records the step count they gave).
set -euo pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-runs/smollm2-dflash}
WORK=${WORK:-$OUT/work}
EVAL_PLOT=${EVAL_PLOT-$OUT/eval.png}  # set EVAL_PLOT= to skip the plot
PROMPTS=${1:-}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
if [ -z "$PROMPTS" ]; then
  PROMPTS=$WORK/prompts
  $PY -m sglang_dflash.data --out "$PROMPTS" --num-eval 40
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
$PY -m sglang_dflash.assets

$PY -m sglang_dflash.train --target smollm2 --prompts "$PROMPTS/train.jsonl" \
  --out "$WORK/drafter" --cache "${CACHE:-$WORK/responses.jsonl}" --log-json "$OUT/train_log.json" \
  --block-size 16 --num-draft-layers "${DRAFT_LAYERS:-5}" --gamma 7 \
  --steps "${STEPS:-100000}" --batch-size "${BATCH:-32}" --anchors-per-seq "${ANCHORS:-64}" \
  --lr "${LR:-1e-3}" --warmup-steps 40 --grad-clip 1.0 --seed 0 \
  --num-prompts "${NUM_PROMPTS:-100000}" --max-prompt-tokens 384 --max-new-tokens "${MAX_NEW:-320}" \
  --gen-batch-size "${GEN_BATCH:-768}" --gen-temperature 0 --max-seq-len 1024 \
  --max-gen-seconds "${GEN_SECONDS:-120}" --max-train-seconds "${TRAIN_SECONDS:-230}" --log-every 25 \
  --checkpoint-every "${CKPT_EVERY:-0}" ${INIT_FROM:+--init-from "$INIT_FROM"} \
  ${RESPONSE_SERVER:+--response-server "$RESPONSE_SERVER"}
rm -rf "$OUT/drafter" && mkdir -p "$OUT/drafter"
cp "$WORK"/drafter/*.json "$WORK"/drafter/*.safetensors "$OUT/drafter/"
rm -f "$OUT/drafter/train_log.json"

# tau on held-out sets; config-major order and incremental JSON, so a capped run keeps what finished
# (EVAL_SECONDS=0 skips it, e.g. to evaluate elsewhere with the same sglang_dflash.eval command)
[ "${EVAL_SECONDS:-150}" = 0 ] && exit 0
timeout "${EVAL_SECONDS:-150}" $PY -m sglang_dflash.eval --target smollm2 --draft "$WORK/drafter" \
  --prompts-dir "$PROMPTS" --datasets mtbench,humaneval,gsm8k --block-sizes 16,8 --temperatures 0,1 \
  --num-prompts "${EVAL_PROMPTS:-40}" --max-new-tokens "${EVAL_NEW:-256}" --batch-size 64 \
  --out "$OUT/eval.json" ${EVAL_PLOT:+--plot "$EVAL_PLOT"} || echo "eval stopped early (exit $?); partial $OUT/eval.json kept"
