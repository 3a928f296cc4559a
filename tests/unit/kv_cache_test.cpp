// The paged KV cache on a sim device: layout, block storage on borrowed VMM pages,
// block tables, fork with copy on write, prefix caching, LRU eviction, swap to pinned
// host memory, elastic capacity shared with the page pool, and typed refusals that
// leave the cache as it was. Sim device memory is host memory, so bytes are checked
// directly.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <numeric>
#include <random>

#include "gpumem/errors.hpp"
#include "gpumem/kv.hpp"
#include "gpumem/pool/pinned_host_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/kv_test_support.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;

// The 4 bytes of layer 0's key slot for token `pos` of a sequence: where the tests write
// each token's id so that copies and swaps can be checked.
token_id* slot(const kv_cache& kv, const std::vector<kv_cache::block_id>& table, std::size_t pos) {
  const kv_layout& l = kv.layout();
  const auto b = table[pos / l.block_tokens];
  return reinterpret_cast<token_id*>(kv.base() + l.offset(b, 0, 0, pos % l.block_tokens, 0, 0));
}

class KvCache : public sim_pool_test {
 protected:
  kv_cache_config config(std::size_t max_blocks = 0) {
    kv_cache_config c;
    c.layout = small_layout();
    c.max_blocks = max_blocks;
    return c;
  }
};

TEST(KvLayout, StridesFollowTheDocumentedFormula) {
  kv_layout l = small_layout();
  EXPECT_EQ(l.head_stride(), 128u);
  EXPECT_EQ(l.token_stride(), 256u);
  EXPECT_EQ(l.kv_stride(), 16u * 256u);
  EXPECT_EQ(l.layer_stride(), 2u * 16u * 256u);
  EXPECT_EQ(l.block_stride(), 16u * KiB);
  EXPECT_EQ(l.bytes_per_token(), 2u * 2u * 256u);
  EXPECT_EQ(l.offset(3, 1, 1, 5, 1, 7), 3 * l.block_stride() + l.layer_stride() + l.kv_stride() +
                                            5 * l.token_stride() + l.head_stride() + 7 * 2);
  EXPECT_EQ(l.validate(), "");
  kv_layout zero = l;
  zero.kv_heads = 0;
  EXPECT_NE(zero.validate(), "");
  kv_layout odd = l;
  odd.head_dim = 3;
  odd.kv_heads = 1;
  odd.block_tokens = 1;
  odd.layers = 1;
  EXPECT_NE(odd.validate().find("multiple of 256"), std::string::npos);
  EXPECT_EQ(parse_kv_dtype("fp16"), kv_dtype::f16);
  EXPECT_THROW(parse_kv_dtype("int4"), gpumem::invalid_argument);
}

TEST(PrefixHash, ChainsParentSaltAndEveryToken) {
  auto t = token_run(16);
  const auto h = prefix_block_hash(0, 0, t);
  EXPECT_EQ(h, prefix_block_hash(0, 0, t));
  EXPECT_NE(h, prefix_block_hash(1, 0, t));
  EXPECT_NE(h, prefix_block_hash(0, 1, t));
  for (std::size_t i = 0; i < t.size(); ++i) {
    auto u = t;
    u[i] += 1;
    EXPECT_NE(h, prefix_block_hash(0, 0, u)) << "token " << i;
  }
  EXPECT_NE(h, prefix_block_hash(0, 0, std::span(t).first(15)));
}

