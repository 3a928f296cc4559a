#include "gpumem/replay/trace.hpp"
#include "gpumem/replay/torch_snapshot.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <unordered_map>

#include "gpumem/errors.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/platform/timed_platform.hpp"
#include "gpumem/platform/status_error.hpp"
#include "gpumem/pool/step_planner.hpp"

#if GPUMEM_HAVE_ZLIB
#include <zlib.h>
#endif

namespace gpumem {

namespace {

std::string read_all(const std::string& path) {
  std::string text;
#if GPUMEM_HAVE_ZLIB
  // gzread reads plain files unchanged, so one path serves both.
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) throw invalid_argument("trace: cannot open '" + path + "'");
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) text.append(buf, static_cast<std::size_t>(n));
  const bool failed = n < 0;
  gzclose(f);
  if (failed) throw invalid_argument("trace: '" + path + "' is not a readable gzip or text file");
#else
  std::FILE* probe = std::fopen(path.c_str(), "rb");
  if (probe == nullptr) throw invalid_argument("trace: cannot open '" + path + "'");
  std::fclose(probe);
  const std::string cmd = "gzip -dcf -- '" + path + "'";
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) throw invalid_argument("trace: cannot run gzip for '" + path + "'");
  char buf[1 << 16];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
  if (::pclose(p) != 0) throw invalid_argument("trace: '" + path + "' could not be decompressed");
#endif
  return text;
}

std::vector<std::string_view> split(std::string_view line) {
  std::vector<std::string_view> fields;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= line.size(); ++i) {
    if (i == line.size() || line[i] == ',') {
      std::string_view f = line.substr(start, i - start);
      while (!f.empty() && (f.front() == ' ' || f.front() == '"')) f.remove_prefix(1);
      while (!f.empty() && (f.back() == ' ' || f.back() == '"' || f.back() == '\r')) f.remove_suffix(1);
      fields.push_back(f);
      start = i + 1;
    }
  }
  return fields;
}

std::uint64_t parse_u64(std::string_view f, const std::string& where) {
  std::uint64_t v = 0;
  int base = 10;
  if (f.size() > 2 && f[0] == '0' && (f[1] == 'x' || f[1] == 'X')) {
    f.remove_prefix(2);
    base = 16;
  }
  auto [p, ec] = std::from_chars(f.data(), f.data() + f.size(), v, base);
  if (ec != std::errc{} || p != f.data() + f.size() || f.empty())
    throw invalid_argument("trace: " + where + ": '" + std::string(f) + "' is not a number");
  return v;
}

// An event's time in nanoseconds, or false: PyTorch's time_us (an integer of
// microseconds); RMM's Time, h:m:s with a fraction after '.' or ':'.
bool parse_time_ns(std::string_view f, bool rmm, std::uint64_t& ns) {
  auto number = [](std::string_view d, std::uint64_t& v) {
    auto [p, ec] = std::from_chars(d.data(), d.data() + d.size(), v);
    return ec == std::errc{} && p == d.data() + d.size() && !d.empty();
  };
  if (!rmm) {
    std::uint64_t us = 0;
    if (!number(f, us) || us > (std::uint64_t{1} << 63) / 1000) return false;
    ns = us * 1000;
    return true;
  }
  std::uint64_t part[3] = {};
  for (int i = 0; i < 3; ++i) {
    const std::size_t sep = i < 2 ? f.find(':') : f.find_first_of(".:");
    if (!number(f.substr(0, sep), part[i])) return false;
    f = sep == std::string_view::npos ? std::string_view{} : f.substr(sep + 1);
  }
  std::uint64_t frac_ns = 0, scale = 100'000'000;
  for (char c : f.substr(0, 9)) {
    if (c < '0' || c > '9') return false;
    frac_ns += static_cast<std::uint64_t>(c - '0') * scale;
    scale /= 10;
  }
  ns = ((part[0] * 60 + part[1]) * 60 + part[2]) * 1'000'000'000 + frac_ns;
  return true;
}

}  // namespace

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

