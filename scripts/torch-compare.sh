#!/usr/bin/env bash
# On a GPU machine with PyTorch: each workload of scripts/torch_compare.py run as an unmodified
# script natively, with expandable_segments, and under `python -m gpumem run`, the three
# alternating within each repeat. One JSON line per run in $OUT/torch_compare.jsonl, then a
# table: median step time (spread over repeats) and peak reserved / peak requested.
#   WORKLOADS (default below), REPEATS (default 2), STEPS (default 7)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
WORKLOADS=${WORKLOADS:-ckpt_train generate_sampled encode_varlen moe_train lora_finetune fsdp_layers graph_decode}
REPEATS=${REPEATS:-2}
STEPS=${STEPS:-7}
export PYTHONPATH=$PWD/python GPUMEM_LIB=${GPUMEM_LIB:-$PWD/build-gpu/src/interop/libgpumem_torch.so}
log=$OUT/torch_compare.jsonl
: >"$log"
for r in $(seq "$REPEATS"); do
  for w in $WORKLOADS; do
    python3 scripts/torch_compare.py "$w" --steps "$STEPS" 2>>"$OUT/torch_compare.err" | tail -1 >>"$log"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      python3 scripts/torch_compare.py "$w" --steps "$STEPS" 2>>"$OUT/torch_compare.err" | tail -1 >>"$log"
    python3 -m gpumem run scripts/torch_compare.py "$w" --steps "$STEPS" 2>>"$OUT/torch_compare.err" | tail -1 >>"$log"
  done
done
python3 - "$log" <<'PY'
import json, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    line = line.strip()
    if line.startswith("{"):
        x = json.loads(line)
        rows[(x["workload"], x["mode"])].append(x)
print("%-17s %-20s %-26s %s" % ("workload", "allocator", "step ms (median per repeat)", "reserved/requested"))
for (w, m), xs in sorted(rows.items()):
    print("%-17s %-20s %-26s %s" % (w, m, " ".join("%.1f" % (x["median_s"] * 1e3) for x in xs),
                                    " ".join("%.4f" % x["reserved_over_requested"] for x in xs)))
PY
