// PyTorch memory snapshots (the pickle torch.cuda.memory._dump_snapshot() writes, and
// gpumem's own exporter) read as allocation traces, so `gpumem replay SNAPSHOT.pickle`
// replays what PyTorch recorded with torch.cuda.memory._record_memory_history().
//
// The pickle is read by a small unpickler of plain data only (dicts, lists, tuples,
// strings, bytes, numbers, booleans, None: protocols 2 to 5); anything else (a class, a
// global, a reduce) is refused, so no code is ever run. The trace is the alloc and
// free_completed events of one device's device_traces, as the CSV form
// "action,addr,size,stream,time_us" of trace.hpp that parse_trace reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpumem {

// How deep values may nest in a snapshot pickle (a snapshot's deepest, a frame of a block
// of a segment, is 7 deep).
inline constexpr std::uint32_t snapshot_max_depth = 100;

// Does `bytes` start as a pickle (the PROTO opcode, protocol 2 or later)?
bool looks_like_pickle(const std::string& bytes) noexcept;

// The trace of `device` (-1: the device with the most trace entries) as trace CSV text.
// The pickle's values are held within `max_memory` bytes while it is read (each length,
// count and memo index is checked before anything is allocated for it), and the text made
// within `max_csv_bytes`. Throws gpumem::invalid_argument naming `source` and what is
// wrong: not a snapshot, an unsupported pickle opcode, truncated data, values nested deeper
// than snapshot_max_depth, a limit passed, no device_traces (recording was off), a device
// out of range.
std::string torch_snapshot_to_trace_csv(const std::string& bytes, const std::string& source,
                                        int device = -1,
                                        std::uint64_t max_memory = std::uint64_t{4} << 30,
                                        std::uint64_t max_csv_bytes = std::uint64_t{2} << 30);

}  // namespace gpumem