trace parse_trace(const std::string& text, const std::string& source) {
  trace t;
  t.source = source;
  std::size_t pos = 0, line_no = 0;
  int col_action = -1, col_addr = -1, col_size = -1, col_stream = -1, col_time = -1;
  bool all_timed = true, have_first = false;
  std::uint64_t first_ns = 0, last_ns = 0;
  std::unordered_map<std::uint64_t, std::pair<std::uint32_t, std::uint64_t>> live;  // addr -> id,size
  std::unordered_map<std::uint64_t, std::uint32_t> stream_index;
  std::size_t live_bytes = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.empty() || line == "\r") continue;
    auto f = split(line);
    const std::string where = source + ":" + std::to_string(line_no);
    if (col_action < 0) {
      for (int i = 0; i < static_cast<int>(f.size()); ++i) {
        if (f[i] == "action") { col_action = i; t.format = "pytorch"; }
        if (f[i] == "Action") { col_action = i; t.format = "rmm"; }
        if (f[i] == "addr" || f[i] == "Pointer") col_addr = i;
        if (f[i] == "size" || f[i] == "Size") col_size = i;
        if (f[i] == "stream" || f[i] == "Stream") col_stream = i;
        if (f[i] == "time_us" || f[i] == "Time") col_time = i;
      }
      if (col_action < 0 || col_addr < 0 || col_size < 0)
        throw invalid_argument("trace: " + where +
                               ": unknown header; expected 'action,addr,size,stream,time_us' "
                               "(PyTorch) or 'Thread,Time,Action,Pointer,Size,Stream' (RMM)");
      continue;
    }
    const int needed = std::max({col_action, col_addr, col_size, col_stream});
    if (static_cast<int>(f.size()) <= needed)
      throw invalid_argument("trace: " + where + ": expected at least " +
                             std::to_string(needed + 1) + " fields");
    const std::string_view action = f[static_cast<std::size_t>(col_action)];
    const bool is_alloc = action == "alloc" || action == "allocate";
    const bool is_free = action == "free_completed" || action == "free";
    if (!is_alloc && !is_free) {
      if (action == "segment_alloc" || action == "segment_free" || action == "free_requested" ||
          action == "segment_map" || action == "segment_unmap" || action == "snapshot" ||
          action == "oom" || action == "allocate failure")
        continue;
      throw invalid_argument("trace: " + where + ": unknown action '" + std::string(action) + "'");
    }
    const std::uint64_t addr = parse_u64(f[static_cast<std::size_t>(col_addr)], where);
    const std::uint64_t size = parse_u64(f[static_cast<std::size_t>(col_size)], where);
    const std::uint64_t stream =
        col_stream >= 0 && !f[static_cast<std::size_t>(col_stream)].empty()
            ? parse_u64(f[static_cast<std::size_t>(col_stream)], where)
            : 0;
    // Times never go back (a multi-threaded RMM log may interleave them): each is at
    // least the one before.
    std::uint64_t time_ns = 0;
    if (all_timed) {
      std::uint64_t ns = 0;
      if (col_time >= 0 && static_cast<std::size_t>(col_time) < f.size() &&
          parse_time_ns(f[static_cast<std::size_t>(col_time)], t.format == "rmm", ns)) {
        if (!have_first) {
          first_ns = ns;
          have_first = true;
        }
        last_ns = std::max(last_ns, ns > first_ns ? ns - first_ns : 0);
        time_ns = last_ns;
      } else {
        all_timed = false;
      }
    }
    auto [sit, fresh] = stream_index.emplace(stream, static_cast<std::uint32_t>(t.streams.size()));
    if (fresh) t.streams.push_back(stream);
    if (is_alloc) {
      if (size == 0) continue;  // nothing to replay
      const auto id = static_cast<std::uint32_t>(t.allocs++);
      live[addr] = {id, size};
      t.events.push_back({trace_event::kind::alloc, id, size, sit->second, time_ns});
      live_bytes += size;
      t.peak_live_bytes = std::max(t.peak_live_bytes, live_bytes);
      t.max_size = std::max(t.max_size, size);
    } else {
      auto it = live.find(addr);
      if (it == live.end()) {
        ++t.unmatched_frees;
        continue;
      }
      t.events.push_back({trace_event::kind::free, it->second.first, it->second.second, sit->second,
                          time_ns});
      live_bytes -= it->second.second;
      ++t.frees;
      live.erase(it);
    }
  }
  if (col_action < 0) throw invalid_argument("trace: " + source + " is empty");
  t.timed = all_timed && !t.events.empty();
  if (t.timed)
    t.duration_ns = t.events.back().time_ns;
  else
    for (trace_event& e : t.events) e.time_ns = 0;
  t.live_at_end = live.size();
  return t;
}

