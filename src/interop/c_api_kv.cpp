// The KV cache's C API (gpumem/interop/gpumem_kv.h) over gpumem::kv_cache.
//
// A gpumem_kv_cache owns, in declaration order, the pinned host pool for swap (when asked
// for) and the cache, so the cache (which may hand host blocks back) goes first. It keeps
// a pointer to its gpumem pool's vmm_page_pool and counts itself among the pool's
// borrowers (c_api_internal.hpp) from create to destroy, so gpumem_pool_destroy refuses
// the pool while it lives. gpumem_kv_vseqs does the same.
//
// Counts that describe a caller's buffer (tokens, sequence ids, rows) are checked before
// the buffer is read: a count whose bytes overflow size_t, or whose buffer would wrap the
// address space, names no buffer that can exist (invalid_argument). Token counts are
// checked against the cache's sequence_token_limit() first, so the text names the limit.
// Every entry point is noexcept: exceptions become status codes through the pool C API's
// `guarded` (c_api_internal.hpp), with the text in the same thread-local slot
// (gpumem_last_error()).
#include "gpumem/interop/gpumem_kv.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/kv.hpp"
#include "gpumem/platform/status_error.hpp"
#include "gpumem/pool.hpp"
#include "interop/c_api_internal.hpp"

// Counts its handle among a pool's borrowers for as long as it lives.
class pool_borrow {
 public:
  pool_borrow(std::atomic<std::uint64_t>& count) noexcept : count_(&count) {
    count_->fetch_add(1, std::memory_order_acq_rel);
  }
  ~pool_borrow() { count_->fetch_sub(1, std::memory_order_acq_rel); }
  pool_borrow(const pool_borrow&) = delete;
  pool_borrow& operator=(const pool_borrow&) = delete;

 private:
  std::atomic<std::uint64_t>* count_;
};

// Names its stream among the pool's streams in use by KV caches for as long as it lives.
class stream_borrow {
 public:
  stream_borrow(gpumem::detail::c_api_borrowers& b, void* stream) : b_(&b) {
    std::lock_guard lock(b_->streams_mutex);
    it_ = b_->kv_streams.insert(reinterpret_cast<std::uintptr_t>(stream));
  }
  ~stream_borrow() {
    std::lock_guard lock(b_->streams_mutex);
    b_->kv_streams.erase(it_);
  }
  stream_borrow(const stream_borrow&) = delete;
  stream_borrow& operator=(const stream_borrow&) = delete;

 private:
  gpumem::detail::c_api_borrowers* b_;
  std::multiset<std::uintptr_t>::iterator it_;
};

// Members in this order: the borrow ends last, after the cache gave its pages back.
struct gpumem_kv_cache {
  gpumem_kv_cache(gpumem::detail::c_api_borrowers& b, void* stream)
      : borrow(b.kv_caches), stream_use(b, stream) {}
  pool_borrow borrow;
  stream_borrow stream_use;
  std::unique_ptr<gpumem::pinned_host_pool> host;
  std::unique_ptr<gpumem::kv_cache> cache;
  void* stream = nullptr;
  gpumem::platform* platform = nullptr;
};

struct gpumem_kv_vseqs {
  explicit gpumem_kv_vseqs(std::atomic<std::uint64_t>& count) : borrow(count) {}
  pool_borrow borrow;
  std::unique_ptr<gpumem::kv_virtual_sequences> seqs;
};

namespace {

using gpumem::detail::c_api_fail;
using gpumem::detail::guarded;

// Null handle or null output: refused before any work, with the entry point's name.
gpumem_status refuse(const char* where, const char* what) noexcept {
  try {
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, (std::string(where) + ": " + what).c_str());
  } catch (...) {
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, what);
  }
}

#define GPUMEM_KV_REQUIRE(cond, where, what) \
  do {                                       \
    if (!(cond)) return refuse(where, what); \
  } while (0)

