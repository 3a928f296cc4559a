#!/usr/bin/env bash
# scripts/record_torch_trace.py on a machine without a GPU: it imports (snapshot_to_csv's
# convert/write_csv, torch_proof's llama_config), prints its usage, and, where torch is not
# installed, refuses to record with a message naming what is missing.
set -euo pipefail
src=$1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 "$src/scripts/record_torch_trace.py" --help > "$tmp/help"
grep -q "usage: record_torch_trace.py" "$tmp/help"
grep -q -- "--steps" "$tmp/help"
python3 - "$src/scripts" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
from snapshot_to_csv import convert, write_csv  # what the recorder writes its CSV with
from torch_proof import llama_config
assert callable(convert) and callable(write_csv) and callable(llama_config)
PY
if python3 -c "import torch" 2>/dev/null; then
  echo "torch is installed here: the refusal check does not apply"
  exit 0
fi
if python3 "$src/scripts/record_torch_trace.py" "$tmp/out.csv.gz" 2>"$tmp/err"; then
  echo "recorded without torch?" >&2
  exit 1
fi
grep -q "needs torch and transformers" "$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
[ ! -e "$tmp/out.csv.gz" ]
echo "ok"
