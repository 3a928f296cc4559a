#!/usr/bin/env bash
# The warm pass on sim: every trace in data/ and data/workloads/ replayed twice on
# vmm_page_pool, three ways. Checks that `gpumem replay --json` reports the last pass's
# memory-moving driver calls (last_pass_memory_calls, the sum of the create, map, unmap,
# set-access and release calls in last_pass_driver_calls) and its allocations, and holds
# the pool to the figures in docs/PAGE_POOL.md ("The warm pass"):
#  - the defaults (footprint:fast, a cache within the budget): the last passes' calls in
#    all, the traces within 1% of their allocations, and the fragmentation, each no worse
#    than today's figures;
#  - footprint:tight (gathers on every growth): its fragmentation and calls as before;
#  - the defaults under a cap, limit at 1.03x each trace's peak live bytes: every trace
#    completes, reserved never past the cap, fragmentation and calls held likewise.
# The sim replay is deterministic: the ceilings are today's figures, so any rise fails. The
# goal is at most 1% of a pass's allocations on every trace at fragmentation no worse than
# caching_pool's; the ceilings are lowered as the pool gets there.
set -euo pipefail
src=$1 gpumem=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
traces=("$src"/data/*.csv.gz "$src"/data/workloads/*.csv.gz)

"$gpumem" replay "${traces[@]}" --device sim --allocator vmm_page_pool --passes 2 --json \
  > "$tmp/fast.json"
"$gpumem" replay "${traces[@]}" --device sim --allocator vmm_page_pool --passes 2 --json \
  --config footprint:tight > "$tmp/tight.json"
# Each trace under a cap of 1.03x its own peak live bytes (read from the run above).
python3 - "$tmp/fast.json" > "$tmp/caps.txt" <<'PY'
import json, sys
for t in json.load(open(sys.argv[1]))["traces"]:
    print(t["trace"], int(t["results"][0]["peak_live_bytes"] * 1.03))
PY
{
  echo '{"traces": ['
  sep=""
  while read -r trace cap; do
    printf '%s' "$sep"
    "$gpumem" replay "$trace" --device sim --allocator vmm_page_pool --passes 2 --json \
      --config "limit:$cap"
    sep=","
  done < "$tmp/caps.txt"
  echo ']}'
} > "$tmp/capped.json"

python3 - "$tmp" <<'PY'
import json, math, sys
tmp = sys.argv[1]
moving = ("cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
          "cudaMalloc", "cudaFree", "cuMemAlloc", "cuMemFree")
# name: (total last-pass calls, traces within 1%, fragmentation geomean, worst)
ceilings = {
    "fast": dict(calls=51, within=45, geomean=1.0864, worst=1.3441),
    "tight": dict(calls=47865, within=2, geomean=1.0077, worst=1.0397),
    "capped": dict(calls=31050, within=6, geomean=1.0065, worst=1.0195),
}
for name, c in ceilings.items():
    doc = json.load(open(f"{tmp}/{name}.json"))
    total, within, logs, worst = 0, 0, [], 0.0
    for t in doc["traces"]:
        assert "error" not in t, (name, t)
        (r,) = t["results"]
        assert not r["oom"], (name, t["trace"], "out of memory")
        calls = sum(n for k, n in r["last_pass_driver_calls"].items() if k in moving)
        assert r["last_pass_memory_calls"] == calls, (name, t["trace"], r["last_pass_memory_calls"], calls)
        assert 2 * r["last_pass_allocs"] == r["allocs"], (name, t["trace"])
        assert r["modelled_ns_per_event"] >= r["ns_per_event"], (name, t["trace"])
        if name == "capped":  # never past the cap
            assert r["peak_reserved_bytes"] <= int(r["peak_live_bytes"] * 1.03), (t["trace"], r)
        total += calls
        within += calls <= 0.01 * r["last_pass_allocs"]
        logs.append(math.log(r["fragmentation"]))
        worst = max(worst, r["fragmentation"])
    geomean = math.exp(sum(logs) / len(logs))
    print(f"{name}: {len(logs)} traces, fragmentation geomean {geomean:.4f}, worst {worst:.4f}; "
          f"last-pass memory-moving calls {total}, {within} traces within 1% of their allocations")
    assert geomean <= c["geomean"], (name, "fragmentation regressed", geomean, c)
    assert worst <= c["worst"], (name, "fragmentation regressed", worst, c)
    assert total <= c["calls"], (name, "more warm-pass driver calls", total, c)
    assert within >= c["within"], (name, "fewer traces within 1%", within, c)
PY
echo "replay warm calls: ok"
