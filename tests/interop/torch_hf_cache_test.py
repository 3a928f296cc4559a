#!/usr/bin/env python3
"""gpumem.hf.GpumemCache under transformers' generate on a GPU, on a small random-weight
LlamaForCausalLM (GQA): greedy output token for token equal to DynamicCache (one prompt,
a left-padded batch), beam search and num_return_sequences through fork (copy on write,
shared prompt blocks), sampling with a fixed seed, the paged Triton attention path, and
bad input (a layout that does not match the model, a dtype that does not). Exits 77
(skip) without torch, a CUDA device or transformers; fails with a clear message when the
installed transformers' interface differs from what GpumemCache implements."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_test_support import require_torch_and_gpu  # noqa: E402

torch = require_torch_and_gpu()
try:
    import transformers
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError as e:
    print("skipped: transformers is not installed (%s)" % e)
    sys.exit(77)

import gpumem  # noqa: E402
import gpumem.kv as gkv  # noqa: E402
from gpumem.hf import GpumemCache, register_paged_attention  # noqa: E402

print("torch", torch.__version__, "transformers", transformers.__version__)


def small_llama(dtype=torch.bfloat16, layers=4, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()
    # Random weights: never stop at an end token, so every row generates max_new_tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts(batch, length, seed=1, pad_left=()):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, n in pad_left:
        ids[row, :n] = 0
        mask[row, :n] = 0
    return ids.cuda(), mask.cuda()


def generate(model, cache, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)


class GenerateTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = small_llama()

    def same_as_dynamic(self, ids, mask, **kw):
        ref = generate(self.model, DynamicCache(), ids, mask, **kw)
        cache = GpumemCache(self.model.config)
        out = generate(self.model, cache, ids, mask, **kw)
        self.assertEqual(out.shape, ref.shape)
        diff = (out != ref).nonzero()
        self.assertEqual(diff.numel(), 0, "first differing (row, position): %s"
                         % (diff[0].tolist() if diff.numel() else None))
        self.assertEqual(cache.kv_cache.validate(), "")
        return cache

    def test_greedy_one_prompt(self):
        ids, mask = prompts(1, 37)
        cache = self.same_as_dynamic(ids, mask, max_new_tokens=40, do_sample=False)
        self.assertEqual(cache.get_seq_length(), 37 + 40 - 1)
        self.assertEqual(cache.kv_cache.stats()["sequences"], 1)

    def test_greedy_left_padded_batch(self):
        ids, mask = prompts(4, 50, pad_left=[(1, 13), (3, 30)])
        cache = self.same_as_dynamic(ids, mask, max_new_tokens=33, do_sample=False)
        mem = cache.memory()
        self.assertGreater(mem["peak_mapped_bytes"], 0)
        cache.release()
        self.assertEqual(cache.kv_cache.stats()["mapped_bytes"], 0)

    def test_beam_search_forks(self):
        ids, mask = prompts(2, 40)
        cache = self.same_as_dynamic(ids, mask, max_new_tokens=20, num_beams=4,
                                     num_return_sequences=2, do_sample=False)
        s = cache.kv_cache.stats()
        self.assertGreater(s["cow_copies"], 0, "reorder_cache should fork (copy on write)")

    def test_num_return_sequences_share_the_prompt(self):
        ids, mask = prompts(2, 60)  # 3 full blocks and a shared, partly filled one
        torch.manual_seed(7)
        ref = generate(self.model, DynamicCache(), ids, mask, max_new_tokens=16,
                       do_sample=True, num_return_sequences=3)
        cache = GpumemCache(self.model.config)
        torch.manual_seed(7)
        out = generate(self.model, cache, ids, mask, max_new_tokens=16, do_sample=True,
                       num_return_sequences=3)
        self.assertTrue(torch.equal(out, ref))
        s = cache.kv_cache.stats()
        # 6 rows of 60 + 15 tokens (5 blocks each unshared); each prompt's 3 full blocks
        # are held once: 2 * 3 + 6 * 2 blocks.
        self.assertEqual(s["used_blocks"], 2 * 3 + 6 * 2)
        self.assertGreater(s["cow_copies"], 0)

    def test_layout_mismatch_is_refused(self):
        ids, mask = prompts(1, 8)
        wrong = gkv.Layout(layers=4, kv_heads=4, head_dim=32, dtype="bf16")
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, r"kv_heads 2 \(the cache has 4\)"):
            generate(self.model, GpumemCache(layout=wrong), ids, mask, max_new_tokens=2)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, r"dtype bf16 \(the cache has f16\)"):
            generate(self.model, GpumemCache(self.model.config, dtype="f16"), ids, mask,
                     max_new_tokens=2)
        few = gkv.Layout(layers=2, kv_heads=2, head_dim=32, dtype="bf16")
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "layer 2 of a 2-layer cache"):
            generate(self.model, GpumemCache(layout=few), ids, mask, max_new_tokens=2)

    def test_append_past_the_maximum_is_refused(self):
        ids, mask = prompts(1, 30)
        cache = GpumemCache(self.model.config, max_sequence_tokens=40)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "max_sequence_tokens 40"):
            generate(self.model, cache, ids, mask, max_new_tokens=20, do_sample=False)


class ContiguousTest(unittest.TestCase):
    """attention="contiguous": the rows in one virtually contiguous range, strided views."""

    @classmethod
    def setUpClass(cls):
        cls.model = small_llama()

    def same_as_dynamic(self, ids, mask, seed=None, **kw):
        if seed is not None:
            torch.manual_seed(seed)
        ref = generate(self.model, DynamicCache(), ids, mask, **kw)
        cache = GpumemCache(self.model.config, attention="contiguous")
        if seed is not None:
            torch.manual_seed(seed)
        out = generate(self.model, cache, ids, mask, **kw)
        self.assertEqual(out.shape, ref.shape)
        diff = (out != ref).nonzero()
        self.assertEqual(diff.numel(), 0, "first differing (row, position): %s"
                         % (diff[0].tolist() if diff.numel() else None))
        self.assertIsNone(cache.kv_cache)
        return cache, out

    def test_greedy_one_prompt_and_memory(self):
        ids, mask = prompts(1, 37)
        cache, _ = self.same_as_dynamic(ids, mask, max_new_tokens=40, do_sample=False)
        self.assertEqual(cache.get_seq_length(), 37 + 40 - 1)
        lay = gkv.Layout.from_hf_config(self.model.config)
        live = (37 + 40 - 1) * lay.layers * 2 * lay.kv_heads * lay.head_dim * 2
        mem = cache.memory()
        page = cache._rows._vs.info()["page_size"]
        self.assertGreaterEqual(mem["mapped_bytes"], live)
        self.assertLess(mem["mapped_bytes"], live + live // 32 + page,
                        "more than 1/32 over the tokens and a partly used page")
        self.assertEqual(cache._rows._vs.validate(), "")
        cache.release()
        self.assertEqual(cache.memory()["mapped_bytes"], 0)

    def test_greedy_left_padded_batch(self):
        ids, mask = prompts(4, 50, pad_left=[(1, 13), (3, 30)])
        self.same_as_dynamic(ids, mask, max_new_tokens=33, do_sample=False)

    def test_beam_search_and_returned_sequences(self):
        ids, mask = prompts(2, 40)
        self.same_as_dynamic(ids, mask, max_new_tokens=20, num_beams=4,
                             num_return_sequences=2, do_sample=False)
        self.same_as_dynamic(ids, mask, seed=7, max_new_tokens=16, do_sample=True,
                             num_return_sequences=3)

    def test_crop_in_assisted_decoding(self):
        # Prompt lookup decoding proposes tokens and crops the rejected ones off the cache.
        ids, mask = prompts(1, 64)
        ids[0, 32:48] = ids[0, 8:24]  # repeats for the lookup to find
        cache, _ = self.same_as_dynamic(ids, mask, max_new_tokens=30, do_sample=False,
                                        prompt_lookup_num_tokens=4)
        self.assertTrue(cache.is_croppable)

    def test_rows_change_and_refusals(self):
        lay = gkv.Layout(layers=2, kv_heads=2, head_dim=32, dtype="f32")
        cache = GpumemCache(layout=lay, dtype="f32", attention="contiguous",
                            max_sequence_tokens=12)
        k = [torch.randn(2, 2, 5, 32, device="cuda") for _ in range(2)]
        v = [torch.randn(2, 2, 5, 32, device="cuda") for _ in range(2)]
        for layer in range(2):
            kk, vv = cache.update(k[layer], v[layer], layer)
            self.assertTrue(torch.equal(kk, k[layer]) and torch.equal(vv, v[layer]))
        cache.batch_repeat_interleave(2)  # rows 0,0,1,1: a new range
        cache.reorder_cache(torch.tensor([3, 2, 1, 0]))  # in place
        one = torch.randn(4, 2, 1, 32, device="cuda")
        for layer in range(2):
            kk, vv = cache.update(one, one, layer)
            want = k[layer][[1, 1, 0, 0]]
            self.assertTrue(torch.equal(kk[:, :, :5], want), "layer %d rows" % layer)
            self.assertTrue(torch.equal(kk[:, :, 5:], one))
            self.assertEqual(tuple(kk.shape), (4, 2, 6, 32))
        self.assertEqual(cache.get_seq_length(), 6)
        with self.assertRaisesRegex(IndexError, "out of range"):
            cache.reorder_cache(torch.tensor([0, 1, 2, 4]))
        with self.assertRaisesRegex(ValueError, "3 rows in this step, 4 in the cache"):
            cache.update(torch.randn(3, 2, 1, 32, device="cuda"), one[:3], 0)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "max_sequence_tokens 12"):
            cache.update(torch.randn(4, 2, 7, 32, device="cuda"),
                         torch.randn(4, 2, 7, 32, device="cuda"), 0)
        self.assertEqual(cache.get_seq_length(), 6, "a refused step changes nothing")
        cache.crop(-2)
        self.assertEqual(cache.get_seq_length(), 4)
        cache.release()
        wrong = GpumemCache(layout=lay, dtype="f32", attention="contiguous")
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, r"head_dim 16 \(the cache has 32\)"):
            wrong.update(torch.randn(1, 2, 3, 16, device="cuda"),
                         torch.randn(1, 2, 3, 16, device="cuda"), 0)


class PagedAttentionTest(unittest.TestCase):
    def test_paged_decode_matches_sdpa_in_float32(self):
        try:
            import triton  # noqa: F401
        except ImportError:
            self.skipTest("triton is not installed")
        model = small_llama(dtype=torch.float32)
        ids, mask = prompts(3, 45)
        kw = dict(max_new_tokens=24, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)
        ref = generate(model, DynamicCache(), ids, mask, **kw)
        name = register_paged_attention()
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(name)
        else:
            model.config._attn_implementation = name
        cache = GpumemCache(model.config, attention="paged")
        out = generate(model, cache, ids, mask, **kw)
        self.assertGreater(cache.decode_layers_paged, 0, "no decode step took the paged path")
        same = 0
        for step, (a, b) in enumerate(zip(ref.scores, out.scores)):
            err = (a - b).abs().max().item()
            self.assertLess(err, 1e-3, "step %d: logits differ by %.3g" % (step, err))
            if not torch.equal(ref.sequences[:, ids.shape[1] + step],
                               out.sequences[:, ids.shape[1] + step]):
                break
            same += 1
        self.assertGreaterEqual(same, 8, "tokens diverge at step %d" % same)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    sys.exit(0 if result.wasSuccessful() else 1)
