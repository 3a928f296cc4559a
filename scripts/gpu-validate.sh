#!/usr/bin/env bash
# One GPU call that checks the newest GPU paths first: the native allocator built and its tests
# run (statistics, graphs, MemPool, CUDA IPC, sleep and sharing; TESTS overrides the list),
# then examples/rl_colocate.py (RL_ARGS, default: without the capacity search) in the time
# left of CALL_SECONDS (default 450). Results go to $OUT, the logs as one archive (logs.tgz);
# TORCH_HEADERS=1 adds torch's headers (torchinc.tgz, to build the native allocator against
# them elsewhere).
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/gpu-validate-out}; mkdir -p "$OUT"
T0=$SECONDS
TD=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')
H=include  # torch's header folders, relative to the torch package
[ "${TORCH_HEADERS:-0}" = 1 ] &&
  (cd "$TD" && tar czf "$OUT/torchinc.tgz" $H/c10 $H/torch/headeronly $H/torch/csrc/cuda $H/ATen/cuda 2>&1 | tail -2)
echo "ptrace_scope $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null) uid $(id -u)"
BENCH=0 OUT=$OUT TESTS="${TESTS:-torch_native_allocator_test torch_graph_test torch_mempool_test torch_sleep_share_test torch_memory_saver_test}" timeout 330 ./scripts/gpu-native.sh 2>&1 | tail -45
export PYTHONPATH=$PWD/python GPUMEM_LIB=$PWD/build-gpu/src/interop/libgpumem_torch.so PYTHONDONTWRITEBYTECODE=1
LEFT=$((${CALL_SECONDS:-450} - (SECONDS - T0)))
echo "rl: $LEFT s left"
[ $LEFT -gt 60 ] && { timeout $LEFT python3 examples/rl_colocate.py ${RL_ARGS:---no-capacity} --json $OUT/rl.json >$OUT/rl.log 2>&1; echo "rl exit $?"; tail -30 $OUT/rl.log; }
# Few files come back from a device call: the logs travel as one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
