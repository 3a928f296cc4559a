// The Redis tier in a build without hiredis: it says so.
#include "gpumem/errors.hpp"
#include "gpumem/kv/tier/redis_store.hpp"

namespace gpumem {

bool redis_tier_available() noexcept { return false; }

std::unique_ptr<kv_store> make_redis_store(std::string_view url, redis_store_options) {
  throw invalid_argument("kv store '" + std::string(url) +
                         "': this gpumem was built without the Redis tier (hiredis was not "
                         "found at build time: install libhiredis-dev and rebuild)");
}

redis_fault_counts redis_faults(const kv_store& store) {
  throw invalid_argument("redis_faults: '" + store.name() + "' is not a Redis store (this gpumem "
                         "was built without the Redis tier)");
}

}  // namespace gpumem
