#!/usr/bin/env bash
# Builds and runs the whole test suite. GPU tests skip, saying why, where no GPU is found.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build-test -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-test
ctest --test-dir build-test --output-on-failure -j 2 "$@"
