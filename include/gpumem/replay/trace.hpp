// Allocation traces and their deterministic replay against any memory_resource.
//
// Formats read (gzip'd or plain, detected by content):
//  - PyTorch-derived CSV  "action,addr,size,stream,time_us" (shared/traces/README.md):
//    `alloc` and `free_completed` drive the replay; `segment_*` and `free_requested` are
//    what PyTorch itself did and are skipped;
//  - a PyTorch memory snapshot pickle (torch.cuda.memory._dump_snapshot): the alloc and
//    free_completed events of its busiest device trace (replay/torch_snapshot.hpp);
//  - RMM logging_resource_adaptor CSV "Thread,Time,Action,Pointer,Size,Stream":
//    `allocate` and `free`.
// Event times (PyTorch's time_us; RMM's Time as h:m:s with a fraction) are kept relative
// to the first event; a trace where any event lacks one has none (trace::timed false).
// Frees are matched to allocations by address. What a well-formed trace never holds is
// counted, not refused (trace::unmatched_frees and the three after it):
//  - a free of an address never allocated in the trace (allocated before recording
//    began) is dropped;
//  - a second free of an address already freed (a double free) is dropped;
//  - an allocation at an address still live (its free is missing) is replayed; the
//    earlier allocation stays live to the end of the trace;
//  - a free whose size differs from its allocation's frees the allocation (its size).
// A file is read as it streams (replay/input_file.hpp), its text cut into lines by the rule
// every text reader shares (replay/text_lines.hpp: a leading UTF-8 byte-order mark skipped,
// CRLF read as LF, a NUL or other control byte refused as binary data): its first
// non-empty line must be a known header within the first trace_header_window bytes, and no
// line may be longer than trace_max_line, so a file that is not a trace (/dev/zero, a
// binary) is refused after a bounded read. At most trace_read_limits::max_bytes are read,
// compressed and decompressed (a FIFO or a gzip bomb is refused at the limit, naming the
// file and the limit). A gzip'd file is read through zlib; a gzip stream that ends early or
// is corrupt is refused naming the file and the line where the data stopped. Built without
// zlib, a gzip'd file is refused with that reason. Numbers are checked: a field that is no
// number, or a time beyond the range, is refused naming the field, the value and the range.
//
// Invariant of a loaded trace: every free names an earlier, still-live alloc id.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/platform/platform.hpp"
#include "gpumem/pool/core/pool_base.hpp"
#include "gpumem/pool/core/pool_clock.hpp"

namespace gpumem {

struct trace_event {
  enum class kind : std::uint8_t { alloc, free };
  kind op = kind::alloc;
  std::uint32_t id = 0;       // allocation number, 0..allocs-1
  std::uint64_t size = 0;     // bytes requested
  std::uint32_t stream = 0;   // index into trace::streams
  std::uint64_t time_ns = 0;  // since the trace's first event (0 in an untimed trace)
};

struct trace {
  std::string source;
  std::string format;                 // "pytorch" or "rmm"
  std::vector<trace_event> events;
  std::vector<std::uint64_t> streams; // original stream handles; index 0 = first seen
  std::size_t allocs = 0;
  std::size_t frees = 0;
  std::size_t unmatched_frees = 0;        // frees of addresses never allocated: dropped
  std::size_t double_frees = 0;           // frees of addresses already freed: dropped
  std::size_t reused_addresses = 0;       // allocations at an address still live
  std::size_t mismatched_free_sizes = 0;  // frees naming a size other than the allocation's
  std::size_t live_at_end = 0;            // allocations never freed in the trace
  std::size_t peak_live_bytes = 0;    // of requested bytes, over the trace
  std::uint64_t max_size = 0;
  bool timed = false;                 // every event has a time
  std::uint64_t duration_ns = 0;      // the last event's time
};

// The clock a replay gives the pool it drives (pool_options::remap_budget): the trace's own
// time at the event being replayed (each pass following the last), plus the driver time
// spent so far (modelled on sim, measured on a GPU through a timed_platform). So a pool
// judges its remaps against the time the workload took when it was recorded, on sim and
// on a GPU alike. An untimed trace is taken as one event every 40 us (the recorded
// workloads in data/workloads average 40-250 us an event). Given a pool, the clock is the
// pool's while it lives (set_clock), and the pool's own again after.
// REQUIRES: `t` and `pool` outlive it.
class trace_clock final : public pool_clock {
 public:
  static constexpr std::uint64_t untimed_event_ns = 40'000;
  trace_clock(platform& p, const trace& t, pool_base* pool = nullptr);
  ~trace_clock() override;
  trace_clock(const trace_clock&) = delete;
  trace_clock& operator=(const trace_clock&) = delete;
  // The trace time now: the replay is at event `index` of pass `pass`.
  void at(int pass, std::size_t index) noexcept;
  std::uint64_t now_ns() const noexcept override;

