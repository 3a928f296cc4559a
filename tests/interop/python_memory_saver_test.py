"""gpumem.memory_saver (torch_memory_saver's interface on gpumem's tags) on the sim device,
without torch: its tags served by a gpumem.Pool. Regions route allocations to one gpumem tag
per (tag, cpu backup); pause releases every page (offloading the backed-up tags, dropping the
rest) and resume restores them at the same addresses, the backed-up bytes intact and the
host copy given back unless retained; a pause or resume of one tag leaves the others; a
double pause or a resume of nothing is refused with nothing changed; a resume without room
raises and resumes once there is room; memory_margin_bytes keeps that much of the device
free (gpumem's keep_free); disable() allocates untagged; the features gpumem does not offer
are refused by name; install() makes `import torch_memory_saver` find it.

    python tests/interop/python_memory_saver_test.py     # GPUMEM_LIB, PYTHONPATH as ctest's
"""
import contextlib
import ctypes
import os
import sys
import unittest

import gpumem
import gpumem.memory_saver as ms

MIB = 1 << 20


class PoolTags:
    """gpumem.torch's tag functions over a sim Pool; alloc() allocates in the current tag,
    as PyTorch's requests do through the plug-in."""

    def __init__(self, pool):
        self.pool = pool
        self.lib = gpumem.load()

    @contextlib.contextmanager
    def tag(self, name):
        previous = self.lib.gpumem_set_current_tag(gpumem.tag_id(name))
        try:
            yield
        finally:
            self.lib.gpumem_set_current_tag(previous)

    def alloc(self, nbytes):
        return self.pool.malloc_tagged(nbytes, self.lib.gpumem_current_tag())

    def sleep(self, name, mode):
        self.pool.sleep(name, mode)

    def wake(self, name):
        self.pool.wake(name)

    def asleep(self, name):
        return self.pool.asleep(name)

    def tag_used(self, name):
        return self.pool.tag_stats(name)["allocations"] > 0

    def release_host(self, name):
        return self.pool.release_host(name)

    def host_bytes(self, name):
        return self.pool.host_bytes(name)

    def set_keep_free(self, nbytes):
        self.pool.set_keep_free(nbytes)


def fill(ptr, nbytes, byte):
    ctypes.memset(ptr, byte, nbytes)


def holds(ptr, nbytes, byte):
    return ctypes.string_at(ptr, nbytes) == bytes([byte]) * nbytes


