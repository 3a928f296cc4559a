// pool_mutex: the pools' lock. A futex mutex (U. Drepper, "Futexes Are Tricky", mutex 3;
// glibc's own lock is the same): uncontended, lock and unlock are one atomic operation each,
// inline, where std::mutex calls into libc for each. Contended, a waiter sleeps in the
// kernel on the futex at once, as in glibc (std::atomic::wait spins and yields before
// sleeping, which costs a pool shared by several threads more than it saves). Not fair, as
// std::mutex is not.
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
    if (state_.exchange(unlocked, std::memory_order_release) == contended) wake_one();
  }

 private:
  // unlocked; locked with no waiter; locked, and a thread may wait (unlock wakes one).
  static constexpr int unlocked = 0, locked = 1, contended = 2;
  // From here on the state says `contended` while this thread holds or waits, so an
  // unlock never misses a sleeper (at the price of a spare wake-up).
  void lock_contended(int seen) noexcept;
  // Sleeps while the state is `contended`; wakes one sleeper.
  void sleep_while_contended() noexcept;
  void wake_one() noexcept;
  std::atomic<int> state_{unlocked};
};

}  // namespace gpumem
