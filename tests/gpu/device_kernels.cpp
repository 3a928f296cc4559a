#include "gpu/device_kernels.hpp"

#include <mutex>
#include <utility>
#include <vector>

#if defined(GPUMEM_TEST_HAVE_NVRTC)
#include <cuda_runtime.h>
#include <nvrtc.h>
#endif

namespace gpumem_test {

namespace {

// The pattern: a 64-bit mix of (seed, offset), low byte. The same text is compiled into
// the kernels below so host and device agree.
#define GPUMEM_PATTERN_SOURCE                                                   \
  "__host__ __device__ inline unsigned char pattern_byte(unsigned long long s,\n" \
  "                                                      unsigned long long i) {\n" \
  "  unsigned long long x = s * 0x9E3779B97F4A7C15ull + i;\n"                   \
  "  x ^= x >> 31; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 29;\n"                 \
  "  return (unsigned char)(x ^ (x >> 8));\n"                                   \
  "}\n"

[[maybe_unused]] constexpr const char* kernel_source =
    GPUMEM_PATTERN_SOURCE
    "extern \"C\" __global__ void gpumem_fill(unsigned char* p, unsigned long long n,\n"
    "                                         unsigned long long seed) {\n"
    "  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;\n"
    "       i < n; i += (unsigned long long)gridDim.x * blockDim.x)\n"
    "    p[i] = pattern_byte(seed, i);\n"
    "}\n"
    "extern \"C\" __global__ void gpumem_count_mismatches(const unsigned char* p,\n"
    "    unsigned long long n, unsigned long long seed, unsigned long long* bad) {\n"
    "  unsigned long long mine = 0;\n"
    "  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;\n"
    "       i < n; i += (unsigned long long)gridDim.x * blockDim.x)\n"
    "    mine += p[i] != pattern_byte(seed, i);\n"
    "  if (mine != 0) atomicAdd(bad, mine);\n"
    "}\n"
    "extern \"C\" __global__ void gpumem_poke(unsigned char* p, unsigned long long offset,\n"
    "                                         unsigned char value) {\n"
    "  p[offset] = value;\n"
    "}\n";

}  // namespace

std::uint8_t pattern_byte(std::uint64_t s, std::uint64_t i) {
  std::uint64_t x = s * 0x9E3779B97F4A7C15ull + i;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<std::uint8_t>(x ^ (x >> 8));
}

#if defined(GPUMEM_TEST_HAVE_NVRTC)

namespace {

std::string cuda_text(cudaError_t e) {
  return e == cudaSuccess ? std::string{}
                          : std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// Blocks for a grid-stride loop over n bytes: enough to fill the GPU, never zero.
unsigned blocks_for(std::size_t n) {
  const std::size_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < 1024 ? blocks : 1024));
}

std::string launch(void* kernel, unsigned blocks, void** args, void* stream) {
  return cuda_text(cudaLaunchKernel(kernel, dim3(blocks), dim3(256), args, 0,
                                    static_cast<cudaStream_t>(stream)));
}

}  // namespace

device_kernels* device_kernels::get(std::string* why) {
  static std::once_flag once;
  static device_kernels* kernels = nullptr;
  static std::string failure;
  std::call_once(once, [] {
    int device = 0, major = 0, minor = 0;
    if (auto e = cudaGetDevice(&device); e != cudaSuccess) return void(failure = cuda_text(e));
    (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    nvrtcProgram program;
    if (nvrtcCreateProgram(&program, kernel_source, "gpumem_test_kernels.cu", 0, nullptr,
                           nullptr) != NVRTC_SUCCESS)
      return void(failure = "nvrtcCreateProgram failed");
    // PTX for this device's architecture; the driver compiles it when loading.
    const std::string arch = "--gpu-architecture=compute_" + std::to_string(major * 10 + minor);
    const char* options[] = {arch.c_str()};
    const nvrtcResult compiled = nvrtcCompileProgram(program, 1, options);
    std::size_t size = 0;
    if (compiled != NVRTC_SUCCESS) {
      (void)nvrtcGetProgramLogSize(program, &size);
      std::string log(size, '\0');
      (void)nvrtcGetProgramLog(program, log.data());
      failure = std::string("NVRTC: ") + nvrtcGetErrorString(compiled) + "\n" + log;
      (void)nvrtcDestroyProgram(&program);
      return;
    }
    (void)nvrtcGetPTXSize(program, &size);
    std::vector<char> ptx(size);
    (void)nvrtcGetPTX(program, ptx.data());
    (void)nvrtcDestroyProgram(&program);
    cudaLibrary_t library;
    if (auto e = cudaLibraryLoadData(&library, ptx.data(), nullptr, nullptr, 0, nullptr,
                                     nullptr, 0);
        e != cudaSuccess)
      return void(failure = "cudaLibraryLoadData: " + cuda_text(e));
    auto* k = new device_kernels();  // lives as long as the process, like the library
    cudaKernel_t fill, count, poke;
    for (auto [name, out] : {std::pair{"gpumem_fill", &fill},
                             std::pair{"gpumem_count_mismatches", &count},
                             std::pair{"gpumem_poke", &poke}})
      if (auto e = cudaLibraryGetKernel(out, library, name); e != cudaSuccess) {
        delete k;
        return void(failure = std::string("cudaLibraryGetKernel(") + name + "): " + cuda_text(e));
      }
    k->fill_ = reinterpret_cast<void*>(fill);
    k->count_ = reinterpret_cast<void*>(count);
    k->poke_ = reinterpret_cast<void*>(poke);
    kernels = k;
  });
  if (kernels == nullptr && why != nullptr) *why = failure;
  return kernels;
}

std::string device_kernels::fill(void* p, std::size_t n, std::uint64_t seed, void* stream) {
  unsigned long long count = n, s = seed;
  void* args[] = {&p, &count, &s};
  return launch(fill_, blocks_for(n), args, stream);
}

std::string device_kernels::count_mismatches(const void* p, std::size_t n, std::uint64_t seed,
                                             unsigned long long* device_counter, void* stream) {
  unsigned long long count = n, s = seed;
  void* args[] = {&p, &count, &s, &device_counter};
  return launch(count_, blocks_for(n), args, stream);
}

std::string device_kernels::poke(void* p, std::size_t offset, std::uint8_t value, void* stream) {
  unsigned long long at = offset;
  unsigned char v = value;
  void* args[] = {&p, &at, &v};
  return launch(poke_, 1, args, stream);
}

std::string device_kernels::synchronize(void* stream) {
  return cuda_text(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

#else  // no CUDA toolkit or no NVRTC at build time

device_kernels* device_kernels::get(std::string* why) {
  if (why != nullptr) *why = "built without the CUDA toolkit's NVRTC";
  return nullptr;
}
std::string device_kernels::fill(void*, std::size_t, std::uint64_t, void*) { return "no NVRTC"; }
std::string device_kernels::count_mismatches(const void*, std::size_t, std::uint64_t,
                                             unsigned long long*, void*) {
  return "no NVRTC";
}
std::string device_kernels::poke(void*, std::size_t, std::uint8_t, void*) { return "no NVRTC"; }
std::string device_kernels::synchronize(void*) { return "no NVRTC"; }

#endif

}  // namespace gpumem_test
