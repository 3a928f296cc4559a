// kv_cache with tiers below the GPU, on a sim device (device memory is host memory, so
// bytes are checked directly): an evicted block is written back and found again by a
// later prompt, bytes intact; tenants stay apart; a record whose tokens differ is not
// used; copy failures, a full write-back queue and corrupt tier values are misses that
// the cache serves by computing, never exceptions.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "gpumem/errors.hpp"
#include "gpumem/kv.hpp"
#include "gpumem/kv/tier/host_store.hpp"
#include "gpumem/kv/tier/kv_record.hpp"
#include "gpumem/kv/tier/kv_tiers.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/kv_test_support.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;

// Fills every byte of a sequence's blocks with a pattern of its block index and `seed`.
void fill(kv_cache& kv, kv_cache::sequence_id id, unsigned seed) {
  const auto table = kv.block_table(id);
  const std::size_t bs = kv.layout().block_stride();
  for (std::size_t i = 0; i < table.size(); ++i)
    std::memset(kv.block_address(table[i]), static_cast<int>((seed * 31 + i) & 0xff), bs);
}
bool holds(kv_cache& kv, kv_cache::sequence_id id, std::size_t blocks, unsigned seed) {
  const auto table = kv.block_table(id);
  const std::size_t bs = kv.layout().block_stride();
  std::vector<unsigned char> want(bs);
  for (std::size_t i = 0; i < blocks; ++i) {
    std::memset(want.data(), static_cast<int>((seed * 31 + i) & 0xff), bs);
    if (std::memcmp(kv.block_address(table[i]), want.data(), bs) != 0) return false;
  }
  return true;
}

class KvCacheTiers : public sim_pool_test {
 protected:
  std::unique_ptr<kv_tiers> host_tiers(std::size_t bytes = 8 * MiB, kv_tiers_options o = {}) {
    std::vector<std::unique_ptr<kv_store>> stores;
    stores.push_back(std::make_unique<host_store>(sim, 0, bytes));
    return std::make_unique<kv_tiers>(sim, 0, std::move(stores), o);
  }
  kv_cache_config config(kv_tiers* tiers, std::size_t max_blocks = 64) {
    kv_cache_config c;
    c.layout = small_layout();
    c.max_blocks = max_blocks;
    c.tiers = tiers;
    return c;
  }
};

TEST_F(KvCacheTiers, AnEvictedPrefixComesBackFromTheHostTierBytesIntact) {
  auto tiers = host_tiers();
  vmm_page_pool pages(sim, 0);
  kv_cache kv(pages, config(tiers.get()));
  const auto p = token_run(16 * 5 + 3);  // 5 full blocks, then 3 tokens
  auto a = kv.add_sequence(p, 7);
  fill(kv, a.id, 1);
  kv.free(a.id);
  EXPECT_EQ(kv.evict(100), 5u);
  tiers->flush();
  EXPECT_EQ(kv.stats().writebacks, 5u);
  EXPECT_EQ(tiers->stats().writebacks_written, 5u);

  auto b = kv.add_sequence(p, 7);
  EXPECT_EQ(b.cached_tokens, 16u * 5);
  EXPECT_TRUE(holds(kv, b.id, 5, 1));
  const auto st = kv.stats();
  EXPECT_EQ(st.tier_hits, 5u);
  EXPECT_EQ(st.tier_lookups, 10u) << "5 asked cold (missed), 5 asked again (found)";
  EXPECT_EQ(tiers->stats().tiers[0].hits, 5u);
  EXPECT_EQ(kv.validate(), "");
  // Adopted blocks are cached prefix blocks again: a third request hits on the GPU.
  auto c = kv.add_sequence(p, 7);
  EXPECT_EQ(c.cached_tokens, 16u * 5);
  EXPECT_EQ(kv.stats().tier_lookups, 10u) << "a GPU hit asks no tier";
  kv.free(b.id);
  kv.free(c.id);
  EXPECT_EQ(kv.validate(), "");
}

TEST_F(KvCacheTiers, APartialGpuHitContinuesFromTheTier) {
  auto tiers = host_tiers();
  vmm_page_pool pages(sim, 0);
  kv_cache kv(pages, config(tiers.get()));
  const auto p = token_run(16 * 4 + 1);
  auto a = kv.add_sequence(p);
  fill(kv, a.id, 3);
  kv.free(a.id);
  // Freed last blocks first, so the LRU evicts the tail: blocks 3, 2 leave, 0, 1 stay.
  EXPECT_EQ(kv.evict(2), 2u);
  tiers->flush();
  auto b = kv.add_sequence(p);
  EXPECT_EQ(b.cached_tokens, 64u);
  EXPECT_EQ(kv.stats().prefix_hits, 2u);
  EXPECT_EQ(kv.stats().tier_hits, 2u);
  EXPECT_TRUE(holds(kv, b.id, 4, 3));
  kv.free(b.id);
}

TEST_F(KvCacheTiers, TenantsStayApartAcrossTheTier) {
  auto tiers = host_tiers();
  vmm_page_pool pages(sim, 0);
  kv_cache kv(pages, config(tiers.get()));
  const auto p = token_run(16 * 3 + 1);
  auto a = kv.add_sequence(p, /*salt*/ 1);
  kv.free(a.id);
  kv.evict(100);
  tiers->flush();
  auto b = kv.add_sequence(p, /*salt*/ 2);
  EXPECT_EQ(b.cached_tokens, 0u);
  EXPECT_EQ(kv.stats().tier_hits, 0u);
  kv.free(b.id);
}

