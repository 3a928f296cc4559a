#!/usr/bin/env python3
"""The KV cache's measurements on a GPU (issue: the KV cache serves real models), one JSON
object a line on stdout (and appended to --out):

  hf_generate   transformers generate on a random-weight Llama-shaped model, batch x prompt,
                256 new tokens, greedy: tokens/s and memory for DynamicCache, StaticCache
                (cache_implementation="static", compile disabled), GpumemCache (gathered
                attention) and GpumemCache with the paged Triton attention. Memory:
                torch_peak_above_weights (PyTorch's peak allocated during generate minus
                before it: activations, logits and, for DynamicCache / StaticCache, the KV
                tensors), kv_held_end (DynamicCache / StaticCache: PyTorch's allocated bytes
                still held with the cache after generate; gpumem: mapped bytes), gpumem_kv_peak
                (the cache's peak mapped bytes, outside PyTorch's counters), live_kv_bytes
                (batch x final length x bytes per token: what the KV must hold) and
                kv_over_live (KV memory / live_kv_bytes).
  decode_attention  one decode step's attention: gpumem.kv_attention.paged_decode through
                the block table against SDPA on the same keys and values held dense
                (contiguous [batch, kv_heads, length, head_dim], enable_gqa), CUDA events,
                median of --iters.
  serve         examples/serve_llama.py: the paged engine against the contiguous one on one
                budget (peak concurrency, tokens/s, TTFT, prefix hit rate, KV held), and
                `gpumem serve-sim` for the same workload when $GPUMEM_CLI names the CLI.

Default sizes fit in about three minutes on an H200; --full runs batch {1, 8, 32} x
prompt {128, 1024, 4096}.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import torch  # noqa: E402

OUT = None


def emit(row):
    line = json.dumps(row)
    print(line, flush=True)
    if OUT:
        with open(OUT, "a") as f:
            f.write(line + "\n")


def llama(layers, hidden, heads, kv_heads, intermediate, vocab, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=8192)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.disable_compile = True  # StaticCache: no torch.compile here
    return model


def bench_hf(a):
    import gpumem.hf as ghf
    from transformers import DynamicCache
    # StaticCache makes generate compile the forward (minutes per shape): every cache is
    # measured eager, the same way.
    try:
        import torch._dynamo
        torch._dynamo.config.disable = True
    except Exception:
        pass
    model = llama(a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.vocab)
    head_dim = a.hidden // a.heads
    bytes_per_token = a.layers * 2 * a.kv_heads * head_dim * 2
    paged_name = ghf.register_paged_attention()
    default_attn = model.config._attn_implementation

    def set_attn(name):
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(name)
        else:
            model.config._attn_implementation = name

    grid = [(b, p) for b in (1, 8, 32) for p in (128, 1024, 4096)] if a.full else \
        [(1, 128), (1, 4096), (8, 1024), (32, 128), (32, 4096)]
    if a.hf_points:
        grid = [tuple(int(x) for x in point.split("x")) for point in a.hf_points.split(",")]
    kinds = ["dynamic", "static", "gpumem", "gpumem_paged", "gpumem_contiguous"]

    def run(kind, batch, prompt, new):
        ids = torch.randint(3, a.vocab - 1, (batch, prompt), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(batch * prompt))
        mask = torch.ones_like(ids)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        cache = None
        if kind == "dynamic":
            cache = DynamicCache()
            kw["past_key_values"] = cache
        elif kind == "static":
            kw["cache_implementation"] = "static"
        else:
            cache = ghf.GpumemCache(model.config, attention={
                "gpumem": "gather", "gpumem_paged": "paged",
                "gpumem_contiguous": "contiguous"}[kind])
            kw["past_key_values"] = cache
        set_attn(paged_name if kind == "gpumem_paged" else default_attn)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - before
        held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        row = {"bench": "hf_generate", "cache": kind, "batch": batch, "prompt": prompt,
               "new_tokens": out.shape[1] - prompt, "seconds": round(seconds, 4),
               "tokens_per_s": round(batch * (out.shape[1] - prompt) / seconds, 1),
               "torch_peak_above_weights": peak,
               "live_kv_bytes": batch * (out.shape[1] - 1) * bytes_per_token}
        if isinstance(cache, ghf.GpumemCache):
            mem = cache.memory()
            row["gpumem_kv_peak"] = mem["peak_mapped_bytes"]
            row["kv_held_end"] = mem["mapped_bytes"]
            row["kv_over_live"] = round(mem["peak_mapped_bytes"] / row["live_kv_bytes"], 4)
            if cache.kv_cache is not None:
                row["cow_copies"] = cache.kv_cache.stats()["cow_copies"]
            if kind == "gpumem_paged":
                row["decode_layers_paged"] = cache.decode_layers_paged
                row["decode_layers_gathered"] = cache.decode_layers_gathered
            kv = cache.kv_cache
            cache.release()
            if kv is not None:
                kv.close()
        else:
            row["kv_held_end"] = held
            row["kv_over_live"] = round(held / row["live_kv_bytes"], 4)
        if getattr(model, "_cache", None) is not None:
            model._cache = None  # generate keeps a static cache for its next call
        del out, cache
        gc.collect()
        torch.cuda.empty_cache()
        return row

    for kind in kinds:  # warm-up: Triton compiles, cuBLAS heuristics
        run(kind, 2, 64, 8)
    set_attn(default_attn)
    for batch, prompt in grid:
        # The first generate at a shape pays for what is built per shape (cuDNN attention
        # plans for each new key length and key strides): untimed runs first, one for each
        # kind of key tensor (contiguous as DynamicCache's; the contiguous cache's strided
        # views), so no cache kind pays it in a timed run.
        run("dynamic", batch, prompt, a.new_tokens)
        run("gpumem_contiguous", batch, prompt, a.new_tokens)
        for repeat in range(a.hf_repeats):
            # Sides alternate: each repeat runs the caches in the reverse order of the last.
            for kind in (kinds if repeat % 2 == 0 else kinds[::-1]):
                try:
                    row = run(kind, batch, prompt, a.new_tokens)
                    row["repeat"] = repeat
                    emit(row)
                except Exception as e:  # one failure must not hide the other rows
                    emit({"bench": "hf_generate", "cache": kind, "batch": batch,
                          "prompt": prompt, "error": "%s: %s" % (type(e).__name__, str(e)[:400])})
                    torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()


def bench_attention(a):
    import torch.nn.functional as F
    import gpumem.kv as gkv
    from gpumem.kv_attention import gather_kv, paged_decode
    q_heads, kv_heads, head_dim = 32, 8, 128
    for batch, length in [(1, 4096), (8, 4096), (32, 1024), (32, 4096), (8, 16384)]:
        cache = gkv.KVCache(layers=1, kv_heads=kv_heads, head_dim=head_dim, dtype="bf16",
                            max_blocks=batch * (length // 16 + 1) + 16, prefix_caching=False,
                            stream=torch.cuda.current_stream().cuda_stream)
        # Interleaved sequences: their blocks alternate, as in a running server.
        seqs = [cache.add_sequence([])[0] for _ in range(batch)]
        for _ in range(length // 16):
            for s in seqs:
                cache.append(s, [0] * 16)
        k, v = cache.layer_views(0)
        table, lengths = cache.block_tables(seqs).tensors("cuda")
        # Only blocks named by a table are mapped: never touch the whole view.
        used = table.long().flatten()
        k[used] = torch.randn((used.numel(),) + tuple(k.shape[1:]), device="cuda",
                              dtype=k.dtype)
        v[used] = torch.randn_like(k[used])
        q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        kd, vd = gather_kv(k, v, table, length)  # dense [batch, kv_heads, length, D]
        kd, vd = kd.contiguous(), vd.contiguous()
        qd = q.unsqueeze(2)

        def timed(fn):
            for _ in range(5):
                fn()
            times = []
            for _ in range(a.iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) * 1000.0)
            return statistics.median(times)

        def graphed(fn, calls=20):
            """Device time per call with the launch cost taken out, as a server that
            replays its decode step as a CUDA graph sees it: `calls` calls captured in
            one graph, the replay timed."""
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls):
                    fn()
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(a.iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                g.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) * 1000.0 / calls)
            del g
            return statistics.median(times)

        paged_fn = lambda: paged_decode(q, k, v, (table, lengths), lengths_max=length)  # noqa: E731
        dense_fn = lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)  # noqa: E731
        # Sides alternate: paged, dense, dense, paged; each side's figure is the mean of
        # its two medians.
        p1, d1, d2, p2 = timed(paged_fn), timed(dense_fn), timed(dense_fn), timed(paged_fn)
        paged_us, dense_us = (p1 + p2) / 2, (d1 + d2) / 2
        gp1, gd1, gd2, gp2 = graphed(paged_fn), graphed(dense_fn), graphed(dense_fn), graphed(paged_fn)
        paged_graph_us, dense_graph_us = (gp1 + gp2) / 2, (gd1 + gd2) / 2
        out = paged_decode(q, k, v, (table, lengths), lengths_max=length)
        ref = F.scaled_dot_product_attention(qd.float(), kd.float(), vd.float(),
                                             enable_gqa=True)[:, :, 0]
        emit({"bench": "decode_attention", "batch": batch, "context": length,
              "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": "bf16",
              "paged_us": round(paged_us, 2), "dense_sdpa_us": round(dense_us, 2),
              "paged_over_dense": round(paged_us / dense_us, 3),
              "paged_spread_us": [round(p1, 2), round(p2, 2)],
              "dense_spread_us": [round(d1, 2), round(d2, 2)],
              "paged_graph_us": round(paged_graph_us, 2),
              "dense_graph_us": round(dense_graph_us, 2),
              "graph_paged_over_dense": round(paged_graph_us / dense_graph_us, 3),
              "graph_spread_us": [round(gp1, 2), round(gp2, 2), round(gd1, 2), round(gd2, 2)],
              "max_abs_err": round((out.float() - ref).abs().max().item(), 5)})
        cache.close()
        del k, v, kd, vd
        gc.collect()
        torch.cuda.empty_cache()


def bench_virtual(a):
    """Virtually contiguous sequences (token-major): memory held against live bytes for
    sequences of chat-like lengths, and SDPA reading a sequence's strided per-layer view
    against the same keys and values copied contiguous."""
    import random
    import torch.nn.functional as F
    import gpumem.kv as gkv
    layers, kv_heads, head_dim = 32, 8, 128
    rng = random.Random(3)
    vs = gkv.VirtualSequences(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype="bf16",
                              max_sequence_tokens=8192)
    lengths = [int(min(8000, max(4, rng.lognormvariate(6.0, 1.0)))) for _ in range(64)]
    seqs = [vs.add(n) for n in lengths]
    info = vs.info()
    per_layer_pages = sum(layers * -(-n * kv_heads * head_dim * 2 * 2 // info["page_size"])
                          for n in lengths) * info["page_size"]
    emit({"bench": "virtual_memory", "sequences": len(seqs), "live_bytes": info["live_bytes"],
          "mapped_bytes": info["mapped_bytes"],
          "mapped_over_live": round(info["mapped_bytes"] / info["live_bytes"], 4),
          "per_layer_layout_bytes": per_layer_pages,
          "per_layer_over_live": round(per_layer_pages / info["live_bytes"], 4)})
    for s in seqs:
        vs.free(s)
    for length in (1024, 8000):
        seq = vs.add(length)
        k, v = vs.views(seq, 5)
        k.normal_()
        v.normal_()
        ks, vv = vs.sdpa_views(seq, 5)
        kd, vd = ks.contiguous(), vv.contiguous()
        q = torch.randn(1, 32, 1, head_dim, device="cuda", dtype=torch.bfloat16)

        def timed(fn):
            for _ in range(5):
                fn()
            times = []
            for _ in range(a.iters):
                st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                st.record()
                fn()
                en.record()
                en.synchronize()
                times.append(st.elapsed_time(en) * 1000.0)
            return statistics.median(times)

        strided = timed(lambda: F.scaled_dot_product_attention(q, ks, vv, enable_gqa=True))
        dense = timed(lambda: F.scaled_dot_product_attention(q, kd, vd, enable_gqa=True))
        emit({"bench": "virtual_attention", "context": length, "strided_sdpa_us": round(strided, 2),
              "dense_sdpa_us": round(dense, 2), "strided_over_dense": round(strided / dense, 3)})
        del k, v, ks, vv, kd, vd
        gc.collect()
        vs.free(seq)
    vs.close()


def bench_serve(a):
    import serve_llama
    import tempfile
    workload = os.path.join(tempfile.mkdtemp(prefix="gpumem_serve_"), "workload.txt")
    args = ["--mode", "both", "--json", "--requests", str(a.serve_requests), "--rate",
            str(a.serve_rate), "--budget", a.serve_budget, "--duration", str(a.serve_duration),
            "--workload-out", workload]
    rows = []
    import io
    import contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        serve_llama.main(args)
    sim_cmd = None
    for line in buf.getvalue().splitlines():
        row = json.loads(line)
        if "simulator_command" in row:
            sim_cmd = row["simulator_command"]
            continue
        row["bench"] = "serve"
        rows.append(row)
        emit(row)
    by = {r["mode"]: r for r in rows}
    if "paged" in by and "contiguous" in by and by["contiguous"]["peak_concurrent"]:
        emit({"bench": "serve_ratio",
              "concurrency_ratio": round(by["paged"]["peak_concurrent"] /
                                         by["contiguous"]["peak_concurrent"], 3),
              "tokens_per_s_ratio": round(by["paged"]["tokens_per_s"] /
                                          max(1e-9, by["contiguous"]["tokens_per_s"]), 3)})
    cli = os.environ.get("GPUMEM_CLI")
    if cli and sim_cmd:
        cmd = [cli] + sim_cmd.split()[1:]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            row = {"bench": "serve_sim", "command": " ".join(cmd), "rc": res.returncode}
            if res.returncode == 0:
                sim = json.loads(res.stdout)[0]
                row["sim_prefix_hit_rate"] = round(sim["prefix_hit_rate"], 4)
                row["sim_completed"] = sim["completed"]
                if "paged" in by and sim["prefix_hit_rate"]:
                    # The engine's hit rate over the simulator's, for the same requests.
                    row["engine_prefix_hit_rate"] = by["paged"]["prefix_hit_rate"]
                    row["engine_over_sim"] = round(by["paged"]["prefix_hit_rate"] /
                                                   sim["prefix_hit_rate"], 4)
            else:
                row["output"] = (res.stdout + res.stderr).strip()[-2000:]
            emit(row)
        except Exception as e:
            emit({"bench": "serve_sim", "error": str(e)})


def main():
    global OUT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["hf", "attention", "virtual", "serve"], action="append")
    p.add_argument("--full", action="store_true", help="the whole batch x prompt grid")
    p.add_argument("--out", help="also append the JSON lines to this file")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--hf-repeats", type=int, default=1,
                   help="runs of every cache at each HF point, sides alternating")
    p.add_argument("--hf-points", help="batch x prompt points of the HF bench, e.g. 8x1024,32x128")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--serve-requests", type=int, default=400)
    p.add_argument("--serve-rate", type=float, default=200.0)
    p.add_argument("--serve-budget", default="2G")
    p.add_argument("--serve-duration", type=float, default=40.0)
    a = p.parse_args()
    OUT = a.out
    if not torch.cuda.is_available():
        print("kv-gpu-bench: needs a CUDA device", file=sys.stderr)
        return 2
    import transformers
    emit({"bench": "info", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                          time.gmtime())})
    only = a.only or ["attention", "virtual", "hf", "serve"]
    for part, fn in (("attention", bench_attention), ("virtual", bench_virtual),
                     ("hf", bench_hf), ("serve", bench_serve)):
        if part in only:
            t0 = time.perf_counter()
            try:
                fn(a)
            except Exception as e:
                import traceback
                traceback.print_exc()
                emit({"bench": part, "error": "%s: %s" % (type(e).__name__, str(e)[:400])})
            emit({"bench": part + "_done", "seconds": round(time.perf_counter() - t0, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
