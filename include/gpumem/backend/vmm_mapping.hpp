// One piece of VMM memory owned end to end: a reserved virtual range, a physical handle
// and the mapping between them with access granted. The destructor undoes the three in
// the only legal order (unmap, release, address free), so a forgotten address free or a
// release before unmap cannot be written.
//
// Invariants: a non-empty vmm_mapping holds exactly one range of size() bytes, one handle
// of size() bytes mapped over all of it, readable and writable from device().
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpumem/platform/platform.hpp"

namespace gpumem {

class vmm_mapping {
 public:
  vmm_mapping() = default;
  // Reserves, creates, maps and grants access; on failure undoes what it did and
  // returns the failed call's status. When the undo fails too (a second driver failure),
  // what is left goes to *leftover, if given, for the caller to release later; without
  // it, it is given up after that one attempt.
  // REQUIRES: size and alignment are multiples of the device's granularity.
  static result<vmm_mapping> create(platform& platform, int device, std::size_t size,
                                    std::size_t alignment, vmm_mapping* leftover = nullptr);
  ~vmm_mapping() { reset(); }
  vmm_mapping(vmm_mapping&& other) noexcept { *this = std::move(other); }
  vmm_mapping& operator=(vmm_mapping&& other) noexcept;
  vmm_mapping(const vmm_mapping&) = delete;
  vmm_mapping& operator=(const vmm_mapping&) = delete;

  // Unmaps, releases the handle, frees the range. Stops at the first failure and keeps
  // what is left, so a later call resumes there (a range is never freed while mapped).
  status release();

  bool empty() const noexcept { return platform_ == nullptr; }
  std::uintptr_t address() const noexcept { return address_; }
  void* pointer() const noexcept { return reinterpret_cast<void*>(address_); }
  std::size_t size() const noexcept { return size_; }
  int device() const noexcept { return device_; }

 private:
  void reset() noexcept { (void)release(); }

  platform* platform_ = nullptr;
  int device_ = 0;
  std::uintptr_t address_ = 0;
  std::size_t size_ = 0;
  physical_handle handle_{};
  // Steps still to undo, each only after the one before it.
  bool mapped_ = false;
  bool handle_live_ = false;
  bool range_live_ = false;
};

}  // namespace gpumem
