// libFuzzer target: the KV cache's C API under the reference model
// (kv_c_api_fuzz_driver.hpp): pools, caches and sequence sets made and destroyed in any
// order, counts, ids and sizes at the edges of their types. Any model violation prints
// what broke and aborts.
#include <cstdio>
#include <cstdlib>

#include "fuzz/kv_c_api_fuzz_driver.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gpumem_fuzz::fuzz_counts counts;
  const auto why = gpumem_fuzz::run_kv_c_api_fuzz(data, size, 2000, counts);
  if (!why.empty()) {
    std::fprintf(stderr, "gpumem fuzz: %s\n", why.c_str());
    std::abort();
  }
  return 0;
}
