#include "gpumem/backend/vmm_mapping.hpp"

namespace gpumem {

result<vmm_mapping> vmm_mapping::create(platform& platform, int device, std::size_t size,
                                        std::size_t alignment, vmm_mapping* leftover) {
  vmm_mapping m;
  m.platform_ = &platform;
  m.device_ = device;
  m.size_ = size;
  // Each step is recorded as soon as it succeeds, so an undo releases exactly the steps
  // taken when a later one fails.
  auto undo = [&](const status& why) {
    if (!m.release() && leftover != nullptr) *leftover = std::move(m);
    return why;
  };
  auto range = platform.reserve_range(size, alignment);
  if (!range) {
    m.platform_ = nullptr;
    return range.error();
  }
  m.address_ = range.value();
  m.range_live_ = true;
  auto handle = platform.create_physical(device, size);
  if (!handle) return undo(handle.error());
  m.handle_ = handle.value();
  m.handle_live_ = true;
  if (auto s = platform.map(m.address_, size, m.handle_, 0); !s) return undo(s);
  m.mapped_ = true;
  if (auto s = platform.set_access(device, m.address_, size); !s) return undo(s);
  return m;
}

vmm_mapping& vmm_mapping::operator=(vmm_mapping&& other) noexcept {
  if (this != &other) {
    reset();
    platform_ = other.platform_;
    device_ = other.device_;
    address_ = other.address_;
    size_ = other.size_;
    handle_ = other.handle_;
    mapped_ = other.mapped_;
    handle_live_ = other.handle_live_;
    range_live_ = other.range_live_;
    other.platform_ = nullptr;
    other.mapped_ = other.handle_live_ = other.range_live_ = false;
  }
  return *this;
}

status vmm_mapping::release() {
  if (platform_ == nullptr) return status::success();
  if (mapped_) {
    if (auto s = platform_->unmap(address_, size_); !s) return s;
    mapped_ = false;
  }
  if (handle_live_) {
    if (auto s = platform_->release_physical(handle_); !s) return s;
    handle_live_ = false;
  }
  if (range_live_) {
    if (auto s = platform_->free_range(address_, size_); !s) return s;
    range_live_ = false;
  }
  platform_ = nullptr;
  return status::success();
}

}  // namespace gpumem