gpumem::kv_dtype to_dtype(std::int32_t d, const char* where) {
  switch (d) {
    case GPUMEM_KV_FP8: return gpumem::kv_dtype::fp8;
    case GPUMEM_KV_F16: return gpumem::kv_dtype::f16;
    case GPUMEM_KV_BF16: return gpumem::kv_dtype::bf16;
    case GPUMEM_KV_F32: return gpumem::kv_dtype::f32;
    default: break;
  }
  throw gpumem::invalid_argument(std::string(where) + ": unknown dtype " + std::to_string(d) +
                                 " (expected GPUMEM_KV_FP8, _F16, _BF16 or _F32)");
}

std::int32_t from_dtype(gpumem::kv_dtype d) noexcept {
  switch (d) {
    case gpumem::kv_dtype::fp8: return GPUMEM_KV_FP8;
    case gpumem::kv_dtype::f16: return GPUMEM_KV_F16;
    case gpumem::kv_dtype::bf16: return GPUMEM_KV_BF16;
    case gpumem::kv_dtype::f32: return GPUMEM_KV_F32;
  }
  return -1;
}

gpumem_kv_layout to_c(const gpumem::kv_layout& l) noexcept {
  gpumem_kv_layout c{};
  c.layers = l.layers;
  c.kv_heads = l.kv_heads;
  c.head_dim = l.head_dim;
  c.block_tokens = l.block_tokens;
  c.dtype = from_dtype(l.dtype);
  return c;
}

