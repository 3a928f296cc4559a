// Every memory resource the contract suite runs over, one line each.
//
// A factory builds a fresh resource on the platform it is given. The resource may own
// an upstream it is built on (a pool over a vmm_resource, say): the suite only talks to
// the memory_resource interface and destroys the object before checking for leaks.
// To put a new resource under contract, add one line to all_resource_factories().
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

namespace gpumem_test {

// A pool that owns the backend it is built on, so a factory returns one object.
template <class Pool, class Upstream>
class pool_over final : public gpumem::memory_resource {
 public:
  explicit pool_over(gpumem::platform& p)
      : memory_resource(p, 0), upstream_(p, 0), pool_(upstream_) {}
  std::string_view name() const noexcept override { return pool_.name(); }
  std::size_t max_alignment() const noexcept override { return pool_.max_alignment(); }
  gpumem::resource_stats stats() const override { return pool_.stats(); }
  std::string validate() const override { return pool_.validate(); }
  Pool& pool() { return pool_; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment, gpumem::stream_handle s) override {
    return pool_.allocate(bytes, alignment, s);
  }
  void do_deallocate(void* ptr, std::size_t bytes, gpumem::stream_handle s) override {
    pool_.deallocate(ptr, bytes, s);
  }

 private:
  Upstream upstream_;
  Pool pool_;
};

// Gives back what a pool caches (no-op for backends), so "holds nothing" can be checked.
inline void release_cached(gpumem::memory_resource& r) {
  if (auto* pool = dynamic_cast<gpumem::pool_base*>(&r)) pool->trim();
  if (auto* over = dynamic_cast<pool_over<gpumem::caching_pool, gpumem::runtime_resource>*>(&r))
    over->pool().trim();
  if (auto* over = dynamic_cast<pool_over<gpumem::caching_pool, gpumem::vmm_resource>*>(&r))
    over->pool().trim();
}


struct resource_factory {
  std::string name;  // a GoogleTest-safe identifier: letters, digits, '_'
  std::function<std::unique_ptr<gpumem::memory_resource>(gpumem::platform&)> make;
};

inline std::vector<resource_factory> all_resource_factories() {
  using namespace gpumem;
  return {
      {"runtime", [](platform& p) { return std::make_unique<runtime_resource>(p); }},
      {"driver", [](platform& p) { return std::make_unique<driver_resource>(p); }},
      {"vmm", [](platform& p) { return std::make_unique<vmm_resource>(p); }},
      {"caching_pool_over_runtime",
       [](platform& p) { return std::make_unique<pool_over<caching_pool, runtime_resource>>(p); }},
      {"caching_pool_over_vmm",
       [](platform& p) { return std::make_unique<pool_over<caching_pool, vmm_resource>>(p); }},
      {"vmm_page_pool", [](platform& p) { return std::make_unique<vmm_page_pool>(p); }},
  };
}

}  // namespace gpumem_test
