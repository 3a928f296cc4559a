// vmm_page_pool: construction, physical chunks, the virtual range's free runs, release, reports
// and the invariant check.
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

#include <algorithm>
#include <mutex>
#include <sstream>

#include "gpumem/errors.hpp"
#include "backend/ownership_registry.hpp"
#include "pool/core/block_arena.hpp"
#include "pool/vmm/sleep_state.hpp"
#include "pool/vmm/vmm_worker.hpp"

namespace gpumem {

vmm_page_pool::vmm_page_pool(platform& platform, int device, pool_options options)
    : pool_base(platform, device, options, 0) {
  auto props = platform.properties(device);
  if (!props) throw_cuda_error(props.error(), "vmm_page_pool: device properties");
  if (!props.value().vmm_supported)
    throw cuda_error("cuDeviceGetAttribute", 801, "CUDA_ERROR_NOT_SUPPORTED",
                     "device does not support virtual memory management", "vmm_page_pool");
  auto g = platform.granularity(device);
  if (!g) throw_cuda_error(g.error(), "vmm_page_pool: granularity");
  page_ = std::max(g.value().recommended, g.value().minimum);
  set_alignment_limit(page_);
  // Large blocks own whole pages unless configured otherwise (pool_options::round_large).
  if (options_.round_large == 0) options_.round_large = page_;
  counts_.page_size = page_;
  keep_free_ = options_.keep_free_bytes;
  std::size_t va = options.va_reserve_bytes != 0 ? options.va_reserve_bytes
                                                 : 2 * device_total_bytes();
  va = (va + page_ - 1) / page_ * page_;
  auto range = platform.reserve_range(va, page_);
  if (!range) throw_cuda_error(range.error(), "vmm_page_pool: reserve the virtual range");
  va_base_ = range.value();
  va_pages_ = va / page_;
  page_table_.assign(va_pages_, no_chunk);
  detail::registry_add_managed(reinterpret_cast<void*>(va_base_), va, this);
  va_free_.emplace(0, va_pages_);
  // The map worker pays off where driver calls cost time: on a GPU (see vmm_worker.hpp).
  const bool worker = options_.map_worker == map_worker_mode::on ||
                      (options_.map_worker == map_worker_mode::automatic && platform.kind() == "cuda");
  if (worker && !options_.guard) worker_ = std::make_unique<detail::vmm_worker>(platform);
  // footprint:fast: a large request takes the free block at the top of the large heap
  // (where it grows in place) only where no other free block holds it. The top's size
  // says only how far the heap has grown yet: a loop's next pass, meeting the heap grown to
  // its full height, would place blocks elsewhere than the last pass did and grow again
  // later. Kept for last, the top serves each pass alike (sim, 45 traces, 2 passes: every
  // trace's warm-pass memory calls within 1% of its allocations, 95 in all; docs/PAGE_POOL.md).
  if (fast() && !options_.guard) arena(large_arena).keep_top_for_last(true);
  // A huge growth's multi-page handles serve only requests that cover one: a smaller block
  // placed in one would pin its other pages where no gather can move them (ckpt_train_seed2
  // drifted to 1.10 over 8 passes). Smaller requests take other free memory, or a growth
  // that reclaims those handles (spare, then released and made again as one-page handles).
  if (huge_chunk_pages() > 1 && !fast())
    for (std::uint32_t id : {large_arena, long_arena})
      arena(id).restrict_segment(detail::whole_chunk_segment, huge_chunk_pages() * page_);
  // Lifetime hints move pages between runs: not with a reservation (its promise: no driver
  // call within it) nor in guard mode (no arenas). Nor in footprint:fast: their guesses
  // change as they learn, so a loop's next pass places its blocks elsewhere than the last
  // and grows the pool again (sim, 45 traces, 2 passes: 1.2234 -> 1.1245 fragmentation
  // geomean without them, 23 -> 39 traces with warm-pass calls within 1% of allocations).
  if (options_.lifetime_hints && options_.footprint == footprint_mode::tight && !options_.guard &&
      options.reserve_bytes == 0 && options.reserve_fraction <= 0)
    use_lifetime_hints();

  std::size_t reserve = options.reserve_bytes;
  if (options.reserve_fraction > 0)
    reserve = static_cast<std::size_t>(options.reserve_fraction *
                                       static_cast<double>(device_total_bytes()));
  if (reserve > 0) reserve_up_front(reserve);
}

void vmm_page_pool::reserve_up_front(std::size_t reserve) {
  platform& platform = device_platform();
  // A constructor that throws runs no destructor: give back what was taken here, as the
  // destructor does (mappings an undo could not remove, then handles, then the range).
  // The error being thrown is the reservation's; a call failing here is tried once more
  // (a failed call changes nothing), so one more transient failure strands nothing.
  auto give_back = [&] {
    auto retried = [](auto&& call) {
      if (!call()) (void)call();
    };
    for (const chunk& c : chunks_) {
      if (!c.live) continue;
      if (c.mapped_at != no_page)
        retried([&] { return platform.unmap(page_address(c.mapped_at), c.pages * page_); });
      retried([&] { return platform.release_physical(c.handle); });
    }
    retried([&] { return platform.free_range(va_base_, va_pages_ * page_); });
    detail::registry_remove(reinterpret_cast<void*>(va_base_));
  };
  std::lock_guard lock(mutex_);
  bool made = false;
  try {
    made = create_chunks((reserve + page_ - 1) / page_, handle_sizes::reservation);
  } catch (...) {
    give_back();  // a driver failure: create_chunks kept only handles it could not release
    throw;
  }
  if (!made) {
    give_back();
    throw out_of_memory("gpumem: vmm_page_pool could not reserve " + format_bytes(reserve) +
                        " up front on device " + std::to_string(device()));
  }
  // Mapped up front too, as one free run of the large arena with one access grant: the
  // reserved memory then serves requests with no driver call (mapping it on demand costs
  // ~26 us a page of access grant on the H200, one-page handle by handle). Small requests
  // take their pages from it as from any free run. (Guard mode maps per allocation.)
  if (!options_.guard) {
    bool mapped = false;
    try {
      mapped = grow(arena(large_arena), large_arena, (reserve + page_ - 1) / page_ * page_,
                    arena(large_arena).unit(), stream_handle{}, growth::any);
    } catch (...) {
      give_back();  // grow unmapped what it had mapped
      throw;
    }
    if (!mapped) {
      give_back();
      throw out_of_memory("gpumem: vmm_page_pool could not map the " + format_bytes(reserve) +
                          " reserved up front on device " + std::to_string(device()));
    }
  }
}

vmm_page_pool::~vmm_page_pool() {
  // Never throws: unmap every page, release every handle, free the range, ignoring a
  // driver that is already shutting down.
  platform& p = device_platform();
  stop_worker();  // its queued unmaps done; what is left is unmapped here
  forget_sleeping_chunks();  // their memory is the driver's already
  for (auto& r : retiring_) {
    (void)p.stream_synchronize(stream_handle{r.stream});
    std::size_t at = r.first_page;
    for (auto& [id, pages] : r.chunks) {
      (void)p.unmap(page_address(at), pages * page_);
      at += pages;
    }
  }
  for (auto& c : chunks_) {
    if (!c.live) continue;
    if (c.mapped_at != no_page) (void)p.unmap(page_address(c.mapped_at), c.pages * page_);
    (void)p.release_physical(c.handle);
  }
  (void)p.free_range(va_base_, va_pages_ * page_);
  detail::registry_remove(reinterpret_cast<void*>(va_base_));
}

vmm_page_counts vmm_page_pool::page_counts() const {
  std::lock_guard lock(mutex_);
  vmm_page_counts c = counts_;
  c.growth_slack = slack_now();
  c.long_lived_allocations = long_lived_allocations_locked();
  c.lifetime_hints_active = lifetime_hints_active_locked();
  c.long_lived_bytes_handed_over = long_lived_bytes_handed_over_locked();
  c.spare_pages = spare_pages();
  c.handle_entries = chunks_.size();
  c.mapped_pages = 0;
  c.handles = 0;
  for (auto& ch : chunks_) {
    if (!ch.live) continue;
    c.mapped_pages += ch.mapped_at != no_page ? ch.pages : 0;
    c.handles += 1;
  }
  return c;
}

pool_base::page_holdings vmm_page_pool::page_holdings_locked() const {
  page_holdings h{page_, spare_pages() * page_, {}};
  for (const chunk& c : chunks_)
    if (c.live && c.pages > 1 && c.mapped_at != no_page)
      h.multi_page_handles.emplace_back(page_address(c.mapped_at), c.pages * page_);
  return h;
}

std::size_t vmm_page_pool::spare_pages() const {
  std::size_t n = 0;
  for (std::uint32_t id : spare_) n += chunks_[id].pages;
  return n;
}

std::size_t vmm_page_pool::spare_single_pages() const {
  return static_cast<std::size_t>(std::count_if(spare_.begin(), spare_.end(), [&](std::uint32_t id) {
    return chunks_[id].pages == 1 && chunks_[id].retiring == 0;
  }));
}

std::size_t vmm_page_pool::spare_pages_for(std::uintptr_t stream) const {
  std::size_t n = 0;
  for (std::uint32_t id : spare_) n += mappable_for(id, stream) ? chunks_[id].pages : 0;
  return n;
}

void vmm_page_pool::release_stream(stream_handle stream) {
  {
    std::lock_guard lock(mutex_);
    retire_completed(true, &stream.value);
  }
  pool_base::release_stream(stream);
}

bool vmm_page_pool::create_chunks(std::size_t pages, handle_sizes sizes) {
  const std::size_t bytes = pages * page_;
  if (options_.limit_bytes != 0 && reserved_locked() + bytes > options_.limit_bytes) return false;
  const std::size_t spare_before = spare_.size();
  std::vector<std::uint32_t> made;  // this call's chunks, in order (also at spare_'s end)
  // Undo this call's chunks when a later one fails: all or nothing, but for a chunk whose
  // cuMemRelease fails too: forgetting it would leak its handle, so it stays, spare (still
  // counted reserved), for later use or release (release_cached, the destructor).
  auto undo = [&] {
    spare_.resize(spare_before);
    for (std::uint32_t id : made) {
      if (!device_platform().release_physical(chunks_[id].handle)) {
        spare_.push_back(id);
        continue;
      }
      sub_reserved(chunks_[id].pages * page_);
      counts_.pages_created -= chunks_[id].pages;
      forget_chunk(id);
    }
  };
  // The multi-page handle size this call may use (1: none; see handle_sizes), and whether
  // the pages left past its multiples make one handle too rather than one each.
  std::size_t big = 1;
  bool rest_whole = false;
  if (sizes != handle_sizes::one_page && options_.big_chunk_pages > 1) {
    if (pages >= 2 * options_.big_chunk_pages) big = options_.big_chunk_pages;
  } else if (sizes == handle_sizes::whole_growth && whole_growth_handles()) {
    // At most a growth_room_share-th of the room the budget has left after this growth:
    // handles shrink towards one page as the pool nears its budget, where a partly used
    // handle would pin its free pages against the gather.
    const std::size_t budget = budget_locked(), after = reserved_locked() + bytes;
    const std::size_t room_pages = after < budget ? (budget - after) / page_ : 0;
    // The same share of the device's free memory after it, and one page where less than a
    // plentiful_share-th of the device would stay free: the budget is this pool's alone,
    // and other processes (a colocated generator, a ballast) or other pools may have filled
    // the device, where a pinned page costs an out-of-memory.
    big = std::clamp<std::size_t>(room_pages / growth_room_share, 1, pages);
    if (big > 1) {  // the device is asked only where the handle would be coarse
      std::size_t free_pages = 0;
      if (auto info = device_platform().mem_info(device());
          info && info.value().free >= bytes + info.value().total / plentiful_share)
        free_pages = (info.value().free - bytes) / page_;
      big = std::clamp<std::size_t>(std::min(big, free_pages / growth_room_share), 1, pages);
    }
    rest_whole = big > 1;
  } else if (sizes != handle_sizes::one_page && sizes != handle_sizes::reservation &&
             pages * page_ >= options_.huge_growth_bytes) {
    big = huge_chunk_pages();
  }
  for (std::size_t left = pages; left > 0;) {
    const std::size_t n = left >= big ? big : (rest_whole ? left : 1);
    auto h = create_handle(n * page_);
    if (!h) {
      undo();
      if (h.error().kind == failure_kind::out_of_memory) return false;
      throw_cuda_error(h.error(), "vmm_page_pool: create physical memory");
    }
    const std::uint32_t id = new_chunk_id();
    chunks_[id] = chunk{h.value(), n, no_page, true};
    chunks_[id].made = ++made_serial_;
    made.push_back(id);
    spare_.push_back(id);
    add_reserved(n * page_);
    counts_.pages_created += n;
    left -= n;
  }
  return true;
}

std::uint32_t vmm_page_pool::new_chunk_id() {
  if (!free_ids_.empty()) {
    const std::uint32_t id = free_ids_.back();
    free_ids_.pop_back();
    return id;
  }
  chunks_.emplace_back();
  return static_cast<std::uint32_t>(chunks_.size() - 1);
}

// The chunk has left the pool (its handle released or merged into another chunk's): its
// entry is reset and its id made free for the next chunk.
void vmm_page_pool::forget_chunk(std::uint32_t id) noexcept {
  chunks_[id] = chunk{};
  free_ids_.push_back(id);
}

namespace {
// Held from keep_free's look at the device's free bytes to the handle made on it, so two
// pools of the process growing at once do not both pass on the same free bytes. Taken
// inside a pool's lock, never the other way round; only while keep_free is set.
std::mutex& keep_free_gate() {
  static std::mutex gate;
  return gate;
}
}  // namespace

result<physical_handle> vmm_page_pool::create_handle(std::size_t bytes) {
  std::unique_lock<std::mutex> gate;
  if (keep_free_ != 0) {
    gate = std::unique_lock(keep_free_gate());
    // The driver's view: memory other processes and libraries hold counts too.
    const auto info = device_platform().mem_info(device());
    if (info && (info.value().free < bytes || info.value().free - bytes < keep_free_))
      return status::failure(platform_op::create_physical, failure_kind::out_of_memory, 2,
                             "CUDA_ERROR_OUT_OF_MEMORY",
                             "keep_free: device " + std::to_string(device()) + " has " +
                                 format_bytes(info.value().free) + " free; " +
                                 format_bytes(bytes) + " more would leave less than " +
                                 format_bytes(keep_free_));
  }
  if (options_.shareable && !shareable_refused_) {
    auto h = device_platform().create_shareable_physical(device(), bytes);
    if (h || (h.error().kind != failure_kind::not_supported &&
              h.error().kind != failure_kind::invalid_value))
      return h;
    shareable_refused_ = true;
  }
  return device_platform().create_physical(device(), bytes);
}

void vmm_page_pool::va_insert(std::size_t first, std::size_t count) {
  auto next = va_free_.lower_bound(first);
  if (next != va_free_.end() && first + count == next->first) {
    count += next->second;
    next = va_free_.erase(next);
  }
  if (next != va_free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      prev->second += count;
      return;
    }
  }
  va_free_.emplace(first, count);
}

