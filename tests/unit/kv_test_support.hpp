// What the KV cache tests share: a small layout and runs of token ids.
#pragma once

#include <cstddef>
#include <numeric>
#include <vector>

#include "gpumem/kv.hpp"

namespace gpumem_test {

// 2 layers x 2 heads x 64 dims, bf16, 16 tokens: 16 KiB blocks, 128 to a 2 MiB page.
inline gpumem::kv_layout small_layout() {
  gpumem::kv_layout l;
  l.layers = 2;
  l.kv_heads = 2;
  l.head_dim = 64;
  l.dtype = gpumem::kv_dtype::bf16;
  l.block_tokens = 16;
  return l;
}

// `n` token ids counting up from `first`.
inline std::vector<gpumem::token_id> token_run(std::size_t n, gpumem::token_id first = 1) {
  std::vector<gpumem::token_id> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

}  // namespace gpumem_test
