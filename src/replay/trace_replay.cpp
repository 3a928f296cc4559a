// Deterministic replay of a loaded trace on any memory_resource: the trace's clock, the
// passes, and the driver calls each pass made (trace.hpp).
#include "gpumem/replay/trace.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <string>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/platform/timed_platform.hpp"
#include "gpumem/platform/status_error.hpp"
#include "gpumem/pool/plan/large_planner.hpp"
#include "gpumem/pool/plan/step_planner.hpp"

namespace gpumem {

trace_clock::trace_clock(platform& p, const trace& t, pool_base* pool)
    : platform_(p), trace_(t), pool_(pool) {
  const std::uint64_t n = t.events.size();
  // A timed trace's pass starts one average event after the last one ended.
  pass_ns_ = !t.timed ? n * untimed_event_ns
                      : t.duration_ns + (n > 1 ? t.duration_ns / (n - 1) : untimed_event_ns);
  if (pool_ != nullptr) pool_->set_clock(this);
}

trace_clock::~trace_clock() {
  if (pool_ != nullptr) pool_->set_clock(nullptr);
}

void trace_clock::at(int pass, std::size_t index) noexcept {
  const std::size_t n = trace_.events.size();
  const std::uint64_t at = !trace_.timed ? index * untimed_event_ns
                           : index < n   ? trace_.events[index].time_ns
                                         : trace_.duration_ns;
  event_ns_ = static_cast<std::uint64_t>(pass) * pass_ns_ + at;
}

std::uint64_t trace_clock::now_ns() const noexcept {
  std::uint64_t driver = 0;
  if (auto* timed = dynamic_cast<timed_platform*>(&platform_))
    driver = timed->measured_ns();
  else if (auto* sim = dynamic_cast<sim_platform*>(&platform_))
    driver = sim->modelled_ns();
  return event_ns_ + driver;
}

std::string oversized_request(const trace& t, const std::string& allocator, std::uint64_t event,
                              std::uint64_t bytes, std::size_t device_total) {
  return "out of memory replaying " + t.source + " on " + allocator + ": event " +
         std::to_string(event) + " requests " + format_bytes(bytes) +
         ", more than the device's whole memory (" + format_bytes(device_total) + ")";
}

bool moves_memory(platform_op op) noexcept {
  switch (op) {
    case platform_op::create_physical:
    case platform_op::release_physical:
    case platform_op::map:
    case platform_op::unmap:
    case platform_op::set_access:
    case platform_op::runtime_malloc:
    case platform_op::runtime_free:
    case platform_op::driver_alloc:
    case platform_op::driver_free:
      return true;
    default:
      return false;
  }
}

namespace {

using op_counts = std::array<std::uint64_t, platform_op_count>;

// The driver calls made on a platform and the time spent in them, per call: time modelled
// on sim, measured through a timing decorator, else 0.
class driver_meter {
 public:
  explicit driver_meter(platform& p)
      : platform_(p),
        sim_(dynamic_cast<sim_platform*>(&p)),
        timed_(dynamic_cast<timed_platform*>(&p)) {}
  sim_platform* sim() const noexcept { return sim_; }
  std::uint64_t calls(platform_op op) const { return platform_.calls_made(op); }
  std::uint64_t ns(platform_op op) const {
    if (timed_ != nullptr) return timed_->measured_ns(op);
    if (sim_ != nullptr) return sim_->modelled_ns(op);
    return 0;
  }
  op_counts all_calls() const {
    op_counts c{};
    for (std::size_t i = 0; i < platform_op_count; ++i) c[i] = calls(static_cast<platform_op>(i));
    return c;
  }
  op_counts all_ns() const {
    op_counts c{};
    for (std::size_t i = 0; i < platform_op_count; ++i) c[i] = ns(static_cast<platform_op>(i));
    return c;
  }

