#!/usr/bin/env python3
"""The largest batch that trains under one memory cap, per allocator, and the samples/s at
each allocator's own largest batch.

For each training workload and allocator, a bisection (scripts/batch_search.py) runs trials,
each a fresh process: the workload built at that batch and trained for --steps steps
(forward, backward, AdamW step), shapes varying from step to step as the workload says.
Every side gets the same cap, in bytes:
  native      PyTorch's caching allocator, torch.cuda.set_per_process_memory_fraction
  expandable  the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  gpumem      gpumem.torch.enable("limit:BYTES"): the pool's hard cap, which is also its
              budget (footprint:fast is a cache up to the budget and gathers free pages
              past it); set_per_process_memory_fraction is called as well
Then each allocator's largest batch is run once more, timed: one warm cycle of the
workload's shapes, then --timed-cycles cycles; samples/s is the median over cycles.

Workloads:
  llama_ckpt   a Llama-shaped model (transformers LlamaForCausalLM from a config, random
               weights, bf16, 1536 hidden, 12 layers) fine-tuned with activation
               checkpointing; sequence length 512, 320, 448, 384 in turn
  vit_varres   a ViT (plain torch: 16x16 patches, 768 wide, 8 layers) trained under bf16
               autocast on images of side 224, 160, 288, 256 in turn
  fsdp_stack   FSDP-style on one GPU: ten layers, each one flat fp32 buffer gathered into a
               bf16 copy before it runs and freed after (again in backward, checkpointed);
               sequence length 1024, 512, 768, 256 in turn

Usage (GPU machine, torch and transformers installed; GPUMEM_LIB naming libgpumem_torch.so
and PYTHONPATH the package, as scripts/torch-compare.sh sets them):
  max_batch.py (--cap-gib G | --fraction F) [--out DIR] [--workloads a,b] [--allocators a,b]
               [--jobs N] [--steps N] [--timed-cycles N] [--trial-timeout S] [--max-batch N]
               [--tolerance T] [--gpumem-conf CONF]
Writes DIR/max_batch.json, DIR/max_batch.md (the table) and DIR/trials.log (every trial).
A trial's exit status: 0 it fitted, 86 out of memory; any other is an error, reported and
never counted as out of memory."""

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import batch_search  # noqa: E402

ALLOCATORS = ("native", "expandable", "gpumem")
GIB = 1 << 30


# --- workloads (built in the trial process; torch is imported there only) -----------------

