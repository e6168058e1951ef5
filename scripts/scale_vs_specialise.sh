#!/usr/bin/env bash
# Specialisation vs scale (issue 12), scaled down and controlled: both arms from scratch on one token budget.
#
#   arm 1   a fresh 1x LM (hidden 256, 6 layers, MLP 1024: the embedded base's shape and data mixture) for LM_STEPS
#           steps of 65,536 ids, then the four domain adapters on it (train_domain_adapters.py, AD_STEPS steps each,
#           four processes at once), then a router over them (train_router.py, RT_STEPS steps, the
#           shipped recipe's flags (scripts/train_molora.sh): the shipped context decays, --label-coef 1.0,
#           --start-weight 5, three mixed requests for each item of a domain, which the plan and train_lm.py
#           --domain-router-mixed follow; the adapters at batch 128)
#   arm 4x  an LM of about 4x the parameters (hidden 512, 8 heads of 64, 6 layers, MLP 2048), no adapters, trained
#           from scratch for as many ids as the whole of arm 1: LM_STEPS + the adapters' and router's ids in LM steps,
#           with those very train items mixed into its data in the same share of ids (train_lm.py --domain-share;
#           loss on every id, as train_lm trains). It trains at the same time as arm 1, on the same GPU.
#   eval    scripts/eval_molora.py --rows base ours oracle_span on arm 1; the same items and scoring on the 4x base
#           (scale_vs_specialise.py eval-base); then OUT/table.md and OUT/summary.json (scale_vs_specialise.py report)
#
#   scripts/scale_vs_specialise.sh [OUT]          # OUT defaults to runs/scale; the GPU run (one H200, 9 min)
#   TINY=1 DEVICE=cpu scripts/scale_vs_specialise.sh /tmp/scale      # a CPU smoke run at toy sizes (~1 min)
#
# BASE (default assets/model) lends its tokenizer.json, vocab.json and vq/: only the LMs are trained. Knobs:
# ARMS (default "arm1 big", the 4x also as "4x"; the report reads a left-out arm's files from an earlier run into
# the same OUT with the same knobs: its eval.json and model/lm/metrics.json), LM_STEPS, AD_STEPS, RT_STEPS,
# N_EXAMPLES, N_EVAL, WORKERS (per LM process), DEVICE, BIG_LR, COMPILE (1: both LMs under torch.compile), and the
# time limits LM_MAX_MIN, BIG_MAX_MIN, AD_MAX_MIN, RT_MAX_MIN (0 = none, the default: a
# limit that cuts a run short makes the budgets unequal; OUT/summary.json records the steps each took). Logs: OUT/logs/.
#
# Timings measured on one H200 (16 cores; 2026-12-01, benchmarks/RESULTS.md "Specialisation vs scale"): plan 14 s;
# 120,000 examples a LM in 37 s (8 workers each, both LMs at once); the two concurrent torch.compile warm-ups cost
# ~140 s before step 50; then the 1x ran 18-21 steps/s and the 4x 12-16 steps/s side by side (20 alone); four adapters
# at once ~5 steps/s each; the router ~5.8 steps/s; eval_molora's three rows ~40 s. Arm 1 is a serial chain, so the
# defaults (1,000 / 400 / 400 steps) ended the whole study in 538 s (tenth session's run); 2,000 / 600 / 600 did not
# fit in 555 s. On one H100 with the shipped recipe (2026-12-06, benchmarks/RESULTS.md "Learned routing"): the two
# LMs' first steps (compile warm-ups side by side) took 133 s and 108 s, and arm 1 did not finish within 545 s; arm 1
# alone (ARMS=arm1): LM 230 s, the four adapters at batch 128 ~100 s at once, the router 96 s, then the eval's rows
# (not all within 548 s). There, run the arms in two calls (ARMS=big, then ARMS=arm1) into one OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/scale}
PY=${PYTHON:-python3}
BASE=${BASE:-assets/model}
DEVICE=${DEVICE:-cuda}
DOMAINS=(count arith spatial size)
if [[ "${TINY:-0}" == "1" ]]; then
  LM_STEPS=${LM_STEPS:-3}; AD_STEPS=${AD_STEPS:-2}; RT_STEPS=${RT_STEPS:-2}; N_EVAL=${N_EVAL:-4}; WORKERS=${WORKERS:-1}
  LM_SHAPE=(--n-examples 48 --n-val 8 --tokens-per-batch 4096 --hidden 32 --heads 2 --layers 2 --intermediate 64)
  BIG_SHAPE=(--n-examples 48 --n-val 8 --tokens-per-batch 4096 --hidden 64 --heads 4 --layers 2 --intermediate 128)
  AD_DATA=(--n-train 64 --n-val 8); RT_DATA=(--n-per-domain 16 --n-val 4); PLAN_DATA=(--n-train 64 --n-per-domain 16
    --tokens-per-batch 4096 --fill-examples 48)
  COMPILE_ARGS=()
