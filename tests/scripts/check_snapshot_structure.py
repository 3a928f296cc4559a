#!/usr/bin/env python3
"""Check a gpumem memory snapshot with Python's standard library only (no torch).

What PyTorch's tools need of a snapshot, checked here:
  - the pickle uses only opcodes that PyTorch's in-browser viewer (MemoryViz.js) decodes;
  - top-level keys: segments, device_traces, allocator_settings;
  - each segment has the keys torch.cuda.memory._snapshot() gives, its blocks lie back to
    back from its address and their sizes sum to total_size (torch's `stats` asserts the
    same), allocated/active/requested sizes agree with the blocks;
  - each trace entry has a known action and its keys (an OOM carries device_free);
  - walking the trace backwards from the segments, as the viewer's "Allocator State
    History" does, never looks up a block or segment that is not there.

Usage: check_snapshot_structure.py FILE.pickle [--expandable yes|no] [--min-trace N]
Prints a one-line summary; exits non-zero with the reason on the first violation.
"""
import argparse
import pickle
import pickletools
import sys

VIEWER_OPCODES = {"PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE",
                  "NONE", "BINGET", "BININT", "BININT1", "BININT2", "EMPTY_DICT",
                  "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET", "MARK", "MEMOIZE",
                  "BINPUT", "SETITEMS", "SHORT_BINUNICODE", "STOP", "TUPLE2", "BINUNICODE",
                  "EMPTY_TUPLE", "BINFLOAT", "TUPLE1", "TUPLE3", "LONG_BINPUT", "DICT",
                  "SETITEM"}
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom", "snapshot"}
SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size",
                "requested_size", "stream", "segment_type", "segment_pool_id",
                "is_expandable", "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
FRAME_KEYS = {"filename", "line", "name"}


class Bad(Exception):
    pass


def need(cond, why):
    if not cond:
        raise Bad(why)


def check_frames(frames, where):
    need(isinstance(frames, list), f"{where}: frames is not a list")
    for f in frames:
        need(isinstance(f, dict) and FRAME_KEYS <= f.keys(), f"{where}: frame {f!r} lacks keys")
        need(isinstance(f["line"], int) and isinstance(f["name"], str), f"{where}: frame types")


def check_segments(snap):
    segs = snap["segments"]
    need(isinstance(segs, list), "segments is not a list")
    blocks_total = 0
    for i, s in enumerate(segs):
        where = f"segment {i}"
        need(SEGMENT_KEYS <= s.keys(), f"{where}: missing {SEGMENT_KEYS - s.keys()}")
        need(s["segment_type"] in ("large", "small"), f"{where}: segment_type {s['segment_type']!r}")
        need(isinstance(s["segment_pool_id"], tuple) and len(s["segment_pool_id"]) == 2,
             f"{where}: segment_pool_id is not a pair")
        need(s["total_size"] > 0, f"{where}: empty")
        check_frames(s["frames"], where)
        addr, alloc, req = s["address"], 0, 0
        need(s["blocks"], f"{where}: no blocks")
        for j, b in enumerate(s["blocks"]):
            bw = f"{where} block {j}"
            need(BLOCK_KEYS <= b.keys(), f"{bw}: missing {BLOCK_KEYS - b.keys()}")
            need(b["address"] == addr, f"{bw}: at {b['address']:#x}, expected {addr:#x}")
            need(b["size"] > 0, f"{bw}: size {b['size']}")
            need(b["state"] in ("active_allocated", "active_pending_free", "inactive"),
                 f"{bw}: state {b['state']!r}")
            check_frames(b["frames"], bw)
            if b["state"] == "active_allocated":
                need(0 < b["requested_size"] <= b["size"], f"{bw}: requested {b['requested_size']}")
                alloc += b["size"]
                req += b["requested_size"]
            addr += b["size"]
            blocks_total += 1
        need(addr - s["address"] == s["total_size"],
             f"{where}: blocks sum to {addr - s['address']}, total_size {s['total_size']}")
        need(s["allocated_size"] == alloc, f"{where}: allocated_size {s['allocated_size']} != {alloc}")
        need(s["active_size"] >= alloc, f"{where}: active_size below allocated")
        need(s["requested_size"] == req, f"{where}: requested_size {s['requested_size']} != {req}")
    ordered = sorted(segs, key=lambda s: s["address"])
    for a, b in zip(ordered, ordered[1:]):
        need(a["address"] + a["total_size"] <= b["address"], "segments overlap")
    return blocks_total


def check_trace(snap):
    traces = snap["device_traces"]
    need(isinstance(traces, list), "device_traces is not a list")
    n = 0
    for d, trace in enumerate(traces):
        for i, e in enumerate(trace):
            where = f"device {d} trace entry {i}"
            need(e.get("action") in ACTIONS, f"{where}: action {e.get('action')!r}")
            addr_key = "device_free" if e["action"] == "oom" else "addr"
            for k in (addr_key, "size", "stream", "time_us"):
                need(isinstance(e.get(k), int), f"{where}: {k} missing or not an int")
            check_frames(e.get("frames", []), where)
            n += 1
    return n