def llama_ckpt(torch, batch):
    import record_workloads

    model = record_workloads.bf16_llama_on_gpu(torch, 1536, 12)
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    seqs = (512, 320, 448, 384)

    def step(i):
        ids = torch.randint(0, 32000, (batch, seqs[i % len(seqs)]), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, len(seqs)


def vit_varres(torch, batch):
    import record_workloads

    params, vit = record_workloads.vit_encoder(torch)
    opt = torch.optim.AdamW(params, lr=1e-4)
    sides = (224, 160, 288, 256)

    def step(i):
        side = sides[i % len(sides)]
        x = torch.randn(batch, 3, side, side, device="cuda")
        y = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(vit(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, len(sides)


def fsdp_stack(torch, batch):
    import record_workloads

    flats, stack = record_workloads.fsdp_stack(torch)
    opt = torch.optim.AdamW(flats, lr=1e-4)
    seqs = (1024, 512, 768, 256)

    def step(i):
        x = torch.randn(batch, seqs[i % len(seqs)], record_workloads.FSDP_WIDTH, device="cuda",
                        dtype=torch.bfloat16)
        stack(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, len(seqs)


# name -> (builder, the batch the search starts from under a 12 GiB cap)
WORKLOADS = {"llama_ckpt": (llama_ckpt, 16), "vit_varres": (vit_varres, 128),
             "fsdp_stack": (fsdp_stack, 16)}


# --- the trial: one process, one workload, one batch ---------------------------------------

def is_out_of_memory(torch, error):
    """PyTorch's out-of-memory error, or gpumem's where the plug-in was built without torch
    (a RuntimeError whose text starts as PyTorch's does). Nothing else is."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(error, oom_type):
        return True
    return isinstance(error, RuntimeError) and str(error).startswith("CUDA out of memory")


def trial_main(a):
    import torch

    if a.allocator == "gpumem":
        import gpumem.torch

        gpumem.torch.enable(gpumem_conf(a.cap_bytes, a.gpumem_conf))
    total = torch.cuda.mem_get_info(0)[1]
    try:
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_bytes / total), 0)
    except RuntimeError as e:
        if a.allocator != "gpumem":
            raise
        # The pluggable route may refuse the fraction; the pool's limit holds the cap.
        sys.stderr.write("set_per_process_memory_fraction under gpumem: %s\n" % e)
    build, _ = WORKLOADS[a.workload]
    cycle_s, t_cycle, done = [], None, 0
    try:
        torch.manual_seed(0)
        step, cycle = build(torch, a.batch)
        steps = a.steps if not a.timed_cycles else cycle * (1 + a.timed_cycles)
        for i in range(steps):
            if a.timed_cycles and i % cycle == 0:
                torch.cuda.synchronize()
                now = time.perf_counter()
                if i >= 2 * cycle:  # the first cycle warms up
                    cycle_s.append(now - t_cycle)
                t_cycle = now
            step(i)
            done += 1
        torch.cuda.synchronize()
        if a.timed_cycles:
            cycle_s.append(time.perf_counter() - t_cycle)
    except Exception as e:  # pylint: disable=broad-except
        if not is_out_of_memory(torch, e):
            raise
        sys.stderr.write("out of memory at step %d: %s\n" % (done, str(e).splitlines()[0]))
        print(json.dumps({"workload": a.workload, "allocator": a.allocator, "batch": a.batch,
                          "fits": False, "steps_done": done}), flush=True)
        return batch_search.OOM_EXIT
    import torch_compare

    mode, reserved, requested = torch_compare.stats()
    r = {"workload": a.workload, "allocator": a.allocator, "mode": mode, "batch": a.batch,
         "fits": True, "steps": done, "cap_bytes": a.cap_bytes, "peak_reserved": reserved,
         "peak_requested": requested}
    if cycle_s:
        per_cycle = [a.batch * cycle / s for s in cycle_s]
        r.update(cycle_s=[round(s, 4) for s in cycle_s],
                 samples_per_s=round(statistics.median(per_cycle), 2),
                 samples_per_s_min=round(min(per_cycle), 2),
                 samples_per_s_max=round(max(per_cycle), 2))
    print(json.dumps(r), flush=True)
    return 0


def probe_main(_a):
    import torch

    print(json.dumps({"total_bytes": torch.cuda.mem_get_info(0)[1],
                      "device": torch.cuda.get_device_name(0), "torch": torch.__version__}))
    return 0


# --- the driver (no torch) ------------------------------------------------------------------

def gpumem_conf(cap_bytes, extra=""):
    """gpumem's configuration for a cap: its hard limit (and so its budget), then any extra
    keys (a later key wins)."""
    conf = "limit:%d" % cap_bytes
    return conf + ("," + extra if extra else "")


def trial_environment(allocator, base=None):
    """The environment of a trial process: PYTORCH_CUDA_ALLOC_CONF is
    expandable_segments:True for expandable and absent otherwise (a setting inherited from
    the caller would change the native side); gpumem's own settings come from the trial's
    --gpumem-conf, so GPUMEM_CONF and GPUMEM_ENABLE are dropped for every side."""
    if allocator not in ALLOCATORS:
        raise ValueError("max_batch: unknown allocator %r (known: %s)"
                         % (allocator, ", ".join(ALLOCATORS)))
    env = dict(os.environ if base is None else base)
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "GPUMEM_CONF", "GPUMEM_ENABLE"):
        env.pop(key, None)
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def trial_command(python, workload, allocator, batch, cap_bytes, steps, timed_cycles=0,
                  extra_conf=""):
    argv = [python, os.path.join(HERE, "max_batch.py"), "trial", workload, str(batch),
            "--allocator", allocator, "--cap-bytes", str(cap_bytes), "--steps", str(steps),
            "--timed-cycles", str(timed_cycles)]
    return argv + (["--gpumem-conf", extra_conf] if extra_conf else [])


def start_batch(workload, cap_bytes):
    """Where the search starts: the workload's batch for 12 GiB, scaled to the cap."""
    return max(1, int(WORKLOADS[workload][1] * cap_bytes / (12 * GIB)))


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def summarize(results, allocators):
    """Rows of the table: each result gains ratio_vs_native, ratio_vs_expandable (largest
    batch) and samples_ratio (samples/s over native's, each at its own largest batch)."""
    by = {(r["workload"], r["allocator"]): r for r in results}
    rows = []
    for r in results:
        native = by.get((r["workload"], "native"), {})
        expandable = by.get((r["workload"], "expandable"), {})
        row = dict(r)
        row["ratio_vs_native"] = ratio(r.get("max_batch"), native.get("max_batch"))
        row["ratio_vs_expandable"] = ratio(r.get("max_batch"), expandable.get("max_batch"))
        row["samples_ratio"] = ratio(r.get("samples_per_s"), native.get("samples_per_s"))
        rows.append(row)
    order = {a: i for i, a in enumerate(allocators)}
    rows.sort(key=lambda x: (x["workload"], order.get(x["allocator"], len(order))))
    return rows


def markdown(rows, cap_bytes):
    def cell(v, fmt="%s"):
        return "n/a" if v is None else fmt % v

    lines = ["Cap: %.2f GiB for every allocator." % (cap_bytes / GIB), "",
             "| workload | allocator | max batch | ratio vs native | ratio vs expandable "
             "| samples/s | ratio |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        batch = r.get("max_batch")
        if r.get("error"):
            shown = "error"
        elif r.get("capped"):
            shown = "≥ %d" % batch
        else:
            shown = cell(batch)
        lines.append("| %s | %s | %s | %s | %s | %s | %s |" % (
            r["workload"], r["allocator"], shown, cell(r["ratio_vs_native"], "%.2f×"),
            cell(r["ratio_vs_expandable"], "%.2f×"), cell(r.get("samples_per_s"), "%.1f"),
            cell(r["samples_ratio"], "%.2f×")))
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines.append("")
        lines += ["- %s / %s: %s" % (r["workload"], r["allocator"],
                                     r["error"].splitlines()[0]) for r in errors]
    return "\n".join(lines) + "\n"


class trial_log:
    """trials.log: one line a trial (time, workload, allocator, batch, outcome)."""

    def __init__(self, path):
        self.lock, self.f = threading.Lock(), open(path, "a", encoding="utf-8")

    def write(self, line):
        with self.lock:
            self.f.write("%s %s\n" % (time.strftime("%H:%M:%S"), line))
            self.f.flush()


def search_one(a, workload, allocator, log):
    def on_result(batch, outcome, _record, _tail):
        log.write("%s %s batch %d: %s" % (workload, allocator, batch, outcome))

    trial = batch_search.subprocess_trial(
        lambda b: trial_command(a.python, workload, allocator, b, a.cap_bytes, a.steps,
                                extra_conf=a.gpumem_conf),
        a.trial_timeout, env=trial_environment(allocator), on_result=on_result)
    r = {"workload": workload, "allocator": allocator}
    t0 = time.time()
    try:
        s = batch_search.largest_fitting(trial, start_batch(workload, a.cap_bytes),
                                         a.max_batch, a.tolerance)
        r.update(max_batch=s.largest, first_oom=s.first_oom, capped=s.capped,
                 trials=s.as_dict()["trials"])
    except batch_search.TrialError as e:
        log.write("%s %s ERROR %s" % (workload, allocator, e))
        r.update(max_batch=None, error=str(e))
    r["search_s"] = round(time.time() - t0, 1)
    return r


def time_one(a, r, log):
    """The timed run at the allocator's own largest batch; a run that now runs out of
    memory (the GPU's pools are not deterministic) steps one batch down, once."""
    for batch in (r["max_batch"], r["max_batch"] - 1):
        if batch < 1:
            return
        cmd = trial_command(a.python, r["workload"], r["allocator"], batch, a.cap_bytes, 0,
                            timed_cycles=a.timed_cycles, extra_conf=a.gpumem_conf)
        try:
            outcome, record, _ = batch_search.run_trial(cmd, a.trial_timeout,
                                                        trial_environment(r["allocator"]))
        except batch_search.TrialError as e:
            log.write("%s %s timed batch %d ERROR %s" % (r["workload"], r["allocator"], batch, e))
            r["timed_error"] = str(e)
            return
        log.write("%s %s timed batch %d: %s" % (r["workload"], r["allocator"], batch, outcome))
        if outcome == batch_search.FITS and record:
            r.update(timed_batch=batch, samples_per_s=record.get("samples_per_s"),
                     samples_per_s_min=record.get("samples_per_s_min"),
                     samples_per_s_max=record.get("samples_per_s_max"),
                     peak_reserved=record.get("peak_reserved"),
                     peak_requested=record.get("peak_requested"))
            return
        r["timed_oom_at"] = batch


def probe(python):
    p = subprocess.run([python, os.path.join(HERE, "max_batch.py"), "probe"],
                       capture_output=True, text=True, timeout=300, check=False)
    info = batch_search.last_json(p.stdout)
    if p.returncode != 0 or not info:
        sys.exit("max_batch.py: the device probe failed (exit %d):\n%s"
                 % (p.returncode, p.stderr.strip()[-2000:]))
    return info


def driver_main(a):
    for w in a.workloads:
        if w not in WORKLOADS:
            sys.exit("max_batch.py: unknown workload %r (known: %s)" % (w, ", ".join(WORKLOADS)))
    for al in a.allocators:
        if al not in ALLOCATORS:
            sys.exit("max_batch.py: unknown allocator %r (known: %s)" % (al, ", ".join(ALLOCATORS)))
    os.makedirs(a.out, exist_ok=True)
    info = probe(a.python)
    total = info["total_bytes"]
    a.cap_bytes = int(a.cap_gib * GIB) if a.cap_gib else int(a.fraction * total)
    if not 0 < a.cap_bytes <= total:
        sys.exit("max_batch.py: the cap (%d bytes) must be within the device's %d bytes"
                 % (a.cap_bytes, total))
    # Searches run side by side, each process under the cap: room for each, with its CUDA
    # context and libraries, on the device.
    fit = max(1, int(0.9 * total // (a.cap_bytes + 2 * GIB)))
    jobs = min(a.jobs, fit)
    log = trial_log(os.path.join(a.out, "trials.log"))
    log.write("device %s, torch %s, total %d bytes, cap %d bytes, %d job(s)"
              % (info["device"], info["torch"], total, a.cap_bytes, jobs))
    pairs = [(w, al) for w in a.workloads for al in a.allocators]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda p: search_one(a, p[0], p[1], log), pairs))
    write_results(a, info, results, timed=False)  # kept should the timed runs be cut short
    # Timed runs one at a time (no other process on the GPU), the allocators alternating.
    for r in results:
        if r.get("max_batch"):
            time_one(a, r, log)
    rows = write_results(a, info, results, timed=True)
    sys.stdout.write(markdown(rows, a.cap_bytes))
    return 1 if any(r.get("error") for r in rows) else 0


def write_results(a, info, results, timed):
    """DIR/max_batch.json and DIR/max_batch.md of the results so far; returns the rows."""
    rows = summarize(results, a.allocators)
    out = {"device": info["device"], "torch": info["torch"], "total_bytes": info["total_bytes"],
           "cap_bytes": a.cap_bytes, "steps": a.steps, "timed_cycles": a.timed_cycles,
           "timed": timed, "gpumem_conf": gpumem_conf(a.cap_bytes, a.gpumem_conf),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows}
    with open(os.path.join(a.out, "max_batch.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(a.out, "max_batch.md"), "w", encoding="utf-8") as f:
        f.write(markdown(rows, a.cap_bytes))
    return rows


def parse(argv):
    if argv[:1] == ["trial"]:
        p = argparse.ArgumentParser(prog="max_batch.py trial")
        p.add_argument("workload", choices=sorted(WORKLOADS))
        p.add_argument("batch", type=int)
        p.add_argument("--allocator", choices=ALLOCATORS, required=True)
        p.add_argument("--cap-bytes", type=int, required=True)
        p.add_argument("--steps", type=int, default=8)
        p.add_argument("--timed-cycles", type=int, default=0)
        p.add_argument("--gpumem-conf", default="")
        a = p.parse_args(argv[1:])
        a.main = trial_main
        return a
    if argv[:1] == ["probe"]:
        return argparse.Namespace(main=probe_main)
    p = argparse.ArgumentParser(prog="max_batch.py", description=__doc__.split("\n\n")[0])
    cap = p.add_mutually_exclusive_group(required=True)
    cap.add_argument("--cap-gib", type=float, help="the cap in GiB, the same for every allocator")
    cap.add_argument("--fraction", type=float, help="the cap as a share of the device's memory")
    p.add_argument("--out", default="max-batch-out")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--allocators", default=",".join(ALLOCATORS))
    p.add_argument("--jobs", type=int, default=3, help="searches run side by side")
    p.add_argument("--steps", type=int, default=8, help="training steps a trial runs")
    p.add_argument("--timed-cycles", type=int, default=3,
                   help="cycles of the workload's shapes timed at the largest batch")
    p.add_argument("--trial-timeout", type=float, default=300)
    p.add_argument("--max-batch", type=int, default=4096)
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="stop bisecting within this share of the batch (0: exact)")
    p.add_argument("--gpumem-conf", default="", help="more GPUMEM_CONF keys for gpumem")
    p.add_argument("--python", default=sys.executable)
    a = p.parse_args(argv)
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.allocators = [x for x in a.allocators.split(",") if x]
    if a.fraction is not None and not 0 < a.fraction <= 1:
        p.error("--fraction must be in (0, 1]")
    if a.cap_gib is not None and a.cap_gib <= 0:
        p.error("--cap-gib must be positive")
    if a.jobs < 1 or a.steps < 1 or a.timed_cycles < 1 or a.max_batch < 1:
        p.error("--jobs, --steps, --timed-cycles and --max-batch must be at least 1")
    a.main = driver_main
    return a


if __name__ == "__main__":
    args = parse(sys.argv[1:])
    sys.exit(args.main(args))
