#!/usr/bin/env bash
# Builds, on this machine and before a GPU session, the wheel that bench/run_gpu.sh's build step
# installs in seconds in place of building lowfp on the device (minutes of device time): for the
# device image's Python 3.12 (.ci/python312), with the CUDA extension as sm_90 machine code (H100
# and H200) from this machine's nvcc, into .whl-lowfp/ beside the digest of the sources it was
# built from (bench/gpu_parts.py sources). run_gpu.sh builds from source where the working tree's
# digest differs, the GPU is not sm_90, or the installed wheel does not import. Then carry both
# wheel folders:
#   run(command="bash bench/run_gpu.sh", carry=[".whl", ".whl-lowfp"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvcc >/dev/null || { echo "prebuild_gpu: no nvcc here" >&2; exit 2; }
PY312=$(bash .ci/python312)
rm -rf .whl-lowfp
mkdir -p .whl-lowfp
digest=$(python3 bench/gpu_parts.py sources)
CUDAARCHS=90-real LOWFP_CUDA=ON "$PY312" -m pip wheel --no-deps -w .whl-lowfp .
[ "$(python3 bench/gpu_parts.py sources)" = "$digest" ] || { echo "prebuild_gpu: the sources changed during the build" >&2; exit 1; }
echo "$digest" > .whl-lowfp/sources.sha256
ls -l .whl-lowfp
