"""Hugging Face Trainer with memory metrics on (skip_memory_metrics=False) under gpumem as
PyTorch's allocator: it reads torch.cuda.memory_allocated / max_memory_allocated /
reset_peak_memory_stats, which answer from gpumem; training runs and the metrics are
reported. A small Llama-shaped model with random weights and data (no network).

Run with PYTHONPATH=python and GPUMEM_LIB=<libgpumem_torch.so>. Exits 77 (skipped) without
torch, a CUDA device, transformers or accelerate (Trainer needs it)."""

import os
import sys
import tempfile

from torch_test_support import require_torch_and_gpu  # noqa: E402

torch = require_torch_and_gpu()

import gpumem.torch  # noqa: E402

os.environ.setdefault("GPUMEM_TORCH_ROUTE", "native")
gpumem.torch.enable()
if gpumem.torch.route() != "native":
    # Trainer reads torch.cuda.memory_allocated(), which CUDAPluggableAllocator refuses.
    print("skipped: the native allocator was not built for this torch (see stderr)")
    sys.exit(77)

try:
    import accelerate  # noqa: F401  (Trainer needs it)
    import transformers
except ImportError as e:
    print("skipped: %s" % e)
    sys.exit(77)

from torch_test_support import CompatResults  # noqa: E402


def main():
    results = CompatResults()
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
    data = [{"input_ids": torch.randint(0, 1024, (64,)), "labels": torch.randint(0, 1024, (64,))}
            for _ in range(32)]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, max_steps=6,
                                              per_device_train_batch_size=4,
                                              skip_memory_metrics=False, report_to=[],
                                              logging_steps=100, save_strategy="no")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        metrics = trainer.train().metrics
    keys = sorted(k for k in metrics if "mem" in k)
    ok = "train_mem_gpu_alloc_delta" in metrics and "train_mem_gpu_peaked_delta" in metrics
    results.record("HF Trainer(skip_memory_metrics=False) (%s)" % gpumem.torch.route(), ok,
                   ", ".join("%s=%s" % (k, metrics[k]) for k in keys))
    results.write()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
