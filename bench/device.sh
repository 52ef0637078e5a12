#!/usr/bin/env bash
# The benchmarks at accelerator sizes (a TPU or a GPU, whatever JAX's default device is):
# fcir against DrJAX and a hand-written streamed round, in one command of 10 minutes at most.
#
#   bash bench/device.sh            # on the accelerator: 520 s at most (DEVICE_SECONDS)
#   bash bench/device.sh --smoke    # tiny sizes on the CPU (CI's smoke mode)
#
# Three parts, each a table (rounds per second and per hour; ratios as median [min, max]
# of alternating repetitions), each in a process of its own and under a time limit: a
# part that runs past it is recorded as cut short and the next one runs.
#   1. bench/simulate.py, the CIFAR-10 FedAvg experiment, cohort 50 of 1,000 clients:
#      fcir (in the loop xla.simulate picks), fcir in its host loop, fcir k=10 and DrJAX;
#   2. the same at cohort 2,048 of 4,096: fcir with clients_per_step=auto (the k the
#      device's memory holds) against DrJAX;
#   3. bench/fax_round.py, the FAX 368M-parameter round at 16, 64 and 256 clients, fcir
#      streamed against a hand-written lax.scan over chunks of k vmapped clients (and
#      DrJAX at 16), with TFLOP/s and XLA's temporaries per cohort; it starts no cohort
#      that would not end within its share of the time.
# A system that runs out of the device's memory is recorded as "out of memory" (table
# and JSON) and the others go on. JSON with every sample: $OUT_DIR (bench/results).
# Python: $PYTHON, else the checkout's .venv, else python3 on PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT_DIR:-bench/results}
TOTAL=${DEVICE_SECONDS:-520}  # the whole run; setting the machine up (tpu-env.sh) comes on top
START=$SECONDS
status=0

part() {  # part LIMIT_S TITLE COMMAND...
  local limit=$1 title=$2
  shift 2
  echo "=== $title (at most $limit s)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "=== $title: cut short after $limit s"; status=1
  elif [ $rc -ne 0 ]; then echo "=== $title: failed (exit $rc)"; status=1; fi
}

left() {  # left CAP: the seconds a part may take, CAP at most, keeping RESERVE for later parts
  local cap=$1 reserve=${2:-0} rest=$((TOTAL - (SECONDS - START)))
  rest=$((rest - reserve))
  [ "$rest" -lt "$cap" ] && cap=$rest
  [ "$cap" -lt 30 ] && cap=30
  echo "$cap"
}

if [ "${1:-}" = "--smoke" ]; then
  part 600 "CIFAR-10 FedAvg, smoke sizes, clients_per_step=auto" "$PY" bench/simulate.py \
    --smoke --systems fcir,fcir-k,drjax --cohort 2 --clients-per-step auto --out-dir "$OUT"
  part 600 "FAX-scale round, smoke model" "$PY" bench/fax_round.py --smoke --out-dir "$OUT"
else
  part "$(left 130 320)" "CIFAR-10 FedAvg, cohort 50 of 1,000" "$PY" bench/simulate.py \
    --systems fcir,fcir-host,fcir-k,drjax --clients 1000 --cohort 50 --rounds 20 --reps 5 \
    --clients-per-step 10 --out-dir "$OUT"
  part "$(left 110 200)" "CIFAR-10 FedAvg, cohort 2,048 of 4,096, clients_per_step=auto" \
    "$PY" bench/simulate.py --systems fcir-k,drjax --clients 4096 --cohort 2048 --rounds 3 \
    --reps 3 --clients-per-step auto --out-dir "$OUT"
  limit=$(left 400)
  part "$limit" "FAX-scale round, 368M parameters, 16 / 64 / 256 clients" "$PY" \
    bench/fax_round.py --cohorts 16,64,256 --steps 4 --batch 4 --reps 5 \
    --deadline-s $((limit - 15)) --out-dir "$OUT"
fi
echo "=== done in $((SECONDS - START)) s"
exit $status
