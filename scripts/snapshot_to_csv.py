#!/usr/bin/env python3
"""Convert a PyTorch memory snapshot pickle into a gpumem trace CSV.

The snapshot is what `torch.cuda.memory._snapshot()` returns (or `_dump_snapshot()` writes)
after `torch.cuda.memory._record_memory_history()`: a dict whose "device_traces" holds, per
device, a list of events {action, addr, size, stream, time_us, frames...}. The output is the
CSV that `gpumem replay` reads: action,addr,size,stream,time_us.

Usage: snapshot_to_csv.py SNAPSHOT.pickle OUT.csv[.gz] [--device N]
Loading needs only the standard library (the snapshot is plain dicts and lists).
"""
import argparse
import gzip
import pickle
import sys

ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom", "snapshot"}


def convert(snapshot, device):
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if traces is None:
        raise ValueError("not a PyTorch memory snapshot: no 'device_traces' (record history "
                         "with torch.cuda.memory._record_memory_history() first)")
    if device >= len(traces):
        raise ValueError(f"snapshot has {len(traces)} device trace(s); no device {device}")
    rows = []
    for i, event in enumerate(traces[device]):
        action = event.get("action")
        if action not in ACTIONS:
            raise ValueError(f"event {i}: unknown action {action!r}")
        rows.append((action, int(event.get("addr", 0)), int(event.get("size", 0)),
                     int(event.get("stream", 0)), int(event.get("time_us", 0))))
    return rows


def write_csv(rows, path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as out:
        out.write("action,addr,size,stream,time_us\n")
        for row in rows:
            out.write(",".join(str(v) for v in row) + "\n")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot")
    parser.add_argument("out")
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        with open(args.snapshot, "rb") as f:
            snapshot = pickle.load(f)
        rows = convert(snapshot, args.device)
    except (OSError, pickle.UnpicklingError, ValueError, EOFError) as e:
        print(f"snapshot_to_csv: {args.snapshot}: {e}", file=sys.stderr)
        return 1
    write_csv(rows, args.out)
    print(f"{args.out}: {len(rows)} events from device {args.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
