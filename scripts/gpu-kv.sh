#!/usr/bin/env bash
# On a GPU machine with PyTorch, transformers and Triton: builds (Release, the C library
# the Python package loads included), runs the KV cache's tests (the C API and gpumem.kv on
# sim, the storage as torch tensors and the paged decode against SDPA, GpumemCache under
# generate against DynamicCache), then the KV benchmarks (scripts/kv-gpu-bench.py).
# Writes the logs and $OUT/kv_bench.jsonl to $OUT (default ./gpu-kv-out).
#   SKIP_TESTS=1   only the benchmarks      SKIP_BENCH=1   only the tests
#   BENCH_ARGS     extra arguments of kv-gpu-bench.py (e.g. "--full", "--only attention")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-kv-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
gtest_arg=()
[ -d .deps/googletest ] && gtest_arg=(-DGPUMEM_GTEST_SOURCE="$PWD/.deps/googletest")
cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=ON \
  -DGPUMEM_BUILD_BENCH=OFF "${gtest_arg[@]}" >"$OUT/build.log" 2>&1 &&
  cmake --build $BUILD -j 16 --target gpumem gpumem_torch gpumem_cli c_api_kv_c_test \
    >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
{ date -u; nvidia-smi -L
  python3 -c 'import torch; print("torch", torch.__version__)'
  python3 -c 'import transformers; print("transformers", transformers.__version__)'
  python3 -c 'import triton; print("triton", triton.__version__)'; } 2>&1 | tee "$OUT/kv_info.txt"
lib=$PWD/$BUILD/src/interop/libgpumem_torch.so
export PYTHONPATH=$PWD/python GPUMEM_LIB=$lib PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  (cd $BUILD && ctest -R "^(c_api_kv_c|python_kv)$" --output-on-failure) >"$OUT/kv_sim_tests.log" 2>&1 || status=1
  grep -E "tests passed|tests failed" "$OUT/kv_sim_tests.log"
  for t in torch_kv_attention_test torch_hf_cache_test; do
    timeout 900 python3 tests/interop/$t.py >"$OUT/$t.log" 2>&1
    rc=$?
    case $rc in 0) r=pass ;; 77) r=skipped ;; *) r="FAIL ($rc)"; status=1 ;; esac
    echo "$t: $r"; tail -3 "$OUT/$t.log"
  done
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  rm -f "$OUT/kv_bench.jsonl"
  GPUMEM_CLI=$PWD/$BUILD/tools/gpumem timeout 1200 python3 scripts/kv-gpu-bench.py \
    --out "$OUT/kv_bench.jsonl" ${BENCH_ARGS:-} >"$OUT/kv_bench.log" 2>&1 || status=1
  cat "$OUT/kv_bench.jsonl"
fi
exit $status
