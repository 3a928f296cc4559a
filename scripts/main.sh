#!/usr/bin/env bash
# The main job: install what is missing, build, describe the device, and replay the
# shipped Llama training trace on every allocator (on the sim device when no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=OFF >/dev/null
cmake --build build
./build/tools/gpumem info
./build/tools/gpumem replay data/train_llama.csv.gz --allocator all "$@"
