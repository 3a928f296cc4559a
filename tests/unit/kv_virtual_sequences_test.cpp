// kv_virtual_sequences on a sim device: token-major addresses, growth in place with the
// bytes kept, one budget with the page pool, typed refusals, and every platform failure
// during growth leaving the sequences as they were and nothing leaked.
#include <gtest/gtest.h>

#include <cstring>

#include "gpumem/errors.hpp"
#include "gpumem/kv/kv_virtual_sequences.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;

// 2 layers x 2 heads x 64 dims, f16: 1 KiB a token, 2048 tokens to a 2 MiB page.
kv_layout token_layout() {
  kv_layout l;
  l.layers = 2;
  l.kv_heads = 2;
  l.head_dim = 64;
  l.dtype = kv_dtype::f16;
  return l;
}

class KvVirtualSequences : public sim_pool_test {};

TEST_F(KvVirtualSequences, GrowsInPlaceAndKeepsBytes) {
  vmm_page_pool pool(sim);
  kv_virtual_sequences vs(pool, token_layout(), 8192);
  EXPECT_EQ(vs.token_stride(), 1024u);
  const auto a = vs.add(10);
  const auto base = vs.base(a);
  auto* slot = reinterpret_cast<std::uint16_t*>(base + 9 * 1024 + 512 + 256 + 128 + 6);
  *slot = 4321;
  vs.append(a, 3000);
  EXPECT_EQ(vs.base(a), base);
  EXPECT_EQ(*slot, 4321);
  std::memset(reinterpret_cast<void*>(base + 3009 * 1024), 0x5a, 1024);  // mapped
  EXPECT_EQ(vs.mapped_bytes(), 2 * 2 * MiB);
  EXPECT_EQ(vs.live_bytes(), 3010u * 1024u);
  const auto b = vs.add(1);
  EXPECT_NE(vs.base(b), base);
  EXPECT_EQ(vs.mapped_bytes(), 3 * 2 * MiB);
  EXPECT_EQ(vs.validate(), "");
  vs.free(a);
  EXPECT_EQ(vs.mapped_bytes(), 2 * MiB);
  EXPECT_THROW(vs.base(a), gpumem::invalid_argument);
  vs.free(b);
  EXPECT_EQ(pool.stats().reserved_bytes, pool.page_counts().spare_pages * 2 * MiB);
}

TEST_F(KvVirtualSequences, RefusalsAreTypedAndChangeNothing) {
  pool_options o;
  o.limit_bytes = 6 * MiB;
  vmm_page_pool pool(sim, 0, o);
  kv_layout bad = token_layout();
  bad.kv_heads = 0;
  EXPECT_THROW(kv_virtual_sequences(pool, bad, 100), gpumem::invalid_argument);
  EXPECT_THROW(kv_virtual_sequences(pool, token_layout(), 0), gpumem::invalid_argument);
  kv_virtual_sequences vs(pool, token_layout(), 8192);
  const auto a = vs.add(4000);
  EXPECT_THROW(vs.append(a, 5000), gpumem::invalid_argument);  // past max_sequence_tokens
  EXPECT_THROW(vs.add(9000), gpumem::invalid_argument);
  EXPECT_THROW(vs.add(4000), gpumem::out_of_memory);  // 2 more pages over the 6 MiB limit
  EXPECT_EQ(vs.sequences(), 1u);
  EXPECT_EQ(vs.tokens(a), 4000u);
  EXPECT_EQ(vs.mapped_bytes(), 2 * 2 * MiB);
  EXPECT_THROW(vs.free(a + 1), gpumem::invalid_argument);
  EXPECT_EQ(vs.validate(), "");
}

TEST_F(KvVirtualSequences, EveryPlatformFailureDuringGrowthLeavesStateAndLeaksNothing) {
  int failures = 0;
  for (platform_op op : {platform_op::map, platform_op::set_access, platform_op::reserve_range,
                         platform_op::create_physical}) {
    for (std::uint64_t nth = 1; nth <= 3; ++nth) {
      SCOPED_TRACE(std::string(platform_op_name(op)) + " call " + std::to_string(nth));
      vmm_page_pool pool(sim);
      kv_virtual_sequences vs(pool, token_layout(), 16384);
      const auto a = vs.add(100);
      sim_fault f;
      f.nth = nth;
      f.kind = failure_kind::driver_error;
      sim.inject_fault(op, f);
      const std::size_t before = vs.mapped_bytes();
      bool append_failed = false, add_failed = false;
      try {
        vs.append(a, 6000);  // 3 more pages: several maps
      } catch (const gpumem::cuda_error&) {
        append_failed = true;
      } catch (const gpumem::out_of_memory&) {
        append_failed = true;
      }
      try {
        (void)vs.add(3000);
      } catch (const gpumem::cuda_error&) {
        add_failed = true;
      } catch (const gpumem::out_of_memory&) {
        add_failed = true;
      }
      sim.clear_faults();
      EXPECT_EQ(vs.validate(), "");
      if (append_failed) {
        ++failures;
        EXPECT_EQ(vs.tokens(a), 100u);  // the append is all or nothing
        EXPECT_GE(vs.mapped_bytes(), before);
      }
      if (add_failed) ++failures;
      EXPECT_EQ(vs.sequences(), add_failed ? 1u : 2u);
      vs.append(a, 100);  // usable afterwards
      EXPECT_EQ(vs.validate(), "");
    }
  }
  EXPECT_GE(failures, 8);  // each op's early calls fail the growth
}

}  // namespace
