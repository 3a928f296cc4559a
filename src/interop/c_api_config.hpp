// The configuration string of gpumem_pool_create: the C API's own keys (the option table's
// rows of scope pool_create) taken out and checked, the rest left for pool_options::parse.
// One grammar with the pool options (for_each_config_item). Not part of the public API.
#pragma once

#include <string>
#include <string_view>

#include "gpumem/platform/sim_platform.hpp"

namespace gpumem::detail {

struct c_api_pool_spec {
  std::string allocator = "vmm_page_pool";
  std::string backend = "runtime";
  std::string platform;  // "" = gpumem::default_platform() (honours GPUMEM_DEVICE)
  int device = 0;
  bool step_plan = true;
  // A private sim device when any sim_* key is given.
  bool own_sim = false;
  std::string sim_key;  // the first sim_* key given, for messages
  gpumem::sim_options sim;
  bool sim_devices_given = false;
  std::string pool_options;  // the items that are pool options, in their order
};

// Throws gpumem::invalid_argument naming the key for an unknown key or a bad value.
c_api_pool_spec parse_c_api_config(std::string_view config);

}  // namespace gpumem::detail
