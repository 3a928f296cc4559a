// Uses the installed C++ headers and library: a VMM page pool on a private sim device, and
// the C API's version against the package's. Exit status 0 only if everything held.
#include <cstdio>
#include <cstring>

#include "gpumem/errors.hpp"
#include "gpumem/interop/gpumem.h"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

int main() {
  gpumem::sim_options o;
  o.capacity = std::size_t{256} << 20;
  gpumem::sim_platform sim(o);
  {
    gpumem::vmm_page_pool pool(sim, 0, gpumem::pool_options::parse("limit:64M"));
    void* p = pool.allocate(3 << 20);
    std::memset(p, 0x5a, 3 << 20);  // sim memory is host memory
    if (pool.stats().live_bytes != (3u << 20)) return 1;
    pool.deallocate(p, 3 << 20);
    bool refused = false;
    try {
      pool.deallocate(p, 3 << 20);
    } catch (const gpumem::invalid_argument&) {
      refused = true;
    }
    if (!refused) return 2;
  }
  if (std::strcmp(gpumem_version(), GPUMEM_EXPECTED_VERSION) != 0) {
    std::fprintf(stderr, "library %s, package %s\n", gpumem_version(), GPUMEM_EXPECTED_VERSION);
    return 3;
  }
  std::printf("consumer_cpp: ok (gpumem %s)\n", gpumem_version());
  return 0;
}
