#!/usr/bin/env bash
# `gpumem replay --explain` on sim: for each pool, the parts of its peak's reserved bytes sum
# to them, the peak is the one the replay reports (over one pass, and over three, where the
# caching pool's peak with release_idle comes in a later pass), the largest rounding losses
# are listed and the text names the parts (on a trace whose peak holds rounded blocks); a
# raw backend is refused.
set -euo pipefail
src=$1 gpumem=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
trace="$src/data/train_llama.csv.gz"

"$gpumem" replay "$trace" --device sim --passes 1 --explain --json > "$tmp/r.json"
python3 - "$tmp/r.json" <<'PY'
import json, sys
top = json.load(open(sys.argv[1]))
results = top["results"]
explained = {r["allocator"]: r for r in results if "peak_breakdown" in r}
assert sorted(explained) == ["caching_pool", "vmm_page_pool"], sorted(explained)
for name, r in explained.items():
    b = r["peak_breakdown"]
    parts = sum(b[k] for k in ("requested_bytes", "unit_rounding_bytes", "block_rounding_bytes",
                               "cached_bytes", "free_pinned_bytes", "free_releasable_bytes",
                               "kept_unmapped_bytes", "other_bytes"))
    assert parts == b["reserved_bytes"], (name, parts, b)
    assert b["reserved_bytes"] == r["peak_reserved_bytes"], (name, b["reserved_bytes"], r["peak_reserved_bytes"])
    assert b["at"] == "peak_reserved" and b["pass"] == 1 and 0 < b["after_event"] <= top["events"], b
    assert b["requested_bytes"] <= r["peak_live_bytes"], (name, b)
    losses = [l["lost_bytes"] for l in b["largest_rounding_losses"]]
    assert losses == sorted(losses, reverse=True), losses
    for l in b["largest_rounding_losses"]:
        assert l["lost_bytes"] == l["count"] * (l["block_bytes"] - l["requested_bytes"]), l
PY

# A trace whose peak holds rounded blocks (train_llama's large requests are whole pages, or
# at most half a page past them: not rounded).
rounded="$src/data/workloads/vit_accum.csv.gz"
"$gpumem" replay "$rounded" --device sim --passes 1 --allocator vmm_page_pool --explain --json > "$tmp/v.json"
python3 - "$tmp/v.json" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))["results"][0]["peak_breakdown"]
assert v["block_rounding_bytes"] > 0 and v["largest_rounding_losses"], v
PY

"$gpumem" replay "$rounded" --device sim --passes 1 --allocator vmm_page_pool --explain > "$tmp/r.txt" 2> "$tmp/r.err"
grep -q "where the reserved bytes went, at peak reserved (after event" "$tmp/r.txt"
grep -q "rounding beyond it (whole pages, near fits)" "$tmp/r.txt"
grep -Eq "^ +[0-9]+ x .* in .* blocks" "$tmp/r.txt"
grep -q "free whole pages (trim could unmap them)" "$tmp/r.txt"
if grep -q "caching_pool:" "$tmp/r.txt"; then echo "explained a pool not asked for"; exit 1; fi

# Out of memory: the explanation is of the moment it ran out.
"$gpumem" replay "$trace" --device sim --passes 1 --allocator vmm_page_pool --capacity 8G \
  --explain > "$tmp/oom.txt" 2> /dev/null
grep -q "where the reserved bytes went, at the out-of-memory (at event" "$tmp/oom.txt"

# Three passes: the explained peak is the replay's, in whichever pass it came.
"$gpumem" replay "$trace" --device sim --passes 3 --allocator caching_pool \
  --config release_idle:on --explain --json > "$tmp/p3.json"
python3 - "$tmp/p3.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
b = r["peak_breakdown"]
assert b["reserved_bytes"] == r["peak_reserved_bytes"], (b, r["peak_reserved_bytes"])
assert b["pass"] > 1, b  # release_idle's peak rises in later passes on this trace
PY

# A trace with no events: an empty breakdown, not a crash.
printf 'action,addr,size,stream,time_us\n' > "$tmp/empty.csv"
"$gpumem" replay "$tmp/empty.csv" --device sim --allocator vmm_page_pool --explain \
  --snapshot "$tmp/empty.pickle" > "$tmp/empty.txt" 2> /dev/null
grep -q "after event 0 of 0" "$tmp/empty.txt"
grep -q "0 B reserved for 0 B requested" "$tmp/empty.txt"

if "$gpumem" replay "$trace" --device sim --allocator runtime --explain > /dev/null 2> "$tmp/rt.err"; then
  echo "--explain of a non-pool allocator was accepted"; exit 1
fi
grep -q "needs a pool" "$tmp/rt.err"
echo "replay explain: ok"
