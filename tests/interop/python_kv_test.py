#!/usr/bin/env python3
"""gpumem.kv through ctypes on the sim device, without torch: sequences, prefix sharing,
fork with copy on write, swap, block tables, the storage view's __cuda_array_interface__
(its strides address the bytes the C API's layout says: sim device memory is host memory),
stale block tables, a view kept after close(), and bad input (layout mismatch, append past
the maximum, a freed sequence). Run by ctest with PYTHONPATH=python and GPUMEM_LIB."""

import ctypes
import gc
import os
import sys
import unittest
import warnings
import weakref

os.environ.setdefault("GPUMEM_DEVICE", "sim")

import gpumem  # noqa: E402
import gpumem.kv as kv  # noqa: E402


def make_cache(**kw):
    pool = gpumem.Pool("sim_capacity:1G", allocator="vmm_page_pool", platform="sim")
    args = dict(layers=2, kv_heads=2, head_dim=64, dtype="f16", block_tokens=16, pool=pool,
                max_blocks=256, max_sequence_tokens=1000)
    args.update(kw)
    return kv.KVCache(**args), pool


def slot_address(view, block, layer, which, token, head, dim):
    """The byte address of one element by the view's __cuda_array_interface__."""
    cai = view.__cuda_array_interface__
    idx = (block, layer, which, token, head, dim)
    return cai["data"][0] + sum(i * s for i, s in zip(idx, cai["strides"]))