 private:
  platform& platform_;
  sim_platform* sim_;
  timed_platform* timed_;
};

// The trace's first stream is the default stream; others get streams of their own
// (create()), released from the resource and destroyed on every way out.
struct replay_streams {
  platform& p;
  memory_resource& resource;
  std::vector<stream_handle> handles;
  void create() {
    for (std::size_t i = 1; i < handles.size(); ++i) {
      auto s = p.stream_create(resource.device());
      if (!s) throw_cuda_error(s.error(), "replay_trace: stream");
      handles[i] = s.value();
    }
  }
  ~replay_streams() {
    for (std::size_t i = 1; i < handles.size(); ++i) {
      if (handles[i].value == 0) continue;
      try {
        resource.release_stream(handles[i]);
      } catch (...) {
        // Destruction must not throw; the stream is still destroyed below.
      }
      (void)p.stream_destroy(handles[i]);
    }
  }
};

// The GPU behind the CPU (sim): events stay incomplete between catch-ups, and all
// complete again however the replay ends.
struct lag_model {
  sim_platform* sim;
  explicit lag_model(sim_platform* s) : sim(s) {
    if (sim != nullptr) sim->hold_events(true);
  }
  ~lag_model() {
    if (sim == nullptr) return;
    sim->complete_events();
    sim->hold_events(false);
  }
  lag_model(const lag_model&) = delete;
  lag_model& operator=(const lag_model&) = delete;
};

// What the passes of one replay share: the pointers live, the bytes live, the result.
struct replay_run {
  const trace& t;
  memory_resource& resource;
  const replay_options& options;
  const std::vector<stream_handle>& streams;
  trace_clock& clock;
  step_planner* planner;  // null unless the resource is one
  sim_platform* lag_sim;  // null unless options.gpu_lag models a GPU behind the CPU
  replay_result& r;
  std::vector<void*> ptrs = std::vector<void*>(t.allocs, nullptr);
  std::size_t sample_every = std::max<std::size_t>(1, t.events.size() / 2000);
  std::size_t live = 0;

  // Replays the events of pass `pass` in order, stopping at an out-of-memory (r.oom, with
  // its event and message). Returns the events run (the failing one not counted).
  std::uint64_t run_pass(int pass) {
    std::uint64_t index = 0;
    auto next_step = options.step_starts.begin();
    for (const trace_event& e : t.events) {
      clock.at(pass, index);
      if (planner != nullptr && next_step != options.step_starts.end() && *next_step == index) {
        planner->mark_step();
        ++next_step;
        ++r.steps_marked;
      }
      if (e.op == trace_event::kind::alloc) {
        if (e.size > resource.device_total_bytes()) {  // the resource refuses it as a bad argument
          r.oom = true;
          r.oom_event = index;
          r.oom_message = oversized_request(t, r.allocator, index, e.size, resource.device_total_bytes());
          break;
        }
        try {
          void* ptr = resource.allocate(e.size, default_alignment, streams[e.stream]);
          ptrs[e.id] = ptr;
          if (options.touch) static_cast<volatile char*>(ptr)[0] = 1;
        } catch (const out_of_memory& oom) {
          r.oom = true;
          r.oom_event = index;
          r.oom_message = oom.what();
          break;
        }
        live += e.size;
        ++r.allocs;
      } else {
        resource.deallocate(ptrs[e.id], e.size, streams[e.stream]);
        ptrs[e.id] = nullptr;
        live -= e.size;
        ++r.frees;
      }
      if (lag_sim != nullptr && (index + 1) % options.gpu_lag == 0) lag_sim->complete_events();
      if (pass == 0 && index % sample_every == 0) {
        r.live_samples.emplace_back(index, live);
        r.reserved_samples.emplace_back(index, resource.stats().reserved_bytes);
      }
      ++index;
    }
    return index;
  }