std::size_t vmm_page_pool::release_cached() {
  if (sleeping_locked()) {
    // Sleeping pages hold no physical memory: the cache among them leaves the pool, so
    // wake maps only the pages in use (footprint:tight's wake trims afterwards instead).
    // Partly asleep (a sleep or a wake that failed part way) it stays: the records keep the
    // pool asleep until the same call again completes it, and dropping the last of them
    // would leave a pool that refuses allocations and refuses the wake as "not asleep".
    if (!sleep_->complete) return 0;
    std::vector<std::uint32_t> ids(sleep_->chunks.size());
    std::transform(sleep_->chunks.begin(), sleep_->chunks.end(), ids.begin(),
                   [](const auto& entry) { return entry.first; });
    drop_sleeping_cache_locked(take_cache_locked(ids));
    return 0;
  }
  reclaim(va_pages_, true);
  retire_completed(true);
  return release_spare_locked();
}

// Gives the spare chunks (held, unmapped) of `which` kind back to the driver; one whose
// release fails stays spare, so the pool stays consistent. Returns the bytes released.
std::size_t vmm_page_pool::release_spare_locked(spare_kind which) {
  std::size_t released = 0;
  std::vector<std::uint32_t> kept;
  for (std::uint32_t id : spare_) {
    chunk& c = chunks_[id];
    if (which == spare_kind::coarse && c.pages == 1) {
      kept.push_back(id);
      continue;
    }
    if (auto s = device_platform().release_physical(c.handle); !s) {
      kept.push_back(id);  // keep it; the pool stays consistent
      continue;
    }
    const std::size_t bytes = c.pages * page_;
    sub_reserved(bytes);
    released += bytes;
    counts_.pages_released += c.pages;
    forget_chunk(id);
  }
  spare_ = std::move(kept);
  return released;
}