TEST_F(KvCache, StorageTakesLowestIdsAndGrowsByPagesWithOneAccessGrant) {
  vmm_page_pool pool(sim);
  kv_block_storage st(pool, 16 * KiB, 1000);
  EXPECT_EQ(st.capacity_blocks(), 0u);
  const auto access = calls(platform_op::set_access);
  auto a = st.try_allocate();
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(st.capacity_blocks(), 128u);  // one 2 MiB page
  EXPECT_EQ(calls(platform_op::set_access), access + 1);
  EXPECT_EQ(pool.page_counts().lent_pages, 1u);
  EXPECT_EQ(pool.stats().reserved_bytes, 2 * MiB);
  EXPECT_TRUE(st.grow_to(300));  // two more pages, one grant
  EXPECT_EQ(calls(platform_op::set_access), access + 2);
  EXPECT_EQ(st.capacity_blocks(), 384u);
  auto b = st.try_allocate();
  EXPECT_EQ(*b, 1u);
  st.free(*a);
  EXPECT_EQ(*st.try_allocate(), 0u);
  EXPECT_THROW(st.free(7), gpumem::invalid_argument);    // never allocated
  EXPECT_THROW(st.free(999), gpumem::invalid_argument);  // beyond capacity
  EXPECT_EQ(st.validate(), "");
  // Blocks 0 and 1 in use: everything above the first page goes back to the pool.
  EXPECT_EQ(st.shrink(), 2u);
  EXPECT_EQ(st.capacity_blocks(), 128u);
  EXPECT_EQ(pool.page_counts().lent_pages, 1u);
  EXPECT_EQ(pool.page_counts().spare_pages, 2u);
  EXPECT_EQ(st.validate(), "");
  EXPECT_EQ(pool.validate(), "");
  // The cap holds.
  EXPECT_FALSE(st.grow_to(1001));
}

// grow_pages and keep_free are caller counts up to SIZE_MAX: bounded by the range, never
// added past it (a sum that wraps would map too few pages, or unmap a used block's page).
TEST_F(KvCache, HugeGrowAndKeepCountsSaturate) {
  vmm_page_pool pool(sim);
  kv_block_storage st(pool, 16 * KiB, 1000, /*grow_pages=*/SIZE_MAX);  // 8 pages of range
  ASSERT_TRUE(st.try_allocate().has_value());
  EXPECT_EQ(st.capacity_blocks(), 1000u);  // "at least SIZE_MAX pages": the whole range
  EXPECT_EQ(st.shrink(), 7u);              // block 0 keeps the first page
  EXPECT_TRUE(st.grow_to(200));
  EXPECT_EQ(st.capacity_blocks(), 1000u) << "1 + SIZE_MAX pages wrapped to 0";
  while (st.used_blocks() < 129) ASSERT_TRUE(st.try_allocate().has_value());
  EXPECT_TRUE(st.is_used(128));  // the first block of the second page
  EXPECT_EQ(st.shrink(SIZE_MAX), 0u);
  EXPECT_EQ(st.shrink(SIZE_MAX - 1), 0u);
  EXPECT_EQ(st.shrink(SIZE_MAX - 129), 0u);
  EXPECT_TRUE(st.is_used(128));
  EXPECT_EQ(st.validate(), "");
  EXPECT_EQ(st.shrink(0), 6u);  // pages 2..7 hold no used block
  EXPECT_EQ(st.validate(), "");
  EXPECT_EQ(pool.validate(), "");
}

TEST_F(KvCache, StorageAndPoolShareOneBudget) {
  pool_options o;
  o.limit_bytes = 8 * MiB;  // four pages for the pool and the cache together
  vmm_page_pool pool(sim, 0, o);
  kv_block_storage st(pool, 16 * KiB, 4096);
  ASSERT_TRUE(st.grow_to(3 * 128));
  EXPECT_EQ(pool.stats().reserved_bytes, 6 * MiB);
  EXPECT_THROW(pool.allocate(4 * MiB), gpumem::out_of_memory);  // only one page left
  const auto created = pool.page_counts().pages_created;
  EXPECT_EQ(st.shrink(), 3u);  // nothing in use: every page goes back
  void* p = pool.allocate(4 * MiB);  // ... and serves the pool: no new memory
  EXPECT_EQ(pool.page_counts().pages_created, created);
  pool.deallocate(p, 4 * MiB);
  // Back to the cache: the pool's kept and freed pages are remapped, still no new memory.
  ASSERT_TRUE(st.grow_to(3 * 128));
  EXPECT_EQ(pool.page_counts().pages_created, created);
  EXPECT_LE(pool.stats().reserved_bytes, 8 * MiB);
  EXPECT_EQ(pool.validate(), "");
  EXPECT_EQ(st.validate(), "");
}