def put(view, table, pos, value, layer=1, which=1):
    bt = view.shape[3]
    addr = slot_address(view, table[pos // bt], layer, which, pos % bt, 1, 3)
    ctypes.c_uint16.from_address(addr).value = value


def get(view, table, pos, layer=1, which=1):
    bt = view.shape[3]
    addr = slot_address(view, table[pos // bt], layer, which, pos % bt, 1, 3)
    return ctypes.c_uint16.from_address(addr).value


class KVCacheTest(unittest.TestCase):
    def setUp(self):
        self.cache, self.pool = make_cache()

    def tearDown(self):
        self.cache.close()
        gc.collect()
        self.pool.close()

    def test_view_layout_matches_the_documented_strides(self):
        view = self.cache.storage_view()
        cai = view.__cuda_array_interface__
        self.assertEqual(cai["version"], 3)
        self.assertEqual(cai["shape"], (256, 2, 2, 16, 2, 64))
        self.assertEqual(cai["typestr"], "<f2")
        head, token = 64 * 2, 2 * 64 * 2
        kvs = 16 * token
        self.assertEqual(cai["strides"], (2 * 2 * kvs, 2 * kvs, kvs, token, head, 2))
        st = self.cache.storage()
        self.assertEqual(cai["data"], (st["base"], False))
        self.assertEqual(st["block_stride"], self.cache.layout.block_bytes)
        self.assertGreaterEqual(st["capacity_blocks"], 1)  # initial_blocks=1 maps one
        self.assertIsNone(cai["stream"])
        bf16, _ = make_cache(dtype="bf16")
        self.assertEqual(bf16.storage_view().__cuda_array_interface__["typestr"], "<i2")
        bf16.close()

    def test_prefix_fork_copy_on_write_and_swap_keep_bytes(self):
        c = self.cache
        view = c.storage_view()
        prompt = list(range(100, 140))
        a, cached = c.add_sequence(prompt)
        self.assertEqual(cached, 0)
        table = c.block_table(a)
        self.assertEqual(len(table), 3)
        for pos in range(40):
            put(view, table, pos, 1000 + pos)
        b, cached = c.add_sequence(prompt)
        self.assertEqual(cached, 32)
        self.assertEqual(c.block_table(b)[:2], table[:2])
        self.assertEqual(get(view, c.block_table(b), 20), 1020)
        c.free(b)

        child = c.fork(a)
        self.assertEqual(c.block_table(child), table)
        c.append(child, [7])
        c.synchronize()
        ct = c.block_table(child)
        self.assertNotEqual(ct[2], table[2])
        self.assertEqual(get(view, ct, 39), 1039)
        put(view, ct, 40, 4242)
        self.assertEqual(get(view, table, 39), 1039)  # the parent's block untouched

        c.swap_out(child)
        self.assertTrue(c.is_swapped(child))
        self.assertEqual(c.block_table(child)[2], kv.NOT_RESIDENT)
        with self.assertRaises(gpumem.InvalidArgumentError):
            c.block_tables([child])  # a kernel cannot read a swapped-out sequence
        c.swap_in(child)
        c.synchronize()
        ct = c.block_table(child)
        self.assertEqual((get(view, ct, 38), get(view, ct, 40)), (1038, 4242))
        s = c.stats()
        self.assertEqual((s["cow_copies"], s["swaps_out"], s["swaps_in"]), (1, 1, 1))
        self.assertEqual(s["prefix_hits"], 2)
        self.assertEqual(c.validate(), "")

    def test_block_tables_for_a_decode_step(self):
        c = self.cache
        a, _ = c.add_sequence(range(20))
        b, _ = c.add_sequence(range(50, 53), salt=1)
        c.append_each([a, b], [1, 2])
        t = c.block_tables([a, b], row_blocks=4, pad=0)
        self.assertEqual(list(t.lengths), [21, 4])
        rows = t.table()
        self.assertEqual(rows[0][:2], c.block_table(a))
        self.assertEqual(rows[1], c.block_table(b) + [0, 0, 0])
        c.check_tables(t)
        auto = c.block_tables([a, b])
        self.assertEqual(auto.row_blocks, 2)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "a row holds 1"):
            c.block_tables([a, b], row_blocks=1)

    def test_stale_block_tables_are_detected(self):
        c = self.cache
        a, _ = c.add_sequence(range(10))
        b, _ = c.add_sequence(range(10), salt=2)
        t = c.block_tables([a, b])
        c.append(a, [1])
        with self.assertRaisesRegex(kv.StaleBlockTableError, "sequence %d changed" % a):
            c.check_tables(t)
        t = c.block_tables([a, b])
        c.free(b)
        with self.assertRaisesRegex(kv.StaleBlockTableError, "sequence %d was freed" % b):
            c.check_tables(t)

    def test_freed_sequence_is_refused(self):
        c = self.cache
        a, _ = c.add_sequence(range(5))
        c.free(a)
        for call in (lambda: c.block_table(a), lambda: c.block_tables([a]),
                     lambda: c.append(a, [1]), lambda: c.fork(a), lambda: c.free(a),
                     lambda: c.generation(a)):
            with self.assertRaisesRegex(gpumem.InvalidArgumentError, "was freed"):
                call()
        self.assertEqual(c.stats()["sequences"], 0)

    def test_append_past_the_maximum_changes_nothing(self):
        c = self.cache
        a, _ = c.add_sequence(range(990))
        before = c.stats()
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "max_sequence_tokens 1000"):
            c.append(a, range(11))
        self.assertEqual(c.sequence_tokens(a), 990)
        self.assertEqual(c.stats()["used_blocks"], before["used_blocks"])
        c.append(a, range(10))
        with self.assertRaises(gpumem.InvalidArgumentError):
            c.add_sequence(range(1001))

    def test_sequence_ids_are_checked_before_any_call(self):
        """An id past 64 bits is refused, never wrapped onto another sequence; a non-integer
        (float, bool, str) is a TypeError, never truncated. Nothing changes."""
        c = self.cache
        a, _ = c.add_sequence(range(20))
        b, _ = c.add_sequence(range(100, 105))
        before = c.stats()
        wrapped = (1 << 64) + a
        calls = {
            "free": lambda s: c.free(s), "fork": lambda s: c.fork(s),
            "append": lambda s: c.append(s, [1]), "append_each": lambda s: c.append_each([s], [1]),
            "block_tables": lambda s: c.block_tables([s]), "block_table": lambda s: c.block_table(s),
            "swap_out": lambda s: c.swap_out(s), "swap_in": lambda s: c.swap_in(s),
            "is_swapped": lambda s: c.is_swapped(s), "sequence_tokens": lambda s: c.sequence_tokens(s),
            "blocks_needed": lambda s: c.blocks_needed(s, 1), "generation": lambda s: c.generation(s),
        }
        for name, call in calls.items():
            with self.subTest(call=name):
                with self.assertRaisesRegex(gpumem.InvalidArgumentError,
                                            r"sequence id(\[0\])? %d is outside 0\.\.%d"
                                            % (wrapped, (1 << 64) - 1)):
                    call(wrapped)
                with self.assertRaisesRegex(gpumem.InvalidArgumentError, r"sequence id(\[0\])? -1 is outside"):
                    call(-1)
                for bad in (float(a), a + 0.5, True, str(a), None):
                    with self.assertRaisesRegex(TypeError, "sequence id.* must be an integer"):
                        call(bad)
        self.assertEqual(c.stats(), before)
        self.assertEqual(c.sequence_tokens(a), 20)
        self.assertEqual(c.validate(), "")

        class Index:  # numpy and torch integer scalars: __index__
            def __index__(self):
                return a
        self.assertEqual(c.sequence_tokens(Index()), 20)
        c.append_each([Index(), b], [7, 8])
        self.assertEqual((c.sequence_tokens(a), c.sequence_tokens(b)), (21, 6))

    def test_token_ids_and_counts_are_checked_before_any_call(self):
        c = self.cache
        a, _ = c.add_sequence(range(20))
        before = c.stats()
        for bad in ([1.5], [True], ["3"], [None]):
            with self.assertRaisesRegex(TypeError, r"token\[0\] must be an integer"):
                c.append(a, bad)
        with self.assertRaisesRegex(TypeError, r"token\[1\]"):
            c.add_sequence([1, 2.0])
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, r"token\[0\] 2147483648 is outside"):
            c.append(a, [1 << 31])
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "token\\[1\\] -2147483649"):
            c.append_each([a, a], [1, -(1 << 31) - 1])
        c.append(a, [-(1 << 31), (1 << 31) - 1])  # the int32 range itself
        self.assertEqual(c.sequence_tokens(a), 22)
        # Counts: past the C type refused in Python; within it, past the cache's limit
        # refused by the cache naming the limit, never wrapped.
        for count in (-1, 1 << 64):
            with self.assertRaisesRegex(gpumem.InvalidArgumentError, "tokens -?[0-9]+ is outside"):
                c.blocks_needed(a, count)
        for count in ((1 << 64) - 1, (1 << 64) - 16, 1000 - 22 + 1):
            with self.assertRaisesRegex(gpumem.InvalidArgumentError, "max_sequence_tokens 1000"):
                c.blocks_needed(a, count)
        self.assertEqual(c.blocks_needed(a, 1000 - 22), 61)
        for call in (lambda: c.evict(-1), lambda: c.shrink(1 << 64), lambda: c.block_tables([a], row_blocks=-1),
                     lambda: c.block_tables([a], pad=1 << 32)):
            with self.assertRaises(gpumem.InvalidArgumentError):
                call()
        with self.assertRaises(TypeError):
            c.evict(1.0)
        with self.assertRaises(TypeError):
            c.layer_views(0.5)
        self.assertEqual(c.shrink((1 << 64) - 1), 0)  # keep_free at its top keeps every page
        self.assertEqual(c.stats()["used_blocks"], before["used_blocks"])
        self.assertEqual(c.validate(), "")

    def test_pool_close_is_refused_while_a_cache_stands_on_it(self):
        c, pool = make_cache()
        a, _ = c.add_sequence(range(40))
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "still has 1 KV cache"):
            pool.close()
        self.assertEqual(len(c.block_table(a)), 3)  # the cache still works
        c.append(a, [1])
        ptr = pool.malloc(1 << 20)  # and so does the pool
        pool.free(ptr, 1 << 20)
        c.close()
        gc.collect()
        pool.close()
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "closed"):
            pool.handle

    def test_a_bogus_stream_is_refused_at_create(self):
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "not a stream the platform knows"):
            make_cache(stream=0x5EED)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "not a stream the platform knows"):
            kv.VirtualSequences(layers=2, kv_heads=2, head_dim=64, dtype="f16", stream=0x5EED,
                                pool=self.pool)

    def test_layout_mismatch_names_the_fields(self):
        c = self.cache
        c.check_layout(2, 2, 64, "float16")
        with self.assertRaisesRegex(gpumem.InvalidArgumentError,
                                    r"head_dim 128 \(the cache has 64\).*dtype bf16"):
            c.check_layout(2, 2, 128, "torch.bfloat16")
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "unknown KV dtype"):
            c.check_layout(2, 2, 64, "int4")

    def test_bad_configurations(self):
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "bad layout"):
            make_cache(kv_heads=0)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "vmm_page_pool"):
            caching = gpumem.Pool("sim_capacity:1G", allocator="caching_pool", platform="sim")
            try:
                kv.KVCache(layers=1, kv_heads=1, head_dim=128, pool=caching)
            finally:
                caching.close()
        with self.assertRaises(gpumem.InvalidArgumentError):
            kv.KVCache(layers=2)
        with self.assertRaises(ValueError):
            kv.Layout(-1, 2, 64)

    def test_out_of_blocks_is_typed(self):
        c = self.cache
        for salt in range(5):
            try:
                c.add_sequence(range(1000), salt=salt)
            except gpumem.OutOfMemoryError as e:
                self.assertIn("out of blocks", str(e))
                break
        else:
            self.fail("256 blocks cannot hold five 63-block sequences")
        self.assertEqual(c.validate(), "")

    def test_view_outlives_close_and_storage_goes_with_the_last_view(self):
        c, pool = make_cache()
        a, _ = c.add_sequence(range(16))
        view = c.storage_view()
        table = c.block_table(a)
        put(view, table, 3, 333)
        owner = weakref.ref(c._owner)
        c.close()
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "closed"):
            c.add_sequence([1])
        gc.collect()
        self.assertIsNotNone(owner())  # the view holds the storage
        self.assertEqual(get(view, table, 3), 333)  # still mapped
        del view
        gc.collect()
        self.assertIsNone(owner())  # destroyed with the last view
        pool.close()

    def test_a_pool_close_refused_at_garbage_collection_is_a_resource_warning(self):
        c, pool = make_cache()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            pool.__del__()  # what the collector runs, the cache still standing on the pool
        self.assertEqual(len(seen), 1)
        self.assertIs(seen[0].category, ResourceWarning)
        self.assertRegex(str(seen[0].message), "Pool not closed at garbage collection: .*")
        c.add_sequence(range(4))  # the pool is intact and open
        c.close()
        pool.close()

    def test_dlpack_capsule_describes_the_view_and_its_deleter_releases_it(self):
        view = self.cache.storage_view()
        cap = kv._dlpack_capsule(view, 0)
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype = ctypes.c_void_p
        get.argtypes = [ctypes.py_object, ctypes.c_char_p]
        managed = kv._DLManagedTensor.from_address(get(cap, b"dltensor"))
        t = managed.dl_tensor
        self.assertEqual(t.data, view.ptr)
        self.assertEqual((t.device.device_type, t.device.device_id), (2, 0))  # kDLCUDA
        self.assertEqual((t.dtype.code, t.dtype.bits, t.dtype.lanes), (2, 16, 1))  # f16
        self.assertEqual([t.shape[i] for i in range(t.ndim)], list(view.shape))
        self.assertEqual([t.strides[i] * 2 for i in range(t.ndim)], list(view.strides))
        self.assertEqual(len(kv._dlpack_live), 1)  # the view is kept until the deleter
        managed.deleter(ctypes.pointer(managed))  # what a consumer calls when done
        self.assertEqual(len(kv._dlpack_live), 0)
        cap = kv._dlpack_capsule(view, 0)
        kv._dlpack_forget_unconsumed(cap)  # never consumed: nothing kept
        self.assertEqual(len(kv._dlpack_live), 0)

    def test_layout_from_a_model_config(self):
        class Cfg:
            num_attention_heads = 32
            num_key_value_heads = 8
            hidden_size = 4096
            num_hidden_layers = 4
        lay = kv.Layout.from_hf_config(Cfg(), dtype="bf16")
        self.assertEqual((lay.layers, lay.kv_heads, lay.head_dim, lay.dtype), (4, 8, 128, "bf16"))


