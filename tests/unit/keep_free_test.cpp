// keep_free (sim, 1 GiB, 2 MiB pages): every new physical handle of a vmm_page_pool leaves
// that much of the device free (the driver's free bytes, other pools' memory counted). A
// growth past it gathers free pages or throws out_of_memory naming keep_free; a wake past
// it leaves the pool asleep with its offloaded bytes on the host; lend_pages throws. A
// tagged_pool's setting reaches every tag, those made later too.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "gpumem/pool/vmm/tagged_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::fill;
using gpumem_test::holds;
using gpumem_test::MiB;

class KeepFree : public gpumem_test::sim_pool_test {
 protected:
  std::size_t device_free() { return sim.mem_info(0).value().free; }
};

TEST(KeepFreeOption, ParsesBytesAndRoundTrips) {
  EXPECT_EQ(pool_options{}.keep_free_bytes, 0u);
  EXPECT_EQ(pool_options::parse("keep_free:1G").keep_free_bytes, std::size_t{1} << 30);
  EXPECT_NE(pool_options::parse("keep_free:64M").to_string().find("keep_free:67108864"),
            std::string::npos);
  EXPECT_THROW((void)pool_options::parse("keep_free:lots"), invalid_argument);
  EXPECT_THROW((void)pool_options::parse("keep_free:-1"), invalid_argument);
}

TEST_F(KeepFree, AGrowthThatWouldPassItThrowsAndOneWithinItServes) {
  pool_options o;
  o.keep_free_bytes = 1000 * MiB;  // of 1 GiB: room for 24 MiB
  vmm_page_pool pool(sim, 0, o);
  void* fits = pool.allocate(16 * MiB, 256, {});
  fill(fits, 16 * MiB, 0x3c);
  try {
    (void)pool.allocate(16 * MiB, 256, {});
    ADD_FAILURE() << "a growth past keep_free served";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("keep_free"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(holds(fits, 16 * MiB, 0x3c));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  // Free pages of its own serve within it (no new handle), and lowering it lets it grow.
  pool.deallocate(fits, 16 * MiB);
  void* again = pool.allocate(16 * MiB, 256, {});
  pool.set_keep_free(0);
  EXPECT_EQ(pool.keep_free(), 0u);
  void* more = pool.allocate(64 * MiB, 256, {});
  pool.deallocate(more, 64 * MiB);
  pool.deallocate(again, 16 * MiB);
  pool.trim();
}

TEST_F(KeepFree, AWakePastItLeavesTheBytesOnTheHostUntilThereIsRoom) {
  vmm_page_pool pool(sim, 0);
  void* p = pool.allocate(32 * MiB, 256, {});
  fill(p, 32 * MiB, 0x5a);
  pool.sleep(sleep_mode::offload);
  pool.set_keep_free(device_free() - 16 * MiB);
  try {
    pool.wake();
    ADD_FAILURE() << "a wake past keep_free succeeded";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("keep_free"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(pool.asleep());
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.set_keep_free(device_free() - 64 * MiB);
  pool.wake();
  EXPECT_TRUE(holds(p, 32 * MiB, 0x5a));
  pool.deallocate(p, 32 * MiB);
}

TEST_F(KeepFree, LendingPastItThrows) {
  vmm_page_pool pool(sim, 0);
  pool.set_keep_free(device_free() - 4 * MiB);
  EXPECT_THROW((void)pool.lend_pages(4), out_of_memory);
  EXPECT_EQ(pool.page_counts().lent_pages, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(KeepFree, ATaggedPoolsSettingReachesEveryTagAndTheTagsMadeLater) {
  vmm_page_pool untagged(sim, 0);
  tagged_pool pool(untagged, {});
  void* one = pool.allocate(8 * MiB, 256, {}, 1);  // tag 1 exists before the setting
  const std::size_t keep = device_free() - 4 * MiB;
  pool.set_keep_free(keep);
  EXPECT_EQ(untagged.keep_free(), keep);
  EXPECT_THROW((void)pool.allocate(8 * MiB, 256, {}, 0), out_of_memory);
  EXPECT_THROW((void)pool.allocate(8 * MiB, 256, {}, 1), out_of_memory);
  EXPECT_THROW((void)pool.allocate(8 * MiB, 256, {}, 2), out_of_memory);  // made now
  pool.set_keep_free(0);
  void* two = pool.allocate(8 * MiB, 256, {}, 2);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(two, 8 * MiB);
  pool.deallocate(one, 8 * MiB);
}

// Pools growing at once on several threads: the check and the new handle are one step in
// the process, so no two growths both pass it on the same free bytes.
TEST_F(KeepFree, PoolsGrowingAtOnceNeverPassItTogether) {
  constexpr int threads = 8;
  const std::size_t room = 64 * MiB, request = 16 * MiB;
  std::vector<std::unique_ptr<vmm_page_pool>> pools;
  for (int i = 0; i < threads; ++i) pools.push_back(std::make_unique<vmm_page_pool>(sim, 0));
  const std::size_t keep = device_free() - room;
  for (auto& p : pools) p->set_keep_free(keep);
  for (int round = 0; round < 40; ++round) {
    std::atomic<int> ready{0};
    std::vector<void*> got(threads, nullptr);
    std::vector<std::thread> workers;
    for (int i = 0; i < threads; ++i)
      workers.emplace_back([&, i] {
        ready.fetch_add(1);
        while (ready.load() < threads) std::this_thread::yield();
        try {
          got[i] = pools[i]->allocate(request, 256, {});
        } catch (const out_of_memory&) {
        }
      });
    for (auto& w : workers) w.join();
    ASSERT_GE(device_free(), keep) << "round " << round << ": growths passed keep_free together";
    int served = 0;
    for (int i = 0; i < threads; ++i)
      if (got[i] != nullptr) {
        ++served;
        pools[i]->deallocate(got[i], request);
      }
    EXPECT_GE(served, 1) << "round " << round;
    EXPECT_LE(std::size_t(served), room / request) << "round " << round;
    for (auto& p : pools) p->trim();
  }
}

}  // namespace