TEST_F(KvCache, ReturnPagesRefusesHandlesNotLent) {
  vmm_page_pool pool(sim);
  auto lent = pool.lend_pages(2);
  ASSERT_EQ(lent.size(), 2u);
  std::vector<physical_handle> bad{lent[0], physical_handle{123456}};
  EXPECT_THROW(pool.return_pages(bad), gpumem::invalid_argument);
  std::vector<physical_handle> twice{lent[0], lent[0]};
  EXPECT_THROW(pool.return_pages(twice), gpumem::invalid_argument);
  EXPECT_EQ(pool.page_counts().lent_pages, 2u);  // nothing taken back
  pool.return_pages(lent);
  EXPECT_EQ(pool.page_counts().lent_pages, 0u);
  EXPECT_EQ(pool.page_counts().spare_pages, 2u);
  EXPECT_EQ(pool.validate(), "");
}

TEST_F(KvCache, AppendAllocatesBlocksAsTheyFill) {
  vmm_page_pool pool(sim);
  kv_cache kv(pool, config());
  auto a = kv.add_sequence(token_run(20));
  EXPECT_EQ(a.cached_tokens, 0u);
  EXPECT_EQ(kv.block_table(a.id).size(), 2u);
  EXPECT_EQ(kv.sequence_tokens(a.id), 20u);
  EXPECT_EQ(kv.blocks_needed(a.id, 12), 0u);
  EXPECT_EQ(kv.blocks_needed(a.id, 13), 1u);
  kv.append(a.id, token_run(12, 100));
  EXPECT_EQ(kv.block_table(a.id).size(), 2u);
  kv.append(a.id, token_run(1, 200));
  EXPECT_EQ(kv.block_table(a.id).size(), 3u);
  const auto st = kv.stats();
  EXPECT_EQ(st.used_blocks, 3u);
  EXPECT_EQ(st.filled_slots, 33u);
  EXPECT_NEAR(st.waste_fraction(16), 1.0 - 33.0 / 48.0, 1e-12);
  EXPECT_EQ(kv.validate(), "");
  kv.free(a.id);
  EXPECT_EQ(kv.stats().used_blocks, 0u);
  EXPECT_EQ(kv.validate(), "");
}

TEST_F(KvCache, ForkSharesBlocksAndCopiesOnWriteWithTheBytes) {
  vmm_page_pool pool(sim);
  kv_cache kv(pool, config());
  auto a = kv.add_sequence(token_run(20));
  auto table = kv.block_table(a.id);
  for (std::size_t i = 0; i < 20; ++i) *slot(kv, table, i) = static_cast<token_id>(1000 + i);
  const auto b = kv.fork(a.id);
  EXPECT_EQ(kv.block_table(b), table);
  EXPECT_EQ(kv.stats().used_blocks, 2u);
  // The shared full block is not copied; the shared partial one is, bytes and all.
  kv.append(b, token_run(1, 77));
  auto tb = kv.block_table(b);
  EXPECT_EQ(tb[0], table[0]);
  EXPECT_NE(tb[1], table[1]);
  EXPECT_EQ(kv.stats().cow_copies, 1u);
  for (std::size_t i = 0; i < 20; ++i) EXPECT_EQ(*slot(kv, tb, i), static_cast<token_id>(1000 + i));
  *slot(kv, tb, 20) = 77;
  // The original can now write in place: its last block is its own again.
  kv.append(a.id, token_run(1, 88));
  EXPECT_EQ(kv.block_table(a.id), table);
  EXPECT_EQ(kv.stats().cow_copies, 1u);
  *slot(kv, table, 20) = 88;
  EXPECT_EQ(*slot(kv, tb, 20), 77);
  EXPECT_EQ(kv.validate(), "");
  kv.free(a.id);
  EXPECT_EQ(kv.block_table(b)[0], table[0]);  // still held by the fork
  kv.free(b);
  EXPECT_EQ(kv.validate(), "");
}

