// guard_pages: what vmm_page_pool's guard mode (GPUMEM_CONF=guard:on) buys. The same
// 4 KiB overrun — a device-side memset past the end of a 1 MiB allocation — is done twice:
//   1. in a normal pool, where the next allocation lies right after: the write succeeds
//      and silently corrupts the neighbour;
//   2. in a guard-mode pool, where the allocation ends at an unmapped page: the device
//      refuses or faults at once, and the error is printed.
// Run it on the GPU (`--device cuda`): the second step may leave the CUDA context unusable
// (a sticky illegal-address error), so it is the last thing the program does.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

using namespace gpumem;

int main(int argc, char** argv) {
  const std::string device = argc == 3 && !std::strcmp(argv[1], "--device") ? argv[2] : "auto";
  platform& gpu = platform_by_name(device);
  constexpr std::size_t mib = std::size_t{1} << 20, over = 4096;
  std::printf("guard_pages on %s\n", std::string(gpu.kind()).c_str());
  {
    vmm_page_pool pool(gpu, 0);
    void* a = pool.allocate(mib);
    void* b = pool.allocate(mib);
    std::vector<unsigned char> zero(mib, 0), back(16, 0);
    (void)gpu.memcpy_async(b, zero.data(), mib, {});
    const bool adjacent = static_cast<char*>(a) + mib == static_cast<char*>(b);
    status st = gpu.memset_async(a, 0xAB, mib + over, {});
    (void)gpu.stream_synchronize({});
    (void)gpu.memcpy_async(back.data(), b, back.size(), {});
    (void)gpu.stream_synchronize({});
    std::printf("normal pool: overrun of %zu bytes %s; neighbour %s; its first byte now 0x%02x\n",
                over, st.ok() ? "accepted" : ("refused: " + st.describe()).c_str(),
                adjacent ? "directly after" : "elsewhere", back[0]);
    pool.deallocate(a, mib);
    pool.deallocate(b, mib);
  }
  std::fflush(stdout);
  if (gpu.kind() == std::string_view("sim")) {
    // On sim an overrun is a SIGSEGV of this process: tests/unit/guard_test.cpp shows it.
    std::printf("guard pool: on sim an overrun kills the process with SIGSEGV "
                "(GuardDeathTest.AnOverrunOfOneByteFaultsAtOnce); run with --device cuda\n");
    return 0;
  }
  {
    vmm_page_pool pool(gpu, 0, pool_options::parse("guard:on"));
    void* a = pool.allocate(mib);
    status inside = gpu.memset_async(a, 0xAB, mib, {});
    status sync1 = gpu.stream_synchronize({});
    std::printf("guard pool: write of all %zu bytes: %s\n", mib,
                inside.ok() && sync1.ok() ? "ok" : (inside.describe() + sync1.describe()).c_str());
    status st = gpu.memset_async(a, 0xAB, mib + over, {});
    status sync2 = gpu.stream_synchronize({});
    if (!st.ok())
      std::printf("guard pool: overrun of %zu bytes refused when enqueued: %s\n", over,
                  st.describe().c_str());
    else
      std::printf("guard pool: overrun of %zu bytes enqueued; completion: %s\n", over,
                  sync2.ok() ? "ok (NOT caught)" : sync2.describe().c_str());
    const bool caught = !st.ok() || !sync2.ok();
    std::printf("%s\n", caught ? "the overrun was caught at once" : "the overrun was NOT caught");
    if (!caught) pool.deallocate(a, mib);
    // A faulted context cannot free anything; the process exits.
    return caught ? 0 : 1;
  }
}
