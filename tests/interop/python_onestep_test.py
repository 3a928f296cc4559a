#!/usr/bin/env python3
"""gpumem for PyTorch in one step, without torch or a GPU: `python -m gpumem run`, the
GPUMEM_ENABLE start-up hook (gpumem-enable.pth), enable()'s refusal once CUDA has started,
and the torch.cuda.memory_stats()-style functions of gpumem.torch on the plug-in's pool.
A stand-in torch package (fake_torch/) records the allocator swap. Run by ctest with
PYTHONPATH=python, GPUMEM_LIB=<libgpumem_torch.so> and GPUMEM_DEVICE=sim."""

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(HERE, "fake_torch")
TRAIN = os.path.join(FAKE, "train.py")
PTH = os.path.join(HERE, "..", "..", "python", "gpumem-enable.pth")
MiB = 1 << 20

os.environ["GPUMEM_DEVICE"] = "sim"
os.environ["GPUMEM_CONF"] = "limit:256M"
os.environ.pop("GPUMEM_ENABLE", None)
os.environ.pop("GPUMEM_MARK_STEPS", None)

import gpumem  # noqa: E402
import gpumem.torch  # noqa: E402


def child_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([FAKE, os.environ.get("PYTHONPATH", "")])
    env.update({k: v for k, v in extra.items() if v is not None})
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
    return env


def run(args, **extra):
    return subprocess.run([sys.executable] + args, env=child_env(**extra), cwd=tempfile.gettempdir(),
                          capture_output=True, text=True, timeout=120)


def seen(result):
    """The JSON line train.py printed."""
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


