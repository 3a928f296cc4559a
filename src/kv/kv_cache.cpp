#include "gpumem/kv/kv_cache.hpp"

#include <algorithm>
#include <sstream>

#include "gpumem/errors.hpp"
#include "gpumem/platform/status_error.hpp"

namespace gpumem {

namespace {

std::size_t checked_max_blocks(const vmm_page_pool& pages, const kv_cache_config& c) {
  if (auto why = c.layout.validate(); !why.empty()) throw invalid_argument("kv_cache: " + why);
  if (c.max_blocks != 0) return c.max_blocks;
  return std::max<std::size_t>(1, pages.device_total_bytes() / c.layout.block_stride());
}

// Never overflows (a + b - 1 would for a near SIZE_MAX).
std::size_t ceil_div(std::size_t a, std::size_t b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace

kv_cache::kv_cache(vmm_page_pool& pages, kv_cache_config config, pinned_host_pool* host)
    : config_(config),
      pages_(pages),
      host_(host),
      storage_(pages, config.layout.block_stride(), checked_max_blocks(pages, config),
               config.grow_pages, config.stream) {
  config_.max_blocks = storage_.max_blocks();
  if (config.initial_blocks > config_.max_blocks)
    throw invalid_argument("kv_cache: initial_blocks " + std::to_string(config.initial_blocks) +
                           " exceeds max_blocks " + std::to_string(config_.max_blocks));
  if (!storage_.grow_to(config.initial_blocks))
    throw out_of_memory("gpumem: kv_cache could not map its " +
                        std::to_string(config.initial_blocks) + " initial blocks of " +
                        format_bytes(storage_.block_bytes()) + "\n" +
                        pages.memory_report(config.initial_blocks * storage_.block_bytes()));
  meta_.resize(storage_.capacity_blocks());
  tokens_.resize(meta_.size() * config_.layout.block_tokens);
  if (config_.tiers != nullptr && !config_.prefix_caching)
    throw invalid_argument("kv_cache: tiers need prefix_caching (blocks are found by prefix hash)");
  if (config_.tiers != nullptr) space_ = layout_space(config_.layout, config_.tiers->options().space);
}

kv_cache::~kv_cache() {
  // Write-back copies may still read blocks on the stream: done before the pages go.
  if (config_.tiers != nullptr) (void)pages_.device_platform().stream_synchronize(config_.stream);
  for (auto& [id, s] : sequences_) {
    if (s.host == nullptr) continue;
    try {
      host_->deallocate(s.host, s.host_bytes, config_.stream);
    } catch (...) {
      // Destructors never throw.
    }
  }
  // storage_ unmaps every page and returns it to the pool.
}

// --- lookups and bookkeeping ---------------------------------------------------------------

kv_cache::sequence& kv_cache::find_locked(sequence_id id, const char* what) {
  return const_cast<sequence&>(std::as_const(*this).find_locked(id, what));
}

const kv_cache::sequence& kv_cache::find_locked(sequence_id id, const char* what) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    throw invalid_argument(std::string("kv_cache::") + what + ": sequence " + std::to_string(id) +
                           (id != 0 && id < next_id_ ? " was freed" : " does not exist"));
  return it->second;
}

std::size_t kv_cache::sequence_token_limit() const noexcept {
  // max_blocks <= 2^31 and block_tokens <= 2^16 (kv_block_storage, kv_layout): no overflow.
  const std::size_t capacity = storage_.max_blocks() * config_.layout.block_tokens;
  return config_.max_sequence_tokens != 0 ? std::min(capacity, config_.max_sequence_tokens)
                                          : capacity;
}

void kv_cache::check_token_count(std::size_t have, std::size_t more, const char* what,
                                 sequence_id id) const {
  // REQUIRES have <= limit (every sequence is within it), so limit - have cannot wrap.
  const std::size_t limit = sequence_token_limit();
  if (more <= limit - have) return;
  const bool by_cap = config_.max_sequence_tokens != 0 && limit == config_.max_sequence_tokens;
  std::string text = std::string("kv_cache::") + what + ": ";
  if (id != 0)
    text += "sequence " + std::to_string(id) + " has " + std::to_string(have) + " tokens; " +
            std::to_string(more) + " more";
  else
    text += std::to_string(more) + " tokens";
  if (by_cap)
    text += " exceed max_sequence_tokens " + std::to_string(limit);
  else
    text += " exceed the cache's capacity of " + std::to_string(limit) + " tokens (" +
            std::to_string(storage_.max_blocks()) + " max_blocks of " +
            std::to_string(config_.layout.block_tokens) + " tokens)";
  throw invalid_argument(text);
}

void kv_cache::lru_push(block_id b) {
  block_meta& m = meta_[b];
  m.lru_prev = lru_tail_;
  m.lru_next = no_block;
  if (lru_tail_ != no_block) meta_[lru_tail_].lru_next = b;
  else lru_head_ = b;
  lru_tail_ = b;
  ++cached_;
}

void kv_cache::lru_remove(block_id b) {
  block_meta& m = meta_[b];
  if (m.lru_prev != no_block) meta_[m.lru_prev].lru_next = m.lru_next;
  else lru_head_ = m.lru_next;
  if (m.lru_next != no_block) meta_[m.lru_next].lru_prev = m.lru_prev;
  else lru_tail_ = m.lru_prev;
  m.lru_prev = m.lru_next = no_block;
  --cached_;
}

void kv_cache::evict_one() {
  const block_id b = lru_head_;
  lru_remove(b);
  block_meta& m = meta_[b];
  write_back(b);
  prefix_.erase(m.hash);
  m.hashed = false;
  m.filled = 0;
  return_to_storage(b);
  ++counters_.evictions;
  ++counters_.block_releases;
}

kv_cache::block_id kv_cache::take_block() {
  std::optional<block_id> b;
  if (storage_.free_blocks() == 0 && cached_ > 0) evict_one();
  b = storage_.try_allocate();
  if (!b) return no_block;
  if (*b >= meta_.size()) {
    meta_.resize(storage_.capacity_blocks());
    tokens_.resize(meta_.size() * config_.layout.block_tokens);
  }
  block_meta& m = meta_[*b];
  m = block_meta{};
  m.refs = 1;
  ++counters_.block_allocations;
  return *b;
}

void kv_cache::release_block(block_id b) {
  block_meta& m = meta_[b];
  if (--m.refs != 0) return;
  filled_in_use_ -= m.filled;
  if (m.hashed) {
    lru_push(b);
    return;
  }
  m.filled = 0;
  return_to_storage(b);
  ++counters_.block_releases;
}

void kv_cache::return_to_storage(block_id b) {
  if (config_.scrub) {
    if (!pages_.device_platform().memset_async(storage_.address(b), 0, storage_.block_bytes(),
                                               config_.stream)) {
      dirty_.push_back(b);
      return;
    }
    ++counters_.blocks_scrubbed;
  }
  storage_.free(b);
}

void kv_cache::register_full(block_id b, std::uint64_t parent, std::uint64_t salt,
                             std::span<const token_id> tokens, std::uint64_t& hash_out) {
  hash_out = prefix_block_hash(parent, salt, tokens);
  if (!config_.prefix_caching) return;
  // An equal block is already cached (two requests computed the same prefix): keep that
  // one as the name of the prefix; this block is freed with its sequence.
  if (!prefix_.emplace(hash_out, b).second) return;
  block_meta& m = meta_[b];
  m.hashed = true;
  m.hash = hash_out;
  m.parent = parent;
  m.salt = salt;
  std::copy(tokens.begin(), tokens.end(), tokens_.begin() + static_cast<std::ptrdiff_t>(
                                                              b * config_.layout.block_tokens));
}

std::size_t kv_cache::blocks_needed_locked(const sequence& s, std::size_t tokens) const {
  if (tokens == 0) return 0;
  const std::size_t bt = config_.layout.block_tokens;
  const std::size_t pos = s.tokens % bt;
  std::size_t need = 0, rest = tokens;
  if (pos != 0) {
    if (meta_[s.blocks.back()].refs > 1) need += 1;  // copy on write
    rest -= std::min(rest, bt - pos);
  }
  return need + ceil_div(rest, bt);
}

std::size_t kv_cache::available_locked() const {
  return storage_.free_blocks() + cached_ + storage_.growable_blocks();
}

void kv_cache::throw_out_of_blocks(std::size_t wanted, const char* what) const {
  const resource_stats ps = pages_.stats();
  std::ostringstream r;
  r << "gpumem: KV cache out of blocks: " << what << " needs " << wanted << " block(s) of "
    << format_bytes(storage_.block_bytes()) << ".\n"
    << "  cache: " << storage_.capacity_blocks() << " blocks mapped ("
    << format_bytes(storage_.mapped_bytes()) << "), " << storage_.used_blocks() - cached_
    << " used by " << sequences_.size() << " sequence(s), " << cached_
    << " cached for prefix reuse, " << storage_.free_blocks() << " free; "
    << storage_.growable_blocks() << " more mappable under the cap of "
    << storage_.max_blocks() << " blocks\n"
    << "  page pool ('" << pages_.name() << "'): " << format_bytes(ps.reserved_bytes)
    << " reserved, " << format_bytes(ps.live_bytes) << " live, "
    << format_bytes(ps.cached_bytes) << " cached";
  if (pages_.options().limit_bytes != 0) r << ", limit " << format_bytes(pages_.options().limit_bytes);
  r << "\n";
  auto info = pages_.device_platform().mem_info(pages_.device());
  if (info)
    r << "  device: " << format_bytes(info.value().total) << " total, "
      << format_bytes(info.value().free) << " free\n";
  throw out_of_memory(r.str());
}

// Capacity is secured before an operation changes anything, so it never fails halfway:
// grow by the blocks free and cached ones cannot cover (growing before evicting keeps the
// prefix cache warm while the budget allows), and refuse when even eviction cannot cover
// the rest. protected_cached: cached blocks the operation itself is about to reuse.
void kv_cache::scrub_dirty() {
  while (!dirty_.empty()) {  // blocks whose scrub failed earlier: zero them first
    const block_id b = dirty_.back();
    if (auto st = pages_.device_platform().memset_async(storage_.address(b), 0,
                                                        storage_.block_bytes(), config_.stream);
        !st)
      throw_cuda_error(st, "kv_cache: scrub a released block");
    dirty_.pop_back();
    ++counters_.blocks_scrubbed;
    storage_.free(b);
  }
}

void kv_cache::ensure_available(std::size_t need, std::size_t protected_cached,
                                const char* what) {
  scrub_dirty();
  if (storage_.free_blocks() < need) {
    const std::size_t grow = std::min(need - storage_.free_blocks(), storage_.growable_blocks());
    if (grow > 0) (void)storage_.grow_to(storage_.capacity_blocks() + grow);
    if (storage_.capacity_blocks() > meta_.size()) {
      meta_.resize(storage_.capacity_blocks());
      tokens_.resize(meta_.size() * config_.layout.block_tokens);
    }
  }
  if (storage_.free_blocks() + (cached_ - protected_cached) < need) throw_out_of_blocks(need, what);
}

// --- operations ------------------------------------------------------------------------

void kv_cache::append_locked(sequence& s, std::span<const token_id> tokens) {
  const std::size_t bt = config_.layout.block_tokens;
  std::size_t i = 0;
  while (i < tokens.size()) {
    const std::size_t pos = s.tokens % bt;
    block_id b;
    if (pos == 0) {
      b = take_block();
      s.blocks.push_back(b);
    } else {
      b = s.blocks.back();
      if (meta_[b].refs > 1) {
        // Copy on write: this sequence gets its own copy of the shared, partly filled block.
        const block_id copy = take_block();
        if (auto st = pages_.device_platform().memcpy_async(
                storage_.address(copy), storage_.address(b), storage_.block_bytes(),
                config_.stream);
            !st) {
          release_block(copy);
          throw_cuda_error(st, "kv_cache: copy on write");
        }
        meta_[copy].filled = meta_[b].filled;
        filled_in_use_ += meta_[copy].filled;
        release_block(b);
        s.blocks.back() = copy;
        b = copy;
        ++counters_.cow_copies;
      }
    }
    const std::size_t n = std::min(bt - pos, tokens.size() - i);
    s.tail.insert(s.tail.end(), tokens.begin() + static_cast<std::ptrdiff_t>(i),
                  tokens.begin() + static_cast<std::ptrdiff_t>(i + n));
    meta_[b].filled += static_cast<std::uint32_t>(n);
    filled_in_use_ += n;
    s.tokens += n;
    i += n;
    if (s.tokens % bt == 0) {
      std::uint64_t h = 0;
      register_full(b, s.full_hashes.empty() ? 0 : s.full_hashes.back(), s.salt, s.tail, h);
      s.full_hashes.push_back(h);
      s.tail.clear();
    }
  }
}

kv_cache::admission kv_cache::add_sequence(std::span<const token_id> prompt, std::uint64_t salt) {
  check_token_count(0, prompt.size(), "add_sequence");
  std::lock_guard lock(mutex_);
  const std::size_t bt = config_.layout.block_tokens;
  const std::size_t max_hits = prompt.empty() ? 0 : (prompt.size() - 1) / bt;
  // Leading full blocks already cached, confirmed token by token.
  std::vector<block_id> hits;
  std::vector<std::uint64_t> hashes;
  std::size_t protected_cached = 0;
  if (config_.prefix_caching) {
    std::uint64_t parent = 0;
    for (std::size_t i = 0; i < max_hits; ++i) {
      auto block = prompt.subspan(i * bt, bt);
      const std::uint64_t h = prefix_block_hash(parent, salt, block);
      auto it = prefix_.find(h);
      if (it == prefix_.end()) break;
      const block_meta& m = meta_[it->second];
      auto stored = tokens_.begin() + static_cast<std::ptrdiff_t>(it->second * bt);
      if (m.parent != parent || m.salt != salt || !std::equal(block.begin(), block.end(), stored))
        break;
      hits.push_back(it->second);
      hashes.push_back(h);
      protected_cached += m.refs == 0 ? 1 : 0;
      parent = h;
    }
    counters_.prefix_queries += max_hits;
    counters_.prefix_hits += hits.size();
  }
  // Blocks from the tiers need fresh blocks too: capacity first, so a prompt that cannot
  // be admitted now costs no lookup.
  const std::size_t need = ceil_div(prompt.size(), bt) - hits.size();
  ensure_available(need, protected_cached, "add_sequence");
  // The GPU missed: the next blocks from the tiers, in one batch. The staging buffers go
  // back on every path out, after the copies out of them (stream order).
  kv_tiers::fetched found;
  struct release_found {
    kv_tiers* tiers;
    kv_tiers::fetched& f;
    stream_handle stream;
    ~release_found() {
      if (tiers != nullptr) tiers->release(f, stream);
    }
  } releaser{config_.tiers, found, config_.stream};
  std::size_t from_tiers = 0;
  if (config_.tiers != nullptr && hits.size() < max_hits)
    from_tiers = lookup_tiers(prompt, salt, hits.size(), max_hits,
                              hashes.empty() ? 0 : hashes.back(), found);

  const sequence_id id = next_id_;
  sequence& s = sequences_[id];
  ++next_id_;
  s.salt = salt;
  for (block_id b : hits) {
    block_meta& m = meta_[b];
    if (m.refs == 0) {
      lru_remove(b);
      filled_in_use_ += m.filled;
    }
    ++m.refs;
  }
  s.blocks = hits;
  s.full_hashes = std::move(hashes);
  s.tokens = hits.size() * bt;
  if (from_tiers > 0) from_tiers = adopt_tier_blocks(s, found, from_tiers);
  append_locked(s, prompt.subspan(s.tokens));
  return {id, (hits.size() + from_tiers) * bt};
}

void kv_cache::append(sequence_id id, std::span<const token_id> tokens) {
  std::lock_guard lock(mutex_);
  sequence& s = find_locked(id, "append");
  if (s.swapped)
    throw invalid_argument("kv_cache::append: sequence " + std::to_string(id) +
                           " is swapped out (swap_in first)");
  check_token_count(s.tokens, tokens.size(), "append", id);
  ensure_available(blocks_needed_locked(s, tokens.size()), 0, "append");
  append_locked(s, tokens);
}

kv_cache::sequence_id kv_cache::fork(sequence_id id) {
  std::lock_guard lock(mutex_);
  const sequence& parent = find_locked(id, "fork");
  if (parent.swapped)
    throw invalid_argument("kv_cache::fork: sequence " + std::to_string(id) + " is swapped out");
  sequence child = parent;
  for (block_id b : child.blocks) ++meta_[b].refs;
  const sequence_id child_id = next_id_++;
  sequences_.emplace(child_id, std::move(child));
  return child_id;
}

void kv_cache::free(sequence_id id) {
  std::lock_guard lock(mutex_);
  sequence& s = find_locked(id, "free");
  if (s.host != nullptr) host_->deallocate(s.host, s.host_bytes, config_.stream);
  // Last blocks first: pushed first onto the LRU, they are evicted first (a prompt's
  // head is the part most likely shared).
  for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it)
    if (*it != not_resident) release_block(*it);
  sequences_.erase(id);
}

void kv_cache::swap_out(sequence_id id) {
  std::lock_guard lock(mutex_);
  sequence& s = find_locked(id, "swap_out");
  if (host_ == nullptr)
    throw invalid_argument("kv_cache::swap_out: the cache has no pinned host pool for swap");
  if (s.swapped)
    throw invalid_argument("kv_cache::swap_out: sequence " + std::to_string(id) +
                           " is already swapped out");
  // Only blocks this sequence alone holds move: a shared block stays resident (freeing
  // this reference would free no memory) and is still named by the table.
  std::vector<std::size_t> moving;
  for (std::size_t i = 0; i < s.blocks.size(); ++i)
    if (meta_[s.blocks[i]].refs == 1) moving.push_back(i);
  const std::size_t bs = storage_.block_bytes();
  const std::size_t bytes = moving.size() * bs;
  std::byte* host = nullptr;
  if (bytes != 0) {
    host = static_cast<std::byte*>(host_->allocate(bytes, config_.stream));
    platform& p = pages_.device_platform();
    // One copy per run of positions whose block ids are consecutive too.
    for (std::size_t k = 0; k < moving.size();) {
      std::size_t run = 1;
      while (k + run < moving.size() && moving[k + run] == moving[k] + run &&
             s.blocks[moving[k + run]] == s.blocks[moving[k]] + run)
        ++run;
      if (auto st = p.memcpy_async(host + k * bs, storage_.address(s.blocks[moving[k]]),
                                   run * bs, config_.stream);
          !st) {
        host_->deallocate(host, bytes, config_.stream);
        throw_cuda_error(st, "kv_cache: swap out");
      }
      k += run;
    }
  }
  for (auto it = moving.rbegin(); it != moving.rend(); ++it) {
    release_block(s.blocks[*it]);
    s.blocks[*it] = not_resident;
  }
  s.host = host;
  s.host_bytes = bytes;
  s.swapped = true;
  ++counters_.swaps_out;
  counters_.bytes_swapped_out += bytes;
}

void kv_cache::swap_in(sequence_id id) {
  std::lock_guard lock(mutex_);
  sequence& s = find_locked(id, "swap_in");
  if (!s.swapped)
    throw invalid_argument("kv_cache::swap_in: sequence " + std::to_string(id) +
                           " is not swapped out");
  const std::size_t bt = config_.layout.block_tokens;
  std::vector<std::size_t> moving;
  for (std::size_t i = 0; i < s.blocks.size(); ++i)
    if (s.blocks[i] == not_resident) moving.push_back(i);
  ensure_available(moving.size(), 0, "swap_in");
  std::vector<block_id> blocks;
  blocks.reserve(moving.size());
  for (std::size_t k = 0; k < moving.size(); ++k) blocks.push_back(take_block());
  const std::size_t bs = storage_.block_bytes();
  platform& p = pages_.device_platform();
  auto* host = static_cast<std::byte*>(s.host);
  for (std::size_t k = 0; k < moving.size();) {
    std::size_t run = 1;
    while (k + run < moving.size() && blocks[k + run] == blocks[k] + run) ++run;
    if (auto st = p.memcpy_async(storage_.address(blocks[k]), host + k * bs, run * bs,
                                 config_.stream);
        !st) {
      for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) release_block(*b);
      throw_cuda_error(st, "kv_cache: swap in");
    }
    k += run;
  }
  for (std::size_t k = 0; k < moving.size(); ++k) {
    const std::size_t i = moving[k];
    const std::size_t filled = i + 1 < s.blocks.size() || s.tokens % bt == 0 ? bt : s.tokens % bt;
    meta_[blocks[k]].filled = static_cast<std::uint32_t>(filled);
    filled_in_use_ += filled;
    s.blocks[i] = blocks[k];
  }
  // The copies are queued on the stream; the pool reuses the host block in stream order.
  if (s.host != nullptr) host_->deallocate(s.host, s.host_bytes, config_.stream);
  counters_.bytes_swapped_in += s.host_bytes;
  s.host = nullptr;
  s.host_bytes = 0;
  s.swapped = false;
  ++counters_.swaps_in;
}

