#include "gpumem/pool/core/pool_mutex.hpp"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace gpumem {

static_assert(sizeof(std::atomic<int>) == sizeof(int) && std::atomic<int>::is_always_lock_free,
              "the futex word is the atomic's int");

void pool_mutex::lock_contended(int seen) noexcept {
  if (seen != contended) seen = state_.exchange(contended, std::memory_order_acquire);
  while (seen != unlocked) {
    sleep_while_contended();
    seen = state_.exchange(contended, std::memory_order_acquire);
  }
}

#if defined(__linux__)
// The kernel compares the word with `contended` before sleeping: an unlock in between makes
// the call return at once. Spurious returns loop back through lock_contended.
void pool_mutex::sleep_while_contended() noexcept {
  syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAIT_PRIVATE, contended, nullptr,
          nullptr, 0);
}
void pool_mutex::wake_one() noexcept {
  syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}
#else
void pool_mutex::sleep_while_contended() noexcept {
  state_.wait(contended, std::memory_order_relaxed);
}
void pool_mutex::wake_one() noexcept { state_.notify_one(); }
#endif

}  // namespace gpumem
