#!/usr/bin/env bash
# gpumem replay reads a PyTorch memory snapshot pickle directly (protocols 2, 4 and 5, as
# torch.cuda.memory._dump_snapshot writes with Python's pickle): its busiest device trace's
# allocs and frees are replayed; a snapshot recorded without history is refused saying so.
#   replay_torch_snapshot_test.sh GPUMEM_CLI
set -euo pipefail
cli=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$work" <<'PY'
import pickle, sys
MiB = 1 << 20
def ev(action, addr, size, t, **kw):
    return dict(action=action, addr=addr, size=size, stream=0, time_us=t, frames=[], **kw)
base = 0x7f0000000000
trace = [ev("segment_alloc", base, 20 * MiB, 1),
         ev("alloc", base, MiB, 2, compile_context="N/A", user_metadata=""),
         ev("alloc", base + MiB, 2 * MiB, 3),
         ev("free_requested", base, MiB, 4), ev("free_completed", base, MiB, 5),
         dict(action="oom", device_free=12345, size=3 * MiB, stream=0, time_us=6, frames=[])]
snap = {"segments": [], "device_traces": [[], trace], "allocator_settings": {"r": 0.5, "n": None}}
for p in (2, 4, 5):
    with open("%s/snap%d.pickle" % (sys.argv[1], p), "wb") as f:
        pickle.dump(snap, f, protocol=p)
with open("%s/no_history.pickle" % sys.argv[1], "wb") as f:
    pickle.dump({"segments": [], "device_traces": [[]]}, f)
PY
for p in 2 4 5; do
  out=$("$cli" replay "$work/snap$p.pickle" --device sim --allocator vmm_page_pool 2>&1)
  echo "$out" | grep -q "3 events (2 allocs, 1 frees), peak live 3.00 MiB" ||
    { echo "FAIL: protocol $p:"; echo "$out"; exit 1; }
done
if "$cli" replay "$work/no_history.pickle" --device sim >"$work/out" 2>&1; then
  echo "FAIL: a snapshot without a trace was replayed"; cat "$work/out"; exit 1
fi
grep -q "every device trace is empty" "$work/out" || { cat "$work/out"; exit 1; }
echo "replay of torch snapshots: ok"
