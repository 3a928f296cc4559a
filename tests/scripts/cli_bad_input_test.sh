#!/usr/bin/env bash
# `gpumem replay` and `gpumem serve-sim` on bad or unusual input, on sim: each refusal names
# the flag or the file and exits 2 (command line) or 1 (input); a file that is no trace is
# refused after a bounded read; a request beyond the device is each allocator's
# out-of-memory; with --json stdout is one valid JSON text even when a trace fails; output
# paths are checked before any replay; GPUMEM_DEVICE is honoured; a trace's anomalies are
# reported; the help cites only files that exist.
set -euo pipefail
src=$1 gpumem=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
# Runs the command; its status in $rc, its output in $tmp/out and $tmp/err.
run() { set +e; "$@" > "$tmp/out" 2> "$tmp/err"; rc=$?; set -e; }
expect_rc() { [ "$rc" = "$1" ] || { cat "$tmp/err"; fail "$2: exit $rc, expected $1"; }; }
expect_err() { grep -qF -- "$1" "$tmp/err" || { cat "$tmp/err"; fail "stderr lacks '$1'"; }; }
json_ok() { python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$1" || fail "not JSON: $1"; }

good="$tmp/good.csv"
printf 'action,addr,size,stream,time_us\nalloc,4096,1048576,0,1\nfree_completed,4096,1048576,0,2\n' > "$good"

# A file that is no trace: refused after a bounded read (the read was unbounded: memory grew
# until the process was killed), naming the file.
run bash -c "ulimit -v 4000000; timeout 60 '$gpumem' replay /dev/zero --device sim"
expect_rc 1 "replay /dev/zero"
expect_err "/dev/zero is not a trace"

# A request larger than --capacity: every allocator's out-of-memory on that trace, named;
# the other traces are replayed.
big="$tmp/big.csv"
printf 'action,addr,size,stream,time_us\nalloc,4096,104857600,0,1\nfree_completed,4096,104857600,0,2\n' > "$big"
run "$gpumem" replay "$big" "$good" --device sim --capacity 64M --json
expect_rc 0 "a request beyond the device"
cp "$tmp/out" "$tmp/big.json"
python3 - "$tmp/big.json" "$big" <<'PY'
import json, sys
doc, big = json.load(open(sys.argv[1])), sys.argv[2]
first, second = doc["traces"]
assert first["trace"] == big
names = [r["allocator"] for r in first["results"]]
assert names == ["runtime", "driver", "vmm", "caching_pool", "vmm_page_pool"], names
for r in first["results"]:
    assert r["oom"] and r["oom_event"] == 0, r
    assert big in r["oom_report"] and " on " + r["allocator"] + ":" in r["oom_report"], r["oom_report"]
assert not any(r["oom"] for r in second["results"]), second
assert all(s["oom_traces"] == 1 and s["traces"] == 2 for s in doc["summary"]), doc["summary"]
assert doc["failed_traces"] == 0
PY
run "$gpumem" replay "$big" --device sim --capacity 64M --allocator caching_pool
expect_rc 0 "a request beyond the device, text"
grep -qF "caching_pool: OUT OF MEMORY replaying $big at event 0" "$tmp/out" || fail "no OOM line naming the trace"

# A later trace that fails: still one valid JSON text, the failure as that trace's error,
# exit 1; alone, too.
printf 'action,addr,size,stream,time_us\nalloc,4096,512,0,1\nrealloc,4096,512,0,2\n' > "$tmp/bad.csv"
run "$gpumem" replay "$good" "$tmp/bad.csv" "$tmp/missing.csv" --device sim --allocator runtime --json
expect_rc 1 "a failing later trace"
cp "$tmp/out" "$tmp/later.json"
json_ok "$tmp/later.json"
python3 - "$tmp/later.json" "$tmp" <<'PY'
import json, sys
doc, tmp = json.load(open(sys.argv[1])), sys.argv[2]
ok, bad, missing = doc["traces"]
assert ok["results"][0]["allocator"] == "runtime" and "error" not in ok
assert bad["trace"] == tmp + "/bad.csv" and tmp + "/bad.csv:3" in bad["error"], bad
assert missing["trace"] == tmp + "/missing.csv" and "cannot open" in missing["error"], missing
assert doc["failed_traces"] == 2 and doc["summary"][0]["traces"] == 1, doc
PY
run "$gpumem" replay "$tmp/missing.csv" --device sim --json
expect_rc 1 "one failing trace"
json_ok "$tmp/out"
python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); assert "cannot open" in d["error"], d' "$tmp/out"

