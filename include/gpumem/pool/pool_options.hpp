// Options shared by the pools, settable from C++ or from a configuration string in the
// style of PYTORCH_CUDA_ALLOC_CONF: "key:value,key:value" (GPUMEM_CONF in the environment).
//
//   reserve:BYTES            physical memory taken up front (suffixes K, M, G, T; or a
//   reserve_fraction:F       fraction of device memory, 0 < F <= 1); vmm_page_pool also maps
//                            it up front, so requests within it make no driver call
//   limit:BYTES              hard cap on reserved bytes (0: none)
//   release_threshold:BYTES  cached bytes kept before the pool gives memory back
//                            (default: keep all, like cudaMemPool's threshold "never")
//   small_threshold:BYTES    requests up to this size use the small-block arena (1M)
//   cross_stream:wait|event  reuse another stream's freed block by making the new stream
//                            wait on it (wait) or only once its event completed (event)
//   va_reserve:BYTES         vmm_page_pool's virtual range (default 2x device memory)
//   big_chunk:N              vmm_page_pool: growths of >= 2N pages use N-page handles (0:
//                            one page per handle but for huge growths, below; see
//                            vmm_page_pool.hpp)
//   huge_growth:BYTES        vmm_page_pool, without big_chunk: a growth that creates at least
//                            BYTES (default 1G) takes handles of BYTES/16 (64 MiB), the rest
//                            one page; 0: one page per handle always. The driver's access
//                            grant costs ~26-29 us per handle on the H200 (2026-12-01), so
//                            one-page handles cannot grow faster than that per page. Those
//                            handles serve only requests of BYTES/16 or more (smaller blocks
//                            would pin them; see vmm_page_pool.hpp)
//   scrub:on|off             zero every block (memset on the freeing stream) at free, before
//                            any other owner can get it (default off)
//   guard:on|off             vmm_page_pool debug mode: every allocation gets pages of its own
//                            ending at an unmapped guard page, so an overrun faults at once
//                            (default off; frees wait for their stream)
//   round_large:BYTES        round blocks of large requests (over small_threshold) up to a
//                            multiple of BYTES, a power of two (default 0: 512 B, like small
//                            ones), when that loses less than half of BYTES (a request just
//                            over a multiple keeps 512-byte units: its tail shares a unit with
//                            the next block). With the page size (2M on the H200),
//                            vmm_page_pool's large blocks mostly own whole pages: no page is
//                            pinned by another block's tail, and a tensor re-allocated a
//                            little larger each step fits the block its predecessor freed.
//                            Costs under BYTES/2 per live large block, and at most 1/32 of the
//                            live bytes in all
//   thread_cache:on|off      per-thread caches in front of the pool: a thread reuses the
//                            blocks of small requests it freed (its size, or up to 1/16
//                            larger within the 1/32 waste allowance), and frees what it
//                            allocated, without the pool's lock (default on; off: every call
//                            takes the pool lock). Large requests always take the pool lock
//                            (their blocks merge at once; see thread_cache.hpp)
//   small_classes:N          round small requests (up to small_threshold) up to size classes,
//                            N to an octave (a power of two up to 64; default 4, as jemalloc's
//                            classes; 0: 512-byte units only). A block then exceeds its request
//                            by under 1/N, every freed block serves all later requests of its
//                            class, and each thread's cache keeps and reuses small blocks on
//                            its own (below). Applied while the thread caches are on (not with
//                            thread_cache:off, guard, scrub or an observer attached: there a
//                            freed block merges at once and the rounding only wastes). With 0,
//                            pool_bench's mixed-size pairs take the pool lock on most calls
//                            (sim: ~120-140 ns against ~75-95 ns a pair); over 46 recorded
//                            traces the geomean fragmentation is 1.0069 with 0 and 1.0076
//                            with 4; infer_llama 1.0044 and 1.0063 (sim; docs/RESULTS.md)
//   small_cache:BYTES        with small_classes: the bytes of small blocks each thread's cache
//                            keeps (default 16M). A small request that finds no free block
//                            first grows the small arena from the pages the pool holds (kept
//                            unmapped, or gathered from free runs); the kept blocks go back
//                            before the pool makes new pages, and before memory is given back
//   map_worker:auto|on|off   vmm_page_pool: unmap the old mappings of remapped pages on a
//                            helper thread, so the allocating thread does not pay ~40 us per
//                            mapping while the GPU is busy (auto: on for the cuda platform, off
//                            on sim, whose calls cost no driver time; see vmm_worker.hpp).
//                            With it on, page placement depends on the helper's progress:
//                            peak memory varies between runs (train_llama ~1.002, or ~1.010
//                            one run in four; docs/RESULTS.md); off, every run is the same
//   growth_slack:F           vmm_page_pool: memory it may hold beyond the peak live bytes,
//                            as a fraction (0 <= F <= 1; default 0: the least memory). Within
//                            (1 + F) x peak live, a request does not split a large free run
//                            (a large tensor's, wanted back soon) and growth takes new pages
//                            rather than gathering scattered free ones: each remapped page
//                            costs ~80 us of driver time on a busy H200. From 0.03 a Llama
//                            training step ran at native speed (fragmentation 1.03; the
//                            default 1.0004 at 1-11% slower; see docs/INTEROP.md)
//   remap_budget:F           vmm_page_pool: the share of elapsed time it may spend gathering
//                            scattered free pages (0 <= F <= 1; default 0: never trades
//                            memory for it). When its gathers take more than F of the time
//                            since the last judgement (at least 250 ms, with no new peak of
//                            live bytes in it), the growth slack above is raised by 0.01 for
//                            each F they took and at least to the largest gathering request's
//                            share of the peak, up to 0.1: memory bought for speed only where
//                            the workload makes the pool remap often. Judged on the pool's
//                            clock (the host's steady clock; a replay's is the trace's own
//                            time, see replay/trace.hpp)
//   release_idle:on|off      caching_pool: before a new segment would raise the reserved
//                            peak, free wholly idle segments upstream first (the smallest
//                            that is enough, else the largest until enough). Segments are
//                            sized for the requests that made them, so later peaks' requests
//                            often fit none of them: on sim, train_llama 1.19 -> 1.08 and
//                            encode_varlen 2.51 -> 1.69 (docs/RESULTS.md). Costs a cudaFree
//                            (it waits for the device) each time; default off, as PyTorch's
//                            allocator, which frees segments only when out of memory.
//                            vmm_page_pool accepts it and always does the like: it remaps
//                            free pages rather than grow past the peak
//   lifetime_hints:on|off    vmm_page_pool: guess from the sizes of the large requests before
//                            it whether a large request's block will outlive its successors
//                            (blocks of its kind pile up: a layer's saved activation, a
//                            prefill's KV block) and place such blocks side by side in runs
//                            of their own, so their partial last pages are shared with each
//                            other instead of pinned by dead temporaries (default on; no
//                            effect with reserve/reserve_fraction, whose promise is no driver
//                            call within the reservation, nor in guard mode). H200, 2 passes:
//                            infer_llama 1.0139 -> 1.0044. Where those runs trade pages with
//                            the others step after step (a memory-tight training loop), a
//                            move budget stops the guesses for good (src/pool/lifetime_hints.hpp,
//                            docs/RESULTS.md)
//
// Unknown keys and malformed values throw gpumem::invalid_argument naming them.
#pragma once

