#include "gpumem/pool/pinned_host_pool.hpp"

namespace gpumem {

pinned_host_pool::pinned_host_pool(platform& platform, int device, pool_options options,
                                   std::size_t min_segment_bytes)
    : upstream_(platform, device), pool_(upstream_, options, min_segment_bytes) {}

// The pool's destructor gives its segments back to upstream_ first (members are destroyed
// in reverse order), then upstream_ frees what is left.
pinned_host_pool::~pinned_host_pool() = default;

void* pinned_host_pool::allocate(std::size_t bytes, stream_handle stream) {
  return pool_.allocate(bytes, default_alignment, stream);
}

void pinned_host_pool::deallocate(void* ptr, std::size_t bytes, stream_handle stream) {
  pool_.deallocate(ptr, bytes, stream);
}

}  // namespace gpumem
