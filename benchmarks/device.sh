#!/usr/bin/env bash
# One accelerator (GPU/TPU), <= 10 minutes: the core, gradient, QGT and large-model benchmarks, each as
# JSON, plus one table (summary.txt) in OUT. On a machine without an accelerator it runs on the CPU.
#
#   bash benchmarks/device.sh                  # full sizes, OUT=device-bench-<date>
#   OUT=dir bash benchmarks/device.sh
#   SMOKE=1 bash benchmarks/device.sh          # tiny sizes on CPU: a check of this script (minutes;
#                                              # not part of the test suite)
#
# PYTHON defaults to `python`. Every step has its own timeout (seconds: core, grad, qgt and qgt_eqmem
# 90 each, large 200, so at most 560 s in all; SMOKE: 300, large 600, on a CPU) so one slow step
# cannot eat the whole budget; a failed step is recorded and the others still run (the exit status is then 1).
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-device-bench-$(date -u +%Y%m%dT%H%M%SZ)}
SMOKE=${SMOKE:-0}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$SMOKE" = 1 ]; then
  T_SMALL=300 T_LARGE=600
  export JAX_PLATFORMS=cpu
  CORE=(--L 8 --n-samples 256 --chunk-size 64 --repeats 1 --dtypes float64)
  GRAD=(--L 8 --n-samples 256 --chunk-size 64 --repeats 1)
  QGT=(--L 8 --n-samples 256 --chunk-size 64 --repeats 1 --memory-n 256 512)
  LARGE=(--size small --models gcnn --dtypes float64 --sizes 256 512 --budgets-mib 8 --n-max 8192
         --chunk 32 --time-n 64 --repeats 1 --impls vmcgrad "netket chunked" "VMC_SR dense")
else
  T_SMALL=90 T_LARGE=200
  CORE=(--L 64 --n-samples 65536 --chunk-size 4096 --repeats 5)
  GRAD=(--L 48 --n-samples 65536 --chunk-size 4096 --repeats 5)
  QGT=(--L 48 --n-samples 65536 --chunk-size 4096 --repeats 5 --memory-n 65536 262144)
  LARGE=(--models gcnn vit --dtypes float32 --sizes 4096 65536 --budgets-mib 256 1024
         --chunk 256 --time-n 4096 --repeats 3)
fi

status=0
step() {  # step NAME TIMEOUT SCRIPT ARGS...
  local name=$1 limit=$2 script=$3
  shift 3
  local t0=$SECONDS
  echo "== $name: $PYTHON $script $* --json $OUT/$name.json" | tee -a "$OUT/log.txt"
  if timeout "$limit" "$PYTHON" "$script" "$@" --json "$OUT/$name.json" >"$OUT/$name.txt" 2>&1; then
    echo "   ok in $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
  else
    echo "   FAILED (status $?) after $((SECONDS - t0)) s; see $OUT/$name.txt" | tee -a "$OUT/log.txt"
    status=1
  fi
}

"$PYTHON" -c 'import jax; d = jax.devices()[0]; print(f"{jax.device_count()} x {d.platform} {d.device_kind}")' \
  >"$OUT/device.txt" 2>&1 || status=1
step core "$T_SMALL" benchmarks/bench_core.py "${CORE[@]}"
step grad "$T_SMALL" benchmarks/bench_grad.py "${GRAD[@]}"
step qgt "$T_SMALL" benchmarks/bench_qgt.py "${QGT[@]}" --only same-chunk memory
# issue 18: at equal compiled memory, QGT(chunk_size="auto") picks its design and chunk
step qgt_eqmem "$T_SMALL" benchmarks/bench_qgt.py "${QGT[@]}" --only equal-memory
step large "$T_LARGE" benchmarks/bench_large.py "${LARGE[@]}"

{
  echo "vmcgrad device benchmarks, $(date -u +%Y-%m-%dT%H:%MZ), device: $(tail -n 1 "$OUT/device.txt")"
  echo "smoke=$SMOKE; per-benchmark JSON and full output in $OUT/"
  for name in core grad qgt qgt_eqmem large; do
    echo
    echo "### $name"
    if [ "$name" = large ]; then  # its tables follow the last progress line
      sed -n '/device(s)/,$p' "$OUT/$name.txt"
    else
      grep -v -i "warn" "$OUT/$name.txt" | tail -n 30
    fi
  done
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $status
