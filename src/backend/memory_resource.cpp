#include "gpumem/backend/memory_resource.hpp"

#include <cstdio>
#include <sstream>

#include "gpumem/errors.hpp"
#include "gpumem/platform/status_error.hpp"

namespace gpumem {

std::string format_bytes(std::size_t bytes) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  char buf[48];
  if (unit == 0)
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", value, units[unit]);
  return buf;
}

memory_resource::memory_resource(platform& platform, int device)
    : platform_(platform), device_(device) {
  auto count = platform_.device_count();
  if (!count) throw_cuda_error(count.error(), "memory_resource: device count");
  if (device < 0 || device >= count.value())
    throw invalid_argument("device " + std::to_string(device) + " does not exist (" +
                           std::to_string(count.value()) + " device(s) on the " +
                           std::string(platform_.kind()) + " platform)");
  auto props = platform_.properties(device);
  if (!props) throw_cuda_error(props.error(), "memory_resource: device properties");
  device_total_ = props.value().total_memory;
}

namespace {
// The refusals of allocate(), out of its hot path.
[[noreturn, gnu::cold, gnu::noinline]] void refuse_request(const memory_resource& r,
                                                          std::size_t bytes,
                                                          std::size_t alignment) {
  if (bytes == 0)
    throw invalid_argument("allocate of 0 bytes from the '" + std::string(r.name()) +
                           "' resource: sizes must be at least 1 byte");
  if (bytes > r.device_total_bytes())
    throw invalid_argument("allocate of " + format_bytes(bytes) + " from the '" +
                           std::string(r.name()) + "' resource exceeds device " +
                           std::to_string(r.device()) + "'s total memory of " +
                           format_bytes(r.device_total_bytes()));
  throw invalid_argument("alignment " + std::to_string(alignment) + " for the '" +
                         std::string(r.name()) +
                         "' resource must be a power of two no larger than " +
                         std::to_string(r.max_alignment()));
}
}  // namespace

void* memory_resource::allocate_aligned(std::size_t bytes, std::size_t alignment,
                                        stream_handle stream) {
  if (bytes - 1 >= device_total_ || alignment == 0 || (alignment & (alignment - 1)) != 0 ||
      alignment > max_alignment())
    refuse_request(*this, bytes, alignment);
  return do_allocate(bytes, alignment, stream);
}

void* memory_resource::allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) {
  // bytes - 1 wraps for 0: one comparison refuses 0 and more than the device holds. Every
  // resource takes alignments up to default_alignment (max_alignment()'s contract): only
  // larger ones, or bad input, leave this path, which then makes no call but the tail call
  // (no registers to save: ~30 instructions a call before, callgrind).
  if (bytes - 1 >= device_total_ || (alignment & (alignment - 1)) != 0 || alignment == 0 ||
      alignment > default_alignment) [[unlikely]]
    return allocate_aligned(bytes, alignment, stream);
  return do_allocate(bytes, alignment, stream);
}

void memory_resource::deallocate(void* ptr, std::size_t bytes, stream_handle stream) {
  do_deallocate(ptr, bytes, stream);
}

void memory_resource::throw_out_of_memory(std::size_t bytes, const status& cause,
                                          const std::string& holdings) const {
  std::ostringstream report;
  report << "gpumem: out of memory on device " << device_ << " (" << platform_.kind()
         << "): the '" << name() << "' resource could not allocate " << format_bytes(bytes)
         << " (" << bytes << " bytes).\n  cause: " << cause.describe() << "\n";
  auto info = platform_.mem_info(device_);
  if (info)
    report << "  device: " << format_bytes(info.value().total) << " total, "
           << format_bytes(info.value().free) << " free\n";
  else
    report << "  device: memory info unavailable (" << info.error().describe() << ")\n";
  report << "  this resource holds: " << holdings;
  throw out_of_memory(report.str());
}

void memory_resource::throw_cuda_error(const status& cause, const char* where) const {
  gpumem::throw_cuda_error(cause, where);
}

}  // namespace gpumem
