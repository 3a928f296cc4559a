"""One workload as an unmodified training or inference script, for the comparison a PyTorch
user makes: run it natively, with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and
under `python -m gpumem run` (scripts/torch-compare.sh does all three, alternating).

    python scripts/torch_compare.py WORKLOAD [--steps N] [--warm W]

WORKLOAD is one of scripts/record_workloads.py's (each call is one step) or graph_decode
(a Llama-shaped decoder's one-token step captured once in a CUDA graph, replayed per step).
Prints one JSON line: the median step time over the steps after the warm-up, the spread
(min, max), and the peak reserved bytes over the peak requested bytes of the allocator in
use (PyTorch's memory_stats, or gpumem.torch.memory_stats under gpumem)."""

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record_workloads  # noqa: E402


def graph_decode_factory():
    """A Llama-shaped decoder (hidden 2048, 16 layers, 16 heads, bf16) over a static KV cache
    of 32 sequences x 1024 positions; one decode step captured in a CUDA graph."""
    hidden, layers, heads, batch, max_len = 2048, 16, 16, 32, 1024
    hd = hidden // heads
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w = [{k: torch.randn(*shape, device=dev, dtype=dt, generator=g) * 0.02
          for k, shape in (("qkv", (3 * hidden, hidden)), ("o", (hidden, hidden)),
                           ("up", (2 * 4 * hidden, hidden)), ("down", (hidden, 4 * hidden)))}
         for _ in range(layers)]
    kv = [torch.zeros(2, batch, heads, max_len, hd, device=dev, dtype=dt) for _ in range(layers)]
    x_in = torch.randn(batch, 1, hidden, device=dev, dtype=dt, generator=g)
    pos = torch.zeros((), dtype=torch.long, device=dev)
    mask = torch.zeros(1, 1, 1, max_len, device=dev, dtype=dt)

    def rms(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def step():
        x = x_in
        for i in range(layers):
            q, k, v = torch.nn.functional.linear(rms(x), w[i]["qkv"]).view(batch, 1, 3, heads, hd).unbind(2)
            kv[i][0].index_copy_(2, pos.view(1), k.transpose(1, 2))
            kv[i][1].index_copy_(2, pos.view(1), v.transpose(1, 2))
            a = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), kv[i][0], kv[i][1], attn_mask=mask)
            x = x + torch.nn.functional.linear(a.transpose(1, 2).reshape(batch, 1, hidden), w[i]["o"])
            gate, up = torch.nn.functional.linear(rms(x), w[i]["up"]).chunk(2, -1)
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w[i]["down"])
        return x

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    eager = step()
    graph.replay()
    torch.cuda.synchronize()
    error = (out.float() - eager.float()).abs().max().item()

    def run(_torch, _rng):
        for t in range(64):  # 64 tokens a step
            pos.fill_(t)
            graph.replay()
        torch.cuda.synchronize()

    return run, {"graph_vs_eager_max_abs": error}


def stats():
    if "gpumem" in sys.modules and sys.modules["gpumem"].__dict__.get("torch") is not None:
        import gpumem.torch

        if gpumem.torch.enabled():
            s = gpumem.torch.memory_stats()
            return "gpumem", s["reserved_bytes.all.peak"], s["requested_bytes.all.peak"]
    s = torch.cuda.memory_stats()
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    name = "expandable_segments" if "expandable_segments:True" in conf else "native"
    return name, s["reserved_bytes.all.peak"], s["requested_bytes.all.peak"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workload")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warm", type=int, default=2)
    a = p.parse_args()
    extra = {}
    if a.workload == "graph_decode":
        fn, extra = graph_decode_factory()
    else:
        fn = record_workloads.WORKLOADS[a.workload]
    times = []
    for i in range(a.warm + a.steps):
        torch.manual_seed(i)
        t0 = time.perf_counter()
        fn(torch, random.Random(i))
        torch.cuda.synchronize()
        if i >= a.warm:
            times.append(time.perf_counter() - t0)
    mode, reserved, requested = stats()
    print(json.dumps(dict(workload=a.workload, mode=mode, median_s=statistics.median(times),
                          min_s=min(times), max_s=max(times), steps=len(times),
                          peak_reserved=reserved, peak_requested=requested,
                          reserved_over_requested=round(reserved / max(requested, 1), 4), **extra)),
          flush=True)


if __name__ == "__main__":
    main()
