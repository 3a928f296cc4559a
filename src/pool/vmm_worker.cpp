#include "pool/vmm_worker.hpp"

#include <atomic>
#include <utility>

#include "gpumem/platform/status_error.hpp"

namespace gpumem::detail {

namespace {
// The driver's GEQ: true once `counter` has reached `ticket`, through wraparound.
bool reached(std::uint32_t counter, std::uint32_t ticket) noexcept {
  return static_cast<std::int32_t>(counter - ticket) >= 0;
}
}  // namespace

vmm_worker::vmm_worker(platform& p, int device) : platform_(p), device_(device) {
  auto mem = p.host_alloc_pinned(sizeof(std::uint32_t));
  if (!mem) throw_cuda_error(mem.error(), "vmm_page_pool: pinned counter for the map worker");
  counter_ = static_cast<std::uint32_t*>(mem.value());
  std::atomic_ref<std::uint32_t>(counter()).store(0, std::memory_order_release);
  thread_ = std::thread([this] { run(); });
}

vmm_worker::~vmm_worker() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();  // the thread runs every queued job before it stops
  (void)platform_.host_free_pinned(counter_);
}

std::uint32_t vmm_worker::grant_access(std::uintptr_t va, std::size_t bytes) {
  std::uint32_t ticket = 0;
  {
    std::lock_guard lock(mutex_);
    ticket = ++issued_;
    queue_.push_back(job{true, va, bytes, 0});
  }
  wake_.notify_one();
  return ticket;
}

void vmm_worker::unmap(std::uintptr_t va, std::size_t bytes, std::uint64_t token) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(job{false, va, bytes, token});
  }
  wake_.notify_one();
}

status vmm_worker::make_stream_wait(stream_handle stream, std::uint32_t ticket) {
  if (granted(ticket)) return status::success();  // nothing to wait for
  return platform_.stream_wait_value(stream, counter_, ticket);
}

bool vmm_worker::granted(std::uint32_t ticket) const noexcept {
  return reached(std::atomic_ref<std::uint32_t>(counter()).load(std::memory_order_acquire), ticket);
}

void vmm_worker::wait_until_granted(std::uint32_t ticket) {
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [&] { return granted(ticket); });
}

void vmm_worker::drain() {
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [&] { return queue_.empty() && !running_job_; });
}

bool vmm_worker::busy() const {
  std::lock_guard lock(mutex_);
  return !queue_.empty() || running_job_;
}

void vmm_worker::collect(std::vector<finished_unmap>& unmaps, std::vector<failed_grant>& grants) {
  std::lock_guard lock(mutex_);
  for (auto& f : finished_) unmaps.push_back(std::move(f));
  finished_.clear();
  for (auto& g : failed_grants_) grants.push_back(std::move(g));
  failed_grants_.clear();
}

void vmm_worker::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, and nothing left to do
    const job j = queue_.front();
    queue_.pop_front();
    running_job_ = true;
    lock.unlock();
    // The driver call, without the lock: the pool may queue more meanwhile.
    status st;
    if (j.grant) {
      st = platform_.set_access(device_, j.va, j.bytes);
      if (!st) st = platform_.set_access(device_, j.va, j.bytes);  // once more
    } else {
      st = platform_.unmap(j.va, j.bytes);
    }
    lock.lock();
    if (j.grant) {
      if (!st) failed_grants_.push_back(failed_grant{j.va, j.bytes, std::move(st)});
      // Advance even on failure: a stream waiting on the ticket must not hang.
      auto c = std::atomic_ref<std::uint32_t>(counter());
      c.store(c.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    } else {
      finished_.push_back(finished_unmap{j.token, std::move(st)});
    }
    running_job_ = false;
    idle_.notify_all();  // drain() and wait_until_granted() look again
  }
}

}  // namespace gpumem::detail
