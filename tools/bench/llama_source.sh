#!/usr/bin/env bash
# llama.cpp's source for the GPU machine, which has no network: the llama.cpp that the
# llama-cpp-python source distribution on PyPI vendors (pip can fetch it here; a clone of
# llama.cpp is 1.5 GB), without what a CUDA build of llama-bench and llama-quantize does not
# use (other backends, tests, vocabularies, docs): ~6 MB, under the device's 64 MiB carry.
# device_run.sh's llamacpp part builds and runs it, beside ftkit, on one Q4_K_M file. Nothing
# of it enters ftkit (read for facts, run for comparison).
#   bash tools/bench/llama_source.sh [VERSION]  ->  .llama/llama-src.tgz (carry .llama)
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-0.3.36}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "llama-cpp-python==$version"
top=llama_cpp_python-$version/vendor/llama.cpp
tar xzf "$tmp"/llama_cpp_python-"$version".tar.gz -C "$tmp" --wildcards "$top/*" --exclude="$top/models/*" \
  --exclude="$top/docs/*" --exclude="$top/tools/ui/*" --exclude="$top/benches/*"
mkdir -p .llama
skip=(); for d in ggml/src/ggml-{vulkan,sycl,opencl,hexagon,metal,et,webgpu,openvino,cann,virtgpu} tests gguf-py \
  conversion scripts media app skills pocs; do skip+=(--exclude="./$d"); done
tar czf .llama/llama-src.tgz -C "$tmp/$top" "${skip[@]}" .
grep -qx '/.llama/' .git/info/exclude 2>/dev/null || echo /.llama/ >> .git/info/exclude
echo "wrote .llama/llama-src.tgz ($(du -h .llama/llama-src.tgz | cut -f1)), llama.cpp of llama-cpp-python $version"
