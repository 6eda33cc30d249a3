#!/usr/bin/env bash
# One device-machine call (issue 56): build lowfp for the GPU at hand, run the suite's CUDA tests
# and the GPU benchmarks within a deadline, and write one log and one JSON per part to $OUT (the
# device tool brings back 8 files at most; default bench/out/gpu):
#   suite.log    suite.json     the build and the tests marked cuda (JSON: outcome counts, failures)
#   kernels.log  kernels.json   element-wise rounding (2^28), scaled formats beside torchao's
#                               compiled casts (2^26), S2FP8, accumulation, host cost per call;
#                               roundings fused by Inductor (log only)
#   optim.log    optim.json     the ExtraBits optimizers
#   emulate.log  emulate.json   emulated training steps, eager and under GEMM recipes
# Usage, from the repository root, with the wheels the device image lacks in .whl, carried (fetch
# them here with: pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0 gfloat
# more_itertools array-api-compat):
#   bash bench/run_gpu.sh [build] [test] [kernels] [optim] [emulate] [fused] [emulate-compile] [all-tests] [profile]
# Before a GPU session, .ci/device-torch runs the suite on the device's Python and torch on a CPU
# machine, and .ci/triton-interpreter runs the Triton code of lowfp's fused roundings under Triton's
# interpreter, both at no device time; bench/prebuild_gpu.sh builds the wheel that the build step
# then installs in seconds (carry .whl-lowfp too), where it was built from the working tree's
# sources (bench/gpu_parts.py sources) for this GPU's architecture.
# The default, build test kernels optim emulate fused, runs the most wanted first: the tests at most
# LOWFP_GPU_TEST_SECONDS (default 180), so that the benchmarks follow. A step starts only while
# the time it needs is left before the deadline (LOWFP_GPU_DEADLINE seconds from the start,
# default 540, inside the tool's 10-minute call) and is cut off there; the logs say which.
set -uo pipefail
OUT=${OUT:-bench/out/gpu}
DEADLINE=${LOWFP_GPU_DEADLINE:-540}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)  # each benchmark's JSON, merged into one per part
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TEST_SECONDS=${LOWFP_GPU_TEST_SECONDS:-180}
steps=${*:-build test kernels optim emulate fused}

WHEELS=${LOWFP_GPU_WHEELS:-.whl}
PREBUILT=${LOWFP_GPU_PREBUILT:-.whl-lowfp}  # bench/prebuild_gpu.sh's wheel and its sources' digest
if compgen -G "$WHEELS/*.whl" >/dev/null; then  # torchao and the tests' other packages the image lacks
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/lowfp-site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/lowfp-site${PYTHONPATH:+:$PYTHONPATH}
fi

left() { echo $((DEADLINE - SECONDS)); }

# starts PART NEED: whether step PART may start, NEED seconds being the least it needs
starts() {
  if (($(left) < $2)); then
    echo "== $1: skipped at ${SECONDS} s: $(left) s left before the deadline, it needs $2" | tee -a "$OUT/$1.log"
    return 1
  fi
  echo "== $1: started at ${SECONDS} s" | tee -a "$OUT/$1.log"
  mkdir -p "$WORK/$1"
}

# run PART NAME CMD...: CMD's output appended to PART's log, interrupted at the deadline (or after
# $CAP seconds, where CAP is set and sooner: pytest then still writes its report); NAME is the key of the JSON it writes to
# "$WORK/PART/NAME.json" (when it writes one)
run() {
  local part=$1 name=$2 limit
  shift 2
  limit=$(left)
  if [ -n "${CAP:-}" ] && ((CAP < limit)); then limit=$CAP; fi
  ((limit > 0)) || limit=1  # (timeout 0 would mean none)
  echo "-- $name: $* (at ${SECONDS} s, at most $limit s)" >>"$OUT/$part.log"
  timeout -s INT -k 30 "$limit" "$@" 2>&1 | tee -a "$OUT/$part.log" | tail -25
  local rc=$?
  ((rc == 0)) || echo "-- $name: exit status $rc (124: cut off at its limit)" | tee -a "$OUT/$part.log"
}

# merge PART: its benchmarks' JSON files as one object, keyed by name, in $OUT/PART.json
merge() { $PY bench/gpu_parts.py merge "$WORK/$1" "$OUT/$1.json"; }

