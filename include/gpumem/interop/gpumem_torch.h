/* libgpumem_torch.so's PyTorch entry points (src/interop/torch_plugin.cpp), beside the C
 * API of gpumem.h that the library exports too.
 *
 *   gpumem_torch_malloc / gpumem_torch_free   CUDAPluggableAllocator's alloc and free
 *   gpumem_torch_record_stream                CUDAPluggableAllocator::set_record_stream_fn
 *   gpumem_torch_reset                        CUDAPluggableAllocator::set_reset_fn
 *   gpumem_torch_memory_counts                what torch.cuda.memory_stats() reports
 *   gpumem_torch_reset_peak                   torch.cuda.reset_peak_memory_stats()
 *
 * One pool per device, created on first use on the GPU (platform:cuda); the simulated
 * device only where asked for by name (GPUMEM_DEVICE=sim, or GPUMEM_CONF's platform:sim).
 * gpumem_torch_malloc throws (a C++ exception, as PyTorch expects of an allocator) on
 * failure; every other function returns a status or nothing.
 */
#ifndef GPUMEM_INTEROP_GPUMEM_TORCH_H
#define GPUMEM_INTEROP_GPUMEM_TORCH_H

#include <stdint.h>
#include <sys/types.h>

#include "gpumem/interop/gpumem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What the plug-in handed one device's PyTorch, in torch.cuda.memory_stats()'s terms.
 * Peaks count from the pool's creation or the last gpumem_torch_reset_peak. */
typedef struct gpumem_torch_counts {
  uint64_t requested_bytes;           /* bytes PyTorch asked for, live now */
  uint64_t requested_bytes_peak;
  uint64_t requested_bytes_allocated; /* sum over every allocation */
  uint64_t requested_bytes_freed;
  uint64_t allocations;               /* live allocations */
  uint64_t allocations_peak;
  uint64_t allocations_made;
  uint64_t allocations_freed;
  uint64_t reserved_bytes;            /* the pool's reserved bytes now */
  /* Before any reset: the pool's all-time peak (exact). After one: exact when the pool
   * set a new all-time peak since the reset, else the most seen at the reset, at each
   * new requested peak since, and now (reserved_peak_exact 0: a lower bound). */
  uint64_t reserved_bytes_peak;
  uint64_t reserved_peak_exact;
  uint64_t alloc_retries;
  uint64_t oom_count;
  uint64_t resets;                    /* gpumem_torch_reset_peak calls */
} gpumem_torch_counts;

/* One event of the history (gpumem_torch_record_history). */
enum {
  GPUMEM_TORCH_EVENT_ALLOC = 0, /* addr, size: the allocation handed out */
  GPUMEM_TORCH_EVENT_FREE = 1,  /* addr, size: freed by PyTorch */
  GPUMEM_TORCH_EVENT_OOM = 2    /* size: the request that failed; addr 0 */
};
typedef struct gpumem_torch_event {
  int32_t action;
  int32_t device;
  uint64_t addr;
  uint64_t size;
  uint64_t stream;
  int64_t time_us; /* microseconds since the Unix epoch */
} gpumem_torch_event;

GPUMEM_API void* gpumem_torch_malloc(ssize_t size, int device, void* stream);
GPUMEM_API void gpumem_torch_free(void* ptr, ssize_t size, int device, void* stream);
GPUMEM_API void gpumem_torch_record_stream(void* ptr, void* stream);
GPUMEM_API int gpumem_torch_record_stream_on(int device, void* ptr, void* stream);
GPUMEM_API gpumem_pool* gpumem_torch_pool(int device);
GPUMEM_API int gpumem_torch_pool_exists(int device);
GPUMEM_API int gpumem_torch_stats(int device, gpumem_stats* out);
GPUMEM_API int gpumem_torch_snapshot(int device, const char* path);
GPUMEM_API unsigned long long gpumem_torch_empty_cache(void);
GPUMEM_API void gpumem_torch_reset(void);
GPUMEM_API int gpumem_torch_mark_step(void);
GPUMEM_API unsigned long long gpumem_torch_failures(void);
GPUMEM_API int gpumem_torch_oom_is_torch_type(void);
/* Sleep and wake of a tag of the device's pool together with the private pools (CUDA
 * graphs, MemPools) made while it was the thread's current tag: arguments, refusals and
 * failures as gpumem_sleep / gpumem_wake. A call that fails halfway leaves the parts before
 * the failure asleep (or awake); the same call again completes it. */
