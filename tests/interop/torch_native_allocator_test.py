"""gpumem as PyTorch's own CUDA allocator (libgpumem_torch_native.so, a CUDAAllocator
subclass): unchanged torch.cuda calls answer from gpumem. Statistics with PyTorch's meanings
(allocated bytes equal the tensors' bytes), peaks and their reset, empty_cache giving memory
back to the driver (mem_get_info shows it), set_per_process_memory_fraction as a cap,
_record_memory_history / _snapshot / _dump_snapshot with the timeline memory_viz draws,
out-of-memory observers, torch.compile(mode="reduce-overhead") with CUDA graph trees on,
torch.cuda.MemPool over gpumem, MemPool(CUDAPluggableAllocator(...)) over a library that
maps with cuMemCreate / cuMemMap, paused and resumed as vLLM's sleep mode does, and CUDA IPC
(reduce_tensor, torch.multiprocessing) to processes running gpumem or PyTorch's own allocator.

Run by ctest with PYTHONPATH=python and GPUMEM_LIB=<libgpumem_torch.so> (the native library
beside it). Exits 77 (skipped) without torch, without a CUDA device, or where the native
library was not built for this torch."""

import ctypes
import gc
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

from torch_test_support import require_torch_and_gpu  # noqa: E402

torch = require_torch_and_gpu()

import gpumem.torch  # noqa: E402

os.environ.setdefault("GPUMEM_TORCH_ROUTE", "native")
gpumem.torch.enable()
if gpumem.torch.route() != "native":
    print("skipped: the native allocator was not built for this torch (see stderr)")
    sys.exit(77)

from torch_test_support import CompatResults  # noqa: E402

_results = CompatResults()
MiB = 1 << 20


def _settle():
    gc.collect()
    torch.cuda.synchronize()


