#!/usr/bin/env python3
"""Record the allocation trace of torch_proof.py's fixed-shape training loop (PyTorch's
native allocator, memory history on) and write it as a gpumem trace CSV (.csv.gz).

Unlike ../shared/traces/train_llama (a new batch and sequence length every step), every
step here has the same shapes: the steady state of a real training loop, where an
allocator should settle and stop asking the driver for anything.

Usage (GPU machine, transformers installed):
  record_torch_trace.py OUT.csv.gz [--steps 6] [--hidden 2048 --layers 16 --batch 4 --seq 2048]
"""
import argparse
import os
import pickle
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from snapshot_to_csv import convert, write_csv  # noqa: E402
from torch_proof import llama_config  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args()
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError as e:
        sys.exit("record_torch_trace.py: needs torch and transformers (%s); run it on the GPU "
                 "machine" % e)

    torch.manual_seed(0)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=2_000_000)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(llama_config(args))
    torch.set_default_dtype(torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda")
    for _ in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    rows = convert(snapshot, 0)
    write_csv(rows, args.out)
    s = torch.cuda.memory_stats()
    print(f"{args.out}: {len(rows)} events, {args.steps} steps; native peak reserved "
          f"{s['reserved_bytes.all.peak']}, peak allocated {s['allocated_bytes.all.peak']}")


if __name__ == "__main__":
    main()