trace load_trace(const std::string& path) {
  const std::string bytes = read_all(path);
  // A PyTorch memory snapshot (torch.cuda.memory._dump_snapshot): its device trace.
  if (looks_like_pickle(bytes)) return parse_trace(torch_snapshot_to_trace_csv(bytes, path), path);
  return parse_trace(bytes, path);
}

std::vector<std::size_t> find_steps(const trace& t, std::size_t min_repeats) {
  // The allocations, as (size, stream), with their event indices.
  std::vector<std::pair<std::uint64_t, std::uint32_t>> req;
  std::vector<std::size_t> at;
  for (std::size_t i = 0; i < t.events.size(); ++i)
    if (t.events[i].op == trace_event::kind::alloc) {
      req.emplace_back(t.events[i].size, t.events[i].stream);
      at.push_back(i);
    }
  const std::size_t n = req.size();
  std::size_t period = 0;
  for (std::size_t p = 1; p <= n / 2 && period == 0; ++p)
    if (std::equal(req.end() - static_cast<std::ptrdiff_t>(p), req.end(),
                   req.end() - static_cast<std::ptrdiff_t>(2 * p)))
      period = p;
  if (period == 0) return {};
  std::size_t first = n - 2 * period;  // the repeat holds for allocations [first, n)
  while (first > 0 && req[first - 1] == req[first - 1 + period]) --first;
  if ((n - first) / period < min_repeats) return {};

  // Live bytes after each event of the last full period; the step begins at the first
  // allocation after the least.
  std::size_t live = 0, least = static_cast<std::size_t>(-1), least_at = 0;
  const std::size_t from = at[n - 2 * period], to = at[n - period];
  for (std::size_t i = 0; i < to; ++i) {
    const trace_event& e = t.events[i];
    live = e.op == trace_event::kind::alloc ? live + e.size : live - e.size;
    if (i >= from && live < least) {
      least = live;
      least_at = i;
    }
  }
  const auto next_alloc = std::upper_bound(at.begin(), at.end(), least_at);
  const std::size_t phase = static_cast<std::size_t>(next_alloc - at.begin()) % period;
  std::vector<std::size_t> starts;
  for (std::size_t k = phase; k < n; k += period)
    if (k >= first) starts.push_back(at[k]);
  return starts;
}

