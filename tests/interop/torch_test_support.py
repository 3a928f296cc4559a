"""Shared by the tests that run under PyTorch on a GPU (torch_*_test.py): skipping without
torch or a CUDA device, and the compatibility results each case records."""

import json
import os
import sys


def require_torch_and_gpu():
    """The torch module; exits 77 (ctest's skip) without torch or without a CUDA device."""
    try:
        import torch
    except ImportError:
        print("skipped: torch is not installed")
        sys.exit(77)
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        sys.exit(77)
    return torch


class CompatResults:
    """Cases and their results: printed at the end, and appended as JSON lines to
    $GPUMEM_COMPAT_JSON when set (the table of docs/PYTORCH.md is made from them)."""

    def __init__(self):
        self.rows = []

    def record(self, case, ok, detail=""):
        self.rows.append({"case": case, "result": "pass" if ok else "fail", "detail": detail})

    def write(self):
        path = os.environ.get("GPUMEM_COMPAT_JSON")
        if path:
            with open(path, "a") as f:
                for r in self.rows:
                    f.write(json.dumps(r) + "\n")
        for r in self.rows:
            print("%-60s %s  %s" % (r["case"], r["result"], r["detail"]))
