// Can a growth's driver work run on several threads at once? A 1 GiB growth in 64 MiB
// handles (vmm_page_pool's default for a huge growth) costs 16 cuMemCreate, 16 cuMemMap and
// one cuMemSetAccess over the 16 handles: ~2 us a page, nearly all in create (~26 us a
// handle) and the access grant (~38 us a handle). Timed here, on an idle GPU, median of 7:
//  1. the 16 creates on one thread, then on 2, 4 and 8 threads (handles split evenly);
//  2. the access grant as one call over the 1 GiB, then as 2, 4, 8 and 16 calls over equal
//     parts, on as many threads at once (and the same parts one after another on one thread).
// Not part of the build (the project compiles no .cu files); on a GPU machine:
//   nvcc -O2 -arch=sm_90 -o par scripts/probes/vmm_parallel_growth_probe.cu -lcuda && ./par
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#define CK(x) do { CUresult rc_ = (x); if (rc_ != CUDA_SUCCESS) { const char* s; cuGetErrorString(rc_, &s); std::printf("%s failed: %s\n", #x, s); std::exit(1); } } while (0)
using clk = std::chrono::steady_clock;
static double us_since(clk::time_point t0) { return std::chrono::duration<double, std::micro>(clk::now() - t0).count(); }
static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main() {
  cudaFree(0);
  CUcontext ctx;
  CK(cuCtxGetCurrent(&ctx));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAccessDesc acc{};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const size_t handle = size_t{64} << 20;
  const int handles = 16;
  const size_t total = handle * handles;
  const int reps = 7;
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, total, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> h(handles);

  // Runs body(part) for parts 0..n-1 on n threads (each sets the context first).
  auto on_threads = [&](int n, auto body) {
    std::vector<std::thread> ts;
    for (int t = 0; t < n; ++t)
      ts.emplace_back([&, t] {
        CK(cuCtxSetCurrent(ctx));
        body(t);
      });
    for (auto& t : ts) t.join();
  };
  auto release_all = [&] {
    for (auto x : h) CK(cuMemRelease(x));
  };

  std::printf("1 GiB in %d handles of %zu MiB: microseconds, median of %d\n", handles, handle >> 20, reps);
  for (int threads : {1, 2, 4, 8}) {
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      const int per = handles / threads;
      auto t0 = clk::now();
      on_threads(threads, [&](int part) {
        for (int i = part * per; i < (part + 1) * per; ++i) CK(cuMemCreate(&h[i], handle, &prop, 0));
      });
      t.push_back(us_since(t0));
      release_all();
    }
    std::printf("  16 cuMemCreate on %d thread(s): %8.0f us (%.0f ns a 2 MiB page)\n", threads, median(t),
                median(t) * 1000 / (total >> 21));
  }

  for (int parts : {1, 2, 4, 8, 16}) {
    for (int threaded = 0; threaded < (parts == 1 ? 1 : 2); ++threaded) {
      std::vector<double> t;
      for (int r = 0; r < reps; ++r) {
        for (int i = 0; i < handles; ++i) CK(cuMemCreate(&h[i], handle, &prop, 0));
        for (int i = 0; i < handles; ++i) CK(cuMemMap(va + i * handle, handle, 0, h[i], 0));
        const size_t part = total / parts;
        auto t0 = clk::now();
        if (threaded) {
          on_threads(parts, [&](int p) { CK(cuMemSetAccess(va + p * part, part, &acc, 1)); });
        } else {
          for (int p = 0; p < parts; ++p) CK(cuMemSetAccess(va + p * part, part, &acc, 1));
        }
        t.push_back(us_since(t0));
        CK(cuMemUnmap(va, total));
        release_all();
      }
      std::printf("  cuMemSetAccess as %2d call(s)%s: %8.0f us (%.0f ns a page)\n", parts,
                  parts == 1 ? "                  " : threaded ? " on as many threads" : " on one thread     ",
                  median(t), median(t) * 1000 / (total >> 21));
    }
  }
  // The whole growth both ways: serial (as now), and creates + maps + grants split over 4
  // threads (each thread its 4 handles: create, map, grant its part).
  for (int threads : {1, 4}) {
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      const int per = handles / threads;
      auto t0 = clk::now();
      on_threads(threads, [&](int part) {
        for (int i = part * per; i < (part + 1) * per; ++i) CK(cuMemCreate(&h[i], handle, &prop, 0));
        for (int i = part * per; i < (part + 1) * per; ++i) CK(cuMemMap(va + i * handle, handle, 0, h[i], 0));
        CK(cuMemSetAccess(va + part * per * handle, per * handle, &acc, 1));
      });
      t.push_back(us_since(t0));
      CK(cuMemUnmap(va, total));
      release_all();
    }
    std::printf("  whole growth (create, map, grant) on %d thread(s): %8.0f us (%.0f ns a page)\n", threads,
                median(t), median(t) * 1000 / (total >> 21));
  }
  CK(cuMemAddressFree(va, total));
  return 0;
}
