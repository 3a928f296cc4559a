#!/usr/bin/env bash
# A snapshot pickle shaped like torch.cuda.memory._snapshot() goes through
# scripts/snapshot_to_csv.py and is replayed by `gpumem replay` on sim with the
# expected counts and peak; a malformed pickle is refused with a message.
set -euo pipefail
src=$1 gpumem=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 - "$tmp/snap.pickle" <<'PY'
import pickle, sys
MiB = 1 << 20
ev = lambda a, addr, size: {"action": a, "addr": addr, "size": size, "stream": 0,
                            "time_us": 1, "frames": [{"filename": "x.py", "line": 1, "name": "f"}]}
trace = [ev("segment_alloc", 1000, 20 * MiB), ev("alloc", 1000, 4 * MiB), ev("alloc", 9000000, 2 * MiB),
         ev("free_requested", 1000, 4 * MiB), ev("free_completed", 1000, 4 * MiB), ev("alloc", 1000, 1 * MiB)]
pickle.dump({"segments": [], "device_traces": [trace]}, open(sys.argv[1], "wb"), protocol=2)
PY
python3 "$src/scripts/snapshot_to_csv.py" "$tmp/snap.pickle" "$tmp/t.csv.gz"
"$gpumem" replay "$tmp/t.csv.gz" --device sim --allocator vmm_page_pool --passes 1 --json > "$tmp/r.json"
python3 - "$tmp/r.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
assert r["allocs"] == 3 and r["frees"] == 1, r
assert r["peak_live_bytes"] == 6 << 20, r
assert r["peak_reserved_bytes"] >= r["peak_live_bytes"] and not r["oom"], r
PY
echo "not a pickle" > "$tmp/bad.pickle"
if python3 "$src/scripts/snapshot_to_csv.py" "$tmp/bad.pickle" "$tmp/x.csv" 2>"$tmp/err"; then
  echo "malformed pickle was accepted"; exit 1
fi
grep -q "snapshot_to_csv" "$tmp/err"
echo "snapshot converter: ok"