TEST_F(KvCacheTiers, ARecordWhoseTokensDifferIsNotUsed) {
  // A store holding a record under the right key but with other tokens (a hash
  // collision, or a store that lies): the cache confirms tokens and computes instead.
  auto tiers = host_tiers();
  vmm_page_pool pages(sim, 0);
  kv_cache kv(pages, config(tiers.get()));
  const auto p = token_run(16 * 2 + 1);
  const std::size_t bs = kv.layout().block_stride();
  const kv_block_key k{kv.tier_space(), 0, prefix_block_hash(0, 0, std::span(p).first(16))};
  std::vector<std::byte> rec(kv_record::size(16, bs));
  const auto other = token_run(16, 1000);
  kv_record::write_head(rec, k, 0, other);
  kv_record::seal(rec);
  const kv_block_key keys[] = {k};
  const std::span<const std::byte> vals[] = {rec};
  bool ok[1];
  tiers->store(0).put(keys, vals, ok);
  ASSERT_TRUE(ok[0]);
  auto a = kv.add_sequence(p);
  EXPECT_EQ(a.cached_tokens, 0u);
  EXPECT_EQ(kv.stats().tier_lookups, 2u);
  EXPECT_EQ(kv.stats().tier_hits, 0u);
  EXPECT_EQ(tiers->stats().lookup_hits, 1u) << "the store verified it; the cache refused it";
  kv.free(a.id);
  EXPECT_EQ(kv.validate(), "");
}

TEST_F(KvCacheTiers, AFullWriteBackQueueDropsBlocksWithoutWaiting) {
  kv_tiers_options o;
  o.max_pending_bytes = kv_record::size(16, small_layout().block_stride()) * 2;
  auto tiers = host_tiers(8 * MiB, o);
  vmm_page_pool pages(sim, 0);
  kv_cache kv(pages, config(tiers.get()));
  const auto p = token_run(16 * 6 + 1);
  auto a = kv.add_sequence(p);
  kv.free(a.id);
  sim.hold_events(true);  // the write-back copies stay in flight: the queue fills
  EXPECT_EQ(kv.evict(100), 6u);
  auto t = tiers->stats();
  EXPECT_EQ(t.writebacks, 2u);
  EXPECT_EQ(t.writebacks_dropped, 4u);
  sim.complete_events();
  sim.hold_events(false);
  tiers->flush();
  t = tiers->stats();
  EXPECT_EQ(t.writebacks_written, 2u);
  EXPECT_EQ(t.pending_bytes, 0u);
}

TEST_F(KvCacheTiers, AFailedCopyOfATierHitIsComputedNotThrown) {
  auto tiers = host_tiers();
  vmm_page_pool pages(sim, 0);
  kv_cache kv(pages, config(tiers.get()));
  const auto p = token_run(16 * 6 + 1);
  auto a = kv.add_sequence(p);
  fill(kv, a.id, 5);
  kv.free(a.id);
  kv.evict(100);
  tiers->flush();
  sim.inject_fault(platform_op::memcpy_async, {1, true, 0.0, failure_kind::driver_error});
  kv_cache::admission b;
  EXPECT_NO_THROW(b = kv.add_sequence(p));
  sim.clear_faults();
  EXPECT_EQ(b.cached_tokens, 0u);
  EXPECT_EQ(kv.validate(), "");
  kv.free(b.id);
  kv.evict(100);  // blocks b computed (not filled) replace nothing: the tier keeps a's
  tiers->flush();
  auto c = kv.add_sequence(p);
  EXPECT_EQ(c.cached_tokens, 96u);
  EXPECT_TRUE(holds(kv, c.id, 6, 5));
  kv.free(c.id);
}

TEST_F(KvCacheTiers, APromptRefusedForCapacityAsksNoTier) {
  // An engine retries a prompt that does not fit every step: each retry must not move
  // blocks out of the tiers only to refuse them.
  auto tiers = host_tiers();
  vmm_page_pool pages(sim, 0);
  kv_cache kv(pages, config(tiers.get(), /*max_blocks*/ 8));
  const auto p = token_run(16 * 4 + 1);
  auto a = kv.add_sequence(p);
  kv.free(a.id);
  kv.evict(100);
  tiers->flush();
  auto hold = kv.add_sequence(token_run(16 * 6, 500));  // 6 of 8 blocks held
  const auto before = kv.stats().tier_lookups;
  EXPECT_THROW(kv.add_sequence(p), out_of_memory);  // needs 5
  EXPECT_EQ(kv.stats().tier_lookups, before);
  EXPECT_EQ(tiers->stats().lookups, before);
  EXPECT_EQ(kv.validate(), "");
  kv.free(hold.id);
  auto b = kv.add_sequence(p);
  EXPECT_EQ(b.cached_tokens, 64u);
  kv.free(b.id);
}

TEST_F(KvCacheTiers, TiersNeedPrefixCaching) {
  auto tiers = host_tiers();
  vmm_page_pool pages(sim, 0);
  auto c = config(tiers.get());
  c.prefix_caching = false;
  EXPECT_THROW(kv_cache(pages, c), invalid_argument);
}

}  // namespace
