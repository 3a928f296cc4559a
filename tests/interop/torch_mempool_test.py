"""torch.cuda.MemPool built on gpumem's plug-in under PyTorch's own allocator: allocations
inside torch.cuda.use_mem_pool come from gpumem (its pool's live bytes rise, PyTorch's do
not), outside from PyTorch's allocator, and a CUDA graph captured into the MemPool replays
equal to eager. (With gpumem as PyTorch's allocator, PyTorch 2.11 refuses to build a MemPool
over any pluggable allocator: "pluggable does not yet support createOrIncrefPool"; graphs
there get gpumem's own private pools, torch_graph_test.py.)

Run with PYTHONPATH=python and GPUMEM_LIB=<libgpumem_torch.so>. Exits 77 (skipped) without
torch or without a CUDA device."""

import os
import unittest

from torch_test_support import require_torch_and_gpu  # noqa: E402

torch = require_torch_and_gpu()

import gpumem.torch  # noqa: E402

from torch_test_support import CompatResults  # noqa: E402

_results = CompatResults()


class MemPoolOnGpumem(unittest.TestCase):
    def test_use_mem_pool_and_capture_into_it(self):
        pool = torch.cuda.MemPool(gpumem.torch.allocator().allocator())
        native_before = torch.cuda.memory_allocated()
        with torch.cuda.use_mem_pool(pool):
            a = torch.randn(1024, 1024, device="cuda")
            b = a * 3
        live = gpumem.torch.stats()["live_bytes"]
        c = torch.randn(1024, 1024, device="cuda")
        in_gpumem = live >= 2 * a.numel() * a.element_size()
        ok = in_gpumem and bool(torch.allclose(b, a * 3))
        _results.record("torch.cuda.MemPool(gpumem) + use_mem_pool (PyTorch's allocator current)", ok,
                        "gpumem live %d B; PyTorch's allocator +%d B outside the block"
                        % (live, torch.cuda.memory_allocated() - native_before))
        self.assertTrue(ok)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 256)).cuda().eval()
        x = torch.randn(8, 256, device="cuda")
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model(x)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool.id):
                out = model(x)
            worst = 0.0
            for _ in range(100):
                x.copy_(torch.randn(8, 256, device="cuda"))
                g.replay()
                worst = max(worst, (out - model(x)).abs().max().item())
        ok = worst == 0.0
        _results.record("CUDA graph captured into a MemPool(gpumem), 100 replays", ok,
                        "max |replay - eager| = %g" % worst)
        self.assertTrue(ok)
        del a, b, c, g, out


def tearDownModule():
    _results.write()


if __name__ == "__main__":
    unittest.main(verbosity=2)
