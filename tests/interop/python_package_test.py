#!/usr/bin/env python3
"""python/gpumem through ctypes, on the sim device, without torch: Pool (allocations,
typed errors with gpumem's texts, stats, streams and record_stream, snapshot, counters),
the plug-in's PyTorch entry points called as PyTorch would call them, and gpumem.torch's
helpers. Run by ctest with PYTHONPATH=python, GPUMEM_LIB=<libgpumem_torch.so> and
GPUMEM_DEVICE=sim (so the plug-in's pools are sim pools)."""

import ctypes
import os
import pickle
import sys
import tempfile
import unittest

# The plug-in reads these when it creates device 0's pool (first use below).
os.environ["GPUMEM_ALLOCATOR"] = "caching_pool"
os.environ["GPUMEM_CONF"] = "limit:512M"
os.environ.setdefault("GPUMEM_DEVICE", "sim")
os.environ.setdefault("GPUMEM_SIM_DEVICES", "2")  # the shared sim device: two GPUs

import gpumem  # noqa: E402
import gpumem.torch  # noqa: E402  (must import without torch)
import gpumem.hf  # noqa: E402  (so must the Hugging Face cache, saying what it needs)

MiB = 1 << 20


class HfImportTest(unittest.TestCase):
    def test_the_cache_says_what_it_needs(self):
        if gpumem.hf._IMPORT_ERROR is None:
            self.skipTest("torch and transformers are installed")
        with self.assertRaisesRegex(ImportError, "needs torch and transformers"):
            gpumem.hf.GpumemCache(layout=None, kv_cache=None, config=object())


