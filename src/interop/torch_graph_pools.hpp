// CUDA graph pools of the PyTorch plug-in: PyTorch's graph-pool rules for a pluggable
// allocator (CUDAPluggableAllocator::set_begin_allocate_to_pool, set_end_allocate_to_pool_fn,
// set_release_pool).
//
// While a capture (torch.cuda.graph) or a torch.cuda.use_mem_pool block routes allocations
// to a pool id, an allocation whose stream the capture's filter accepts is served by a
// private gpumem pool of that id, never by the device's shared pool:
//  - memory a graph allocated is private to the id while the id is in use (a graph that can
//    replay, a MemPool context) or any of its allocations lives: nothing else is served
//    from it, it is never trimmed (torch.cuda.empty_cache reaches the shared pools only),
//    and blocks freed during the capture stay cached for the replays;
//  - several graphs capturing into one id (`pool=`) share one private pool;
//  - the private pool is destroyed, its memory given back to the driver, once the id is
//    released as often as it was begun and its last allocation is freed.
// A private pool belongs to the tag current on the thread that made it (gpumem_current_tag,
// `with gpumem.torch.tag(...)`): it sleeps and wakes with that tag (sleep_tag_pools,
// wake_tag_pools), keeping its addresses as the tag's own pages do, so a graph captured
// inside a tag gives its memory back with the tag's sleep and replays after its wake.
// A private pool takes the shared pool's configuration with cross-stream reuse by waiting
// (a stream wait on an event is legal inside a capture, an event query is not), no memory
// taken up front and none given back while it lives.
//
// Frees of shared-pool memory on a capturing stream wait until no capture runs
// (defer_free).
//
// Invariants: every live pointer of a private pool is in owner_ exactly once; a private pool
// with uses == 0 and live == 0 does not exist.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "gpumem/interop/gpumem.h"

struct CUstream_st;

namespace gpumem_torch {

// PyTorch's c10::cuda::MempoolId_t and the stream filter a capture passes.
using mempool_id = std::pair<unsigned long long, unsigned long long>;
using capture_filter = std::function<bool(CUstream_st*)>;

struct graph_pool;

// The private pool an allocation on `stream` for `device` goes to now, or nullptr (no capture
// routes it). Cheap while no capture is active: one atomic load.
graph_pool* graph_pool_for(int device, void* stream) noexcept;
// Allocates in `pool`; nullptr with gpumem_last_error() set on failure.
void* graph_pool_allocate(graph_pool* pool, std::size_t size, void* stream) noexcept;
// Allocates `size` at exactly `ptr` in the private pool of (device, id), out of its free
// memory there (a graph tree's checkpoint restored: gpumem_allocate_at). GPUMEM_SUCCESS,
// or the failure's status (the pool's message in gpumem_last_error) with nothing changed;
// *found false (and GPUMEM_ERROR_INVALID_ARGUMENT) when no such pool lives.
gpumem_status graph_pool_allocate_at(int device, mempool_id id, void* ptr, std::size_t size,
                                     void* stream, bool* found) noexcept;
// Frees ptr if a private pool owns it: true when one did (the status of the free in *st).
bool graph_pool_free(void* ptr, std::size_t size, void* stream, gpumem_status* st) noexcept;

void begin_allocate_to_pool(int device, mempool_id id, capture_filter filter,
                            const char* config);

// A free of shared-pool memory on a stream being captured: the pool would record its stream
// order there (an event the capture takes into the graph, never completing outside it), so
// the free waits until no capture runs, as PyTorch's allocator defers such frees.
struct deferred_free {
  void* ptr;
  std::size_t size;
  int device;
  void* stream;
};
void defer_free(const deferred_free& f);
// Ends the latest capture into `id`; returns the deferred frees to make now (all of them
// once no capture runs, else none).
std::vector<deferred_free> end_allocate_to_pool(int device, mempool_id id);
void release_pool(int device, mempool_id id);

// Sleeps (mode as gpumem_sleep) every private pool of (device, tag) that is awake, in the
// order they were made; *slept counts them. GPUMEM_SUCCESS, or the first failure's status
// (its text in gpumem_last_error): the pools before it sleep, the rest stay awake, and the
// same call again goes on from there.
gpumem_status sleep_tag_pools(int device, std::uint32_t tag, int mode, void* stream,
                              std::size_t* slept) noexcept;
// Wakes every private pool of (device, tag) that sleeps; *woken counts them. The first
// failure (out of memory: no room) stops it, as sleep_tag_pools.
gpumem_status wake_tag_pools(int device, std::uint32_t tag, void* stream,
                             std::size_t* woken) noexcept;
// Gives back the pinned host memory of every private pool of (device, tag) (gpumem_release_host
// of its tag 0); *released sums the bytes. The first refusal (a pool asleep with offload)
// stops it, the pools before it released.
gpumem_status release_tag_pools_host(int device, std::uint32_t tag,
                                     std::uint64_t* released) noexcept;
// The pinned host bytes the private pools of (device, tag) hold for their offload sleeps.
std::uint64_t tag_pools_host_bytes(int device, std::uint32_t tag) noexcept;
// The private pools of (device, tag) alive now.
std::size_t tag_pool_count(int device, std::uint32_t tag) noexcept;
// Of the private pools of (device, tag), the ones asleep (wholly or part way).
std::size_t tag_pools_asleep(int device, std::uint32_t tag) noexcept;
// gpumem_pool_set_keep_free for every private pool of the device, now and made later; the
// first failure's status.
gpumem_status set_keep_free(int device, std::size_t bytes) noexcept;

// Private pools alive now, and the bytes they hold from the driver (for stats and tests).
struct graph_pool_totals {
  std::size_t pools = 0;
  std::size_t reserved_bytes = 0;
  std::size_t live_allocations = 0;
};
// Of one device's pools, or of all with device -1.
graph_pool_totals graph_pools_totals(int device = -1) noexcept;

}  // namespace gpumem_torch
