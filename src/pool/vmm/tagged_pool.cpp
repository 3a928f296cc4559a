// tagged_pool: see gpumem/pool/vmm/tagged_pool.hpp.
#include "gpumem/pool/vmm/tagged_pool.hpp"

#include <atomic>
#include <limits>
#include <mutex>
#include <unordered_map>

#include <algorithm>
#include <sstream>

#include "gpumem/errors.hpp"
#include "gpumem/pool/core/segment_lookup.hpp"

namespace gpumem {

namespace {
thread_local std::uint32_t current_tag = 0;
thread_local bool tag_set = false;  // false: the thread follows process_tag
std::atomic<std::uint32_t> process_tag{0};

// Written rarely (a tag's first use by name), read by messages and reports.
std::mutex names_mutex;
std::unordered_map<std::uint32_t, std::string>& tag_names() {
  static auto* names = new std::unordered_map<std::uint32_t, std::string>();  // outlives every pool
  return *names;
}
}  // namespace

void set_tag_name(std::uint32_t tag, std::string_view name) {
  if (tag == 0 || tag == tagged_pool::shared_tag)
    throw invalid_argument("set_tag_name: tag " + tag_label(tag) + " keeps its own name");
  if (name.empty() || name.size() > max_tag_name)
    throw invalid_argument("set_tag_name: a tag name has 1 to " + std::to_string(max_tag_name) +
                           " bytes, not " + std::to_string(name.size()));
  for (const char c : name)
    if (c < 0x20 || c > 0x7e)
      throw invalid_argument("set_tag_name: a tag name holds printable ASCII only (byte " +
                             std::to_string(static_cast<unsigned char>(c)) + " refused)");
  std::lock_guard lock(names_mutex);
  tag_names()[tag] = std::string(name);
}

std::string tag_label(std::uint32_t tag) {
  if (tag == tagged_pool::shared_tag) return "shared";
  if (tag == 0) return "0 (untagged)";
  std::lock_guard lock(names_mutex);
  auto it = tag_names().find(tag);
  return it == tag_names().end() ? std::to_string(tag)
                                 : it->second + " (" + std::to_string(tag) + ")";
}

scoped_tag::scoped_tag(std::uint32_t tag) noexcept : previous_(current_tag), previous_set_(tag_set) {
  current_tag = tag;
  tag_set = true;
}
scoped_tag::~scoped_tag() {
  current_tag = previous_;
  tag_set = previous_set_;
}
std::uint32_t scoped_tag::current() noexcept {
  return tag_set ? current_tag : process_tag.load(std::memory_order_relaxed);
}
void scoped_tag::set_current(std::uint32_t tag) noexcept {
  current_tag = tag;
  tag_set = true;
}
std::uint32_t scoped_tag::set_process(std::uint32_t tag) noexcept {
  return process_tag.exchange(tag, std::memory_order_relaxed);
}

tagged_pool::tagged_pool(pool_base& untagged, pool_options options,
                         memory_resource* untagged_front)
    : memory_resource(untagged.device_platform(), untagged.device()),
      untagged_(untagged),
      options_(options),
      shared_(untagged.device_platform(), untagged.device()) {
  // A tag's pool starts empty: a reservation up front is the untagged pool's.
  options_.reserve_bytes = 0;
  options_.reserve_fraction = 0;
  auto zero = std::make_unique<tag_entry>();
  zero->pool = &untagged_;
  zero->front = untagged_front != nullptr ? untagged_front : &untagged_;
  zero->vmm = dynamic_cast<vmm_page_pool*>(&untagged_);
  zero->asleep = zero->vmm != nullptr && zero->vmm->asleep();
  zero_ = zero.get();
  tags_.emplace(0, std::move(zero));
}

// Tag pools go before the shared memory and the untagged pool (members in reverse order;
// the untagged pool is not owned).
tagged_pool::~tagged_pool() = default;

tagged_pool::tag_entry* tagged_pool::find(std::uint32_t tag) const {
  std::lock_guard lock(tags_mutex_);
  auto it = tags_.find(tag);
  return it == tags_.end() ? nullptr : it->second.get();
}

std::vector<std::pair<std::uint32_t, tagged_pool::tag_entry*>> tagged_pool::entries() const {
  std::vector<std::pair<std::uint32_t, tag_entry*>> out;
  std::lock_guard lock(tags_mutex_);
  out.reserve(tags_.size());
  for (auto& [tag, e] : tags_) out.emplace_back(tag, e.get());
  return out;
}

tagged_pool::tag_entry& tagged_pool::entry_for_allocation(std::uint32_t tag) {
  if (tag == shared_tag) throw invalid_argument("tagged_pool: the shared tag has no pool");
  std::lock_guard lock(tags_mutex_);
  auto it = tags_.find(tag);
  if (it != tags_.end()) return *it->second;
  auto e = std::make_unique<tag_entry>();
  auto made = std::make_unique<vmm_page_pool>(device_platform(), device(), options_);
  const std::uintptr_t base = made->range_base();
  const std::uintptr_t end = base + made->range_bytes();
  e->vmm = made.get();
  e->owned = std::move(made);
  e->pool = e->owned.get();
  e->front = e->pool;
  // Both maps change together or not at all (the pool dies with `e` if an insert throws).
  auto range = ranges_.emplace(base, std::make_pair(end, tag)).first;
  try {
    return *tags_.emplace(tag, std::move(e)).first->second;
  } catch (...) {
    ranges_.erase(range);
    throw;
  }
}

std::size_t tagged_pool::max_alignment() const noexcept { return untagged_.max_alignment(); }

void* tagged_pool::allocate(std::size_t bytes, std::size_t alignment, stream_handle stream,
                            std::uint32_t tag) {
  if (tag == shared_tag) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > max_alignment())
      throw invalid_argument("tagged_pool::allocate: bad alignment " + std::to_string(alignment));
    return with_memory_of_every_tag([&] { return shared_.allocate(bytes); });  // page-aligned
  }
  tag_entry& e = entry_for_allocation(tag);
  std::shared_lock gate(e.gate);
  if (e.asleep.load(std::memory_order_relaxed))
    throw invalid_argument("tagged_pool::allocate: tag " + tag_label(tag) +
                           " is asleep; wake it before allocating in it");
  return with_memory_of_every_tag([&] { return e.front->allocate(bytes, alignment, stream); });
}