class PoolTest(unittest.TestCase):
    def setUp(self):
        self.pool = gpumem.Pool("limit:64M", allocator="vmm_page_pool", platform="sim")

    def tearDown(self):
        self.pool.close()

    def test_identity_and_version(self):
        self.assertEqual(self.pool.allocator, "vmm_page_pool")
        self.assertEqual(self.pool.platform, "sim")
        self.assertEqual(self.pool.device, 0)
        self.assertIn("limit:67108864", self.pool.config)
        major, minor, patch = (int(x) for x in gpumem.version().split("."))
        self.assertEqual(gpumem.load().gpumem_version_number(), major * 10000 + minor * 100 + patch)

    def test_malloc_free_stats(self):
        a = self.pool.malloc(3 * MiB)
        b = self.pool.malloc(1000)
        self.assertNotEqual(a, b)
        self.assertEqual(a % 256, 0)
        ctypes.memset(a, 0x7F, 3 * MiB)  # sim device memory is host memory
        self.assertEqual(ctypes.string_at(a + 3 * MiB - 1, 1), b"\x7f")
        s = self.pool.stats()
        self.assertEqual(s["live_bytes"], 3 * MiB + 1000)
        self.assertEqual(s["live_allocations"], 2)
        self.pool.free(a, 3 * MiB)
        self.pool.free(b, 1000)
        s = self.pool.stats()
        self.assertEqual(s["live_bytes"], 0)
        self.assertEqual(s["peak_live_bytes"], 3 * MiB + 1000)
        self.assertEqual((s["allocations"], s["deallocations"]), (2, 2))
        self.assertGreaterEqual(s["peak_reserved_bytes"], s["peak_live_bytes"])
        self.assertAlmostEqual(s["fragmentation"], s["peak_reserved_bytes"] / s["peak_live_bytes"])
        self.assertGreater(self.pool.trim(), 0)
        self.assertEqual(self.pool.stats()["reserved_bytes"], 0)

    def test_bad_free_is_refused_with_its_reason(self):
        a = self.pool.malloc(MiB)
        with self.assertRaises(gpumem.InvalidArgumentError) as e:
            self.pool.free(a, 2 * MiB)
        self.assertEqual(e.exception.status, gpumem.ERROR_INVALID_ARGUMENT)
        self.assertIn("size mismatch", str(e.exception))
        self.assertEqual(self.pool.stats()["live_allocations"], 1)  # still live
        self.pool.free(a, MiB)
        with self.assertRaises(gpumem.InvalidArgumentError) as e:
            self.pool.free(a, MiB)
        self.assertIn("double free", str(e.exception))
        self.assertIsInstance(e.exception, ValueError)

    def test_out_of_memory(self):
        keep = self.pool.malloc(MiB)
        with self.assertRaises(gpumem.OutOfMemoryError) as e:
            self.pool.malloc(100 * MiB)
        self.assertIsInstance(e.exception, MemoryError)
        self.assertEqual(e.exception.status, gpumem.ERROR_OUT_OF_MEMORY)
        self.assertIn("out of memory", str(e.exception))
        s = self.pool.stats()
        self.assertEqual((s["oom_count"], s["live_allocations"]), (1, 1))
        self.assertIn("could not allocate", self.pool.report(100 * MiB))
        text = self.pool.explain()
        self.assertIn("reserved for 1.00 MiB requested", text)
        self.assertIn("free, in pages shared with live blocks", text)
        self.pool.free(keep, MiB)

    def test_bad_config_and_closed_pool(self):
        with self.assertRaises(gpumem.InvalidArgumentError) as e:
            gpumem.Pool("colour:blue", platform="sim")
        self.assertIn("colour", str(e.exception))
        with self.assertRaises(gpumem.InvalidArgumentError):
            gpumem.Pool(allocator="bump", platform="sim")
        p = gpumem.Pool(platform="sim")
        p.close()
        with self.assertRaises(gpumem.InvalidArgumentError):
            p.malloc(16)

    def test_streams_and_record_stream(self):
        s = self.pool.stream_create()
        a = self.pool.malloc(MiB)
        self.pool.record_stream(a, s)
        self.pool.free(a, MiB)  # the default stream waits for s
        self.assertEqual(self.pool.stats()["cross_stream_waits"], 1)
        b = self.pool.malloc(MiB, stream=s)
        self.pool.free(b, MiB, stream=s)
        self.pool.stream_synchronize(s)
        self.pool.stream_destroy(s)

    def test_integers_that_ctypes_would_wrap_are_refused_before_the_call(self):
        # ctypes wraps: 2**64 + 100 would be 100 bytes, -1 would be 16384 PiB.
        cases = [
            (OverflowError, lambda: self.pool.malloc(2**64 + 100)),
            (ValueError, lambda: self.pool.malloc(-1)),
            (TypeError, lambda: self.pool.malloc(1.5)),
            (TypeError, lambda: self.pool.malloc("100")),
            (TypeError, lambda: self.pool.malloc(True)),
            (OverflowError, lambda: self.pool.malloc(MiB, alignment=2**64 + 256)),
            (ValueError, lambda: self.pool.malloc(MiB, alignment=-256)),
            (ValueError, lambda: self.pool.malloc(MiB, stream=-1)),
            (OverflowError, lambda: self.pool.malloc(MiB, stream=2**64)),
            (TypeError, lambda: self.pool.malloc(MiB, stream=1.0)),
            (OverflowError, lambda: self.pool.report(2**64)),
        ]
        for error, call in cases:
            with self.assertRaises(error) as e:
                call()
            self.assertIn("gpumem:", str(e.exception))
        self.assertIn("does not fit in 64 bits", self._message(lambda: self.pool.malloc(2**64 + 100)))
        self.assertIn("must not be negative", self._message(lambda: self.pool.malloc(-1)))
        s = self.pool.stats()
        self.assertEqual((s["allocations"], s["live_allocations"], s["reserved_bytes"]), (0, 0, 0))
        # A numpy-like integer (with __index__) is an integer.
        class Index:
            def __index__(self):
                return MiB
        a = self.pool.malloc(Index())
        # A free with a pointer, size or stream out of range changes nothing.
        for error, call in [(OverflowError, lambda: self.pool.free(a + 2**64, MiB)),
                            (ValueError, lambda: self.pool.free(-a, MiB)),
                            (OverflowError, lambda: self.pool.free(a, MiB + 2**64)),
                            (ValueError, lambda: self.pool.free(a, MiB, stream=-5)),
                            (OverflowError, lambda: self.pool.free(a, MiB, stream=2**64 + 1)),
                            (TypeError, lambda: self.pool.free(str(a), MiB)),
                            (OverflowError, lambda: self.pool.record_stream(a, 2**65)),
                            (ValueError, lambda: self.pool.record_stream(-a, None))]:
            with self.assertRaises(error):
                call()
        self.assertEqual(self.pool.stats()["live_allocations"], 1)
        self.pool.free(a, MiB)
        self.assertEqual(self.pool.stats()["live_allocations"], 0)

    @staticmethod
    def _message(call):
        try:
            call()
        except Exception as e:  # noqa: BLE001  (the message is what is checked)
            return str(e)
        return ""

    def test_a_stream_the_platform_refuses_changes_nothing(self):
        a = self.pool.malloc(MiB)
        with self.assertRaises(gpumem.InvalidArgumentError) as e:
            self.pool.record_stream(a, 12345)
        self.assertIn("0x3039", str(e.exception))
        s = self.pool.stream_create()
        self.pool.record_stream(a, s)
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.pool.free(a, MiB, stream=12345)
        self.assertEqual(self.pool.stats()["live_allocations"], 1)
        self.pool.free(a, MiB)
        self.assertEqual(self.pool.stats()["live_allocations"], 0)
        b = self.pool.malloc(MiB)
        self.pool.free(b, MiB)
        self.pool.stream_destroy(s)

    def test_a_free_on_a_stream_the_platform_refuses_changes_nothing(self):
        # Needs the pool to refuse a stream the platform refuses (not the C API alone).
        a = self.pool.malloc(3 * MiB)
        with self.assertRaises(gpumem.GpumemError):
            self.pool.free(a, 3 * MiB, stream=12345)
        self.assertEqual(self.pool.stats()["live_allocations"], 1)
        self.pool.free(a, 3 * MiB)
        b = self.pool.malloc(5 * MiB)
        self.pool.free(b, 5 * MiB)
        self.pool.trim()

    def test_record_stream_refuses_a_freed_pointer(self):
        s = self.pool.stream_create()
        a = self.pool.malloc(MiB)
        self.pool.free(a, MiB)
        with self.assertRaises(gpumem.InvalidArgumentError) as e:
            self.pool.record_stream(a, s)
        self.assertIn("not a live allocation", str(e.exception))
        self.pool.stream_destroy(s)

    def test_text_with_a_nul_inside_is_refused(self):
        for call in [lambda: gpumem.Pool("limit:64M\0limit:1K", platform="sim"),
                     lambda: gpumem.Pool(allocator="caching_pool\0x", platform="sim"),
                     lambda: gpumem.Pool(platform="sim\0cuda"),
                     lambda: self.pool.counter("cuMemMap\0.ns"),
                     lambda: self.pool.snapshot(os.path.join(tempfile.gettempdir(), "a\0b"))]:
            with self.assertRaises(ValueError) as e:
                call()
            self.assertIn("NUL", str(e.exception))
        for call, error in [(lambda: gpumem.Pool(device=-1, platform="sim"), ValueError),
                            (lambda: gpumem.Pool(device=2**40, platform="sim"), OverflowError),
                            (lambda: gpumem.Pool(device=0.5, platform="sim"), TypeError),
                            (lambda: gpumem.Pool(b"limit:1G", platform="sim"), TypeError)]:
            with self.assertRaises(error):
                call()

    def test_counters(self):
        a = self.pool.malloc(3 * MiB)
        c = self.pool.counters()
        self.assertGreaterEqual(c["pages_mapped"], 2)
        self.assertGreaterEqual(c["cuMemMap"], 1)
        self.assertGreater(c["cuMemMap.ns"], 0)
        self.assertGreaterEqual(c["driver_ns"], c["cuMemMap.ns"] + c["cuMemSetAccess.ns"])
        # Lifetime hints serve footprint:tight alone (the default, footprint:fast, places a
        # repeated loop's blocks where the last pass did); one request is never guessed
        # long-lived.
        self.assertEqual(c["lifetime_hints_active"], 0)
        self.assertEqual(c["long_lived_allocations"], 0)
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.pool.counter("no_such_counter")
        self.pool.free(a, 3 * MiB)
        tight = gpumem.Pool("limit:64M,footprint:tight", allocator="vmm_page_pool", platform="sim")
        try:
            b = tight.malloc(3 * MiB)
            c = tight.counters()
            self.assertEqual(c["lifetime_hints_active"], 1)
            self.assertEqual(c["long_lived_allocations"], 0)
            tight.free(b, 3 * MiB)
        finally:
            tight.close()

    def test_mark_step_serves_equal_steps_from_a_plan(self):
        for _ in range(5):
            self.pool.mark_step()
            a = self.pool.malloc(3 * MiB)
            b = self.pool.malloc(1000)
            self.pool.free(b, 1000)
            self.pool.free(a, 3 * MiB)
        c = self.pool.counters(["plans_built", "planned_steps", "planned_allocations"])
        self.assertEqual(c["plans_built"], 1)
        self.assertEqual(c["planned_steps"], 3)  # marks 3, 4 and 5
        self.assertEqual(c["planned_allocations"], 3 * 2)
        self.assertEqual(self.pool.stats()["live_bytes"], 0)

    def test_snapshot(self):
        a = self.pool.malloc(3 * MiB)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "snap.pickle")
            try:
                self.pool.snapshot(path)
            except gpumem.NotSupportedError as e:
                self.assertIn("snapshot", str(e))
            else:
                with open(path, "rb") as f:
                    data = pickle.load(f)
                blocks = [b for seg in data["segments"] for b in seg["blocks"]
                          if b["state"] == "active_allocated"]
                self.assertEqual([b["requested_size"] for b in blocks], [3 * MiB])
            with self.assertRaises(gpumem.InvalidArgumentError):
                self.pool.snapshot("")
        self.pool.free(a, 3 * MiB)

    def test_load_refuses_a_missing_library(self):
        with self.assertRaises(OSError) as e:
            gpumem.load("/nonexistent/libgpumem_torch.so")
        self.assertIn("GPUMEM_LIB", str(e.exception))


