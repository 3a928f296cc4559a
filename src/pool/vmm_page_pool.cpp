#include "gpumem/pool/vmm_page_pool.hpp"

#include <algorithm>
#include <sstream>

#include "gpumem/errors.hpp"
#include "pool/block_arena.hpp"

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
  counts_.page_size = page_;
  std::size_t va = options.va_reserve_bytes != 0 ? options.va_reserve_bytes
                                                 : 2 * device_total_bytes();
  va = (va + page_ - 1) / page_ * page_;
  auto range = platform.reserve_range(va, page_);
  if (!range) throw_cuda_error(range.error(), "vmm_page_pool: reserve the virtual range");
  va_base_ = range.value();
  va_pages_ = va / page_;
  page_table_.assign(va_pages_, page_ref{});
  va_free_.emplace(0, va_pages_);

  std::size_t reserve = options.reserve_bytes;
  if (options.reserve_fraction > 0)
    reserve = static_cast<std::size_t>(options.reserve_fraction *
                                       static_cast<double>(device_total_bytes()));
  if (reserve > 0) {
    std::lock_guard lock(mutex_);
    if (!create_chunk((reserve + page_ - 1) / page_)) {
      (void)platform.free_range(va_base_, va_pages_ * page_);
      throw out_of_memory("gpumem: vmm_page_pool could not reserve " + format_bytes(reserve) +
                          " up front on device " + std::to_string(device));
    }
  }
}

vmm_page_pool::~vmm_page_pool() {
  // Never throws: unmap every page, release every handle, free the range, ignoring a
  // driver that is already shutting down.
  platform& p = device_platform();
  for (std::size_t i = 0; i < va_pages_; ++i)
    if (page_table_[i].chunk != no_chunk) (void)p.unmap(page_address(i), page_);
  for (auto& c : chunks_)
    if (c.live) (void)p.release_physical(c.handle);
  (void)p.free_range(va_base_, va_pages_ * page_);
}

vmm_page_counts vmm_page_pool::page_counts() const {
  std::lock_guard lock(mutex_);
  vmm_page_counts c = counts_;
  c.spare_pages = spare_.size();
  c.mapped_pages = 0;
  c.handles = 0;
  for (auto& ch : chunks_) {
    c.mapped_pages += ch.mapped;
    c.handles += ch.live ? 1 : 0;
  }
  return c;
}

