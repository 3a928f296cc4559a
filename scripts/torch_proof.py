#!/usr/bin/env python3
"""gpumem plugged into PyTorch on a real GPU, side by side with PyTorch's allocators.

Runs a Llama-shaped training loop and a generation loop (transformers LlamaForCausalLM from
a LlamaConfig, random weights, bf16) once per allocator mode, each in its own subprocess so
every mode starts from an empty device:

  native        PyTorch's caching allocator
  expandable    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  async         PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  gpumem        libgpumem_torch.so through CUDAPluggableAllocator (vmm_page_pool)

Per mode and workload: peak reserved, peak allocated (PyTorch modes: memory_stats();
gpumem: its own stats, peak reserved and peak live requested bytes), fragmentation = peak
reserved / peak allocated, and the median step time (training: one optimizer step;
generation: one decode step with the KV cache). The gpumem run also checks that a tensor
used on a second stream and freed (record_stream) is not reused under that stream's
kernel. Prints a table and writes JSON to $OUT/torch_proof.json (or --json).

  PYTHONPATH=python GPUMEM_LIB=build/src/interop/libgpumem_torch.so python3 scripts/torch_proof.py
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = {
    "native": {},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "gpumem": {},
}


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 128, max_position_embeddings=4096,
        use_cache=True)


def torch_peaks(torch):
    s = torch.cuda.memory_stats()
    return {
        "peak_reserved": s.get("reserved_bytes.all.peak"),
        "peak_allocated": s.get("allocated_bytes.all.peak"),
        "peak_requested": s.get("requested_bytes.all.peak"),
    }


def gpumem_peaks():
    import gpumem.torch

    s = gpumem.torch.stats(0)
    return {
        "peak_reserved": s["peak_reserved_bytes"],
        "peak_allocated": s["peak_live_bytes"],  # requested bytes: gpumem does not round
        "peak_requested": s["peak_live_bytes"],
        "gpumem": s,
    }


def stream_check(torch):
    """A tensor read on a side stream, freed on its allocation stream after record_stream:
    the next allocation on that stream must not overwrite it before the side stream read it."""
    n = 64 << 20  # 256 MiB of float32
    side = torch.cuda.Stream()
    results = {}
    for recorded in (True, False):
        x = torch.full((n,), 1.0, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s: the read below runs late
            y = x * 2
        if recorded:
            x.record_stream(side)
        x_ptr = x.data_ptr()
        del x
        z = torch.full((n,), 5.0, device="cuda")  # may take x's block on this stream
        torch.cuda.synchronize()
        results["recorded" if recorded else "not_recorded"] = {
            "y_correct": bool((y == 2).all().item()),
            "z_reused_block": z.data_ptr() == x_ptr,
        }
        del y, z
    return results


def snapshot_check(torch):
    """gpumem.torch.snapshot() at the training peak's end, read back with torch's own tools."""
    import pickle

    import gpumem.torch
    from torch.cuda import _memory_viz

    path = os.path.join(os.environ.get("OUT", "."), "gpumem_train_snapshot.pickle")
    try:
        gpumem.torch.snapshot(path)
        with open(path, "rb") as f:
            data = pickle.load(f)
        summary = _memory_viz.segsum(data)
        return {"path": path, "bytes": os.path.getsize(path), "segments": len(data["segments"]),
                "segsum_head": summary.splitlines()[:3]}
    except Exception as e:  # reported, not fatal: the allocator figures still count
        return {"error": "%s: %s" % (type(e).__name__, e)}


def worker(args):
    mode = args.worker
    import torch

    info = {"mode": mode, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    if mode == "gpumem":
        import gpumem
        import gpumem.torch

        gpumem.torch.enable(args.gpumem_conf,
                            mark_steps="optimizer" if args.mark_steps == "optimizer" else None)
        info["gpumem_conf"] = args.gpumem_conf or ""
        info["gpumem_library"] = gpumem.library_path()
        info["record_stream_mode"] = gpumem.torch.record_stream_mode()
        info["gpumem_version"] = gpumem.version()
    peaks = gpumem_peaks if mode == "gpumem" else (lambda: torch_peaks(torch))

    def counters():
        if mode != "gpumem":
            return {}
        import gpumem.torch

        return gpumem.torch.counters(0)

    mark_step = None
    if mode == "gpumem" and args.mark_steps == "top":
        import gpumem.torch

        mark_step = gpumem.torch.mark_step
    info["mark_steps"] = args.mark_steps if mode == "gpumem" else "none"
    info["zero_grad_first"] = bool(args.zero_grad_first)
    info["eval_every"] = args.eval_every
    start_counters = {}
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    info["torch"] = torch.__version__
    info["device"] = torch.cuda.get_device_name(0)
    cfg = llama_config(args)
    phase = args.phase

    if phase == "train":
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
        eval_ids = torch.randint(0, cfg.vocab_size, (max(1, args.batch // 2), args.seq),
                                 device="cuda")
        times = []
        for step in range(args.steps):
            if step == 2:
                start_counters = counters()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if mark_step is not None:
                mark_step()  # timed with the step: its cost is the step's
            if args.zero_grad_first:
                opt.zero_grad(set_to_none=True)  # the other common loop: gradients cross the mark
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            if not args.zero_grad_first:
                opt.zero_grad(set_to_none=True)
            if args.eval_every and step % args.eval_every == args.eval_every - 1:
                # An evaluation pass of other shapes inside this step: a step unlike the
                # others (a step plan is left, and taken again after).
                with torch.no_grad():
                    model(input_ids=eval_ids)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        info["loss"] = float(loss.item())
        warm = times[2:] if len(times) > 4 else times
    else:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
        model.eval()
        times = []
        with torch.no_grad():
            for rep in range(args.gen_reps):
                ids = torch.randint(0, cfg.vocab_size, (args.gen_batch, args.prompt),
                                    device="cuda")
                out = model(input_ids=ids, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
                del out
                for i in range(args.new_tokens):
                    if rep == 0 and i == 8:
                        start_counters = counters()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    nxt = out.logits[:, -1:].argmax(-1)
                    del out
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                del past, nxt, ids
        warm = times[8:] if len(times) > 16 else times
    info["steps"] = len(times)
    info["step_times_ms"] = [round(x * 1e3, 2) for x in times]
    info["median_step_s"] = statistics.median(warm)
    info["mean_step_s"] = statistics.fmean(warm)
    info.update(peaks())
    if mode == "gpumem":
        end = counters()
        info["counters"] = end
        info["counters_timed_steps"] = {k: v - start_counters.get(k, 0) for k, v in end.items()}
    free, total = torch.cuda.mem_get_info()
    info["device_used_end"] = total - free
    if mode == "gpumem" and phase == "train":
        info["snapshot"] = snapshot_check(torch)
        del model, opt
        info["stream_check"] = stream_check(torch)
        import gpumem.torch

        info["stream_check"]["cross_stream_waits"] = gpumem.torch.stats(0)["cross_stream_waits"]

        info["plugin_failures"] = gpumem.torch.failures()
    with open(args.result, "w") as f:
        json.dump(info, f)


def fmt_gib(b):
    return "-" if b is None else "%.2f" % (b / 2**30)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="native,expandable,async,gpumem")
    p.add_argument("--phases", default="train,generate")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gen-batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--gen-reps", type=int, default=1)
    p.add_argument("--timeout", type=int, default=150, help="seconds per subprocess")
    p.add_argument("--gpumem-conf", default=None, help="GPUMEM_CONF for the gpumem mode")
    p.add_argument("--eval-every", type=int, default=0,
                   help="train: every N steps, also an evaluation forward of half the batch "
                        "inside the step (0: never)")
    p.add_argument("--zero-grad-first", action="store_true",
                   help="train: zero the gradients at the top of the step (after the mark) "
                        "rather than at its end")
    p.add_argument("--mark-steps", choices=["none", "top", "optimizer"], default="none",
                   help="gpumem mode: mark training steps for step plans: 'top' calls "
                        "gpumem.torch.mark_step() at the top of each step, 'optimizer' lets "
                        "gpumem.torch.enable(mark_steps='optimizer') mark after each "
                        "optimizer step (no change to the loop)")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    out_dir = os.environ.get("OUT", ".")
    json_path = args.json or os.path.join(out_dir, "torch_proof.json")
    report = {"date": time.strftime("%Y-%m-%d"), "workload": {
        k: getattr(args, k) for k in ("hidden", "layers", "batch", "seq", "steps", "gen_batch",
                                      "prompt", "new_tokens", "gen_reps")}, "runs": []}
    # The workload's options, passed on to each worker subprocess.
    worker_args = []
    for key in ("hidden", "layers", "batch", "seq", "steps", "gen_batch", "prompt",
                "new_tokens", "gen_reps"):
        worker_args += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    if args.gpumem_conf:
        worker_args += ["--gpumem-conf", args.gpumem_conf]
    worker_args += ["--mark-steps", args.mark_steps]
    if args.zero_grad_first:
        worker_args += ["--zero-grad-first"]
    if args.eval_every:
        worker_args += ["--eval-every", str(args.eval_every)]
    for phase in args.phases.split(","):
        for mode in args.modes.split(","):
            env = dict(os.environ)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            env.update(MODES[mode])
            env["PYTHONUNBUFFERED"] = "1"
            result = os.path.join(out_dir, "proof_%s_%s.tmp.json" % (phase, mode))
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--phase", phase,
                   "--result", result] + worker_args
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True,
                                      text=True)
                ok = proc.returncode == 0 and os.path.exists(result)
                run = json.load(open(result)) if ok else {
                    "mode": mode, "error": "rc %d: %s" % (proc.returncode, proc.stderr[-3000:])}
                if proc.stderr and "gpumem_torch" in proc.stderr:
                    run["plugin_stderr"] = proc.stderr[-2000:]
            except subprocess.TimeoutExpired:
                run = {"mode": mode, "error": "timed out after %d s" % args.timeout}
            if os.path.exists(result):
                os.remove(result)
            run["phase"] = phase
            run["wall_s"] = round(time.time() - t0, 1)
            report["runs"].append(run)
            print("%s/%s: %s" % (phase, mode, json.dumps(run)[:600]), flush=True)
            with open(json_path, "w") as f:  # partial results survive a later failure
                json.dump(report, f, indent=1)

    native = {r["phase"]: r for r in report["runs"] if r.get("mode") == "native" and "error" not in r}
    print("\n%-9s %-11s %10s %10s %10s %8s %8s %11s %8s" % (
        "phase", "mode", "peak_res", "peak_alloc", "peak_req", "frag", "frag_req",
        "median_ms", "vs_nat"))
    for r in report["runs"]:
        if "error" in r:
            print("%-9s %-11s ERROR %s" % (r["phase"], r["mode"], r["error"][:200]))
            continue
        res, alloc, req = r["peak_reserved"], r["peak_allocated"], r["peak_requested"]
        r["fragmentation"] = res / alloc if res and alloc else None
        r["fragmentation_requested"] = res / req if res and req else None
        base = native.get(r["phase"])
        r["step_vs_native"] = r["median_step_s"] / base["median_step_s"] if base else None
        print("%-9s %-11s %10s %10s %10s %8s %8s %11.2f %8s" % (
            r["phase"], r["mode"], fmt_gib(res), fmt_gib(alloc), fmt_gib(req),
            "%.4f" % r["fragmentation"] if r["fragmentation"] else "-",
            "%.4f" % r["fragmentation_requested"] if r["fragmentation_requested"] else "-",
            r["median_step_s"] * 1e3,
            "%.4f" % r["step_vs_native"] if r["step_vs_native"] else "-"))
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    print("\nJSON: %s" % json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
