// kv_virtual_sequences: each sequence's keys and values in one virtual range of its own
// that grows by mapping pages (the vAttention idea on stock VMM calls), so attention reads
// a sequence as an ordinary strided tensor, without a block table.
//
// Layout: token-major, all layers of a token side by side:
//
//   address(seq, token, layer, kv, head, dim) = base(seq)
//       + token * token_stride   (= layout.bytes_per_token() = layers * layer_stride)
//       + layer * layer_stride   (= 2 * kv_stride)
//       + kv    * kv_stride      (0 keys, 1 values; = kv_heads * head_dim * dtype bytes)
//       + head  * head_dim * dtype bytes + dim * dtype bytes
//
// so layer l's keys of a sequence are a [tokens][kv_heads][head_dim] array whose token
// stride is token_stride. A sequence holds ceil(tokens * token_stride / page) pages: at
// most one partly used page per sequence (a per-layer layout would leave one per layer).
// layout.block_tokens is not used, nor the block size rule of kv_layout::validate().
//
// Pages come from a vmm_page_pool (lend_pages) and go back to it at free(), under the
// pool's one budget. free() waits for the stream first (a kernel may still read the pages).
// Errors (typed; nothing changes): unknown or freed sequence, more than max_sequence_tokens
// -> gpumem::invalid_argument; the pool cannot lend the pages -> gpumem::out_of_memory;
// a driver failure -> gpumem::cuda_error.
// Invariants (validate()): each sequence maps ceil(tokens * token_stride / page) pages (more
// only where a failed undo left pages mapped, without access, until free()), and
// mapped_bytes() == their sum * page. Thread-safe: one mutex around each call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpumem/kv/kv_layout.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem {

class kv_virtual_sequences {
 public:
  using sequence_id = std::uint64_t;

  // Throws gpumem::invalid_argument for a bad layout or max_sequence_tokens 0.
  kv_virtual_sequences(vmm_page_pool& pages, kv_layout layout, std::size_t max_sequence_tokens,
                       stream_handle stream = {});
  ~kv_virtual_sequences();
  kv_virtual_sequences(const kv_virtual_sequences&) = delete;
  kv_virtual_sequences& operator=(const kv_virtual_sequences&) = delete;

  // A sequence with room for `tokens` tokens mapped (its range is reserved for
  // max_sequence_tokens).
  sequence_id add(std::size_t tokens);
  // Room for `tokens` more (maps pages when they cross a page). All or nothing.
  void append(sequence_id seq, std::size_t tokens);
  void free(sequence_id seq);

  std::uintptr_t base(sequence_id seq) const;
  std::size_t tokens(sequence_id seq) const;
  std::size_t sequences() const;
  std::size_t mapped_bytes() const;
  // Bytes of the tokens the sequences hold (tokens * token_stride, summed).
  std::size_t live_bytes() const;
  const kv_layout& layout() const noexcept { return layout_; }
  std::size_t token_stride() const noexcept { return layout_.bytes_per_token(); }
  std::size_t page_size() const noexcept { return page_; }
  std::size_t max_sequence_tokens() const noexcept { return max_tokens_; }
  std::string validate() const;

 private:
  struct sequence {
    std::uintptr_t base = 0;
    std::size_t tokens = 0;
    std::vector<physical_handle> pages;  // page i of the range maps pages[i]
  };
  sequence& find_locked(sequence_id seq, const char* what);
  const sequence& find_locked(sequence_id seq, const char* what) const;
  // Maps pages until `s` has room for `tokens` tokens; all or nothing.
  void grow_locked(sequence& s, std::size_t tokens);
  // Unmaps s's pages from index `first` on and returns them to the pool (best effort).
  void unmap_from(sequence& s, std::size_t first) noexcept;

  vmm_page_pool& pool_;
  platform& platform_;
  int device_;
  kv_layout layout_;
  std::size_t max_tokens_;
  stream_handle stream_;
  std::size_t page_;
  std::size_t range_bytes_;
  mutable std::mutex mutex_;
  std::unordered_map<sequence_id, sequence> sequences_;
  sequence_id next_id_ = 1;
  std::size_t mapped_pages_ = 0;
  std::size_t live_tokens_ = 0;
};

}  // namespace gpumem
