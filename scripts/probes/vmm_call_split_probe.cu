// Which VMM call costs the host time while the GPU is busy, and does it stop another thread
// from launching kernels? Three questions, each timed while 200 copies of 1 GiB run:
//  1. 600 one-page cuMemMap alone, then one cuMemSetAccess over the 600 mappings, then 600
//     cuMemUnmap, and cuMemUnmap of the 600 mappings in one call: per call or per mapping?
//  2. A launching thread queues 20,000 tiny kernels on a second stream while a helper thread
//     makes those calls: is the launch loop slower than with no helper?
//  3. Can a stream wait on a flag in pinned host memory that a host thread sets later
//     (cuStreamWaitValue32), i.e. can a mapping made off the launching thread be ordered
//     before the kernels that use it?
// Not part of the build; on a GPU machine:
//   nvcc -O2 -arch=sm_90 -o split scripts/probes/vmm_call_split_probe.cu -lcuda && ./split
#include <cuda.h>
#include <cuda_runtime.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
#define CK(x) do { CUresult rc_ = (x); if (rc_ != CUDA_SUCCESS) { const char* s; cuGetErrorString(rc_, &s); printf("%s failed: %s\n", #x, s); std::exit(1); } } while (0)
__global__ void copy(const float4* __restrict__ a, float4* __restrict__ b, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) b[i] = a[i];
}
__global__ void tiny(int* p) { if (threadIdx.x == 0) p[blockIdx.x] += 1; }
__global__ void touch(float* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = 1.0f;
}
using clk = std::chrono::steady_clock;
static double ms_since(clk::time_point t0) { return std::chrono::duration<double, std::milli>(clk::now() - t0).count(); }

