#!/usr/bin/env python3
"""torch_alloc_bench: what one tensor allocation costs through PyTorch, with its own
allocator or with gpumem's plug-in, in microseconds per torch.empty + del pair.

pool_bench times the pools from C++; a PyTorch program reaches them through
CUDAPluggableAllocator, whose bookkeeping (and Python's) comes on top. This bench measures
that whole path, so a workload's timing under PyTorch can be split into per-call overhead
and the pool's driver time.

  same_size  torch.empty of 1 MiB, then del, repeated
  mixed_64   64 live tensors of random sizes 512 B - 8 MiB (log-uniform, as pool_bench's
             mixed_64); each step drops one at random and makes a new random size

One mode a process (PyTorch cannot switch allocators once it has allocated):
  torch_alloc_bench.py native|gpumem[:CONF] [--steps N] [--rounds R]
Prints one JSON line: medians over rounds, microseconds per pair.
"""
import argparse
import json
import math
import random
import statistics
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("--steps", type=int, default=200000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.mode != "native":
        if not args.mode.startswith("gpumem"):
            sys.exit("torch_alloc_bench.py: mode is native, gpumem or gpumem:CONF")
        import gpumem.torch

        gpumem.torch.enable(args.mode.partition(":")[2] or None)
    import torch

    dev = torch.device("cuda")
    rng = random.Random(42)
    lo, hi = math.log2(512), math.log2(8 << 20)

    def random_size():
        return (int(2 ** rng.uniform(lo, hi)) + 511) // 512 * 512

    def same_size(steps):
        t0 = time.perf_counter()
        for _ in range(steps):
            t = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
            del t
        return (time.perf_counter() - t0) / steps * 1e6

    def mixed(steps):
        live = [torch.empty(random_size(), dtype=torch.uint8, device=dev) for _ in range(64)]
        seq = [(rng.randrange(64), random_size()) for _ in range(steps)]
        t0 = time.perf_counter()
        for i, n in seq:
            live[i] = None
            live[i] = torch.empty(n, dtype=torch.uint8, device=dev)
        us = (time.perf_counter() - t0) / steps * 1e6
        del live
        return us

    def loop_only(steps):
        # The Python loop and list work of mixed() without the allocation: subtracted by
        # the reader, not here (printed on its own).
        live = [None] * 64
        seq = [(rng.randrange(64), random_size()) for _ in range(steps)]
        t0 = time.perf_counter()
        for i, n in seq:
            live[i] = None
            live[i] = n
        return (time.perf_counter() - t0) / steps * 1e6

    same_size(args.steps // 10)  # warm: the pool holds what the loops need
    mixed(args.steps // 10)
    same = [same_size(args.steps) for _ in range(args.rounds)]
    mix = [mixed(args.steps) for _ in range(args.rounds)]
    torch.cuda.synchronize()
    print(json.dumps({"mode": args.mode, "same_size_us": round(statistics.median(same), 3),
                      "mixed_64_us": round(statistics.median(mix), 3),
                      "python_loop_us": round(loop_only(args.steps), 3)}), flush=True)


if __name__ == "__main__":
    main()
