#!/usr/bin/env bash
# A/B of bench/pool_bench: an earlier commit against the working tree, built on one host and
# run in alternation, so that a host whose speed drifts by tens of percent within minutes
# (docs/RESULTS.md) favours neither side. Prints, per allocator, the median over runs of
# each run's median ratio to cudaMallocAsync (ratios are taken within a round, so they
# survive the drift that absolute nanoseconds do not) and the range over runs.
#
#   scripts/ab-bench.sh prepare REV     on the development machine: the tree of REV into
#                                       .gpurun/ab-base.tar (git-ignored; carry .gpurun)
#   scripts/ab-bench.sh run [N]         on the GPU machine: build both, N runs each (default
#                                       8), the summary (ab.txt) and the logs (ab-logs.tar.gz)
#                                       under $OUT (default ./ab-out)
#   scripts/ab-bench.sh summary DIR     the summary of a run's logs again
set -euo pipefail
cd "$(dirname "$0")/.."

summary() {
  python3 - "$1" <<'EOF'
import glob, os, re, statistics, sys

def logs():
    """(side, lines) of each run's pool_bench output: base1.txt, new1.txt, ..."""
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.txt"))):
        m = re.match(r"(base|new)(\d+)\.txt$", os.path.basename(path))
        if m:
            yield m.group(1), open(path).read().splitlines()

runs = {}  # (allocator, side) -> [(same ns, mixed ns, mixed ratio)]
driver = {}  # (allocator, side) -> [mixed driver ns a pair] (pool_bench from 2026-12-03 on)
for side, lines in logs():
    table = False
    for line in lines:
        if line.startswith("allocator "):
            table = True
            continue
        if table and (not line.strip() or line.startswith("  ")):
            break  # the table ends at a blank line or the driver time by call below it
        if table:
            name, rest = line[:22].strip(), line[22:].split()
            runs.setdefault((name, side), []).append(
                (float(rest[0]), float(rest[1]), float(rest[3].rstrip("x"))))
            if len(rest) == 8:
                driver.setdefault((name, side), []).append(float(rest[7]))
names = []
for name, _ in runs:
    if name not in names and name not in ("cudaMallocAsync", "cudaMalloc"):
        names.append(name)
print(f"{'allocator':22} {'side':5} {'runs':>4} {'mixed ns (median)':>18} {'vs async (median)':>18} {'range over runs':>16} {'driver ns':>9}")
for name in names:
    for side in ("base", "new"):
        v = runs.get((name, side), [])
        if not v:
            continue
        ratios = [r for _, _, r in v]
        d = driver.get((name, side), [])
        print(f"{name:22} {side:5} {len(v):4d} {statistics.median(n for _, n, _ in v):18.1f} "
              f"{statistics.median(ratios):17.1f}x {min(ratios):7.1f}x-{max(ratios):5.1f}x"
              + (f" {statistics.median(d):9.1f}" if d else ""))
# The pools' mixed-loop driver time by call kind (the lines under the table): median over runs.
by_call = {}  # (allocator, side, call) -> [ns a pair]
for side, lines in logs():
    for line in lines:
        c = re.match(r"  (\S+), mixed_64 driver ns a pair by call \(mean over rounds\): (.*)", line)
        if c:
            for part in c.group(2).split(", "):
                call, ns = part.rsplit(" ", 1)
                by_call.setdefault((c.group(1), side, call), []).append(float(ns))
if by_call:
    print(f"\n{'mixed driver ns a pair by call':34} {'side':5} {'median':>8} {'range over runs':>18}")
    for (name, side, call), v in sorted(by_call.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        print(f"{name + ' ' + call:34} {side:5} {statistics.median(v):8.1f} {min(v):8.1f}-{max(v):8.1f}")
# Threads sharing one pool: wall ns a pair, all threads together (no ratio: cudaMallocAsync
# is not run threaded), the median over runs and the range.
threaded = {}  # (case, threads, side) -> [ns]
for side, lines in logs():
    for line in lines:
        t = re.match(r"(\d+) thread\(s\) sharing one pool, (.*?): ([\d.]+) ns", line)
        if t:
            threaded.setdefault((t.group(2), int(t.group(1)), side), []).append(float(t.group(3)))
if threaded:
    print(f"\n{'threads sharing one pool':34} {'n':>2} {'side':5} {'ns a pair (median)':>19} {'range over runs':>18}")
    for (case, n, side), v in sorted(threaded.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "base")):
        print(f"{case:34} {n:2d} {side:5} {statistics.median(v):19.1f} {min(v):8.1f}-{max(v):8.1f}")
EOF
}

case "${1:-}" in
  prepare)
    rev=${2:?usage: scripts/ab-bench.sh prepare REV}
    mkdir -p .gpurun
    git archive "$rev" --prefix=base/ -o .gpurun/ab-base.tar
    echo "$(git rev-parse --short "$rev")" >.gpurun/ab-base.rev
    echo "wrote .gpurun/ab-base.tar ($(git rev-parse --short "$rev")); carry .gpurun to the GPU machine"
    ;;
  run)
    n=${2:-8}
    out=${OUT:-$PWD/ab-out}
    mkdir -p "$out"
    [ -f .gpurun/ab-base.tar ] || { echo "no .gpurun/ab-base.tar: run 'prepare REV' first" >&2; exit 2; }
    work=$(mktemp -d)
    tar -xf .gpurun/ab-base.tar -C "$work"
    cfg=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=OFF -DGPUMEM_BUILD_BENCH=ON)
    cmake -S "$work/base" -B "$work/build" "${cfg[@]}" >"$out/build-base.log" 2>&1
    cmake --build "$work/build" --target pool_bench >>"$out/build-base.log" 2>&1
    cmake -S . -B build-ab "${cfg[@]}" >"$out/build-new.log" 2>&1
    cmake --build build-ab --target pool_bench >>"$out/build-new.log" 2>&1
    { date -u; nvidia-smi -L 2>/dev/null || true; echo "base: $(cat .gpurun/ab-base.rev 2>/dev/null || echo '?')"; } >"$out/ab.txt"
    for i in $(seq 1 "$n"); do
      if [ $((i % 2)) = 1 ]; then order="base new"; else order="new base"; fi
      for side in $order; do
        bin=build-ab/bench/pool_bench
        [ "$side" = base ] && bin=$work/build/bench/pool_bench
        "$bin" >"$out/$side$i.txt" 2>&1
      done
    done
    date -u >>"$out/ab.txt"
    summary "$out" | tee -a "$out/ab.txt"
    # The device tool brings back a limited number of files: the runs' logs travel as one.
    (cd "$out" && tar -czf ab-logs.tar.gz base*.txt new*.txt build-*.log && rm -f base*.txt new*.txt build-*.log)
    ;;
  summary)
    dir=${2:?usage: scripts/ab-bench.sh summary DIR}
    if [ -f "$dir/ab-logs.tar.gz" ]; then
      tmp=$(mktemp -d)
      tar -xzf "$dir/ab-logs.tar.gz" -C "$tmp"
      summary "$tmp"
      rm -rf "$tmp"
    else
      summary "$dir"
    fi
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
