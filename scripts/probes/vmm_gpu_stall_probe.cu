// Do VMM driver calls slow down kernels that are running? A memory-bound kernel (copy of
// 1 GiB) is queued 200 times; while it runs, the host maps, grants access to or unmaps
// pages of another range. The GPU time of the 200 copies (events) is compared with a run
// where the host does nothing. Not part of the build; on a GPU machine:
//   nvcc -O2 -arch=sm_90 -o stall scripts/probes/vmm_gpu_stall_probe.cu -lcuda && ./stall
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <vector>
#define CK(x) do { CUresult rc_ = (x); if (rc_ != CUDA_SUCCESS) { const char* s; cuGetErrorString(rc_, &s); printf("%s failed: %s\n", #x, s); return 1; } } while (0)
__global__ void copy(const float4* __restrict__ a, float4* __restrict__ b, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) b[i] = a[i];
}
using clk = std::chrono::steady_clock;
int main() {
  cudaFree(0);
  const size_t bytes = 1ull << 30, n = bytes / sizeof(float4);
  float4 *a, *b;
  cudaMalloc(&a, bytes); cudaMalloc(&b, bytes);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  CUmemAllocationProp prop{}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  const size_t g = 2 << 20; const int pages = 600;
  CUmemAccessDesc acc{}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va; CK(cuMemAddressReserve(&va, 4 * pages * g, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> h(pages);
  for (auto& x : h) CK(cuMemCreate(&x, g, &prop, 0));
  const char* names[] = {"nothing", "map 600 pages + 2 setaccess", "unmap 600 pages (600 calls)",
                         "10 x (unmap 60, map 60, setaccess 60)", "setaccess again over 600 mapped pages (2 calls)",
                         "map 600 pages as 10 handles of 60 + 2 setaccess", "unmap those (10 calls)",
                         "(try: map one page of a big handle at an offset)", "map 600 pages of big handles, 60 per call"};
  // Ten 60-page handles: does a call cost per page or per call?
  std::vector<CUmemGenericAllocationHandle> big(10);
  for (auto& x : big) CK(cuMemCreate(&x, 60 * g, &prop, 0));
  for (int rep = 0; rep < 3; ++rep)
    for (int phase = 0; phase < 9; ++phase) {
      // Phases 2 and 4 need the pages mapped first, phase 1 unmapped (outside the timing).
      bool mapped_now = false;
      if (phase == 6) {
        for (int r = 0; r < 10; ++r) CK(cuMemMap(va + r * 60 * g, 60 * g, 0, big[r], 0));
        CK(cuMemSetAccess(va, pages * g, &acc, 1));
      }
      if (phase == 2 || phase == 3 || phase == 4) {
        for (int i = 0; i < pages; ++i) CK(cuMemMap(va + i * g, g, 0, h[i], 0));
        CK(cuMemSetAccess(va, pages * g, &acc, 1));
        mapped_now = true;
      }
      cudaDeviceSynchronize();
      cudaEventRecord(e0, s);
      for (int k = 0; k < 200; ++k) copy<<<1056, 512, 0, s>>>(a, b, n);
      cudaEventRecord(e1, s);
      auto t0 = clk::now();
      if (phase == 1) {
        for (int i = 0; i < pages; ++i) CK(cuMemMap(va + i * g, g, 0, h[i], 0));
        CK(cuMemSetAccess(va, 300 * g, &acc, 1));
        CK(cuMemSetAccess(va + 300 * g, 300 * g, &acc, 1));
        mapped_now = true;
      } else if (phase == 2) {
        for (int i = 0; i < pages; ++i) CK(cuMemUnmap(va + i * g, g));
        mapped_now = false;
      } else if (phase == 3) {
        for (int run = 0; run < 10; ++run) {
          for (int i = run * 60; i < run * 60 + 60; ++i) CK(cuMemUnmap(va + i * g, g));
          CUdeviceptr to = va + (2 * pages + run * 60) * g;
          for (int i = 0; i < 60; ++i) CK(cuMemMap(to + i * g, g, 0, h[run * 60 + i], 0));
          CK(cuMemSetAccess(to, 60 * g, &acc, 1));
        }
      } else if (phase == 5) {
        for (int r = 0; r < 10; ++r) CK(cuMemMap(va + r * 60 * g, 60 * g, 0, big[r], 0));
        CK(cuMemSetAccess(va, 300 * g, &acc, 1));
        CK(cuMemSetAccess(va + 300 * g, 300 * g, &acc, 1));
        mapped_now = true;
      } else if (phase == 6) {
        for (int r = 0; r < 10; ++r) CK(cuMemUnmap(va + r * 60 * g, 60 * g));
      } else if (phase == 7) {
        // A page of a big handle at an offset: refused by the driver (CUDA 13, H200:
        // "operation not supported"), so the call is tried once and reported.
        CUresult r = cuMemMap(va, g, g, big[0], 0);
        if (r == CUDA_SUCCESS) CK(cuMemUnmap(va, g));
        printf("  cuMemMap at offset 1 page into a 60-page handle: %s\n", r == CUDA_SUCCESS ? "supported" : "refused");
      } else if (phase == 8) {
        for (int r = 0; r < 10; ++r) CK(cuMemMap(va + r * 60 * g, 60 * g, 0, big[r], 0));
        CK(cuMemSetAccess(va, pages * g, &acc, 1));
        mapped_now = true;
      } else if (phase == 4) {
        CK(cuMemSetAccess(va, 300 * g, &acc, 1));
        CK(cuMemSetAccess(va + 300 * g, 300 * g, &acc, 1));
      }
      const double host_ms = std::chrono::duration<double, std::milli>(clk::now() - t0).count();
      cudaEventSynchronize(e1);
      float gpu_ms = 0; cudaEventElapsedTime(&gpu_ms, e0, e1);
      printf("rep %d  %-48s gpu %.2f ms  host calls %.2f ms\n", rep, names[phase], gpu_ms, host_ms);
      // Clean up to the unmapped state.
      if (phase == 3) { for (int i = 0; i < pages; ++i) CK(cuMemUnmap(va + (2 * pages + i) * g, g)); mapped_now = false; }
      if (mapped_now && phase >= 5) for (int r = 0; r < 10; ++r) CK(cuMemUnmap(va + r * 60 * g, 60 * g));
      else if (mapped_now) for (int i = 0; i < pages; ++i) CK(cuMemUnmap(va + i * g, g));
    }
  return 0;
}
