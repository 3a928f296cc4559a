#!/usr/bin/env python3
"""Sleep / wake and sharing between processes under PyTorch on a GPU (docs/SLEEP_AND_SHARING.md).

Runs, printing one JSON line per measurement:
  1. sleep_wake: a Llama-shaped model's bf16 weights (tag "weights", >= 8 GB) and a KV
     cache (tag "kv", >= 20 GiB); free memory reported by the driver before and after
     sleep (weights offloaded, KV discarded), sleep and wake times against the pinned
     host<->device copy bandwidth measured in the same run, and a CUDA graph of a decode
     step captured before sleep replayed after wake (logits compared bit for bit);
  2. colocated: 10 iterations of training step -> sleep the trainer's tag -> wake the
     inference tags and generate -> sleep them -> wake the trainer; reserved bytes per
     iteration (they must not grow);
  3. share: a producer writes a 4 GiB tensor, a consumer process maps it (gpumem.ipc) and
     checks every byte; time to share against torch.multiprocessing's CUDA IPC, same run.

    python scripts/gpu-sleep-wake.py [--layers 16] [--kv-gib 20] [--share-gib 4] [--only X]

Needs torch with CUDA and the gpumem plug-in (GPUMEM_LIB or a built tree); exits 77 when
either is missing.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

GiB = 1 << 30


def emit(**fields):
    print(json.dumps(fields), flush=True)


def setup():
    try:
        import torch
    except ImportError:
        print("skip: no torch", file=sys.stderr)
        sys.exit(77)
    if not torch.cuda.is_available():
        print("skip: no CUDA device", file=sys.stderr)
        sys.exit(77)
    import gpumem.torch as gt
    gt.enable()
    return torch, gt


def build_model(torch, layers, hidden=4096, inter=14336, vocab=128256):
    """Llama-shaped weights: per layer q, k, v, o (hidden x hidden) and gate, up, down."""
    w = {"embed": torch.randn(vocab, hidden, dtype=torch.bfloat16, device="cuda") * 0.02}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            w["%d.%s" % (i, name)] = torch.randn(hidden, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
        w["%d.gate" % i] = torch.randn(inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
        w["%d.up" % i] = torch.randn(inter, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
        w["%d.down" % i] = torch.randn(hidden, inter, dtype=torch.bfloat16, device="cuda") * 0.02
    return w


def decode_step(torch, w, layers, x, kv):
    """One token through every layer (attention reduced to its projections, each sublayer
    after an RMS norm so the activations stay finite over any number of layers), writing
    the keys and values into the KV cache (so the graph touches it) and returning logits."""
    norm = torch.nn.functional.rms_norm
    h = x
    for i in range(layers):
        a = norm(h, (h.shape[-1],))
        q = a @ w["%d.q" % i].t()
        k = a @ w["%d.k" % i].t()
        v = a @ w["%d.v" % i].t()
        kv[i, 0, : k.numel()].copy_(k.flatten())
        kv[i, 1, : v.numel()].copy_(v.flatten())
        h = h + (q * torch.sigmoid(k) + v) @ w["%d.o" % i].t()
        a = norm(h, (h.shape[-1],))
        g = torch.nn.functional.silu(a @ w["%d.gate" % i].t()) * (a @ w["%d.up" % i].t())
        h = h + g @ w["%d.down" % i].t()
    return norm(h, (h.shape[-1],)) @ w["embed"].t()


def pinned_bandwidth(torch, nbytes=2 * GiB):
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = 3 * nbytes / (time.perf_counter() - t)
    del dev, host
    return out


def tagged_bytes(gt, tag):
    return gt.tag_stats(tag)["reserved_bytes"]


def sleep_wake(torch, gt, args):
    with gt.tag("weights"):
        w = build_model(torch, args.layers)
    weight_bytes = sum(t.numel() * t.element_size() for t in w.values())
    kv_elems = args.kv_gib * GiB // 2
    with gt.tag("kv"):
        kv = torch.zeros(args.layers, 2, kv_elems // (2 * args.layers), dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    bw = pinned_bandwidth(torch)
    # The graph: captured before sleep, replayed after wake.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            decode_step(torch, w, args.layers, x, kv)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = decode_step(torch, w, args.layers, x, kv)
    graph.replay()
    torch.cuda.synchronize()
    before_logits = logits.clone()
    # Bitwise equality only means something for finite logits (NaN != NaN) that two
    # replays without sleep reproduce.
    finite = bool(torch.isfinite(before_logits).all())
    logits.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replay_reproduces = bool(torch.equal(before_logits, logits))
    tagged = tagged_bytes(gt, "weights") + tagged_bytes(gt, "kv")
    # Cycle 1 includes getting the pinned host memory (kept for later sleeps); cycle 2 is
    # the steady state an RL loop sees.
    for cycle in (1, 2):
        free_before = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        gt.sleep("weights", "offload")
        torch.cuda.synchronize()
        t_w = time.perf_counter()
        gt.sleep("kv", "discard")
        torch.cuda.synchronize()
        t_k = time.perf_counter()
        sleep_s, weights_sleep_s, kv_sleep_s = t_k - t, t_w - t, t_k - t_w
        free_asleep = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        gt.wake("weights")
        torch.cuda.synchronize()
        t_w = time.perf_counter()
        gt.wake("kv")
        torch.cuda.synchronize()
        t_k = time.perf_counter()
        wake_s, weights_wake_s, kv_wake_s = t_k - t, t_w - t, t_k - t_w
        logits.zero_()
        graph.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(before_logits, logits))
        emit(test="sleep_wake", cycle=cycle, weight_bytes=weight_bytes, kv_bytes=kv.numel() * 2,
             tagged_reserved=tagged, free_before=free_before, free_asleep=free_asleep,
             returned_share=(free_asleep - free_before) / tagged, sleep_s=sleep_s, wake_s=wake_s,
             weights_sleep_s=weights_sleep_s, weights_wake_s=weights_wake_s,
             kv_sleep_s=kv_sleep_s, kv_wake_s=kv_wake_s,
             pinned_d2h_Bps=bw["d2h"], pinned_h2d_Bps=bw["h2d"],
             weights_sleep_vs_pinned=(weight_bytes / bw["d2h"]) / weights_sleep_s,
             weights_wake_vs_pinned=(weight_bytes / bw["h2d"]) / weights_wake_s,
             sleep_vs_pinned=(weight_bytes / bw["d2h"]) / sleep_s,
             wake_vs_pinned=(weight_bytes / bw["h2d"]) / wake_s,
             logits_finite=finite, replay_reproduces_without_sleep=replay_reproduces,
             graph_logits_identical=same)
    del graph, logits, before_logits, kv, w
    torch.cuda.synchronize()


def colocated(torch, gt, args):
    layers = max(2, args.layers // 4)
    with gt.tag("weights"):
        w = build_model(torch, layers)
    with gt.tag("kv"):  # 4 GiB: [layers, K/V, GiB / layers] bf16
        kv = torch.zeros(layers, 2, GiB // layers, dtype=torch.bfloat16, device="cuda")
    with gt.tag("trainer"):
        model = torch.nn.Sequential(torch.nn.Linear(8192, 8192), torch.nn.GELU(),
                                    torch.nn.Linear(8192, 8192)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gt.sleep("weights", "offload")
    gt.sleep("kv", "discard")
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    reserved = []
    for it in range(10):
        with gt.tag("trainer"):
            batch = torch.randn(512, 8192, device="cuda")
            loss = model(batch).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del batch, loss
        torch.cuda.synchronize()
        gt.sleep("trainer", "offload")
        gt.wake("weights")
        gt.wake("kv")
        with torch.no_grad():
            for _ in range(8):
                decode_step(torch, w, layers, x, kv)
        torch.cuda.synchronize()
        total = sum(tagged_bytes(gt, t) for t in ("weights", "kv", "trainer")) + \
            gt.stats()["reserved_bytes"]
        reserved.append(total)
        gt.sleep("weights", "offload")
        gt.sleep("kv", "discard")
        gt.wake("trainer")
    emit(test="colocated", iterations=10, reserved_per_iteration=reserved,
         growth_bytes=max(reserved) - reserved[0])
    gt.wake("weights")
    gt.wake("kv")


CHECK_CHUNK = 64 << 20


def check_pattern(torch, t):
    """Every byte of t equals its index mod 251, checked in chunks (no n-sized temporary)."""
    flat = t.view(-1)
    for start in range(0, flat.numel(), CHECK_CHUNK):
        end = min(start + CHECK_CHUNK, flat.numel())
        expected = (torch.arange(start, end, device=flat.device, dtype=torch.int64) % 251).to(torch.uint8)
        if not torch.equal(flat[start:end], expected):
            return False
    return True


def consumer_gpumem(sock_fd):
    torch, gt = setup()
    import gpumem.ipc as ipc
    torch.zeros(1, device="cuda")  # CUDA and the pool up before the clock runs
    torch.cuda.synchronize()
    sock = socket.socket(fileno=sock_fd)
    sock.sendall(b"r")
    handle = ipc.Handle.receive(sock)
    t = ipc.open(handle)
    ready = time.time()
    ok = check_pattern(torch, t)
    torch.cuda.synchronize()
    sock.sendall(json.dumps({"ready": ready, "checked": time.time(), "ok": ok}).encode())
    sock.close()


def consumer_torch(queue, answers):
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    answers.put("r")
    t = queue.get()
    ready = time.time()
    ok = check_pattern(torch, t)
    torch.cuda.synchronize()
    answers.put({"ready": ready, "checked": time.time(), "ok": ok})
    del t


def share(torch, gt, args):
    import gpumem.ipc as ipc
    n = args.share_gib * GiB
    with gt.tag("shared"):
        t = (torch.arange(n, device="cuda", dtype=torch.int64) % 251).to(torch.uint8)
    torch.cuda.synchronize()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--consumer-fd",
                             str(child.fileno())], pass_fds=[child.fileno()])
    child.close()
    assert parent.recv(1) == b"r"  # the consumer's CUDA is up: the clock starts now
    start = time.time()
    handle = ipc.share(t)
    handle.send(parent)
    answer = json.loads(parent.recv(4096).decode())
    proc.wait()
    gpumem_s = answer["ready"] - start
    gpumem_check_s = answer["checked"] - answer["ready"]
    del t
    # torch.multiprocessing's CUDA IPC needs memory of PyTorch's own allocator, so the
    # baseline runs in a process without gpumem: same size, same check, same clock.
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-mp-baseline",
                          str(n)], capture_output=True, text=True, timeout=900)
    base = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {
        "error": out.stderr[-2000:]}
    emit(test="share", bytes=n, gpumem_ok=answer["ok"], gpumem_share_s=gpumem_s,
         gpumem_check_s=gpumem_check_s, torch_mp_ok=base.get("ok"),
         torch_mp_share_s=base.get("share_s"), torch_mp_check_s=base.get("check_s"),
         torch_mp_error=base.get("error"))


def torch_mp_baseline(n):
    import torch
    import torch.multiprocessing as mp
    t = (torch.arange(n, device="cuda", dtype=torch.int64) % 251).to(torch.uint8)
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    queue, answers = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer_torch, args=(queue, answers))
    p.start()
    assert answers.get(timeout=600) == "r"  # the consumer's CUDA is up
    start = time.time()
    queue.put(t)
    got = answers.get(timeout=600)
    p.join(timeout=60)
    print(json.dumps({"ok": got["ok"], "share_s": got["ready"] - start,
                      "check_s": got["checked"] - got["ready"]}), flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-gib", type=int, default=20)
    ap.add_argument("--share-gib", type=int, default=4)
    ap.add_argument("--only", choices=["sleep_wake", "colocated", "share"])
    ap.add_argument("--consumer-fd", type=int)
    ap.add_argument("--torch-mp-baseline", type=int)
    args = ap.parse_args()
    if args.consumer_fd is not None:
        return consumer_gpumem(args.consumer_fd)
    if args.torch_mp_baseline is not None:
        return torch_mp_baseline(args.torch_mp_baseline)
    torch, gt = setup()
    emit(test="device", name=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
         torch=torch.__version__)
    for name, fn in (("sleep_wake", sleep_wake), ("colocated", colocated), ("share", share)):
        if args.only in (None, name):
            fn(torch, gt, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