for step in $steps; do
  case $step in
    build)
      starts suite 120 || exit 1
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/suite.log"
      # One architecture, the GPU's own: a full build also embeds sm_80 and PTX.
      arch=$($PY -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
      wheel=$(compgen -G "$PREBUILT/lowfp-*.whl" | head -1)
      built=""
      if [ -n "$wheel" ] && [ "$arch" = 90 ] &&
        [ "$(cat "$PREBUILT/sources.sha256" 2>/dev/null)" = "$($PY bench/gpu_parts.py sources)" ]; then
        run suite prebuilt $PY -m pip install --no-index --no-deps --force-reinstall -q "$wheel"
        if $PY -c "import lowfp; assert lowfp.cuda_built()" 2>/dev/null; then
          built=1
        else
          echo "-- prebuilt: $wheel did not import with CUDA; building" | tee -a "$OUT/suite.log"
        fi
      elif [ -n "$wheel" ]; then
        echo "-- prebuilt: $wheel not taken (built from other sources, or the GPU is sm_$arch); building" |
          tee -a "$OUT/suite.log"
      fi
      export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
      [ -n "$built" ] || run suite build $PY -m pip install --no-build-isolation \
        --no-deps -q -Ccmake.define.LOWFP_CUDA=ON -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="${arch}-real" .
      run suite check $PY -c "import lowfp; assert lowfp.cuda_built(); print('lowfp', lowfp.__file__, 'CUDA built')"
      $PY -c "import lowfp; assert lowfp.cuda_built()" 2>/dev/null || exit 1 ;;
    kernels)
      starts kernels 60 || continue
      run kernels quantize $PY bench/bench_quantize.py --device cuda --json "$WORK/kernels/quantize.json"
      run kernels scaled $PY bench/bench_scaled.py --device cuda --json "$WORK/kernels/scaled.json"
      run kernels s2fp8 $PY bench/bench_s2fp8.py --device cuda --json "$WORK/kernels/s2fp8.json"
      run kernels accumulate $PY bench/bench_accumulate.py --device cuda --json "$WORK/kernels/accumulate.json"
      # (B of 8 columns, attention's per-head products: the narrow tiles)
      run kernels accumulate-narrow $PY bench/bench_accumulate.py --device cuda --size 8192 4096 8 \
        --json "$WORK/kernels/accumulate_narrow.json"
      run kernels host $PY bench/bench_host.py --device cuda
      merge kernels ;;
    fused)
      # (Inductor compiles each case's rounding: minutes)
      starts kernels 60 || continue
      run kernels fused $PY bench/bench_fused.py --device cuda --numel 67108864 ;;
    test)
      # (the tests marked cuda: each module's checks of the GPU against the CPU, and its reference
      # tests' cuda cases; tests/devices.py)
      starts suite 90 || continue
      CAP=$TEST_SECONDS run suite tests $PY -m pytest -q -p no:cacheprovider --timeout 300 -n 8 -m 'cuda and not long' -rf \
        --junitxml="$WORK/suite/junit.xml" tests
      [ -f "$WORK/suite/junit.xml" ] && $PY bench/gpu_parts.py junit "$WORK/suite/junit.xml" "$OUT/suite.json" ;;
    all-tests)
      starts suite 300 || continue
      run suite all-tests $PY -m pytest -q -p no:cacheprovider --timeout 600 -n 8 -rf \
        --junitxml="$WORK/suite/junit.xml" tests
      [ -f "$WORK/suite/junit.xml" ] && $PY bench/gpu_parts.py junit "$WORK/suite/junit.xml" "$OUT/suite.json" ;;
    optim)
      starts optim 30 || continue
      run optim optim $PY bench/bench_optim.py --device cuda --repeats 11 --json "$WORK/optim/optim.json"
      merge optim ;;
    emulate)
      starts emulate 60 || continue
      run emulate eager $PY bench/bench_emulate.py --device cuda --no-compile --repeats 10 \
        --json "$WORK/emulate/eager.json"
      run emulate gemms $PY bench/bench_emulate.py --device cuda --gemms-only --repeats 10 \
        --json "$WORK/emulate/gemms.json"
      merge emulate ;;
    emulate-compile)
      # (compiles for minutes)
      starts emulate 240 || continue
      run emulate compile $PY bench/bench_emulate.py --device cuda --compile-only --repeats 10 \
        --json "$WORK/emulate/compile.json"
      merge emulate ;;
    profile)
      starts kernels 30 || continue
      run kernels profile $PY bench/profile_gpu.py ;;
    *) echo "unknown step $step (steps: build test kernels optim emulate fused emulate-compile all-tests profile)"; exit 2 ;;
  esac
done
echo "== done at ${SECONDS} s; in $OUT: $(ls "$OUT" | tr '\n' ' ')"