class MultiDeviceTest(unittest.TestCase):
    """One pool per device of the shared two-GPU sim device (GPUMEM_SIM_DEVICES=2)."""

    def setUp(self):
        self.on0 = gpumem.Pool("limit:64M", platform="sim", device=0)
        self.on1 = gpumem.Pool("limit:64M", platform="sim", device=1)

    def tearDown(self):
        self.on0.close()
        self.on1.close()

    def test_a_pool_per_device_refuses_another_devices_pointer_and_stream(self):
        self.assertEqual((self.on0.device, self.on1.device), (0, 1))
        with self.assertRaises(gpumem.InvalidArgumentError):
            gpumem.Pool(platform="sim", device=2)
        stream1 = self.on1.stream_create()
        self.assertEqual(self.on0.stream_device(stream1), 1)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "belongs to device 1"):
            self.on0.malloc(MiB, stream=stream1)
        p = self.on0.malloc(MiB)
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.on1.free(p, MiB)  # device 0's pointer on device 1's pool
        self.assertEqual(self.on0.stats()["live_bytes"], MiB)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "belongs to device 1"):
            self.on0.record_stream(p, stream1)
        self.on0.free(p, MiB)
        q = self.on1.malloc(MiB, stream=stream1)
        self.on1.free(q, MiB, stream=stream1)
        self.on1.stream_destroy(stream1)

    def test_peer_access_and_a_pair_without_a_peer_path(self):
        with gpumem.Pool("sim_devices:2,sim_capacity:128M,peer_access:1") as pool:
            self.assertIn("peer_access:1", pool.config)
            p = pool.malloc(2 * MiB)
            pool.free(p, 2 * MiB)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "cannot reach"):
            gpumem.Pool("sim_devices:2,sim_no_peer:0-1,peer_access:1")
        gpumem.check_config("peer_access:1+2,device:1")  # text fit for a multi-GPU machine
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "peer_access"):
            gpumem.check_config("peer_access:x")
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "sim_devices"):
            gpumem.check_config("bogus:1")  # the message lists the C API's keys too