class VirtualSequencesTest(unittest.TestCase):
    def setUp(self):
        self.pool = gpumem.Pool("sim_capacity:1G,limit:6M", allocator="vmm_page_pool",
                                platform="sim")
        self.vs = kv.VirtualSequences(layers=2, kv_heads=2, head_dim=64, dtype="f16",
                                      max_sequence_tokens=8192, pool=self.pool)

    def tearDown(self):
        self.vs.close()
        gc.collect()
        self.pool.close()

    def test_views_address_the_token_major_layout_and_grow_in_place(self):
        vs = self.vs
        a = vs.add(10)
        k, v = vs.array_views(a, 1)
        cai = v.__cuda_array_interface__
        self.assertEqual(cai["shape"], (10, 2, 64))
        self.assertEqual(cai["strides"], (1024, 128, 2))  # 2 layers x K,V x 2 x 64 x 2 bytes
        base, tokens = vs.sequence(a)
        self.assertEqual((cai["data"][0], tokens), (base + 512 + 256, 10))
        self.assertEqual(k.__cuda_array_interface__["data"][0], base + 512)
        addr = cai["data"][0] + 9 * 1024 + 128 + 3 * 2
        ctypes.c_uint16.from_address(addr).value = 4321
        vs.append(a, 3000)  # a second page, mapped after the first
        self.assertEqual(vs.sequence(a), (base, 3010))
        self.assertEqual(ctypes.c_uint16.from_address(addr).value, 4321)
        info = vs.info()
        self.assertEqual((info["mapped_bytes"], info["live_bytes"]), (4 << 20, 3010 * 1024))
        self.assertEqual(vs.validate(), "")

    def test_free_refuses_while_a_view_lives(self):
        vs = self.vs
        a = vs.add(5)
        k, v = vs.array_views(a, 0)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "2 live view"):
            vs.free(a)
        self.assertEqual(vs.sequence(a)[1], 5)
        del k, v
        gc.collect()
        vs.free(a)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "was freed"):
            vs.sequence(a)

    def test_bad_input(self):
        vs = self.vs
        a = vs.add(4000)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "max_sequence_tokens 8192"):
            vs.append(a, 5000)
        with self.assertRaises(gpumem.OutOfMemoryError):
            vs.add(4000)  # 2 more pages over the pool's 6 MiB
        self.assertEqual(vs.info()["sequences"], 1)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "layer 2 of a 2-layer"):
            vs.array_views(a, 2)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "holds 4000 tokens"):
            vs.array_views(a, 0, tokens=4001)
        # Ids and counts: checked before any call, never wrapped or truncated.
        for call in (lambda: vs.free((1 << 64) + a), lambda: vs.append((1 << 64) + a, 1),
                     lambda: vs.sequence(-1), lambda: vs.add(1 << 64),
                     lambda: vs.append(a, (1 << 64) - 1)):
            with self.assertRaises(gpumem.InvalidArgumentError):
                call()
        for call in (lambda: vs.free(float(a)), lambda: vs.add(2.5), lambda: vs.append(a, True),
                     lambda: vs.array_views(a, 0.0)):
            with self.assertRaises(TypeError):
                call()
        self.assertEqual(vs.sequence(a)[1], 4000)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "still has 0 KV cache.*1 virtually"):
            self.pool.close()
        self.assertEqual(vs.validate(), "")


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    sys.exit(0 if result.wasSuccessful() else 1)
