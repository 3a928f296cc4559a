#include "gpumem/telemetry/snapshot.hpp"

#include <fstream>
#include <ostream>
#include <unordered_map>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/core/pool_base.hpp"
#include "gpumem/pool/plan/step_planner.hpp"
#include "gpumem/telemetry/event_recorder.hpp"
#include "gpumem/telemetry/memory_stats.hpp"
#include "telemetry/pickle_writer.hpp"

namespace gpumem {

namespace {

using detail::pickle_writer;

const char* action_name(pool_event_kind k) {
  switch (k) {
    case pool_event_kind::alloc: return "alloc";
    case pool_event_kind::free: return "free_requested";
    case pool_event_kind::segment_alloc: return "segment_alloc";
    case pool_event_kind::segment_free: return "segment_free";
    case pool_event_kind::segment_map: return "segment_map";
    case pool_event_kind::segment_unmap: return "segment_unmap";
    case pool_event_kind::oom: return "oom";
  }
  return "snapshot";
}

// What the recorder knew, copied while the pool was held still.
struct trace_copy {
  std::vector<recorded_event> events;
  std::vector<std::vector<stack_frame>> frames;  // per event (empty without context)
};

// The context of an event as PyTorch frames: the tag first (as a frame of its own), then
// the call stack innermost first.
void write_frames(pickle_writer& w, const recorded_event* e, const std::vector<stack_frame>* stack) {
  w.begin_list();
  if (e != nullptr && e->tag != nullptr) {
    w.begin_dict();
    w.item("filename", "<context tag>");
    w.item("line", 0);
    w.item("name", e->tag);
    w.end_dict();
  }
  if (stack != nullptr)
    for (const stack_frame& f : *stack) {
      w.begin_dict();
      w.item("filename", f.filename);
      w.item("line", f.line);
      w.item("name", f.name);
      w.end_dict();
    }
  w.end_list();
}

void write_trace_entry(pickle_writer& w, const event_recorder& rec, const recorded_event& e,
                       const std::vector<stack_frame>& stack, const char* action) {
  w.begin_dict();
  w.item("action", action);
  // PyTorch puts the device's free bytes where the address would be for an OOM.
  w.item(e.kind == pool_event_kind::oom ? "device_free" : "addr", e.address);
  w.item("size", e.size);
  w.item("stream", e.stream);
  w.item("time_us", rec.to_unix_us(e.time_ns));
  w.str("frames");
  write_frames(w, &e, &stack);
  w.end_dict();
}

// Symbolizes each copied event's return addresses (slow: dladdr per frame, so outside the
// pool's lock). Events overwritten since the copy lose their stacks, not their place.
void symbolize_trace(trace_copy& copy, const event_recorder& trace) {
  // Stacks repeat (a training step allocates from the same places): symbolize each
  // distinct return address once.
  std::unordered_map<void*, stack_frame> symbols;
  copy.frames.reserve(copy.events.size());
  for (const recorded_event& e : copy.events) {
    std::vector<stack_frame> stack;
    if (e.frame_count != 0)
      for (void* pc : trace.return_addresses(e.sequence)) {
        auto it = symbols.find(pc);
        if (it == symbols.end()) it = symbols.emplace(pc, symbolize_frames(&pc, 1).front()).first;
        stack.push_back(it->second);
      }
    copy.frames.push_back(std::move(stack));
  }
}

// Each live block's allocation event (its index in copy.events), for the block's frames.
using alloc_events = std::unordered_map<std::uintptr_t, std::size_t>;
alloc_events live_allocation_events(const trace_copy& copy) {
  alloc_events alloc_event;
  for (std::size_t i = 0; i < copy.events.size(); ++i) {
    const recorded_event& e = copy.events[i];
    if (e.kind == pool_event_kind::alloc) alloc_event[e.address] = i;
    if (e.kind == pool_event_kind::free) alloc_event.erase(e.address);
  }
  return alloc_event;
}

void write_blocks(pickle_writer& w, const memory_segment& seg, const trace_copy& copy,
                  const alloc_events& alloc_event) {
  w.begin_list();
  for (const memory_block& b : seg.blocks) {
    const bool live = b.st == memory_block::state::allocated;
    w.begin_dict();
    w.item("address", b.address);
    w.item("size", b.size);
    w.item("requested_size", live ? b.requested : 0);
    w.item("state", live ? "active_allocated" : "inactive");
    w.str("frames");
    auto it = live ? alloc_event.find(b.address) : alloc_event.end();
    if (it != alloc_event.end())
      write_frames(w, &copy.events[it->second], &copy.frames[it->second]);
    else
      write_frames(w, nullptr, nullptr);
    w.end_dict();
  }
  w.end_list();
}

// The segments of one pool, `tag` its segment_pool_id's first half, as list items.
void write_segment_items(pickle_writer& w, const pool_base& pool,
                         const std::vector<memory_segment>& segments, const trace_copy& copy,
                         const alloc_events& alloc_event, std::uint32_t tag) {
  for (const memory_segment& seg : segments) {
    std::size_t allocated = 0, requested = 0;
    for (const memory_block& b : seg.blocks)
      if (b.st == memory_block::state::allocated) {
        allocated += b.size;
        requested += b.requested;
      }
    w.begin_dict();
    w.item("device", pool.device());
    w.item("address", seg.address);
    w.item("total_size", seg.size);
    w.item("allocated_size", allocated);
    w.item("active_size", allocated);
    w.item("requested_size", requested);
    w.item("stream", 0);
    w.item("segment_type", seg.small ? "small" : "large");
    w.str("segment_pool_id");
    w.tuple2(tag, 0);
    w.item("is_expandable", seg.expandable);
    w.str("frames");
    write_frames(w, nullptr, nullptr);
    w.str("blocks");
    write_blocks(w, seg, copy, alloc_event);
    w.end_dict();
  }
}

void write_segments(pickle_writer& w, const pool_base& pool,
                    const std::vector<memory_segment>& segments, const trace_copy& copy,
                    std::span<const snapshot_part> parts,
                    const std::vector<std::vector<memory_segment>>& part_segments) {
  const alloc_events alloc_event = live_allocation_events(copy);
  const trace_copy none;
  const alloc_events no_events;
  w.begin_list();
  write_segment_items(w, pool, segments, copy, alloc_event, 0);
  for (std::size_t i = 0; i < parts.size(); ++i)
    write_segment_items(w, *parts[i].pool, part_segments[i], none, no_events, parts[i].tag);
  w.end_list();
}

// One trace per device up to the pool's (PyTorch indexes device_traces by device).
void write_device_traces(pickle_writer& w, const pool_base& pool, const event_recorder* trace,
                         const trace_copy& copy) {
  w.begin_list();
  for (int d = 0; d < pool.device(); ++d) {
    w.begin_list();
    w.end_list();
  }
  w.begin_list();
  if (trace != nullptr) {
    for (std::size_t i = 0; i < copy.events.size(); ++i) {
      const recorded_event& e = copy.events[i];
      write_trace_entry(w, *trace, e, copy.frames[i], action_name(e.kind));
      // gpumem's free is complete at once in its stream's order.
      if (e.kind == pool_event_kind::free)
        write_trace_entry(w, *trace, e, copy.frames[i], "free_completed");
    }
    recorded_event snap;
    snap.time_ns = copy.events.empty() ? 0 : copy.events.back().time_ns;
    write_trace_entry(w, *trace, snap, {}, "snapshot");
  }
  w.end_list();
  w.end_list();
}

void write_allocator_settings(pickle_writer& w, const pool_base& pool, bool expandable) {
  w.begin_dict();
  w.item("PYTORCH_CUDA_ALLOC_CONF", pool.options().to_string());
  w.item("max_split_size", -1);
  w.item("garbage_collection_threshold", 0.0);
  w.item("expandable_segments", expandable);
  w.item("pinned_num_register_threads", 1);
  w.item("release_lock_on_cudamalloc", false);
  w.item("pinned_use_cuda_host_register", false);
  w.str("roundup_power2_divisions");
  w.begin_dict();
  w.end_dict();
  w.end_dict();
}

// gpumem's own figures (PyTorch's tools ignore keys they do not know).
void write_gpumem_figures(pickle_writer& w, const pool_base& pool, const event_recorder* trace,
                          const memory_stats& stats) {
  w.begin_dict();
  w.item("allocator", stats.allocator);
  w.item("platform", pool.device_platform().kind());
  w.item("options", pool.options().to_string());
  if (trace != nullptr) {
    w.item("trace_events_recorded", trace->recorded());
    w.item("trace_events_dropped", trace->dropped());
  }
  w.str("stats");
  w.begin_dict();
  for (const auto& [key, value] : stats.torch_keys()) {
    w.str(key);
    const auto as_int = static_cast<std::int64_t>(value);
    if (static_cast<double>(as_int) == value)
      w.integer(as_int);
    else
      w.real(value);
  }
  w.end_dict();
  w.end_dict();
}

}  // namespace

std::string memory_snapshot_pickle(const pool_base& pool, const event_recorder* trace,
                                   const step_planner* plan, std::span<const snapshot_part> parts) {
  std::vector<std::vector<memory_segment>> part_segments(parts.size());
  for (std::size_t i = 0; i < parts.size(); ++i)
    parts[i].pool->inspect([&](const std::vector<memory_segment>& s) { part_segments[i] = s; });
  std::vector<memory_segment> segments;
  trace_copy copy;
  // One consistent moment: no pool operation (and so no recorder event) runs in between.
  pool.inspect([&](const std::vector<memory_segment>& s) {
    segments = s;
    if (trace != nullptr) copy.events = trace->events();
  });
  if (plan != nullptr) plan->show_plan_in(segments);
  if (trace != nullptr) symbolize_trace(copy, *trace);
  const memory_stats stats = collect_memory_stats(pool);
  const bool expandable = !segments.empty() ? segments.front().expandable : stats.has_pages;

  std::string out;
  pickle_writer w(out);
  w.begin_dict();
  w.str("segments");
  write_segments(w, pool, segments, copy, parts, part_segments);
  w.str("device_traces");
  write_device_traces(w, pool, trace, copy);
  w.str("allocator_settings");
  write_allocator_settings(w, pool, expandable);
  w.str("gpumem");
  write_gpumem_figures(w, pool, trace, stats);
  w.end_dict();
  w.finish();
  return out;
}

void write_memory_snapshot(const pool_base& pool, const event_recorder* trace, std::ostream& out,
                           const step_planner* plan) {
  const std::string bytes = memory_snapshot_pickle(pool, trace, plan);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void write_memory_snapshot(const pool_base& pool, const event_recorder* trace,
                           const std::string& path, const step_planner* plan,
                           std::span<const snapshot_part> parts) {
  const std::string bytes = memory_snapshot_pickle(pool, trace, plan, parts);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw invalid_argument("write_memory_snapshot: cannot open '" + path + "' for writing");
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) throw invalid_argument("write_memory_snapshot: writing '" + path + "' failed");
}

}  // namespace gpumem
