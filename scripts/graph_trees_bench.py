"""Step time and memory of torch.compile(mode="reduce-overhead") under three allocators, each
in fresh processes, sides alternating: PyTorch's own ("native"), gpumem as PyTorch's own
CUDAAllocator ("gpumem", CUDA graph trees on) and gpumem through CUDAPluggableAllocator
("gpumem-pluggable", trees off, one private pool per graph).

    python3 scripts/graph_trees_bench.py --repeats 3 [--steps 200] [--json out.json]

Each run: an MLP stack trained for --steps steps (forward and backward compiled, AdamW);
reported: the median step time after warm-up and peak reserved bytes (torch.cuda's
max_memory_reserved, which gpumem answers too, and gpumem's own peak for the pluggable
route). Needs torch and a CUDA device; GPUMEM_LIB names libgpumem_torch.so."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one_run(steps, width, depth, batch):
    import torch

    side = os.environ.get("BENCH_SIDE")
    if side != "native":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "python"))
        import gpumem.torch

        gpumem.torch.enable()
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(batch, width, device="cuda")
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step_fn(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    warm = times[steps // 4:]
    if side == "gpumem-pluggable":
        import gpumem.torch

        peak = gpumem.torch.memory_stats()["reserved_bytes.all.peak"]
    else:
        peak = torch.cuda.max_memory_reserved()
    route = "native"
    if side != "native":
        import gpumem.torch

        route = gpumem.torch.route()
    print(json.dumps({"side": side, "route": route, "step_ms": statistics.median(warm) * 1e3,
                      "peak_reserved": peak, "loss": float(loss)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--json")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        one_run(a.steps, a.width, a.depth, a.batch)
        return 0
    sides = ["native", "gpumem", "gpumem-pluggable"]
    runs = []
    for r in range(a.repeats):
        order = sides if r % 2 == 0 else list(reversed(sides))
        for side in order:
            env = dict(os.environ, BENCH_SIDE=side)
            env["GPUMEM_TORCH_ROUTE"] = "pluggable" if side == "gpumem-pluggable" else "native"
            out = subprocess.run([sys.executable, __file__, "--one", "--steps", str(a.steps),
                                  "--width", str(a.width), "--depth", str(a.depth),
                                  "--batch", str(a.batch)], env=env, capture_output=True,
                                 text=True)
            lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
            if out.returncode != 0 or not lines:
                print("%s failed (exit %d):\n%s" % (side, out.returncode, out.stderr[-3000:]))
                runs.append({"side": side, "error": out.stderr[-500:]})
                continue
            runs.append(json.loads(lines[-1]))
            print(lines[-1], flush=True)
    for side in sides:
        ok = [x for x in runs if x["side"] == side and "step_ms" in x]
        if ok:
            ms = sorted(x["step_ms"] for x in ok)
            peaks = sorted(x["peak_reserved"] for x in ok)
            print("%-17s step median %.3f ms (%.3f-%.3f), peak reserved %.1f MiB (%.1f-%.1f), route %s"
                  % (side, statistics.median(ms), ms[0], ms[-1], statistics.median(peaks) / 2**20,
                     peaks[0] / 2**20, peaks[-1] / 2**20, ok[0]["route"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