#include <cstddef>
#include <limits>
#include <string>
#include <string_view>

namespace gpumem {

enum class cross_stream_policy { event, wait };
enum class map_worker_mode { automatic, on, off };

struct pool_options {
  std::size_t reserve_bytes = 0;
  double reserve_fraction = 0.0;
  std::size_t limit_bytes = 0;
  std::size_t release_threshold = std::numeric_limits<std::size_t>::max();
  std::size_t small_threshold = std::size_t{1} << 20;
  cross_stream_policy cross_stream = cross_stream_policy::event;
  std::size_t va_reserve_bytes = 0;
  std::size_t big_chunk_pages = 0;
  std::size_t huge_growth_bytes = std::size_t{1} << 30;
  bool scrub = false;
  bool guard = false;
  bool thread_cache = true;
  std::size_t round_large = 0;
  unsigned small_classes = 4;
  std::size_t small_cache = std::size_t{16} << 20;
  map_worker_mode map_worker = map_worker_mode::automatic;
  double growth_slack = 0.0;
  double remap_budget = 0.0;
  bool release_idle = false;
  bool lifetime_hints = true;

  static pool_options parse(std::string_view config);
  // Whether n is a valid small_classes (0 or a power of two up to 64), for parse() and the
  // pools' constructors (options built in code skip parse()).
  static constexpr bool valid_small_classes(unsigned n) noexcept {
    return n <= 64 && (n & (n - 1)) == 0;
  }
  // GPUMEM_CONF, or defaults when unset.
  static pool_options from_environment();
  std::string to_string() const;

 private:
  static void apply(pool_options& o, std::string_view key, std::string_view value);
};

// "2G", "512M", "4096", "1.5G" -> bytes; throws gpumem::invalid_argument.
std::size_t parse_bytes(std::string_view text);

}  // namespace gpumem