# --capacity and --budget: the flag named, exit 2; below a page refused.
for bad in abc 12Q -1G 1e30T; do
  run "$gpumem" replay "$good" --device sim --capacity "$bad"
  expect_rc 2 "--capacity $bad"
  expect_err "invalid value '$bad' for --capacity"
done
run "$gpumem" replay "$good" --device sim --capacity 1K
expect_rc 2 "--capacity 1K"
expect_err "for --capacity: must be at least 2.00 MiB (one page of the sim device)"
run "$gpumem" replay "$good" --device sim --capacity 3M --allocator runtime
expect_rc 0 "--capacity 3M"
expect_err "is not a whole number of 2.00 MiB pages: the sim device has 4.00 MiB"
run "$gpumem" replay "$good" --device sim --large-plan 0
expect_rc 2 "--large-plan 0"
expect_err "for --large-plan"
run "$gpumem" replay "$good" --device sim --large-plan 1M --allocator vmm_page_pool
expect_rc 0 "--large-plan 1M"
run "$gpumem" serve-sim --budget 8Q
expect_rc 2 "--budget 8Q"
expect_err "invalid value '8Q' for --budget"

# Output paths are checked before any replay runs.
for opt in plot:svg tradeoff-plot:svg snapshot:pickle; do
  out="$tmp/no/such/dir/out.${opt#*:}" opt=${opt%%:*}
  run "$gpumem" replay "$good" --device sim --allocator vmm_page_pool --"$opt" "$out"
  expect_rc 1 "--$opt into a missing directory"
  expect_err "--$opt: cannot write '$out'"
  if grep -q "replaying" "$tmp/err"; then fail "--$opt checked only after a replay"; fi
done
# A plot in a format gpumem cannot draw is refused before any replay, saying so.
run "$gpumem" replay "$good" --device sim --allocator vmm_page_pool --plot "$tmp/p.png"
expect_rc 1 "--plot p.png"
expect_err "asks for png output, which gpumem cannot draw"
[ ! -e "$tmp/p.png" ] || fail "an SVG was written under a .png name"
run "$gpumem" replay "$good" --device sim --allocator vmm_page_pool --plot "$tmp/p.svg"
expect_rc 0 "--plot into a writable place"
grep -q "<svg" "$tmp/p.svg" || fail "no plot written"

# The trade-off plot: its format, its points file (malformed, missing, of another shape),
# the points alone without a plot to draw them, and no trace at all.
run "$gpumem" replay "$good" --device sim --allocator vmm_page_pool --tradeoff-plot "$tmp/t.png"
expect_rc 1 "--tradeoff-plot t.png"
expect_err "asks for png output, which gpumem cannot draw"
printf '[{"trace": "a", "allocator": "x", "fragmentation": 1.1,' > "$tmp/cut.json"
run "$gpumem" replay --tradeoff-points "$tmp/cut.json" --tradeoff-plot "$tmp/t.svg"
expect_rc 1 "--tradeoff-points with cut JSON"
expect_err "cut.json: not valid JSON at byte"
[ ! -e "$tmp/t.svg" ] || fail "a plot was drawn from a bad points file"
run "$gpumem" replay --tradeoff-points "$tmp/none.json" --tradeoff-plot "$tmp/t.svg"
expect_rc 1 "--tradeoff-points missing"
expect_err "cannot read '$tmp/none.json'"
printf '{"summary": []}' > "$tmp/shape.json"
run "$gpumem" replay --tradeoff-points "$tmp/shape.json" --tradeoff-plot "$tmp/t.svg"
expect_rc 1 "--tradeoff-points of another shape"
expect_err "expected gpumem replay --json output"
run "$gpumem" replay --tradeoff-points "$tmp/shape.json"
expect_rc 2 "--tradeoff-points without --tradeoff-plot"
expect_err "give both"
run "$gpumem" replay
expect_rc 2 "replay without a trace"
expect_err "give a trace"
"$gpumem" replay "$good" --device sim --allocator all --passes 2 --json > "$tmp/r.json"
printf '[{"trace": "g", "allocator": "pytorch c10", "fragmentation": 1.5, "ns_per_event": 579}]' > "$tmp/gpu.json"
run "$gpumem" replay --tradeoff-points "$tmp/r.json" --tradeoff-plot "$tmp/t.svg"
expect_rc 0 "--tradeoff-points from replay JSON"
[ "$(grep -c '<title>' "$tmp/t.svg")" = 5 ] || fail "expected a point per allocator"
run "$gpumem" replay "$good" --device sim --allocator caching_pool --tradeoff-points "$tmp/gpu.json" \
  --tradeoff-plot "$tmp/t.svg"
