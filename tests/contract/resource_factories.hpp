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

namespace gpumem_test {

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
  };
}

}  // namespace gpumem_test
