"""The importing side of the CUDA IPC tests (torch_native_allocator_test.py): reads a pickled
reduce_tensor result from stdin, rebuilds the tensor under the allocator its environment
selects (gpumem's native one when GPUMEM_TORCH_ROUTE=native, else PyTorch's own), checks its
bytes against the expected sum, adds 1 to its first element (the exporter checks that it
sees the write: the same memory), and prints one JSON line."""

import json
import pickle
import sys
import time

import torch

if len(sys.argv) > 1 and sys.argv[1] == "gpumem":
    import gpumem.torch

    gpumem.torch.enable()
# A first allocation before the timed open, on either side: it creates the CUDA context and
# the allocator's state (gpumem's pool; PyTorch's own allocator sets its handle type then,
# which it needs to open an expandable-segment handle, with expandable_segments:True).
torch.empty(1, device="cuda")


def main():
    func, args, expected = pickle.loads(sys.stdin.buffer.read())
    torch.cuda.init()
    t0 = time.perf_counter()
    t = func(*args)
    torch.cuda.synchronize()
    opened = time.perf_counter() - t0
    total = float(t.double().sum())
    t[0] += 1
    torch.cuda.synchronize()
    print(json.dumps({"sum": total, "ok": total == expected, "open_s": opened,
                      "backend": torch.cuda.get_allocator_backend()}), flush=True)
    del t


if __name__ == "__main__":
    main()