// --- queries and capacity --------------------------------------------------------------

std::vector<kv_cache::block_id> kv_cache::block_table(sequence_id id) const {
  std::lock_guard lock(mutex_);
  return find_locked(id, "block_table").blocks;
}

std::size_t kv_cache::sequence_tokens(sequence_id id) const {
  std::lock_guard lock(mutex_);
  return find_locked(id, "sequence_tokens").tokens;
}

bool kv_cache::is_swapped(sequence_id id) const {
  std::lock_guard lock(mutex_);
  return find_locked(id, "is_swapped").swapped;
}

std::size_t kv_cache::blocks_needed(sequence_id id, std::size_t tokens) const {
  std::lock_guard lock(mutex_);
  const sequence& s = find_locked(id, "blocks_needed");
  check_token_count(s.tokens, tokens, "blocks_needed", id);
  if (!s.swapped) return blocks_needed_locked(s, tokens);
  // Back in first, then the new tokens as if appended.
  const std::size_t bt = config_.layout.block_tokens;
  const auto away = static_cast<std::size_t>(std::count(s.blocks.begin(), s.blocks.end(), not_resident));
  return away + ceil_div(s.tokens + tokens, bt) - s.blocks.size();
}

std::size_t kv_cache::available_blocks() const {
  std::lock_guard lock(mutex_);
  return available_locked();
}

