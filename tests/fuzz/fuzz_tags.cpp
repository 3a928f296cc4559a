// libFuzzer target: tags, sleep / wake, trim, record_stream and sharing through the C API
// under the reference model (tag_fuzz_driver.hpp). Any model violation prints what broke
// and aborts.
#include <cstdio>
#include <cstdlib>

#include "fuzz/tag_fuzz_driver.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gpumem_fuzz::fuzz_counts counts;
  const auto why = gpumem_fuzz::run_tag_fuzz(data, size, 2000, counts);
  if (!why.empty()) {
    std::fprintf(stderr, "gpumem fuzz: %s\n", why.c_str());
    std::abort();
  }
  return 0;
}
