#!/usr/bin/env bash
# On a GPU machine with PyTorch: builds, runs the PyTorch compatibility tests (CUDA graphs,
# torch.compile, autocast, checkpointing, record_stream, MemPool), the interop tests (the
# plug-in's entry points, the Python package, pip install, the one-step switches, the
# out-of-memory types, the C API, the CLI's bad input on cuda) and the GPU tests. Writes
# $OUT/torch_compat.jsonl (one line per case: the table in docs/PYTORCH.md) and the logs to
# $OUT (default ./gpu-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
gtest_arg=()
[ -d .deps/googletest ] && gtest_arg=(-DGPUMEM_GTEST_SOURCE="$PWD/.deps/googletest")
cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=ON \
  -DGPUMEM_BUILD_BENCH=OFF "${gtest_arg[@]}" >"$OUT/build.log" 2>&1 &&
  cmake --build $BUILD -j 16 >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
{ date -u; nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__)'; } | tee "$OUT/torch_info.txt"
[ "${SKIP_CTEST:-0}" = 1 ] || (cd $BUILD && ctest -E "torch_graphs|torch_mempool|torch_hf_generate" -R "torch_|TorchPlugin|python_|pip_install|c_api|install_package|cli_bad_input|replay_torch_snapshot" \
  --output-on-failure) >"$OUT/interop.log" 2>&1
[ "${SKIP_CTEST:-0}" = 1 ] || grep -E "tests passed|tests failed|\(Skipped\)|\(Failed\)|Not Run" "$OUT/interop.log"
lib=$PWD/$BUILD/src/interop/libgpumem_torch.so
export PYTHONPATH=$PWD/python GPUMEM_LIB=$lib PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
rm -f "$OUT/torch_compat.jsonl"
GPUMEM_COMPAT_JSON="$OUT/torch_compat.jsonl" python3 tests/interop/torch_graph_test.py >"$OUT/torch_graphs.log" 2>&1
GPUMEM_COMPAT_JSON="$OUT/torch_compat.jsonl" python3 tests/interop/torch_mempool_test.py >"$OUT/torch_mempool.log" 2>&1
GPUMEM_COMPAT_JSON="$OUT/torch_compat.jsonl" python3 tests/interop/torch_hf_generate_test.py >"$OUT/torch_hf_generate.log" 2>&1
cat "$OUT/torch_compat.jsonl"
# One step for a PyTorch user: pip install . into a venv that sees this machine's torch, then
# an unmodified training script under GPUMEM_ENABLE=1 and under python -m gpumem run, from a
# folder outside the source tree (docs/PYTORCH.md).
onestep() {
  local venv=$PWD/$BUILD/onestep-venv src=$PWD
  # The venv also sees the packages of the python3 that has torch (itself a venv, whose
  # packages --system-site-packages would not reach).
  rm -rf "$venv" && python3 -m venv "$venv" &&
    python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
      >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch-site.pth" &&
    GPUMEM_BUILD_DIR=$PWD/$BUILD/pip-build "$venv/bin/pip" install --no-deps --no-index "$src" &&
    (cd /tmp && env -u PYTHONPATH -u GPUMEM_LIB GPUMEM_ENABLE=1 "$venv/bin/python" "$src/tests/interop/torch_train_script.py" --steps 20 &&
     env -u PYTHONPATH -u GPUMEM_LIB "$venv/bin/python" -m gpumem run --mark-steps optimizer "$src/tests/interop/torch_train_script.py" --steps 20 &&
     env -u PYTHONPATH -u GPUMEM_LIB "$venv/bin/python" "$src/tests/interop/torch_train_script.py" --steps 20)
}
onestep >"$OUT/onestep.log" 2>&1; echo "one step (pip install, GPUMEM_ENABLE, run, native) exit $?"; tail -4 "$OUT/onestep.log"
$BUILD/tests/gpumem_gpu_tests 2>&1 | tail -3
