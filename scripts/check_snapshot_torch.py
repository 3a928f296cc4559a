#!/usr/bin/env python3
"""Load gpumem memory snapshots with PyTorch's own tools; fail loudly if any refuses them.

For the GPU machine (any machine with torch installed; a GPU is needed only for the last
step). For each FILE (written by `gpumem replay ... --snapshot FILE` or gpumem_snapshot()):

  1. pickle.load, then torch.cuda._memory_viz: segsum (`stats`: asserts that block sizes
     add up to every segment), trace, segments and memory (flamegraph text), compare,
     trace_plot, segment_plot (the HTML viewer pages, written next to the file);
  2. `python3 -m torch.cuda._memory_viz stats|trace|trace_plot|segment_plot FILE` as
     subprocesses;
  3. if node is installed: PyTorch's own in-browser unpickler (unpickle() from
     torch/utils/viz/MemoryViz.js) decodes the file to the same segments and trace;
  4. if CUDA is available: a real torch.cuda.memory._snapshot() is taken and its segment,
     block and trace-entry keys are compared with gpumem's (missing keys are reported).

Usage: python3 scripts/check_snapshot_torch.py FILE.pickle [FILE2.pickle ...] [--keep-html]
Exit status: 0 when every step passed on every file, 1 otherwise (each failure printed).
"""
import argparse
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import traceback
from contextlib import redirect_stdout

failures = []


def step(name, fn):
    try:
        result = fn()
        print(f"  ok    {name}")
        return result
    except Exception:  # noqa: BLE001 - every failure is reported, then the run fails
        print(f"  FAIL  {name}")
        traceback.print_exc()
        failures.append(name)
        return None


def identity(text):
    return text  # the flamegraph text itself: format_flamegraph would download a script


