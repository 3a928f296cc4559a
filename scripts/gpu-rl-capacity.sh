#!/usr/bin/env bash
# On a GPU machine with PyTorch: the capacity part of examples/rl_colocate.py alone. Builds the
# plug-in where build-gpu lacks it, then for each layout of LAYOUTS (default "baseline one")
# bisects the largest rollout batch under the cap, each try a fresh process, between the
# bounds BOUNDS_<layout> ("FITS:FAILS", from an earlier search; none: doubling from 128).
# RL_ARGS adds flags to every try. Results go to $OUT/capacity_<layout>.json, each try's
# output (an out-of-memory's whole report) to $OUT/capacity_<layout>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-rl-capacity-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
if [ ! -f $BUILD/src/interop/libgpumem_torch_native.so ]; then
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=OFF \
    -DGPUMEM_BUILD_BENCH=OFF -DGPUMEM_TORCH_NATIVE=ON >"$OUT/build.log" 2>&1 &&
    cmake --build $BUILD -j 16 --target gpumem_torch gpumem_torch_native >>"$OUT/build.log" 2>&1 ||
    { tail -20 "$OUT/build.log"; exit 1; }
fi
export PYTHONPATH=$PWD/python GPUMEM_LIB=$PWD/$BUILD/src/interop/libgpumem_torch.so \
  PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
for layout in ${LAYOUTS:-baseline one}; do
  var=BOUNDS_$layout
  bounds=${!var:-}
  args=(--layout "$layout" --find-max-batch --capacity-tries "${TRIES:-4}")
  [ -n "$bounds" ] && args+=(--capacity-bounds "$layout:$bounds")
  timeout "${T_LAYOUT:-280}" python3 examples/rl_colocate.py "${args[@]}" ${RL_ARGS:-} \
    --json "$OUT/capacity_$layout.json" 2>&1 | tee "$OUT/capacity_$layout.log" |
    grep -E '^\{"capacity"|^\{"out_of_memory"|Error|error' | cut -c1-700 | head -20
  echo "$layout exit ${PIPESTATUS[0]}"
done
