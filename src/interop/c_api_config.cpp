// gpumem_pool_create's configuration (c_api_config.hpp).
#include "interop/c_api_config.hpp"

#include <algorithm>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/backend.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/pool/option_table.hpp"

namespace gpumem::detail {

namespace {

int parse_ordinal(std::string_view value, std::string_view key, int limit) {
  int n = 0;
  bool digits = !value.empty() && value.size() <= 6;
  for (char c : value) {
    digits = digits && c >= '0' && c <= '9';
    if (digits) n = n * 10 + (c - '0');
  }
  if (!digits || n >= limit)
    throw gpumem::invalid_argument("config: '" + std::string(key) + "' must be a number below " +
                                   std::to_string(limit) + ", got '" + std::string(value) + "'");
  return n;
}

// "A+B+C" -> {A, B, C} (a comma would end the item).
std::vector<std::string_view> plus_list(std::string_view value) {
  std::vector<std::string_view> out;
  while (true) {
    const auto plus = value.find('+');
    out.push_back(value.substr(0, plus));
    if (plus == std::string_view::npos) return out;
    value = value.substr(plus + 1);
  }
}

// Sizes of a sim_capacity / sim_granularity value: one for every device, or one per device.
void parse_sim_sizes(std::string_view key, std::string_view value, std::size_t& every,
                     std::vector<std::size_t>& each) {
  const auto parts = plus_list(value);
  std::vector<std::size_t> sizes;
  for (std::string_view part : parts) {
    const std::size_t n = gpumem::parse_bytes(part);
    if (n == 0)
      throw gpumem::invalid_argument("config: '" + std::string(key) +
                                     "' must be more than 0 bytes, got '" + std::string(value) +
                                     "'");
    if (key == "sim_granularity" && ((n & (n - 1)) != 0 || n < 4096))
      throw gpumem::invalid_argument("config: 'sim_granularity' must be a power of two of at "
                                     "least 4K, got '" + std::string(part) + "'");
    sizes.push_back(n);
  }
  if (sizes.size() == 1)
    every = sizes.front();
  else
    each = std::move(sizes);
}

// A private sim device's key (sim_capacity, sim_granularity, sim_devices, sim_no_peer)
// into spec.sim; false for a key that is none of them.
bool parse_sim_key(c_api_pool_spec& spec, std::string_view key, std::string_view value) {
  if (key == "sim_capacity") {
    parse_sim_sizes(key, value, spec.sim.capacity, spec.sim.capacities);
  } else if (key == "sim_granularity") {
    parse_sim_sizes(key, value, spec.sim.granularity, spec.sim.granularities);
  } else if (key == "sim_devices") {
    spec.sim.device_count = parse_ordinal(value, key, gpumem::sim_max_devices + 1);
    if (spec.sim.device_count == 0)
      throw gpumem::invalid_argument("config: 'sim_devices' must be at least 1");
    spec.sim_devices_given = true;
  } else if (key == "sim_no_peer") {
    spec.sim.no_peer.clear();
    if (value != "none")
      for (std::string_view pair : plus_list(value)) {
        const auto dash = pair.find('-');
        if (dash == std::string_view::npos)
          throw gpumem::invalid_argument("config: 'sim_no_peer' takes pairs A-B joined by "
                                         "'+', got '" + std::string(value) + "'");
        spec.sim.no_peer.emplace_back(
            parse_ordinal(pair.substr(0, dash), key, gpumem::sim_max_devices),
            parse_ordinal(pair.substr(dash + 1), key, gpumem::sim_max_devices));
      }
  } else {
    return false;
  }
  spec.own_sim = true;
  return true;
}

// The sim device as a whole, once every key is read: its device count (from sim_devices,
// else from the lists of sizes) and the pairs sim_no_peer names checked against it.
void check_sim(c_api_pool_spec& spec) {
  if (spec.own_sim && spec.platform == "cuda")
    throw gpumem::invalid_argument("config: '" + spec.sim_key +
                                   "' (a private sim device) needs platform sim, not cuda");
  if (spec.own_sim && !spec.sim_devices_given)
    spec.sim.device_count = static_cast<int>(std::max<std::size_t>(
        {std::size_t{1}, spec.sim.capacities.size(), spec.sim.granularities.size()}));
  if (spec.own_sim)
    for (auto [a, b] : spec.sim.no_peer)
      if (a >= spec.sim.device_count || b >= spec.sim.device_count || a == b)
        throw gpumem::invalid_argument("config: 'sim_no_peer' names a pair of devices that "
                                       "are not two of the sim device's " +
                                       std::to_string(spec.sim.device_count));
}

}  // namespace

// The configuration grammar is the pool options' (for_each_config_item); the C API's own
// keys are the option table's rows of scope pool_create, parsed here; the rest goes to
// pool_options::parse.
c_api_pool_spec parse_c_api_config(std::string_view config) {
  c_api_pool_spec spec;
  gpumem::for_each_config_item(config, [&](std::string_view key, std::string_view value,
                                           std::string_view item) {
    const gpumem::pool_option_info* row = gpumem::find_pool_option(key);
    if (row == nullptr)
      throw gpumem::invalid_argument(
          "config: unknown key '" + std::string(key) + "' (known: " +
          gpumem::pool_option_names() + "; and gpumem_pool_create's: " +
          gpumem::pool_option_names(gpumem::option_scope::pool_create) + ")");
    if (row->scope == gpumem::option_scope::pool) {
      if (!spec.pool_options.empty()) spec.pool_options += ',';
      spec.pool_options.append(item);
      return;
    }
    if (key.starts_with("sim_") && spec.sim_key.empty()) spec.sim_key = key;
    const auto one_of = [&](std::span<const std::string_view> names) {
      return std::find(names.begin(), names.end(), value) != names.end();
    };
    if (key == "allocator") {
      if (!one_of(gpumem::pool_names()))
        throw gpumem::invalid_argument("config: unknown allocator '" + std::string(value) +
                                       "': expected vmm_page_pool or caching_pool");
      spec.allocator = value;
    } else if (key == "backend") {
      if (!one_of(gpumem::backend_names()))
        throw gpumem::invalid_argument("config: unknown backend '" + std::string(value) +
                                       "': expected runtime, driver or vmm");
      spec.backend = value;
    } else if (key == "platform") {
      if (value != "auto" && value != "cuda" && value != "sim")
        throw gpumem::invalid_argument("config: unknown platform '" + std::string(value) +
                                       "': expected auto, cuda or sim");
      spec.platform = value;
    } else if (key == "device") {
      spec.device = parse_ordinal(value, key, 1000000);
    } else if (key == "step_plan") {
      if (value != "on" && value != "off")
        throw gpumem::invalid_argument("config: 'step_plan' must be on or off, got '" +
                                       std::string(value) + "'");
      spec.step_plan = value == "on";
    } else if (!parse_sim_key(spec, key, value)) {
      // A row of the table that this parser does not know: the table and this function
      // disagree (option_table_test checks that every row's example is taken here).
      throw gpumem::invalid_argument("config: the C API does not handle key '" +
                                     std::string(key) + "'");
    }
  });
  check_sim(spec);
  return spec;
}

}  // namespace gpumem::detail