def _plugin_entry_points():
    """The library, with the signatures of the entry points PyTorch calls declared."""
    lib = gpumem.load()
    lib.gpumem_torch_malloc.restype = ctypes.c_void_p
    lib.gpumem_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.gpumem_torch_free.restype = None
    lib.gpumem_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                                      ctypes.c_void_p]
    return lib


class TorchPluginTest(unittest.TestCase):
    """The entry points PyTorch calls, driven as CUDAPluggableAllocator drives them."""

    def test_malloc_free_as_pytorch_calls_them(self):
        lib = _plugin_entry_points()
        failures = gpumem.torch.failures()
        self.assertIsNone(lib.gpumem_torch_malloc(0, 0, None))  # empty tensor: no memory
        self.assertEqual(gpumem.torch.failures(), failures)
        p = lib.gpumem_torch_malloc(5 * MiB, 0, None)
        self.assertTrue(p)
        pool = gpumem.torch.pool(0)
        # GPUMEM_ALLOCATOR and GPUMEM_CONF chose the pool.
        self.assertEqual((pool.allocator, pool.platform), ("caching_pool", "sim"))
        self.assertIn("limit:536870912", pool.config)
        self.assertEqual(gpumem.torch.stats(0)["live_bytes"], 5 * MiB)
        lib.gpumem_torch_free(p, 5 * MiB, 0, None)
        self.assertEqual(gpumem.torch.stats(0)["live_bytes"], 0)
        self.assertGreater(gpumem.torch.empty_cache(), 0)  # the freed segment goes back
        self.assertEqual(gpumem.torch.stats(0)["reserved_bytes"], 0)
        # The set_reset_fn entry (torch.cuda.empty_cache()) does the same.
        p = lib.gpumem_torch_malloc(5 * MiB, 0, None)
        lib.gpumem_torch_free(p, 5 * MiB, 0, None)
        self.assertGreater(gpumem.torch.stats(0)["reserved_bytes"], 0)
        lib.gpumem_torch_reset()
        self.assertEqual(gpumem.torch.stats(0)["reserved_bytes"], 0)
        # A failed free is counted and printed on stderr (PyTorch frees from destructors).
        # A failed malloc throws a C++ exception, which ctypes cannot carry: it is tested in
        # C++ (tests/interop/torch_plugin_test.cpp).
        lib.gpumem_torch_free(p, 5 * MiB, 0, None)  # double free
        self.assertEqual(gpumem.torch.failures(), failures + 1)
        # No pool for a device the sim device lacks: creation fails (it has two).
        with self.assertRaises(gpumem.GpumemError):
            gpumem.torch.stats(3)

    def test_out_of_memory_error_names_what_the_build_raises(self):
        # ctest passes what this build's plug-in must raise (tests/interop/CMakeLists.txt).
        self.assertEqual(gpumem.torch.out_of_memory_error(),
                         os.environ.get("GPUMEM_EXPECTED_OOM", "RuntimeError"))

    def test_mark_step_reaches_the_plugin_pools(self):
        lib = _plugin_entry_points()
        before = gpumem.torch.counters(0, ["planned_allocations"])["planned_allocations"]
        for _ in range(4):
            gpumem.torch.mark_step()
            p = lib.gpumem_torch_malloc(2 * MiB, 0, None)
            lib.gpumem_torch_free(p, 2 * MiB, 0, None)
        after = gpumem.torch.counters(0, ["planned_allocations"])["planned_allocations"]
        self.assertEqual(after - before, 2)  # steps 3 and 4, after two alike

    def test_enable_needs_torch(self):
        try:
            import torch  # noqa: F401
        except ImportError:
            with self.assertRaises(ImportError):
                gpumem.torch.enable()
        else:
            self.skipTest("torch is installed: enable() is exercised by scripts/torch_proof.py")


