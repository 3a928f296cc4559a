"""Time to share a tensor between processes through CUDA IPC (reduce_tensor in the exporter,
the rebuild in the importer, to its first byte read), for gpumem's native allocator against
PyTorch's own (expandable segments, whose handles are the same format, and plain cudaMalloc
segments). Each side runs in processes of its own (an allocator is process-wide); sides
alternate, each repeated; medians and spreads are printed and written as JSON.

    python3 scripts/ipc_share_bench.py --gib 4 --repeats 3 --json out.json
"""

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONSUMER = os.path.join(HERE, "..", "tests", "interop", "torch_ipc_consumer.py")
SIDES = {
    "gpumem": {"GPUMEM_TORCH_ROUTE": "native"},
    "native_expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "native": {},
}


def exporter(side, gib):
    import torch

    if side == "gpumem":
        import gpumem.torch

        gpumem.torch.enable()
        assert gpumem.torch.route() == "native", "the native allocator is not installed"
    from torch.multiprocessing.reductions import reduce_tensor

    t = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    func, args = reduce_tensor(t)
    payload = pickle.dumps((func, args, float(t.numel())))
    share_s = time.perf_counter() - t0
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, CONSUMER] + (["gpumem"] if side == "gpumem" else []),
                          input=payload, capture_output=True, env=env, timeout=300)
    if proc.returncode != 0:
        print(json.dumps({"error": proc.stderr.decode()[-800:]}))
        return
    got = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    print(json.dumps({"share_s": share_s, "open_s": got["open_s"], "ok": got["ok"]}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--exporter", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.exporter:
        return exporter(a.exporter, a.gib)
    runs = {s: [] for s in SIDES}
    for _ in range(a.repeats):
        for side, extra in SIDES.items():
            env = dict(os.environ, **extra)
            if side != "gpumem":
                env.pop("GPUMEM_TORCH_ROUTE", None)
            out = subprocess.run([sys.executable, __file__, "--exporter", side, "--gib", str(a.gib)],
                                 capture_output=True, env=env, timeout=600)
            lines = out.stdout.decode().strip().splitlines()
            r = json.loads(lines[-1]) if lines else {"error": out.stderr.decode()[-800:]}
            runs[side].append(r)
    summary = {}
    for side, rs in runs.items():
        good = [r for r in rs if "error" not in r and r.get("ok")]
        if not good:
            summary[side] = {"error": rs[-1].get("error", "bytes differ")}
            continue
        tot = [r["share_s"] + r["open_s"] for r in good]
        summary[side] = {"median_ms": 1e3 * statistics.median(tot), "min_ms": 1e3 * min(tot),
                         "max_ms": 1e3 * max(tot), "runs": len(good),
                         "share_ms": 1e3 * statistics.median(r["share_s"] for r in good),
                         "open_ms": 1e3 * statistics.median(r["open_s"] for r in good)}
    base = summary.get("native_expandable", {}).get("median_ms")
    print("%-18s %10s %10s %10s %18s" % ("side", "share ms", "open ms", "total ms", "spread (min-max)"))
    for side, s in summary.items():
        if "error" in s:
            print("%-18s error: %s" % (side, s["error"][-300:]))
            continue
        print("%-18s %10.2f %10.2f %10.2f %8.2f-%-8.2f%s" % (
            side, s["share_ms"], s["open_ms"], s["median_ms"], s["min_ms"], s["max_ms"],
            "  %.2fx expandable" % (s["median_ms"] / base) if base else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gib": a.gib, "summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
