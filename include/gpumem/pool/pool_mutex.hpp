// pool_mutex: the pools' lock. A futex mutex (U. Drepper, "Futexes Are Tricky", mutex 3):
// uncontended, lock and unlock are one atomic operation each, inline, where std::mutex
// calls into libc for each (pthread_mutex_lock and unlock took 35 instructions of a
// mixed-size pair, sim, callgrind). Contended, a waiter sleeps in the kernel
// (std::atomic::wait), as on std::mutex; it is not fair, nor is std::mutex.
// Lockable: for std::lock_guard, std::unique_lock and std::scoped_lock.
#pragma once

#include <atomic>

namespace gpumem {

class pool_mutex {
 public:
  pool_mutex() = default;
  pool_mutex(const pool_mutex&) = delete;
  pool_mutex& operator=(const pool_mutex&) = delete;

  void lock() noexcept {
    int seen = unlocked;
    if (!state_.compare_exchange_strong(seen, locked, std::memory_order_acquire,
                                        std::memory_order_relaxed))
      lock_contended(seen);
  }
  bool try_lock() noexcept {
    int seen = unlocked;
    return state_.compare_exchange_strong(seen, locked, std::memory_order_acquire,
                                          std::memory_order_relaxed);
  }
  void unlock() noexcept {
    if (state_.exchange(unlocked, std::memory_order_release) == contended) state_.notify_one();
  }

 private:
  // unlocked; locked with no waiter; locked, and a thread may wait (unlock wakes one).
  static constexpr int unlocked = 0, locked = 1, contended = 2;
  void lock_contended(int seen) noexcept {
    // From here on the state says `contended` while this thread holds or waits, so an
    // unlock never misses a sleeper (at the price of a spare wake-up).
    if (seen != contended) seen = state_.exchange(contended, std::memory_order_acquire);
    while (seen != unlocked) {
      state_.wait(contended, std::memory_order_relaxed);
      seen = state_.exchange(contended, std::memory_order_acquire);
    }
  }
  std::atomic<int> state_{unlocked};
};

}  // namespace gpumem
