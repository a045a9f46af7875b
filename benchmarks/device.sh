#!/usr/bin/env bash
# One accelerator (GPU/TPU), <= 10 minutes: the core, gradient, QGT and large-model benchmarks, each as
# JSON, plus one table (summary.txt) in OUT. On a machine without an accelerator it runs on the CPU.
#
#   bash benchmarks/device.sh                  # full sizes, OUT=device-bench-<date>
#   OUT=dir bash benchmarks/device.sh
#   SMOKE=1 bash benchmarks/device.sh          # tiny sizes on CPU: a check of this script (minutes;
#                                              # not part of the test suite)
#   STEPS=regime bash benchmarks/device.sh     # a step's time against N, compilation apart: 6-9 minutes
#   STEPS=race bash benchmarks/device.sh       # the short race (issue 33); see below
#   STEPS=calib bash benchmarks/device.sh      # the cost model's constants only (under a minute)
#   STEPS=kernels bash benchmarks/device.sh    # MinSR's kernels compiled, costed and run: 6-7 minutes
#   STEPS=local bash benchmarks/device.sh      # a step's local energies, vmcgrad's choice against NetKet
#
# STEPS (default "calib core grad qgt qgt_eqmem large") names the steps to run, in that order; `regime`,
# `kernels`, `local` and `race` are not among the defaults (with them the call would pass 10 minutes).
#
# `local` is benchmarks/local_values.py on the race's problem and model, float32, N = 256, at
# vmcgrad's default budget: NetKet's local energies unchunked and at chunk 64 against
# vmcgrad.netket.MCState(chunk_size="auto") priced for the CPU (the gradient's chunk) and for the
# device (its own chunk for the local values), each compiled, costed and timed on the device
# (under 200 s). LOCAL_ARGS replaces its arguments (all but --json).
#
# `kernels` is benchmarks/accelerator_cost.py on the device, with vmcgrad's choices made for it
# (--cost-platform tpu; gpu on a GPU): MinSR's update at N = 256, vmcgrad within 1 GiB against
# NetKet unchunked, then within 64 MiB against NetKet's chunk 64, each program compiled there,
# costed by vmcgrad.program_cost, run 10 times (--run) and its optimized HLO kept (OUT/hlo.tgz):
# the measured ratio beside the modelled one. KERNEL_ARGS replaces the comparisons (`--only ...`
# and sizes; e.g. "--only qgt qgt-solve grad vjp jvp": the parameter-space kernels, one process
# under 200 s); by default two processes, 200 s and 330 s (on the TPU v5e of 2026-12-07 they took 157 s and
# 217 s, most of it compiling: benchmarks/results/device-tpu-v5e-2026-12-07b/).
#
# `calib`, first, is benchmarks/calibrate_op_cost.py: the constants of vmcgrad.program_cost's model
# measured on the device (t_op from a chain of k small ops and a loop of k trips, against the ops
# program_cost counts; peak FLOP/s from a matmul; bandwidth from a copy), as JSON in OUT/calib.json.
#
# `regime` is benchmarks/step_regime.py on the race's problem and model (below), float32 with x64 off,
# 64 MiB: NetKet's and vmcgrad's VMC_SR at N = 256, chunk 64 (vmcgrad's with its chunk's Jacobians
# derived in 16 parts, the default, and in one), then both at N = 1024 unchunked; per run the first
# step (compilation) and the median of 3, split into sampling, local energies and the SR phase.
# REGIME_ARGS replaces its arguments (all but --json). Its rows go to OUT/regime.json (JSON lines).
#
# The race is benchmarks/time_to_energy.py on the 4x4 J1-J2 model, NetKet's GCNN over the space group
# (3 layers of 8 features, P = 16 536), float32 with x64 off (a TPU emulates float64 and its float64
# solves raise), 64 MiB per device, one seed, 1.25 minutes per contender, compilation included, 256
# sampler chains: NetKet's VMC_SR at 256 samples (chunk 64), NetKet's on-the-fly VMC_SR and vmcgrad's
# VMC_SR (chunk by the budget) at 1024 samples. Its table.md, results.json, energy.png and traces go
# to OUT/race/. RACE_ARGS replaces its arguments (all but --out). On the TPU v5e lent on 2026-12-06 it
# gives no race in one call: its host compiles about 10x slower than this project's 2-core CPU
# machine (NetKet's first step 55 s there, 7 s here), so the first contender made one step in its
# 1.25 minutes and vmcgrad's compiled past the call's end (benchmarks/results/step-regime-tpu-v5e).
# The compilation cache below (JAX_COMPILATION_CACHE_DIR, default /tmp/vmcgrad-jax-cache) is
# meant for that: a first call with short minutes compiles every contender's programs, and a second
# call while the machine is warm races on them (not yet tried on an accelerator). Caveat: JAX keys
# the cache on programs stripped of metadata, and vmcgrad.program_cost's expected_trips (the CG
# route's priced iterations) is metadata, so a priced program can load an unannotated executable
# (docs/performance.md, "JAX's persistent compilation cache is not safe with program_cost's
# annotations"); unset JAX_COMPILATION_CACHE_DIR where route choices matter.
#
# NetKet is not in the accelerator machines' images: `bash benchmarks/device_wheels.sh gpu` (or tpu)
# fetches its wheels here, and that script's header gives the install line that starts a call.
#
# PYTHON defaults to `python`. Every step has its own timeout (seconds: calib 120; core, grad, qgt and
# qgt_eqmem 90 each, large 200, so at most 680 s in all: with calib the defaults can pass a 10-minute
# call, leave a step out where they must fit; regime 540; race 450; SMOKE: calib 120, 300, large 600,
# regime and race 400, on a CPU) so
# one slow step cannot eat the whole budget; a failed step is recorded and the others still run (the
# exit status is then 1).
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-device-bench-$(date -u +%Y%m%dT%H%M%SZ)}
SMOKE=${SMOKE:-0}
STEPS=${STEPS:-calib core grad qgt qgt_eqmem large}
T_CALIB=${T_CALIB:-120}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# JAX's persistent compilation cache, kept outside OUT: a second call on a machine still warm (its
# /tmp kept) takes the programs the first compiled, so a short race measures steps, not compiling
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/vmcgrad-jax-cache}

