/* gpumem C API: a gpumem pool behind plain C functions, for C programs, ctypes and the
 * PyTorch plug-in (libgpumem_torch.so exports these too).
 *
 *   gpumem_pool_create(config, &pool)      one pool from a configuration string
 *   gpumem_malloc(pool, size, stream)      stream-ordered allocation (NULL on failure)
 *   gpumem_free(pool, ptr, size, stream)   the memory is reusable after `stream`'s work
 *   gpumem_record_stream(pool, ptr, s)     `ptr` is also used on stream `s` (see below)
 *   gpumem_pool_stats(pool, &stats)        live / reserved / cached bytes, counts
 *   gpumem_last_error()                    this thread's text for the last failure
 *
 * The configuration string has the GPUMEM_CONF syntax ("key:value,key:value") with every
 * pool option (reserve, limit, release_threshold, small_threshold, cross_stream,
 * va_reserve, big_chunk, huge_growth, peer_access, ...) plus these keys of the C API:
 *   allocator:vmm_page_pool|caching_pool  which pool (default vmm_page_pool)
 *   backend:runtime|driver|vmm            caching_pool's upstream (default runtime)
 *   device:N                              device ordinal (default 0): one pool per device
 *   platform:auto|cuda|sim                auto: the GPU when present, else sim (default)
 *   step_plan:on|off                      a step planner in front of the pool (default
 *                                         on; it does nothing until gpumem_pool_mark_step
 *                                         is called: see that function)
 *   sim_capacity, sim_devices,            a private sim device for this pool: capacity
 *   sim_granularity, sim_no_peer          and granularity (per device with A+B), number
 *                                         of GPUs, pairs without a peer path (implies
 *                                         platform:sim; for tests)
 * Every key, its default and an example: docs/OPTIONS.md (the one option table).
 * NULL or "" means all defaults. Unknown keys and bad values give
 * GPUMEM_ERROR_INVALID_ARGUMENT naming them.
 *
 * Several GPUs: a pool serves one device. A stream of another device is refused
 * (GPUMEM_ERROR_INVALID_ARGUMENT) by gpumem_malloc, gpumem_free and gpumem_record_stream,
 * and so is a pointer another pool handed out. Peers read a vmm_page_pool's memory once
 * the pool grants them access: the peer_access option.
 *
 * Streams are cudaStream_t values passed as void*; NULL is the default stream. Reuse is
 * stream-ordered: a block freed on stream S is reused at once by work on S, and by another
 * stream only once the free is known complete (cross_stream:event) or after that stream
 * was made to wait for it (cross_stream:wait).
 *
 * Contract:
 *  - no C++ exception crosses this boundary; every failure returns a status code (or NULL)
 *    and sets this thread's gpumem_last_error() text; success leaves the text as it was;
 *  - a failed call changes nothing: a refused free keeps the allocation live, a failed
 *    create returns no pool;
 *  - gpumem::out_of_memory -> GPUMEM_ERROR_OUT_OF_MEMORY (the text is the OOM report),
 *    gpumem::invalid_argument -> GPUMEM_ERROR_INVALID_ARGUMENT, gpumem::cuda_error ->
 *    GPUMEM_ERROR_CUDA, anything else -> GPUMEM_ERROR_INTERNAL;
 *  - functions of one pool may be called from several threads at once; destroy must not
 *    race with other calls on the same pool (a call that overlaps the destroy is the
 *    caller's bug and may read freed memory);
 *  - a handle stays detectable after gpumem_pool_destroy: every later call on it (a second
 *    destroy included) is refused with GPUMEM_ERROR_INVALID_ARGUMENT and a text saying the
 *    pool was destroyed; it never touches the freed pool. This costs one atomic load per
 *    call and keeps 24 bytes per destroyed pool for the life of the process. A pointer
 *    gpumem_pool_create never returned is not detectable (reading it is undefined).
 */
