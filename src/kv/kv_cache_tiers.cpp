// kv_cache's side of the tiers below the GPU (kv/tier/kv_tiers.hpp): write-back of evicted
// blocks and the lookup of prompt blocks the GPU missed.
#include <algorithm>

#include "gpumem/kv/kv_cache.hpp"
#include "gpumem/kv/tier/kv_record.hpp"

namespace gpumem {

std::uint64_t kv_cache::layout_space(const kv_layout& l, std::uint64_t extra) noexcept {
  // Two caches share tier blocks only when their blocks have the same shape.
  std::uint64_t h = detail::mix64(extra ^ 0x6b76746965727331ull, l.layers + 1);
  h = detail::mix64(h ^ l.kv_heads, l.head_dim + 0x9e3779b97f4a7c15ull);
  h = detail::mix64(h ^ static_cast<std::uint64_t>(l.dtype), l.block_tokens + 0xc2b2ae3d27d4eb4full);
  return h;
}

void kv_cache::write_back(block_id b) noexcept {
  if (config_.tiers == nullptr) return;
  const block_meta& m = meta_[b];
  const std::size_t bt = config_.layout.block_tokens;
  const std::span<const token_id> toks(tokens_.data() + b * bt, bt);
  auto st = config_.tiers->stage({space_, m.salt, m.hash}, m.parent, toks, storage_.block_bytes(),
                                 config_.stream);
  if (!st) return;
  // Queued before the block can be reused or scrubbed on the same stream.
  if (!pages_.device_platform().memcpy_async(st->record + st->payload_offset, storage_.address(b),
                                             storage_.block_bytes(), config_.stream)) {
    config_.tiers->abandon(*st, config_.stream);
    return;
  }
  config_.tiers->commit(*st, config_.stream);
  ++counters_.writebacks;
}

std::size_t kv_cache::lookup_tiers(std::span<const token_id> prompt, std::uint64_t salt,
                                   std::size_t first, std::size_t last, std::uint64_t parent,
                                   kv_tiers::fetched& found) {
  const std::size_t bt = config_.layout.block_tokens;
  std::vector<kv_block_key> keys;
  keys.reserve(last - first);
  std::uint64_t p = parent;
  for (std::size_t i = first; i < last; ++i) {
    p = prefix_block_hash(p, salt, prompt.subspan(i * bt, bt));
    keys.push_back({space_, salt, p});
  }
  counters_.tier_lookups += keys.size();
  found = config_.tiers->fetch(keys, kv_record::size(bt, storage_.block_bytes()), config_.stream);
  // Confirmed like a GPU hit: the record's parent, salt and tokens are the prompt's.
  std::size_t n = 0;
  p = parent;
  for (; n < found.records.size(); ++n) {
    const std::span<const std::byte> rec(found.records[n], found.record_bytes);
    const kv_record_header h = kv_record::header(rec);
    const auto stored = kv_record::tokens(rec);
    const auto want = prompt.subspan((first + n) * bt, bt);
    if (h.parent != p || h.salt != salt || h.hash != keys[n].hash || stored.size() != bt ||
        !std::equal(want.begin(), want.end(), stored.begin()))
      break;
    p = keys[n].hash;
  }
  return n;
}

std::size_t kv_cache::adopt_tier_blocks(sequence& s, kv_tiers::fetched& found, std::size_t count) {
  const std::size_t bt = config_.layout.block_tokens;
  platform& plat = pages_.device_platform();
  std::size_t n = 0;
  for (; n < count; ++n) {
    const std::span<const std::byte> rec(found.records[n], found.record_bytes);
    const block_id b = take_block();
    if (b == no_block) break;
    const auto payload = kv_record::payload(rec);
    if (!plat.memcpy_async(storage_.address(b), payload.data(), storage_.block_bytes(),
                           config_.stream)) {
      release_block(b);
      break;  // the rest of the prompt is computed instead
    }
    meta_[b].filled = static_cast<std::uint32_t>(bt);
    filled_in_use_ += bt;
    std::uint64_t h = 0;
    register_full(b, s.full_hashes.empty() ? 0 : s.full_hashes.back(), s.salt,
                  kv_record::tokens(rec), h);
    s.blocks.push_back(b);
    s.full_hashes.push_back(h);
    s.tokens += bt;
  }
  counters_.tier_hits += n;
  config_.tiers->count_used(found, n);
  return n;
}

}  // namespace gpumem