if [ "$SMOKE" = 1 ]; then
  T_SMALL=300 T_LARGE=600 T_RACE=400 T_REGIME=400
  export JAX_PLATFORMS=cpu
  CORE=(--L 8 --n-samples 256 --chunk-size 64 --repeats 1 --dtypes float64)
  GRAD=(--L 8 --n-samples 256 --chunk-size 64 --repeats 1)
  QGT=(--L 8 --n-samples 256 --chunk-size 64 --repeats 1 --memory-n 256 512)
  LARGE=(--size small --models gcnn --dtypes float64 --sizes 256 512 --budgets-mib 8 --n-max 8192
         --chunk 32 --time-n 64 --repeats 1 --impls vmcgrad "netket chunked" "VMC_SR dense")
  RACE=(--smoke --dtype float32 --contenders netket-vmcsr netket-vmcsr-otf vmcgrad-vmcsr
        --n netket-vmcsr=64:32 netket-vmcsr-otf=128:32 vmcgrad-vmcsr=128:auto)
  REGIME=(--problem chain --layers 1 --features 8 --dtype float32 --budget-mib 16 --chains 16 --steps 1
          --runs netket-vmcsr=32:16 vmcgrad-vmcsr=32:16@2 vmcgrad-vmcsr=32:16)
  LOCAL=(--problem chain --layers 1 --features 4 --n 32 --chunk 8 --runs 1 --budget-mib default
         --priced cpu tpu)
else
  T_SMALL=90 T_LARGE=200 T_RACE=450 T_REGIME=540
  CORE=(--L 64 --n-samples 65536 --chunk-size 4096 --repeats 5)
  GRAD=(--L 48 --n-samples 65536 --chunk-size 4096 --repeats 5)
  QGT=(--L 48 --n-samples 65536 --chunk-size 4096 --repeats 5 --memory-n 65536 262144)
  LARGE=(--models gcnn vit --dtypes float32 --sizes 4096 65536 --budgets-mib 256 1024
         --chunk 256 --time-n 4096 --repeats 3)
  REGIME=(--dtype float32 --budget-mib 64 --steps 3 --runs netket-vmcsr=256:64 vmcgrad-vmcsr=256:64
          vmcgrad-vmcsr=256:64@1 netket-vmcsr=1024:none vmcgrad-vmcsr=1024:none)
  LOCAL=(--dtype float32 --n 256 --chunk 64 --runs 10 --budget-mib default --priced cpu DEVICE)
  RACE=(--problem j1j2 --model gcnn --layers 3 --features 8 --dtype float32 --budget-mib 64
        --minutes 1.25 --seeds 0 --chains 256 --contenders netket-vmcsr netket-vmcsr-otf vmcgrad-vmcsr
        --n netket-vmcsr=256:64 netket-vmcsr-otf=1024:64 vmcgrad-vmcsr=1024:auto)
fi
if [ -n "${RACE_ARGS:-}" ]; then
  read -r -a RACE <<<"$RACE_ARGS"
fi
if [ -n "${REGIME_ARGS:-}" ]; then
  read -r -a REGIME <<<"$REGIME_ARGS"
fi
if [ -n "${LOCAL_ARGS:-}" ]; then
  read -r -a LOCAL <<<"$LOCAL_ARGS"