  // Allocations still live at the end of a pass are freed before the next one.
  void free_live() {
    for (const trace_event& e : t.events) {
      if (e.op == trace_event::kind::alloc && ptrs[e.id] != nullptr) {
        resource.deallocate(ptrs[e.id], e.size, streams[e.stream]);
        ptrs[e.id] = nullptr;
        live -= e.size;
      }
    }
  }
};

// The step planner's counts into `r`.
void record_plan_counts(const step_planner& planner, replay_result& r) {
  const step_planner_counts c = planner.counts();
  r.plans_built = c.plans_built;
  r.planned_allocations = c.planned_allocations;
  r.steps_left_plan = c.steps_left_plan;
  r.steps_rejoined = c.steps_rejoined;
  r.regions_handed_over = c.regions_handed_over;
}

// The large-request planner's counts into `r`.
void record_large_plan_counts(const large_planner& planner, replay_result& r) {
  const large_planner_counts c = planner.counts();
  r.large_requests = c.large_requests;
  r.plans_built = c.plans_built;
  r.planned_allocations = c.planned_allocations;
  r.large_plan_misses = c.misses;
  r.large_plan_conflicts = c.conflicts;
  r.large_plan_region_takes = c.region_takes;
  r.regions_handed_over = c.regions_handed_over;
}

// The driver calls made since `calls_before` (and, with several passes, since the last
// pass began: `calls_at_pass`) and the time in them since `ns_before`, into `r`.
void record_driver_calls(const driver_meter& meter, const op_counts& calls_before,
                         const op_counts& ns_before, const op_counts& calls_at_pass, int passes,
                         replay_result& r) {
  for (std::size_t i = 0; i < platform_op_count; ++i) {
    const auto op = static_cast<platform_op>(i);
    const std::uint64_t n = meter.calls(op) - calls_before[i];
    if (n == 0) continue;
    const auto name = std::string(platform_op_name(op));
    if (passes > 1) {
      const std::uint64_t last = meter.calls(op) - calls_at_pass[i];
      r.last_pass_driver_calls[name] = last;
      if (moves_memory(op)) r.last_pass_memory_calls += last;
    }
    r.driver_calls[name] = n;
    const double ns = static_cast<double>(meter.ns(op) - ns_before[i]);
    r.driver_call_ns[name] = ns;
    r.driver_ns += ns;
  }
}

}  // namespace

replay_result replay_trace(const trace& t, memory_resource& resource, const replay_options& options) {
  replay_result r;
  r.allocator = std::string(resource.name());
  r.peak_live_bytes = t.peak_live_bytes;
  platform& p = resource.device_platform();
  const driver_meter meter(p);
  replay_streams streams{p, resource, std::vector<stream_handle>(t.streams.size())};
  streams.create();
  const op_counts calls_before = meter.all_calls();
  const op_counts ns_before = meter.all_ns();
  const lag_model lag{options.gpu_lag > 0 ? meter.sim() : nullptr};
  auto* planner = dynamic_cast<step_planner*>(&resource);
  // The pool runs on the trace's clock while it is replayed, and on its own again after.
  pool_base* clocked = planner != nullptr ? &planner->pool() : dynamic_cast<pool_base*>(&resource);
  if (auto* lp = dynamic_cast<large_planner*>(&resource)) clocked = &lp->pool();
  trace_clock clock(p, t, clocked);
  replay_run run{t, resource, options, streams.handles, clock, planner, lag.sim, r};
  op_counts calls_at_pass{};
  for (int pass = 0; pass < options.passes && !r.oom; ++pass) {
    calls_at_pass = meter.all_calls();
    const op_counts ns_at_pass = meter.all_ns();
    const std::uint64_t allocs_before = r.allocs;
    const auto start = std::chrono::steady_clock::now();
    const std::uint64_t events = run.run_pass(pass);
    const double ns = std::chrono::duration<double, std::nano>(
                          std::chrono::steady_clock::now() - start).count();
    const double per_event = events == 0 ? 0 : ns / static_cast<double>(events);
    if (pass == 0) r.ns_per_event_cold = per_event;
    r.ns_per_event_warm = per_event;
    const op_counts ns_after = meter.all_ns();
    std::uint64_t pass_driver_ns = 0;
    for (std::size_t i = 0; i < platform_op_count; ++i) pass_driver_ns += ns_after[i] - ns_at_pass[i];
    const double driver_per_event =
        events == 0 ? 0 : static_cast<double>(pass_driver_ns) / static_cast<double>(events);
    if (pass == 0) r.driver_ns_per_event_cold = driver_per_event;
    r.driver_ns_per_event_warm = driver_per_event;
    if (options.passes > 1) r.last_pass_allocs = r.allocs - allocs_before;
    run.free_live();
  }
  if (planner != nullptr) record_plan_counts(*planner, r);
  if (auto* lp = dynamic_cast<const large_planner*>(&resource)) record_large_plan_counts(*lp, r);
  const resource_stats s = resource.stats();
  r.peak_reserved_bytes = s.peak_reserved_bytes;
  r.fragmentation = r.peak_live_bytes == 0
                        ? 0
                        : static_cast<double>(r.peak_reserved_bytes) /
                              static_cast<double>(r.peak_live_bytes);
  record_driver_calls(meter, calls_before, ns_before, calls_at_pass, options.passes, r);
  return r;
}

}  // namespace gpumem
