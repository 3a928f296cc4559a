#!/usr/bin/env python3
"""gpumem.kv under PyTorch on a GPU: the storage as torch tensors without a copy, and the
paged decode kernel (gpumem.kv_attention.paged_decode, Triton) against dense SDPA in
float32 for every sequence of a batch of different lengths, GQA and MHA, bf16 / f16 /
f32, one split and several, shared (forked) blocks included.

Tolerances (largest absolute difference against SDPA in float32 on the same values):
bf16 3e-2, f16 5e-3, f32 1e-4. Exits 77 (skip) without torch, a CUDA device or triton."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_test_support import require_torch_and_gpu  # noqa: E402

torch = require_torch_and_gpu()
try:
    import triton  # noqa: F401
except ImportError:
    print("skipped: triton is not installed")
    sys.exit(77)

import gpumem  # noqa: E402
import gpumem.kv as kv  # noqa: E402
from gpumem.kv_attention import dense_reference, gather_kv, paged_decode, write_kv  # noqa: E402

TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def filled_cache(lengths, kv_heads, head_dim, dtype, layers=2, block_tokens=16, forks=()):
    """A cache with one sequence per length, its keys and values random, plus forks of
    the sequences at the indices in `forks` (sharing their blocks) extended by one token."""
    cache = kv.KVCache(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                       dtype=NAMES[dtype], block_tokens=block_tokens,
                       max_blocks=sum(lengths) // block_tokens + 8 * len(lengths) + 64,
                       prefix_caching=False,
                       stream=torch.cuda.current_stream().cuda_stream)
    seqs = [cache.add_sequence([0] * n)[0] for n in lengths]
    gen = torch.Generator(device="cuda").manual_seed(1234)
    for layer in range(layers):
        k, v = cache.layer_views(layer)
        t = cache.block_tables(seqs)
        table, lens = t.tensors("cuda")
        n = max(lengths)
        pos = torch.arange(n, device="cuda").unsqueeze(0).expand(len(seqs), n)
        mask = pos < lens.unsqueeze(1).long()
        keys = torch.randn(len(seqs), n, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
        vals = torch.randn(len(seqs), n, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
        rows = torch.arange(len(seqs), device="cuda").unsqueeze(1).expand(-1, n)[mask]
        p = pos[mask]
        k[table[rows, p // block_tokens].long(), p % block_tokens] = keys[mask]
        v[table[rows, p // block_tokens].long(), p % block_tokens] = vals[mask]
    for i in forks:
        child = cache.fork(seqs[i])
        cache.append(child, [1])  # copy on write of the shared last block
        t = cache.block_tables([child])
        table, lens = t.tensors("cuda")
        for layer in range(layers):
            k, v = cache.layer_views(layer)
            pos = (lens.long() - 1).unsqueeze(1)
            new = torch.randn(1, 1, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
            write_kv(k, v, new, new * 0.5, table, pos)
        seqs.append(child)
    torch.cuda.synchronize()
    return cache, seqs


class StorageViewTest(unittest.TestCase):
    def test_views_alias_the_cache_memory(self):
        cache = kv.KVCache(layers=3, kv_heads=2, head_dim=64, dtype="bf16", max_blocks=64)
        seq, _ = cache.add_sequence([1] * 40)
        full = cache.tensor()
        self.assertEqual(full.dtype, torch.bfloat16)
        self.assertEqual(tuple(full.shape), (64, 3, 2, 16, 2, 64))
        self.assertEqual(full.data_ptr(), cache.storage()["base"])
        st = cache.storage()
        self.assertEqual(full.stride(0) * 2, st["block_stride"])
        self.assertEqual(full.stride(1) * 2, st["layer_stride"])
        k, v = cache.layer_views(1)
        self.assertEqual(tuple(k.shape), (64, 16, 2, 64))
        b = cache.block_table(seq)[2]
        k[b, 7, 1].fill_(3.0)
        v[b, 7, 1].fill_(-2.0)
        torch.cuda.synchronize()
        self.assertTrue(bool((full[b, 1, 0, 7, 1] == 3.0).all()))
        self.assertTrue(bool((full[b, 1, 1, 7, 1] == -2.0).all()))
        # The tensor keeps the storage after close(): still readable.
        cache.close()
        self.assertEqual(float(full[b, 1, 0, 7, 1, 0]), 3.0)

    def test_gather_returns_what_was_written(self):
        cache, seqs = filled_cache([5, 40], 2, 64, torch.float16)
        table, lens = cache.block_tables(seqs).tensors("cuda")
        k, v = cache.layer_views(0)
        kk, vv = gather_kv(k, v, table, 40)
        self.assertEqual(tuple(kk.shape), (2, 2, 40, 64))
        blk = cache.block_table(seqs[1])[1]
        self.assertTrue(torch.equal(kk[1, :, 17], k[blk, 1]))


class PagedDecodeTest(unittest.TestCase):
    def check(self, lengths, q_heads, kv_heads, head_dim, dtype, splits=None, forks=(),
              block_tokens=16):
        cache, seqs = filled_cache(lengths, kv_heads, head_dim, dtype, forks=forks,
                                   block_tokens=block_tokens)
        tables = cache.block_tables(seqs)
        table, lens = tables.tensors("cuda")
        gen = torch.Generator(device="cuda").manual_seed(99)
        q = torch.randn(len(seqs), q_heads, head_dim, device="cuda", generator=gen).to(dtype)
        for layer in range(cache.layout.layers):
            k, v = cache.layer_views(layer)
            out = paged_decode(q, k, v, tables, cache=cache, splits=splits)
            ref = dense_reference(q, k, v, table, lens.tolist())
            for i in range(len(seqs)):
                err = (out[i].float() - ref[i].float()).abs().max().item()
                self.assertLess(err, TOL[dtype], "sequence %d (length %d), layer %d, %s: "
                                "max error %.3g" % (i, int(lens[i]), layer, dtype, err))
        cache.close()

    def test_gqa_bf16_mixed_lengths(self):
        self.check([1, 15, 16, 17, 100, 1000, 3001], 32, 8, 128, torch.bfloat16)

    def test_gqa_bf16_one_split(self):
        self.check([1, 63, 64, 65, 700], 32, 8, 128, torch.bfloat16, splits=1)

    def test_mha_f16_many_splits(self):
        self.check([2, 33, 4000], 8, 8, 64, torch.float16, splits=16)

    def test_f32_and_forked_blocks(self):
        self.check([20, 31, 300], 16, 4, 128, torch.float32, forks=(0, 2))

    def test_block_of_32_tokens_and_mqa(self):
        self.check([9, 128, 513], 16, 1, 64, torch.bfloat16, block_tokens=32)

    def test_stale_table_is_refused(self):
        cache, seqs = filled_cache([10, 20], 2, 64, torch.bfloat16)
        tables = cache.block_tables(seqs)
        cache.append(seqs[0], [1])
        k, v = cache.layer_views(0)
        q = torch.zeros(2, 2, 64, device="cuda", dtype=torch.bfloat16)
        with self.assertRaises(kv.StaleBlockTableError):
            paged_decode(q, k, v, tables, cache=cache)
        cache.free(seqs[1])
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "was freed"):
            cache.block_tables(seqs)

    def test_bad_shapes_are_refused(self):
        cache, seqs = filled_cache([10], 2, 64, torch.bfloat16)
        k, v = cache.layer_views(0)
        tables = cache.block_tables(seqs)
        with self.assertRaisesRegex(ValueError, "not a multiple"):
            paged_decode(torch.zeros(1, 3, 64, device="cuda", dtype=torch.bfloat16), k, v, tables)
        with self.assertRaisesRegex(ValueError, "head_dim"):
            paged_decode(torch.zeros(1, 2, 128, device="cuda", dtype=torch.bfloat16), k, v, tables)
        with self.assertRaisesRegex(ValueError, "float16"):
            paged_decode(torch.zeros(1, 2, 64, device="cuda", dtype=torch.float16), k, v, tables)


class VirtualSequencesTest(unittest.TestCase):
    def test_sdpa_reads_strided_sequences_as_they_are(self):
        import torch.nn.functional as F
        vs = kv.VirtualSequences(layers=4, kv_heads=8, head_dim=128, dtype="bf16",
                                 max_sequence_tokens=8192)
        gen = torch.Generator(device="cuda").manual_seed(5)
        for n in (1, 300, 2049):
            seq = vs.add(n)
            for layer in (0, 3):
                k, v = vs.views(seq, layer)
                self.assertEqual(tuple(k.shape), (n, 8, 128))
                self.assertEqual(k.stride(0) * 2, vs.info()["token_stride"])
                k.copy_(torch.randn(n, 8, 128, device="cuda", generator=gen).to(torch.bfloat16))
                v.copy_(torch.randn(n, 8, 128, device="cuda", generator=gen).to(torch.bfloat16))
                ks, vs_ = vs.sdpa_views(seq, layer)
                q = torch.randn(1, 32, 1, 128, device="cuda", generator=gen).to(torch.bfloat16)
                out = F.scaled_dot_product_attention(q, ks, vs_, enable_gqa=True)
                ref = F.scaled_dot_product_attention(q.float(), ks.float().contiguous(),
                                                     vs_.float().contiguous(), enable_gqa=True)
                err = (out.float() - ref).abs().max().item()
                self.assertLess(err, TOL[torch.bfloat16], "length %d layer %d: %.3g" % (n, layer, err))
                del k, v, ks, vs_
            info = vs.info()
            self.assertLessEqual(info["mapped_bytes"] - info["live_bytes"],
                                 info["sequences"] * info["page_size"])
            vs.free(seq)
        self.assertEqual(vs.info()["mapped_bytes"], 0)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    sys.exit(0 if result.wasSuccessful() else 1)
