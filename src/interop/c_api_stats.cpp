// The C API's stats, counters, reports and snapshots (gpumem_pool_stats,
// gpumem_pool_counter, gpumem_pool_report, gpumem_pool_explain, gpumem_snapshot) over the
// pool layer. Stats, the report, the explanation, the snapshot and the pool's counts cover
// every tag; settings and states among the counters, and the step plan's, are tag 0's.
#include "gpumem/interop/gpumem.h"
#include "interop/c_api_internal.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/platform/timed_platform.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/pool/core/overhead.hpp"
#include "gpumem/pool/vmm/tagged_pool.hpp"
// The telemetry layer's PyTorch snapshot writer, where this tree has it (it is built in
// the same library, so the header's presence means the function's).
#if __has_include("gpumem/telemetry/snapshot.hpp")
#include "gpumem/telemetry/snapshot.hpp"
#define GPUMEM_C_API_HAS_SNAPSHOT 1
#endif

using gpumem::detail::c_api_fail;
using gpumem::detail::guarded;
using gpumem::detail::live_body;
using gpumem::detail::pool_body;

extern "C" {

gpumem_status gpumem_pool_stats(gpumem_pool* pool, gpumem_stats* out) {
  pool_body* body = live_body(pool, "gpumem_pool_stats");
  if (body == nullptr) return gpumem_last_status();
  if (out == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_pool_stats: null output pointer");
  return guarded("gpumem_pool_stats", [&] {
    const gpumem::resource_stats s = body->stats();  // every tag's
    gpumem_stats r{};
    r.live_bytes = s.live_bytes;
    r.peak_live_bytes = s.peak_live_bytes;
    r.live_allocations = s.live_allocations;
    r.reserved_bytes = s.reserved_bytes;
    r.peak_reserved_bytes = s.peak_reserved_bytes;
    r.cached_bytes = s.cached_bytes;
    r.allocations = s.allocations;
    r.deallocations = s.deallocations;
    r.alloc_retries = s.alloc_retries;
    r.oom_count = s.oom_count;
    r.cross_stream_waits = body->cross_stream_waits.load(std::memory_order_relaxed);
    r.fragmentation = s.fragmentation();
    *out = r;
  });
}

gpumem_status gpumem_pool_counter(gpumem_pool* pool, const char* name, uint64_t* out) {
  pool_body* body = live_body(pool, "gpumem_pool_counter");
  if (body == nullptr) return gpumem_last_status();
  if (name == nullptr || out == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_pool_counter: null name or output");
  return guarded("gpumem_pool_counter", [&] {
    const std::string_view n(name);
    if (n == "driver_ns") {
      *out = body->timed->measured_ns();
      return;
    }
    // "<call>" counts the calls, "<call>.ns" sums their time.
    const bool ns = n.size() > 3 && n.substr(n.size() - 3) == ".ns";
    const std::string_view call = ns ? n.substr(0, n.size() - 3) : n;
    for (std::size_t i = 0; i < gpumem::platform_op_count; ++i) {
      const auto op = static_cast<gpumem::platform_op>(i);
      if (gpumem::platform_op_name(op) == call) {
        *out = ns ? body->timed->measured_ns(op) : body->platform->calls_made(op);
        return;
      }
    }
    if (ns) throw gpumem::invalid_argument("gpumem_pool_counter: unknown CUDA call '" + std::string(call) + "'");
    // Counts cover every tag's pool (the pool's own parts); settings and states are tag 0's.
    for (const gpumem::pool_counter& c : body->pool->counters().named)
      if (c.name == n) {
        *out = c.value;
        if (c.summed)
          for (const auto& [tag, tag_pool] : body->tag_pools())
            for (const gpumem::pool_counter& t : tag_pool->counters().named)
              if (t.name == n) *out += t.value;
        return;
      }
    if (body->planner != nullptr) {
      const gpumem::step_planner_counts c = body->planner->counts();
      const std::pair<std::string_view, std::uint64_t> counters[] = {
          {"plan_marks", c.steps},
          {"plans_built", c.plans_built},
          {"planned_steps", c.planned_steps},
          {"steps_left_plan", c.steps_left_plan},
          {"steps_rejoined", c.steps_rejoined},
          {"planned_allocations", c.planned_allocations},
          {"plan_region_failures", c.region_failures},
          {"plan_region_takes", c.region_takes},
          {"plan_regions_handed_over", c.regions_handed_over},
          {"plan_region_bytes", c.region_bytes},
          {"plan_lower_bound", c.plan_lower_bound},
          {"planned_per_step", c.planned_count}};
      for (const auto& [key, value] : counters)
        if (key == n) {
          *out = value;
          return;
        }
    }
    throw gpumem::invalid_argument("unknown counter '" + std::string(n) + "' for the '" +
                                   body->allocator + "' pool");
  });
}

// Writes text to buf (truncated, NUL-terminated when capacity > 0); returns its full length.
static size_t copy_text(const std::string& text, char* buf, size_t capacity) {
  if (buf != nullptr && capacity > 0) {
    const std::size_t n = std::min(text.size(), capacity - 1);
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

size_t gpumem_pool_report(gpumem_pool* pool, size_t size, char* buf, size_t capacity) {
  std::string report;
  pool_body* body = live_body(pool, "gpumem_pool_report");
  if (body == nullptr) return 0;
  if (guarded("gpumem_pool_report", [&] { report = body->memory_report(size); }) !=
      GPUMEM_SUCCESS)
    return 0;
  return copy_text(report, buf, capacity);
}

size_t gpumem_pool_explain(gpumem_pool* pool, char* buf, size_t capacity) {
  std::string text;
  pool_body* body = live_body(pool, "gpumem_pool_explain");
  if (body == nullptr) return 0;
  if (guarded("gpumem_pool_explain", [&] {
        text = gpumem::explain_overhead(*body->pool).to_string();
        for (const auto& [tag, tag_pool] : body->tag_pools())
          text += "tag " + gpumem::tag_label(tag) + ":\n" +
                  gpumem::explain_overhead(*tag_pool).to_string();
      }) !=
      GPUMEM_SUCCESS)
    return 0;
  return copy_text(text, buf, capacity);
}

gpumem_status gpumem_snapshot(gpumem_pool* pool, const char* path) {
  pool_body* body = live_body(pool, "gpumem_snapshot");
  if (body == nullptr) return gpumem_last_status();
  if (path == nullptr || *path == '\0')
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_snapshot: empty path");
#ifdef GPUMEM_C_API_HAS_SNAPSHOT
  // No event recorder is attached to C API pools: segments and blocks, no device trace.
  return guarded("gpumem_snapshot", [&] {
    std::vector<gpumem::snapshot_part> parts;
    for (const auto& [tag, tag_pool] : body->tag_pools()) parts.push_back({tag_pool, tag});
    gpumem::write_memory_snapshot(*body->pool, nullptr, std::string(path), body->planner.get(),
                                  parts);
  });
#else
  return c_api_fail(GPUMEM_ERROR_NOT_SUPPORTED,
              "gpumem_snapshot: this build has no PyTorch snapshot exporter "
              "(gpumem/telemetry/snapshot.hpp is not part of it)");
#endif
}

}  // extern "C"