TEST_F(KvCache, PrefixCachingReusesFullBlocksOfAMatchingPrompt) {
  vmm_page_pool pool(sim);
  kv_cache kv(pool, config());
  auto system = token_run(32, 5000);  // two full blocks of shared system prompt
  auto p1 = system;
  p1.push_back(1);
  auto a = kv.add_sequence(p1);
  const auto ta = kv.block_table(a.id);
  auto p2 = system;
  p2.insert(p2.end(), {7, 8, 9});
  auto b = kv.add_sequence(p2);
  EXPECT_EQ(b.cached_tokens, 32u);
  const auto tb = kv.block_table(b.id);
  EXPECT_EQ(tb[0], ta[0]);
  EXPECT_EQ(tb[1], ta[1]);
  EXPECT_NE(tb[2], ta[2]);
  // Another tenant's salt never shares.
  auto c = kv.add_sequence(p2, /*salt=*/42);
  EXPECT_EQ(c.cached_tokens, 0u);
  // A prompt that is exactly the cached blocks still leaves its last token to compute.
  auto d = kv.add_sequence(system);
  EXPECT_EQ(d.cached_tokens, 16u);
  // After every user is gone the blocks stay cached and still hit.
  for (auto id : {a.id, b.id, c.id, d.id}) kv.free(id);
  EXPECT_GT(kv.stats().cached_blocks, 0u);
  auto e = kv.add_sequence(p1);
  EXPECT_EQ(e.cached_tokens, 32u);
  EXPECT_EQ(kv.block_table(e.id)[0], ta[0]);
  const auto st = kv.stats();
  EXPECT_GT(st.prefix_hits, 0u);
  EXPECT_EQ(kv.validate(), "");
  kv.free(e.id);
}

TEST_F(KvCache, EvictsLeastRecentlyUsedCachedBlocksWhenFull) {
  vmm_page_pool pool(sim);
  kv_cache kv(pool, config(/*max_blocks=*/4));
  auto old_prompt = token_run(33, 100);  // 2 full blocks + 1 token
  auto recent_prompt = token_run(17, 900);
  auto a = kv.add_sequence(old_prompt);
  kv.free(a.id);
  auto b = kv.add_sequence(recent_prompt);
  kv.free(b.id);
  EXPECT_EQ(kv.stats().cached_blocks, 3u);  // the partial blocks were freed outright
  // Three new blocks: one free, two evicted — the oldest, first freed last-block-first.
  auto c = kv.add_sequence(token_run(48, 5));
  EXPECT_EQ(kv.stats().evictions, 2u);
  kv.free(c.id);
  // The recent prompt's block survived; the old prompt's did not.
  auto d = kv.add_sequence(recent_prompt);
  EXPECT_EQ(d.cached_tokens, 16u);
  kv.free(d.id);
  EXPECT_EQ(kv.add_sequence(old_prompt).cached_tokens, 0u);
  EXPECT_EQ(kv.validate(), "");
}

TEST_F(KvCache, SwapOutAndInKeepsTheBytes) {
  vmm_page_pool pool(sim);
  pinned_host_pool host(sim);
  auto s = make_stream();
  auto c = config();
  c.stream = s;
  kv_cache kv(pool, c, &host);
  auto a = kv.add_sequence(token_run(40));
  auto table = kv.block_table(a.id);
  for (std::size_t i = 0; i < 40; ++i) *slot(kv, table, i) = static_cast<token_id>(i * 7 + 3);
  kv.swap_out(a.id);
  EXPECT_TRUE(kv.is_swapped(a.id));
  EXPECT_EQ(kv.block_table(a.id),
            std::vector<kv_cache::block_id>(3, kv_cache::not_resident));
  EXPECT_THROW(kv.append(a.id, token_run(1)), gpumem::invalid_argument);
  EXPECT_THROW(kv.fork(a.id), gpumem::invalid_argument);
  // Someone else takes and overwrites the blocks meanwhile.
  auto b = kv.add_sequence(token_run(48, 1));
  auto tb = kv.block_table(b.id);
  for (std::size_t i = 0; i < 48; ++i) *slot(kv, tb, i) = -1;
  kv.swap_in(a.id);
  ASSERT_TRUE(sim.stream_synchronize(s).ok());
  auto back = kv.block_table(a.id);
  EXPECT_EQ(back.size(), 3u);
  for (std::size_t i = 0; i < 40; ++i)
    ASSERT_EQ(*slot(kv, back, i), static_cast<token_id>(i * 7 + 3)) << "token " << i;
  kv.append(a.id, token_run(1));
  const auto st = kv.stats();
  EXPECT_EQ(st.swaps_out, 1u);
  EXPECT_EQ(st.swaps_in, 1u);
  EXPECT_EQ(st.bytes_swapped_out, 3 * 16 * KiB);
  EXPECT_EQ(kv.validate(), "");
  kv.free(b.id);
  kv.swap_out(a.id);
  kv.free(a.id);  // freeing a swapped sequence gives its host memory back
  EXPECT_EQ(host.stats().live_bytes, 0u);
}

