// Options shared by the pools, settable from C++ or from a configuration string in the
// style of PYTORCH_CUDA_ALLOC_CONF: "key:value,key:value" (GPUMEM_CONF in the environment).
//
// Every key, its default, what it trades and an example live in one table,
// gpumem/pool/option_table.hpp, from which the parser's list of valid keys, `gpumem options`
// and docs/OPTIONS.md are made. Unknown keys and malformed values throw
// gpumem::invalid_argument naming them; a later key wins over an earlier one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <string_view>

namespace gpumem {

enum class cross_stream_policy { event, wait, wait_before_growth };
enum class map_worker_mode { automatic, on, off };
// vmm_page_pool: when it moves pages (the footprint option). fast: a cache while growing
// stays within the budget, pages gathered only past it; tight: pages gathered on every
// growth that free pages can serve, reserved bytes held near the live bytes.
enum class footprint_mode { fast, tight };

struct pool_options {
  std::size_t reserve_bytes = 0;
  double reserve_fraction = 0.0;
  std::size_t limit_bytes = 0;
  std::size_t release_threshold = std::numeric_limits<std::size_t>::max();
  std::size_t small_threshold = std::size_t{1} << 20;
  cross_stream_policy cross_stream = cross_stream_policy::event;
  std::size_t va_reserve_bytes = 0;
  // vmm_page_pool: device memory every new physical handle leaves free (0: none); see
  // option_table.cpp.
  std::size_t keep_free_bytes = 0;
  std::size_t big_chunk_pages = 0;
  std::size_t huge_growth_bytes = std::size_t{1} << 30;
  bool scrub = false;
  bool guard = false;
  // vmm_page_pool: physical pages created exportable (POSIX file descriptor handles), so
  // any live allocation's pages can go to another process (export_pages).
  bool shareable = false;
  bool thread_cache = true;
  std::size_t round_large = 0;
  unsigned small_classes = 4;
  std::size_t small_cache = std::size_t{16} << 20;
  map_worker_mode map_worker = map_worker_mode::automatic;
  double growth_slack = 0.0;
  double remap_budget = 0.0;
  // vmm_page_pool with footprint:fast: the soft budget, a fraction of the peak live bytes
  // (0: none); see option_table.cpp.
  double soft_budget = 0.0;
  bool release_idle = false;
  bool lifetime_hints = true;
  footprint_mode footprint = footprint_mode::fast;
  // vmm_page_pool: devices granted access to the pool's pages besides its own (bit d:
  // device d), or every device that can reach them (peer_access_all).
  std::uint64_t peer_access = 0;
  bool peer_access_all = false;

  static pool_options parse(std::string_view config);
  // Whether n is a valid small_classes (0 or a power of two up to 64), for parse() and the
  // pools' constructors (options built in code skip parse()).
  static constexpr bool valid_small_classes(unsigned n) noexcept {
    return n <= 64 && (n & (n - 1)) == 0;
  }
  // GPUMEM_CONF, or defaults when unset.
  static pool_options from_environment();
  std::string to_string() const;

 private:
  static void apply(pool_options& o, std::string_view key, std::string_view value);
};

// "2G", "512M", "4096", "1.5G" -> bytes; throws gpumem::invalid_argument.
std::size_t parse_bytes(std::string_view text);

// The grammar of every configuration string (GPUMEM_CONF, the tool's --config, the C API's
// gpumem_pool_create): items apart by commas, each "key:value" split at its first colon,
// spaces and tabs around items, keys and values left out, empty items skipped. Calls
// fn(key, value, item) for each item in order; throws gpumem::invalid_argument for an item
// without a colon, before fn sees it.
void for_each_config_item(
    std::string_view config,
    const std::function<void(std::string_view key, std::string_view value, std::string_view item)>& fn);

}  // namespace gpumem