def reverse_walk(snap, device):
    """The viewer's simulate_memory from the last event back to the first."""
    segs = sorted(({"addr": s["address"], "size": s["total_size"], "stream": s["stream"]}
                   for s in snap["segments"] if s["device"] == device), key=lambda s: s["addr"])
    blocks = {}
    for s in snap["segments"]:
        if s["device"] != device:
            continue
        for b in s["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[b["address"]] = b["size"]
    events = snap["device_traces"][device] if device < len(snap["device_traces"]) else []

    def containing(addr, size):
        for k, s in enumerate(segs):
            if s["addr"] <= addr and addr + size <= s["addr"] + s["size"]:
                return k
        return None

    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        a = e["action"]
        where = f"trace entry {i} ({a} {e.get('addr', 0):#x})"
        if a == "alloc":
            need(e["addr"] in blocks, f"{where}: allocated block not live after it")
            need(containing(e["addr"], 1) is not None, f"{where}: block in no segment")
            del blocks[e["addr"]]
        elif a == "free_completed":
            need(e["addr"] not in blocks, f"{where}: freed block still live after it")
            blocks[e["addr"]] = e["size"]
        elif a == "free_requested":
            need(e["addr"] in blocks, f"{where}: free_requested without its free_completed")
        elif a in ("segment_map", "segment_alloc"):
            k = containing(e["addr"], e["size"])
            need(k is not None, f"{where}: mapped range in no segment after it")
            s = segs[k]
            if a == "segment_alloc":
                need(s["addr"] == e["addr"] and s["size"] == e["size"], f"{where}: segment differs")
                segs.pop(k)
            else:  # cut the range out, as the viewer's unmap_segment
                end, s_end = e["addr"] + e["size"], s["addr"] + s["size"]
                pieces = [p for p in ({"addr": s["addr"], "size": e["addr"] - s["addr"], "stream": s["stream"]},
                                      {"addr": end, "size": s_end - end, "stream": s["stream"]}) if p["size"] > 0]
                segs[k:k + 1] = pieces
        elif a in ("segment_unmap", "segment_free"):
            need(containing(e["addr"], 1) is None and containing(e["addr"] + e["size"] - 1, 1) is None,
                 f"{where}: unmapped range still mapped after it")
            segs.append({"addr": e["addr"], "size": e["size"], "stream": e["stream"]})
            segs.sort(key=lambda s: s["addr"])
            if a == "segment_unmap":  # merge with neighbours, as the viewer's map_segment
                merged = []
                for s in segs:
                    if merged and merged[-1]["addr"] + merged[-1]["size"] == s["addr"] \
                            and merged[-1]["stream"] == s["stream"]:
                        merged[-1]["size"] += s["size"]
                    else:
                        merged.append(dict(s))
                segs = merged
    return len(events)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot")
    ap.add_argument("--expandable", choices=("yes", "no"))
    ap.add_argument("--min-trace", type=int, default=0)
    args = ap.parse_args(argv)
    data = open(args.snapshot, "rb").read()
    try:
        need(data[:2] == b"\x80\x02", "not a protocol-2 pickle")
        for op, _, _ in pickletools.genops(data):
            need(op.name in VIEWER_OPCODES, f"opcode {op.name} is not read by PyTorch's viewer")
        snap = pickle.loads(data)
        need(isinstance(snap, dict), "not a dict")
        for k in ("segments", "device_traces", "allocator_settings"):
            need(k in snap, f"missing top-level key {k!r}")
        nblocks = check_segments(snap)
        ntrace = check_trace(snap)
        need(ntrace >= args.min_trace, f"{ntrace} trace entries, expected at least {args.min_trace}")
        for d in range(len(snap["device_traces"])):
            reverse_walk(snap, d)
        if args.expandable:
            want = args.expandable == "yes"
            need(all(s["is_expandable"] == want for s in snap["segments"]),
                 f"is_expandable is not {want} everywhere")
            need(snap["allocator_settings"]["expandable_segments"] == want,
                 "allocator_settings.expandable_segments")
        if "gpumem" in snap:
            st = snap["gpumem"]["stats"]
            mapped = sum(s["total_size"] for s in snap["segments"])
            need(mapped <= st["reserved_bytes.all.current"], "segments exceed reserved bytes")
            alloc = sum(s["allocated_size"] for s in snap["segments"])
            need(alloc == st["allocated_bytes.all.current"],
                 f"segments hold {alloc} allocated bytes, stats say {st['allocated_bytes.all.current']}")
    except Bad as e:
        print(f"{args.snapshot}: INVALID: {e}", file=sys.stderr)
        return 1
    reserved = sum(s["total_size"] for s in snap["segments"])
    actions = {}
    for t in snap["device_traces"]:
        for e in t:
            actions[e["action"]] = actions.get(e["action"], 0) + 1
    print(f"{args.snapshot}: ok: {len(snap['segments'])} segments, {nblocks} blocks, "
          f"{reserved} bytes in segments, {ntrace} trace entries {actions}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