#ifndef GPUMEM_INTEROP_GPUMEM_H
#define GPUMEM_INTEROP_GPUMEM_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define GPUMEM_API
#else
#define GPUMEM_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define GPUMEM_VERSION_MAJOR 0
#define GPUMEM_VERSION_MINOR 1
#define GPUMEM_VERSION_PATCH 0

typedef enum gpumem_status {
  GPUMEM_SUCCESS = 0,
  GPUMEM_ERROR_INVALID_ARGUMENT = 1, /* bad config, size, pointer, double free, ... */
  GPUMEM_ERROR_OUT_OF_MEMORY = 2,    /* the device or the pool's limit is exhausted */
  GPUMEM_ERROR_CUDA = 3,             /* a CUDA call failed (or no device for platform:cuda) */
  GPUMEM_ERROR_NOT_SUPPORTED = 4,    /* the feature is not built in */
  GPUMEM_ERROR_INTERNAL = 5          /* any other failure (e.g. host memory exhausted) */
} gpumem_status;

typedef struct gpumem_pool gpumem_pool;

/* Byte counts are requested sizes for `live`, device memory held from the driver for
 * `reserved` (mapped pages, kept physical pages, cached segments). */
typedef struct gpumem_stats {
  uint64_t live_bytes;
  uint64_t peak_live_bytes;
  uint64_t live_allocations;
  uint64_t reserved_bytes;
  uint64_t peak_reserved_bytes;
  uint64_t cached_bytes;          /* reserved but not handed out */
  uint64_t allocations;           /* successful allocations */
  uint64_t deallocations;
  uint64_t alloc_retries;         /* allocations that had to give cached memory back first */
  uint64_t oom_count;             /* out-of-memory failures */
  uint64_t cross_stream_waits;    /* waits inserted at free for gpumem_record_stream */
  double fragmentation;           /* peak reserved / peak live; 0 before any allocation */
} gpumem_stats;

/* "0.1.0". Never NULL. */
GPUMEM_API const char* gpumem_version(void);
/* GPUMEM_VERSION_MAJOR * 10000 + MINOR * 100 + PATCH of the library (not the header). */
GPUMEM_API int gpumem_version_number(void);

/* Text of this thread's last failure ("" if none). Valid until this thread's next failing
 * gpumem call. Never NULL. */
GPUMEM_API const char* gpumem_last_error(void);
/* Status of this thread's last failure (GPUMEM_SUCCESS if none). */
GPUMEM_API gpumem_status gpumem_last_status(void);
/* "GPUMEM_ERROR_OUT_OF_MEMORY", ... Never NULL. */
GPUMEM_API const char* gpumem_status_name(gpumem_status status);

/* REQUIRES: out != NULL. On failure *out is set to NULL. */
GPUMEM_API gpumem_status gpumem_pool_create(const char* config, gpumem_pool** out);
/* Gives every byte back to the driver. Live allocations are freed with the pool. NULL is
 * a no-op (GPUMEM_SUCCESS). The handle stays dead, never reused: a later call on it, or a
 * second destroy, returns GPUMEM_ERROR_INVALID_ARGUMENT ("... was destroyed") and does
 * nothing else. A pool that KV caches or virtually contiguous sequence sets
 * (gpumem_kv.h) still stand on is refused the same way ("... still has N KV cache(s)"),
 * and stays live: destroy them first. */
GPUMEM_API gpumem_status gpumem_pool_destroy(gpumem_pool* pool);

/* NULL on failure (also for size 0): gpumem_last_status() / gpumem_last_error() say why. */
GPUMEM_API void* gpumem_malloc(gpumem_pool* pool, size_t size, void* stream);
/* Allocates `size` bytes at exactly `ptr` out of the untagged pool's free memory there, as
 * an allocation made on `stream` (gpumem_free frees it): memory freed earlier and wanted
 * back at its address, as restoring a CUDA graph tree's checkpoint needs. The caller knows
 * that memory idle on every stream. GPUMEM_ERROR_INVALID_ARGUMENT, nothing changed, where
 * the range is not wholly free in one block of the pool (allocated, given back to the
 * driver, inside the step plan's region, another tag's, or never the pool's);
 * GPUMEM_ERROR_NOT_SUPPORTED in guard mode. */
