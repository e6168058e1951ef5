#!/usr/bin/env bash
# Build the embedded default model end to end: VQ image tokenizer -> BPE text tokenizer -> LM (two stages) -> style
# adapters. Stage lm2 continues stage lm's weights (kept in OUT/lm_stage1) on fresh examples at half the peak rate.
#
#   scripts/build_embedded.sh [OUT]            # OUT defaults to runs/embedded; writes OUT/model and OUT/adapters
#   STAGES="vq tok lm" scripts/build_embedded.sh runs/embedded      # some stages only
#   TINY=1 scripts/build_embedded.sh /tmp/emb                        # a CPU smoke run in about a minute
#
# The shipped assets/ were built on one H200 with the defaults below (see assets/model/README.md); copy
# OUT/model -> assets/model and OUT/adapters -> assets/adapters, then run scripts/train_*'s checks.
# Extra per-stage flags: VQ_ARGS, TOK_ARGS, LM_ARGS, LM2_ARGS, AD_ARGS (e.g. LM_ARGS="--max-minutes 4").
# LM_PROCS=N trains the LM stages data-parallel on N GPUs (torchrun, one process a GPU; WORKERS split between them).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/embedded}
STAGES=${STAGES:-"vq tok lm lm2 adapters"}
PY=${PYTHON:-python3}
WORKERS=${WORKERS:-$(nproc)}
SEED=${SEED:-0}
LM_PROCS=${LM_PROCS:-1}
if [[ "${TINY:-0}" == "1" ]]; then
  VQ_ARGS="--tiny --steps 3 ${VQ_ARGS:-}"; TOK_ARGS="--n-examples 500 ${TOK_ARGS:-}"
  LM_ARGS="--tiny --steps 3 ${LM_ARGS:-}"; LM2_ARGS="--tiny --steps 2 ${LM2_ARGS:-}"
  AD_ARGS="--tiny --steps 3 ${AD_ARGS:-}"; WORKERS=1
fi
mkdir -p "$OUT/model"
LM_RUN=("$PY")
LM_WORKERS=$WORKERS
if (( LM_PROCS > 1 )); then
  LM_RUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$LM_PROCS")
  LM_WORKERS=$(( WORKERS / LM_PROCS > 0 ? WORKERS / LM_PROCS : 1 ))
fi
for stage in $STAGES; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    vq)       $PY scripts/train_vq.py --out "$OUT/model/vq" --seed "$SEED" --workers "$WORKERS" ${VQ_ARGS:-} ;;
    tok)      $PY scripts/train_tokenizer.py --out "$OUT/model" --vq "$OUT/model/vq" --seed "$SEED" \
                --workers "$WORKERS" ${TOK_ARGS:-} ;;
    lm)       "${LM_RUN[@]}" scripts/train_lm.py --model-dir "$OUT/model" --seed "$SEED" --workers "$LM_WORKERS" \
                ${LM_ARGS:-} ;;
    lm2)      rm -rf "$OUT/lm_stage1" && cp -r "$OUT/model/lm" "$OUT/lm_stage1"
              "${LM_RUN[@]}" scripts/train_lm.py --model-dir "$OUT/model" --init-from "$OUT/lm_stage1" \
                --seed $((SEED + 1)) --lr 1e-3 --workers "$LM_WORKERS" ${LM2_ARGS:-} ;;
    adapters) $PY scripts/train_adapters.py --model-dir "$OUT/model" --out "$OUT/adapters" --seed "$SEED" \
                --workers "$WORKERS" ${AD_ARGS:-} ;;
    *) echo "unknown stage $stage (expected: vq tok lm lm2 adapters)" >&2; exit 2 ;;
  esac
done
echo "=== done: $OUT ($(date -u +%H:%M:%S))"
