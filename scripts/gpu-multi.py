#!/usr/bin/env python3
"""Several GPUs of one host under gpumem against PyTorch's own allocator (docs/INTEROP.md,
"Several GPUs"). Needs 2 GPUs, torch with CUDA and NCCL, and the gpumem plug-in (GPUMEM_LIB
or a built tree); exits 77 saying which is missing.

Every measurement runs in fresh processes, once with gpumem as PyTorch's allocator and once
with PyTorch's caching allocator, in the same invocation (the allocator is chosen per
process before CUDA starts); with --repeats R each pair runs R times in alternating order
and the medians are reported. One JSON line per result:
  1. ddp: DistributedDataParallel training of a Llama-shaped model (random weights; the
     nn.Module below, or transformers' LlamaForCausalLM with --hf when importable) over
     NCCL, 2 ranks: median step time, peak reserved and peak requested bytes per rank;
  2. fsdp: the same model under FullyShardedDataParallel (one unit per decoder layer);
  3. tp_decode: tensor-parallel greedy decode on 2 ranks (attention heads and MLP columns
     split, an NCCL all-reduce after each row-parallel projection, on buffers from the
     allocator's pool): median token latency, and the logits checked against one GPU
     computing the full model;
  4. peer_copy: copies between a tensor on cuda:0 and one on cuda:1: both from gpumem's
     pools (peer_access:all) and both from PyTorch's allocator, against plain
     cudaMemcpyPeer on cudaMalloc'd buffers (through libcudart, when loadable), same run;
     bytes checked. Also whether a copy works without peer_access (in a child process:
     a failure there may poison its CUDA context).

    python scripts/gpu-multi.py [--only ddp,fsdp,tp_decode,peer_copy] [--repeats 3]
        [--steps 20] [--layers 8] [--hidden 2048] [--seq 1024] [--batch 4] [--hf]
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
MiB = 1 << 20


def emit(**fields):
    print(json.dumps(fields), flush=True)


def skip(reason):
    print("skip: " + reason, file=sys.stderr)
    sys.exit(77)


# --- the model -------------------------------------------------------------------------


def llama_module(torch, layers, hidden, heads, vocab, inter):
    """A Llama-shaped decoder written out: RMSNorm, rotary attention (SDPA, causal), SwiGLU."""
    nn = torch.nn
    F = torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            v = x.float().pow(2).mean(-1, keepdim=True)
            return (x.float() * torch.rsqrt(v + 1e-6)).type_as(x) * self.weight

    def rotary(x, pos):
        """x: [batch, tokens, heads, head_dim]; pos: [tokens]."""
        d = x.shape[-1]
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device).float() / d))
        ang = (pos.float()[:, None] * inv[None, :])[:, None, :]  # [tokens, 1, head_dim / 2]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads, self.dim = heads, hidden // heads
            self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
            self.o = nn.Linear(hidden, hidden, bias=False)
            self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
            self.down = nn.Linear(inter, hidden, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, self.dim).unbind(2)
            pos = torch.arange(t, device=x.device)
            q, k = rotary(q, pos), rotary(k, pos)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
            g, u = self.gate_up(self.norm2(x)).chunk(2, -1)
            return x + self.down(F.silu(g) * u)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = RMSNorm(hidden)
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    return Model(), Layer


def make_model(torch, args):
    if args.hf:
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        except ImportError:
            args.hf = False
        else:
            cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                              intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                              num_attention_heads=args.heads, num_key_value_heads=args.heads,
                              max_position_embeddings=args.seq)
            model = LlamaForCausalLM(cfg)
            return (lambda ids: model(ids).logits), model, LlamaDecoderLayer
    model, layer_cls = llama_module(torch, args.layers, args.hidden, args.heads, args.vocab,
                                    args.hidden * 8 // 3)
    return model, model, layer_cls


# --- workers (one process per rank) ------------------------------------------------------


def worker_setup(args):
    import torch
    rank = int(os.environ["RANK"])
    if args.allocator == "gpumem":
        import gpumem.torch as gt
        gt.enable(args.conf or None)
    torch.cuda.set_device(rank)
    import torch.distributed as dist
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    return torch, dist, rank


def peaks(torch, rank, allocator):
    if allocator == "gpumem":
        import gpumem.torch as gt
        s = gt.memory_stats(rank)
    else:
        s = torch.cuda.memory_stats(rank)
    return {"peak_reserved": s["reserved_bytes.all.peak"],
            "peak_requested": s["requested_bytes.all.peak"]}


def train_worker(args, sharded):
    torch, dist, rank = worker_setup(args)
    torch.manual_seed(0)
    _, model, layer_cls = make_model(torch, args)
    model = model.cuda()
    if sharded:
        import functools
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=policy, device_id=rank,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32,
                                           buffer_dtype=torch.bfloat16))
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    step_fn = (lambda ids: wrapped(ids).logits) if args.hf else wrapped
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    times = []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not sharded):
            logits = step_fn(ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                    ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    result = {"rank": rank, "step_ms_median": 1e3 * statistics.median(times),
              "loss": float(loss), **peaks(torch, rank, args.allocator)}
    dist.destroy_process_group()
    return result


def tp_worker(args):
    """Megatron-style: rank r holds heads [r*H/2, (r+1)*H/2) and MLP columns of half the
    width; each row-parallel output is all-reduced in place (the buffer is the allocator's)."""
    torch, dist, rank = worker_setup(args)
    world = dist.get_world_size()
    F = torch.nn.functional
    h, heads, inter, vocab = args.hidden, args.heads, args.hidden * 8 // 3, args.vocab
    d = h // heads
    torch.manual_seed(0)  # every rank makes the full weights, then keeps its shard
    full = [{"qkv": torch.randn(3, heads, d, h) * h ** -0.5, "o": torch.randn(h, heads, d) * h ** -0.5,
             "gate": torch.randn(inter, h) * h ** -0.5, "up": torch.randn(inter, h) * h ** -0.5,
             "down": torch.randn(h, inter) * inter ** -0.5} for _ in range(args.layers)]
    embed = (torch.randn(vocab, h) * 0.02).cuda().to(torch.bfloat16)
    head_w = (torch.randn(vocab, h) * h ** -0.5).cuda().to(torch.bfloat16)
    hs, cs = heads // world, inter // world

    def shard(w, r):
        return {"qkv": w["qkv"][:, r * hs:(r + 1) * hs].reshape(3 * hs * d, h),
                "o": w["o"][:, r * hs:(r + 1) * hs].reshape(h, hs * d),
                "gate": w["gate"][r * cs:(r + 1) * cs], "up": w["up"][r * cs:(r + 1) * cs],
                "down": w["down"][:, r * cs:(r + 1) * cs]}

    def to_gpu(w):
        return {k: v.cuda().to(torch.bfloat16) for k, v in w.items()}

    mine = [to_gpu(shard(w, rank)) for w in full]
    whole = [to_gpu(shard(w, 0) if world == 1 else {
        "qkv": w["qkv"].reshape(3 * heads * d, h), "o": w["o"].reshape(h, heads * d),
        "gate": w["gate"], "up": w["up"], "down": w["down"]}) for w in full] if rank == 0 else None
    batch, steps, prompt = args.decode_batch, args.decode_steps, 16
    max_t = prompt + steps

    def run(weights, nh, reduce, forced=None):
        """Greedy decode; with `forced`, feeds those tokens instead of its own (so the
        one-GPU reference sees the same inputs as the tensor-parallel run)."""
        kc = [torch.zeros(batch, nh, max_t, d, device="cuda", dtype=torch.bfloat16) for _ in weights]
        vc = [torch.zeros_like(k) for k in kc]
        ids = torch.arange(batch * prompt, device="cuda").view(batch, prompt) % vocab
        out, times, tokens = [], [], []
        t0 = 0
        nxt = None
        for step in range(steps + 1):
            if step == 0:
                cur = ids
            else:
                cur = (forced[step - 1] if forced is not None else nxt)[:, None]
            t = cur.shape[1]
            torch.cuda.synchronize()
            start = time.perf_counter()
            x = embed[cur]
            for i, w in enumerate(weights):
                q, k, v = F.linear(x, w["qkv"]).view(batch, t, 3, nh, d).unbind(2)
                kc[i][:, :, t0:t0 + t] = k.transpose(1, 2)
                vc[i][:, :, t0:t0 + t] = v.transpose(1, 2)
                a = F.scaled_dot_product_attention(q.transpose(1, 2), kc[i][:, :, :t0 + t],
                                                   vc[i][:, :, :t0 + t], is_causal=step == 0)
                y = F.linear(a.transpose(1, 2).reshape(batch, t, nh * d), w["o"])
                reduce(y)
                x = x + y
                z = F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])
                reduce(z)
                x = x + z
            logits = F.linear(x[:, -1], head_w)
            nxt = logits.argmax(-1)
            torch.cuda.synchronize()
            if step > 0:
                times.append(time.perf_counter() - start)
            out.append(logits.float())
            tokens.append(nxt)
            t0 += t
        return torch.stack(out), times, tokens

    logits, times, tokens = run(mine, hs, lambda y: dist.all_reduce(y))
    result = {"rank": rank, "token_ms_median": 1e3 * statistics.median(times),
              **peaks(torch, rank, args.allocator)}
    if rank == 0:
        ref, _, _ = run(whole, heads, lambda y: None, forced=tokens)
        err = (logits - ref).abs().max().item()
        scale = ref.abs().max().item()
        result["max_abs_diff_vs_one_gpu"] = err
        result["greedy_tokens_equal"] = bool((logits.argmax(-1) == ref.argmax(-1)).all().item())
        result["logits_match"] = err <= 0.05 * scale
    dist.destroy_process_group()
    return result