GPUMEM_API gpumem_status gpumem_allocate_at(gpumem_pool* pool, void* ptr, size_t size,
                                            void* stream);
/* As gpumem_malloc, with an alignment (a power of two; 256 is what gpumem_malloc uses) and
 * the status returned. *out is NULL on failure. */
GPUMEM_API gpumem_status gpumem_allocate(gpumem_pool* pool, size_t size, size_t alignment,
                                         void* stream, void** out);
/* `size` must be the size passed to gpumem_malloc. `stream` is the stream whose work last
 * uses the memory (the allocation stream under PyTorch's rules). A stream the platform
 * refuses (not a stream of the pool's device, a destroyed one) is refused with
 * GPUMEM_ERROR_INVALID_ARGUMENT or GPUMEM_ERROR_CUDA: the allocation stays live, the pool
 * unchanged, and a free with a good stream then succeeds. */
GPUMEM_API gpumem_status gpumem_free(gpumem_pool* pool, void* ptr, size_t size, void* stream);
/* The live allocation at `ptr` is also used by work on `stream`. When it is freed, the
 * freeing stream first waits for the work queued on every recorded stream up to that
 * moment, so stream-ordered reuse on the freeing stream is safe. Records die with the
 * allocation's free (a later allocation at the same address has none); a stream is
 * recorded once however often it is passed.
 * Any live allocation of the pool may be recorded: untagged, of a tag, shared or imported.
 * Refused with GPUMEM_ERROR_INVALID_ARGUMENT, nothing recorded: a `ptr` that is not a live
 * allocation of this pool as gpumem_malloc returned it (unknown, already freed, interior;
 * guard mode does not check), and a `stream` of another device than the pool's or one
 * the platform does not know.
 * A recorded stream that is destroyed before the free:
 *  - through gpumem_stream_destroy: the destroy waits for the stream's work, then drops
 *    its records; the free does not wait for it (its work is complete);
 *  - by other means (cudaStreamDestroy): the free finds the stream gone (the platform
 *    refuses it) and drops the record without waiting. The caller must then have
 *    completed the stream's work that uses the memory before destroying it
 *    (cudaStreamSynchronize), as no one can wait for a destroyed stream.
 * Finding whether `ptr` is live reads the pool's blocks once per allocation recorded
 * (O(blocks); later records of the same allocation cost a hash lookup). */
GPUMEM_API gpumem_status gpumem_record_stream(gpumem_pool* pool, void* ptr, void* stream);

/* Every tag's memory (untagged, each tag's, shared): all the device memory the pool holds. */
GPUMEM_API gpumem_status gpumem_pool_stats(gpumem_pool* pool, gpumem_stats* out);
/* A named counter, for diagnosis. A CUDA call's name ("cuMemCreate", "cuMemMap",
 * "cuMemUnmap", "cuMemSetAccess", "cudaMalloc", "cudaEventQuery", ...): how many times this
 * pool made it; the name followed by ".ns" ("cuMemMap.ns"): the nanoseconds spent in those
 * calls (steady clock around each, on any thread of the pool); "driver_ns": in all of
 * them. For vmm_page_pool also "page_size", "pages_mapped",
 * "pages_spare", "physical_handles", "pages_created", "pages_reclaimed", "pages_released",
 * and the remap budget's (pool_options remap_budget): "remap_ns" (time in growths that
 * gathered pages, on the pool's clock), "growth_slack_permille" (the slack in force, in
 * thousandths) and "slack_raises"; with lifetime_hints (on by default),
 * "long_lived_allocations" (large allocations guessed long-lived and placed side by side),
 * "long_lived_pages_moved" (pages gathered out of their runs for other blocks),
 * "lifetime_hints_active" (1 while the hints guess, 0 when off or stopped by their move
 * budget) and "long_lived_bytes_handed_over" (once stopped, free bytes of those runs given
 * to the other large blocks). With tags, these counts are summed over every tag's pool;
 * "page_size", "growth_slack_permille" and "lifetime_hints_active" are tag 0's.
 * With step_plan:on also "plan_marks", "plans_built", "planned_steps", "steps_left_plan",
 * "steps_rejoined", "planned_allocations", "plan_region_failures", "plan_region_takes",
 * "plan_regions_handed_over", "plan_region_bytes", "plan_lower_bound", "planned_per_step".
 * An unknown name gives GPUMEM_ERROR_INVALID_ARGUMENT. */
