// Snapshot export in PyTorch's memory snapshot format: a protocol-2 pickle of the dict
// torch.cuda.memory._snapshot() returns, so a gpumem pool opens in PyTorch's memory viewer
// (pytorch.org/memory_viz) and in torch.cuda._memory_viz (stats, trace, segments, memory,
// compare, trace_plot, segment_plot).
//
//   {'segments': [{device, address, total_size, allocated_size, active_size,
//                  requested_size, stream, segment_type, segment_pool_id, is_expandable,
//                  frames, blocks: [{address, size, requested_size, state, frames}]}],
//    'device_traces': [[{action, addr | device_free (oom), size, stream, time_us, frames}]],
//    'allocator_settings': {...}, 'gpumem': {allocator, options, stats}}
//
// Invariants of what is written (tests/unit/telemetry_snapshot_test.cpp,
// tests/scripts/telemetry_snapshot_test.sh check them):
//  - a segment is an upstream segment (caching_pool) or a run of mapped pages
//    (vmm_page_pool, is_expandable True); every block of it is listed, allocated or not,
//    and block sizes sum to total_size; blocks lie back to back from `address`;
//  - sum of total_size == the pool's mapped or segment bytes; reserved pages kept unmapped
//    for reuse are in no segment (the 'gpumem' entry reports them);
//  - the device trace (when a recorder is given) holds the recorder's kept events in
//    order, a free as 'free_requested' then 'free_completed', closed by one 'snapshot'
//    entry; read under the pool's mutex with the segments, so replaying it backwards from
//    the segments (as the viewer does) is consistent;
//  - segments and segment events say stream 0 (gpumem segments are not tied to a stream),
//    alloc and free events carry their real stream;
//  - the pools of other tags (snapshot_part) follow with their own segments, each with
//    segment_pool_id (tag, 0), so the viewer tells them apart; the main pool's are (0, 0).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <span>
#include <string>

namespace gpumem {

class pool_base;
class event_recorder;
class step_planner;

// Another pool whose segments the snapshot shows beside the main pool's: a tag's.
struct snapshot_part {
  const pool_base* pool = nullptr;
  std::uint32_t tag = 0;
};

// The snapshot as pickle bytes. `trace` may be nullptr (no device trace; the viewer's
// segment views still work). REQUIRES: `trace`, if given, records `pool` (or nothing).
// With `plan` (a step planner in front of `pool`), its region shows as the planned
// allocations live in it, each a block of its own.
std::string memory_snapshot_pickle(const pool_base& pool, const event_recorder* trace,
                                   const step_planner* plan = nullptr,
                                   std::span<const snapshot_part> parts = {});
void write_memory_snapshot(const pool_base& pool, const event_recorder* trace, std::ostream& out,
                           const step_planner* plan = nullptr);
// Writes the file; throws gpumem::invalid_argument naming the path when it cannot.
void write_memory_snapshot(const pool_base& pool, const event_recorder* trace,
                           const std::string& path, const step_planner* plan = nullptr,
                           std::span<const snapshot_part> parts = {});

}  // namespace gpumem