else
  LM_STEPS=${LM_STEPS:-1000}; AD_STEPS=${AD_STEPS:-400}; RT_STEPS=${RT_STEPS:-400}; N_EVAL=${N_EVAL:-200}
  WORKERS=${WORKERS:-8}
  N_EXAMPLES=${N_EXAMPLES:-120000}
  LM_SHAPE=(--n-examples "$N_EXAMPLES" --tokens-per-batch 65536 --hidden 256 --heads 4 --layers 6 --intermediate 1024)
  BIG_SHAPE=(--n-examples "$N_EXAMPLES" --tokens-per-batch 65536 --hidden 512 --heads 8 --layers 6 --intermediate 2048)
  # the shipped recipe's batches (scripts/train_molora.sh): adapters at batch 128 (on 60,000 items a domain; the
  # shipped ones drew from 120,000), the router on three mixed requests for each item of a domain
  AD_DATA=(--n-train 60000 --n-val 200 --batch-size 128); RT_DATA=(--n-per-domain 3000 --n-mixed 9000 --n-val 100)
  PLAN_DATA=(--n-train 60000 --adapter-batch-size 128 --n-per-domain 3000 --n-mixed 9000 --tokens-per-batch 65536)
  COMPILE_ARGS=(--compile)
fi
if [[ "${COMPILE:-1}" == "0" ]]; then COMPILE_ARGS=(); fi
ARMS=${ARMS:-arm1 big}
for arm in $ARMS; do
  [[ "$arm" =~ ^(arm1|big|4x)$ ]] || { echo "ARMS: unknown arm '$arm' (arm1, big or 4x)" >&2; exit 2; }
done
BIG_LR=${BIG_LR:-1e-3}  # Pythia-70M's (hidden 512, 6 layers); the 1x keeps the shipped 2e-3
mkdir -p "$OUT/logs" "$OUT/arm1/model" "$OUT/big/model" "$OUT/arm1/adapters"
for arm in arm1 big; do
  cp "$BASE/tokenizer.json" "$BASE/vocab.json" "$OUT/$arm/model/"
  ln -sfn "$(cd "$BASE" && pwd)/vq" "$OUT/$arm/model/vq"
done
stamp() { echo "=== $* ($(date -u +%H:%M:%S))"; }

stamp plan
$PY scripts/scale_vs_specialise.py plan --model-dir "$BASE" --lm-steps "$LM_STEPS" --adapter-steps "$AD_STEPS" \
  --router-steps "$RT_STEPS" "${PLAN_DATA[@]}" > "$OUT/plan.json"
read -r BIG_STEPS SHARE ROUTER_SHARE ROUTER_MIXED < <($PY -c "import json,sys; p=json.load(open(sys.argv[1])); \
print(p['big_steps'], p['domain_share'], p['domain_router_share'], p['n_mixed'] / p['n_per_domain'])" "$OUT/plan.json")

