#!/usr/bin/env bash
# On a GPU machine, in one go: build (Release), run the whole test suite, the interop tests
# (the PyTorch plug-in under torch, when installed) and the GPU tests (compute-sanitizer
# over the GPU tests), gpumem info, the trace replays on the GPU
# and the pool benchmark. Logs go to $OUT (default ./gpu-check-out), and all of them again in
# $OUT/all-logs.tar.gz; a short table last.
#   .deps/googletest   GoogleTest sources, when the machine has no libgtest-dev
#   .gpurun/*.csv.gz   extra traces to replay (e.g. infer_llama.csv.gz)
# Then the KV bench, serve-sim on the GPU, a snapshot checked by torch.cuda._memory_viz and,
# with 2 GPUs or more, scripts/gpu-multi.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
BUILD=build-gpu
gtest_arg=()
[ -d .deps/googletest ] && gtest_arg=(-DGPUMEM_GTEST_SOURCE="$PWD/.deps/googletest")
{ date -u; nvidia-smi -L; } | tee "$OUT/info.txt"
cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=ON -DGPUMEM_BUILD_BENCH=ON "${gtest_arg[@]}" >"$BUILD.log" 2>&1 &&
  cmake --build $BUILD -j 16 >>"$BUILD.log" 2>&1 || { tail -40 "$BUILD.log"; exit 1; }
$BUILD/tools/gpumem info | tee -a "$OUT/info.txt"
$BUILD/tools/gpumem info --json --bandwidth >"$OUT/info.json"
grep -E 'measured|platform"' "$OUT/info.json"
$BUILD/tests/gpumem_gpu_tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
$BUILD/tests/gpumem_tests 2>&1 >"$OUT/all_tests.log"; tail -4 "$OUT/all_tests.log"
grep -E "SKIPPED|FAILED" "$OUT/all_tests.log" | head -20
# The interop tests: the plug-in under PyTorch on this GPU (torch_out_of_memory: the
# out-of-memory's type and text in forward, backward and on a side stream; torch_graphs,
# torch_mempool, torch_hf_generate: CUDA graphs, torch.compile, MemPool, HF generate with a
# static cache, the table of docs/PYTORCH.md), its C++ entry points, the Python package, the
# C API from C, the installed package.
(cd $BUILD && ctest -R "torch_out_of_memory|torch_graphs|torch_mempool|torch_hf_generate|TorchPlugin|python_package|c_api_c|install_package|python_onestep|torch_onestep|pip_install" \
  --output-on-failure) >"$OUT/interop.log" 2>&1
grep -E "tests passed|tests failed|Skipped|Failed" "$OUT/interop.log"
# One step for a PyTorch user: pip install . into a venv that sees this machine's torch,
# then an unmodified training script under GPUMEM_ENABLE=1 and under python -m gpumem run,
# from a folder outside the source tree (docs/PYTORCH.md).
onestep() {
  local venv=$PWD/$BUILD/onestep-venv src=$PWD
  rm -rf "$venv" && python3 -m venv --system-site-packages "$venv" &&
    GPUMEM_BUILD_DIR=$PWD/$BUILD/pip-build "$venv/bin/pip" install --no-deps --no-index "$src" &&
    (cd /tmp && GPUMEM_ENABLE=1 "$venv/bin/python" "$src/tests/interop/torch_train_script.py" --steps 20 &&
     "$venv/bin/python" -m gpumem run --mark-steps optimizer "$src/tests/interop/torch_train_script.py" --steps 20 &&
     "$venv/bin/python" "$src/tests/interop/torch_train_script.py" --steps 20)
}
onestep >"$OUT/onestep.log" 2>&1; echo "one step (pip install, GPUMEM_ENABLE, run, native) exit $?"; tail -3 "$OUT/onestep.log"
if command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --leak-check full $BUILD/tests/gpumem_gpu_tests --gtest_filter=-GpuFaultDeathTest.* >"$OUT/sanitizer.log" 2>&1
  echo "compute-sanitizer exit $?: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
  grep -E "^=========" "$OUT/sanitizer.log" | grep -v "ERROR SUMMARY\|LEAK SUMMARY" | head -12
fi
$BUILD/bench/pool_bench --device cuda 2>&1 | tee "$OUT/bench.txt"
$BUILD/examples/embedding_tables --device cuda --steps 2000 2>&1 | tee "$OUT/embedding.txt"
$BUILD/tools/gpumem replay data/train_llama.csv.gz --device cuda --passes 2 2>/dev/null | tee "$OUT/replay.txt"
# The other traces, all at once per pool: each one's table, then the summary over them.
traces=()
for t in .gpurun/*.csv.gz data/workloads/*.csv.gz; do [ -f "$t" ] && traces+=("$t"); done
for a in vmm_page_pool caching_pool; do
  $BUILD/tools/gpumem replay "${traces[@]}" --device cuda --passes 2 --allocator $a 2>/dev/null | tee -a "$OUT/replay.txt" | tail -1
done
# Step plans on a loop of equal steps (the fixed-shape training trace, when carried).
if [ -f .gpurun/torch_train_fixed.csv.gz ]; then
  $BUILD/tools/gpumem replay .gpurun/torch_train_fixed.csv.gz --device cuda --passes 3 \
    --allocator vmm_page_pool --step-plan 2>/dev/null | tee -a "$OUT/replay.txt" | tail -3
fi
# The KV layer: block pairs, prefix hashing, pinned host pool vs cudaMallocHost, swap
# bandwidth against plain copies (bytes checked), then the serving simulation on the GPU.
$BUILD/bench/kv_bench --device cuda 2>&1 | tee "$OUT/kv_bench.txt"
$BUILD/tools/gpumem serve-sim --device cuda 2>&1 | tee "$OUT/serve_sim.txt"
$BUILD/examples/paged_kv_cache --device cuda 2>&1 | tee "$OUT/kv_example.txt"
$BUILD/examples/guard_pages --device cuda 2>&1 | tee "$OUT/guard_pages.txt"
# A snapshot at peak, opened by PyTorch's own memory viewer tools.
$BUILD/tools/gpumem replay data/train_llama.csv.gz --device cuda --allocator vmm_page_pool \
  --snapshot "$OUT/train_peak.pickle" --snapshot-events 20000 >/dev/null 2>"$OUT/snapshot_replay.err" &&
  python3 scripts/check_snapshot_torch.py "$OUT/train_peak.pickle" 2>&1 | tee "$OUT/snapshot_check.txt" | tail -15
rm -f "$OUT/train_peak.pickle"
# The trace through PyTorch's own C++ caching allocator beside gpumem's pools (built when
# libtorch is found).
if [ -x $BUILD/bench/torch_replay_bench ]; then
  for t in data/train_llama.csv.gz .gpurun/*.csv.gz data/workloads/*.csv.gz; do
    [ -f "$t" ] && $BUILD/bench/torch_replay_bench "$t" --passes 2 2>&1 | tee -a "$OUT/torch_replay.txt"
  done
fi
# Several GPUs: DDP, FSDP, tensor-parallel decode and peer copies, gpumem against PyTorch's
# allocator in the same run (exits 77, saying why, with fewer than 2 GPUs).
python3 scripts/gpu-multi.py 2>"$OUT/multi_gpu.err" | tee "$OUT/multi_gpu.jsonl"
echo "multi-GPU exit ${PIPESTATUS[0]}: $(tail -1 "$OUT/multi_gpu.err")"
# The device tool brings back a limited number of files: every log also travels in one
# archive, named to sort first (the plain files stay for a local run).
(cd "$OUT" && tar -czf all-logs.tar.gz --exclude=all-logs.tar.gz -- *)
