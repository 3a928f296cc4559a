// vmm_page_pool: the physical pages under a live allocation, exported for another process.
#include <unistd.h>

#include <string>

#include "gpumem/errors.hpp"
#include "gpumem/platform/status_error.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem {

vmm_page_pool::page_export vmm_page_pool::export_pages(const void* ptr, std::size_t bytes) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  if (bytes == 0 || !owns(ptr) || bytes > va_base_ + va_pages_ * page_ - addr)
    throw invalid_argument("vmm_page_pool::export_pages: [" + std::to_string(addr) + ", +" +
                           std::to_string(bytes) + ") is not a range of this pool");
  if (!options_.shareable)
    throw not_supported("vmm_page_pool::export_pages: the pool's pages are not exportable "
                        "(create it with shareable:on)");
  std::lock_guard lock(mutex_);
  if (sleeping_locked())
    throw invalid_argument("vmm_page_pool::export_pages: the pool sleeps; wake it first");
  const std::size_t first = (addr - va_base_) / page_;
  const std::size_t last = (addr + bytes - 1 - va_base_) / page_;
  // The chunks in address order: each is mapped whole from its mapped_at page, so the
  // run of chunks covering [first, last] is contiguous in the pool's range.
  std::vector<std::uint32_t> ids;
  for (std::size_t p = first; p <= last;) {
    const std::uint32_t id = page_table_[p];
    if (id == no_chunk || !chunks_[id].live || chunks_[id].mapped_at == no_page)
      throw invalid_argument("vmm_page_pool::export_pages: page " + std::to_string(p - first) +
                             " of the range is not mapped (not a live allocation)");
    ids.push_back(id);
    p = chunks_[id].mapped_at + chunks_[id].pages;
  }
  page_export out;
  out.offset = addr - (va_base_ + chunks_[ids.front()].mapped_at * page_);
  out.fds.reserve(ids.size());
  out.bytes.reserve(ids.size());
  for (const std::uint32_t id : ids) {
    auto fd = device_platform().export_handle(chunks_[id].handle);
    if (!fd) {
      for (const int f : out.fds) ::close(f);
      if (fd.error().kind == failure_kind::invalid_value)
        throw not_supported("vmm_page_pool::export_pages: a page was not created exportable: " +
                            fd.error().describe());
      throw_cuda_error(fd.error(), "vmm_page_pool::export_pages");
    }
    out.fds.push_back(fd.value());
    out.bytes.push_back(chunks_[id].pages * page_);
  }
  return out;
}

}  // namespace gpumem