std::string vmm_page_pool::describe_holdings() const {
  std::size_t mapped = 0, handles = 0;
  for (auto& c : chunks_) {
    if (!c.live) continue;
    mapped += c.mapped_at != no_page ? c.pages : 0;
    handles += 1;
  }
  std::ostringstream out;
  out << "  pages of " << format_bytes(page_) << ": " << mapped << " mapped, " << spare_pages()
      << " kept unmapped for reuse, in " << handles << " physical handles; "
      << counts_.pages_reclaimed << " pages remapped so far; " << counts_.lent_pages
      << " lent (KV cache); " << retiring_.size()
      << " old mappings of remapped pages waiting for their stream\n";
  if (va_exhausted_) {
    std::size_t free_pages = 0, largest_run = 0;
    for (const auto& [first, count] : va_free_) {
      free_pages += count;
      largest_run = std::max(largest_run, count);
    }
    out << "  the pool's virtual range (va_reserve: " << format_bytes(va_pages_ * page_)
        << ") is exhausted: " << (va_pages_ - free_pages) * page_ << " of " << va_pages_ * page_
        << " bytes of addresses in use, the largest free run " << largest_run * page_
        << " bytes, too small for the request; raise va_reserve\n";
  }
  if (keep_free_ != 0)
    out << "  keep_free: every new physical handle leaves " << format_bytes(keep_free_)
        << " of the device free\n";
  if (counts_.unmap_failures > 0)
    out << "  " << counts_.unmap_failures
        << " unmaps of old mappings failed so far; those runs stay mapped until a retry "
           "succeeds\n";
  return out.str();
}