expect_rc 0 "--tradeoff-plot of a replay and a points file"
[ "$(grep -c '<title>' "$tmp/t.svg")" = 2 ] || fail "expected the replay's point and the file's"

# GPUMEM_DEVICE as gpumem info reads it; --device wins.
run env GPUMEM_DEVICE=bogus "$gpumem" replay "$good"
expect_rc 1 "GPUMEM_DEVICE=bogus"
expect_err "GPUMEM_DEVICE: unknown platform 'bogus'"
if "$gpumem" info --device cuda > /dev/null 2>&1; then
  run env GPUMEM_DEVICE=cuda "$gpumem" replay "$good" --allocator runtime --passes 1
  expect_rc 0 "GPUMEM_DEVICE=cuda on a GPU"
  grep -q "^device: cuda" "$tmp/out" || fail "GPUMEM_DEVICE=cuda did not replay on the GPU"
else
  run env GPUMEM_DEVICE=cuda "$gpumem" replay "$good"
  expect_rc 1 "GPUMEM_DEVICE=cuda without a GPU"
  expect_err "GPUMEM_DEVICE=cuda"
fi
run env GPUMEM_DEVICE=cuda "$gpumem" replay "$good" --device sim --allocator runtime --passes 1
expect_rc 0 "--device sim over GPUMEM_DEVICE=cuda"
grep -q "^device: sim" "$tmp/out" || fail "--device sim did not win over GPUMEM_DEVICE"

# Several simulated GPUs (GPUMEM_SIM_DEVICES): gpumem info lists each and the peer-access
# matrix; a bad count is refused naming the variable.
run env GPUMEM_SIM_DEVICES=3 "$gpumem" info --device sim --json
expect_rc 0 "info with three sim devices"
python3 - "$tmp/out" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["device_count"] == 3 and len(doc["devices"]) == 3, doc["device_count"]
assert doc["peer_access"] == [[True] * 3] * 3, doc["peer_access"]
PY
run env GPUMEM_SIM_DEVICES=2 "$gpumem" info --device sim
expect_rc 0 "info with two sim devices"
grep -q "^peer access" "$tmp/out" || fail "no peer-access matrix in the text"
grep -q "^device 1:" "$tmp/out" || fail "device 1 not listed"
run env GPUMEM_SIM_DEVICES=0 "$gpumem" info --device sim
expect_rc 1 "GPUMEM_SIM_DEVICES=0"
expect_err "GPUMEM_SIM_DEVICES"

# A UTF-8 byte-order mark before the header.
printf '\xef\xbb\xbf' | cat - "$good" > "$tmp/bom.csv"
run "$gpumem" replay "$tmp/bom.csv" --device sim --allocator runtime --passes 1
expect_rc 0 "a byte-order mark"

# A trace's anomalies, counted and reported in the text and the JSON.
printf '%s\n' action,addr,size,stream,time_us alloc,4096,512,0,1 free_completed,4096,512,0,2 \
  free_completed,4096,512,0,3 free_completed,777,64,0,4 alloc,8192,512,0,5 alloc,8192,1024,0,6 \
  free_completed,8192,2048,0,7 > "$tmp/anomalies.csv"
run "$gpumem" replay "$tmp/anomalies.csv" --device sim --allocator runtime --passes 1
expect_rc 0 "anomalies, text"
grep -qF "anomalies: 1 free of an address never allocated (dropped); 1 double free (dropped); 1 allocation at an address still live" "$tmp/out" \
  || { cat "$tmp/out"; fail "anomalies not reported"; }
run "$gpumem" replay "$tmp/anomalies.csv" --device sim --allocator runtime --passes 1 --json
python3 - "$tmp/out" <<'PY'
import json, sys
a = json.load(open(sys.argv[1]))["anomalies"]
assert a == {"unmatched_frees": 1, "double_frees": 1, "reused_addresses": 1, "mismatched_free_sizes": 1}, a
PY
run "$gpumem" replay "$good" --device sim --allocator runtime --passes 1
if grep -q "^anomalies" "$tmp/out"; then fail "a clean trace reported anomalies"; fi

# serve-sim --rate: any finite positive rate (a burst); beyond a double, the limit named.
run "$gpumem" serve-sim --rate 1e308 --requests 40 --strategy paged --budget 2G --json
expect_rc 0 "--rate 1e308"
python3 -c 'import json, sys; (r,) = json.load(open(sys.argv[1])); assert r["completed"] == 40, r' "$tmp/out"
run "$gpumem" serve-sim --rate 1e309
expect_rc 2 "--rate 1e309"
expect_err "invalid value '1e309' for --rate: must be at most 1.79769e+308"
run "$gpumem" serve-sim --rate 0
expect_rc 2 "--rate 0"
expect_err "invalid value '0' for --rate: must be above 0"

