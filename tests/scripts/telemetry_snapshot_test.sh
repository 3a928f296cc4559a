#!/usr/bin/env bash
# `gpumem replay --snapshot` on sim writes PyTorch memory snapshots of both pools that
# Python's pickle loads and check_snapshot_structure.py accepts (keys, block sizes summing
# to segments, valid trace actions, the trace consistent with the segments, only opcodes
# PyTorch's viewer reads); a corrupted snapshot is refused; a non-pool allocator is refused.
set -euo pipefail
src=$1 gpumem=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
check="$src/tests/scripts/check_snapshot_structure.py"
trace="$src/data/train_llama.csv.gz"

"$gpumem" replay "$trace" --device sim --allocator vmm_page_pool --passes 1 \
  --snapshot "$tmp/vmm.pickle" > /dev/null 2> "$tmp/vmm.err"
grep -q "snapshot of vmm_page_pool written to" "$tmp/vmm.err"
python3 "$check" "$tmp/vmm.pickle" --expandable yes --min-trace 1000

"$gpumem" replay "$trace" --device sim --allocator caching_pool --passes 1 \
  --snapshot "$tmp/cp.pickle" --snapshot-events 500 > /dev/null 2> "$tmp/cp.err"
python3 "$check" "$tmp/cp.pickle" --expandable no --min-trace 500

# The snapshot is at peak reserved: its segments hold what the replay reported as peak.
"$gpumem" replay "$trace" --device sim --allocator vmm_page_pool --passes 1 --json > "$tmp/r.json"
python3 - "$tmp/vmm.pickle" "$tmp/r.json" "$tmp/cp.pickle" <<'PY'
import json, pickle, sys
snap = pickle.load(open(sys.argv[1], "rb"))
peak = json.load(open(sys.argv[2]))["results"][0]["peak_reserved_bytes"]
assert snap["gpumem"]["stats"]["reserved_bytes.all.current"] == peak, (snap["gpumem"]["stats"], peak)
cp = pickle.load(open(sys.argv[3], "rb"))
trace = cp["device_traces"][0]
assert len(trace) <= 2 * 500 + 1, len(trace)          # a free is two entries, plus 'snapshot'
assert cp["gpumem"]["trace_events_dropped"] > 0, cp["gpumem"]
assert trace[-1]["action"] == "snapshot"
PY

# Out of memory: the snapshot is taken there and its trace ends with the OOM.
"$gpumem" replay "$trace" --device sim --allocator vmm_page_pool --passes 1 --capacity 8G \
  --snapshot "$tmp/oom.pickle" > /dev/null 2> "$tmp/oom.err"
grep -q "out of memory" "$tmp/oom.err"
python3 "$check" "$tmp/oom.pickle" --expandable yes
python3 - "$tmp/oom.pickle" <<'PY'
import pickle, sys
t = pickle.load(open(sys.argv[1], "rb"))["device_traces"][0]
assert [e["action"] for e in t[-2:]] == ["oom", "snapshot"], t[-2:]
assert t[-2]["device_free"] >= 0 and t[-2]["size"] > 0
PY

# A block removed from a segment breaks the tiling: the checker must say so.
python3 - "$tmp/vmm.pickle" "$tmp/bad.pickle" <<'PY'
import pickle, sys
s = pickle.load(open(sys.argv[1], "rb"))
seg = next(x for x in s["segments"] if len(x["blocks"]) > 1)
seg["blocks"].pop()
pickle.dump(s, open(sys.argv[2], "wb"), protocol=2)
PY
if python3 "$check" "$tmp/bad.pickle" 2> "$tmp/bad.err"; then
  echo "a snapshot whose blocks do not tile a segment was accepted"; exit 1
fi
grep -q "INVALID" "$tmp/bad.err"

if "$gpumem" replay "$trace" --device sim --allocator runtime --snapshot "$tmp/x.pickle" \
     > /dev/null 2> "$tmp/rt.err"; then
  echo "--snapshot of a non-pool allocator was accepted"; exit 1
fi
grep -q "needs a pool" "$tmp/rt.err"
echo "telemetry snapshot: ok"
