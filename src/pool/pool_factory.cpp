#include "gpumem/pool/pool_factory.hpp"

#include <algorithm>

#include "gpumem/backend/backends.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem {

namespace {

constexpr std::string_view pools[] = {"vmm_page_pool", "caching_pool"};
constexpr std::string_view backends[] = {"runtime", "driver", "vmm"};

bool one_of(std::span<const std::string_view> names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::unique_ptr<memory_resource> make_backend(platform& p, std::string_view name, int device) {
  if (name == "driver") return std::make_unique<driver_resource>(p, device);
  if (name == "vmm") return std::make_unique<vmm_resource>(p, device);
  return std::make_unique<runtime_resource>(p, device);
}

}  // namespace

std::span<const std::string_view> pool_names() noexcept { return pools; }
std::span<const std::string_view> backend_names() noexcept { return backends; }

made_resource make_resource(platform& platform, const resource_spec& spec) {
  if (!one_of(pools, spec.allocator) && !one_of(backends, spec.allocator))
    throw invalid_argument("unknown allocator '" + spec.allocator +
                           "': expected vmm_page_pool, caching_pool, runtime, driver or vmm");
  if (!one_of(backends, spec.backend))
    throw invalid_argument("unknown backend '" + spec.backend +
                           "': expected runtime, driver or vmm");
  made_resource m;
  if (spec.allocator == "vmm_page_pool") {
    m.pool = std::make_unique<vmm_page_pool>(platform, spec.device, spec.options);
  } else if (spec.allocator == "caching_pool") {
    m.upstream = make_backend(platform, spec.backend, spec.device);
    m.pool = std::make_unique<caching_pool>(*m.upstream, spec.options);
  } else {
    m.backend = make_backend(platform, spec.allocator, spec.device);
  }
  return m;
}

}  // namespace gpumem
