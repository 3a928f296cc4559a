#!/usr/bin/env bash
# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer, then under
# ThreadSanitizer. Any report fails the run. ASan's handle_segv=0: sim faults on unmapped
# memory by design, and its death tests expect that SIGSEGV. The mapping-limit test
# exhausts the kernel's host mappings on purpose, which the sanitizer runtimes need too
# (ASan aborted once with "Failed to mmap" while it ran): it runs in the plain build only.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
common=(-G Ninja -DCMAKE_BUILD_TYPE=Debug -DGPUMEM_BUILD_BENCH=OFF -DGPUMEM_WITH_CUDA=OFF)
cmake -S . -B build-asan "${common[@]}" -DGPUMEM_SANITIZE=address,undefined >/dev/null
cmake --build build-asan --target gpumem_tests torch_plugin_tests multi_device_interop_tests gpumem_kv_tier_tests
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:handle_segv=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
./build-asan/tests/gpumem_tests --gtest_brief=1 \
  --gtest_filter='-sim_platform.host_mapping_limit_fails_cleanly'
# The KV tiers (their worker thread; Redis tests skip without redis-server).
./build-asan/tests/gpumem_kv_tier_tests --gtest_brief=1
# The PyTorch plug-in's entry points (an exception thrown out of the shared library).
./build-asan/tests/interop/torch_plugin_tests --gtest_brief=1
# The plug-in and the C API on a two-GPU sim device.
./build-asan/tests/interop/multi_device_interop_tests --gtest_brief=1
unset ASAN_OPTIONS UBSAN_OPTIONS
cmake -S . -B build-tsan "${common[@]}" -DGPUMEM_SANITIZE=thread >/dev/null
cmake --build build-tsan --target gpumem_tests gpumem_kv_tier_tests
TSAN_OPTIONS=halt_on_error=1 ./build-tsan/tests/gpumem_kv_tier_tests --gtest_brief=1
# Death tests fork, which TSan does not support well: they run in the other two builds. The
# single-threaded corpora that replay a whole fuzz corpus twice (address independence) or
# drive tags through sleep and wake hold no thread to race and are slow under TSan: they
# run in the plain and ASan builds.
TSAN_OPTIONS=halt_on_error=1 ./build-tsan/tests/gpumem_tests --gtest_brief=1 \
  --gtest_filter='-*death*:*Death*:*dies*:sim_platform.host_mapping_limit_fails_cleanly:*decisions_do_not_depend_on_host_addresses*:fuzz_corpus_tags.*'
