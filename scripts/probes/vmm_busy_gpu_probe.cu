// Does a VMM driver call wait for running kernels? Time each call on the host while a
// ~100 ms kernel runs, and while the GPU is idle. Not part of the build (the project
// compiles no .cu files); on a GPU machine:
//   nvcc -O2 -arch=sm_90 -o probe scripts/probes/vmm_busy_gpu_probe.cu -lcuda && ./probe
// None of the calls waits for the kernel, on a non-blocking stream or the legacy default
// stream; they are slower while the GPU is busy than idle.
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorString(r, &s); printf("%s failed: %s\n", #x, s); return 1; } } while (0)
__global__ void spin(long long cycles) { long long t = clock64(); while (clock64() - t < cycles) {} }
using clk = std::chrono::steady_clock;
static double ms_since(clk::time_point t0) { return std::chrono::duration<double, std::milli>(clk::now() - t0).count(); }
int main() {
  cudaFree(0);
  CUcontext ctx; cuCtxGetCurrent(&ctx);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  CUmemAllocationProp prop{}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  size_t g = 2 << 20;
  CUmemAccessDesc acc{}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr va; CK(cuMemAddressReserve(&va, 64 * g, 0, 0, 0));
  CUmemGenericAllocationHandle h[8];
  for (int i = 0; i < 8; ++i) CK(cuMemCreate(&h[i], g, &prop, 0));
  const long long cycles = 200000000LL;  // ~100 ms at ~2 GHz
  for (int busy = 0; busy < 2; ++busy) for (int use_default = 0; use_default < 2; ++use_default) {
    cudaStream_t st = use_default ? 0 : s;
    auto start = [&] { if (busy) { spin<<<1, 1, 0, st>>>(cycles); } };
    double t_map, t_acc, t_unmap, t_create, t_release, t_rec;
    start(); auto t0 = clk::now(); CK(cuMemMap(va, g, 0, h[0], 0)); t_map = ms_since(t0); cudaDeviceSynchronize();
    start(); t0 = clk::now(); CK(cuMemSetAccess(va, g, &acc, 1)); t_acc = ms_since(t0); cudaDeviceSynchronize();
    start(); t0 = clk::now(); CK(cuMemUnmap(va, g)); t_unmap = ms_since(t0); cudaDeviceSynchronize();
    CUmemGenericAllocationHandle x;
    start(); t0 = clk::now(); CK(cuMemCreate(&x, g, &prop, 0)); t_create = ms_since(t0); cudaDeviceSynchronize();
    start(); t0 = clk::now(); CK(cuMemRelease(x)); t_release = ms_since(t0); cudaDeviceSynchronize();
    cudaEvent_t e; cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    start(); t0 = clk::now(); cudaEventRecord(e, st); cudaEventQuery(e); t_rec = ms_since(t0); cudaDeviceSynchronize();
    cudaEventDestroy(e);
    // 8 pages mapped, access set once, then unmapped at once, with the GPU busy
    start(); t0 = clk::now(); for (int i = 0; i < 8; ++i) CK(cuMemMap(va + i * g, g, 0, h[i], 0)); double t_map8 = ms_since(t0);
    t0 = clk::now(); CK(cuMemSetAccess(va, 8 * g, &acc, 1)); double t_acc8 = ms_since(t0);
    t0 = clk::now(); for (int i = 0; i < 8; ++i) CK(cuMemUnmap(va + i * g, g)); double t_unmap8 = ms_since(t0);
    cudaDeviceSynchronize();
    printf("%s, %s stream: map %.3f  setaccess %.3f  unmap %.3f  create %.3f  release %.3f  event rec+query %.3f | 8 maps %.3f, setaccess(8) %.3f, 8 unmaps %.3f (ms)\n",
           busy ? "GPU busy (100 ms kernel)" : "GPU idle", use_default ? "legacy default" : "non-blocking",
           t_map, t_acc, t_unmap, t_create, t_release, t_rec, t_map8, t_acc8, t_unmap8);
  }
  return 0;
}