std::size_t kv_cache::evict(std::size_t blocks) {
  std::lock_guard lock(mutex_);
  std::size_t n = 0;
  for (; n < blocks && cached_ > 0; ++n) evict_one();
  return n;
}

std::size_t kv_cache::shrink(std::size_t keep_free, bool drop_cached) {
  std::lock_guard lock(mutex_);
  if (drop_cached)
    while (cached_ > 0) evict_one();
  scrub_dirty();
  return storage_.shrink(keep_free);
}

kv_cache_stats kv_cache::stats() const {
  std::lock_guard lock(mutex_);
  kv_cache_stats st = counters_;
  st.capacity_blocks = storage_.capacity_blocks();
  st.cached_blocks = cached_;
  st.used_blocks = storage_.used_blocks() - cached_ - dirty_.size();
  st.free_blocks = storage_.free_blocks();
  st.filled_slots = filled_in_use_;
  st.sequences = sequences_.size();
  for (auto& [id, s] : sequences_) st.swapped_sequences += s.swapped ? 1 : 0;
  st.mapped_bytes = storage_.mapped_bytes();
  return st;
}

std::string kv_cache::validate() const {
  std::lock_guard lock(mutex_);
  if (auto why = storage_.validate(); !why.empty()) return "storage: " + why;
  const std::size_t bt = config_.layout.block_tokens;
  std::vector<std::uint32_t> refs(meta_.size(), 0);
  for (auto& [id, s] : sequences_) {
    if (s.blocks.size() != ceil_div(s.tokens, bt)) return "a sequence's block count disagrees";
    if (!s.swapped && std::count(s.blocks.begin(), s.blocks.end(), not_resident) != 0)
      return "a resident sequence has a block swapped out";
    if (s.swapped && (s.host_bytes != storage_.block_bytes() *
                                          static_cast<std::size_t>(std::count(
                                              s.blocks.begin(), s.blocks.end(), not_resident))))
      return "a swapped sequence's host bytes disagree with its blocks away";
    if (s.full_hashes.size() != s.tokens / bt || s.tail.size() != s.tokens % bt)
      return "a sequence's hashes or tail disagree with its tokens";
    for (block_id b : s.blocks) {
      if (b == not_resident) continue;
      if (b >= meta_.size() || !storage_.is_used(b)) return "a sequence names an unused block";
      ++refs[b];
    }
  }
  std::size_t cached = 0, filled = 0;
  for (block_id b = 0; b < meta_.size(); ++b) {
    const block_meta& m = meta_[b];
    if (!storage_.is_used(b)) {
      if (refs[b] != 0) return "a free block is referenced";
      continue;
    }
    if (std::find(dirty_.begin(), dirty_.end(), b) != dirty_.end()) {
      if (refs[b] != 0 || m.hashed) return "a block waiting to be scrubbed is still held";
      continue;
    }
    if (m.refs != refs[b]) return "block " + std::to_string(b) + "'s reference count disagrees";
    if (m.refs == 0) {
      if (!m.hashed) return "an unreferenced used block is not cached";
      ++cached;
    } else {
      filled += m.filled;
    }
    if (m.filled > bt) return "a block holds more tokens than it has slots";
    if (m.hashed) {
      auto it = prefix_.find(m.hash);
      if (it == prefix_.end() || it->second != b) return "a hashed block is not in the prefix map";
    }
  }
  if (cached != cached_) return "cached block count disagrees";
  std::size_t lru = 0;
  for (block_id b = lru_head_; b != no_block; b = meta_[b].lru_next)
    if (++lru > cached_) return "the LRU list is longer than the cached count";
  if (lru != cached_) return "the LRU list disagrees with the cached count";
  if (filled != filled_in_use_) return "filled slot count disagrees";
  for (auto& [h, b] : prefix_)
    if (b >= meta_.size() || !meta_[b].hashed || meta_[b].hash != h)
      return "a prefix entry names a block not hashed under it";
  return {};
}

}  // namespace gpumem