def peer_copy_worker(args):
    """One process, both GPUs: copies of args.copy_mib between cuda:0 and cuda:1."""
    import torch
    if args.allocator == "gpumem":
        import gpumem.torch as gt
        gt.enable(args.conf)
    n = args.copy_mib * MiB
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    b = torch.empty(n, dtype=torch.uint8, device="cuda:1")

    def bandwidth(copy, sync):
        copy()
        sync()
        rates = []
        for _ in range(args.repeat_copies):
            sync()
            start = time.perf_counter()
            for _ in range(10):
                copy()
            sync()
            rates.append(10 * n / (time.perf_counter() - start) / 1e9)
        return statistics.median(rates)

    def sync():
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    result = {"allocator": args.allocator, "bytes": n,
              "can_access_peer": torch.cuda.can_device_access_peer(0, 1)}
    result["tensor_copy_0_to_1_gb_s"] = bandwidth(lambda: b.copy_(a, non_blocking=True), sync)
    result["bytes_equal"] = bool(torch.equal(a.cpu(), b.cpu()))
    b.fill_(7)
    result["tensor_copy_1_to_0_gb_s"] = bandwidth(lambda: a.copy_(b, non_blocking=True), sync)
    result["bytes_equal"] = result["bytes_equal"] and bool((a == 7).all().item())
    if args.allocator == "torch":
        result.update(cuda_memcpy_peer(torch, n, bandwidth))
    print("RESULT " + json.dumps(result), flush=True)


