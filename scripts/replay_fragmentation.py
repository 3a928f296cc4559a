#!/usr/bin/env python3
"""Fragmentation and warm-pass driver calls of the page pool over every trace, on sim.

Replays each trace in data/ and data/workloads/ (and --shared DIR's) twice (`gpumem replay
--passes 2 --json`) with the defaults, optionally footprint:tight and caching_pool (the
c10-like model), and each trace alone under a cap (`limit:` at --cap times its peak live
bytes). Prints a row per trace (fragmentation, warm memory-moving calls as a share of the
pass's allocations) and the geomeans, as docs/PAGE_POOL.md reports them.

  scripts/replay_fragmentation.py build/tools/gpumem [--config K:V,...] [--tight] [--c10]
      [--cap 1.03] [--shared /work/shared/traces] [--traces FILE ...] [--json OUT]
"""
import argparse
import glob
import json
import math
import os
import subprocess
import sys

MOVING = ("cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
          "cudaMalloc", "cudaFree", "cuMemAlloc", "cuMemFree")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trace_name(path):
    """The trace's file name; a trace outside data/ is named by its folder too (a shared
    folder may hold a trace of the same name as data/'s)."""
    name = os.path.basename(path).removesuffix(".csv.gz")
    parent = os.path.abspath(os.path.dirname(path))
    inside = parent.startswith(os.path.join(ROOT, "data"))
    return name if inside else f"{os.path.basename(parent)}/{name}"


def replay(gpumem, traces, allocator, config=None):
    cmd = [gpumem, "replay", *traces, "--device", "sim", "--allocator", allocator,
           "--passes", "2", "--json"]
    if config:
        cmd += ["--config", config]
    doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    if "traces" not in doc:
        doc = {"traces": [doc]}
    out = {}
    for t in doc["traces"]:
        name = trace_name(t["trace"])
        if "error" in t:
            out[name] = {"error": t["error"]}
            continue
        (r,) = t["results"]
        calls = sum(n for k, n in r["last_pass_driver_calls"].items() if k in MOVING)
        out[name] = {"frag": r["fragmentation"], "calls": calls, "allocs": r["last_pass_allocs"],
                     "pct": 100.0 * calls / max(1, r["last_pass_allocs"]), "oom": r["oom"],
                     "peak_live": r["peak_live_bytes"], "peak_reserved": r["peak_reserved_bytes"],
                     "ns_warm": r["modelled_driver_ns_per_event"],
                     "ns_cold": r["modelled_driver_ns_per_event_cold"]}
    return out


def summary(name, rows):
    ok = [r for r in rows.values() if "error" not in r]
    geo = math.exp(sum(math.log(r["frag"]) for r in ok) / len(ok))
    within = sum(r["pct"] <= 1.0 for r in ok)
    ooms = sum(bool(r["oom"]) for r in ok) + len(rows) - len(ok)
    calls = sum(r["calls"] for r in ok)
    worst = max(r["frag"] for r in ok)
    print(f"{name}: {len(rows)} traces, fragmentation geomean {geo:.4f} worst {worst:.4f}; "
          f"{within} within 1%; {calls} warm memory calls; {ooms} out of memory")
    return geo


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gpumem")
    ap.add_argument("--config", default="", help="pool options for the page pool's runs")
    ap.add_argument("--tight", action="store_true", help="also footprint:tight")
    ap.add_argument("--c10", action="store_true", help="also caching_pool")
    ap.add_argument("--cap", type=float, default=0.0, help="also each trace under limit: cap x peak")
    ap.add_argument("--shared", help="also the traces in this folder")
    ap.add_argument("--traces", nargs="*")
    ap.add_argument("--json", help="write every row here")
    a = ap.parse_args()
    traces = a.traces or sorted(glob.glob(f"{ROOT}/data/*.csv.gz") +
                                glob.glob(f"{ROOT}/data/workloads/*.csv.gz"))
    if a.shared:
        traces += sorted(glob.glob(f"{a.shared}/*.csv.gz"))
    cfg = a.config
    runs = {"fast": replay(a.gpumem, traces, "vmm_page_pool", cfg)}
    if a.tight:
        runs["tight"] = replay(a.gpumem, traces, "vmm_page_pool",
                               ",".join(x for x in (cfg, "footprint:tight") if x))
    if a.c10:
        runs["c10"] = replay(a.gpumem, traces, "caching_pool")
    if a.cap:
        capped = {}
        for tr in traces:
            name = trace_name(tr)
            peak = runs["fast"][name].get("peak_live", 0)
            limit = f"limit:{int(peak * a.cap)}"
            capped.update(replay(a.gpumem, [tr], "vmm_page_pool",
                                 ",".join(x for x in (cfg, limit) if x)))
        runs["capped"] = capped
    names = list(runs["fast"])
    cols = list(runs)
    print("trace".ljust(28) + "".join(f"{c + ' frag':>12}{c + ' %':>9}" for c in cols))
    for n in names:
        line = n.ljust(28)
        for c in cols:
            r = runs[c].get(n, {"error": "missing"})
            if "error" in r:
                line += f"{'error':>12}{'':>9}"
            else:
                mark = "*" if c == "fast" and "c10" in runs and r["frag"] > runs["c10"][n]["frag"] else " "
                line += f"{r['frag']:>11.4f}{mark}{r['pct']:>8.2f}%"
        print(line)
    for c in cols:
        summary(c, runs[c])
    if a.json:
        json.dump(runs, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