def js_unpickle_check(path, data):
    import torch
    node = shutil.which("node")
    if node is None:
        print("  skip  MemoryViz.js unpickle (node not installed)")
        return
    js_path = os.path.join(os.path.dirname(torch.__file__), "utils", "viz", "MemoryViz.js")
    src = open(js_path).read()
    start = src.index("function unpickle(buffer)")
    end = src.index("\nfunction ", start + 10)
    script = src[start:end] + r"""
const fs = require('fs');
const bytes = fs.readFileSync(process.argv[2]);
const buf = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length);
const s = unpickle(buf);
const blocks = s.segments.reduce((n, x) => n + x.blocks.length, 0);
console.log(JSON.stringify({segments: s.segments.length, blocks,
  traces: s.device_traces.map(t => t.length),
  first_address: s.segments.length ? s.segments[0].address : null}));
"""
    with tempfile.NamedTemporaryFile("w", suffix=".js", delete=False) as f:
        f.write(script)
    try:
        out = subprocess.run([node, f.name, path], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    got = json.loads(out)
    want = {"segments": len(data["segments"]),
            "blocks": sum(len(s["blocks"]) for s in data["segments"]),
            "traces": [len(t) for t in data["device_traces"]],
            "first_address": data["segments"][0]["address"] if data["segments"] else None}
    assert got == want, f"MemoryViz.js read {got}, Python read {want}"


def compare_with_torch(data):
    import torch
    if not torch.cuda.is_available():
        print("  skip  key comparison with a real torch snapshot (no CUDA device)")
        return
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        x = [torch.empty(n, device="cuda") for n in (1 << 10, 1 << 20, 3 << 20)]
        del x[1]
        real = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

    def keys(items):
        out = set()
        for i in items:
            out |= set(i.keys())
        return out

    ours_seg, real_seg = keys(data["segments"]), keys(real["segments"])
    ours_blk = keys(b for s in data["segments"] for b in s["blocks"])
    real_blk = keys(b for s in real["segments"] for b in s["blocks"])
    ours_ev = keys(e for t in data["device_traces"] for e in t if e["action"] != "oom")
    real_ev = keys(e for t in real["device_traces"] for e in t if e["action"] != "oom")
    missing = {"segment": sorted(real_seg - ours_seg), "block": sorted(real_blk - ours_blk),
               "trace entry": sorted(real_ev - ours_ev) if ours_ev else [],
               "top level": sorted(set(real.keys()) - set(data.keys()))}
    for what, ks in missing.items():
        if ks:
            print(f"  note  torch {torch.__version__} has {what} keys gpumem does not write: {ks}")
    # Keys the viewer and _memory_viz read must be there.
    needed = {"segment": {"address", "total_size", "stream", "blocks", "device"},
              "block": {"size", "state", "requested_size", "frames"},
              "trace entry": {"action", "addr", "size", "stream", "frames"}}
    got = {"segment": ours_seg, "block": ours_blk, "trace entry": ours_ev or needed["trace entry"]}
    for what, ks in needed.items():
        assert ks <= got[what], f"gpumem {what} lacks {sorted(ks - got[what])}"


def check(path, keep_html):
    import torch
    from torch.cuda import _memory_viz as mv
    print(f"{path}:")
    data = step("pickle.load", lambda: pickle.load(open(path, "rb")))
    if data is None:
        return
    step("segsum (stats)", lambda: mv.segsum(data))
    step("trace", lambda: mv.trace(data))
    step("segments flamegraph", lambda: mv.segments(data, format_flamegraph=identity))
    step("memory flamegraph", lambda: mv.memory(data, format_flamegraph=identity))
    def quiet_compare():
        with redirect_stdout(io.StringIO()):  # compare prints its segment lists
            return mv.compare(data["segments"], data["segments"], format_flamegraph=identity)
    step("compare", quiet_compare)
    base = os.path.splitext(path)[0]
    for name, fn in (("trace_plot", lambda: mv.trace_plot(data)),
                     ("trace_plot segments", lambda: mv.trace_plot(data, plot_segments=True)),
                     ("segment_plot", lambda: mv.segment_plot(data))):
        html = step(name, fn)
        if html is not None:
            assert "add_local_files" in html
            if keep_html:
                out = f"{base}.{name.replace(' ', '_')}.html"
                open(out, "w").write(html)
                print(f"        wrote {out} (open in a browser with internet access)")
    with tempfile.TemporaryDirectory() as tmp:
        for args in (["stats", path], ["trace", path],
                     ["trace_plot", path, "-o", os.path.join(tmp, "t.html")],
                     ["segment_plot", path, "-o", os.path.join(tmp, "s.html")]):
            step("python -m torch.cuda._memory_viz " + args[0],
                 lambda args=args: subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz"] + args,
                                                  check=True, capture_output=True, text=True))
    step("MemoryViz.js unpickle", lambda: js_unpickle_check(path, data))
    step("keys against a real torch snapshot", lambda: compare_with_torch(data))

    # Summary.
    segs = data["segments"]
    reserved = sum(s["total_size"] for s in segs)
    allocated = sum(s["allocated_size"] for s in segs)
    actions = {}
    for t in data["device_traces"]:
        for e in t:
            actions[e["action"]] = actions.get(e["action"], 0) + 1
    g = data.get("gpumem", {})
    print(f"  summary: allocator {g.get('allocator', '?')}, torch {torch.__version__}; "
          f"{len(segs)} segments ({sum(s['is_expandable'] for s in segs)} expandable), "
          f"{sum(len(s['blocks']) for s in segs)} blocks, {reserved / 2**30:.2f} GiB in segments, "
          f"{allocated / 2**30:.2f} GiB allocated; trace {actions}")
    stats_text = mv.segsum(data) if "segsum (stats)" not in failures else ""
    for line in stats_text.splitlines():
        if line.startswith(("segments:", "total_reserved", "total_allocated", "total_free")):
            print("    " + line)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--keep-html", action="store_true",
                    help="write the trace_plot/segment_plot pages next to each file")
    args = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
        from torch.cuda import _memory_viz  # noqa: F401
    except ImportError as e:
        print(f"check_snapshot_torch: torch is not importable here ({e})", file=sys.stderr)
        return 1
    for path in args.files:
        check(path, args.keep_html)
    if failures:
        print(f"FAILED: {len(failures)} step(s): {failures}", file=sys.stderr)
        return 1
    print(f"all PyTorch checks passed on {len(args.files)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
