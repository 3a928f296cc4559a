#include "gpumem/telemetry/memory_stats.hpp"

#include <algorithm>
#include <sstream>

#include "gpumem/pool/core/pool_base.hpp"

namespace gpumem {

memory_stats collect_memory_stats(const pool_base& pool) {
  memory_stats m;
  m.allocator = std::string(pool.name());
  m.device = pool.device();
  const resource_stats s = pool.stats();
  const std::vector<memory_segment> segments = pool.memory_segments();
  std::size_t allocated = 0;
  for (const memory_segment& seg : segments) {
    std::size_t in_use = 0, idle = 0;
    for (const memory_block& b : seg.blocks)
      (b.st == memory_block::state::allocated ? in_use : idle) += b.size;
    allocated += in_use;
    if (in_use != 0) m.inactive_split_bytes += idle;
  }
  m.segments = segments.size();
  m.allocated_bytes = {allocated, std::max(allocated, pool.peak_allocated_block_bytes())};
  m.active_bytes = m.allocated_bytes;
  m.requested_bytes = {s.live_bytes, s.peak_live_bytes};
  m.reserved_bytes = {s.reserved_bytes, s.peak_reserved_bytes};
  m.cached_bytes = s.cached_bytes;
  m.largest_free_block = pool.largest_free_block();
  m.live_allocations = s.live_allocations;
  m.num_allocs = s.allocations;
  m.num_frees = s.deallocations;
  m.num_alloc_retries = s.alloc_retries;
  m.num_ooms = s.oom_count;
  m.fragmentation = s.fragmentation();
  const platform& p = pool.device_platform();
  for (std::size_t i = 0; i < platform_op_count; ++i) {
    const auto op = static_cast<platform_op>(i);
    if (const std::uint64_t n = p.calls_made(op); n != 0)
      m.driver_calls[std::string(platform_op_name(op))] = n;
  }
  if (const pool_counters c = pool.counters(); c.has_pages) {
    m.has_pages = true;
    m.page_size = c.page_size;
    m.pages_mapped = c.mapped_pages;
    m.pages_kept = c.spare_pages;
    m.physical_handles = c.handles;
    m.pages_created = c.pages_created;
    m.pages_reclaimed = c.pages_reclaimed;
    m.pages_released = c.pages_released;
  }
  return m;
}

std::vector<std::pair<std::string, double>> memory_stats::torch_keys() const {
  std::vector<std::pair<std::string, double>> k;
  auto add = [&](std::string name, double v) { k.emplace_back(std::move(name), v); };
  auto pair = [&](const char* name, const stat_value& v) {
    add(std::string(name) + ".all.current", static_cast<double>(v.current));
    add(std::string(name) + ".all.peak", static_cast<double>(v.peak));
  };
  pair("allocated_bytes", allocated_bytes);
  pair("requested_bytes", requested_bytes);
  pair("reserved_bytes", reserved_bytes);
  pair("active_bytes", active_bytes);
  add("inactive_split_bytes.all.current", static_cast<double>(inactive_split_bytes));
  add("allocation.all.current", static_cast<double>(live_allocations));
  add("allocation.all.allocated", static_cast<double>(num_allocs));
  add("allocation.all.freed", static_cast<double>(num_frees));
  add("segment.all.current", static_cast<double>(segments));
  add("num_alloc_retries", static_cast<double>(num_alloc_retries));
  add("num_ooms", static_cast<double>(num_ooms));
  add("gpumem.cached_bytes", static_cast<double>(cached_bytes));
  add("gpumem.largest_free_block", static_cast<double>(largest_free_block));
  add("gpumem.fragmentation", fragmentation);
  if (has_pages) {
    add("gpumem.page_size", static_cast<double>(page_size));
    add("gpumem.pages_mapped", static_cast<double>(pages_mapped));
    add("gpumem.pages_kept", static_cast<double>(pages_kept));
    add("gpumem.physical_handles", static_cast<double>(physical_handles));
    add("gpumem.pages_created", static_cast<double>(pages_created));
    add("gpumem.pages_reclaimed", static_cast<double>(pages_reclaimed));
    add("gpumem.pages_released", static_cast<double>(pages_released));
  }
  for (const auto& [call, n] : driver_calls)
    add("gpumem.driver_calls." + call, static_cast<double>(n));
  return k;
}

std::string memory_stats::to_string() const {
  std::ostringstream o;
  o << allocator << " on device " << device << ":\n";
  auto line = [&](const char* name, const stat_value& v) {
    o << "  " << name << ": " << format_bytes(v.current) << " (peak " << format_bytes(v.peak)
      << ")\n";
  };
  line("allocated_bytes", allocated_bytes);
  line("requested_bytes", requested_bytes);
  line("reserved_bytes", reserved_bytes);
  line("active_bytes", active_bytes);
  o << "  inactive_split_bytes: " << format_bytes(inactive_split_bytes) << "\n"
    << "  cached_bytes: " << format_bytes(cached_bytes) << "\n"
    << "  largest_free_block: " << format_bytes(largest_free_block) << "\n"
    << "  allocations: " << live_allocations << " live, " << num_allocs << " made, "
    << num_frees << " freed; segments: " << segments << "\n"
    << "  num_alloc_retries: " << num_alloc_retries << ", num_ooms: " << num_ooms << "\n"
    << "  fragmentation (peak reserved / peak requested): " << fragmentation << "\n";
  if (has_pages)
    o << "  pages of " << format_bytes(page_size) << ": " << pages_mapped << " mapped, "
      << pages_kept << " kept for reuse, " << physical_handles << " handles; "
      << pages_created << " created, " << pages_reclaimed << " reclaimed, " << pages_released
      << " released\n";
  o << "  driver calls:";
  for (const auto& [call, n] : driver_calls) o << " " << call << "=" << n;
  o << "\n";
  return o.str();
}

}  // namespace gpumem