 private:
  platform& platform_;
  const trace& trace_;
  pool_base* pool_;
  std::uint64_t pass_ns_ = 0;  // a pass and the gap before the next
  std::uint64_t event_ns_ = 0;
};

// How far into a file its header must begin, and the longest line of a trace (a line of
// either format is well under 200 bytes).
inline constexpr std::size_t trace_header_window = 64 * 1024;
inline constexpr std::size_t trace_max_line = 64 * 1024;

// What reading one trace file may take. A loaded trace holds at most about 4 x max_bytes
// (an event is 32 bytes, from a line of at least 10 bytes); a snapshot pickle's values
// are held within max_snapshot_memory while it is read, and the trace text made of it
// within max_bytes.
struct trace_read_limits {
  std::uint64_t max_bytes = std::uint64_t{2} << 30;            // read from the file, either form
  std::uint64_t max_snapshot_memory = std::uint64_t{4} << 30;  // a pickle's values, read
};

// Reads a trace file as it streams; throws gpumem::invalid_argument naming the file (and
// the line, where there is one) when it cannot be read, is not a trace (no header in the
// window, binary data, a line over trace_max_line), is over a limit, is malformed (unknown
// header, bad number, unknown action) or is a gzip stream cut short or corrupt.
trace load_trace(const std::string& path, const trace_read_limits& limits = {});
// Parses trace text (already decompressed), by the same rules.
trace parse_trace(const std::string& text, const std::string& source);

struct replay_options {
  int passes = 1;           // replay the trace this many times on one allocator
  bool touch = false;       // write the first bytes of each block (sim: proves mapping)
  // sim only: work recorded on a stream completes only every `gpu_lag` trace events, as
  // when a GPU runs behind the CPU that queues its work (frees are then not known complete
  // at once: a pool reuses them in stream order or waits). 0: at once, the sim default.
  std::size_t gpu_lag = 0;
  // Event indices (ascending) before which a step begins, as find_steps() gives: when the
  // resource is a step_planner, mark_step() is called there, in every pass.
  std::vector<std::size_t> step_starts;
};

struct replay_result {
  std::string allocator;
  std::size_t peak_live_bytes = 0;
  std::size_t peak_reserved_bytes = 0;
  double fragmentation = 0;            // peak reserved / peak live
  std::uint64_t allocs = 0;
  std::uint64_t frees = 0;
  double ns_per_event_cold = 0;        // first pass
  double ns_per_event_warm = 0;        // last pass (== cold with one pass)
  std::map<std::string, std::uint64_t> driver_calls;  // CUDA call name -> count
  std::map<std::string, double> driver_call_ns;       // CUDA call name -> time in it
  // Calls made during the last pass alone (with several passes: the steady state of a
  // workload that repeats; a pool that has settled makes none there).
  std::map<std::string, std::uint64_t> last_pass_driver_calls;
  // Of those, the calls that take, give back or move device memory (moves_memory), and the
  // allocations the last pass made: a pool that repeats a pass without moving memory makes
  // last_pass_memory_calls == 0. Both 0 with one pass.
  std::uint64_t last_pass_memory_calls = 0;
  std::uint64_t last_pass_allocs = 0;
  double driver_ns = 0;                // driver time: modelled on sim, measured through a
                                       // timed_platform (on the GPU), else 0
  // driver_ns of the first and of the last pass, per event of that pass. On sim (calls
  // modelled, not waited for) ns_per_event + this is the pass's modelled time per event;
  // on the GPU ns_per_event includes it already.
  double driver_ns_per_event_cold = 0;
  double driver_ns_per_event_warm = 0;
  bool oom = false;
  std::uint64_t oom_event = 0;         // event index where it happened
  std::string oom_message;
  // With a step_planner: steps marked (all passes), plans built, allocations it served;
  // steps that left the plan, rejoined it, handed the region over (step_planner_counts).
  std::uint64_t steps_marked = 0;
  std::uint64_t plans_built = 0;
  std::uint64_t planned_allocations = 0;
  std::uint64_t steps_left_plan = 0;
  std::uint64_t steps_rejoined = 0;
  std::uint64_t regions_handed_over = 0;
  // With a large_planner (plans_built, planned_allocations and regions_handed_over above
  // are its too): large requests seen, those that differed from the plan, planned places
  // found taken, regions taken (large_planner_counts).
  std::uint64_t large_requests = 0;
  std::uint64_t large_plan_misses = 0;
  std::uint64_t large_plan_conflicts = 0;
  std::uint64_t large_plan_region_takes = 0;
  // Live and reserved bytes sampled over the (first) pass, for plots.
  std::vector<std::pair<std::uint64_t, std::size_t>> live_samples;
  std::vector<std::pair<std::uint64_t, std::size_t>> reserved_samples;
};

// Whether `op` takes device memory from the driver, gives it back or moves it: cuMemCreate,
// cuMemRelease, cuMemMap, cuMemUnmap, cuMemSetAccess, and the raw allocation calls
// (cudaMalloc, cudaFree, cuMemAlloc, cuMemFree). Stream-ordered pool calls
// (cudaMallocAsync) and bookkeeping (events, streams) do not.
bool moves_memory(platform_op op) noexcept;

// Where the steps of a loop begin in `t`, as event indices, for a trace that ends by
// repeating the same requests: the shortest period P (in allocations: sizes and streams)
// with which the trace's last two periods agree, extended back as far as the repeat
// holds, if it holds at least `min_repeats` times. Each step begins at the first request
// after the point of the period where the trace has the fewest live bytes (so little
// lives across a boundary), as a loop calling mark_step() at its top would. Empty when the
// trace does not end in such a repeat (steps of varying shapes, say).
std::vector<std::size_t> find_steps(const trace& t, std::size_t min_repeats = 3);

// Replays `t` on `resource`. Streams other than the trace's first map to streams created
// on the resource's platform. Stops at the first out_of_memory (reported, not thrown); a
// request larger than the device's whole memory is such an out-of-memory too (no
// allocator could serve it), reported naming the trace, the allocator and the event.
replay_result replay_trace(const trace& t, memory_resource& resource, const replay_options& options);

// The out-of-memory message for event `event` of `t`, a request of `bytes` more than the
// device's whole memory (`device_total`) when replayed on `allocator`.
std::string oversized_request(const trace& t, const std::string& allocator, std::uint64_t event,
                              std::uint64_t bytes, std::size_t device_total);

}  // namespace gpumem
