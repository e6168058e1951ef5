#!/usr/bin/env bash
# Train the learned-routing set of the embedded model: the four domain LoRAs (one process each, side by side on
# one GPU; each trains alone on its own domain) and then the MoLoRA router over them.
#
#   scripts/train_molora.sh [OUT]        # OUT defaults to runs/molora: OUT/adapters/<domain>, OUT/router
#   DEVICE=cpu AD_ARGS="--steps 3 --n-train 64 --n-val 16 --batch-size 8" \
#     ROUTER_ARGS="--steps 3 --n-per-domain 32 --n-val 8" AD_MINUTES=0 ROUTER_MINUTES=0 \
#     scripts/train_molora.sh /tmp/molora     # a CPU smoke run
#
# Both stages are time-bounded (AD_MINUTES per adapter, ROUTER_MINUTES): the learning rate anneals over the
# steps or the minutes, whichever ends first, and each output records the steps it took. The shipped set and the
# command that made it: assets/model/README.md, "Domain adapters and the learned router".
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/molora}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
DOMAINS=(count arith spatial size)
mkdir -p "$OUT/parts" "$OUT/adapters"
echo "=== adapters ($(date -u +%H:%M:%S))"
pids=()
for d in "${DOMAINS[@]}"; do
  $PY scripts/train_domain_adapters.py --out "$OUT/parts/$d" --domains "$d" --device "$DEVICE" --threads 2 \
    --steps 6000 --n-train 120000 --batch-size 128 --lr 3e-3 --max-minutes "${AD_MINUTES:-7}" ${AD_ARGS:-} \
    >"$OUT/parts/$d.log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "adapter ${DOMAINS[$i]} failed:" >&2; tail -20 "$OUT/parts/${DOMAINS[$i]}.log" >&2; exit 1; }
  tail -1 "$OUT/parts/${DOMAINS[$i]}.log"
done
for d in "${DOMAINS[@]}"; do rm -rf "$OUT/adapters/$d"; cp -r "$OUT/parts/$d/$d" "$OUT/adapters/$d"; done
$PY - "$OUT" "${DOMAINS[@]}" <<'EOF'
import json, sys
out, domains = sys.argv[1], sys.argv[2:]
merged = {d: json.load(open(f"{out}/parts/{d}/domain_metrics.json"))[d] for d in domains}
json.dump(merged, open(f"{out}/adapters/domain_metrics.json", "w"), indent=1)
EOF
echo "=== router ($(date -u +%H:%M:%S))"
$PY scripts/train_router.py --adapters-dir "$OUT/adapters" --adapters "${DOMAINS[@]}" --out "$OUT/router" \
  --steps 6000 --context-decays 0.5 0.7 0.8 0.85 0.9 0.93 0.95 0.97 0.99 --n-per-domain 3000 --n-mixed 9000 \
  --n-val 100 --label-coef 1.0 --start-weight 5 --device "$DEVICE" --max-minutes "${ROUTER_MINUTES:-3.5}" \
  ${ROUTER_ARGS:-}
echo "=== done: $OUT ($(date -u +%H:%M:%S))"
