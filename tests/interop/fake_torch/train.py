"""A training script that knows nothing of gpumem: prints what it sees as JSON."""
import json
import os
import sys

import torch

print(json.dumps({
    "name": __name__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "changes": [list(c) for c in torch.cuda.memory.changes],
    "optimizer_hooks": len(torch.optim.optimizer.hooks),
    "conf": os.environ.get("GPUMEM_CONF"),
    "allocator": os.environ.get("GPUMEM_ALLOCATOR"),
}))