def cuda_memcpy_peer(torch, n, bandwidth):
    """Plain cudaMemcpyPeer between cudaMalloc'd buffers, through the runtime PyTorch loaded."""
    import ctypes
    import glob
    lib = None
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    base = os.path.dirname(torch.__file__)
    names += glob.glob(os.path.join(base, "..", "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        return {"cuda_memcpy_peer": "not measured: no libcudart could be loaded"}
    ptrs = []
    for dev in (0, 1):
        lib.cudaSetDevice(dev)
        p = ctypes.c_void_p()
        if lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)) != 0:
            return {"cuda_memcpy_peer": "not measured: cudaMalloc failed"}
        ptrs.append(p)
    lib.cudaSetDevice(0)
    lib.cudaDeviceEnablePeerAccess(1, 0)
    lib.cudaSetDevice(1)
    lib.cudaDeviceEnablePeerAccess(0, 0)
    lib.cudaGetLastError()

    def copy():
        lib.cudaMemcpyPeerAsync(ptrs[1], 1, ptrs[0], 0, ctypes.c_size_t(n), None)

    def sync():
        lib.cudaSetDevice(0)
        lib.cudaDeviceSynchronize()
        lib.cudaSetDevice(1)
        lib.cudaDeviceSynchronize()

    rate = bandwidth(copy, sync)
    for dev, p in zip((0, 1), ptrs):
        lib.cudaSetDevice(dev)
        lib.cudaFree(p)
    return {"cuda_memcpy_peer_0_to_1_gb_s": rate}