# The help cites only files that exist.
for command in replay serve-sim info; do
  "$gpumem" "$command" --help > "$tmp/help"
  for file in $(grep -oE '[A-Za-z0-9_./-]+\.(md|cpp|hpp|py|sh)\b' "$tmp/help" | sort -u); do
    [ -e "$src/$file" ] || [ -e "$src/docs/$file" ] || fail "gpumem $command --help cites $file, which does not exist"
  done
done

# With --json, a refusal before any replay is one JSON text on stdout too (it was empty).
run "$gpumem" replay "$good" --device sim --config no_such_key:1 --json
expect_rc 1 "an unknown --config key with --json"
expect_err "no_such_key"
python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); assert "no_such_key" in d["error"] and d["usage_error"] is False, d' "$tmp/out" || fail "refusal not in the JSON"
run "$gpumem" replay "$good" --no-such-flag --json
expect_rc 2 "an unknown flag with --json"
python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); assert d["usage_error"] is True, d' "$tmp/out" || fail "usage refusal not in the JSON"
# Two planners in front of one pool: refused as a usage error naming both.
run "$gpumem" replay "$good" --device sim --step-plan --large-plan 32M
expect_rc 2 "--step-plan with --large-plan"
expect_err "--step-plan and --large-plan"
# --large-plan reports its counts.
run "$gpumem" replay "$good" --device sim --allocator vmm_page_pool --large-plan 1M --passes 1 --json
expect_rc 0 "--large-plan --json"
python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))["results"][0]; assert r["large_requests"] == 1 and "large_plan_misses" in r, r' "$tmp/out" || fail "--large-plan counts not in the JSON"

# Hostile snapshot pickles and workloads, through the command: a million nested tuples (the
# process crashed freeing them), a 9-byte pickle storing at memo index 2^26-1 (1 GiB was
# allocated for it), a FIFO fed without end, a NUL inside a workload token (cut silently),
# a byte-order mark before a workload (refused, where replay skipped it).
python3 -c 'import sys; sys.stdout.buffer.write(b"\x80\x02)" + b"\x85" * 1000000 + b".")' > "$tmp/nested.pickle"
run "$gpumem" replay "$tmp/nested.pickle" --device sim
expect_rc 1 "replay of a deeply nested pickle"
expect_err "values nested more than 100 deep"
printf '\x80\x02Nr\xff\xff\xff\x03.' > "$tmp/memo.pickle"
run bash -c "ulimit -v 400000; '$gpumem' replay '$tmp/memo.pickle' --device sim"
expect_rc 1 "replay of a pickle with a huge memo index"
expect_err "not a PyTorch memory snapshot"
printf '0 8 1 5\n0 8 1 12\00099\n' > "$tmp/nul.workload"
run "$gpumem" serve-sim --workload "$tmp/nul.workload" --device sim
expect_rc 1 "serve-sim of a workload with a NUL"
expect_err "nul.workload:2: binary data, not text (byte 0x00 at column 9: a NUL)"
printf '\xef\xbb\xbf0 8 1 5 6\r\n1 8 1 5 6\r\n' > "$tmp/bom.workload"
run "$gpumem" serve-sim --workload "$tmp/bom.workload" --device sim
expect_rc 0 "serve-sim of a workload with a byte-order mark and CRLF"
printf '0 8 1 5\n1e300 8 1 5\n' > "$tmp/far.workload"
run "$gpumem" serve-sim --workload "$tmp/far.workload" --device sim
expect_rc 1 "serve-sim of an absurd arrival"
expect_err "far.workload:2: arrival '1e300' is not a number of seconds in 0..86400"

# kv-tier-bench runs redis-benchmark for its comparison without a shell: a host carrying
# shell syntax reaches no shell (it ran one: `;touch ...;` in the host created the file).
if "$gpumem" kv-tier-bench --help >/dev/null 2>&1; then
  (cd "$tmp" && run "$gpumem" kv-tier-bench --kv-store 'redis://no-such-host.invalid;touch${IFS}injected;:6' \
     --blocks 2 --batch 1)
  [ ! -e "$tmp/injected" ] || fail "kv-tier-bench ran the URL's host through a shell"
fi
echo "cli bad input: ok"

