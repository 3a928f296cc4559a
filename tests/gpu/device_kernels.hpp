// Kernels for the GPU tests, compiled at run time with NVRTC (the project compiles no .cu
// files): one fills an allocation with a pattern that depends on a seed and on each byte's
// offset, one counts the bytes that differ from that pattern, one writes a single byte.
// A block handed out twice, reused before its last use, or shifted shows up as a mismatch;
// a write into an unmapped page is an illegal address. Without CUDA or NVRTC every call
// returns an error saying so (the tests skip before calling).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpumem_test {

// The byte the pattern puts at `offset` for `seed` (the host-side twin of the kernel's).
std::uint8_t pattern_byte(std::uint64_t seed, std::uint64_t offset);

class device_kernels {
 public:
  // Compiles and loads the kernels for the current device once; later calls reuse them.
  // Returns nullptr and sets *why when that is impossible.
  static device_kernels* get(std::string* why);

  // All launches are asynchronous on `stream` (a cudaStream_t; 0 is the default stream).
  // They return "" on success, else the CUDA error's name and text.
  std::string fill(void* p, std::size_t n, std::uint64_t seed, void* stream);
  // Adds the number of bytes of [p, p+n) that differ from the pattern to *device_counter
  // (a device-resident 64-bit counter).
  std::string count_mismatches(const void* p, std::size_t n, std::uint64_t seed,
                               unsigned long long* device_counter, void* stream);
  std::string poke(void* p, std::size_t offset, std::uint8_t value, void* stream);
  // Waits for `stream`; "" or the error a kernel hit (e.g. cudaErrorIllegalAddress).
  std::string synchronize(void* stream);

 private:
  device_kernels() = default;
  void* fill_ = nullptr;
  void* count_ = nullptr;
  void* poke_ = nullptr;
};

}  // namespace gpumem_test
