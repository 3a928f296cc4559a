// The shape of a paged KV cache and where each byte of it lives.
//
// A block holds `block_tokens` tokens of keys and values for EVERY layer, so growing or
// shrinking the cache by whole blocks maps or unmaps whole pages, and a copy-on-write or
// a swap moves one contiguous range per block. All blocks lie in one virtual range, so a
// kernel needs one base pointer and the block table:
//
//   address(b, layer, kv, token, head, dim) = base
//       + b     * block_stride     (= layers * layer_stride)
//       + layer * layer_stride     (= 2 * kv_stride)
//       + kv    * kv_stride        (0 = keys, 1 = values; = block_tokens * token_stride)
//       + token * token_stride     (= kv_heads * head_stride)
//       + head  * head_stride      (= head_dim * dtype bytes)
//       + dim   * dtype bytes
//
// i.e. each (block, layer, K|V) slab is a dense [block_tokens][kv_heads][head_dim] array,
// the layout of vLLM's per-layer cache with the block index outermost.
// Invariants: block_stride == layers * 2 * block_tokens * kv_heads * head_dim * dtype bytes;
// every stride is a multiple of the dtype size; block_stride is a multiple of 256 bytes
// when head_dim * kv_heads * dtype bytes is a multiple of 16 (checked: see validate).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace gpumem {

enum class kv_dtype : std::uint8_t { fp8, f16, bf16, f32 };
std::size_t kv_dtype_bytes(kv_dtype t) noexcept;
std::string_view kv_dtype_name(kv_dtype t) noexcept;
// "fp8" | "f16" | "fp16" | "bf16" | "f32" | "fp32"; throws gpumem::invalid_argument.
kv_dtype parse_kv_dtype(std::string_view name);

struct kv_layout {
  std::size_t layers = 0;
  std::size_t kv_heads = 0;
  std::size_t head_dim = 0;
  kv_dtype dtype = kv_dtype::bf16;
  std::size_t block_tokens = 16;

  std::size_t dtype_bytes() const noexcept { return kv_dtype_bytes(dtype); }
  std::size_t head_stride() const noexcept { return head_dim * dtype_bytes(); }
  std::size_t token_stride() const noexcept { return kv_heads * head_stride(); }
  std::size_t kv_stride() const noexcept { return block_tokens * token_stride(); }
  std::size_t layer_stride() const noexcept { return 2 * kv_stride(); }
  std::size_t block_stride() const noexcept { return layers * layer_stride(); }
  // Key and value bytes of one token across all layers.
  std::size_t bytes_per_token() const noexcept { return layers * 2 * token_stride(); }
  std::size_t offset(std::size_t block, std::size_t layer, std::size_t kv, std::size_t token,
                     std::size_t head, std::size_t dim) const noexcept {
    return block * block_stride() + layer * layer_stride() + kv * kv_stride() +
           token * token_stride() + head * head_stride() + dim * dtype_bytes();
  }
  // "" when usable, else why not (a zero dimension, a block that is not a multiple of
  // 256 bytes, sizes that overflow).
  std::string validate() const;
};

}  // namespace gpumem
