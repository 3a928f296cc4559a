"""Hugging Face generate() under gpumem as PyTorch's allocator: a Llama-shaped model (random
weights, float32) generates greedily with the dynamic cache, with a static cache in eager
mode, and with a static cache and torch.compile (mode "reduce-overhead": CUDA graphs whose
memory comes from gpumem's private graph pools where the compiled functions can be captured:
those that mutate an input, as the static cache's position counter does, run without graphs,
as PyTorch's own CUDA graph trees decide). The three token sequences must be equal, the
compiled run must really have compiled, and its scores must match the eager static run's.

With GPUMEM_COMPAT_JSON set, writes one line per case to that file (docs/PYTORCH.md's table).
Exits 77 (skipped) without torch, a CUDA device or transformers."""

import gc
import sys
import unittest

from torch_test_support import CompatResults, require_torch_and_gpu

torch = require_torch_and_gpu()

import gpumem.torch  # noqa: E402

gpumem.torch.enable()  # before PyTorch's first CUDA allocation

try:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:
    print("skipped: transformers is not installed")
    sys.exit(77)

_results = CompatResults()


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config).to(device="cuda", dtype=torch.float32).eval()


def _compiled_graphs():
    from torch._dynamo.utils import counters
    return sum(counters["stats"].values()) if "stats" in counters else 0


class HfGenerate(unittest.TestCase):
    def test_static_cache_and_compile_equal_dynamic(self):
        model = _model()
        prompt = torch.randint(0, 512, (2, 24), device="cuda", generator=None)
        common = dict(max_new_tokens=40, do_sample=False, output_scores=True,
                      return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            dynamic = model.generate(prompt, **common)
            static_eager = model.generate(prompt, cache_implementation="static",
                                          disable_compile=True, **common)
            pools_before = gpumem.torch.graph_pools()["pools"]
            torch._dynamo.reset()
            compiled_call = torch.compile(model.forward, mode="reduce-overhead")
            model.forward = compiled_call
            static_compiled = model.generate(prompt, cache_implementation="static",
                                             disable_compile=True, **common)
            torch.cuda.synchronize()
            pools_during = gpumem.torch.graph_pools()["pools"]

        same_dyn = torch.equal(dynamic.sequences, static_eager.sequences)
        same_compiled = torch.equal(static_eager.sequences, static_compiled.sequences)
        score_diff = max((a - b).abs().max().item()
                         for a, b in zip(static_eager.scores, static_compiled.scores))
        graphs = _compiled_graphs()
        ok = same_dyn and same_compiled and score_diff < 1e-3 and graphs > 0
        _results.record(
            "HF generate(): static cache + torch.compile(reduce-overhead)", ok,
            "transformers %s; tokens equal dynamic/static/compiled: %s/%s; max |score diff| %.2g;"
            " gpumem graph pools %d -> %d" % (transformers.__version__, same_dyn, same_compiled,
                                       score_diff, pools_before, pools_during))
        self.assertTrue(same_dyn, "static-cache tokens differ from the dynamic cache's")
        self.assertTrue(same_compiled, "compiled tokens differ from eager static-cache tokens")
        self.assertLess(score_diff, 1e-3)
        self.assertGreater(graphs, 0, "torch.compile compiled nothing")
        del model, compiled_call, dynamic, static_eager, static_compiled
        torch._dynamo.reset()
        gc.collect()


def tearDownModule():
    _results.write()


if __name__ == "__main__":
    unittest.main(verbosity=2)