GPUMEM_API gpumem_status gpumem_pool_counter(gpumem_pool* pool, const char* name,
                                             uint64_t* out);
/* Marks a step boundary of a loop that repeats its requests (call it once per training or
 * serving step, at the same point each time). Once two steps in a row made the same
 * requests in the same order, later steps are served from a precomputed layout in one
 * region of the pool: no search, no driver call, memory at the plan's peak. A step that
 * differs goes to the pool from the first difference on (include/gpumem/pool/
 * step_planner.hpp). With step_plan:off, it does nothing and succeeds. */
GPUMEM_API gpumem_status gpumem_pool_mark_step(gpumem_pool* pool);
/* Gives cached memory of every tag back to the driver; *released (may be NULL) receives the
 * bytes. */
GPUMEM_API gpumem_status gpumem_pool_trim(gpumem_pool* pool, uint64_t* released);
/* The budget of a vmm_page_pool (footprint:fast): the reserved bytes up to which it grows
 * with new pages rather than gathering free ones; the smallest of this, `limit` and the
 * device's memory less headroom (0: none set). A budget below what the pool holds gives the
 * cached pages back at once. Tags other than 0 keep their own pools: the budget is tag 0's.
 * GPUMEM_ERROR_INVALID_ARGUMENT for another allocator. *budget_out (may be NULL) receives
 * the budget in force. The PyTorch plug-in sets it from set_per_process_memory_fraction. */
GPUMEM_API gpumem_status gpumem_pool_set_budget(gpumem_pool* pool, uint64_t bytes,
                                                uint64_t* budget_out);
/* Device memory (the driver's free bytes) that every new physical handle of the pool leaves
 * free, in every tag, as the option keep_free (0: none): a growth that would pass it gathers
 * free pages or fails with GPUMEM_ERROR_OUT_OF_MEMORY, and a wake leaves the tag asleep with
 * its bytes on the host. GPUMEM_ERROR_INVALID_ARGUMENT for another allocator or a value over
 * this machine's size_t. */
GPUMEM_API gpumem_status gpumem_pool_set_keep_free(gpumem_pool* pool, uint64_t bytes);
/* "vmm_page_pool" or "caching_pool"; "" for NULL. The accessors below answer "" (or -1)
 * for NULL, and also for a destroyed pool, where they set the error as well. */
GPUMEM_API const char* gpumem_pool_allocator(gpumem_pool* pool);
/* "cuda" or "sim"; "" for NULL. */
GPUMEM_API const char* gpumem_pool_platform(gpumem_pool* pool);
GPUMEM_API int gpumem_pool_device(gpumem_pool* pool);
/* The pool's options as a configuration string (pool options only). The text lives until
 * the pool is destroyed. */
GPUMEM_API const char* gpumem_pool_config(gpumem_pool* pool);
/* The out-of-memory report the pool would give for a request of `size` bytes, written to
 * buf (truncated, always NUL-terminated when capacity > 0). Returns the full length. */
GPUMEM_API size_t gpumem_pool_report(gpumem_pool* pool, size_t size, char* buf,
                                     size_t capacity);