int main() {
  cudaFree(0);
  CUcontext ctx; CK(cuCtxGetCurrent(&ctx));
  const size_t bytes = 1ull << 30, n = bytes / sizeof(float4);
  float4 *a, *b;
  cudaMalloc(&a, bytes); cudaMalloc(&b, bytes);
  int* counters; cudaMalloc(&counters, 4096);
  cudaStream_t s, s2; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
  CUmemAllocationProp prop{}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  const size_t g = 2 << 20; const int pages = 600;
  CUmemAccessDesc acc{}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va; CK(cuMemAddressReserve(&va, 2 * pages * g, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> h(pages);
  for (auto& x : h) CK(cuMemCreate(&x, g, &prop, 0));
  auto busy = [&] { cudaDeviceSynchronize(); for (int k = 0; k < 200; ++k) copy<<<1056, 512, 0, s>>>(a, b, n); };

  // 1. Which call costs what.
  for (int rep = 0; rep < 3; ++rep) {
    busy();
    auto t0 = clk::now();
    for (int i = 0; i < pages; ++i) CK(cuMemMap(va + i * g, g, 0, h[i], 0));
    double map_ms = ms_since(t0); t0 = clk::now();
    CK(cuMemSetAccess(va, pages * g, &acc, 1));
    double access_ms = ms_since(t0); t0 = clk::now();
    for (int i = 0; i < pages; ++i) CK(cuMemUnmap(va + i * g, g));
    double unmap_ms = ms_since(t0);
    for (int i = 0; i < pages; ++i) CK(cuMemMap(va + i * g, g, 0, h[i], 0));
    CK(cuMemSetAccess(va, pages * g, &acc, 1));
    t0 = clk::now();
    CK(cuMemUnmap(va, pages * g));
    double unmap_one_ms = ms_since(t0);
    // Access over 60 mappings only (a tenth): does access scale with mappings in the range?
    for (int i = 0; i < 60; ++i) CK(cuMemMap(va + i * g, g, 0, h[i], 0));
    t0 = clk::now();
    CK(cuMemSetAccess(va, 60 * g, &acc, 1));
    double access60_ms = ms_since(t0);
    CK(cuMemUnmap(va, 60 * g));
    cudaDeviceSynchronize();
    printf("rep %d busy GPU: 600 maps %.2f ms | 1 access over 600 mappings %.2f ms | access over 60 mappings %.2f ms | 600 unmaps %.2f ms | 1 unmap over 600 mappings %.2f ms\n",
           rep, map_ms, access_ms, access60_ms, unmap_ms, unmap_one_ms);
  }
  // Idle GPU, the same.
  {
    cudaDeviceSynchronize();
    auto t0 = clk::now();
    for (int i = 0; i < pages; ++i) CK(cuMemMap(va + i * g, g, 0, h[i], 0));
    double map_ms = ms_since(t0); t0 = clk::now();
    CK(cuMemSetAccess(va, pages * g, &acc, 1));
    double access_ms = ms_since(t0); t0 = clk::now();
    CK(cuMemUnmap(va, pages * g));
    printf("idle GPU: 600 maps %.2f ms | 1 access over 600 mappings %.2f ms | 1 unmap over 600 mappings %.2f ms\n", map_ms, access_ms, ms_since(t0));
  }

  // 2. Does a helper thread's VMM work slow a launching thread?
  auto launch_loop = [&] {
    auto t0 = clk::now();
    for (int k = 0; k < 20000; ++k) tiny<<<1, 32, 0, s2>>>(counters);
    return ms_since(t0);
  };
  for (int rep = 0; rep < 3; ++rep) {
    for (int helper = 0; helper < 2; ++helper) {
      busy();
      cudaStreamSynchronize(s2);
      std::atomic<bool> go{false};
      double helper_ms = 0;
      std::thread t;
      if (helper) t = std::thread([&] {
        cuCtxSetCurrent(ctx);
        while (!go.load()) {}
        auto t0 = clk::now();
        for (int i = 0; i < pages; ++i) CK(cuMemMap(va + i * g, g, 0, h[i], 0));
        CK(cuMemSetAccess(va, pages * g, &acc, 1));
        for (int i = 0; i < pages; ++i) CK(cuMemUnmap(va + i * g, g));
        helper_ms = ms_since(t0);
      });
      go = true;
      double launch_ms = launch_loop();
      if (helper) t.join();
      cudaDeviceSynchronize();
      printf("rep %d launch 20000 tiny kernels: %.2f ms %s (helper's 600 map+access+unmap: %.2f ms)\n", rep, launch_ms,
             helper ? "WITH helper" : "alone      ", helper_ms);
    }
  }

  // 3. Stream waits on a host flag; the host maps, then sets the flag; the kernel touches the pages.
  {
    int can = 0;
    cuDeviceGetAttribute(&can, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, 0);
    unsigned* flag; CK(cuMemHostAlloc((void**)&flag, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
    CUdeviceptr dflag; CK(cuMemHostGetDevicePointer(&dflag, flag, 0));
    *flag = 0;
    busy();
    CUresult w = cuStreamWaitValue32(s, dflag, 1, CU_STREAM_WAIT_VALUE_GEQ);
    printf("cuStreamWaitValue32 on pinned host memory: %s (host-pointer attribute %d)\n", w == CUDA_SUCCESS ? "accepted" : "refused", can);
    touch<<<1056, 512, 0, s>>>((float*)va, pages * g / 4);  // queued before the mapping exists
    auto t0 = clk::now();
    for (int i = 0; i < pages; ++i) CK(cuMemMap(va + i * g, g, 0, h[i], 0));
    CK(cuMemSetAccess(va, pages * g, &acc, 1));
    __atomic_store_n(flag, 1u, __ATOMIC_RELEASE);
    double host_ms = ms_since(t0);
    cudaError_t e = cudaStreamSynchronize(s);
    float probe = 0; cudaMemcpy(&probe, (void*)(va + 7 * g), 4, cudaMemcpyDeviceToHost);
    printf("kernel queued before the mapping, released by the flag: %s, value %.1f (host map time %.2f ms)\n",
           cudaGetErrorString(e), probe, host_ms);
  }
  return 0;
}