replay_result replay_trace(const trace& t, memory_resource& resource, const replay_options& options) {
  replay_result r;
  r.allocator = std::string(resource.name());
  r.peak_live_bytes = t.peak_live_bytes;
  platform& p = resource.device_platform();
  auto* sim = dynamic_cast<sim_platform*>(&p);
  auto* timed = dynamic_cast<timed_platform*>(&p);
  // Driver time per operation: modelled on sim, measured through a timing decorator.
  auto op_ns = [&](platform_op op) -> std::uint64_t {
    if (timed != nullptr) return timed->measured_ns(op);
    if (sim != nullptr) return sim->modelled_ns(op);
    return 0;
  };

  // The trace's first stream is the default stream; others get streams of their own,
  // released from the resource and destroyed on every way out.
  struct stream_set {
    platform& p;
    memory_resource& resource;
    std::vector<stream_handle> handles;
    ~stream_set() {
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
  } owned{p, resource, std::vector<stream_handle>(t.streams.size())};
  std::vector<stream_handle>& streams = owned.handles;
  for (std::size_t i = 1; i < streams.size(); ++i) {
    auto s = p.stream_create(resource.device());
    if (!s) throw_cuda_error(s.error(), "replay_trace: stream");
    streams[i] = s.value();
  }
  std::array<std::uint64_t, platform_op_count> calls_before{};
  for (std::size_t i = 0; i < platform_op_count; ++i)
    calls_before[i] = p.calls_made(static_cast<platform_op>(i));
  std::array<std::uint64_t, platform_op_count> ns_before{};
  for (std::size_t i = 0; i < platform_op_count; ++i) ns_before[i] = op_ns(static_cast<platform_op>(i));

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
  } lag{options.gpu_lag > 0 ? sim : nullptr};
  auto* planner = dynamic_cast<step_planner*>(&resource);
  // The pool runs on the trace's clock while it is replayed, and on its own again after.
  trace_clock clock(p, t, planner != nullptr ? &planner->pool() : dynamic_cast<pool_base*>(&resource));
  std::vector<void*> ptrs(t.allocs, nullptr);
  const std::size_t sample_every = std::max<std::size_t>(1, t.events.size() / 2000);
  std::size_t live = 0;
  std::array<std::uint64_t, platform_op_count> calls_at_pass{};
  for (int pass = 0; pass < options.passes && !r.oom; ++pass) {
    for (std::size_t i = 0; i < platform_op_count; ++i)
      calls_at_pass[i] = p.calls_made(static_cast<platform_op>(i));
    const auto start = std::chrono::steady_clock::now();
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
      if (lag.sim != nullptr && (index + 1) % options.gpu_lag == 0) lag.sim->complete_events();
      if (pass == 0 && index % sample_every == 0) {
        r.live_samples.emplace_back(index, live);
        r.reserved_samples.emplace_back(index, resource.stats().reserved_bytes);
      }
      ++index;
    }
    const double ns = std::chrono::duration<double, std::nano>(
                          std::chrono::steady_clock::now() - start).count();
    const double per_event = index == 0 ? 0 : ns / static_cast<double>(index);
    if (pass == 0) r.ns_per_event_cold = per_event;
    r.ns_per_event_warm = per_event;
    // Allocations still live at the end of a pass are freed before the next one.
    for (const trace_event& e : t.events) {
      if (e.op == trace_event::kind::alloc && ptrs[e.id] != nullptr) {
        resource.deallocate(ptrs[e.id], e.size, streams[e.stream]);
        ptrs[e.id] = nullptr;
        live -= e.size;
      }
    }
  }
  if (planner != nullptr) {
    const step_planner_counts c = planner->counts();
    r.plans_built = c.plans_built;
    r.planned_allocations = c.planned_allocations;
    r.steps_left_plan = c.steps_left_plan;
    r.steps_rejoined = c.steps_rejoined;
    r.regions_handed_over = c.regions_handed_over;
  }
  const resource_stats s = resource.stats();
  r.peak_reserved_bytes = s.peak_reserved_bytes;
  r.fragmentation = r.peak_live_bytes == 0
                        ? 0
                        : static_cast<double>(r.peak_reserved_bytes) /
                              static_cast<double>(r.peak_live_bytes);
  for (std::size_t i = 0; i < platform_op_count; ++i) {
    const auto op = static_cast<platform_op>(i);
    const std::uint64_t n = p.calls_made(op) - calls_before[i];
    if (n == 0) continue;
    const auto name = std::string(platform_op_name(op));
    if (options.passes > 1) r.last_pass_driver_calls[name] = p.calls_made(op) - calls_at_pass[i];
    r.driver_calls[name] = n;
    const double ns = static_cast<double>(op_ns(op) - ns_before[i]);
    r.driver_call_ns[name] = ns;
    r.driver_ns += ns;
  }
  return r;
}

}  // namespace gpumem