/* Where the pool's reserved bytes go now, one part a line (include/gpumem/pool/
 * overhead.hpp): requested, rounding (and the request sizes whose rounding costs most),
 * freed blocks held unmerged, free bytes sharing a page with live blocks, free whole
 * pages, pages kept unmapped; then each tag other than 0, under a "tag N:" line. Written to
 * buf as gpumem_pool_report does; returns the full length (0 with the error set for a bad
 * pool). */
GPUMEM_API size_t gpumem_pool_explain(gpumem_pool* pool, char* buf, size_t capacity);

/* A stream on the pool's device and platform (cudaStreamCreate on cuda; a sim stream on
 * sim, where no other stream values exist). Destroying one releases it from the pool
 * first, so memory freed on it becomes reusable by every stream. A stream made here and
 * not destroyed by gpumem_stream_destroy is destroyed with the pool (gpumem_pool_destroy
 * waits for its work first): do not use it after the pool, and destroy it only through
 * the pool that made it (never cudaStreamDestroy: the pool would destroy it again).
 * A stream a live KV cache of the pool works on (gpumem_kv_config.stream) is refused with
 * GPUMEM_ERROR_INVALID_ARGUMENT until the cache is destroyed. */
GPUMEM_API gpumem_status gpumem_stream_create(gpumem_pool* pool, void** out);
GPUMEM_API gpumem_status gpumem_stream_destroy(gpumem_pool* pool, void* stream);
/* Waits for the stream's work. */
GPUMEM_API gpumem_status gpumem_stream_synchronize(gpumem_pool* pool, void* stream);
/* The device `stream` belongs to, as the pool's platform knows it (cudaStreamGetDevice;
 * NULL: the current device's default stream). GPUMEM_ERROR_INVALID_ARGUMENT for a stream
 * the platform does not know; *device is then -1. */
GPUMEM_API gpumem_status gpumem_stream_device(gpumem_pool* pool, void* stream, int* device);

/* Writes a PyTorch memory snapshot (the pickle torch.cuda.memory._dump_snapshot writes)
 * of the pool to `path`: every tag's segments, a tag's with segment_pool_id (tag, 0). GPUMEM_ERROR_NOT_SUPPORTED when this build has no snapshot
 * exporter. */
GPUMEM_API gpumem_status gpumem_snapshot(gpumem_pool* pool, const char* path);

/* --- Tags, sleep and wake ------------------------------------------------------------
 * Every allocation carries a tag: 0 for gpumem_malloc / gpumem_allocate (untagged), any
 * other value through gpumem_allocate_tagged. Each tag other than 0 has a vmm_page_pool of
 * its own (made on first use, the pool's options without a reservation up front), so two
 * tags never share a page. gpumem_free frees an allocation of any tag.
 *
 * gpumem_sleep(pool, tag, mode, stream) gives back to the driver the physical memory of
 * every page of the tag, keeping every virtual address reserved: mode 0 (offload) copies
 * the bytes to pinned host memory first, mode 1 (discard) drops them. Work on `stream`
 * queued before is complete before the pages go; work on other streams that uses the
 * memory must be complete already. gpumem_wake(pool, tag, stream) maps new pages at the
 * same addresses and copies the offloaded bytes back on `stream`, before any work queued
 * on `stream` after it: pointers, tensors and CUDA graphs made before the sleep stay valid.
 * Refusals (nothing changes, no byte is lost):
 *  - GPUMEM_ERROR_INVALID_ARGUMENT: an allocation in a sleeping tag (tag 0: gpumem_malloc
 *    too), a sleep of a sleeping tag, a wake of a tag that does not sleep, a sleep or wake
 *    of a tag never allocated in (nothing is made for it), a mode other than 0 or 1, the
 *    shared tag;
 *  - GPUMEM_ERROR_NOT_SUPPORTED: tag 0 of a caching_pool (it cannot keep addresses);
 *  - GPUMEM_ERROR_OUT_OF_MEMORY from gpumem_wake: the device has no room; the offloaded
 *    bytes stay on the host and a later gpumem_wake succeeds once there is room;
 *  - GPUMEM_ERROR_CUDA: a driver call failed halfway; the tag is then partly asleep (still
 *    refusing allocations) and the same call again completes it.
 * Freeing an allocation of a sleeping tag is allowed; its pages are given back at wake.
 * A tag that holds no page (all freed; tag 0 of a fresh pool) sleeps and wakes as any other.
 * A tag's pool is made by its first allocation only. The pool's stats, gpumem_pool_trim,
 * gpumem_pool_report and the retry of an allocation out of memory cover every tag (0, the
 * others, shared); gpumem_record_stream and the free's waits cover their allocations too. */
