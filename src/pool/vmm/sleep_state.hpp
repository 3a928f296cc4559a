// vmm_page_pool's sleep and wake state (src/pool/vmm/sleep_wake.cpp has the steps and the
// invariants): which chunks sleep and where their bytes are on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "gpumem/pool/pinned_host_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem {

namespace detail {

struct vmm_sleep_state {
  enum class phase : std::uint8_t { mapped, unmapped, released };
  std::map<std::uint32_t, phase> chunks;  // by chunk id: those sleep() has begun on
  std::size_t released_pages = 0;
  sleep_mode mode = sleep_mode::offload;
  bool complete = false;  // the last sleep() finished
  // Offloaded bytes: one pinned block for the whole pool, its pages in use in address order.
  std::unique_ptr<pinned_host_pool> staging;  // kept across sleeps: pinned memory is slow to get
  void* host = nullptr;
  std::size_t host_bytes = 0;
  // Where the copied pages lie in `host`: runs of pages side by side in the address space
  // and in `host`, by first page (an index of the page table). Only pages in use are
  // copied, so `host` holds the live bytes alone.
  struct host_run {
    std::size_t pages = 0;
    std::size_t offset = 0;
  };
  std::map<std::size_t, host_run> host_runs;

  // Appends the page `page` at the end of the layout (host_bytes grows by `page_bytes`).
  void add_host_page(std::size_t page, std::size_t page_bytes) {
    if (!host_runs.empty()) {
      auto& [first, run] = *host_runs.rbegin();
      if (first + run.pages == page && run.offset + run.pages * page_bytes == host_bytes) {
        run.pages += 1;
        host_bytes += page_bytes;
        return;
      }
    }
    host_runs.emplace(page, host_run{1, host_bytes});
    host_bytes += page_bytes;
  }
  // The offset in `host` of the pages [first, first + pages), which lie in one run; throws
  // std::logic_error where they were not copied (a broken invariant, not an input).
  std::size_t host_offset(std::size_t first, std::size_t pages, std::size_t page_bytes) const {
    auto it = host_runs.upper_bound(first);
    if (it != host_runs.begin()) {
      --it;
      if (first + pages <= it->first + it->second.pages)
        return it->second.offset + (first - it->first) * page_bytes;
    }
    throw std::logic_error("vmm_page_pool: pages " + std::to_string(first) + "+" +
                           std::to_string(pages) + " have no host copy");
  }
  void clear_host_layout() noexcept {
    host = nullptr;
    host_bytes = 0;
    host_runs.clear();
  }
  std::uint64_t frees_at_sleep = 0;  // stats().deallocations when the sleep began
};

}  // namespace detail

}  // namespace gpumem
