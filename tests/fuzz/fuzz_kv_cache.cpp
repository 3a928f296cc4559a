// libFuzzer target: the paged KV cache under the reference model
// (kv_cache_fuzz_driver.hpp). The first byte says whether sim faults may be injected; the
// rest decodes into add / append / fork / free / swap / evict / shrink / bad input, each
// token's bytes checked. Any model violation prints what broke and aborts.
#include <cstdio>
#include <cstdlib>

#include "fuzz/kv_cache_fuzz_driver.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  gpumem_fuzz::fuzz_counts counts;
  const auto why = gpumem_fuzz::run_kv_cache_fuzz(data + 1, size - 1, data[0] % 2 == 1, 2000, counts);
  if (!why.empty()) {
    std::fprintf(stderr, "gpumem fuzz: %s\n", why.c_str());
    std::abort();
  }
  return 0;
}
