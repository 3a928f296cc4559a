#include "gpumem/pool/fixed_block_pool.hpp"

#include <algorithm>

#include "gpumem/errors.hpp"

namespace gpumem {

fixed_block_pool::fixed_block_pool(memory_resource& upstream, std::size_t block_bytes,
                                   std::size_t blocks_per_chunk, std::size_t max_blocks)
    : upstream_(upstream), block_bytes_(block_bytes), max_blocks_(max_blocks) {
  if (block_bytes == 0 || block_bytes % 256 != 0)
    throw invalid_argument("fixed_block_pool: block size " + std::to_string(block_bytes) +
                           " must be a non-zero multiple of 256 bytes");
  if (blocks_per_chunk == 0) {
    blocks_per_chunk = std::max<std::size_t>(1, (std::size_t{2} << 20) / block_bytes);
    if (max_blocks != 0) blocks_per_chunk = std::min(blocks_per_chunk, max_blocks);
  } else if (max_blocks != 0 && blocks_per_chunk > max_blocks) {
    throw invalid_argument("fixed_block_pool: a chunk of " + std::to_string(blocks_per_chunk) +
                           " blocks exceeds the cap of " + std::to_string(max_blocks) + " blocks");
  }
  // Checked by division: blocks_per_chunk * block_bytes may not even fit in 64 bits.
  if (blocks_per_chunk > upstream.device_total_bytes() / block_bytes)
    throw invalid_argument("fixed_block_pool: a chunk of " + std::to_string(blocks_per_chunk) +
                           " blocks of " + format_bytes(block_bytes) + " exceeds the device");
  blocks_per_chunk_ = blocks_per_chunk;
}

fixed_block_pool::~fixed_block_pool() {
  for (std::uintptr_t base : chunk_base_) {
    if (base == 0) continue;
    try {
      upstream_.deallocate(reinterpret_cast<void*>(base), chunk_bytes());
    } catch (...) {
      // Destructors never throw.
    }
  }
}

bool fixed_block_pool::grow() {
  if (max_blocks_ != 0 && capacity_blocks() + blocks_per_chunk_ > max_blocks_) return false;
  // Host bookkeeping first, so nothing can throw once device memory is held.
  chunk_base_.reserve(chunk_base_.size() + 1);
  used_.reserve((chunk_base_.size() + 1) * blocks_per_chunk_);
  free_.reserve(free_.size() + blocks_per_chunk_);
  void* p = nullptr;
  try {
    p = upstream_.allocate(chunk_bytes());
  } catch (const out_of_memory&) {
    return false;
  }
  // Reuse an empty slot so ids stay dense.
  auto slot = std::find(chunk_base_.begin(), chunk_base_.end(), std::uintptr_t{0});
  const std::size_t chunk = static_cast<std::size_t>(slot - chunk_base_.begin());
  if (slot == chunk_base_.end()) {
    chunk_base_.push_back(0);
    used_.resize(chunk_base_.size() * blocks_per_chunk_, 0);
  }
  chunk_base_[chunk] = reinterpret_cast<std::uintptr_t>(p);
  ++live_chunks_;
  // Push in reverse so the lowest ids come out first.
  for (std::size_t i = blocks_per_chunk_; i-- > 0;)
    free_.push_back(static_cast<block_id>(chunk * blocks_per_chunk_ + i));
  return true;
}

std::optional<fixed_block_pool::block_id> fixed_block_pool::try_allocate() {
  if (free_.empty() && !grow()) return std::nullopt;
  const block_id id = free_.back();
  free_.pop_back();
  used_[id] = used;
  return id;
}

fixed_block_pool::block_id fixed_block_pool::allocate() {
  if (auto id = try_allocate()) return *id;
  throw out_of_memory("gpumem: fixed_block_pool out of blocks: " + std::to_string(used_blocks()) +
                      " of " + std::to_string(capacity_blocks()) + " blocks of " +
                      format_bytes(block_bytes_) + " in use (" + format_bytes(reserved_bytes()) +
                      " reserved" +
                      (max_blocks_ != 0 ? ", cap " + std::to_string(max_blocks_) + " blocks" : "") +
                      "); upstream '" + std::string(upstream_.name()) + "' could not give a " +
                      format_bytes(chunk_bytes()) + " chunk");
}

void fixed_block_pool::free(block_id id) {
  if (id >= used_.size() || chunk_base_[id / blocks_per_chunk_] == 0)
    throw invalid_argument("fixed_block_pool: block id " + std::to_string(id) +
                           " was never allocated");
  if (used_[id] == never_used)
    throw invalid_argument("fixed_block_pool: block id " + std::to_string(id) +
                           " was never allocated (it is free and has never been handed out)");
  if (used_[id] == freed)
    throw invalid_argument("fixed_block_pool: block id " + std::to_string(id) +
                           " is already free (double free)");
  used_[id] = freed;
  free_.push_back(id);
}

bool fixed_block_pool::reserve(std::size_t blocks) {
  while (capacity_blocks() < blocks)
    if (!grow()) return false;
  return true;
}

std::size_t fixed_block_pool::shrink() {
  std::vector<std::size_t> in_use(chunk_base_.size(), 0);
  for (std::size_t id = 0; id < used_.size(); ++id)
    in_use[id / blocks_per_chunk_] += used_[id] == used ? 1 : 0;
  std::size_t given = 0;
  for (std::size_t c = 0; c < chunk_base_.size(); ++c) {
    if (chunk_base_[c] == 0 || in_use[c] != 0) continue;
    try {
      upstream_.deallocate(reinterpret_cast<void*>(chunk_base_[c]), chunk_bytes());
    } catch (const cuda_error&) {
      continue;  // keep the chunk; the pool stays consistent
    }
    chunk_base_[c] = 0;
    std::fill_n(used_.begin() + static_cast<std::ptrdiff_t>(c * blocks_per_chunk_), blocks_per_chunk_,
                never_used);
    --live_chunks_;
    given += blocks_per_chunk_;
    std::erase_if(free_, [&](block_id id) { return id / blocks_per_chunk_ == c; });
  }
  return given;
}

std::string fixed_block_pool::validate() const {
  std::vector<std::uint8_t> seen(used_.size(), 0);
  for (block_id id : free_) {
    if (id >= used_.size() || chunk_base_[id / blocks_per_chunk_] == 0) return "free id out of range";
    if (used_[id] == used) return "id both free and used";
    if (seen[id]++ != 0) return "id on the free stack twice";
  }
  std::size_t used_count = 0;
  for (std::size_t id = 0; id < used_.size(); ++id) {
    if (chunk_base_[id / blocks_per_chunk_] == 0) {
      if (used_[id] != never_used) return "used id in an empty chunk slot";
      continue;
    }
    if (used_[id] != used && seen[id] == 0) return "id neither free nor used";
    used_count += used_[id] == used ? 1 : 0;
  }
  if (used_count + free_.size() != capacity_blocks()) return "block counts do not add up";
  return {};
}

}  // namespace gpumem
