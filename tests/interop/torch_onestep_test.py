#!/usr/bin/env python3
"""gpumem for PyTorch in one step, under real PyTorch on a GPU: an unmodified training
script under `python -m gpumem run` and under GPUMEM_ENABLE=1 (the .pth hook), with
--mark-steps; enable() after PyTorch allocated; gpumem.torch.memory_stats() and friends
against tensor sizes; reset_peak_memory_stats(); record_memory_history() + snapshot()
opened by torch.cuda._memory_viz. Run by ctest with PYTHONPATH=python and
GPUMEM_LIB=<libgpumem_torch.so>. Exits 77 (skipped) without torch or a CUDA device."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from torch_test_support import require_torch_and_gpu  # noqa: E402

torch = require_torch_and_gpu()

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "torch_train_script.py")
PTH = os.path.join(HERE, "..", "..", "python", "gpumem-enable.pth")
MiB = 1 << 20


def run(args, **env):
    e = dict(os.environ)
    for k in ("GPUMEM_ENABLE", "GPUMEM_DEVICE", "GPUMEM_CONF", "GPUMEM_MARK_STEPS"):
        e.pop(k, None)
    e.update(env)
    r = subprocess.run([sys.executable] + args, env=e, capture_output=True, text=True,
                       timeout=300, cwd=tempfile.gettempdir())
    return r


def seen(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


class OneStepTest(unittest.TestCase):
    def test_native_run_has_no_gpumem(self):
        out = seen(run([SCRIPT, "--steps", "3"]))
        self.assertIsNone(out["gpumem"])

    def test_python_m_gpumem_run(self):
        native = seen(run([SCRIPT, "--steps", "5"]))
        out = seen(run(["-m", "gpumem", "run", "--conf", "release_threshold:1G",
                        "--mark-steps", "optimizer", SCRIPT, "--steps", "5"]))
        self.assertEqual(out["argv"], [SCRIPT, "--steps", "5"])
        g = out["gpumem"]
        self.assertIsNotNone(g, "gpumem was not enabled")
        self.assertEqual(g["platform"], "cuda")
        self.assertGreater(g["allocations"], 10)
        self.assertGreater(g["requested_peak"], 2 * MiB)  # the parameters alone are 2 MiB
        self.assertGreater(g["reserved"], 0)
        self.assertEqual(g["plan_marks"], 5)  # one mark per optimizer step
        # The same computation: the allocator must not change the numbers.
        self.assertLess(abs(out["loss"] - native["loss"]), 1e-3 * max(1.0, abs(native["loss"])))

    def test_gpumem_enable_hook(self):
        site = tempfile.mkdtemp()
        try:
            shutil.copy(PTH, site)
            code = ("import site, sys, runpy; site.addsitedir(%r); sys.argv = [%r, '--steps', '2'];"
                    "runpy.run_path(%r, run_name='__main__')" % (site, SCRIPT, SCRIPT))
            out = seen(run(["-c", code], GPUMEM_ENABLE="1"))
            self.assertIsNotNone(out["gpumem"])
            self.assertEqual(out["gpumem"]["platform"], "cuda")
        finally:
            shutil.rmtree(site)

    def test_enable_after_pytorch_allocated_is_refused_clearly(self):
        code = ("import torch; x = torch.zeros(1024, device='cuda')\n"
                "import gpumem.torch\n"
                "try:\n    gpumem.torch.enable()\nexcept RuntimeError as e:\n    print(e)\n")
        r = run(["-c", code])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("PyTorch already allocated CUDA memory with its own allocator", r.stdout)
        self.assertIn("bytes on cuda:0", r.stdout)


class ReplayTorchSnapshotTest(unittest.TestCase):
    @unittest.skipUnless(os.environ.get("GPUMEM_CLI"), "GPUMEM_CLI (the gpumem tool) not given")
    def test_gpumem_replays_a_snapshot_pytorch_dumped(self):
        path = os.path.join(tempfile.gettempdir(), "gpumem_torch_native_snapshot.pickle")
        code = ("import torch\n"
                "torch.cuda.memory._record_memory_history(max_entries=100000)\n"
                "m = torch.nn.Linear(512, 512).cuda(); opt = torch.optim.SGD(m.parameters(), 0.1)\n"
                "for _ in range(5):\n"
                "    loss = m(torch.randn(64, 512, device='cuda')).sum(); loss.backward(); opt.step()\n"
                "torch.cuda.memory._dump_snapshot(%r)\n" % path)
        r = run(["-c", code])
        self.assertEqual(r.returncode, 0, r.stderr)
        r = subprocess.run([os.environ["GPUMEM_CLI"], "replay", path, "--device", "sim",
                            "--allocator", "vmm_page_pool"], capture_output=True, text=True,
                           timeout=300)
        os.remove(path)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertRegex(r.stdout, r"trace .*: \d+ events \(\d+ allocs, \d+ frees\)")


class StatsUnderTorchTest(unittest.TestCase):
    """In a child process, enabled before the first allocation."""

    def test_stats_snapshot_and_memory_viz(self):
        code = r'''
import json, os, pickle, sys, tempfile
import gpumem.torch
gpumem.torch.enable()
import torch
MiB = 1 << 20
g = gpumem.torch
base = g.memory_allocated()
x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
after = g.memory_allocated()
st = g.memory_stats()
del x
freed = g.memory_allocated()
g.reset_peak_memory_stats()
peak_reset = g.max_memory_allocated()
y = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda"); del y
peak = g.max_memory_allocated()
g.record_memory_history(max_entries=1000)
a = torch.randn(1024, 1024, device="cuda"); b = a @ a; del a
snap = g.snapshot(os.path.join(tempfile.gettempdir(), "gpumem_onestep.pickle"))
from torch.cuda import _memory_viz
html = _memory_viz.trace_plot(snap)
seg = _memory_viz.segment_plot(snap)
print(json.dumps({"base": base, "after": after, "freed": freed, "peak_reset": peak_reset,
                  "peak": peak, "summary": g.memory_summary(),
                  "reserved": st["reserved_bytes.all.current"],
                  "trace": [e["action"] for e in snap["device_traces"][0]],
                  "html": len(html), "seg": len(seg)}))
'''
        out = seen(run(["-c", code]))
        self.assertEqual(out["after"] - out["base"], 3 * MiB)
        self.assertEqual(out["freed"], out["base"])
        self.assertEqual(out["peak_reset"], out["base"])
        self.assertEqual(out["peak"], out["base"] + 5 * MiB)
        self.assertGreaterEqual(out["reserved"], 3 * MiB)
        self.assertIn("Requested memory", out["summary"])
        self.assertIn("on cuda", out["summary"])
        self.assertGreaterEqual(out["trace"].count("alloc"), 2)
        self.assertIn("free_completed", out["trace"])
        self.assertGreater(out["html"], 1000)
        self.assertGreater(out["seg"], 1000)


if __name__ == "__main__":
    unittest.main()
