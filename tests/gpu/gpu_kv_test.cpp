// GPU tests of the KV layer on the real driver: blocks on pages lent by vmm_page_pool and
// mapped into the cache's own range, copy on write and swap as real device copies, pinned
// host memory from the pool, and shrink/grow moving pages between cache and pool. Each
// test skips, saying why, when no CUDA device is present (CI has none).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "gpumem/kv.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

#include "gpu/gpu_test_support.hpp"

namespace {

using namespace gpumem;

using gpumem_test::cuda;

kv_cache_config small_config(stream_handle s) {
  kv_cache_config c;
  c.layout = {2, 2, 64, kv_dtype::bf16, 16};  // 16 KiB blocks
  c.max_blocks = 4096;
  c.stream = s;
  return c;
}

// Writes token ids into layer 0's key slots of a sequence's tokens [from, to).
void write_tokens(platform& p, const kv_cache& kv, kv_cache::sequence_id id, std::size_t from,
                  std::size_t to, stream_handle s) {
  const auto table = kv.block_table(id);
  const kv_layout& l = kv.layout();
  for (std::size_t i = from; i < to; ++i) {
    const token_id v = static_cast<token_id>(id * 100000 + i);
    void* dst = reinterpret_cast<void*>(kv.base() + l.offset(table[i / l.block_tokens], 0, 0,
                                                             i % l.block_tokens, 0, 0));
    ASSERT_TRUE(p.memcpy_async(dst, &v, sizeof v, s).ok());
    ASSERT_TRUE(p.stream_synchronize(s).ok());  // v lives on this stack frame
  }
}

// Reads the slots back; `owner` is the sequence whose ids were written.
std::vector<token_id> read_tokens(platform& p, const kv_cache& kv, kv_cache::sequence_id id,
                                  std::size_t n, stream_handle s) {
  const auto table = kv.block_table(id);
  const kv_layout& l = kv.layout();
  std::vector<token_id> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const void* src = reinterpret_cast<const void*>(
        kv.base() + l.offset(table[i / l.block_tokens], 0, 0, i % l.block_tokens, 0, 0));
    EXPECT_TRUE(p.memcpy_async(&out[i], src, sizeof(token_id), s).ok());
  }
  EXPECT_TRUE(p.stream_synchronize(s).ok());
  return out;
}

std::vector<token_id> expected(kv_cache::sequence_id id, std::size_t n) {
  std::vector<token_id> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<token_id>(id * 100000 + i);
  return v;
}

TEST(gpu_kv, fork_copy_on_write_and_swap_keep_the_bytes) {
  REQUIRE_GPU();
  platform& p = *cuda();
  auto s = p.stream_create(0);
  ASSERT_TRUE(s.ok());
  {
    vmm_page_pool pages(p, 0);
    pinned_host_pool host(p, 0);
    kv_cache kv(pages, small_config(s.value()), &host);
    std::vector<token_id> prompt(40);
    std::iota(prompt.begin(), prompt.end(), 1);
    const auto a = kv.add_sequence(prompt).id;
    write_tokens(p, kv, a, 0, 40, s.value());
    const auto b = kv.fork(a);
    const token_id one[1] = {9};
    kv.append(b, one);  // copy on write of the shared last block, on the device
    EXPECT_EQ(kv.stats().cow_copies, 1u);
    EXPECT_NE(kv.block_table(b)[2], kv.block_table(a)[2]);
    EXPECT_EQ(read_tokens(p, kv, b, 40, s.value()), expected(a, 40));
    // Swap a out, let another sequence overwrite its blocks, swap it back in.
    kv.swap_out(a);
    const auto c = kv.add_sequence(std::vector<token_id>(64, 5)).id;
    write_tokens(p, kv, c, 0, 64, s.value());
    kv.swap_in(a);
    EXPECT_EQ(read_tokens(p, kv, a, 40, s.value()), expected(a, 40));
    EXPECT_EQ(read_tokens(p, kv, c, 64, s.value()), expected(c, 64));
    EXPECT_EQ(kv.validate(), "");
    for (auto id : {a, b, c}) kv.free(id);
    EXPECT_EQ(host.stats().live_bytes, 0u);
  }
  ASSERT_TRUE(p.stream_destroy(s.value()).ok());
}

