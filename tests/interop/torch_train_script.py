"""A small training loop that knows nothing of gpumem (tests/interop/torch_onestep_test.py
runs it natively, under `python -m gpumem run` and under GPUMEM_ENABLE=1). Prints one JSON
line: its argv, the final loss, and what gpumem saw if something enabled it."""
import argparse
import json
import sys

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                            torch.nn.Linear(1024, 256)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(64, 256, device="cuda")
for _ in range(args.steps):
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
torch.cuda.synchronize()
out = {"argv": sys.argv, "loss": float(loss), "gpumem": None}
gt = sys.modules.get("gpumem.torch")  # set only when something enabled gpumem
if gt is not None and gt.enabled():
    st = gt.memory_stats()
    out["gpumem"] = {"allocations": st["allocation.all.allocated"],
                     "requested_peak": st["requested_bytes.all.peak"],
                     "reserved": st["reserved_bytes.all.current"],
                     "plan_marks": gt.counters(names=["plan_marks"]).get("plan_marks", 0),
                     "platform": st["gpumem.platform"]}
print(json.dumps(out))