TEST_F(KvCache, SwapLeavesSharedBlocksResident) {
  vmm_page_pool pool(sim);
  pinned_host_pool host(sim);
  kv_cache kv(pool, config(), &host);
  auto system = token_run(32, 500);
  auto p1 = system, p2 = system;
  p1.insert(p1.end(), {1, 2, 3});
  p2.insert(p2.end(), {4, 5});
  auto a = kv.add_sequence(p1);
  auto b = kv.add_sequence(p2);
  const auto ta = kv.block_table(a.id);
  for (std::size_t i = 0; i < 35; ++i) *slot(kv, ta, i) = static_cast<token_id>(i + 1);
  const auto used = kv.stats().used_blocks;  // 2 shared + 1 each
  kv.swap_out(a.id);
  EXPECT_EQ(kv.stats().bytes_swapped_out, 16 * KiB);  // only a's own last block moved
  EXPECT_EQ(kv.stats().used_blocks, used - 1);
  const auto away = kv.block_table(a.id);
  EXPECT_EQ(away[0], ta[0]);
  EXPECT_EQ(away[1], ta[1]);
  EXPECT_EQ(away[2], kv_cache::not_resident);
  EXPECT_EQ(kv.blocks_needed(a.id, 0), 1u);
  EXPECT_EQ(kv.validate(), "");
  kv.swap_in(a.id);
  const auto back = kv.block_table(a.id);
  EXPECT_EQ(back[0], ta[0]);
  for (std::size_t i = 0; i < 35; ++i) ASSERT_EQ(*slot(kv, back, i), static_cast<token_id>(i + 1));
  EXPECT_EQ(kv.validate(), "");
  kv.free(a.id);
  kv.free(b.id);
}

// Scrub: a block is zeroed before anyone else can hold it — read through the next owner's
// block table. A failing memset keeps the block out of the free set until a retry succeeds.
TEST_F(KvCache, ScrubZeroesBlocksBeforeTheNextOwner) {
  vmm_page_pool pool(sim);
  auto c = config(/*max_blocks=*/2);
  c.scrub = true;
  c.prefix_caching = false;
  kv_cache kv(pool, c);
  auto a = kv.add_sequence(token_run(32));
  const auto ta = kv.block_table(a.id);
  fill(kv.block_address(ta[0]), 16 * KiB, 0xa5);
  fill(kv.block_address(ta[1]), 16 * KiB, 0x5a);
  kv.free(a.id);
  EXPECT_EQ(kv.stats().blocks_scrubbed, 2u);
  auto b = kv.add_sequence(token_run(32, 900));
  for (auto blk : kv.block_table(b.id)) EXPECT_TRUE(holds(kv.block_address(blk), 16 * KiB, 0));
  // The memset fails once: the block waits, and is zeroed before the next operation.
  fill(kv.block_address(kv.block_table(b.id)[1]), 16 * KiB, 0x77);
  gpumem::sim_fault f;
  f.nth = 1;
  f.kind = gpumem::failure_kind::driver_error;
  sim.inject_fault(platform_op::memset_async, f);
  kv.free(b.id);
  sim.clear_faults();
  EXPECT_EQ(kv.stats().free_blocks, 1u);  // one zeroed, one waiting
  EXPECT_EQ(kv.validate(), "");
  auto d = kv.add_sequence(token_run(32, 5));
  for (auto blk : kv.block_table(d.id)) EXPECT_TRUE(holds(kv.block_address(blk), 16 * KiB, 0));
  EXPECT_EQ(kv.validate(), "");
  kv.free(d.id);
}

