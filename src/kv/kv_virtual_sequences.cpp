#include "gpumem/kv/kv_virtual_sequences.hpp"

#include "gpumem/errors.hpp"
#include "gpumem/platform/status_error.hpp"

namespace gpumem {

kv_virtual_sequences::kv_virtual_sequences(vmm_page_pool& pages, kv_layout layout,
                                           std::size_t max_sequence_tokens,
                                           stream_handle stream)
    : pool_(pages),
      platform_(pages.device_platform()),
      device_(pages.device()),
      layout_(layout),
      max_tokens_(max_sequence_tokens),
      stream_(stream),
      page_(pages.page_size()) {
  constexpr std::size_t limit = std::size_t{1} << 16;
  if (layout.layers == 0 || layout.kv_heads == 0 || layout.head_dim == 0 ||
      layout.layers > limit || layout.kv_heads > limit || layout.head_dim > limit)
    throw invalid_argument("kv_virtual_sequences: layers, kv_heads and head_dim must be "
                           "between 1 and 65536");
  if (max_sequence_tokens == 0)
    throw invalid_argument("kv_virtual_sequences: max_sequence_tokens must be at least 1");
  const double range = static_cast<double>(max_sequence_tokens) *
                       static_cast<double>(layout_.bytes_per_token());
  if (range > static_cast<double>(pages.device_total_bytes()))
    throw invalid_argument("kv_virtual_sequences: " + std::to_string(max_sequence_tokens) +
                           " tokens of " + format_bytes(layout_.bytes_per_token()) +
                           " exceed the device's memory");
  range_bytes_ = (max_sequence_tokens * layout_.bytes_per_token() + page_ - 1) / page_ * page_;
}

kv_virtual_sequences::~kv_virtual_sequences() {
  // Never throws. The stream may still read the pages: let it finish first.
  (void)platform_.stream_synchronize(stream_);
  for (auto& [id, s] : sequences_) {
    unmap_from(s, 0);
    (void)platform_.free_range(s.base, range_bytes_);
  }
}

kv_virtual_sequences::sequence& kv_virtual_sequences::find_locked(sequence_id seq,
                                                                  const char* what) {
  return const_cast<sequence&>(std::as_const(*this).find_locked(seq, what));
}

const kv_virtual_sequences::sequence& kv_virtual_sequences::find_locked(sequence_id seq,
                                                                        const char* what) const {
  auto it = sequences_.find(seq);
  if (it == sequences_.end())
    throw invalid_argument(std::string("kv_virtual_sequences::") + what + ": sequence " +
                           std::to_string(seq) +
                           (seq != 0 && seq < next_id_ ? " was freed" : " does not exist"));
  return it->second;
}

void kv_virtual_sequences::unmap_from(sequence& s, std::size_t first) noexcept {
  std::vector<physical_handle> back;
  // From the top: a page whose unmap fails, and those below it, stay mapped and ours.
  while (s.pages.size() > first) {
    const std::size_t i = s.pages.size() - 1;
    if (!platform_.unmap(s.base + i * page_, page_)) break;
    back.push_back(s.pages[i]);
    s.pages.pop_back();
    --mapped_pages_;
  }
  try {
    pool_.return_pages(back);
  } catch (...) {
    // The handles are the pool's own: return_pages refuses none of them.
  }
}

void kv_virtual_sequences::grow_locked(sequence& s, std::size_t tokens) {
  const std::size_t need = (tokens * layout_.bytes_per_token() + page_ - 1) / page_;
  if (need <= s.pages.size()) return;
  const std::size_t have = s.pages.size();
  std::vector<physical_handle> lent = pool_.lend_pages(need - have);  // throws out_of_memory
  std::size_t mapped = 0;
  status failed;
  for (; mapped < lent.size(); ++mapped) {
    if (auto st = platform_.map(s.base + (have + mapped) * page_, page_, lent[mapped], 0); !st) {
      failed = st;
      break;
    }
  }
  if (failed.ok())
    failed = platform_.set_access(device_, s.base + have * page_, (need - have) * page_);
  if (!failed.ok()) {
    // Undo: the new mappings go, the handles go back to the pool.
    std::vector<physical_handle> back;
    std::size_t undone = mapped;
    while (undone > 0 && platform_.unmap(s.base + (have + undone - 1) * page_, page_)) --undone;
    for (std::size_t i = 0; i < undone; ++i) {
      s.pages.push_back(lent[i]);  // stuck mapped: kept (without access), unmapped at free
      ++mapped_pages_;
    }
    back.assign(lent.begin() + static_cast<std::ptrdiff_t>(undone), lent.end());
    pool_.return_pages(back);
    if (failed.kind == failure_kind::out_of_memory)
      throw out_of_memory("gpumem: kv_virtual_sequences could not map " +
                          std::to_string(need - have) + " page(s)\n" +
                          pool_.memory_report((need - have) * page_));
    throw_cuda_error(failed, "kv_virtual_sequences: map pages");
  }
  s.pages.insert(s.pages.end(), lent.begin(), lent.end());
  mapped_pages_ += lent.size();
}

kv_virtual_sequences::sequence_id kv_virtual_sequences::add(std::size_t tokens) {
  std::lock_guard lock(mutex_);
  if (tokens > max_tokens_)
    throw invalid_argument("kv_virtual_sequences::add: " + std::to_string(tokens) +
                           " tokens exceed max_sequence_tokens " + std::to_string(max_tokens_));
  auto r = platform_.reserve_range(range_bytes_, page_);
  if (!r) throw_cuda_error(r.error(), "kv_virtual_sequences: reserve a sequence's range");
  sequence s;
  s.base = r.value();
  try {
    grow_locked(s, tokens);
  } catch (...) {
    unmap_from(s, 0);
    (void)platform_.free_range(s.base, range_bytes_);
    throw;
  }
  s.tokens = tokens;
  live_tokens_ += tokens;
  const sequence_id id = next_id_++;
  sequences_.emplace(id, std::move(s));
  return id;
}

void kv_virtual_sequences::append(sequence_id seq, std::size_t tokens) {
  std::lock_guard lock(mutex_);
  sequence& s = find_locked(seq, "append");
  if (tokens > max_tokens_ - s.tokens)
    throw invalid_argument("kv_virtual_sequences::append: sequence " + std::to_string(seq) +
                           " has " + std::to_string(s.tokens) + " tokens; " +
                           std::to_string(tokens) + " more exceed max_sequence_tokens " +
                           std::to_string(max_tokens_));
  grow_locked(s, s.tokens + tokens);
  s.tokens += tokens;
  live_tokens_ += tokens;
}

void kv_virtual_sequences::free(sequence_id seq) {
  std::lock_guard lock(mutex_);
  sequence& s = find_locked(seq, "free");
  if (auto st = platform_.stream_synchronize(stream_); !st)
    throw_cuda_error(st, "kv_virtual_sequences: wait for the stream before unmapping");
  unmap_from(s, 0);
  if (!s.pages.empty())
    throw cuda_error("cuMemUnmap", 0, "unmap failed",
                     "a page of sequence " + std::to_string(seq) +
                         " could not be unmapped; the sequence stays",
                     "kv_virtual_sequences::free");
  (void)platform_.free_range(s.base, range_bytes_);
  live_tokens_ -= s.tokens;
  sequences_.erase(seq);
}

std::uintptr_t kv_virtual_sequences::base(sequence_id seq) const {
  std::lock_guard lock(mutex_);
  return find_locked(seq, "base").base;
}

std::size_t kv_virtual_sequences::tokens(sequence_id seq) const {
  std::lock_guard lock(mutex_);
  return find_locked(seq, "tokens").tokens;
}

std::size_t kv_virtual_sequences::sequences() const {
  std::lock_guard lock(mutex_);
  return sequences_.size();
}

std::size_t kv_virtual_sequences::mapped_bytes() const {
  std::lock_guard lock(mutex_);
  return mapped_pages_ * page_;
}

std::size_t kv_virtual_sequences::live_bytes() const {
  std::lock_guard lock(mutex_);
  return live_tokens_ * layout_.bytes_per_token();
}

std::string kv_virtual_sequences::validate() const {
  std::lock_guard lock(mutex_);
  std::size_t pages = 0, tokens = 0;
  for (const auto& [id, s] : sequences_) {
    const std::size_t need = (s.tokens * layout_.bytes_per_token() + page_ - 1) / page_;
    // More only where a failed undo left pages mapped (unmapped at free).
    if (s.pages.size() < need)
      return "sequence " + std::to_string(id) + " maps " + std::to_string(s.pages.size()) +
             " pages for " + std::to_string(need);
    pages += s.pages.size();
    tokens += s.tokens;
  }
  if (pages != mapped_pages_) return "mapped page count disagrees";
  if (tokens != live_tokens_) return "live token count disagrees";
  return {};
}

}  // namespace gpumem
