// vmm_page_pool: the budget (footprint:fast), the reserved bytes up to whose last
// budget_margin_share-th the pool is a cache: a request no free block holds maps new pages,
// and freed blocks stay mapped for the requests after them, so a loop that repeats settles
// with no driver call. From there on a growth gathers free pages instead (as
// footprint:tight does on every growth).
#include <algorithm>
#include <mutex>

#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem {

std::size_t vmm_page_pool::budget_locked() const noexcept {
  const std::size_t total = device_total_bytes();
  std::size_t b = total - total / budget_headroom_share;
  if (options_.limit_bytes != 0) b = std::min(b, options_.limit_bytes);
  if (budget_set_ != 0) b = std::min(b, budget_set_);
  return b;
}

std::size_t vmm_page_pool::budget() const {
  std::lock_guard lock(mutex_);
  return budget_locked();
}

void vmm_page_pool::set_keep_free(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  keep_free_ = bytes;
}

std::size_t vmm_page_pool::keep_free() const {
  std::lock_guard lock(mutex_);
  return keep_free_;
}

void vmm_page_pool::set_budget(std::size_t bytes) {
  bool over = false;
  {
    std::lock_guard lock(mutex_);
    budget_set_ = bytes;
    over = reserved_locked() > budget_locked();
  }
  if (over) (void)trim();
}

}  // namespace gpumem