TEST_F(KvCache, RefusalsAreTypedAndLeaveTheCacheIntact) {
  vmm_page_pool pool(sim);
  auto c = config(/*max_blocks=*/3);
  c.max_sequence_tokens = 40;
  kv_cache kv(pool, c);
  auto a = kv.add_sequence(token_run(20));
  auto before = kv.stats();
  auto table = kv.block_table(a.id);
  auto same = [&] {
    const auto now = kv.stats();
    EXPECT_EQ(now.used_blocks, before.used_blocks);
    EXPECT_EQ(now.filled_slots, before.filled_slots);
    EXPECT_EQ(now.sequences, before.sequences);
    EXPECT_EQ(kv.block_table(a.id), table);
    EXPECT_EQ(kv.validate(), "");
  };
  EXPECT_THROW(kv.append(999, token_run(1)), gpumem::invalid_argument);
  try {
    kv.append(a.id, token_run(21));
    ADD_FAILURE() << "append past max_sequence_tokens accepted";
  } catch (const gpumem::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_sequence_tokens"), std::string::npos);
  }
  same();
  EXPECT_THROW(kv.add_sequence(token_run(41)), gpumem::invalid_argument);
  EXPECT_THROW(kv.swap_out(a.id), gpumem::invalid_argument);  // no host pool
  // Two more blocks needed, one left: refused with a report, nothing taken.
  auto b = kv.add_sequence(token_run(10, 50));
  before = kv.stats();
  try {
    kv.append(b.id, token_run(20));
    ADD_FAILURE() << "append beyond the blocks accepted";
  } catch (const gpumem::out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("KV cache out of blocks"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("page pool"), std::string::npos) << e.what();
  }
  same();
  EXPECT_EQ(kv.sequence_tokens(b.id), 10u);
  kv.free(b.id);
  try {
    kv.fork(b.id);
    ADD_FAILURE() << "fork of a freed sequence accepted";
  } catch (const gpumem::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("was freed"), std::string::npos);
  }
  EXPECT_THROW(kv.free(b.id), gpumem::invalid_argument);
  kv.free(a.id);
  EXPECT_EQ(kv.validate(), "");
}

TEST_F(KvCache, ElasticCapacityGivesPagesBackAndTakesThemAgain) {
  vmm_page_pool pool(sim);
  kv_cache kv(pool, config());
  std::vector<kv_cache::sequence_id> seqs;
  for (int i = 0; i < 40; ++i) seqs.push_back(kv.add_sequence(token_run(100, i * 1000)).id);
  const auto peak = kv.stats().mapped_bytes;
  EXPECT_GE(peak, 4 * MiB);  // 280 blocks of 16 KiB: three pages
  for (auto id : seqs) kv.free(id);
  EXPECT_GT(kv.shrink(0, /*drop_cached=*/true), 0u);
  EXPECT_EQ(kv.stats().mapped_bytes, 0u);
  EXPECT_EQ(pool.page_counts().lent_pages, 0u);
  const auto created = pool.page_counts().pages_created;
  for (int i = 0; i < 40; ++i) kv.free(kv.add_sequence(token_run(100, i)).id);
  EXPECT_EQ(pool.page_counts().pages_created, created);  // the same pages came back
  EXPECT_EQ(kv.validate(), "");
  EXPECT_EQ(pool.validate(), "");
}

