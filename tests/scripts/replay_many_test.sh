#!/usr/bin/env bash
# `gpumem replay` over several traces on sim: each trace's results, as replaying it alone
# gives them, then a summary per allocator whose figures follow from them (the geometric
# mean and the worst of the fragmentation, the driver time summed, the traces run out of
# memory counted); one-trace options (--plot, --snapshot, --explain) are refused.
set -euo pipefail
src=$1 gpumem=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
a="$src/data/workloads/side_stream_seed1.csv.gz"
b="$src/data/workloads/conv_multiscale_seed1.csv.gz"

"$gpumem" replay "$a" "$b" --device sim --allocator vmm_page_pool --json > "$tmp/many.json"
"$gpumem" replay "$b" --device sim --allocator vmm_page_pool --json > "$tmp/b.json"
# side_stream holds ~4 GiB live: on a 2 GiB device the caching pool runs out of memory on it,
# not on conv_multiscale (1.7 GiB live).
"$gpumem" replay "$a" "$b" --device sim --capacity 2G --allocator caching_pool --json > "$tmp/oom.json"
python3 - "$tmp/many.json" "$tmp/b.json" "$tmp/oom.json" "$a" "$b" <<'PY'
import json, math, sys
many, alone, oom = (json.load(open(p)) for p in sys.argv[1:4])
a, b = sys.argv[4:6]
traces = many["traces"]
assert [t["trace"] for t in traces] == [a, b], [t["trace"] for t in traces]
# The second trace's figures are the ones it gets alone (a fresh device per replay; sim is
# deterministic): nothing carries over from the first.
mine, ref = traces[1]["results"][0], alone["results"][0]
for k in ("peak_live_bytes", "peak_reserved_bytes", "fragmentation", "allocs", "frees", "driver_calls"):
    assert mine[k] == ref[k], (k, mine[k], ref[k])
(s,) = many["summary"]
frags = [t["results"][0]["fragmentation"] for t in traces]
assert s["allocator"] == "vmm_page_pool" and s["traces"] == 2 and s["oom_traces"] == 0, s
assert math.isclose(s["fragmentation_geomean"], math.sqrt(frags[0] * frags[1]), rel_tol=1e-12), (s, frags)
assert s["fragmentation_worst"] == max(frags), (s, frags)
assert s["fragmentation_worst_trace"] == [a, b][frags.index(max(frags))], s
ms = sum(t["results"][0]["modelled_driver_ms"] for t in traces)
assert math.isclose(s["modelled_driver_ms"], ms, rel_tol=1e-9), (s, ms)
(o,) = oom["summary"]
ooms = [t["results"][0]["oom"] for t in oom["traces"]]
assert ooms == [True, False], ooms
assert o["oom_traces"] == 1 and o["traces"] == 2, o
# Fragmentation over the trace that ran whole only.
assert o["fragmentation_geomean"] == o["fragmentation_worst"] == oom["traces"][1]["results"][0]["fragmentation"], o
PY

"$gpumem" replay "$a" "$b" --device sim --allocator all > "$tmp/many.txt" 2> /dev/null
test "$(grep -c '^trace ' "$tmp/many.txt")" = 2
grep -q "^summary over 2 traces (sim, driver ms modelled, 2 pass(es))" "$tmp/many.txt"
for name in runtime driver vmm caching_pool vmm_page_pool; do
  grep -Eq "^$name +2 +0 +1\.[0-9]{4} " "$tmp/many.txt" || { echo "no summary row for $name"; exit 1; }
done

for opt in "--plot $tmp/p.svg" "--snapshot $tmp/s.pickle" "--explain"; do
  # shellcheck disable=SC2086
  if "$gpumem" replay "$a" "$b" --device sim --allocator vmm_page_pool $opt > /dev/null 2> "$tmp/err"; then
    echo "replay of two traces accepted $opt"; exit 1
  fi
  grep -q "takes one trace, not 2" "$tmp/err"
done
echo "replay many: ok"
