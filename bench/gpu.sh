#!/usr/bin/env bash
# The simulate benchmark at GPU sizes against DrJAX, for the day a GPU is lent.
#
#   bash bench/gpu.sh            # one GPU (an H200: about 6 minutes, 8 at most)
#   bash bench/gpu.sh --smoke    # tiny sizes on the CPU (CI's smoke mode)
#
# Three parts, each a table with rounds per second, rounds per hour and fcir/drjax
# (median [min, max] of 5 alternating repetitions):
#   1. bench/simulate.py, the CIFAR-10 FedAvg experiment, cohort 50 of 1,000 clients;
#   2. the same at cohort 2,048 of 4,096 clients;
#   3. bench/fax_round.py, the FAX-scale 368M-parameter transformer round.
# fcir runs with and without clients_per_step; every part has a time limit so the
# whole stays within 8 minutes (a part cut short says so and the next one runs).
# Python: $PYTHON, else the checkout's .venv, else python on PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
OUT=${OUT_DIR:-bench/results}
SYS=fcir,fcir-k,drjax
status=0

part() {  # part LIMIT_S TITLE COMMAND...
  local limit=$1 title=$2
  shift 2
  echo "=== $title"
  timeout "$limit" "$@"
  local rc=$?
  if [ $rc -eq 124 ]; then echo "=== $title: cut short after $limit s"; status=1
  elif [ $rc -ne 0 ]; then echo "=== $title: failed (exit $rc)"; status=1; fi
}

"$PY" -c 'import jax; print("devices:", jax.devices())'
if [ "${1:-}" = "--smoke" ]; then
  part 600 "CIFAR-10 FedAvg, smoke sizes" "$PY" bench/simulate.py --smoke --systems $SYS --out-dir "$OUT"
  part 600 "FAX-scale round, smoke model" "$PY" bench/fax_round.py --smoke --out-dir "$OUT"
else
  part 90 "CIFAR-10 FedAvg, cohort 50 of 1,000" "$PY" bench/simulate.py --systems $SYS \
    --clients 1000 --cohort 50 --rounds 20 --reps 5 --clients-per-step 10 --out-dir "$OUT"
  part 150 "CIFAR-10 FedAvg, cohort 2,048 of 4,096" "$PY" bench/simulate.py --systems $SYS \
    --clients 4096 --cohort 2048 --rounds 5 --reps 5 --clients-per-step 256 --out-dir "$OUT"
  part 230 "FAX-scale round, 368M parameters" "$PY" bench/fax_round.py --clients 16 --steps 4 \
    --batch 4 --reps 5 --out-dir "$OUT"
fi
exit $status
