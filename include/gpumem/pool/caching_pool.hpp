// caching_pool: a PyTorch-style caching allocator over any memory_resource (runtime,
// driver or vmm backend). Segments come from the upstream resource — 2 MiB segments for
// small requests, granularity-rounded ones for large — and are carved into blocks by
// best fit with splitting and merging; freed blocks stay cached for reuse.
//
// Invariants: reserved_bytes == sum of live segment sizes; a segment goes back upstream
// only when one free block spans it entirely; blocks never merge across segments; a
// segment whose upstream free failed is never handed out again (it may be unmapped).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

#include "gpumem/pool/core/pool_base.hpp"

namespace gpumem {

class caching_pool final : public pool_base {
 public:
  // min_segment_bytes: a large request's new segment is at least this big (rounded to
  // 2 MiB), so requests a little over a multiple of 2 MiB (a KV record: a 2 MiB block and
  // its header) share segments instead of each taking one of twice its size, and upstream
  // is asked fewer times. 0: segments of the request's size.
  // REQUIRES: upstream outlives the pool.
  explicit caching_pool(memory_resource& upstream, pool_options options = {},
                        std::size_t min_segment_bytes = 0);
  ~caching_pool() override;
  std::string_view name() const noexcept override { return "caching_pool"; }
  std::size_t segment_count() const;

 protected:
  bool grow(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
            std::size_t alignment, stream_handle stream, growth kind) override;
  std::size_t release_cached() override;
  std::string describe_holdings() const override;
  std::string validate_holdings() const override;

 private:
  struct segment {
    std::size_t size;
    std::uint32_t arena_id;
    // Its upstream free failed partway (a vmm backend may have unmapped it already): out
    // of the arenas, never handed out again, still reserved; the free is retried by the
    // next release_cached() and by the destructor.
    bool retiring = false;
  };
  bool add_segment(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
                   stream_handle stream, std::size_t alignment);
  // Frees wholly free segments upstream until at least `bytes` went back: the smallest one
  // that is enough, else the largest first (every one for SIZE_MAX). Waits for the streams
  // of free blocks first when there is one to free. Returns the bytes freed.
  // REQUIRES: mutex_ held, both arenas flushed.
  std::size_t release_idle_segments(std::size_t bytes);

  memory_resource& upstream_;
  std::map<std::uintptr_t, segment> segments_;
  std::uint32_t next_segment_id_ = 1;
  std::size_t min_segment_ = 0;
};

}  // namespace gpumem
