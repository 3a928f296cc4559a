#include "replay_peak.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/plan/step_planner.hpp"
#include "gpumem/pool/pool_factory.hpp"

namespace gpumem::cli {

void plan_steps(allocator_under_test& a) {
  auto* pool = dynamic_cast<pool_base*>(a.resource.get());
  if (pool == nullptr) return;
  a.pool = std::move(a.resource);
  a.resource = std::make_unique<step_planner>(*pool);
}

allocator_under_test make_allocator(const std::string& name, platform& p, int device,
                                    const pool_options& options) {
  resource_spec spec;
  spec.allocator = name;
  spec.device = device;
  spec.options = options;
  made_resource made = make_resource(p, spec);
  allocator_under_test a;
  a.upstream = std::move(made.upstream);
  if (made.pool)
    a.resource = std::move(made.pool);
  else
    a.resource = std::move(made.backend);
  return a;
}

prefix_result replay_prefix(const trace& t, pool_base& pool, int passes, std::size_t gpu_lag,
                            std::size_t end, bool find_peak, const std::function<void()>& at_stop) {
  platform& p = pool.device_platform();
  std::vector<stream_handle> streams(t.streams.size());
  for (std::size_t i = 1; i < streams.size(); ++i) {
    auto s = p.stream_create(pool.device());
    if (!s) throw cuda_error(std::string(platform_op_name(s.error().call)), s.error().code,
                             s.error().name, s.error().message, "gpumem replay --snapshot");
    streams[i] = s.value();
  }
  auto* lag_sim = gpu_lag > 0 ? dynamic_cast<sim_platform*>(&p) : nullptr;
  if (lag_sim != nullptr) lag_sim->hold_events(true);
  // On the trace's clock, as replay_trace (the same decisions up to the stop).
  trace_clock clock(p, t, &pool);
  std::vector<void*> ptrs(t.allocs, nullptr);
  auto free_live = [&] {
    for (const trace_event& e : t.events)
      if (e.op == trace_event::kind::alloc && ptrs[e.id] != nullptr) {
        pool.deallocate(ptrs[e.id], e.size, streams[e.stream]);
        ptrs[e.id] = nullptr;
      }
  };
  prefix_result r;
  const std::size_t n = t.events.size();
  r.stopped_at = std::min(end, n * static_cast<std::size_t>(passes));
  std::size_t peak = 0;
  for (std::size_t g = 0; g < r.stopped_at; ++g) {
    const std::size_t i = g % n;
    if (i == 0 && g > 0) free_live();
    clock.at(static_cast<int>(g / n), i);
    const trace_event& e = t.events[i];
    if (e.op == trace_event::kind::alloc) {
      if (e.size > pool.device_total_bytes()) {  // as replay_trace: an out-of-memory
        r.oom = true;
        r.stopped_at = g;
        break;
      }
      try {
        ptrs[e.id] = pool.allocate(e.size, default_alignment, streams[e.stream]);
      } catch (const out_of_memory&) {
        r.oom = true;
        r.stopped_at = g;
        break;
      }
    } else {
      pool.deallocate(ptrs[e.id], e.size, streams[e.stream]);
      ptrs[e.id] = nullptr;
    }
    if (lag_sim != nullptr && (i + 1) % gpu_lag == 0) lag_sim->complete_events();
    if (find_peak) {
      const std::size_t reserved = pool.stats().reserved_bytes;
      if (reserved > peak) {
        peak = reserved;
        r.peak_at = g;
      }
    }
  }
  if (at_stop) at_stop();
  free_live();
  if (lag_sim != nullptr) {
    lag_sim->complete_events();
    lag_sim->hold_events(false);
  }
  for (std::size_t i = 1; i < streams.size(); ++i) {
    pool.release_stream(streams[i]);
    (void)p.stream_destroy(streams[i]);
  }
  return r;
}

prefix_result replay_to_peak(const trace& t, const peak_replay_setup& setup,
                             const std::string& allocator,
                             const std::function<void(pool_base&)>& before,
                             const std::function<void(pool_base&)>& at_stop,
                             const std::function<void(pool_base&)>& after) {
  auto fresh_platform = [&]() -> std::pair<std::unique_ptr<platform>, platform*> {
    if (setup.cuda == nullptr) {
      sim_options so;
      so.capacity = setup.sim_capacity;
      so.latency = sim_latency::model;  // as the full replays
      auto sim = std::make_unique<sim_platform>(so);
      platform* raw = sim.get();
      return {std::move(sim), raw};
    }
    return {nullptr, setup.cuda};
  };
  std::size_t stop_after = 0;
  {
    auto [owned, p] = fresh_platform();
    allocator_under_test a = make_allocator(allocator, *p, 0, setup.options);
    auto& pool = dynamic_cast<pool_base&>(*a.resource);
    const prefix_result first = replay_prefix(t, pool, setup.passes, setup.gpu_lag,
                                              static_cast<std::size_t>(-1), true, {});
    stop_after = first.oom ? first.stopped_at + 1 : first.peak_at + 1;
  }
  auto [owned, p] = fresh_platform();
  allocator_under_test a = make_allocator(allocator, *p, 0, setup.options);
  auto& pool = dynamic_cast<pool_base&>(*a.resource);
  struct run_after {
    const std::function<void(pool_base&)>& after;
    pool_base& pool;
    ~run_after() {
      if (after) after(pool);
    }
  } at_exit{after, pool};
  if (before) before(pool);
  return replay_prefix(t, pool, setup.passes, setup.gpu_lag, stop_after, false,
                       [&] { at_stop(pool); });
}

std::pair<std::size_t, std::size_t> pass_and_event(const trace& t, std::size_t stopped_at, bool oom) {
  const std::size_t n = t.events.size();
  if (n == 0) return {1, 0};
  if (oom) return {stopped_at / n + 1, stopped_at % n};
  const std::size_t last = stopped_at - 1;  // with events, a peak comes after at least one
  return {last / n + 1, last % n + 1};
}

// "pass P, after event E of N" (or "at event E" for an out-of-memory).
std::string where_in_trace(const trace& t, std::size_t stopped_at, bool oom, int passes) {
  const auto [pass, event] = pass_and_event(t, stopped_at, oom);
  std::string out = passes > 1 ? "pass " + std::to_string(pass) + ", " : "";
  out += (oom ? "at event " : "after event ") + std::to_string(event);
  return out + " of " + std::to_string(t.events.size());
}

}  // namespace gpumem::cli
