"""gpumem as PyTorch's allocator under what PyTorch users run: CUDA graph capture and replay
with PyTorch's graph-pool rules, graphs sharing a pool, eager traffic between replays,
replays on a side stream, torch.compile (default and reduce-overhead), autocast, activation
checkpointing and record_stream from a side stream (torch.cuda.MemPool: torch_mempool_test.py,
which runs under PyTorch's own allocator).

Each case checks results against eager execution (or against the same computation without
the feature). With GPUMEM_COMPAT_JSON set, writes one line per case (name, result, detail) to
that file: the compatibility table in docs/PYTORCH.md is made from it.

Run by ctest with PYTHONPATH=python and GPUMEM_LIB=<libgpumem_torch.so>. Exits 77 (skipped)
without torch or without a CUDA device."""

import gc
import os
import unittest

from torch_test_support import require_torch_and_gpu  # noqa: E402

torch = require_torch_and_gpu()

import gpumem.torch  # noqa: E402

gpumem.torch.enable()  # before PyTorch's first CUDA allocation

from torch_test_support import CompatResults  # noqa: E402

_results = CompatResults()
_record = _results.record


def _mlp(width=1024, depth=4):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda()


def _drop_cublas_workspaces():
    """cuBLAS takes its workspace from the allocator the first time a stream runs a matmul,
    inside a capture too (then from the graph's pool), and PyTorch keeps it for the stream:
    a live allocation that keeps a private pool alive, as under PyTorch's own allocator,
    until the workspaces are cleared."""
    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    gc.collect()
    torch.cuda.synchronize()


def _capture(fn, static_in, pool=None, warmup=3):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        static_out = fn(static_in)
    return g, static_out


