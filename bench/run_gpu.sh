#!/usr/bin/env bash
# One device-machine session: build lowfp with the CUDA backend for the GPU at hand, run the GPU
# tests and the GPU benchmarks. Logs go to $OUT (default bench/out/gpu). Usage, from the repo root:
#   bash bench/run_gpu.sh [build] [test] [all-tests] [bench] [emulate] [emulate-compile] [profile]
# (build test bench emulate when none is named; all-tests runs the whole suite with the CUDA
# build; emulate-compile, the torch.compile table, compiles for minutes)
set -uo pipefail
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
steps=${*:-build test bench emulate}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
for step in $steps; do
  case $step in
    build)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
      # One architecture, the GPU's own: a full build also embeds sm_80 and PTX.
      arch=$($PY -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
      CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $PY -m pip install --no-build-isolation --no-deps -q \
        -Ccmake.define.LOWFP_CUDA=ON -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="${arch}-real" . \
        2>&1 | tail -30 | tee "$OUT/build.log"
      $PY -c "import lowfp; assert lowfp.cuda_built(); print('lowfp', lowfp.__file__, 'CUDA built')" \
        || exit 1 ;;
    test)
      # (the tests marked cuda: each module's checks of the GPU against the CPU, and its reference
      # tests' cuda cases; tests/devices.py)
      $PY -m pytest -q -p no:cacheprovider --timeout 300 -n 8 -m 'cuda and not long' -rf tests 2>&1 \
        | tee "$OUT/tests.log" | tail -40 ;;
    all-tests)
      $PY -m pytest -q -p no:cacheprovider --timeout 600 -rf tests 2>&1 | tee "$OUT/all_tests.log" \
        | tail -40 ;;
    profile)
      $PY bench/profile_gpu.py 2>&1 | tee "$OUT/profile.log" ;;
    bench)
      $PY bench/bench_s2fp8.py --device cuda --json "$OUT/s2fp8.json" 2>&1 | tee "$OUT/bench_s2fp8.log"
      $PY bench/bench_optim.py --device cuda --repeats 11 --json "$OUT/optim.json" 2>&1 \
        | tee "$OUT/bench_optim.log"
      $PY bench/bench_host.py --device cuda 2>&1 | tee "$OUT/bench_host.log"
      $PY bench/bench_fused.py --device cuda --numel 67108864 2>&1 | tee "$OUT/bench_fused.log"
      $PY bench/bench_accumulate.py --device cuda --json "$OUT/accumulate.json" 2>&1 \
        | tee "$OUT/bench_accumulate.log" ;;
    emulate)
      $PY bench/bench_emulate.py --device cuda --no-compile --repeats 10 --json "$OUT/emulate.json" \
        2>&1 | tee "$OUT/bench_emulate.log"
      $PY bench/bench_emulate.py --device cuda --gemms-only --repeats 10 \
        --json "$OUT/emulate_gemms.json" 2>&1 | tee "$OUT/bench_emulate_gemms.log" ;;
    emulate-compile)
      $PY bench/bench_emulate.py --device cuda --compile-only --repeats 10 \
        --json "$OUT/emulate_compile.json" 2>&1 | tee "$OUT/bench_emulate_compile.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