class RunCommandTest(unittest.TestCase):
    def test_runs_the_script_unmodified_with_gpumem_as_the_allocator(self):
        r = run(["-m", "gpumem", "run", "--conf", "limit:1G,release_threshold:64M",
                 "--allocator", "caching_pool", TRAIN, "--lr", "0.1", "-x"])
        out = seen(r)
        self.assertEqual(out["name"], "__main__")
        self.assertEqual(out["argv"], [TRAIN, "--lr", "0.1", "-x"])
        self.assertEqual(out["path0"], FAKE)
        self.assertEqual(len(out["changes"]), 1)
        lib, alloc, free, torch_complete = out["changes"][0]
        self.assertEqual((alloc, free), ("gpumem_torch_malloc", "gpumem_torch_free"))
        self.assertEqual(os.path.realpath(lib), os.path.realpath(os.environ["GPUMEM_LIB"]))
        self.assertTrue(torch_complete, "enable() ran before torch finished importing")
        self.assertEqual(out["conf"], "limit:1G,release_threshold:64M")
        self.assertEqual(out["allocator"], "caching_pool")
        self.assertEqual(out["optimizer_hooks"], 0)

    def test_mark_steps_optimizer_registers_the_optimizer_hook(self):
        out = seen(run(["-m", "gpumem", "run", "--mark-steps", "optimizer", TRAIN]))
        self.assertEqual(out["optimizer_hooks"], 1)
        out = seen(run(["-m", "gpumem", "run", TRAIN], GPUMEM_MARK_STEPS="optimizer"))
        self.assertEqual(out["optimizer_hooks"], 1)

    def test_an_unknown_conf_key_is_refused_naming_it_and_the_valid_keys(self):
        r = run(["-m", "gpumem", "run", "--conf", "limit:1G,relase_threshold:1G", TRAIN])
        self.assertEqual(r.returncode, 2)
        self.assertEqual(r.stdout, "")  # the script never ran
        self.assertIn("unknown key 'relase_threshold'", r.stderr)
        for key in ("release_threshold", "limit", "allocator", "step_plan"):
            self.assertIn(key, r.stderr)
        r = run(["-m", "gpumem", "run", "--conf", "limit:lots", TRAIN])
        self.assertEqual(r.returncode, 2)
        self.assertIn("limit", r.stderr)
        r = run(["-m", "gpumem", "check-conf", "allocator:fancy"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown allocator 'fancy'", r.stderr)

    def test_a_missing_script_is_refused(self):
        r = run(["-m", "gpumem", "run", "/nonexistent/train.py"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("no such script: /nonexistent/train.py", r.stderr)

    def test_enable_failing_fails_the_import_of_torch(self):
        r = run(["-m", "gpumem", "run", TRAIN], FAKE_TORCH_CUDA_INITIALIZED="1",
                FAKE_TORCH_ALLOCATED="4096")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("PyTorch already allocated CUDA memory with its own allocator "
                      "(4096 bytes on cuda:0)", r.stderr)


class StartupHookTest(unittest.TestCase):
    """gpumem-enable.pth, processed as site-packages would process it."""

    def setUp(self):
        self.site = tempfile.mkdtemp()
        shutil.copy(PTH, self.site)

    def tearDown(self):
        shutil.rmtree(self.site)

    def run_with_site(self, **extra):
        code = ("import site, sys, runpy; site.addsitedir(%r); sys.argv = [%r, '--epochs', '2'];"
                "runpy.run_path(%r, run_name='__main__')" % (self.site, TRAIN, TRAIN))
        return run(["-c", code], **extra)

    def test_gpumem_enable_turns_it_on_when_torch_is_imported(self):
        out = seen(self.run_with_site(GPUMEM_ENABLE="1", GPUMEM_MARK_STEPS="optimizer"))
        self.assertEqual(len(out["changes"]), 1)
        self.assertEqual(out["changes"][0][1:], ["gpumem_torch_malloc", "gpumem_torch_free", True])
        self.assertEqual(out["optimizer_hooks"], 1)
        self.assertEqual(out["argv"], [TRAIN, "--epochs", "2"])

    def test_without_gpumem_enable_nothing_changes(self):
        for value in (None, "", "0"):
            out = seen(self.run_with_site(GPUMEM_ENABLE=value))
            self.assertEqual(out["changes"], [], "GPUMEM_ENABLE=%r" % (value,))

    def test_the_pth_line_imports_nothing_of_gpumem_when_not_asked(self):
        code = ("import site, sys; site.addsitedir(%r); "
                "print(sorted(m for m in sys.modules if m.startswith('gpumem')))" % self.site)
        r = run(["-c", code], GPUMEM_ENABLE=None)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "[]")


class EnableRefusalTest(unittest.TestCase):
    def test_enable_after_pytorch_allocated_says_so(self):
        code = ("import gpumem.torch\n"
                "try:\n    gpumem.torch.enable()\nexcept RuntimeError as e:\n    print(e)\n"
                "import torch; print(len(torch.cuda.memory.changes))\n")
        r = run(["-c", code], FAKE_TORCH_CUDA_INITIALIZED="1", FAKE_TORCH_ALLOCATED="1048576")
        self.assertEqual(r.returncode, 0, r.stderr)
        text, changes = r.stdout.strip().splitlines()
        self.assertIn("gpumem.torch.enable: PyTorch already allocated CUDA memory with its own "
                      "allocator (1048576 bytes on cuda:0)", text)
        self.assertIn("python -m gpumem run", text)
        self.assertEqual(changes, "0")  # the allocator was left alone
        r = run(["-c", code], FAKE_TORCH_CUDA_INITIALIZED="1", FAKE_TORCH_ALLOCATED="0")
        self.assertIn("CUDA is already initialised in this process", r.stdout)


class PlatformChoiceTest(unittest.TestCase):
    """The plug-in's pool is the GPU's unless the sim device is named (own processes: a
    device's pool is created once)."""

    CODE = ("import ctypes, gpumem, gpumem.torch\n"
            "lib = gpumem.load()\n"
            "lib.gpumem_torch_malloc.restype = ctypes.c_void_p\n"
            "lib.gpumem_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
            "try:\n"
            "    print('platform', gpumem.torch.pool(0).platform)\n"
            "except gpumem.GpumemError as e:\n"
            "    print('refused', e)\n")

    @staticmethod
    def gpu_present():
        try:
            gpumem.Pool("platform:cuda,allocator:caching_pool,step_plan:off").close()
            return True
        except gpumem.GpumemError:
            return False

    def test_sim_capacity_in_gpumem_conf_names_the_sim_device(self):
        r = run(["-c", self.CODE], GPUMEM_DEVICE=None, GPUMEM_CONF="sim_capacity:64M")
        self.assertEqual(r.stdout.strip(), "platform sim", r.stderr)
        r = run(["-c", self.CODE], GPUMEM_DEVICE=None, GPUMEM_CONF="limit:1G, platform : sim")
        self.assertEqual(r.stdout.strip(), "platform sim", r.stderr)

    def test_unnamed_is_the_gpu_or_a_refusal_never_sim(self):
        r = run(["-c", self.CODE], GPUMEM_DEVICE=None, GPUMEM_CONF="limit:1G")
        if self.gpu_present():
            self.assertEqual(r.stdout.strip(), "platform cuda", r.stderr)
        else:
            self.assertTrue(r.stdout.startswith("refused"), r.stdout)
            self.assertIn("uses the GPU only; GPUMEM_DEVICE=sim asks for the simulated device",
                          r.stderr)


class MemoryStatsTest(unittest.TestCase):
    """The plug-in's pool on the sim device (device 0), called as PyTorch calls it."""

    @classmethod
    def setUpClass(cls):
        lib = gpumem.load()
        lib.gpumem_torch_malloc.restype = ctypes.c_void_p
        lib.gpumem_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpumem_torch_free.restype = None
        lib.gpumem_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                                          ctypes.c_void_p]
        cls.lib = lib

    def test_pytorch_keys_and_meanings(self):
        lib = self.lib
        base = gpumem.torch.memory_stats()
        a = lib.gpumem_torch_malloc(3 * MiB, 0, None)
        b = lib.gpumem_torch_malloc(1000, 0, None)
        st = gpumem.torch.memory_stats(0)
        self.assertEqual(list(st), sorted(st))
        for key in ("allocated_bytes", "active_bytes", "requested_bytes", "allocation", "active"):
            for part in ("current", "peak", "allocated", "freed"):
                self.assertIn("%s.all.%s" % (key, part), st)
        d = lambda k: st[k] - base[k]  # noqa: E731
        self.assertEqual(d("requested_bytes.all.current"), 3 * MiB + 1000)
        self.assertEqual(d("allocated_bytes.all.allocated"), 3 * MiB + 1000)
        self.assertEqual(d("allocation.all.current"), 2)
        self.assertGreaterEqual(st["reserved_bytes.all.current"], st["allocated_bytes.all.current"])
        self.assertGreaterEqual(st["reserved_bytes.all.peak"], st["reserved_bytes.all.current"])
        self.assertEqual(st["gpumem.platform"], "sim")
        self.assertEqual(st["num_ooms"], base["num_ooms"])
        self.assertGreater(st["num_device_alloc"], 0)
        self.assertEqual(gpumem.torch.memory_allocated(), st["allocated_bytes.all.current"])
        self.assertEqual(gpumem.torch.memory_reserved("cuda:0"), st["reserved_bytes.all.current"])
        self.assertEqual(st["inactive_split_bytes.all.current"],
                         gpumem.torch.stats(0)["cached_bytes"])
        lib.gpumem_torch_free(a, 3 * MiB, 0, None)
        lib.gpumem_torch_free(b, 1000, 0, None)
        st = gpumem.torch.memory_stats("cuda")
        self.assertEqual(st["requested_bytes.all.current"], base["requested_bytes.all.current"])
        self.assertEqual(st["requested_bytes.all.freed"] - base["requested_bytes.all.freed"],
                         3 * MiB + 1000)
        self.assertGreaterEqual(gpumem.torch.max_memory_allocated(0),
                                base["requested_bytes.all.current"] + 3 * MiB + 1000)

    def test_reset_peak_memory_stats(self):
        lib = self.lib
        p = lib.gpumem_torch_malloc(8 * MiB, 0, None)
        lib.gpumem_torch_free(p, 8 * MiB, 0, None)
        self.assertGreaterEqual(gpumem.torch.max_memory_allocated(), 8 * MiB)
        gpumem.torch.reset_peak_memory_stats()
        self.assertEqual(gpumem.torch.max_memory_allocated(), gpumem.torch.memory_allocated())
        self.assertEqual(gpumem.torch.max_memory_reserved(), gpumem.torch.memory_reserved())
        p = lib.gpumem_torch_malloc(2 * MiB, 0, None)
        lib.gpumem_torch_free(p, 2 * MiB, 0, None)
        self.assertEqual(gpumem.torch.max_memory_allocated(),
                         gpumem.torch.memory_allocated() + 2 * MiB)
        self.assertEqual(gpumem.torch.memory_stats()["gpumem.peak_resets"] >= 1, True)

    def test_memory_summary_is_a_table_of_the_stats(self):
        p = self.lib.gpumem_torch_malloc(5 * MiB, 0, None)
        text = gpumem.torch.memory_summary()
        self.lib.gpumem_torch_free(p, 5 * MiB, 0, None)
        lines = text.splitlines()
        self.assertIn("gpumem CUDA memory summary, device ID 0", lines[1])
        self.assertIn("Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed", text)
        row = next(line for line in lines if line.startswith(" Requested memory"))
        self.assertEqual(len(row.split("|")), 5)
        self.assertIn("|   5120 KiB|", row)  # PyTorch's units: MiB from 768 MiB on
        self.assertIn("Allocator: vmm_page_pool on sim", text)
        self.assertTrue(all(len(line) <= 80 for line in lines), text)

    def test_snapshot_carries_the_recorded_history_as_the_device_trace(self):
        import pickle

        lib = self.lib
        early = lib.gpumem_torch_malloc(MiB, 0, None)  # before recording: not in the trace
        gpumem.torch.record_memory_history(max_entries=4)
        a = lib.gpumem_torch_malloc(2 * MiB, 0, None)
        lib.gpumem_torch_free(a, 2 * MiB, 0, None)
        b = lib.gpumem_torch_malloc(3 * MiB, 0, None)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "snap.pickle")
            snap = gpumem.torch.snapshot(path)
            with open(path, "rb") as f:
                self.assertEqual(pickle.load(f), snap)
            # The viewer's checks: segments tile, and the trace walks back to a consistent
            # state from them (tests/scripts/check_snapshot_structure.py).
            checker = os.path.join(HERE, "..", "scripts", "check_snapshot_structure.py")
            r = subprocess.run([sys.executable, checker, path], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("4 trace entries", r.stdout)
        trace = snap["device_traces"][0]
        self.assertEqual([(e["action"], e["addr"], e["size"]) for e in trace],
                         [("alloc", a, 2 * MiB), ("free_requested", a, 2 * MiB),
                          ("free_completed", a, 2 * MiB), ("alloc", b, 3 * MiB)])
        self.assertTrue(all(e["time_us"] > 1.5e15 and e["frames"] == [] for e in trace))
        live = {blk["address"] for seg in snap["segments"] for blk in seg["blocks"]
                if blk["state"] == "active_allocated"}
        self.assertTrue({early, b} <= live, (hex(early), hex(b), [hex(x) for x in live]))
        # The ring keeps the last max_entries (4) events, oldest first.
        lib.gpumem_torch_free(b, 3 * MiB, 0, None)
        lib.gpumem_torch_free(early, MiB, 0, None)  # recorded too: it is a free
        trace = gpumem.torch.snapshot()["device_traces"][0]
        # The last 4 events: free a, alloc b, free b, free early.
        self.assertEqual([(e["action"], e["addr"]) for e in trace],
                         [("free_requested", a), ("free_completed", a), ("alloc", b),
                          ("free_requested", b), ("free_completed", b),
                          ("free_requested", early), ("free_completed", early)])
        gpumem.torch.record_memory_history(None)
        c = lib.gpumem_torch_malloc(MiB, 0, None)  # stopped: not recorded
        lib.gpumem_torch_free(c, MiB, 0, None)
        self.assertEqual(len(gpumem.torch.snapshot()["device_traces"][0]), 7)
        with self.assertRaises(gpumem.InvalidArgumentError):
            gpumem.torch.record_memory_history(max_entries=0)

    def test_a_bad_device_is_refused(self):
        with self.assertRaises(ValueError):
            gpumem.torch.memory_stats("cpu")
        with self.assertRaises(gpumem.GpumemError):
            gpumem.torch.memory_stats(5)  # sim has one device


if __name__ == "__main__":
    unittest.main()
