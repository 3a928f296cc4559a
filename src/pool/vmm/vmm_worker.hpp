// vmm_worker: a helper thread that unmaps vmm_page_pool's old mappings off the allocating
// thread.
//
// Why: cuMemUnmap costs the calling thread tens of microseconds per mapping it covers while
// the GPU is busy, whether made as one call over many mappings or one call each, and a
// helper thread making such calls does not slow another thread's kernel launches
// (scripts/probes/vmm_call_split_probe.cu measures both). A remap moves free pages: they
// are mapped at the new place at once (a handle may be mapped twice), and the old mapping,
// whose last use is complete, can go whenever.
//
// Access grants stay on the allocating thread: cudaMemsetAsync / cudaMemcpyAsync refuse, at
// the call, a pointer whose access is not granted yet, even when the stream is made to wait
// for the grant on the GPU.
//
// What: unmap(va, pieces, token) queues the unmap of a run of mappings; jobs run in the
// order queued; the pool reuses that address space only after collect() reports the token
// done. One call per mapping, from the top down, so that a failure leaves a known prefix
// mapped, and no driver must accept an unmap spanning mappings. A failure stops the job and
// is reported with its token, its status and the bytes at the run's start still mapped.
// Cost: while the worker unmaps, another thread's cuMemMap or access grant waits in the
// driver (the driver serializes them), so vmm_page_pool queues a growth's old mappings only
// after that growth's maps and access grant (vmm_page_pool::hold_unmaps_).
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
    std::size_t mapped_bytes = 0;  // on failure: [va, va + mapped_bytes) is still mapped
  };

  explicit vmm_worker(platform& p);
  // Runs every queued job, then stops the thread.
  ~vmm_worker();
  vmm_worker(const vmm_worker&) = delete;
  vmm_worker& operator=(const vmm_worker&) = delete;

  // pieces: the bytes of each mapping of the run [va, va + their sum), by address.
  void unmap(std::uintptr_t va, std::vector<std::size_t> pieces, std::uint64_t token);
  // Waits until no job is queued or running.
  void drain();
  bool busy() const;
  // Moves out the unmaps finished since the last call.
  void collect(std::vector<finished_unmap>& unmaps);

 private:
  struct job {
    std::uintptr_t va = 0;
    std::vector<std::size_t> pieces;
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