void* tagged_pool::while_awake(std::uint32_t tag, const std::function<void*()>& attempt) {
  tag_entry* e = tag == 0 ? zero_ : find(tag);
  if (e == nullptr) return attempt();
  std::shared_lock gate(e->gate);
  if (e->asleep.load(std::memory_order_relaxed))
    throw invalid_argument("tagged_pool::allocate: tag " + tag_label(tag) +
                           " is asleep; wake it before allocating in it");
  return attempt();
}

void* tagged_pool::do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) {
  return allocate(bytes, alignment, stream, scoped_tag::current());
}

std::uint32_t tagged_pool::tag_of(const void* ptr) const {
  if (shared_.owns(ptr)) return shared_tag;
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard lock(tags_mutex_);
  auto it = ranges_.upper_bound(a);  // the first range starting past `a`
  if (it == ranges_.begin()) return 0;
  --it;
  return a < it->second.first ? it->second.second : 0;
}

bool tagged_pool::is_live_tagged(const void* ptr) const {
  const std::uint32_t tag = tag_of(ptr);
  if (tag == shared_tag) return true;  // owns(): the start of an allocation or import
  if (tag == 0) return false;
  const tag_entry* e = find(tag);
  return e != nullptr &&
         is_allocated_block(e->pool->memory_segments(), reinterpret_cast<std::uintptr_t>(ptr));
}

void tagged_pool::do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) {
  const std::uint32_t tag = tag_of(ptr);
  if (tag == shared_tag) return shared_.release(ptr, bytes, stream);
  // Frees are allowed while the tag sleeps: no driver call touches the block's pages.
  find(tag)->front->deallocate(ptr, bytes, stream);
}

int tagged_pool::export_allocation(void* ptr) { return shared_.export_fd(ptr); }

void* tagged_pool::import_allocation(int fd, std::size_t bytes) { return shared_.import(fd, bytes); }

vmm_page_pool::page_export tagged_pool::export_pages(const void* ptr, std::size_t bytes) {
  const std::uint32_t tag = tag_of(ptr);
  if (tag == shared_tag) {
    if (shared_.is_import(ptr))
      throw invalid_argument("tagged_pool::export_pages: an import is exported by the process "
                             "that made it");
    vmm_page_pool::page_export out;
    out.fds.push_back(shared_.export_fd(const_cast<void*>(ptr)));
    const std::size_t page = shared_.page_size();
    if (bytes == 0 || bytes > std::numeric_limits<std::size_t>::max() - page)
      throw invalid_argument("tagged_pool::export_pages: " + std::to_string(bytes) + " bytes");
    out.bytes.push_back((bytes + page - 1) / page * page);
    return out;
  }
  const tag_entry* e = find(tag);
  if (e == nullptr || e->vmm == nullptr)
    throw not_supported("tagged_pool::export_pages: tag " + tag_label(tag) +
                        "'s pool has no pages to export (not a vmm_page_pool)");
  std::shared_lock gate(e->gate);  // no sleep starts while the handles are exported
  return e->vmm->export_pages(ptr, bytes);
}

