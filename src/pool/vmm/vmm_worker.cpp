#include "pool/vmm/vmm_worker.hpp"

#include <utility>

namespace gpumem::detail {

vmm_worker::vmm_worker(platform& p) : platform_(p), thread_([this] { run(); }) {}

vmm_worker::~vmm_worker() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();  // the thread runs every queued job before it stops
}

void vmm_worker::unmap(std::uintptr_t va, std::vector<std::size_t> pieces, std::uint64_t token) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(job{va, std::move(pieces), token});
  }
  wake_.notify_one();
}

void vmm_worker::drain() {
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [&] { return queue_.empty() && !running_job_; });
}

bool vmm_worker::busy() const {
  std::lock_guard lock(mutex_);
  return !queue_.empty() || running_job_;
}

void vmm_worker::collect(std::vector<finished_unmap>& unmaps) {
  std::lock_guard lock(mutex_);
  for (auto& f : finished_) unmaps.push_back(std::move(f));
  finished_.clear();
}

void vmm_worker::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, and nothing left to do
    const job j = std::move(queue_.front());
    queue_.pop_front();
    running_job_ = true;
    lock.unlock();  // more may be queued meanwhile
    std::size_t mapped = 0;
    for (std::size_t piece : j.pieces) mapped += piece;
    status st;
    for (auto piece = j.pieces.rbegin(); piece != j.pieces.rend(); ++piece) {
      st = platform_.unmap(j.va + mapped - *piece, *piece);
      if (!st) break;
      mapped -= *piece;
    }
    lock.lock();
    finished_.push_back(finished_unmap{j.token, std::move(st), mapped});
    running_job_ = false;
    if (queue_.empty()) idle_.notify_all();
  }
}

}  // namespace gpumem::detail
