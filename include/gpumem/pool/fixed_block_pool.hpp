// fixed_block_pool: equal-size device blocks named by small integer ids, O(1) to
// allocate, free and turn into an address — the storage under the paged KV cache.
//
// Blocks live in chunks taken from an upstream memory_resource (typically a
// vmm_page_pool, so chunks are mapped pages); the pool grows a chunk at a time and gives
// wholly free chunks back on shrink().
//
//   id = chunk * blocks_per_chunk + index;  address(id) = chunk_base[chunk] + index * block_bytes
//
// Invariants (validate()):
//  - every id of a live chunk is either on the free stack or marked used, never both;
//  - a cap (max_blocks) below one default chunk shrinks the chunk to fit it;
//  - free_blocks() + used_blocks() == capacity_blocks() == live chunks * blocks_per_chunk.
// Not thread-safe: its owner serializes calls (a KV cache holds one lock over its tables).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gpumem/backend/memory_resource.hpp"

namespace gpumem {

class fixed_block_pool {
 public:
  using block_id = std::uint32_t;

  // blocks_per_chunk 0: enough blocks for a 2 MiB chunk (at least 1).
  // max_blocks 0: no cap beyond what upstream gives.
  fixed_block_pool(memory_resource& upstream, std::size_t block_bytes,
                   std::size_t blocks_per_chunk = 0, std::size_t max_blocks = 0);
  ~fixed_block_pool();
  fixed_block_pool(const fixed_block_pool&) = delete;
  fixed_block_pool& operator=(const fixed_block_pool&) = delete;

  // Throws gpumem::out_of_memory (with a report) when no block is free and growth fails.
  block_id allocate();
  // As allocate, but std::nullopt when exhausted.
  std::optional<block_id> try_allocate();
  // Throws gpumem::invalid_argument for an id that is not a live block (unknown, freed).
  void free(block_id id);
  void* address(block_id id) const noexcept {
    return reinterpret_cast<void*>(chunk_base_[id / blocks_per_chunk_] +
                                   (id % blocks_per_chunk_) * block_bytes_);
  }
  bool is_used(block_id id) const noexcept { return id < used_.size() && used_[id] == used; }

  // Grows until at least `blocks` blocks exist; false when upstream is exhausted.
  bool reserve(std::size_t blocks);
  // Returns wholly free chunks to upstream; returns the blocks given back.
  std::size_t shrink();

  std::size_t block_bytes() const noexcept { return block_bytes_; }
  std::size_t blocks_per_chunk() const noexcept { return blocks_per_chunk_; }
  std::size_t capacity_blocks() const noexcept { return live_chunks_ * blocks_per_chunk_; }
  std::size_t free_blocks() const noexcept { return free_.size(); }
  std::size_t used_blocks() const noexcept { return capacity_blocks() - free_.size(); }
  std::size_t reserved_bytes() const noexcept { return live_chunks_ * chunk_bytes(); }
  std::size_t chunk_bytes() const noexcept { return blocks_per_chunk_ * block_bytes_; }
  memory_resource& upstream() const noexcept { return upstream_; }
  std::string validate() const;

 private:
  bool grow();

  memory_resource& upstream_;
  std::size_t block_bytes_;
  std::size_t blocks_per_chunk_;
  std::size_t max_blocks_;
  std::vector<std::uintptr_t> chunk_base_;  // 0: slot empty (chunk given back)
  std::size_t live_chunks_ = 0;
  std::vector<block_id> free_;               // stack of free ids
  // Per id: never handed out since its chunk came, handed out now, or freed since.
  static constexpr std::uint8_t never_used = 0, used = 1, freed = 2;
  std::vector<std::uint8_t> used_;
};

}  // namespace gpumem