void* tagged_pool::import_pages(std::span<const int> fds, std::span<const std::size_t> bytes) {
  return shared_.import_pieces(fds, bytes);
}

std::vector<std::uint32_t> tagged_pool::tags() const {
  std::vector<std::uint32_t> out;
  for (auto& [tag, e] : entries()) out.push_back(tag);
  const resource_stats s = shared_.stats();
  if (s.allocations != 0 || shared_.imported_bytes() != 0) out.push_back(shared_tag);
  return out;
}

std::vector<std::pair<std::uint32_t, const pool_base*>> tagged_pool::tag_pools() const {
  std::vector<std::pair<std::uint32_t, const pool_base*>> out;
  for (auto& [tag, e] : entries())
    if (tag != 0) out.emplace_back(tag, e->pool);
  return out;
}

resource_stats tagged_pool::tag_stats(std::uint32_t tag) const {
  if (tag == shared_tag) return shared_.stats();
  const tag_entry* e = find(tag);
  if (e == nullptr) return {};
  return e->front->stats();
}

resource_stats tagged_pool::stats() const {
  resource_stats total;
  auto add = [&](const resource_stats& s) {
    total.live_bytes += s.live_bytes;
    total.peak_live_bytes += s.peak_live_bytes;
    total.live_allocations += s.live_allocations;
    total.reserved_bytes += s.reserved_bytes;
    total.peak_reserved_bytes += s.peak_reserved_bytes;
    total.cached_bytes += s.cached_bytes;
    total.allocations += s.allocations;
    total.deallocations += s.deallocations;
    total.alloc_retries += s.alloc_retries;
    total.oom_count += s.oom_count;
  };
  for (auto& [tag, e] : entries()) add(e->front->stats());
  add(shared_.stats());
  return total;
}

std::size_t tagged_pool::trim() {
  std::size_t released = 0;
  for (auto& [tag, e] : entries()) released += e->pool->trim();
  return released;
}

void tagged_pool::set_keep_free(std::size_t bytes) {
  // Under the lock that makes tags: a tag made meanwhile gets the new value either way.
  std::lock_guard lock(tags_mutex_);
  options_.keep_free_bytes = bytes;
  for (auto& [tag, e] : tags_)
    if (e->vmm != nullptr) e->vmm->set_keep_free(bytes);
}

std::string tagged_pool::describe_tags(std::size_t limit) const {
  struct line {
    std::string tag;
    resource_stats s;
    bool asleep;
  };
  std::vector<line> held;
  for (auto& [tag, e] : entries()) {
    const resource_stats s = e->front->stats();
    if (s.reserved_bytes != 0 || s.live_bytes != 0 || e->asleep.load(std::memory_order_relaxed))
      held.push_back({tag_label(tag), s, e->asleep.load(std::memory_order_relaxed)});
  }
  if (const resource_stats s = shared_.stats(); s.reserved_bytes != 0)
    held.push_back({"shared", s, false});
  const resource_stats all = stats();
  std::ostringstream out;
  out << "\n  tags: the pool holds " << format_bytes(all.reserved_bytes) << " reserved, "
      << format_bytes(all.live_bytes) << " live, over " << held.size()
      << " tag(s) holding memory";
  std::sort(held.begin(), held.end(),
            [](const line& a, const line& b) { return a.s.reserved_bytes > b.s.reserved_bytes; });
  for (std::size_t i = 0; i < held.size() && i < limit; ++i)
    out << "\n    tag " << held[i].tag << ": " << format_bytes(held[i].s.reserved_bytes)
        << " reserved, " << format_bytes(held[i].s.live_bytes) << " live in "
        << held[i].s.live_allocations << " allocation(s)" << (held[i].asleep ? ", asleep" : "");
  if (held.size() > limit) out << "\n    ... and " << held.size() - limit << " more tag(s)";
  out << "\n";
  return out.str();
}

std::string tagged_pool::validate() const {
  for (auto& [tag, e] : entries()) {
    if (std::string why = e->pool->validate(); !why.empty())
      return "tag " + tag_label(tag) + ": " + why;
    std::shared_lock gate(e->gate);
    const bool pool_asleep = e->vmm != nullptr && e->vmm->asleep();
    if (e->asleep.load(std::memory_order_relaxed) != pool_asleep)
      return "tag " + tag_label(tag) + " is marked " +
             (pool_asleep ? "awake but its pool is asleep" : "asleep but its pool is awake");
  }
  {
    std::lock_guard lock(tags_mutex_);
    if (ranges_.size() + 1 != tags_.size())
      return "the range map holds " + std::to_string(ranges_.size()) + " ranges for " +
             std::to_string(tags_.size() - 1) + " tag pools";
    for (auto& [base, r] : ranges_) {
      auto it = tags_.find(r.second);
      if (it == tags_.end() || it->second->vmm == nullptr ||
          it->second->vmm->range_base() != base ||
          base + it->second->vmm->range_bytes() != r.first)
        return "the range at " + std::to_string(base) + " does not match tag " +
               tag_label(r.second) + "'s pool";
    }
  }
  return shared_.validate();
}