fi

status=0
step() {  # step NAME TIMEOUT SCRIPT ARGS...
  local name=$1 limit=$2 script=$3
  shift 3
  local t0=$SECONDS
  echo "== $name: $PYTHON $script $* --json $OUT/$name.json" | tee -a "$OUT/log.txt"
  if timeout "$limit" "$PYTHON" "$script" "$@" --json "$OUT/$name.json" >>"$OUT/$name.txt" 2>&1; then
    echo "   ok in $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
  else
    echo "   FAILED (status $?) after $((SECONDS - t0)) s; see $OUT/$name.txt" | tee -a "$OUT/log.txt"
    status=1
  fi
}

"$PYTHON" -c 'import jax; d = jax.devices()[0]; print(f"{jax.device_count()} x {d.platform} {d.device_kind}")' \
  >"$OUT/device.txt" 2>&1 || status=1
race() {  # the short race: time_to_energy.py writes its own files into OUT/race/
  local t0=$SECONDS
  echo "== race: $PYTHON benchmarks/time_to_energy.py ${RACE[*]} --out $OUT/race" | tee -a "$OUT/log.txt"
  if timeout "$T_RACE" "$PYTHON" benchmarks/time_to_energy.py "${RACE[@]}" --out "$OUT/race" >"$OUT/race.txt" 2>&1; then
    echo "   ok in $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
  else
    echo "   FAILED (status $?) after $((SECONDS - t0)) s; see $OUT/race.txt" | tee -a "$OUT/log.txt"
    status=1
  fi
}

for name in $STEPS; do
  case $name in
    calib) step calib "$T_CALIB" benchmarks/calibrate_op_cost.py ;;
    core) step core "$T_SMALL" benchmarks/bench_core.py "${CORE[@]}" ;;
    grad) step grad "$T_SMALL" benchmarks/bench_grad.py "${GRAD[@]}" ;;
    qgt) step qgt "$T_SMALL" benchmarks/bench_qgt.py "${QGT[@]}" --only same-chunk memory ;;
    # issue 18: at equal compiled memory, QGT(chunk_size="auto") picks its design and chunk
    qgt_eqmem) step qgt_eqmem "$T_SMALL" benchmarks/bench_qgt.py "${QGT[@]}" --only equal-memory ;;
    large) step large "$T_LARGE" benchmarks/bench_large.py "${LARGE[@]}" ;;
    regime) step regime "$T_REGIME" benchmarks/step_regime.py "${REGIME[@]}" ;;
    local)  # DEVICE: the platform the device is priced as (gpu on a GPU)
      kplat=$("$PYTHON" -c 'import jax; p = jax.devices()[0].platform; print(p if p in ("cpu", "tpu") else "gpu")')
      step local 200 benchmarks/local_values.py "${LOCAL[@]/DEVICE/$kplat}" ;;
    kernels)
      kplat=$("$PYTHON" -c 'import jax; p = jax.devices()[0].platform; print(p if p in ("cpu", "tpu") else "gpu")')
      if [ -n "${KERNEL_ARGS:-}" ]; then
        runs=("$KERNEL_ARGS")
      elif [ "$SMOKE" = 1 ]; then
        runs=("--smoke --only minsr-auto-big" "--smoke --only minsr-auto")
      else
        runs=("--only minsr-auto-big" "--only minsr-auto")
      fi
      limit=200
      for only in "${runs[@]}"; do
        read -r -a more <<<"$only"
        step kernels "$limit" benchmarks/accelerator_cost.py --cost-platform "$kplat" --run 10 \
          --hlo-dir "$OUT/hlo" "${more[@]}"
        limit=330
      done
      (cd "$OUT" && tar czf hlo.tgz hlo && rm -rf hlo) ;;
    race) race ;;
    *) echo "STEPS: unknown step '$name' (expected calib core grad qgt qgt_eqmem large regime kernels local race)" | tee -a "$OUT/log.txt"
       status=1 ;;
  esac
done

{
  echo "vmcgrad device benchmarks, $(date -u +%Y-%m-%dT%H:%MZ), device: $(tail -n 1 "$OUT/device.txt")"
  echo "smoke=$SMOKE; per-benchmark JSON and full output in $OUT/"
  for name in $STEPS; do
    echo
    echo "### $name"
    if [ "$name" = large ]; then  # its tables follow the last progress line
      sed -n '/device(s)/,$p' "$OUT/$name.txt"
    elif [ "$name" = race ]; then  # its table, or the end of its output when it wrote none
      cat "$OUT/race/table.md" 2>/dev/null || tail -n 30 "$OUT/race.txt"
    else
      grep -v -i "warn" "$OUT/$name.txt" | tail -n 30
    fi
  done
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $status