// Writes text to buf (truncated, NUL-terminated when capacity > 0); returns its full length.
size_t copy_text(const std::string& text, char* buf, size_t capacity) {
  if (buf != nullptr && capacity > 0) {
    const std::size_t n = std::min(text.size(), capacity - 1);
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

// Throws gpumem::invalid_argument when `count` elements of `element` bytes at `buf` name no
// buffer that can exist: the byte count overflows, or the range wraps the address space.
void require_buffer(const void* buf, std::size_t count, std::size_t element, const char* what) {
  const std::size_t room = SIZE_MAX - reinterpret_cast<std::uintptr_t>(buf);
  if (count <= room / element) return;
  throw gpumem::invalid_argument(std::string(what) + ": a count of " + std::to_string(count) +
                                 " elements of " + std::to_string(element) +
                                 " bytes names no buffer that can exist (it wraps the "
                                 "address space)");
}

// The caller's token buffer: a count past the cache's sequence_token_limit() is refused
// naming that limit; then the buffer must be one that can exist.
std::span<const gpumem::token_id> token_span(const gpumem::kv_cache& cache,
                                             const std::int32_t* tokens, std::size_t count,
                                             const char* what) {
  if (count > cache.sequence_token_limit()) cache.check_token_count(0, count, what);
  require_buffer(tokens, count, sizeof(std::int32_t), "tokens");
  return {reinterpret_cast<const gpumem::token_id*>(tokens), count};
}

}  // namespace

extern "C" {

void gpumem_kv_config_init(gpumem_kv_config* config) {
  if (config == nullptr) return;
  *config = gpumem_kv_config{};
  config->layout.block_tokens = 16;
  config->layout.dtype = GPUMEM_KV_BF16;
  config->prefix_caching = 1;
  config->swap = 1;
}

gpumem_status gpumem_kv_create(gpumem_pool* pool, const gpumem_kv_config* config,
                               gpumem_kv_cache** out) {
  constexpr const char* where = "gpumem_kv_create";
  GPUMEM_KV_REQUIRE(out != nullptr, where, "null output pointer");
  *out = nullptr;
  GPUMEM_KV_REQUIRE(config != nullptr, where, "null config");
  const gpumem::detail::c_api_pool_parts parts = gpumem::detail::c_api_pool(pool, where);
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded(where, [&] {
    gpumem::detail::require_device_stream(*parts.device_platform, parts.device,
                                          reinterpret_cast<std::uintptr_t>(config->stream),
                                          "no cache was made");
    if (config->reserved != 0 || config->layout.reserved != 0)
      throw gpumem::invalid_argument("the reserved fields of the config and its layout must "
                                     "be 0 (gpumem_kv_config_init sets them)");
    const gpumem_kv_layout& cl = config->layout;
    gpumem::kv_cache_config c;
    c.layout.layers = cl.layers;
    c.layout.kv_heads = cl.kv_heads;
    c.layout.head_dim = cl.head_dim;
    c.layout.block_tokens = cl.block_tokens;
    c.layout.dtype = to_dtype(cl.dtype, where);
    if (auto why = c.layout.validate(); !why.empty())
      throw gpumem::invalid_argument("bad layout: " + why);
    c.max_blocks = config->max_blocks;
    c.initial_blocks = config->initial_blocks;
    c.max_sequence_tokens = config->max_sequence_tokens;
    c.grow_pages = config->grow_pages;
    c.prefix_caching = config->prefix_caching != 0;
    c.scrub = config->scrub != 0;
    c.stream = gpumem::stream_handle{reinterpret_cast<std::uintptr_t>(config->stream)};
    // Last of the checks: a tag's pool is made by its first use, never by a refused call.
    gpumem::vmm_page_pool* pages =
        &gpumem::detail::c_api_current_page_pool(parts, "the KV cache needs");
    auto handle = std::make_unique<gpumem_kv_cache>(*parts.borrowers, config->stream);
    if (config->swap != 0)
      handle->host = std::make_unique<gpumem::pinned_host_pool>(*parts.device_platform, parts.device);
    handle->cache = std::make_unique<gpumem::kv_cache>(*pages, c, handle->host.get());
    handle->stream = config->stream;
    handle->platform = parts.device_platform;
    *out = handle.release();
  });
}

void gpumem_kv_destroy(gpumem_kv_cache* cache) {
  if (cache == nullptr) return;
  // Destructors never throw; the cache goes before the host pool it hands blocks back to.
  cache->cache.reset();
  delete cache;
}

gpumem_status gpumem_kv_check_layout(gpumem_kv_cache* cache, const gpumem_kv_layout* model) {
  constexpr const char* where = "gpumem_kv_check_layout";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(model != nullptr, where, "null layout");
  return guarded(where, [&] {
    const gpumem::kv_layout& l = cache->cache->layout();
    std::string diff;
    auto field = [&](const char* name, std::uint64_t cache_value, std::uint64_t model_value) {
      if (cache_value == model_value) return;
      diff += (diff.empty() ? "" : ", ") + std::string(name) + " " +
              std::to_string(model_value) + " (the cache has " + std::to_string(cache_value) +
              ")";
    };
    field("layers", l.layers, model->layers);
    field("kv_heads", l.kv_heads, model->kv_heads);
    field("head_dim", l.head_dim, model->head_dim);
    if (from_dtype(l.dtype) != model->dtype) {
      const std::string model_dtype =
          model->dtype >= GPUMEM_KV_FP8 && model->dtype <= GPUMEM_KV_F32
              ? std::string(gpumem::kv_dtype_name(to_dtype(model->dtype, where)))
              : "unknown (" + std::to_string(model->dtype) + ")";
      diff += (diff.empty() ? "" : ", ") + std::string("dtype ") + model_dtype +
              " (the cache has " + std::string(gpumem::kv_dtype_name(l.dtype)) + ")";
    }
    if (!diff.empty())
      throw gpumem::invalid_argument("the model's KV layout does not match the cache's: " + diff);
  });
}

gpumem_status gpumem_kv_add_sequence(gpumem_kv_cache* cache, const int32_t* tokens,
                                     size_t count, uint64_t salt, uint64_t* seq,
                                     uint64_t* cached_tokens) {
  constexpr const char* where = "gpumem_kv_add_sequence";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(seq != nullptr, where, "null output pointer");
  GPUMEM_KV_REQUIRE(tokens != nullptr || count == 0, where, "null tokens with a count");
  return guarded(where, [&] {
    const auto a =
        cache->cache->add_sequence(token_span(*cache->cache, tokens, count, "add_sequence"), salt);
    *seq = a.id;
    if (cached_tokens != nullptr) *cached_tokens = a.cached_tokens;
  });
}

gpumem_status gpumem_kv_append(gpumem_kv_cache* cache, uint64_t seq, const int32_t* tokens,
                               size_t count) {
  constexpr const char* where = "gpumem_kv_append";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(tokens != nullptr || count == 0, where, "null tokens with a count");
  return guarded(where, [&] {
    cache->cache->append(seq, token_span(*cache->cache, tokens, count, "append"));
  });
}

gpumem_status gpumem_kv_append_each(gpumem_kv_cache* cache, const uint64_t* seqs,
                                    const int32_t* tokens, size_t count, size_t* done) {
  constexpr const char* where = "gpumem_kv_append_each";
  if (done != nullptr) *done = 0;
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE((seqs != nullptr && tokens != nullptr) || count == 0, where,
                    "null sequences or tokens with a count");
  std::size_t i = 0;
  const gpumem_status st = guarded(where, [&] {
    require_buffer(seqs, count, sizeof(std::uint64_t), "sequences");
    require_buffer(tokens, count, sizeof(std::int32_t), "tokens");
    for (; i < count; ++i)
      cache->cache->append(seqs[i], std::span<const gpumem::token_id>(
                                        reinterpret_cast<const gpumem::token_id*>(tokens + i), 1));
  });
  if (done != nullptr) *done = i;
  return st;
}

gpumem_status gpumem_kv_fork(gpumem_kv_cache* cache, uint64_t seq, uint64_t* child) {
  constexpr const char* where = "gpumem_kv_fork";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(child != nullptr, where, "null output pointer");
  return guarded(where, [&] { *child = cache->cache->fork(seq); });
}

gpumem_status gpumem_kv_free(gpumem_kv_cache* cache, uint64_t seq) {
  constexpr const char* where = "gpumem_kv_free";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  return guarded(where, [&] { cache->cache->free(seq); });
}

gpumem_status gpumem_kv_swap_out(gpumem_kv_cache* cache, uint64_t seq) {
  constexpr const char* where = "gpumem_kv_swap_out";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  return guarded(where, [&] { cache->cache->swap_out(seq); });
}

gpumem_status gpumem_kv_swap_in(gpumem_kv_cache* cache, uint64_t seq) {
  constexpr const char* where = "gpumem_kv_swap_in";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  return guarded(where, [&] { cache->cache->swap_in(seq); });
}

gpumem_status gpumem_kv_block_table(gpumem_kv_cache* cache, uint64_t seq, uint32_t* out,
                                    size_t capacity, size_t* count) {
  constexpr const char* where = "gpumem_kv_block_table";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(count != nullptr, where, "null count pointer");
  return guarded(where, [&] {
    const auto table = cache->cache->block_table(seq);
    if (out != nullptr && capacity < table.size())
      throw gpumem::invalid_argument("sequence " + std::to_string(seq) + " has " +
                                     std::to_string(table.size()) + " blocks; the buffer holds " +
                                     std::to_string(capacity));
    *count = table.size();
    if (out != nullptr) std::copy(table.begin(), table.end(), out);
  });
}

gpumem_status gpumem_kv_block_tables(gpumem_kv_cache* cache, const uint64_t* seqs, size_t count,
                                     uint32_t* out, size_t row_blocks, uint32_t pad,
                                     uint64_t* lengths) {
  constexpr const char* where = "gpumem_kv_block_tables";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE((seqs != nullptr && out != nullptr) || count == 0, where,
                    "null sequences or output with a count");
  return guarded(where, [&] {
    require_buffer(seqs, count, sizeof(std::uint64_t), "sequences");
    if (count != 0 && row_blocks > SIZE_MAX / count)
      throw gpumem::invalid_argument(std::to_string(count) + " rows of " +
                                     std::to_string(row_blocks) +
                                     " blocks name no buffer that can exist (the product "
                                     "overflows)");
    require_buffer(out, count * row_blocks, sizeof(std::uint32_t), "rows");
    if (lengths != nullptr) require_buffer(lengths, count, sizeof(std::uint64_t), "lengths");
    // Read every table first: a refusal writes nothing.
    std::vector<std::vector<gpumem::kv_cache::block_id>> tables(count);
    std::vector<std::uint64_t> tokens(count);
    for (std::size_t i = 0; i < count; ++i) {
      tables[i] = cache->cache->block_table(seqs[i]);
      tokens[i] = cache->cache->sequence_tokens(seqs[i]);
      if (std::find(tables[i].begin(), tables[i].end(), gpumem::kv_cache::not_resident) !=
          tables[i].end())
        throw gpumem::invalid_argument("sequence " + std::to_string(seqs[i]) +
                                       " is swapped out (swap_in first)");
      if (tables[i].size() > row_blocks)
        throw gpumem::invalid_argument("sequence " + std::to_string(seqs[i]) + " has " +
                                       std::to_string(tables[i].size()) +
                                       " blocks; a row holds " + std::to_string(row_blocks));
    }
    for (std::size_t i = 0; i < count; ++i) {
      uint32_t* row = out + i * row_blocks;
      std::copy(tables[i].begin(), tables[i].end(), row);
      std::fill(row + tables[i].size(), row + row_blocks, pad);
      if (lengths != nullptr) lengths[i] = tokens[i];
    }
  });
}

gpumem_status gpumem_kv_sequence_tokens(gpumem_kv_cache* cache, uint64_t seq, uint64_t* tokens) {
  constexpr const char* where = "gpumem_kv_sequence_tokens";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(tokens != nullptr, where, "null output pointer");
  return guarded(where, [&] { *tokens = cache->cache->sequence_tokens(seq); });
}

gpumem_status gpumem_kv_is_swapped(gpumem_kv_cache* cache, uint64_t seq, int32_t* swapped) {
  constexpr const char* where = "gpumem_kv_is_swapped";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(swapped != nullptr, where, "null output pointer");
  return guarded(where, [&] { *swapped = cache->cache->is_swapped(seq) ? 1 : 0; });
}

gpumem_status gpumem_kv_blocks_needed(gpumem_kv_cache* cache, uint64_t seq, uint64_t tokens,
                                      uint64_t* blocks) {
  constexpr const char* where = "gpumem_kv_blocks_needed";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(blocks != nullptr, where, "null output pointer");
  return guarded(where, [&] { *blocks = cache->cache->blocks_needed(seq, tokens); });
}

gpumem_status gpumem_kv_available_blocks(gpumem_kv_cache* cache, uint64_t* blocks) {
  constexpr const char* where = "gpumem_kv_available_blocks";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(blocks != nullptr, where, "null output pointer");
  return guarded(where, [&] { *blocks = cache->cache->available_blocks(); });
}

gpumem_status gpumem_kv_evict(gpumem_kv_cache* cache, uint64_t blocks, uint64_t* evicted) {
  constexpr const char* where = "gpumem_kv_evict";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  return guarded(where, [&] {
    const std::size_t n = cache->cache->evict(blocks);
    if (evicted != nullptr) *evicted = n;
  });
}

gpumem_status gpumem_kv_shrink(gpumem_kv_cache* cache, uint64_t keep_free, int32_t drop_cached,
                               uint64_t* pages) {
  constexpr const char* where = "gpumem_kv_shrink";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  return guarded(where, [&] {
    const std::size_t n = cache->cache->shrink(keep_free, drop_cached != 0);
    if (pages != nullptr) *pages = n;
  });
}

gpumem_status gpumem_kv_stats_get(gpumem_kv_cache* cache, gpumem_kv_stats* out) {
  constexpr const char* where = "gpumem_kv_stats_get";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(out != nullptr, where, "null output pointer");
  return guarded(where, [&] {
    const gpumem::kv_cache_stats s = cache->cache->stats();
    gpumem_kv_stats r{};
    r.capacity_blocks = s.capacity_blocks;
    r.used_blocks = s.used_blocks;
    r.cached_blocks = s.cached_blocks;
    r.free_blocks = s.free_blocks;
    r.filled_slots = s.filled_slots;
    r.sequences = s.sequences;
    r.swapped_sequences = s.swapped_sequences;
    r.mapped_bytes = s.mapped_bytes;
    r.block_bytes = cache->cache->layout().block_stride();
    r.block_allocations = s.block_allocations;
    r.block_releases = s.block_releases;
    r.prefix_queries = s.prefix_queries;
    r.prefix_hits = s.prefix_hits;
    r.evictions = s.evictions;
    r.cow_copies = s.cow_copies;
    r.blocks_scrubbed = s.blocks_scrubbed;
    r.swaps_out = s.swaps_out;
    r.swaps_in = s.swaps_in;
    r.bytes_swapped_out = s.bytes_swapped_out;
    r.bytes_swapped_in = s.bytes_swapped_in;
    r.waste_fraction = s.waste_fraction(cache->cache->layout().block_tokens);
    *out = r;
  });
}

gpumem_status gpumem_kv_storage_get(gpumem_kv_cache* cache, gpumem_kv_storage* out) {
  constexpr const char* where = "gpumem_kv_storage_get";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  GPUMEM_KV_REQUIRE(out != nullptr, where, "null output pointer");
  return guarded(where, [&] {
    const gpumem::kv_layout& l = cache->cache->layout();
    gpumem_kv_storage s{};
    s.base = cache->cache->base();
    s.max_blocks = cache->cache->max_blocks();
    s.capacity_blocks = cache->cache->stats().capacity_blocks;
    s.block_stride = l.block_stride();
    s.layer_stride = l.layer_stride();
    s.kv_stride = l.kv_stride();
    s.token_stride = l.token_stride();
    s.head_stride = l.head_stride();
    s.dtype_bytes = l.dtype_bytes();
    s.layout = to_c(l);
    *out = s;
  });
}

gpumem_status gpumem_kv_synchronize(gpumem_kv_cache* cache) {
  constexpr const char* where = "gpumem_kv_synchronize";
  GPUMEM_KV_REQUIRE(cache != nullptr, where, "null cache handle");
  return guarded(where, [&] {
    const gpumem::stream_handle s{reinterpret_cast<std::uintptr_t>(cache->stream)};
    if (auto st = cache->platform->stream_synchronize(s); !st)
      gpumem::throw_cuda_error(st, "gpumem_kv_synchronize");
  });
}

size_t gpumem_kv_validate(gpumem_kv_cache* cache, char* buf, size_t capacity) {
  std::string text;
  if (cache == nullptr) {
    refuse("gpumem_kv_validate", "null cache handle");
    text = "null cache handle";
  } else if (guarded("gpumem_kv_validate", [&] { text = cache->cache->validate(); }) !=
             GPUMEM_SUCCESS) {
    text = gpumem_last_error();
  }
  return copy_text(text, buf, capacity);
}

gpumem_status gpumem_kv_vseqs_create(gpumem_pool* pool, const gpumem_kv_layout* layout,
                                     uint64_t max_sequence_tokens, void* stream,
                                     gpumem_kv_vseqs** out) {
  constexpr const char* where = "gpumem_kv_vseqs_create";
  GPUMEM_KV_REQUIRE(out != nullptr, where, "null output pointer");
  *out = nullptr;
  GPUMEM_KV_REQUIRE(layout != nullptr, where, "null layout");
  const gpumem::detail::c_api_pool_parts parts = gpumem::detail::c_api_pool(pool, where);
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded(where, [&] {
    gpumem::detail::require_device_stream(*parts.device_platform, parts.device,
                                          reinterpret_cast<std::uintptr_t>(stream),
                                          "no sequence set was made");
    if (layout->reserved != 0)
      throw gpumem::invalid_argument("the layout's reserved field must be 0");
    gpumem::kv_layout l;
    l.layers = layout->layers;
    l.kv_heads = layout->kv_heads;
    l.head_dim = layout->head_dim;
    l.block_tokens = layout->block_tokens;
    l.dtype = to_dtype(layout->dtype, where);
    gpumem::vmm_page_pool* pages =
        &gpumem::detail::c_api_current_page_pool(parts, "virtually contiguous sequences need");
    auto handle = std::make_unique<gpumem_kv_vseqs>(parts.borrowers->kv_vseqs);
    handle->seqs = std::make_unique<gpumem::kv_virtual_sequences>(
        *pages, l, max_sequence_tokens,
        gpumem::stream_handle{reinterpret_cast<std::uintptr_t>(stream)});
    *out = handle.release();
  });
}

void gpumem_kv_vseqs_destroy(gpumem_kv_vseqs* vseqs) { delete vseqs; }

gpumem_status gpumem_kv_vseqs_add(gpumem_kv_vseqs* vseqs, uint64_t tokens, uint64_t* seq) {
  constexpr const char* where = "gpumem_kv_vseqs_add";
  GPUMEM_KV_REQUIRE(vseqs != nullptr, where, "null handle");
  GPUMEM_KV_REQUIRE(seq != nullptr, where, "null output pointer");
  return guarded(where, [&] { *seq = vseqs->seqs->add(tokens); });
}

gpumem_status gpumem_kv_vseqs_append(gpumem_kv_vseqs* vseqs, uint64_t seq, uint64_t tokens) {
  constexpr const char* where = "gpumem_kv_vseqs_append";
  GPUMEM_KV_REQUIRE(vseqs != nullptr, where, "null handle");
  return guarded(where, [&] { vseqs->seqs->append(seq, tokens); });
}

gpumem_status gpumem_kv_vseqs_free(gpumem_kv_vseqs* vseqs, uint64_t seq) {
  constexpr const char* where = "gpumem_kv_vseqs_free";
  GPUMEM_KV_REQUIRE(vseqs != nullptr, where, "null handle");
  return guarded(where, [&] { vseqs->seqs->free(seq); });
}

gpumem_status gpumem_kv_vseqs_sequence(gpumem_kv_vseqs* vseqs, uint64_t seq, uint64_t* base,
                                       uint64_t* tokens) {
  constexpr const char* where = "gpumem_kv_vseqs_sequence";
  GPUMEM_KV_REQUIRE(vseqs != nullptr, where, "null handle");
  return guarded(where, [&] {
    const std::uint64_t b = vseqs->seqs->base(seq);
    const std::uint64_t t = vseqs->seqs->tokens(seq);
    if (base != nullptr) *base = b;
    if (tokens != nullptr) *tokens = t;
  });
}

gpumem_status gpumem_kv_vseqs_info_get(gpumem_kv_vseqs* vseqs, gpumem_kv_vseqs_info* out) {
  constexpr const char* where = "gpumem_kv_vseqs_info_get";
  GPUMEM_KV_REQUIRE(vseqs != nullptr, where, "null handle");
  GPUMEM_KV_REQUIRE(out != nullptr, where, "null output pointer");
  return guarded(where, [&] {
    const gpumem::kv_virtual_sequences& v = *vseqs->seqs;
    const gpumem::kv_layout& l = v.layout();
    gpumem_kv_vseqs_info i{};
    i.sequences = v.sequences();
    i.mapped_bytes = v.mapped_bytes();
    i.live_bytes = v.live_bytes();
    i.max_sequence_tokens = v.max_sequence_tokens();
    i.page_size = v.page_size();
    i.token_stride = v.token_stride();
    i.kv_stride = l.kv_heads * l.head_dim * l.dtype_bytes();
    i.layer_stride = 2 * i.kv_stride;
    i.head_stride = l.head_dim * l.dtype_bytes();
    i.dtype_bytes = l.dtype_bytes();
    *out = i;
  });
}

size_t gpumem_kv_vseqs_validate(gpumem_kv_vseqs* vseqs, char* buf, size_t capacity) {
  std::string text;
  if (vseqs == nullptr) {
    refuse("gpumem_kv_vseqs_validate", "null handle");
    text = "null handle";
  } else if (guarded("gpumem_kv_vseqs_validate", [&] { text = vseqs->seqs->validate(); }) !=
             GPUMEM_SUCCESS) {
    text = gpumem_last_error();
  }
  return copy_text(text, buf, capacity);
}

}  // extern "C"