# --- the launcher ----------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(phase, allocator, args, world=2):
    """Runs `phase` on `world` ranks of this script; returns each rank's result dict."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", phase,
               "--allocator", allocator] + args.passthrough
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    deadline = time.monotonic() + args.timeout
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            err += "\n(killed after %d s)" % args.timeout
        found = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not found:
            results.append({"rank": rank, "error": "exit %d: %s" % (p.returncode, err.strip()[-2000:])})
        else:
            results.append(json.loads(found[-1]))
    return results


def median_over(runs, key):
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def compare(phase, args, world=2):
    runs = {"gpumem": [], "torch": []}
    for rep in range(args.repeats):
        order = ("gpumem", "torch") if rep % 2 == 0 else ("torch", "gpumem")
        for allocator in order:
            runs[allocator].append(launch(phase, allocator, args, world))
    for allocator, reps in runs.items():
        errors = [r["error"] for rep in reps for r in rep if "error" in r]
        per_rank = []
        for rank in range(world):
            ranks = [rep[rank] for rep in reps if "error" not in rep[rank]]
            summary = {"rank": rank}
            for key in ("step_ms_median", "token_ms_median", "peak_reserved", "peak_requested"):
                m = median_over(ranks, key)
                if m is not None:
                    summary[key] = m
            if ranks and "peak_requested" in summary and summary["peak_requested"]:
                summary["reserved_over_requested"] = summary["peak_reserved"] / summary["peak_requested"]
            for key in ("logits_match", "greedy_tokens_equal", "max_abs_diff_vs_one_gpu"):
                if ranks and key in ranks[-1]:
                    summary[key] = ranks[-1][key]
            per_rank.append(summary)
        emit(phase=phase, allocator=allocator, repeats=args.repeats, ranks=per_rank,
             errors=errors[:2], config=vars(args)["shape"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="ddp,fsdp,tp_decode,peer_copy")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--repeat-copies", type=int, default=5)
    ap.add_argument("--hf", action="store_true", help="transformers' LlamaForCausalLM when importable")
    ap.add_argument("--conf", default="", help="GPUMEM_CONF for the gpumem runs")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--allocator", default="gpumem", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        if args.worker == "peer_copy":
            return peer_copy_worker(args)
        fn = {"ddp": lambda: train_worker(args, False), "fsdp": lambda: train_worker(args, True),
              "tp_decode": lambda: tp_worker(args)}[args.worker]
        print("RESULT " + json.dumps(fn()), flush=True)
        return None

    try:
        import torch
    except ImportError:
        skip("no torch")
    if not torch.cuda.is_available():
        skip("no CUDA device")
    if torch.cuda.device_count() < 2:
        skip("%d GPU(s) visible; this script needs 2 (one rank per GPU)" % torch.cuda.device_count())
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_nccl_available():
        skip("torch has no NCCL backend")
    try:
        import gpumem
        gpumem.load()
    except OSError as e:
        skip("no gpumem plug-in (%s)" % e)
    args.shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch", "steps", "hf")}
    args.passthrough = []
    for name in ("--steps", "--warmup", "--layers", "--hidden", "--heads", "--vocab", "--seq",
                 "--batch", "--decode-batch", "--decode-steps", "--copy-mib", "--repeat-copies"):
        key = name[2:].replace("-", "_")
        args.passthrough += [name, str(getattr(args, key))]
    if args.hf:
        args.passthrough.append("--hf")
    args.passthrough += ["--conf", args.conf]
    emit(gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
         can_access_peer=torch.cuda.can_device_access_peer(0, 1), torch=torch.__version__,
         nccl=".".join(map(str, torch.cuda.nccl.version())))
    only = args.only.split(",")
    for phase in ("ddp", "fsdp", "tp_decode"):
        if phase in only:
            compare(phase, args)
    if "peer_copy" in only:
        peer_copy(args)
    return None


def peer_copy(args):
    def run(allocator, conf):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "peer_copy", "--allocator",
               allocator, "--copy-mib", str(args.copy_mib), "--repeat-copies",
               str(args.repeat_copies), "--conf", conf]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        found = [line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not found:
            return {"allocator": allocator, "conf": conf,
                    "error": "exit %d: %s" % (p.returncode, p.stderr.strip()[-1500:])}
        return json.loads(found[-1])
    with_peers = ",".join(x for x in (args.conf, "peer_access:all") if x)
    for rep in range(args.repeats):
        emit(phase="peer_copy", repeat=rep, **run("gpumem", with_peers))
        emit(phase="peer_copy", repeat=rep, **run("torch", ""))
    # Without peer_access: does a copy between the devices' VMM pages work at all?
    emit(phase="peer_copy_without_peer_access", **run("gpumem", args.conf))


if __name__ == "__main__":
    main()