std::string vmm_page_pool::validate_holdings() const {
  if (asleep_now() != asleep_locked())
    return asleep_locked() ? "the pool is asleep but serves allocations"
                           : "the pool refuses allocations but is awake";
  std::size_t live_pages = 0, mapped = 0;
  for (std::uint32_t id = 0; id < chunks_.size(); ++id) {
    const chunk& c = chunks_[id];
    if (!c.live) continue;
    live_pages += c.pages;
    if (c.mapped_at == no_page) continue;
    mapped += c.pages;
    for (std::size_t p = 0; p < c.pages; ++p)
      if (page_table_[c.mapped_at + p] != id) return "page table disagrees with a chunk's mapping";
  }
  if (live_pages * page_ != reserved_locked() + sleeping_pages_locked() * page_)
    return "chunks (but sleeping ones) do not add up to reserved";
  std::size_t table_mapped = 0, table_retiring = 0;
  for (std::uint32_t id : page_table_) {
    table_mapped += id != no_chunk && id != retiring_page ? 1 : 0;
    table_retiring += id == retiring_page ? 1 : 0;
  }
  if (table_mapped != mapped) return "page table maps pages of no live chunk";
  std::size_t retiring_pages = 0;
  std::vector<std::uint32_t> retiring_refs(chunks_.size(), 0), waiting_refs(chunks_.size(), 0);
  for (const auto& r : retiring_) {
    std::size_t sum = 0;
    for (auto& [id, pages] : r.chunks) {
      if (!chunks_[id].live || chunks_[id].pages != pages) return "a retiring run names a wrong chunk";
      retiring_refs[id] += 1;
      waiting_refs[id] += r.work_pending ? 1 : 0;
      sum += pages;
    }
    if (sum != r.pages) return "a retiring run's pages disagree with its chunks";
    for (std::size_t q = r.first_page; q < r.first_page + r.pages; ++q)
      if (page_table_[q] != retiring_page) return "a retiring run's pages are not marked retiring";
    retiring_pages += r.pages;
  }
  if (retiring_pages != table_retiring) return "retiring pages in the table disagree with the runs";
  for (std::uint32_t id = 0; id < chunks_.size(); ++id) {
    if (!chunks_[id].live) continue;
    if (chunks_[id].retiring != retiring_refs[id]) return "a chunk's retiring count disagrees with the runs";
    if (chunks_[id].waiting != waiting_refs[id])
      return "a chunk's count of old mappings still in use disagrees with the runs";
  }
  std::size_t lent = 0;
  for (auto& [h, id] : lent_) {
    if (!chunks_[id].live || !chunks_[id].lent || chunks_[id].pages != 1 ||
        chunks_[id].mapped_at != no_page)
      return "a lent handle is not a live, unmapped one-page chunk";
    lent += 1;
  }
  if (lent != counts_.lent_pages) return "lent page count disagrees with the lent handles";
  std::size_t dead = 0;
  for (const chunk& c : chunks_) dead += c.live ? 0 : 1;
  if (dead != free_ids_.size()) return "chunk entries that left the pool are not all free ids";
  for (std::uint32_t id : free_ids_)
    if (id >= chunks_.size() || chunks_[id].live) return "a free chunk id names a live chunk";
  if (mapped + spare_pages() + lent != live_pages) return "chunk pages neither mapped, spare nor lent";
  return {};
}

}  // namespace gpumem
