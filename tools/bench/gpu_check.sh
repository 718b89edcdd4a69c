#!/usr/bin/env bash
# On the GPU machine: install ftkit into its python, run the GPU tests, measure the FTW reader
# with pinning and the decode/prefill baseline on the qwen3-30b-a3b shape cut to 12 layers.
# Results land in $OUT (device tool) or ./gpu-results.
set -uo pipefail
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
W=${WORK:-/tmp/ftkit-bench}; mkdir -p "$W"
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)" | tee -a "$OUT/gpu.txt"
$PY -m pytest -q -x --tb=short -m gpu tests/test_gpu.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
$PY -m ftkit.tools.bench.ftw_read "$W" --gib 4 --threads 16 --pin 2>&1 | tee "$OUT/ftw_read.txt"
[ -f "$W/q12.ftw/manifest.json" ] || $PY -m ftkit.tools.bench.cli write --preset qwen3-30b-a3b --layers 12 --out "$W/q12.ftw" 2>&1 | tail -1
$PY -m ftkit.tools.bench.cli decode -m "$W/q12.ftw" --cache-fraction 0.35 --threads ${THREADS:-15} \
    --pcie-gbps ${PCIE:-53} --cpu-gbps ${CPUBW:-34} --tokens ${TOKENS:-32} --chunks ${CHUNKS:-8192} \
    --strategies ${STRATEGIES:-offload,cpu,hybrid} --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.txt"
