#!/usr/bin/env bash
# What one allocate+free pair of pool_bench's mixed loop costs, in counts that do not drift
# with the host (bench/pair_loop: sim, vmm_page_pool or --pool caching_pool, a Release build):
#  - instructions, by callgrind: inclusive in memory_resource::allocate and ::deallocate,
#    collected inside the measured pairs only;
#  - mispredicted conditional branches in gpumem's functions, by cachegrind's branch model
#    (a simple predictor, sensitive to code layout: compare commits, not absolute values),
#    from two runs of N and 2N pairs: the difference is N pairs' worth, warm-up and set-up
#    cancel.
# Needs valgrind. Arguments go to pair_loop:
#   scripts/pair-instructions.sh [--lo BYTES] [--hi BYTES] [--pairs N] [--config K:V,...]
#                                [--pool vmm_page_pool|caching_pool]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "pair-instructions: valgrind is not installed" >&2; exit 1; }
build=${BUILD:-build-pairs}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" --target pair_loop >/dev/null
pairs=200000
args=()
while [ $# -gt 0 ]; do
  if [ "$1" = --pairs ] && [ $# -gt 1 ]; then pairs=$2; shift 2; else args+=("$1"); shift; fi
done
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bin="$build/bench/pair_loop"
"$bin" "${args[@]}" --pairs "$pairs"
valgrind --tool=callgrind --toggle-collect='measured_pairs*' --callgrind-out-file="$out/cg" \
  "$bin" "${args[@]}" --pairs "$pairs" >/dev/null 2>"$out/cg.err"
instructions=$(callgrind_annotate --inclusive=yes "$out/cg" |
  grep -E "memory_resource::(allocate|deallocate)\(" | awk '{gsub(",", "", $1); s += $1} END {print s + 0}')
mispredicts() {
  valgrind --tool=cachegrind --branch-sim=yes --cache-sim=no --cachegrind-out-file="$out/cb" \
    "$bin" "${args[@]}" --pairs "$1" >/dev/null 2>"$out/cb.err"
  # gpumem's functions only: the longer run also draws twice the random sizes.
  cg_annotate --show=Bcm "$out/cb" | grep -E "^ *[0-9,]+ .*gpumem::" |
    awk '{gsub(",", "", $1); s += $1} END {print s + 0}'
}
one=$(mispredicts "$pairs")
two=$(mispredicts $((2 * pairs)))
awk -v i="$instructions" -v a="$one" -v b="$two" -v n="$pairs" 'BEGIN {
  printf "instructions a pair: %.0f\nmispredicted branches a pair (cachegrind model): %.2f\n", i / n, (b - a) / n }'
