#include "gpumem/kv/kv_layout.hpp"

#include <limits>

#include "gpumem/errors.hpp"

namespace gpumem {

std::size_t kv_dtype_bytes(kv_dtype t) noexcept {
  switch (t) {
    case kv_dtype::fp8: return 1;
    case kv_dtype::f16: return 2;
    case kv_dtype::bf16: return 2;
    case kv_dtype::f32: return 4;
  }
  return 0;
}

std::string_view kv_dtype_name(kv_dtype t) noexcept {
  switch (t) {
    case kv_dtype::fp8: return "fp8";
    case kv_dtype::f16: return "f16";
    case kv_dtype::bf16: return "bf16";
    case kv_dtype::f32: return "f32";
  }
  return "?";
}

kv_dtype parse_kv_dtype(std::string_view name) {
  if (name == "fp8") return kv_dtype::fp8;
  if (name == "f16" || name == "fp16") return kv_dtype::f16;
  if (name == "bf16") return kv_dtype::bf16;
  if (name == "f32" || name == "fp32") return kv_dtype::f32;
  throw invalid_argument("unknown KV dtype '" + std::string(name) +
                         "' (expected fp8, f16, bf16 or f32)");
}

std::string kv_layout::validate() const {
  if (layers == 0 || kv_heads == 0 || head_dim == 0 || block_tokens == 0)
    return "layers, kv_heads, head_dim and block_tokens must all be at least 1";
  // Each factor bounded so the product cannot overflow 64 bits.
  constexpr std::size_t limit = std::size_t{1} << 16;
  if (layers > limit || kv_heads > limit || head_dim > limit || block_tokens > limit)
    return "a KV dimension exceeds 65536";
  const double stride = static_cast<double>(layers) * 2.0 * static_cast<double>(block_tokens) *
                        static_cast<double>(kv_heads) * static_cast<double>(head_dim) *
                        static_cast<double>(dtype_bytes());
  if (stride > static_cast<double>(std::size_t{1} << 40)) return "a KV block would exceed 1 TiB";
  if (block_stride() % 256 != 0)
    return "a KV block of " + std::to_string(block_stride()) +
           " bytes is not a multiple of 256 (make head_dim * kv_heads * dtype bytes a multiple of 16)";
  return {};
}

}  // namespace gpumem