#define GPUMEM_SLEEP_OFFLOAD 0
#define GPUMEM_SLEEP_DISCARD 1
/* The tag of memory shared between processes: each allocation owns a physical handle that
 * gpumem_export can give to another process. Its allocations do not sleep. */
#define GPUMEM_TAG_SHARED 0xFFFFFFFFu

/* The calling thread's current tag (0 initially): gpumem_set_current_tag returns the one
 * it replaces. The PyTorch plug-in (gpumem_torch_malloc) places allocations in the current
 * tag, so `with gpumem.torch.tag(...)` tags the tensors made inside it. */
GPUMEM_API uint32_t gpumem_set_current_tag(uint32_t tag);
GPUMEM_API uint32_t gpumem_current_tag(void);
/* The process tag: the current tag of every thread that never set one
 * (gpumem_set_current_tag), as threads a framework starts for the caller (autograd's
 * backward thread). 0 initially; returns the one it replaces. */
GPUMEM_API uint32_t gpumem_set_process_tag(uint32_t tag);
/* Names a tag for messages and reports, process-wide: a named tag shows as "train (2)" in
 * out-of-memory reports, gpumem_pool_explain and refusals. 1 to 64 bytes of printable ASCII;
 * tag 0 and GPUMEM_TAG_SHARED keep their names. Naming a tag again renames it.
 * GPUMEM_ERROR_INVALID_ARGUMENT (the name unchanged) otherwise. */
GPUMEM_API gpumem_status gpumem_name_tag(uint32_t tag, const char* name);
GPUMEM_API gpumem_status gpumem_allocate_tagged(gpumem_pool* pool, size_t size,
                                                size_t alignment, void* stream, uint32_t tag,
                                                void** out);
GPUMEM_API gpumem_status gpumem_sleep(gpumem_pool* pool, uint32_t tag, int mode /* 0 offload, 1 discard */,
                                      void* stream);
GPUMEM_API gpumem_status gpumem_wake(gpumem_pool* pool, uint32_t tag, void* stream);
/* 1 when the tag sleeps (wholly or partly), 0 when awake, -1 for a bad pool. */
GPUMEM_API int gpumem_tag_asleep(gpumem_pool* pool, uint32_t tag);
/* Stats of one tag (all zero for a tag never used). */
GPUMEM_API gpumem_status gpumem_tag_stats(gpumem_pool* pool, uint32_t tag, gpumem_stats* out);
/* Pinned host memory a tag holds for its offload sleeps: the copy of its pages while it
 * sleeps, and after gpumem_wake the same block, kept for the next sleep (pinned memory is
 * slow to get). Sleeps of up to the same size reuse it, so it does not grow across sleep /
 * wake cycles; a larger sleep replaces it. gpumem_tag_host_bytes writes its bytes to *out
 * (0 for a tag never used). gpumem_release_host gives it back to the system now and
 * writes the bytes released to *released (may be NULL; 0 when none was held); the next
 * offload sleep gets new memory. Refused with GPUMEM_ERROR_INVALID_ARGUMENT, nothing
 * released: a tag asleep with offload (its bytes live there: wake it first), a tag never
 * allocated in, the shared tag; GPUMEM_ERROR_NOT_SUPPORTED: tag 0 of a caching_pool.
 * A tag asleep with discard holds no bytes there and may release it. */
