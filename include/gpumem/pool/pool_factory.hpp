// One factory from a name to a resource, for every front end that builds one by name (the C
// API's gpumem_pool_create, and so the PyTorch plug-in; the gpumem tool's replay): a pool
// ("vmm_page_pool"; "caching_pool" over a backend resource) or a backend resource alone
// ("runtime", "driver", "vmm").
//
// Invariants: exactly one of made_resource::pool and ::backend is set; `upstream` is set
// only under a caching_pool, and outlives it (members are destroyed in reverse order).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/pool/core/pool_base.hpp"
#include "gpumem/pool/pool_options.hpp"

namespace gpumem {

struct resource_spec {
  std::string allocator = "vmm_page_pool";  // a pool's or a backend's name
  std::string backend = "runtime";          // caching_pool's upstream: runtime, driver or vmm
  int device = 0;
  pool_options options;  // for a pool
};

struct made_resource {
  std::unique_ptr<memory_resource> upstream;  // caching_pool's backend
  std::unique_ptr<pool_base> pool;            // when spec.allocator names a pool
  std::unique_ptr<memory_resource> backend;   // when it names a backend resource
  // The resource made: the pool, or the backend resource.
  memory_resource& resource() const { return pool ? *pool : *backend; }
};

// The names make_resource takes: pools, then backend resources.
std::span<const std::string_view> pool_names() noexcept;
std::span<const std::string_view> backend_names() noexcept;

// Throws gpumem::invalid_argument, making nothing, for a name that is not one of the above
// (the message lists them); what the constructors throw otherwise.
made_resource make_resource(platform& platform, const resource_spec& spec);

}  // namespace gpumem