void tagged_pool::release_stream(stream_handle stream) {
  for (auto& [tag, e] : entries()) e->front->release_stream(stream);
}

vmm_page_pool& tagged_pool::sleeper(std::uint32_t tag, tag_entry*& e, const char* caller) const {
  if (tag == shared_tag)
    throw invalid_argument(std::string("tagged_pool::") + caller +
                           ": the shared tag's memory is shared with other processes and "
                           "does not sleep");
  e = find(tag);
  if (e == nullptr)
    throw invalid_argument(std::string("tagged_pool::") + caller + ": tag " + tag_label(tag) +
                           " was never allocated in, so it holds no memory and " +
                           (std::string_view(caller) == "wake"           ? "is not asleep"
                            : std::string_view(caller) == "release_host" ? "no host memory"
                                                                         : "has nothing to sleep") +
                           "; nothing changed");
  if (e->vmm == nullptr)
    throw not_supported(std::string("tagged_pool::") + caller + ": tag " + tag_label(tag) +
                        " is served by a " + std::string(e->pool->name()) +
                        ", which cannot release its pages keeping their addresses "
                        "(use allocator vmm_page_pool)");
  return *e->vmm;
}

// Runs step (a sleep or wake of e's pool), then sets e's mark to the pool's state, also
// when step throws. REQUIRES: e's gate held exclusively, e.vmm != nullptr.
template <class F>
void tagged_pool::follow_pool(tag_entry& e, F&& step) {
  try {
    step();
  } catch (...) {
    e.asleep.store(e.vmm->asleep(), std::memory_order_relaxed);
    throw;
  }
  e.asleep.store(e.vmm->asleep(), std::memory_order_relaxed);
}

void tagged_pool::sleep(std::uint32_t tag, sleep_mode mode, stream_handle stream) {
  tag_entry* e = nullptr;
  vmm_page_pool& pool = sleeper(tag, e, "sleep");
  std::unique_lock gate(e->gate);
  // The mark follows the pool whatever happens: a sleep that failed halfway leaves the pool
  // partly asleep (the same call completes it), one refused or failed before any page
  // slept leaves it awake.
  follow_pool(*e, [&] { pool.sleep(mode, stream); });
}

void tagged_pool::wake(std::uint32_t tag, stream_handle stream) {
  tag_entry* e = nullptr;
  vmm_page_pool& pool = sleeper(tag, e, "wake");
  std::unique_lock gate(e->gate);
  // Out of memory, every tag's free memory is given back and the wake tried once more (it
  // resumes where it stopped). On failure the tag stays asleep: the pool is still partly
  // asleep.
  follow_pool(*e, [&] {
    with_memory_of_every_tag([&]() -> void* {
      pool.wake(stream);
      return nullptr;
    });
  });
}

bool tagged_pool::asleep(std::uint32_t tag) const {
  const tag_entry* e = tag == 0 ? zero_ : find(tag);
  return e != nullptr && e->asleep.load(std::memory_order_relaxed);
}

std::size_t tagged_pool::host_bytes(std::uint32_t tag) const {
  const tag_entry* e = tag == shared_tag ? nullptr : find(tag);
  return e != nullptr && e->vmm != nullptr ? e->vmm->host_bytes() : 0;
}

std::size_t tagged_pool::release_host(std::uint32_t tag) {
  tag_entry* e = nullptr;
  vmm_page_pool& pool = sleeper(tag, e, "release_host");
  std::unique_lock gate(e->gate);  // no sleep or wake of the tag meanwhile
  return pool.release_host();
}

vmm_page_pool& tagged_pool::page_pool(std::uint32_t tag) {
  if (tag == shared_tag)
    throw invalid_argument("tagged_pool::page_pool: the shared tag's memory is one handle per "
                           "allocation; it lends no pages");
  tag_entry& e = entry_for_allocation(tag);
  if (e.vmm == nullptr)
    throw not_supported("tagged_pool::page_pool: tag " + tag_label(tag) + " is served by a " +
                        std::string(e.pool->name()) + ", which has no pages to lend "
                        "(use allocator vmm_page_pool)");
  if (e.asleep.load(std::memory_order_relaxed))
    throw invalid_argument("tagged_pool::page_pool: tag " + tag_label(tag) +
                           " is asleep; wake it before placing memory in it");
  return *e.vmm;
}

}  // namespace gpumem
