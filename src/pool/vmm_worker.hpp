// vmm_worker: a helper thread that unmaps vmm_page_pool's old mappings off the allocating
// thread.
//
// Why: on the H200, cuMemUnmap costs the calling thread ~35-45 us per mapping it covers
// while the GPU is busy (~25 us idle), whether made as one call over many mappings or one
// call each; a helper thread making such calls does not slow another thread's kernel
// launches (scripts/probes/vmm_call_split_probe.cu, 2026-12-01). A remap moves free pages:
// they are mapped at the new place at once (a handle may be mapped twice), and the old
// mapping, whose last use is complete, can go whenever.
//
// (Access grants cannot move here: cudaMemsetAsync / cudaMemcpyAsync refuse, at the call, a
// pointer whose access is not granted yet, even when the stream is made to wait for the
// grant on the GPU; tried on the H200 the same day.)
//
// What: unmap(va, bytes, token) queues an unmap; jobs run in the order queued; the pool
// reuses that address space only after collect() reports the token done. A failed unmap is
// reported with its token and status: the pool keeps the old mapping.
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

  explicit vmm_worker(platform& p);
  // Runs every queued job, then stops the thread.
  ~vmm_worker();
  vmm_worker(const vmm_worker&) = delete;
  vmm_worker& operator=(const vmm_worker&) = delete;

  void unmap(std::uintptr_t va, std::size_t bytes, std::uint64_t token);
  // Waits until no job is queued or running.
  void drain();
  bool busy() const;
  // Moves out the unmaps finished since the last call.
  void collect(std::vector<finished_unmap>& unmaps);

 private:
  struct job {
    std::uintptr_t va = 0;
    std::size_t bytes = 0;
    std::uint64_t token = 0;  // the pool's name for it
  };
  void run();

  platform& platform_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;  // a job was queued, or stop
  std::condition_variable idle_;  // the queue ran empty
  std::deque<job> queue_;
  bool running_job_ = false;
  bool stop_ = false;
  std::vector<finished_unmap> finished_;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace gpumem::detail
