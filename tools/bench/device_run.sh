#!/usr/bin/env bash
# On the GPU machine (python3 + torch + CUDA, no network): build the CPU expert kernel, check it,
# benchmark it at 1..16 threads, run ft-calibrate, and the wrong-profile benchmark. Every result
# goes under $OUT (default ./device-out). Needs no network, pytest or ninja: ftkit is installed
# editable from this tree, the kernel is built with a plain g++ call, the checks run as a script.
#   OUT=/tmp/out bash tools/bench/device_run.sh        [WRONG_PROFILE=0 skips the slowest step]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! $PY -c "import ftkit.kernels.cpu" 2>/dev/null; then  # offline: no build isolation, no deps
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e .
fi
{ nproc; lscpu | grep -E 'Model name|^L3|Flags' | cut -c1-400; nvidia-smi -L || true; } > "$OUT/machine.txt" 2>&1

$PY -c "from ftkit.kernels.cpu import load; k = load(); print('kernel:', k.path, k.isa)" 2>&1 | tee "$OUT/kernel.txt"
$PY tests/test_cpu_kernels.py 2>&1 | tee -a "$OUT/kernel.txt"
$PY -m ftkit.tools.bench.cpu_experts --threads 1,2,4,8,16 --gib 4 --json "$OUT/cpu_experts.json" 2>&1 \
  | tee "$OUT/cpu_experts.txt"
$PY -m ftkit.tools.calibrate.cli --threads 4,8,15 --working-set 4G --out "$OUT/profile.json" --json \
  2> "$OUT/calibrate.txt" > /dev/null
cat "$OUT/calibrate.txt"
if [ "${WRONG_PROFILE:-1}" != 0 ]; then
  $PY -m ftkit.tools.bench.wrong_profile "${TMPDIR:-/tmp}/ftkit-bench" --profile "$OUT/profile.json" \
    --layers 4 --threads 15 --json "$OUT/wrong_profile.json" 2>&1 | tee "$OUT/wrong_profile.txt"
fi