class CudaGraphs(unittest.TestCase):
    def setUp(self):
        _drop_cublas_workspaces()
        self.pools_before = gpumem.torch.graph_pools()["pools"]

    def test_capture_and_replay_equal_eager_over_100_replays_with_eager_traffic(self):
        model = _mlp().eval()
        x = torch.randn(64, 1024, device="cuda")
        with torch.no_grad():
            g, out = _capture(model, x)
            self.assertEqual(gpumem.torch.graph_pools()["pools"], self.pools_before + 1)
            worst = 0.0
            keep = []
            for i in range(100):
                x.copy_(torch.randn(64, 1024, device="cuda"))
                # Eager allocations between replays: they must never land on the graph's
                # memory (a replay would overwrite them, and they the graph's tensors).
                junk = torch.full((256 + 7 * i, 1024), float(i), device="cuda")
                keep.append(junk)
                if len(keep) > 8:
                    keep.pop(0)
                g.replay()
                ref = model(x)
                worst = max(worst, (out - ref).abs().max().item())
                for j, t in enumerate(keep):
                    self.assertTrue(bool((t == t.flatten()[0]).all()),
                                    "an eager tensor was overwritten by a replay")
        _record("torch.cuda.graph capture + 100 replays, eager traffic between",
                worst == 0.0, "max |replay - eager| = %g" % worst)
        self.assertEqual(worst, 0.0)
        del g, out
        _drop_cublas_workspaces()
        self.assertEqual(gpumem.torch.graph_pools()["pools"], self.pools_before,
                         "the private pool is given back once the graph and its outputs go")

    def test_graph_memory_is_private_and_comes_back(self):
        model = _mlp(2048, 2).eval()
        x = torch.randn(128, 2048, device="cuda")
        with torch.no_grad():
            g, out = _capture(model, x)
        held = gpumem.torch.graph_pools()
        self.assertGreater(held["reserved_bytes"], 0)
        lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        # Eager allocations of the same sizes as the graph's intermediates, while it lives.
        eager = [torch.empty(128, 2048, device="cuda") for _ in range(32)]
        overlap = any(lo <= t.data_ptr() < hi for t in eager)
        _record("graph memory private while the graph lives", not overlap)
        self.assertFalse(overlap)
        del g, out, eager
        _drop_cublas_workspaces()
        after = gpumem.torch.graph_pools()
        ok = after["pools"] == self.pools_before and after["reserved_bytes"] < held["reserved_bytes"]
        _record("graph pool given back when the graph is destroyed", ok,
                "private reserved %d -> %d bytes" % (held["reserved_bytes"], after["reserved_bytes"]))
        self.assertTrue(ok)

    def test_a_graph_captured_in_a_tag_sleeps_and_wakes_with_it(self):
        # The rollout's decode graphs: captured inside a tag, their private memory goes back
        # to the driver with the tag's discard sleep and comes back at the same addresses
        # with its wake, so the same graph replays, with eager's results, after the wake.
        model = _mlp(1024, 3).eval()
        base = gpumem.torch.graph_pools()["reserved_bytes"]  # other graphs' pools
        with gpumem.torch.tag("graph-sleep"):
            x = torch.randn(64, 1024, device="cuda")
            with torch.no_grad():
                g, out = _capture(model, x)
        held = gpumem.torch.graph_pools()["reserved_bytes"]
        gpumem.torch.sleep("graph-sleep", "discard")
        asleep = gpumem.torch.graph_pools()["reserved_bytes"]
        # Memory for something else while it sleeps, as the trainer's step.
        filler = torch.ones(held // 4 + 1, device="cuda")
        del filler
        gpumem.torch.wake("graph-sleep")
        awake = gpumem.torch.graph_pools()["reserved_bytes"]
        worst = 0.0
        with torch.no_grad():
            for _ in range(5):
                x.copy_(torch.randn(64, 1024, device="cuda"))
                g.replay()
                worst = max(worst, (out - model(x)).abs().max().item())
        ok = held > base and asleep <= base and awake >= held and worst == 0.0
        _record("a graph captured in a tag: discard sleep and wake with it, then replays",
                ok, "graph pools %d -> %d asleep -> %d awake bytes; max |replay - eager| = %g"
                % (held, asleep, awake, worst))
        self.assertTrue(ok, (held, asleep, awake, worst))
        del g, out, x
        _drop_cublas_workspaces()

    def test_several_graphs_sharing_a_pool_and_side_stream_replays(self):
        a, b = _mlp(512, 2).eval(), _mlp(512, 3).eval()
        x = torch.randn(32, 512, device="cuda")
        with torch.no_grad():
            g1, o1 = _capture(a, x)
            g2, o2 = _capture(lambda t: b(t) * 2, x, pool=g1.pool())
            g3, o3 = _capture(lambda t: a(t) + b(t), x)
            side = torch.cuda.Stream()
            worst = 0.0
            for i in range(100):
                x.copy_(torch.randn(32, 512, device="cuda"))
                # Graphs sharing a pool replay in capture order (PyTorch's rule).
                if i % 2 == 0:
                    g1.replay()
                    g2.replay()
                    g3.replay()
                else:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        g1.replay()
                        g2.replay()
                        g3.replay()
                    torch.cuda.current_stream().wait_stream(side)
                worst = max(worst, (o1 - a(x)).abs().max().item(),
                            (o2 - b(x) * 2).abs().max().item(),
                            (o3 - (a(x) + b(x))).abs().max().item())
        _record("several graphs, a shared pool (pool=), side-stream replays", worst == 0.0,
                "max |replay - eager| = %g" % worst)
        self.assertEqual(worst, 0.0)
        self.assertEqual(gpumem.torch.graph_pools()["pools"], self.pools_before + 2,
                         "g1 and g2 share one private pool, g3 has its own")
        del g1, g2, g3, o1, o2, o3
        _drop_cublas_workspaces()
        self.assertEqual(gpumem.torch.graph_pools()["pools"], self.pools_before)

    def test_training_step_captured(self):
        model = _mlp(512, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(64, 512, device="cuda")
        y = torch.randn(64, 512, device="cuda")
        ref_model = _mlp(512, 2)
        ref_model.load_state_dict(model.state_dict())
        ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.01)

        def step(m, o):
            o.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
            return loss

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step(model, opt)
                step(ref_model, ref_opt)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_loss = step(model, opt)
        worst = 0.0
        for _ in range(20):
            g.replay()
            ref = step(ref_model, ref_opt)
            worst = max(worst, abs(static_loss.item() - ref.item()))
        _record("a whole training step captured (forward, backward, SGD)", worst < 1e-5,
                "max |loss - eager loss| = %g" % worst)
        self.assertLess(worst, 1e-5)


class Compile(unittest.TestCase):
    def _check(self, mode):
        torch._dynamo.reset()
        model = _mlp(512, 3).eval()
        fn = torch.compile(model, mode=mode)
        worst = 0.0
        with torch.no_grad():
            for _ in range(20):
                x = torch.randn(16, 512, device="cuda")
                worst = max(worst, (fn(x) - model(x)).abs().max().item())
        # The compiled function's graphs and their pools go with it.
        del fn
        torch._dynamo.reset()
        gc.collect()
        return worst

    def test_compile_default(self):
        worst = self._check(None)
        _record("torch.compile (default)", worst < 1e-3, "max |compiled - eager| = %g" % worst)
        self.assertLess(worst, 1e-3)

    def test_compile_reduce_overhead(self):
        worst = self._check("reduce-overhead")
        _record("torch.compile(mode='reduce-overhead') (CUDA graphs)", worst < 1e-3,
                "max |compiled - eager| = %g" % worst)
        self.assertLess(worst, 1e-3)


    def test_reduce_overhead_with_a_mutated_input(self):
        # A compiled function that mutates an input in place (a step counter, a cache
        # position) must give eager's results call after call: captured into a graph, its
        # warm-up and replays would apply the mutation to the wrong tensor or twice.
        torch._dynamo.reset()

        def step(x, counter):
            counter.add_(1)
            return x * counter

        fn = torch.compile(step, mode="reduce-overhead")
        x = torch.randn(1024, device="cuda")
        c_eager = torch.zeros(1, device="cuda")
        c_compiled = torch.zeros(1, device="cuda")
        worst = 0.0
        for _ in range(10):
            worst = max(worst, (fn(x, c_compiled) - step(x, c_eager)).abs().max().item())
        worst = max(worst, (c_compiled - c_eager).abs().item())
        del fn
        torch._dynamo.reset()
        gc.collect()
        _record("torch.compile(mode='reduce-overhead'), a function mutating its input",
                worst == 0.0, "max |compiled - eager| = %g after 10 calls" % worst)
        self.assertEqual(worst, 0.0)


class EverydayFeatures(unittest.TestCase):
    def test_autocast_and_checkpointing(self):
        from torch.utils.checkpoint import checkpoint
        model = _mlp(1024, 4)
        x = torch.randn(32, 1024, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            plain = model(x).float().sum()
        plain.backward()
        g_plain = x.grad.clone()
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ck = checkpoint(model, x, use_reentrant=False).float().sum()
        ck.backward()
        diff = (g_plain - x.grad).abs().max().item()
        ok = abs(plain.item() - ck.item()) < 1e-2 and diff < 1e-2
        _record("autocast (bf16) + activation checkpointing", ok, "grad max diff %g" % diff)
        self.assertTrue(ok)

    def test_record_stream_from_a_side_stream(self):
        side = torch.cuda.Stream()
        worst = 0.0
        for i in range(50):
            src = torch.full((1 << 20,), float(i), device="cuda")
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(100000)  # the side stream is still reading when src is freed
                out = src * 2
            src.record_stream(side)
            del src
            # Reuse pressure on the main stream while the side stream reads.
            junk = torch.full((1 << 20,), -1.0, device="cuda")
            torch.cuda.current_stream().wait_stream(side)
            worst = max(worst, (out - 2 * i).abs().max().item())
            del junk
        _record("record_stream from a side stream", worst == 0.0,
                "mode %s" % gpumem.torch.record_stream_mode())
        self.assertEqual(worst, 0.0)


def tearDownModule():
    _results.write()


if __name__ == "__main__":
    unittest.main(verbosity=2)