class Statistics(unittest.TestCase):
    def test_backend_name(self):
        name = torch.cuda.get_allocator_backend()
        _results.record("torch.cuda.get_allocator_backend()", name == "gpumem", name)
        self.assertEqual(name, "gpumem")

    def test_allocated_reserved_and_peaks(self):
        _settle()
        base = torch.cuda.memory_allocated()
        a = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(3 * MiB + 17, dtype=torch.uint8, device="cuda")
        allocated = torch.cuda.memory_allocated() - base
        reserved = torch.cuda.memory_reserved()
        peak = torch.cuda.max_memory_allocated()
        del b
        after_free = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        peak_after_reset = torch.cuda.max_memory_allocated()
        stats = torch.cuda.memory_stats()
        summary = torch.cuda.memory_summary()
        ok = (allocated == 67 * MiB + 17 and after_free == 64 * MiB and reserved >= allocated
              and peak >= allocated + base and peak_after_reset == torch.cuda.memory_allocated()
              and stats["allocated_bytes.all.current"] == torch.cuda.memory_allocated()
              and stats["requested_bytes.all.current"] == torch.cuda.memory_allocated()
              and torch.cuda.max_memory_reserved() >= reserved
              and "allocated" in summary.lower())
        _results.record("memory_allocated / max_memory_allocated / memory_reserved / "
                        "memory_stats / memory_summary / reset_peak_memory_stats", ok,
                        "allocated %d (tensors 67 MiB + 17 B), reserved %d" % (allocated, reserved))
        self.assertTrue(ok)
        torch.cuda.reset_accumulated_memory_stats()
        self.assertGreaterEqual(torch.cuda.memory_stats()["allocated_bytes.all.current"],
                                64 * MiB)
        del a

    def test_empty_cache_gives_memory_back(self):
        _settle()
        x = torch.empty(2048 * MiB, dtype=torch.uint8, device="cuda")
        del x
        _settle()
        free_before, _ = torch.cuda.mem_get_info()
        reserved_before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info()
        reserved_after = torch.cuda.memory_reserved()
        ok = free_after - free_before >= 1024 * MiB and reserved_after < reserved_before
        _results.record("empty_cache (mem_get_info shows the memory back)", ok,
                        "free +%d MiB, reserved %d -> %d MiB" % ((free_after - free_before) // MiB,
                                                                 reserved_before // MiB,
                                                                 reserved_after // MiB))
        self.assertTrue(ok)

    def test_memory_fraction_is_a_cap(self):
        _settle()
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info()
        fraction = 0.25
        torch.cuda.set_per_process_memory_fraction(fraction)
        try:
            self.assertAlmostEqual(torch.cuda.get_per_process_memory_fraction(), fraction)
            held = [torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")]
            raised = False
            try:
                held.append(torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                raised = True
            within = torch.cuda.memory_reserved() <= total * fraction
            del held
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        _settle()
        fine = torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
        del fine
        ok = raised and within
        _results.record("set_per_process_memory_fraction (a cap on reserved bytes)", ok,
                        "0.1 + 0.2 of the device under 0.25: out-of-memory %s" % raised)
        self.assertTrue(ok)

    def test_out_of_memory_observer(self):
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(
            lambda device, alloc, device_alloc, device_free: seen.append((device, alloc)))
        _, total = torch.cuda.mem_get_info()
        with self.assertRaises(torch.OutOfMemoryError):
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        ok = len(seen) >= 1
        _results.record("out-of-memory observers (_cuda_attach_out_of_memory_observer)", ok,
                        "%d call(s)" % len(seen))
        self.assertTrue(ok)

    def test_history_snapshot_and_dump(self):
        torch.cuda.memory._record_memory_history(max_entries=10000)
        a = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        del b
        snap = torch.cuda.memory._snapshot()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "snap.pickle")
            torch.cuda.memory._dump_snapshot(path)
            with open(path, "rb") as f:
                dumped = pickle.load(f)
            from torch.cuda import _memory_viz

            html = _memory_viz.trace_plot(dumped)
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = [e for t in snap["device_traces"] for e in t]
        actions = {e["action"] for e in trace}
        addrs = {s["address"] for s in snap["segments"]}
        ok = ({"alloc", "free_completed"} <= actions and a.data_ptr() in addrs
              and any(e.get("frames") for e in trace) and len(html) > 1000
              and all("time_us" in e for e in trace))
        _results.record("_record_memory_history / _snapshot / _dump_snapshot (memory_viz trace_plot)",
                        ok, "%d events, %d segments, stacks %s" % (len(trace), len(snap["segments"]),
                                                                   any(e.get("frames") for e in trace)))
        self.assertTrue(ok)
        del a


class GraphsAndPools(unittest.TestCase):
    def test_reduce_overhead_with_graph_trees(self):
        import torch._inductor.config as inductor_config

        self.assertTrue(inductor_config.triton.cudagraph_trees)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(),
                                    torch.nn.Linear(512, 512)).cuda()
        f = torch.compile(model, mode="reduce-overhead")
        g = torch.compile(lambda x: torch.relu(x) * 2 + 1, mode="reduce-overhead")
        x = torch.randn(64, 512, device="cuda")
        with torch.no_grad():
            for _ in range(4):
                # A tree's output lives until the next run in the tree overwrites it (PyTorch's
                # own allocator alike): read before g runs, or keep a clone.
                y = f(x).clone()
                z = g(x)
            eager = model(x)
        ok = bool(torch.allclose(y, eager, atol=1e-4, rtol=1e-3)) and bool(
            torch.allclose(z, torch.relu(x) * 2 + 1))
        _results.record("torch.compile(mode='reduce-overhead'), CUDA graph trees on", ok,
                        "two compiled functions, 4 calls each, equal to eager")
        self.assertTrue(ok)

    def test_graph_trees_that_branch_restore_their_checkpoint(self):
        # One function, then either of two (a training and an evaluation path): recording
        # the second branch restores the tree's pool to its state after the first function
        # (setCheckpointPoolState, allocations freed since made again at their addresses).
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 256)).cuda()
        f = torch.compile(lambda x: model(x), mode="reduce-overhead")
        g = torch.compile(lambda y: y * 2 + 1, mode="reduce-overhead")
        h = torch.compile(lambda y: torch.tanh(y) - 1, mode="reduce-overhead")
        x = torch.randn(32, 256, device="cuda")
        worst = 0.0
        with torch.no_grad():
            for i in range(8):
                torch.compiler.cudagraph_mark_step_begin()
                y = f(x)
                out = (g(y) if i % 2 == 0 else h(y)).clone()
                eager = model(x)
                ref = eager * 2 + 1 if i % 2 == 0 else torch.tanh(eager) - 1
                worst = max(worst, float((out - ref).abs().max()))
        restores = None
        try:
            from torch._inductor import cudagraph_trees
            manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
            restores = getattr(manager, "debug_checkpointing_counter", None)
        except Exception:  # pylint: disable=broad-except  (an internal that may move)
            pass
        ok = worst < 1e-3 and (restores is None or restores > 0)
        _results.record("torch.compile(mode='reduce-overhead'), a graph tree that branches", ok,
                        "max |compiled - eager| = %.3g over 8 steps, checkpoint restores %s"
                        % (worst, restores))
        self.assertTrue(ok)

    def test_mempool_over_gpumem(self):
        pool = torch.cuda.MemPool()
        live_before = gpumem.torch.graph_pools()["live_allocations"]
        with torch.cuda.use_mem_pool(pool):
            a = torch.randn(1024, 1024, device="cuda")
        inside = gpumem.torch.graph_pools()["live_allocations"] - live_before
        b = torch.randn(1024, 1024, device="cuda")
        graph = torch.cuda.CUDAGraph()
        static = torch.randn(256, 256, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out = static @ static
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph, pool=pool.id):
            out = static @ static + 1
        static.copy_(torch.randn(256, 256, device="cuda"))
        graph.replay()
        ok = inside >= 1 and bool(torch.allclose(out, static @ static + 1, atol=1e-3, rtol=1e-3))
        uses = pool.use_count()
        del a, graph, out
        _settle()
        del pool
        _settle()
        _results.record("torch.cuda.MemPool() + use_mem_pool + capture into the pool", ok,
                        "%d allocation(s) in the private pool, use_count %d" % (inside, uses))
        self.assertTrue(ok)
        del b

    def test_mempool_over_a_cumem_allocator_pauses_and_resumes(self):
        here = os.path.dirname(os.path.abspath(__file__))
        with tempfile.TemporaryDirectory() as d:
            so = os.path.join(d, "libcumem_test.so")
            cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
            subprocess.check_call(["cc", "-shared", "-fPIC", "-O2", "-o", so,
                                   os.path.join(here, "cumem_test_allocator.c"),
                                   "-I" + os.path.join(cuda_home, "include"), "-lcuda"])
            lib = ctypes.CDLL(so)
            lib.cumem_test_pause.restype = ctypes.c_size_t
            alloc = torch.cuda.memory.CUDAPluggableAllocator(so, "cumem_test_malloc",
                                                             "cumem_test_free")
            pool = torch.cuda.MemPool(alloc.allocator())
            gp_live = gpumem.torch.stats()["live_bytes"]
            with torch.cuda.use_mem_pool(pool):
                w = torch.ones(256 * MiB // 4, device="cuda")
            outside = torch.ones(1024, device="cuda")
            not_gpumem = gpumem.torch.stats()["live_bytes"] - gp_live < 256 * MiB
            _settle()
            free0, _ = torch.cuda.mem_get_info()
            released = lib.cumem_test_pause()
            free1, _ = torch.cuda.mem_get_info()
            resumed = lib.cumem_test_resume() == 1
            w.fill_(2.0)
            ok = (not_gpumem and released >= 256 * MiB and free1 - free0 >= 256 * MiB and resumed
                  and float(w.sum()) == 2.0 * w.numel() and float(outside.sum()) == 1024.0)
            del w
            _settle()
            del pool
            _settle()
            ok = ok and lib.cumem_test_failures() == 0
        _results.record("MemPool(CUDAPluggableAllocator(cuMem .so)) paused and resumed "
                        "(vLLM sleep mode / torch_memory_saver pattern) under gpumem", ok,
                        "released %d MiB, free +%d MiB" % (released // MiB, (free1 - free0) // MiB))
        self.assertTrue(ok)


class CudaIpc(unittest.TestCase):
    """A tensor gpumem allocated, through reduce_tensor and torch.multiprocessing, opened by
    a process running gpumem and by one running PyTorch's own allocator."""

    def _share_with(self, consumer_args, size=64 * MiB):
        t = torch.arange(size // 4, dtype=torch.float32, device="cuda") % 1000
        expected = float(t.double().sum())
        from torch.multiprocessing.reductions import reduce_tensor
        func, args = reduce_tensor(t)
        payload = pickle.dumps((func, args, expected))
        env = dict(os.environ)
        if not consumer_args:
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        here = os.path.dirname(os.path.abspath(__file__))
        proc = subprocess.run([sys.executable, os.path.join(here, "torch_ipc_consumer.py")]
                              + consumer_args, input=payload, capture_output=True, env=env,
                              timeout=120)
        torch.cuda.synchronize()
        out = proc.stdout.decode().strip().splitlines()
        got = __import__("json").loads(out[-1]) if proc.returncode == 0 and out else None
        seen = float(t[0]) == 1.0  # the consumer's write, in place (t[0] was 0)
        return got, seen, proc.stderr.decode()[-600:]

    def test_reduce_tensor_to_a_gpumem_process(self):
        got, seen, err = self._share_with(["gpumem"])
        ok = got is not None and got["ok"] and seen and got["backend"] == "gpumem"
        _results.record("CUDA IPC: reduce_tensor -> rebuild in a gpumem process", ok,
                        "bytes checked, write seen" if ok else err)
        self.assertTrue(ok, err)

    def test_reduce_tensor_to_a_native_process(self):
        got, seen, err = self._share_with([])
        ok = got is not None and got["ok"] and seen and got["backend"] == "native"
        _results.record("CUDA IPC: reduce_tensor -> rebuild under PyTorch's own allocator", ok,
                        "bytes checked, write seen" if ok else err)
        self.assertTrue(ok, err)

    def test_multiprocessing_queue_and_the_exporter_keeps_memory_for_the_importer(self):
        ctx = torch.multiprocessing.get_context("spawn")
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_queue_consumer, args=(q_in, q_out))
        p.start()
        t = torch.full((16 * MiB // 4,), 3.0, device="cuda")
        q_in.put(t)
        # The exporter lets go of its tensor at once: PyTorch's reference counting keeps the
        # memory until the importer drops its own.
        del t
        _settle()
        torch.cuda.empty_cache()
        filler = torch.zeros(64 * MiB // 4, device="cuda")  # would reuse freed memory
        q_in.put("check")
        result = q_out.get(timeout=120)
        p.join(60)
        del filler
        ok = result == 3.0 * (16 * MiB // 4) and p.exitcode == 0
        _results.record("CUDA IPC: torch.multiprocessing Queue to a spawned process; the "
                        "exporter frees first", ok, "sum %r, exit %r" % (result, p.exitcode))
        self.assertTrue(ok)


def _queue_consumer(q_in, q_out):
    t = q_in.get(timeout=120)
    q_in.get(timeout=120)  # the exporter has freed its tensor and reused memory meanwhile
    q_out.put(float(t.double().sum()))
    del t


if __name__ == "__main__":
    try:
        unittest.main(exit=False, verbosity=2)
    finally:
        _results.write()
    failed = any(r["result"] == "fail" for r in _results.rows)
    sys.exit(1 if failed else 0)
