#!/usr/bin/env bash
# On one GPU with torch and transformers: gpumem's defaults (footprint:fast) against PyTorch's
# allocators, in parts, each under its own timeout, so one that fails or runs out of time
# costs none of the others. Everything goes to $OUT (default ./gpu-fast-out).
#
#   scripts/gpu-fast.sh [PART...]      PARTs (default: replay steps maxbatch), in this order:
#   replay    bench/torch_replay_bench over every trace of data/, data/workloads/ and $TRACES
#             (a folder of *.csv.gz, optional), 2 passes, one process a trace: c10, gpumem's
#             defaults, footprint:tight and caching_pool; then c10 again with
#             expandable_segments:True (--c10-only). points.json, torch_replay.txt, the
#             per-trace table replay.md, and tradeoff.svg (gpumem replay --tradeoff-plot)
#   steps     each workload of scripts/record_workloads.py timed (--time, one warm run, a
#             process each) natively and under gpumem's defaults, the sides alternating,
#             REPEATS rounds; steps.md: median seconds with the spread, gpumem / native,
#             peak reserved / requested. SHARD=i/n times the i-th of n slices of the workloads
#   maxbatch  scripts/max_batch.py under a cap of CAP_GIB for every allocator (max_batch/)
#
# Environment: OUT, TRACES, WORKLOADS (steps; default all), REPEATS (3), SHARD, CAP_GIB (8),
# JOBS (5, searches side by side), T_BUILD, T_REPLAY, T_STEPS, T_MAXBATCH (seconds a part may
# run), BUILD (build folder, default build-fast; kept between runs).
# Time on an H100/H200, roughly: build 2-4 min (once); replay 2-4 min; steps about 12 s a
# process, 38 processes a round for the 19 workloads (SHARD=1/3 .. 3/3 keep each under
# 10 min at REPEATS=3); maxbatch 4-7 min.
set -uo pipefail
SELF=$(readlink -f "$0")
cd "$(dirname "$SELF")/.." || exit 2
OUT=${OUT:-$PWD/gpu-fast-out}
BUILD=${BUILD:-build-fast}
case $BUILD in /*) ;; *) BUILD=$PWD/$BUILD ;; esac
REPEATS=${REPEATS:-3}
CAP_GIB=${CAP_GIB:-8}
JOBS=${JOBS:-5}
T_BUILD=${T_BUILD:-900}
T_REPLAY=${T_REPLAY:-480}
T_STEPS=${T_STEPS:-560}
T_MAXBATCH=${T_MAXBATCH:-560}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export GPUMEM_LIB=$BUILD/src/interop/libgpumem_torch.so

# --- the parts' loops (run by the script itself under `timeout`) ---------------------------

replay_loop() {
  local traces=() t
  for t in data/*.csv.gz data/workloads/*.csv.gz; do [ -f "$t" ] && traces+=("$t"); done
  if [ -n "${TRACES:-}" ]; then
    for t in "$TRACES"/*.csv.gz; do [ -f "$t" ] && traces+=("$t"); done
  fi
  echo "${#traces[@]} traces"
  for t in "${traces[@]}"; do
    "$BUILD/bench/torch_replay_bench" "$t" --passes 2 --json "$OUT/points.json" ||
      echo "torch_replay_bench $t: exit $?"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      "$BUILD/bench/torch_replay_bench" "$t" --passes 2 --json "$OUT/points.json" --c10-only ||
      echo "torch_replay_bench (expandable segments) $t: exit $?"
  done
}

steps_workloads() {
  local all
  all=${WORKLOADS:-$(python3 -c 'import sys; sys.path.insert(0, "scripts"); import record_workloads as r; print(" ".join(r.WORKLOADS))')}
  if [ -z "${SHARD:-}" ]; then echo "$all"; return; fi
  python3 - "$SHARD" $all <<'PY'
import sys
i, n = (int(x) for x in sys.argv[1].split("/"))
names = sys.argv[2:]
print(" ".join(names[k] for k in range(len(names)) if k % n == i - 1))
PY
}

steps_loop() {
  local ws w r m order k
  ws=$(steps_workloads)
  mkdir -p "$OUT/steps"
  for r in $(seq "$REPEATS"); do
    k=$r
    for w in $ws; do
      # Which side goes first flips from workload to workload and from round to round.
      k=$((k + 1))
      if [ $((k % 2)) = 0 ]; then order="native gpumem"; else order="gpumem native"; fi
      for m in $order; do
        timeout -k 10 300 python3 scripts/record_workloads.py "$OUT/steps" --only "$w" \
          --time "$m" --warm 1 >"$OUT/steps/${w}_${m}_$r.log" 2>&1 ||
          echo "$w $m round $r: exit $? ($OUT/steps/${w}_${m}_$r.log)"
      done
    done
  done
}

case "${1:-}" in
  __replay_loop) replay_loop; exit ;;
  __steps_loop) steps_loop; exit ;;
esac

# --- summaries (outside the timeouts: whatever the loops finished) -------------------------

replay_summary() {
  python3 - "$OUT/points.json" <<'PY' | tee "$OUT/replay.md"
import json, math, os, sys
try:
    points = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit("no points: %s" % e)
sides = {"c10": "pytorch c10 caching allocator", "expandable": "pytorch c10 expandable segments",
         "default": "gpumem vmm_page_pool", "tight": "gpumem vmm_page_pool footprint:tight",
         "caching_pool": "gpumem caching_pool"}
by = {}
for p in points:
    by.setdefault(p["trace"], {})[p["allocator"]] = p
def geo(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
print("| trace | c10 frag · cold · warm | expandable frag · warm | default frag · cold · warm | "
      "warm / c10 | cold / c10 | default calls | tight frag · warm |")
print("| --- | --- | --- | --- | ---: | ---: | ---: | --- |")
warm_r, cold_r, frag_d, frag_c = [], [], [], []
met_warm = met_cold = met_frag = n = 0
def f(p, *keys):
    if not p or p.get("oom"):
        return "oom" if p else "-"
    return " · ".join(("%.4f" % p[k]) if k == "fragmentation" else "{:,.0f}".format(p[k]) for k in keys)
for trace, s in by.items():
    c, e, d, t = (s.get(sides[k]) for k in ("c10", "expandable", "default", "tight"))
    wr = cr = None
    if c and d and not c.get("oom") and not d.get("oom"):
        n += 1
        wr, cr = d["ns_per_event"] / c["ns_per_event"], d["ns_per_event_cold"] / c["ns_per_event_cold"]
        warm_r.append(wr); cold_r.append(cr)
        frag_d.append(d["fragmentation"]); frag_c.append(c["fragmentation"])
        met_warm += wr <= 1.0; met_cold += cr <= 1.5; met_frag += d["fragmentation"] <= c["fragmentation"]
    print("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
        trace.replace(".csv.gz", ""), f(c, "fragmentation", "ns_per_event_cold", "ns_per_event"),
        f(e, "fragmentation", "ns_per_event"), f(d, "fragmentation", "ns_per_event_cold", "ns_per_event"),
        "%.2fx" % wr if wr else "-", "%.2fx" % cr if cr else "-",
        d.get("last_pass_memory_calls", "-") if d else "-", f(t, "fragmentation", "ns_per_event")))
print()
print("%d traces with c10 and the defaults: warm <= c10 on %d, cold <= 1.5x c10 on %d, "
      "fragmentation <= c10 on %d; geomeans: warm %.2fx, cold %.2fx c10's; fragmentation "
      "default %.4f, c10 %.4f" % (n, met_warm, met_cold, met_frag, geo(warm_r), geo(cold_r),
                                  geo(frag_d), geo(frag_c)))
for k in ("expandable", "tight", "caching_pool"):
    xs = [s[sides[k]]["fragmentation"] for s in by.values() if sides[k] in s and not s[sides[k]].get("oom")]
    if xs:
        print("%s: fragmentation geomean %.4f over %d traces" % (k, geo(xs), len(xs)))
PY
  "$BUILD/tools/gpumem" replay --tradeoff-points "$OUT/points.json" --tradeoff-plot "$OUT/tradeoff.svg" \
    >"$OUT/tradeoff.log" 2>&1 || { echo "tradeoff plot failed:"; tail -3 "$OUT/tradeoff.log"; }
}

steps_summary() {
  python3 - "$OUT/steps" <<'PY' | tee "$OUT/steps.md"
import glob, json, os, re, statistics, sys
runs = {}
for path in glob.glob(os.path.join(sys.argv[1], "*_*_*.log")):
    m = re.match(r"(.+)_(native|gpumem)_(\d+)\.log$", os.path.basename(path))
    lines = [l for l in open(path, errors="replace") if l.startswith("{")]
    if m and lines:
        runs.setdefault((m.group(1), m.group(2)), []).append(json.loads(lines[-1]))
print("| workload | native s: median (min-max) | gpumem s: median (min-max) | gpumem / native "
      "| reserved / requested: native, gpumem | rounds |")
print("| --- | --- | --- | ---: | --- | ---: |")
ratios = []
for w in sorted({w for w, _ in runs}):
    n, g = runs.get((w, "native"), []), runs.get((w, "gpumem"), [])
    def cell(xs):
        s = [x["seconds"] for x in xs]
        return "%.3f (%.3f-%.3f)" % (statistics.median(s), min(s), max(s)) if s else "-"
    def rr(xs):
        return "%.4f" % max(x["reserved_over_requested"] for x in xs) if xs else "-"
    r = (statistics.median(x["seconds"] for x in g) / statistics.median(x["seconds"] for x in n)
         if n and g else None)
    if r:
        ratios.append(r)
    print("| %s | %s | %s | %s | %s, %s | %d, %d |" % (w, cell(n), cell(g), "%.3fx" % r if r else "-",
                                                    rr(n), rr(g), len(n), len(g)))
if ratios:
    print("\n%d workloads: gpumem / native median %.3fx, worst %.3fx; within 1.02x on %d"
          % (len(ratios), statistics.median(ratios), max(ratios), sum(r <= 1.02 for r in ratios)))
PY
}

# --- the parts -----------------------------------------------------------------------------

build() {
  [ -x "$BUILD/tools/gpumem" ] && [ -f "$GPUMEM_LIB" ] && [ -x "$BUILD/bench/torch_replay_bench" ] && return 0
  { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=OFF \
      -DGPUMEM_BUILD_BENCH=ON &&
    timeout "$T_BUILD" cmake --build "$BUILD" -j 16 --target gpumem_cli gpumem_torch; } \
    >"$OUT/build.log" 2>&1 || { echo "build failed:"; tail -30 "$OUT/build.log"; return 1; }
  timeout "$T_BUILD" cmake --build "$BUILD" -j 16 --target torch_replay_bench >>"$OUT/build.log" 2>&1 ||
    echo "torch_replay_bench not built (no libtorch at configure time?): $(grep -m1 torch_replay_bench "$OUT/build.log")"
}

{ date -u; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi";
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -1
  git rev-parse --short HEAD 2>/dev/null || true; } >"$OUT/info.txt"
cat "$OUT/info.txt"
build || exit 1
status=0
parts=("$@")
[ ${#parts[@]} = 0 ] && parts=(replay steps maxbatch)
for part in "${parts[@]}"; do
  t0=$(date +%s)
  case "$part" in
    replay)
      rm -f "$OUT/points.json"
      timeout -k 10 "$T_REPLAY" "$SELF" __replay_loop >"$OUT/torch_replay.txt" 2>&1 ||
        { echo "replay: exit $? (124: timed out)"; status=1; }
      grep -E "exit|traces$" "$OUT/torch_replay.txt" | head -5
      replay_summary | tail -5
      ;;
    steps)
      timeout -k 10 "$T_STEPS" "$SELF" __steps_loop >"$OUT/steps.txt" 2>&1 ||
        { echo "steps: exit $? (124: timed out)"; status=1; }
      head -5 "$OUT/steps.txt"
      steps_summary
      ;;
    maxbatch)
      timeout -k 30 "$T_MAXBATCH" python3 scripts/max_batch.py --cap-gib "$CAP_GIB" \
        --out "$OUT/max_batch" --jobs "$JOBS" --steps 8 --timed-cycles 3 --trial-timeout 240 \
        >"$OUT/max_batch.log" 2>&1 || { echo "maxbatch: exit $? (124: timed out)"; status=1; }
      cat "$OUT/max_batch/max_batch.md" 2>/dev/null || tail -20 "$OUT/max_batch.log"
      ;;
    *) echo "unknown part '$part' (replay, steps, maxbatch)"; status=2 ;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s"
done
# The device tool brings back a limited number of files: the logs also travel as one.
(cd "$OUT" && tar -czf logs.tar.gz --exclude=logs.tar.gz --exclude='*.svg' -- * 2>/dev/null)
exit $status