class IpcReceiveTest(unittest.TestCase):
    """gpumem.ipc.Handle.receive against messages that are not Handle.send's: each raises
    InvalidArgumentError, and no descriptor it carried stays open."""

    @staticmethod
    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    def receive(self, payload, count):
        import socket
        import gpumem.ipc
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            before = self.open_fds()
            sent = [os.open("/dev/null", os.O_RDONLY) for _ in range(count)]
            socket.send_fds(a, [payload], sent)
            for fd in sent:
                os.close(fd)
            try:
                return gpumem.ipc.Handle.receive(b)
            finally:
                self.after = self.open_fds() - before
        finally:
            a.close()
            b.close()

    def refused(self, payload, count, says):
        with self.assertRaises(gpumem.InvalidArgumentError) as e:
            self.receive(payload, count)
        self.assertIn(says, str(e.exception))
        self.assertEqual(self.after, 0, "descriptors left open by: %r" % (payload,))

    def test_a_message_of_send_is_received(self):
        import gpumem.ipc
        h = gpumem.ipc.Handle(-1, 4096, "float32", (2, 512), 0)
        meta = h._meta()  # pylint: disable=protected-access
        got = self.receive(len(meta).to_bytes(4, "little") + meta, 1)
        self.assertEqual((got.size, got.dtype, got.shape, got.device), (4096, "float32", (2, 512), 0))
        self.assertEqual(self.after, 1)
        got.close()

    def test_malformed_metadata_is_refused_and_closes_the_descriptor(self):
        def framed(text):
            return len(text).to_bytes(4, "little") + text
        self.refused(framed(b"(1, 'float32', (2,), 0"), 1, "not JSON text")
        self.refused(framed(b"__import__('os')"), 1, "not JSON text")
        self.refused(framed(b"\xff\xfe"), 1, "not JSON text")
        self.refused(framed(b"[" * 5000 + b"]" * 5000), 1, "metadata")
        self.refused(framed(b'{"size": 1}'), 1, "not [size, dtype, shape, device]")
        self.refused(framed(b'[-1, "float32", [2], 0]'), 1, "size -1")
        self.refused(framed(b'[8, "os.system", [2], 0]'), 1, "dtype 'os.system'")
        self.refused(framed(b'[8, "float32", [2, true], 0]'), 1, "shape")
        self.refused(framed(b'[8, "float32", [2], 99999]'), 1, "device 99999")
        self.refused(b"\x10\x00", 1, "shorter than its 4-byte length")
        self.refused(framed(b"[8]")[:-1], 1, "its length says")
        self.refused(framed(b'[8, "float32", [2], 0]'), 0, "received 0")
        self.refused(framed(b'[8, "float32", [2], 0]'), 2, "received 2")
        self.refused(framed(b'[8, "float32", [2], 0]'), 12, "cut short")


if __name__ == "__main__":
    unittest.main(verbosity=2)
