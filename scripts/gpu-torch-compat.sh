#!/usr/bin/env bash
# On a GPU machine with PyTorch: builds the plug-in and runs the PyTorch compatibility tests
# (CUDA graphs, torch.compile, autocast, checkpointing, record_stream, MemPool, the
# out-of-memory types) and the GPU tests. Writes $OUT/torch_compat.jsonl (one line per
# case: the table in docs/PYTORCH.md) and the logs to $OUT (default ./gpu-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
gtest_arg=()
[ -d .deps/googletest ] && gtest_arg=(-DGPUMEM_GTEST_SOURCE="$PWD/.deps/googletest")
cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=ON \
  -DGPUMEM_BUILD_BENCH=OFF "${gtest_arg[@]}" >"$OUT/build.log" 2>&1 &&
  cmake --build $BUILD -j 16 --target gpumem_torch gpumem_gpu_tests torch_plugin_tests >>"$OUT/build.log" 2>&1 ||
  { tail -40 "$OUT/build.log"; exit 1; }
{ date -u; nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__)'; } | tee "$OUT/torch_info.txt"
lib=$PWD/$BUILD/src/interop/libgpumem_torch.so
export PYTHONPATH=$PWD/python GPUMEM_LIB=$lib PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
GPUMEM_COMPAT_JSON="$OUT/torch_compat.jsonl" python3 tests/interop/torch_graph_test.py 2>&1 | tee "$OUT/torch_graphs.log" | tail -40
GPUMEM_COMPAT_JSON="$OUT/torch_compat.jsonl" python3 tests/interop/torch_mempool_test.py 2>&1 | tee "$OUT/torch_mempool.log" | tail -8
GPUMEM_EXPECTED_OOM=$(grep -q GPUMEM_TORCH_C10 $BUILD/build.ninja && echo torch.OutOfMemoryError || echo RuntimeError) \
  python3 tests/interop/torch_oom_test.py 2>&1 | tail -3
$BUILD/tests/gpumem_gpu_tests 2>&1 | tail -3
