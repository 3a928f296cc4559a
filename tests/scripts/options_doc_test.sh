#!/bin/sh
# docs/OPTIONS.md is exactly `gpumem options --markdown` (generated from the option table in
# src/pool/option_table.cpp). Regenerate with:
#   ./build/tools/gpumem options --markdown > docs/OPTIONS.md
# usage: options_doc_test.sh REPO_ROOT GPUMEM_BINARY
set -eu
root=$1
tool=$2
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
"$tool" options --markdown > "$tmp"
if ! diff -u "$root/docs/OPTIONS.md" "$tmp"; then
  echo "FAIL: docs/OPTIONS.md differs from 'gpumem options --markdown' (diff above)." >&2
  echo "Regenerate: gpumem options --markdown > docs/OPTIONS.md" >&2
  exit 1
fi
echo "docs/OPTIONS.md matches the option table"
