// pool_mutex: the lock of a pool's shared state (pool_base::mutex_).
//
// Large requests always take it (their blocks merge at once, never held in a thread cache),
// each for well under a microsecond. A plain std::mutex puts a waiter to sleep in the
// kernel at once, and the holder wakes it with a system call: with several threads making
// large requests, the hand-offs cost more than the work they guard (pool_bench on the H200:
// 4 MiB pairs on one pool, 135 ns a pair with one thread, 2,240 ns with eight). glibc's
// adaptive mutex spins a bounded while first, so a waiter usually takes the lock as soon as
// it is let go, and sleeps only when the holder stays longer (a growth calling the driver).
// The uncontended path is the same compare-exchange as std::mutex's. Elsewhere: std::mutex.
#pragma once

#include <mutex>
#if __has_include(<pthread.h>)
#include <pthread.h>
#endif

namespace gpumem::detail {

#if defined(__GLIBC__) && defined(PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP)
class pool_mutex {
 public:
  pool_mutex() noexcept = default;
  ~pool_mutex() { pthread_mutex_destroy(&m_); }
  pool_mutex(const pool_mutex&) = delete;
  pool_mutex& operator=(const pool_mutex&) = delete;

  // Errors are those of a misuse (a lock held twice, an unlock by another thread), which
  // the default mutex type does not report either.
  void lock() noexcept { pthread_mutex_lock(&m_); }
  bool try_lock() noexcept { return pthread_mutex_trylock(&m_) == 0; }
  void unlock() noexcept { pthread_mutex_unlock(&m_); }

 private:
  pthread_mutex_t m_ = PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP;
};
#else
using pool_mutex = std::mutex;
#endif

}  // namespace gpumem::detail