GPUMEM_API int gpumem_torch_sleep(int device, uint32_t tag, int mode, void* stream);
GPUMEM_API int gpumem_torch_wake(int device, uint32_t tag, void* stream);
/* gpumem_pool_set_keep_free for the device's pool (every tag) and the private pools of its
 * CUDA graphs and MemPools, those made later too. */
GPUMEM_API int gpumem_torch_set_keep_free(int device, uint64_t bytes);
/* The pinned host memory a tag holds for its offload sleeps, its part of the device's pool
 * and its private pools together: gpumem_tag_host_bytes and gpumem_release_host over every
 * part. A release refused by one part (asleep with offload: wake it first) leaves the parts
 * before it released; *released (may be null) sums the bytes given back. */
GPUMEM_API int gpumem_torch_host_bytes(int device, uint32_t tag, uint64_t* bytes);
GPUMEM_API int gpumem_torch_release_host(int device, uint32_t tag, uint64_t* released);
/* Whether the tag sleeps as gpumem_torch_sleep puts it to sleep: its part of the device's
 * pool or one of its private pools. 1 or 0; -1 (the error set) with no pool for the device. */
GPUMEM_API int gpumem_torch_tag_asleep(int device, uint32_t tag);
/* Whether gpumem_torch_sleep finds anything of the tag: it was allocated in, or it holds a
 * private pool. 1 or 0; -1 (the error set) with no pool for the device. */
GPUMEM_API int gpumem_torch_tag_used(int device, uint32_t tag);
/* REQUIRES: out != NULL. Creates the device's pool if needed (as gpumem_torch_stats). */
GPUMEM_API int gpumem_torch_memory_counts(int device, gpumem_torch_counts* out);
/* Peaks (requested bytes, allocations, reserved bytes) restart from the current values. */
GPUMEM_API int gpumem_torch_reset_peak(int device);
/* torch.cuda.set_per_process_memory_fraction(fraction, device): the device pool's budget
 * becomes fraction of the device's memory (gpumem_pool_set_budget; 1: none), so the pool
 * gathers free pages before it would pass it. GPUMEM_ERROR_INVALID_ARGUMENT outside [0, 1]. */
GPUMEM_API int gpumem_torch_set_memory_fraction(int device, double fraction);

/* enabled != 0: starts recording anew (the ring emptied) keeping the last max_entries
 * events (1 .. 2^26; else GPUMEM_ERROR_INVALID_ARGUMENT); 0: stops, keeping what was
 * recorded. */
GPUMEM_API int gpumem_torch_record_history(int enabled, size_t max_entries);
/* Copies up to `capacity` kept events, oldest first, to out (may be NULL); returns how
 * many are kept. */
GPUMEM_API size_t gpumem_torch_history(gpumem_torch_event* out, size_t capacity);
/* 1 while recording. */
GPUMEM_API int gpumem_torch_recording(void);

/* CUDA IPC of the plug-in's memory (src/interop/torch_ipc.cpp), for the native allocator's
 * shareIpcHandle / getIpcDevPtr. gpumem_torch_ipc_share writes a handle for the live
 * allocation `ptr` of `size` bytes of device `device`'s pool (created with shareable:on, as
 * the plug-in's pools are), in PyTorch's expandable-segment format: the physical handles
 * under it as the exporter's descriptors, which the opener takes with pidfd_getfd.
 * *length_out is the handle's length (when it exceeds `capacity`, nothing is written and
 * GPUMEM_ERROR_INVALID_ARGUMENT is returned: call again with room); *offset_out is where
 * ptr lies from the start of the memory the handle maps. The descriptors stay open until
 * gpumem_torch_ipc_forget(ptr), which the freeing of the allocation calls; sharing `ptr`
 * again gives the same handle.
 * gpumem_torch_ipc_open maps a handle (gpumem's, or PyTorch's own allocator's expandable
 * segment) in device `device`'s pool: *base_out, *mapped_out bytes, freed with
 * gpumem_free(gpumem_torch_pool(device), base, mapped, stream). Refused with
 * GPUMEM_ERROR_INVALID_ARGUMENT, mapping nothing, for bytes that are not such a handle, an
 * exporter that is gone or has closed the descriptors, or one this process may not take
 * descriptors from (ptrace rules). */
GPUMEM_API int gpumem_torch_ipc_share(int device, void* ptr, size_t size, char* handle_out,
                                      size_t capacity, size_t* length_out, size_t* offset_out);
GPUMEM_API void gpumem_torch_ipc_forget(void* ptr);
GPUMEM_API int gpumem_torch_ipc_open(int device, const char* handle, size_t length,
                                     void** base_out, size_t* mapped_out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GPUMEM_INTEROP_GPUMEM_TORCH_H */