bool vmm_page_pool::create_chunk(std::size_t pages) {
  const std::size_t bytes = pages * page_;
  if (options_.limit_bytes != 0 && reserved_locked() + bytes > options_.limit_bytes) return false;
  auto h = device_platform().create_physical(device(), bytes);
  if (!h) {
    if (h.error().kind == failure_kind::out_of_memory) return false;
    throw_cuda_error(h.error(), "vmm_page_pool: create physical memory");
  }
  const auto id = static_cast<std::uint32_t>(chunks_.size());
  chunks_.push_back(chunk{h.value(), pages, 0, true});
  for (std::size_t i = 0; i < pages; ++i)
    spare_.push_back(page_ref{id, static_cast<std::uint32_t>(i)});
  add_reserved(bytes);
  counts_.pages_created += pages;
  return true;
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

std::size_t vmm_page_pool::reclaim(std::size_t wanted) {
  struct candidate {
    std::uint32_t arena_id;
    detail::block* b;
    std::size_t first_page;
    std::size_t pages;
  };
  std::vector<candidate> found;
  for (std::uint32_t id : {small_arena, large_arena}) {
    arena(id).flush();
    for (detail::block* b : arena(id).free_blocks()) {
      const std::size_t first = (b->addr - va_base_ + page_ - 1) / page_;
      const std::size_t end = (b->addr + b->size - va_base_) / page_;
      if (end > first) found.push_back({id, b, first, end - first});
    }
  }
  if (found.empty()) return 0;
  // Biggest runs first: fewest blocks cut.
  std::sort(found.begin(), found.end(),
            [](const candidate& x, const candidate& y) { return x.pages > y.pages; });
  // Work queued on any stream may still touch these pages: let it finish before unmapping.
  synchronize_streams_with_free_blocks();
  std::size_t got = 0;
  for (auto& c : found) {
    if (got >= wanted) break;
    const std::size_t take = std::min(c.pages, wanted - got);
    std::size_t done = 0;
    status failed;
    for (; done < take; ++done) {
      const std::size_t page = c.first_page + done;
      if (auto s = device_platform().unmap(page_address(page), page_); !s) {
        failed = s;
        break;
      }
      page_ref ref = page_table_[page];
      page_table_[page] = page_ref{};
      chunks_[ref.chunk].mapped -= 1;
      spare_.push_back(ref);
    }
    if (done > 0) {
      arena(c.arena_id).carve(c.b, page_address(c.first_page), done * page_);
      va_insert(c.first_page, done);
      got += done;
      counts_.pages_reclaimed += done;
    }
    if (!failed.ok()) throw_cuda_error(failed, "vmm_page_pool: unmap a free page to reuse it");
  }
  return got;
}

bool vmm_page_pool::grow(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
                         std::size_t alignment, stream_handle stream) {
  const std::size_t pad = alignment > arena.unit() ? alignment - arena.unit() : 0;
  const std::size_t pages = (size + pad + page_ - 1) / page_;
  // Physical pages first: kept ones, then reclaimed ones, then new memory.
  if (spare_.size() < pages) reclaim(pages - spare_.size());
  if (spare_.size() < pages && !create_chunk(pages - spare_.size())) return false;

  // Virtual pages: first fit, lowest address first, so runs land next to earlier ones
  // and merge with them.
  auto run = std::find_if(va_free_.begin(), va_free_.end(),
                          [&](const auto& r) { return r.second >= pages; });
  if (run == va_free_.end()) return false;  // virtual range exhausted
  const std::size_t first = run->first;
  const std::size_t remaining = run->second - pages;
  va_free_.erase(run);
  if (remaining > 0) va_free_.emplace(first + pages, remaining);

  // Map the most recently kept pages; undo everything on failure.
  std::size_t mapped = 0;
  status failed;
  for (; mapped < pages; ++mapped) {
    const page_ref ref = spare_[spare_.size() - 1 - mapped];
    if (auto s = device_platform().map(page_address(first + mapped), page_,
                                       chunks_[ref.chunk].handle, ref.index * page_);
        !s) {
      failed = s;
      break;
    }
  }
  if (failed.ok()) failed = device_platform().set_access(device(), page_address(first), pages * page_);
  if (!failed.ok()) {
    for (std::size_t i = 0; i < mapped; ++i) (void)device_platform().unmap(page_address(first + i), page_);
    va_insert(first, pages);
    if (failed.kind == failure_kind::out_of_memory) return false;
    throw_cuda_error(failed, "vmm_page_pool: map pages");
  }
  for (std::size_t i = 0; i < pages; ++i) {
    const page_ref ref = spare_.back();
    spare_.pop_back();
    page_table_[first + i] = ref;
    chunks_[ref.chunk].mapped += 1;
  }
  arena.add_region(page_address(first), pages * page_, 0, stream.value);
  (void)arena_id;
  return true;
}

std::size_t vmm_page_pool::release_cached() {
  reclaim(va_pages_);
  std::size_t released = 0;
  for (std::uint32_t id = 0; id < chunks_.size(); ++id) {
    chunk& c = chunks_[id];
    if (!c.live || c.mapped != 0) continue;
    if (auto s = device_platform().release_physical(c.handle); !s) continue;  // keep it
    c.live = false;
    const std::size_t bytes = c.pages * page_;
    sub_reserved(bytes);
    released += bytes;
    counts_.pages_released += c.pages;
    std::erase_if(spare_, [id](const page_ref& r) { return r.chunk == id; });
  }
  return released;
}

std::string vmm_page_pool::describe_holdings() const {
  std::size_t mapped = 0, handles = 0;
  for (auto& c : chunks_) {
    mapped += c.mapped;
    handles += c.live ? 1 : 0;
  }
  std::ostringstream out;
  out << "  pages of " << format_bytes(page_) << ": " << mapped << " mapped, " << spare_.size()
      << " kept unmapped for reuse, in " << handles << " physical handles; "
      << counts_.pages_reclaimed << " pages remapped so far\n";
  return out.str();
}

std::string vmm_page_pool::validate_holdings() const {
  std::size_t live_pages = 0, mapped = 0;
  for (auto& c : chunks_)
    if (c.live) {
      live_pages += c.pages;
      mapped += c.mapped;
    }
  if (live_pages * page_ != reserved_locked()) return "handles do not add up to reserved";
  std::size_t table_mapped = 0;
  for (auto& r : page_table_) table_mapped += r.chunk != no_chunk ? 1 : 0;
  if (table_mapped != mapped) return "page table disagrees with handle mapping counts";
  if (mapped + spare_.size() != live_pages) return "pages neither mapped nor spare";
  return {};
}

}  // namespace gpumem