// Reference-model fuzz: random add (with shared prefixes), append, fork, free, swap,
// evict and shrink. After every step: validate(), token counts match the model, and every
// token's bytes in device memory match what was written (so copy on write, prefix
// sharing and swap never lose or mix bytes).
TEST_F(KvCache, ReferenceModelFuzz) {
  vmm_page_pool pool(sim);
  pinned_host_pool host(sim);
  auto c = config(/*max_blocks=*/64);
  c.grow_pages = 0;
  kv_cache kv(pool, c, &host);
  std::mt19937_64 rng(2026);
  std::map<kv_cache::sequence_id, std::vector<token_id>> model;
  std::vector<std::vector<token_id>> prefixes{token_run(48, 10000), token_run(32, 20000), token_run(16, 30000)};
  auto write_tail = [&](kv_cache::sequence_id id, std::size_t from) {
    auto table = kv.block_table(id);
    auto& t = model[id];
    for (std::size_t i = from; i < t.size(); ++i) *slot(kv, table, i) = t[i];
  };
  std::uint64_t ops = 0, refusals = 0;
  for (int step = 0; step < 4000; ++step) {
    // Free more often as sequences pile up, so the cache keeps cycling near its cap.
    const int op = model.size() > 20 && rng() % 3 == 0 ? 7 : static_cast<int>(rng() % 10);
    auto pick = [&]() { auto it = model.begin(); std::advance(it, rng() % model.size()); return it->first; };
    try {
      if (op <= 2 || model.empty()) {
        std::vector<token_id> prompt;
        if (rng() % 2) prompt = prefixes[rng() % prefixes.size()];
        const std::size_t extra = rng() % 40;
        for (std::size_t i = 0; i < extra; ++i) prompt.push_back(static_cast<token_id>(rng() % 50000));
        auto a = kv.add_sequence(prompt);
        model[a.id] = prompt;
        write_tail(a.id, a.cached_tokens);
      } else if (op <= 5) {
        auto id = pick();
        if (kv.is_swapped(id)) {
          kv.swap_in(id);
        } else {
          const std::size_t n = 1 + rng() % 20;
          std::vector<token_id> more;
          for (std::size_t i = 0; i < n; ++i) more.push_back(static_cast<token_id>(rng() % 50000));
          kv.append(id, more);
          auto& t = model[id];
          const std::size_t from = t.size();
          t.insert(t.end(), more.begin(), more.end());
          write_tail(id, from);
        }
      } else if (op == 6) {
        auto id = pick();
        if (!kv.is_swapped(id)) model[kv.fork(id)] = model[id];
      } else if (op == 7 && !model.empty()) {
        auto id = pick();
        kv.free(id);
        model.erase(id);
      } else if (op == 8) {
        auto id = pick();
        if (!kv.is_swapped(id)) kv.swap_out(id);
      } else {
        if (rng() % 2) kv.evict(rng() % 8);
        else kv.shrink(rng() % 16, rng() % 4 == 0);
      }
      ++ops;
    } catch (const gpumem::out_of_memory&) {
      ++refusals;  // the cache is full: fine, as long as nothing changed (checked below)
    }
    ASSERT_EQ(kv.validate(), "") << "step " << step;
    if (step % 50 == 0 || step > 3900) {
      for (auto& [id, t] : model) {
        ASSERT_EQ(kv.sequence_tokens(id), t.size());
        if (kv.is_swapped(id)) continue;
        auto table = kv.block_table(id);
        for (std::size_t i = 0; i < t.size(); ++i)
          ASSERT_EQ(*slot(kv, table, i), t[i]) << "step " << step << " seq " << id << " token " << i;
      }
    }
  }
  EXPECT_GT(ops, 3000u);
  EXPECT_GT(refusals, 0u);  // the cap was reached
  const auto st = kv.stats();
  EXPECT_GT(st.prefix_hits, 0u);
  EXPECT_GT(st.cow_copies, 0u);
  EXPECT_GT(st.swaps_in, 0u);
  EXPECT_GT(st.evictions, 0u);
  for (auto& [id, t] : model) kv.free(id);
  EXPECT_EQ(kv.validate(), "");
}

TEST_F(KvCache, PinnedHostPoolReusesCachedBlocksInStreamOrder) {
  pinned_host_pool host(sim);
  auto s1 = make_stream();
  auto s2 = make_stream();
  void* a = host.allocate(2 * MiB, s1);
  std::memset(a, 0xab, 2 * MiB);  // host memory: writable
  const auto allocs = calls(platform_op::host_alloc);
  host.deallocate(a, 2 * MiB, s1);
  void* b = host.allocate(2 * MiB, s1);  // same stream: at once, no new pinned memory
  EXPECT_EQ(b, a);
  EXPECT_EQ(calls(platform_op::host_alloc), allocs);
  sim.hold_events(true);
  host.deallocate(b, 2 * MiB, s1);
  void* c = host.allocate(2 * MiB, s2);  // s1's copy may still read it: not handed to s2
  EXPECT_NE(c, b);
  host.deallocate(c, 2 * MiB, s2);
  sim.complete_events();
  sim.hold_events(false);
  EXPECT_THROW(host.deallocate(reinterpret_cast<char*>(a) + 8, 16), gpumem::invalid_argument);
  EXPECT_THROW(host.allocate(0), gpumem::invalid_argument);
  EXPECT_EQ(host.stats().live_bytes, 0u);
  EXPECT_GT(host.trim(), 0u);
  EXPECT_EQ(host.validate(), "");
}

}  // namespace
