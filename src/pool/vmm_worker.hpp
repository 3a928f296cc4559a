// vmm_worker: a helper thread that makes vmm_page_pool's slow driver calls off the
// allocating thread.
//
// Why: on the H200, cuMemSetAccess and cuMemUnmap cost the calling thread ~35-45 us per
// mapping they cover while the GPU is busy (~25-35 us idle), whether made as one call or
// many; cuMemMap costs ~1 us. A helper thread making those calls does not slow another
// thread's kernel launches (scripts/probes/vmm_call_split_probe.cu, 2026-12-01). A training
// step that remaps ~600 one-page handles spends ~45 ms of its launching thread there.
//
// What:
//  - grant_access(va, bytes) queues an access grant and returns its ticket. The pool then
//    makes the stream that gets the memory wait on the GPU until the worker's counter (in
//    pinned host memory) reaches the ticket (platform::stream_wait_value), so kernels
//    queued after the allocation run only once access is granted; the allocating thread
//    goes on at once.
//  - unmap(va, bytes, token) queues the unmapping of an old mapping whose last use is
//    complete; the pool reuses that address space only after collect() reports it done.
//  - Jobs run in the order queued: an unmap queued after a grant over the same pages runs
//    after it.
//
// Failures: a grant that fails twice is recorded and the counter still advances (a stream
// must never wait forever); collect() hands it to the pool, which grants again on its own
// thread and throws at its next call (work queued on that memory meanwhile may have
// faulted). A failed unmap is reported with its token; the pool keeps the old mapping.
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "gpumem/platform.hpp"

namespace gpumem::detail {

class vmm_worker {
 public:
  struct finished_unmap {
    std::uint64_t token = 0;
    status result;
  };
  struct failed_grant {
    std::uintptr_t va = 0;
    std::size_t bytes = 0;
    status result;
  };

  // Throws gpumem::cuda_error when the counter's pinned memory cannot be allocated.
  vmm_worker(platform& p, int device);
  // Runs every queued job, then stops the thread and frees the counter.
  ~vmm_worker();
  vmm_worker(const vmm_worker&) = delete;
  vmm_worker& operator=(const vmm_worker&) = delete;

  std::uint32_t grant_access(std::uintptr_t va, std::size_t bytes);
  void unmap(std::uintptr_t va, std::size_t bytes, std::uint64_t token);
  // Work queued on `stream` from now on waits until `ticket` is granted. On failure (e.g. a
  // platform without stream memory operations) the caller must not hand the memory out
  // before granted(ticket): wait_until_granted() does that on the host.
  status make_stream_wait(stream_handle stream, std::uint32_t ticket);
  bool granted(std::uint32_t ticket) const noexcept;
  void wait_until_granted(std::uint32_t ticket);
  // Waits until no job is queued or running.
  void drain();
  bool busy() const;
  // Moves out the unmaps finished and the grants failed since the last call.
  void collect(std::vector<finished_unmap>& unmaps, std::vector<failed_grant>& grants);

 private:
  struct job {
    bool grant = false;
    std::uintptr_t va = 0;
    std::size_t bytes = 0;
    std::uint64_t token = 0;  // unmap: the pool's name for it
  };
  void run();
  std::uint32_t& counter() const noexcept { return *counter_; }

  platform& platform_;
  int device_;
  std::uint32_t* counter_ = nullptr;  // pinned host memory: grants done (the last ticket)
  mutable std::mutex mutex_;
  std::condition_variable wake_;      // a job was queued, or stop
  std::condition_variable idle_;      // the queue ran empty
  std::deque<job> queue_;
  bool running_job_ = false;
  bool stop_ = false;
  std::uint32_t issued_ = 0;          // last ticket handed out
  std::vector<finished_unmap> finished_;
  std::vector<failed_grant> failed_grants_;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace gpumem::detail
