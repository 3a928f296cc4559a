// vmm_page_pool's sleep and wake state (src/pool/vmm/sleep_wake.cpp has the steps and the
// invariants): which chunks sleep and where their bytes are on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>

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
  // Offloaded bytes: one pinned block for the whole pool, chunk by chunk.
  std::unique_ptr<pinned_host_pool> staging;  // kept across sleeps: pinned memory is slow to get
  void* host = nullptr;
  std::size_t host_bytes = 0;
  std::unordered_map<std::uint32_t, std::size_t> host_offset;
  std::uint64_t frees_at_sleep = 0;  // stats().deallocations when the sleep began
};

}  // namespace detail

}  // namespace gpumem