class MemorySaverTest(unittest.TestCase):
    def setUp(self):
        self.pool = gpumem.Pool("sim_capacity:256M", allocator="vmm_page_pool", platform="sim")
        self.tags = PoolTags(self.pool)
        self.saver = ms.TorchMemorySaver(self.tags)

    def tearDown(self):
        self.pool.close()

    def region_alloc(self, nbytes, byte, **region):
        with self.saver.region(**region):
            p = self.tags.alloc(nbytes)
        fill(p, nbytes, byte)
        return p

    def test_pause_and_resume_every_tag_keep_addresses_and_backed_up_bytes(self):
        kv = self.region_alloc(8 * MIB, 0x11, tag="kv_cache")
        weights = self.region_alloc(6 * MIB, 0x22, tag="weights", enable_cpu_backup=True)
        self.assertEqual(self.pool.tag_stats("tms/kv_cache")["live_bytes"], 8 * MIB)
        self.assertEqual(self.pool.tag_stats("tms/weights/cpu")["live_bytes"], 6 * MIB)
        free_before, _ = self.pool.device_memory()
        self.saver.pause()
        free_paused, _ = self.pool.device_memory()
        self.assertGreaterEqual(free_paused - free_before, 14 * MIB)
        self.assertTrue(self.pool.asleep("tms/kv_cache"))
        self.assertTrue(self.pool.asleep("tms/weights/cpu"))
        self.assertEqual(self.pool.host_bytes("tms/kv_cache"), 0, "no backup: nothing copied")
        self.assertGreaterEqual(self.pool.host_bytes("tms/weights/cpu"), 6 * MIB)
        self.saver.resume()
        self.pool.stream_synchronize()
        self.assertTrue(holds(weights, 6 * MIB, 0x22))
        self.assertEqual(self.pool.host_bytes("tms/weights/cpu"), 0, "given back on resume")
        fill(kv, 8 * MIB, 0x33)  # mapped again at the same address
        self.assertTrue(holds(kv, 8 * MIB, 0x33))
        # Retained: the host copy stays for the next pause.
        self.saver.retain_cpu_backup = True
        self.assertTrue(self.saver.retain_cpu_backup)
        self.saver.pause("weights")
        self.assertFalse(self.pool.asleep("tms/kv_cache"), "another tag is left as it was")
        self.saver.resume("weights")
        self.pool.stream_synchronize()
        self.assertTrue(holds(weights, 6 * MIB, 0x22))
        self.assertGreaterEqual(self.pool.host_bytes("tms/weights/cpu"), 6 * MIB)
        self.pool.free(kv, 8 * MIB)
        self.pool.free(weights, 6 * MIB)

    def test_double_pause_and_resume_of_nothing_are_refused_and_change_nothing(self):
        a = self.region_alloc(4 * MIB, 0x44, tag="a", enable_cpu_backup=True)
        b = self.region_alloc(4 * MIB, 0x55, tag="b")
        self.saver.pause("a")
        with self.assertRaises(gpumem.InvalidArgumentError) as err:
            self.saver.pause()  # "a" is paused already: "b" must not pause either
        self.assertIn("tms/a/cpu is paused already", str(err.exception))
        self.assertFalse(self.pool.asleep("tms/b"))
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.saver.resume("b")
        self.saver.pause("never-used")  # nothing of it: nothing to do, as torch_memory_saver
        with self.assertRaises(gpumem.InvalidArgumentError):
            self.saver.resume("never-used")
        with self.saver.region(tag="a", enable_cpu_backup=True):
            with self.assertRaises(gpumem.InvalidArgumentError):
                self.tags.alloc(MIB)  # in a paused tag
        self.saver.resume()  # what is paused: "a"
        self.pool.stream_synchronize()
        self.assertTrue(holds(a, 4 * MIB, 0x44))
        self.pool.free(a, 4 * MIB)
        self.pool.free(b, 4 * MIB)

    def test_a_resume_without_room_raises_and_resumes_once_there_is_room(self):
        w = self.region_alloc(16 * MIB, 0x66, tag="w", enable_cpu_backup=True)
        self.saver.pause()
        free, _ = self.pool.device_memory()
        filler = self.pool.malloc(free - 4 * MIB)
        with self.assertRaises(gpumem.OutOfMemoryError):
            self.saver.resume()
        self.assertTrue(self.pool.asleep("tms/w/cpu"))
        self.assertGreaterEqual(self.pool.host_bytes("tms/w/cpu"), 16 * MIB, "bytes on the host")
        self.pool.free(filler, free - 4 * MIB)
        self.saver.resume()
        self.pool.stream_synchronize()
        self.assertTrue(holds(w, 16 * MIB, 0x66))
        self.pool.free(w, 16 * MIB)

    def test_disable_allocates_untagged_inside_a_region(self):
        with self.saver.region(tag="r"):
            inside = self.tags.alloc(MIB)
            with self.saver.disable():
                untagged = self.tags.alloc(MIB)
        self.assertEqual(self.pool.tag_stats("tms/r")["live_bytes"], MIB)
        self.saver.pause()
        fill(untagged, MIB, 0x77)  # untagged memory stays mapped
        self.assertTrue(holds(untagged, MIB, 0x77))
        self.saver.resume()
        self.pool.free(inside, MIB)
        self.pool.free(untagged, MIB)

    def test_memory_margin_bytes_keeps_that_much_of_the_device_free(self):
        free, _ = self.pool.device_memory()
        self.saver.memory_margin_bytes = free - 8 * MIB
        with self.assertRaises(gpumem.OutOfMemoryError) as err:
            self.region_alloc(16 * MIB, 0x12, tag="m")
        self.assertIn("keep_free", str(err.exception))
        with self.assertRaises(NotImplementedError):
            _ = self.saver.memory_margin_bytes
        with self.assertRaises(ValueError):
            self.saver.memory_margin_bytes = -1
        self.saver.memory_margin_bytes = 0
        p = self.region_alloc(16 * MIB, 0x12, tag="m")
        self.assertTrue(holds(p, 16 * MIB, 0x12))
        self.pool.free(p, 16 * MIB)

    def test_what_gpumem_does_not_offer_is_refused_by_name(self):
        with self.assertRaises(gpumem.NotSupportedError):
            with self.saver.region(tag="d", enable_disk_backup=True):
                pass
        with self.assertRaises(gpumem.NotSupportedError):
            self.saver.get_cpu_backup(None)
        with self.assertRaises(gpumem.NotSupportedError):
            self.saver.set_disk_backup_dir("/tmp")
        with self.assertRaises(ValueError):
            with self.saver.region(cpu_backup_backend="mmap"):  # without a backup
                pass
        with self.assertRaises(ValueError):
            with self.saver.region(enable_cpu_backup=True, cpu_backup_backend="disk"):
                pass
        with self.assertRaises(ValueError):
            self.saver.hook_mode = "ld"
        self.saver.hook_mode = "preload"
        with self.assertRaises(AttributeError):
            _ = self.saver.hook_mode
        with self.assertRaises(ValueError):
            with self.saver.region(tag="x" * 80):  # over gpumem's 64-character tag names
                pass
        self.assertTrue(self.saver.enabled)

    def test_install_and_configure_subprocess(self):
        ms.install()
        import torch_memory_saver  # pylint: disable=import-outside-toplevel
        self.assertIs(torch_memory_saver, ms)
        self.assertIsInstance(torch_memory_saver.torch_memory_saver, ms.TorchMemorySaver)
        before = os.environ.get("GPUMEM_ENABLE")
        with torch_memory_saver.configure_subprocess():
            self.assertEqual(os.environ["GPUMEM_ENABLE"], "1")
        self.assertEqual(os.environ.get("GPUMEM_ENABLE"), before)
        del sys.modules["torch_memory_saver"]


if __name__ == "__main__":
    unittest.main()