# the 4x base trains (then is scored) in the background while arm 1 runs its chain on the same GPU; a failure of
# one arm is logged and the other still finishes, and the report reads whatever JSON files exist
big_arm() {
  stamp "4x: $BIG_STEPS steps, domain share $SHARE (router part $ROUTER_SHARE)"
  $PY scripts/train_lm.py --model-dir "$OUT/big/model" "${BIG_SHAPE[@]}" --steps "$BIG_STEPS" --lr "$BIG_LR" \
    --domain-share "$SHARE" --domain-router-share "$ROUTER_SHARE" \
    --domain-router-mixed "$ROUTER_MIXED" --seed 0 --workers "$WORKERS" --device "$DEVICE" \
    --val-every 0 --ckpt-every 0 --max-minutes "${BIG_MAX_MIN:-0}" "${COMPILE_ARGS[@]}" > "$OUT/logs/big_lm.log" 2>&1
  stamp "4x: eval"
  $PY scripts/scale_vs_specialise.py eval-base --model-dir "$OUT/big/model" --name base_4x --n "$N_EVAL" \
    --device "$DEVICE" --json "$OUT/big/eval.json" > "$OUT/logs/big_eval.log" 2>&1
  stamp "4x: done"
}

arm1() {
  stamp "arm 1: 1x LM, $LM_STEPS steps"
  $PY scripts/train_lm.py --model-dir "$OUT/arm1/model" "${LM_SHAPE[@]}" --steps "$LM_STEPS" --seed 0 \
    --workers "$WORKERS" --device "$DEVICE" --val-every 0 --ckpt-every 0 --max-minutes "${LM_MAX_MIN:-0}" \
    "${COMPILE_ARGS[@]}" > "$OUT/logs/arm1_lm.log" 2>&1

  stamp "arm 1: adapters ${DOMAINS[*]}, $AD_STEPS steps each, one process each"
  local pids=() d pid
  for d in "${DOMAINS[@]}"; do  # one --out each: the script merges domain_metrics.json, which would race
    $PY scripts/train_domain_adapters.py --model-dir "$OUT/arm1/model" --out "$OUT/arm1/ad_$d" --domains "$d" \
      --steps "$AD_STEPS" "${AD_DATA[@]}" --lr 3e-3 --seed 0 --device "$DEVICE" --max-minutes "${AD_MAX_MIN:-0}" \
      > "$OUT/logs/arm1_adapter_$d.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for d in "${DOMAINS[@]}"; do rm -rf "$OUT/arm1/adapters/$d"; cp -r "$OUT/arm1/ad_$d/$d" "$OUT/arm1/adapters/$d"; done

  stamp "arm 1: router, $RT_STEPS steps"
  $PY scripts/train_router.py --model-dir "$OUT/arm1/model" --adapters-dir "$OUT/arm1/adapters" \
    --out "$OUT/arm1/router" --steps "$RT_STEPS" --label-coef 1.0 --start-weight 5 --top-k 2 \
    "${RT_DATA[@]}" --seed 0 --device "$DEVICE" --max-minutes "${RT_MAX_MIN:-0}" > "$OUT/logs/arm1_router.log" 2>&1

  stamp "arm 1: eval"
  $PY scripts/eval_molora.py --model-dir "$OUT/arm1/model" --adapters-dir "$OUT/arm1/adapters" \
    --router "$OUT/arm1/router/gates.safetensors" --rows base ours oracle_span --n "$N_EVAL" --device "$DEVICE" \
    --json "$OUT/arm1/eval.json" > "$OUT/logs/arm1_eval.log" 2>&1
  # the same LM through eval-base must give eval_molora's base row: the two arms are scored alike
  $PY scripts/scale_vs_specialise.py eval-base --model-dir "$OUT/arm1/model" --name base_1x --n "$N_EVAL" \
    --device "$DEVICE" --json "$OUT/arm1/eval_base_check.json" > "$OUT/logs/arm1_eval_base_check.log" 2>&1
  stamp "arm 1: done"
}

status=0
BIG_PID= ARM1_PID=
for arm in $ARMS; do
  case "$arm" in
    arm1) arm1 & ARM1_PID=$! ;;
    big|4x) big_arm & BIG_PID=$! ;;
  esac
done
if [[ -n "${ARM1_PID:-}" ]]; then wait "$ARM1_PID" || { status=1; stamp "arm 1 FAILED (logs in $OUT/logs)"; }; fi
if [[ -n "${BIG_PID:-}" ]]; then wait "$BIG_PID" || { status=1; stamp "4x FAILED (logs in $OUT/logs)"; }; fi
$PY scripts/scale_vs_specialise.py report --run "$OUT"
stamp "done: $OUT"
exit $status
