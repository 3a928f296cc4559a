// tagged_pool: see gpumem/pool/vmm/tagged_pool.hpp.
#include "gpumem/pool/vmm/tagged_pool.hpp"

#include <algorithm>
#include <sstream>

#include "gpumem/errors.hpp"

namespace gpumem {

namespace {
thread_local std::uint32_t current_tag = 0;

std::string tag_name(std::uint32_t tag) {
  return tag == tagged_pool::shared_tag ? std::string("shared") : std::to_string(tag);
}
}  // namespace

scoped_tag::scoped_tag(std::uint32_t tag) noexcept : previous_(current_tag) { current_tag = tag; }
scoped_tag::~scoped_tag() { current_tag = previous_; }
std::uint32_t scoped_tag::current() noexcept { return current_tag; }
void scoped_tag::set_current(std::uint32_t tag) noexcept { current_tag = tag; }

tagged_pool::tagged_pool(pool_base& untagged, pool_options options)
    : memory_resource(untagged.device_platform(), untagged.device()),
      untagged_(untagged),
      options_(options),
      shared_(untagged.device_platform(), untagged.device()) {
  // A tag's pool starts empty: a reservation up front is the untagged pool's.
  options_.reserve_bytes = 0;
  options_.reserve_fraction = 0;
  auto zero = std::make_unique<tag_entry>();
  zero->pool = &untagged_;
  zero->vmm = dynamic_cast<vmm_page_pool*>(&untagged_);
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

tagged_pool::tag_entry& tagged_pool::entry(std::uint32_t tag) {
  if (tag == shared_tag) throw invalid_argument("tagged_pool: the shared tag has no pool");
  std::lock_guard lock(tags_mutex_);
  auto it = tags_.find(tag);
  if (it != tags_.end()) return *it->second;
  auto e = std::make_unique<tag_entry>();
  auto made = std::make_unique<vmm_page_pool>(device_platform(), device(), options_);
  e->vmm = made.get();
  e->owned = std::move(made);
  e->pool = e->owned.get();
  return *tags_.emplace(tag, std::move(e)).first->second;
}

pool_base* tagged_pool::pool_of(std::uint32_t tag) {
  return tag == shared_tag ? nullptr : entry(tag).pool;
}

std::size_t tagged_pool::max_alignment() const noexcept { return untagged_.max_alignment(); }

void* tagged_pool::allocate(std::size_t bytes, std::size_t alignment, stream_handle stream,
                            std::uint32_t tag) {
  if (tag == shared_tag) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > max_alignment())
      throw invalid_argument("tagged_pool::allocate: bad alignment " + std::to_string(alignment));
    return shared_.allocate(bytes);  // page-aligned
  }
  tag_entry& e = entry(tag);
  std::shared_lock gate(e.gate);
  if (e.asleep)
    throw invalid_argument("tagged_pool::allocate: tag " + tag_name(tag) +
                           " is asleep; wake it before allocating in it");
  return e.pool->allocate(bytes, alignment, stream);
}

void* tagged_pool::do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) {
  return allocate(bytes, alignment, stream, scoped_tag::current());
}

std::uint32_t tagged_pool::tag_of(const void* ptr) const {
  if (shared_.owns(ptr)) return shared_tag;
  std::lock_guard lock(tags_mutex_);
  for (auto& [tag, e] : tags_)
    if (tag != 0 && e->vmm != nullptr && e->vmm->owns(ptr)) return tag;
  return 0;
}

void tagged_pool::do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) {
  const std::uint32_t tag = tag_of(ptr);
  if (tag == shared_tag) return shared_.release(ptr, bytes, stream);
  // Frees are allowed while the tag sleeps: no driver call touches the block's pages.
  find(tag)->pool->deallocate(ptr, bytes, stream);
}

int tagged_pool::export_allocation(void* ptr) { return shared_.export_fd(ptr); }

void* tagged_pool::import_allocation(int fd, std::size_t bytes) { return shared_.import(fd, bytes); }

std::vector<std::uint32_t> tagged_pool::tags() const {
  std::vector<std::uint32_t> out;
  {
    std::lock_guard lock(tags_mutex_);
    for (auto& [tag, e] : tags_) out.push_back(tag);
  }
  const resource_stats s = shared_.stats();
  if (s.allocations != 0 || shared_.imported_bytes() != 0) out.push_back(shared_tag);
  return out;
}

resource_stats tagged_pool::tag_stats(std::uint32_t tag) const {
  if (tag == shared_tag) return shared_.stats();
  const tag_entry* e = find(tag);
  if (e == nullptr) return {};
  return e->pool->stats();
}

resource_stats tagged_pool::stats() const {
  resource_stats total;
  for (std::uint32_t tag : tags()) {
    const resource_stats s = tag_stats(tag);
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
  }
  return total;
}

std::string tagged_pool::validate() const {
  std::lock_guard lock(tags_mutex_);
  for (auto& [tag, e] : tags_) {
    if (std::string why = e->pool->validate(); !why.empty())
      return "tag " + tag_name(tag) + ": " + why;
    std::shared_lock gate(e->gate);
    if (e->asleep && (e->vmm == nullptr || !e->vmm->asleep()))
      return "tag " + tag_name(tag) + " is marked asleep but its pool is awake";
  }
  return shared_.validate();
}

void tagged_pool::release_stream(stream_handle stream) {
  std::vector<pool_base*> pools;
  {
    std::lock_guard lock(tags_mutex_);
    for (auto& [tag, e] : tags_) pools.push_back(e->pool);
  }
  for (pool_base* p : pools) p->release_stream(stream);
}

vmm_page_pool& tagged_pool::sleeper(std::uint32_t tag, tag_entry*& e, const char* caller) {
  if (tag == shared_tag)
    throw invalid_argument(std::string("tagged_pool::") + caller +
                           ": the shared tag's memory is shared with other processes and "
                           "does not sleep");
  e = &entry(tag);
  if (e->vmm == nullptr)
    throw not_supported(std::string("tagged_pool::") + caller + ": tag " + tag_name(tag) +
                        " is served by a " + std::string(e->pool->name()) +
                        ", which cannot release its pages keeping their addresses "
                        "(use allocator vmm_page_pool)");
  return *e->vmm;
}

void tagged_pool::sleep(std::uint32_t tag, sleep_mode mode, stream_handle stream) {
  tag_entry* e = nullptr;
  vmm_page_pool& pool = sleeper(tag, e, "sleep");
  std::unique_lock gate(e->gate);
  // Marked from the first step on, so no allocation runs meanwhile. A sleep that failed
  // halfway leaves the pool partly asleep and the mark set: the same call completes it.
  e->asleep = true;
  try {
    pool.sleep(mode, stream);
  } catch (...) {
    if (!pool.asleep()) e->asleep = false;  // refused, or failed before any page slept
    throw;
  }
}

void tagged_pool::wake(std::uint32_t tag, stream_handle stream) {
  tag_entry* e = nullptr;
  vmm_page_pool& pool = sleeper(tag, e, "wake");
  std::unique_lock gate(e->gate);
  if (!e->asleep)
    throw invalid_argument("tagged_pool::wake: tag " + tag_name(tag) + " is not asleep");
  pool.wake(stream);  // on failure the tag stays asleep: the pool is still partly asleep
  e->asleep = false;
}

bool tagged_pool::asleep(std::uint32_t tag) const {
  const tag_entry* e = find(tag);
  if (e == nullptr) return false;
  std::shared_lock gate(e->gate);
  return e->asleep;
}

}  // namespace gpumem
