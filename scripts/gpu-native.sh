#!/usr/bin/env bash
# On a GPU machine with PyTorch: builds the plug-in and libgpumem_torch_native.so (gpumem as
# PyTorch's own CUDAAllocator), runs the PyTorch tests on that route (the native allocator's
# own test, graphs, MemPool, out-of-memory, one step, HF Trainer), then the graph-trees
# benchmark and the CUDA IPC share benchmark. Logs and results go to $OUT (default
# ./gpu-native-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-native-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=OFF \
  -DGPUMEM_BUILD_BENCH=OFF -DGPUMEM_TORCH_NATIVE=ON >"$OUT/build.log" 2>&1 &&
  cmake --build $BUILD -j 16 --target gpumem_torch gpumem_torch_native gpumem_cli >>"$OUT/build.log" 2>&1 ||
  { grep -E "error|Error" "$OUT/build.log" | head -40; tail -20 "$OUT/build.log"; exit 1; }
{ date -u; nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__)'; cat $BUILD/src/interop/libgpumem_torch_native.torch; } | tee "$OUT/torch_info.txt"
export PYTHONPATH=$PWD/python GPUMEM_LIB=$PWD/$BUILD/src/interop/libgpumem_torch.so \
  PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 GPUMEM_COMPAT_JSON="$OUT/compat.jsonl" \
  GPUMEM_TORCH_ROUTE=native GPUMEM_EXPECTED_OOM=torch.OutOfMemoryError  # the native build's type
cd tests/interop
for t in ${TESTS:-torch_native_allocator_test torch_graph_test torch_mempool_test torch_oom_test torch_hf_trainer_test}; do
  timeout 300 python3 $t.py >"$OUT/$t.log" 2>&1; echo "$t exit $?"; grep -E "^(FAIL|ERROR)|Error|skipped" "$OUT/$t.log" | head -8
done
cd ../..
cat "$OUT/compat.jsonl"
[ "${BENCH:-1}" = 1 ] && timeout 400 python3 scripts/graph_trees_bench.py --repeats 3 --steps 150 --json "$OUT/graph_trees.json" 2>&1 | tail -14
[ "${BENCH:-1}" = 1 ] && timeout 300 python3 scripts/ipc_share_bench.py --gib 4 --repeats 3 --json "$OUT/ipc_share.json" 2>&1 | tail -6