GPUMEM_API gpumem_status gpumem_tag_host_bytes(gpumem_pool* pool, uint32_t tag, uint64_t* out);
GPUMEM_API gpumem_status gpumem_release_host(gpumem_pool* pool, uint32_t tag, uint64_t* released);
/* The pool's device memory as the driver reports it (cudaMemGetInfo). */
GPUMEM_API gpumem_status gpumem_device_memory(gpumem_pool* pool, size_t* free_bytes,
                                              size_t* total_bytes);

/* --- Sharing device memory between processes ----------------------------------------
 * gpumem_export gives a new file descriptor (close-on-exec, the caller's to close) for a
 * live allocation of GPUMEM_TAG_SHARED (CUDA: a POSIX file descriptor handle). Another
 * process receives it (gpumem_send_fd / gpumem_receive_fd: SCM_RIGHTS over a connected
 * Unix socket) and gpumem_import maps it in a range of its own pool: the same memory, no
 * copy. gpumem_free(pool, ptr, size, stream) on the imported pointer unmaps it. The memory
 * lives while any process maps it or holds a descriptor: the exporter may free its
 * allocation first, and an importer that exits or is killed leaks nothing of the
 * exporter's. Bad input gives GPUMEM_ERROR_INVALID_ARGUMENT: export of a pointer that is
 * not a live shared allocation; import of a closed or foreign descriptor, of a size that
 * does not match the exported memory (sim checks it exactly; CUDA refuses a larger size at
 * the mapping), of memory on a device the pool's cannot reach. Memory exported on one
 * device and imported by a pool of another device that can reach it (a peer) is mapped
 * there and that device is granted access. */
GPUMEM_API gpumem_status gpumem_export(gpumem_pool* pool, void* ptr, int* fd_out);
GPUMEM_API gpumem_status gpumem_import(gpumem_pool* pool, int fd, size_t size, void** ptr_out);
/* Any live allocation, not only GPUMEM_TAG_SHARED's, in a pool created with shareable:on
 * (its pages are made exportable): gpumem_export_pages gives one new close-on-exec file
 * descriptor per physical handle under [ptr, ptr + size), in address order, with each
 * handle's bytes, and *offset_out, where ptr lies from the first handle's start. `capacity`
 * is the room in fds_out and bytes_out; *count_out is set to the number of handles, and when
 * it exceeds `capacity` nothing is exported (GPUMEM_ERROR_INVALID_ARGUMENT): call again with
 * room. The descriptors are the caller's to close. The exporter keeps the allocation live
 * while another process may map it: its pages go back to its pool at free. Refused with
 * GPUMEM_ERROR_INVALID_ARGUMENT for a range not mapped by the pool, an import, a tag
 * asleep; GPUMEM_ERROR_NOT_SUPPORTED for a pool without shareable:on.
 * gpumem_import_pages maps the handles side by side in a range of this pool's (the
 * descriptors stay the caller's): the memory at *ptr_out + offset is the exporter's ptr.
 * Free it with gpumem_free(pool, *ptr_out, sum of the bytes, stream). */
GPUMEM_API gpumem_status gpumem_export_pages(gpumem_pool* pool, void* ptr, size_t size,
                                             int* fds_out, size_t* bytes_out, size_t capacity,
                                             size_t* count_out, size_t* offset_out);
GPUMEM_API gpumem_status gpumem_import_pages(gpumem_pool* pool, const int* fds,
                                             const size_t* bytes, size_t count, void** ptr_out);
/* Sends `fd` with `size` over a connected Unix domain socket; receives them. A message
 * that is not gpumem_send_fd's (short, cut, with no or several descriptors) is refused
 * with GPUMEM_ERROR_INVALID_ARGUMENT, every descriptor it carried closed. */
GPUMEM_API gpumem_status gpumem_send_fd(int socket, int fd, uint64_t size);
GPUMEM_API gpumem_status gpumem_receive_fd(int socket, int* fd_out, uint64_t* size_out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GPUMEM_INTEROP_GPUMEM_H */
