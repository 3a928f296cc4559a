// libFuzzer target: the pools under the reference model (fuzz_driver.hpp). The first input
// byte picks the pool (caching_pool over runtime / vmm, with release threshold 0,
// vmm_page_pool default / big_chunk, pinned_host_pool, fixed_block_pool over two
// upstreams), whether sim faults may be injected and whether most frees go to another
// stream (cross_stream); the rest is the operation sequence.
// Any model violation prints what broke and aborts, so libFuzzer keeps the input.
#include <cstdio>
#include <cstdlib>

#include "fuzz/fuzz_driver.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const auto target = static_cast<gpumem_fuzz::pool_target>(data[0] % gpumem_fuzz::pool_target_count);
  const bool faults = (data[0] / gpumem_fuzz::pool_target_count) % 2 == 1;
  const bool cross_stream = (data[0] / gpumem_fuzz::pool_target_count / 2) % 2 == 1;
  gpumem_fuzz::fuzz_counts counts;
  const auto why =
      gpumem_fuzz::run_pool_fuzz(target, data + 1, size - 1, faults, 2000, counts, 1, cross_stream);
  if (!why.empty()) {
    std::fprintf(stderr, "gpumem fuzz: %s\n", why.c_str());
    std::abort();
  }
  return 0;
}