TEST(gpu_kv, pages_move_between_cache_and_pool_and_data_survives) {
  REQUIRE_GPU();
  platform& p = *cuda();
  auto s = p.stream_create(0);
  ASSERT_TRUE(s.ok());
  {
    vmm_page_pool pages(p, 0);
    kv_cache kv(pages, small_config(s.value()));
    // Fill three pages' worth of blocks, keep the first sequence, free the rest.
    std::vector<kv_cache::sequence_id> seqs;
    for (int i = 0; i < 12; ++i) seqs.push_back(kv.add_sequence(std::vector<token_id>(500, i)).id);
    write_tokens(p, kv, seqs[0], 0, 500, s.value());
    const auto mapped = kv.stats().mapped_bytes;
    for (std::size_t i = 1; i < seqs.size(); ++i) kv.free(seqs[i]);
    // Cached prefix blocks dropped too: unmapped on the device, handles back to the pool.
    EXPECT_GT(kv.shrink(0, /*drop_cached=*/true), 0u);
    EXPECT_LT(kv.stats().mapped_bytes, mapped);
    // The pool uses the returned pages for its own allocation: no new physical memory.
    const auto created = pages.page_counts().pages_created;
    void* x = pages.allocate(2 << 20);
    EXPECT_EQ(pages.page_counts().pages_created, created);
    std::vector<unsigned char> pattern(2 << 20, 0x5a), back(2 << 20);
    ASSERT_TRUE(p.memcpy_async(x, pattern.data(), pattern.size(), s.value()).ok());
    ASSERT_TRUE(p.memcpy_async(back.data(), x, back.size(), s.value()).ok());
    ASSERT_TRUE(p.stream_synchronize(s.value()).ok());
    EXPECT_EQ(back, pattern);
    pages.deallocate(x, 2 << 20, s.value());
    ASSERT_TRUE(p.stream_synchronize(s.value()).ok());
    // And the cache grows again onto them; the kept sequence's bytes never moved.
    for (int i = 0; i < 11; ++i) kv.add_sequence(std::vector<token_id>(500, 100 + i));
    EXPECT_EQ(read_tokens(p, kv, seqs[0], 500, s.value()), expected(seqs[0], 500));
    EXPECT_EQ(kv.validate(), "");
    EXPECT_EQ(pages.validate(), "");
  }
  ASSERT_TRUE(p.stream_destroy(s.value()).ok());
}

// scrub:on on the real device: a freed block reaches its next owner zeroed (pools), and a
// released KV block too.
TEST(gpu_scrub, pools_and_kv_blocks_are_zeroed_before_reuse) {
  REQUIRE_GPU();
  platform& p = *cuda();
  auto s = p.stream_create(0);
  ASSERT_TRUE(s.ok());
  {
    vmm_page_pool pool(p, 0, pool_options::parse("scrub:on"));
    constexpr std::size_t n = 3 << 20;
    std::vector<unsigned char> dirty(n, 0xc3), back(n, 1);
    void* a = pool.allocate(n, 256, s.value());
    ASSERT_TRUE(p.memcpy_async(a, dirty.data(), n, s.value()).ok());
    pool.deallocate(a, n, s.value());
    void* b = pool.allocate(n, 256, s.value());
    EXPECT_EQ(b, a);
    ASSERT_TRUE(p.memcpy_async(back.data(), b, n, s.value()).ok());
    ASSERT_TRUE(p.stream_synchronize(s.value()).ok());
    EXPECT_EQ(back, std::vector<unsigned char>(n, 0));
    pool.deallocate(b, n, s.value());

    auto c = small_config(s.value());
    c.scrub = true;
    c.prefix_caching = false;
    kv_cache kv(pool, c);
    const auto x = kv.add_sequence(std::vector<token_id>(16, 1)).id;
    const auto blk = kv.block_table(x)[0];
    const std::size_t bs = kv.layout().block_stride();
    std::vector<unsigned char> pattern(bs, 0x5a), out(bs, 1);
    ASSERT_TRUE(p.memcpy_async(kv.block_address(blk), pattern.data(), bs, s.value()).ok());
    kv.free(x);
    const auto y = kv.add_sequence(std::vector<token_id>(16, 2)).id;
    EXPECT_EQ(kv.block_table(y)[0], blk);
    ASSERT_TRUE(p.memcpy_async(out.data(), kv.block_address(blk), bs, s.value()).ok());
    ASSERT_TRUE(p.stream_synchronize(s.value()).ok());
    EXPECT_EQ(out, std::vector<unsigned char>(bs, 0));
    kv.free(y);
  }
  ASSERT_TRUE(p.stream_destroy(s.value()).ok());
}

// guard:on on the real device: allocations end at a page boundary, bytes round-trip,
// pages are reused after free. (The overrun itself is shown by examples/guard_pages, in a
// process of its own: a fault can leave the context unusable.)
TEST(gpu_guard, allocations_end_at_the_guard_page_and_round_trip) {
  REQUIRE_GPU();
  platform& p = *cuda();
  vmm_page_pool pool(p, 0, pool_options::parse("guard:on"));
  constexpr std::size_t n = 3 << 20;
  void* a = pool.allocate(n);
  EXPECT_EQ((reinterpret_cast<std::uintptr_t>(a) + n) % pool.page_size(), 0u);
  std::vector<unsigned char> in(n), out(n, 0);
  for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<unsigned char>(i * 13);
  ASSERT_TRUE(p.memcpy_async(a, in.data(), n, {}).ok());
  ASSERT_TRUE(p.memcpy_async(out.data(), a, n, {}).ok());
  ASSERT_TRUE(p.stream_synchronize({}).ok());
  EXPECT_EQ(in, out);
  const auto created = pool.page_counts().pages_created;
  pool.deallocate(a, n);
  void* b = pool.allocate(n);
  EXPECT_EQ(pool.page_counts().pages_created, created);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(b, n);
}

}  // namespace
