// Stress on sim: threads add, append to, fork, swap and free sequences of one kv_cache at
// once (a fixed number of operations each), while another thread allocates from the same
// vmm_page_pool (one memory budget). Every token's id is written into its KV slot and
// each thread checks its sequences' tokens before freeing them, so a block handed to two
// sequences, or reused while referenced, shows. Each thread uses prompts of its own (a
// prefix-hit block's bytes are written by the engine after add_sequence returns, so
// sharing a prefix across threads would be a race in the test, not in the cache).
// Afterwards validate() holds, nothing is used and sim holds nothing. TSan-clean (CI).
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "fuzz/kv_cache_fuzz_driver.hpp"

namespace {

using namespace gpumem;
using gpumem_fuzz::MiB;

constexpr int kv_threads = 6;
constexpr int kv_ops_per_thread = 800;

TEST(kv_cache_stress, threads_add_append_fork_swap_and_free_concurrently) {
  sim_options so;
  so.capacity = std::size_t{512} << 20;
  so.granularity = 2 * MiB;
  sim_platform sim(so);
  auto stream = sim.stream_create(0);
  ASSERT_TRUE(stream.ok());
  std::atomic<std::uint64_t> corrupted{0}, failures{0}, refusals{0}, ops{0}, pool_allocs{0};
  {
    vmm_page_pool pages(sim);
    pinned_host_pool host(sim);
    kv_cache_config c;
    c.layout = gpumem_fuzz::detail::fuzz_kv_layout();
    c.max_blocks = 512;
    c.stream = stream.value();
    kv_cache kv(pages, c, &host);
    auto slot = [&](const std::vector<kv_cache::block_id>& table, std::size_t pos) {
      const kv_layout& l = kv.layout();
      return reinterpret_cast<token_id*>(kv.base() + l.offset(table[pos / l.block_tokens], 0, 0,
                                                              pos % l.block_tokens, 0, 0));
    };
    std::vector<std::thread> workers;
    for (int t = 0; t < kv_threads; ++t) {
      workers.emplace_back([&, t] {
        std::mt19937_64 rng(9100 + static_cast<std::uint64_t>(t));
        std::vector<token_id> prefix(48);
        std::iota(prefix.begin(), prefix.end(), 100000 * (t + 1));
        std::map<kv_cache::sequence_id, std::vector<token_id>> mine;
        auto write = [&](kv_cache::sequence_id id, std::size_t from) {
          auto table = kv.block_table(id);
          const auto& tok = mine[id];
          for (std::size_t i = from; i < tok.size(); ++i) *slot(table, i) = tok[i];
        };
        auto verify = [&](kv_cache::sequence_id id) {
          if (kv.is_swapped(id)) kv.swap_in(id);
          auto table = kv.block_table(id);
          const auto& tok = mine[id];
          if (kv.sequence_tokens(id) != tok.size()) corrupted.fetch_add(1);
          for (std::size_t i = 0; i < tok.size(); ++i)
            if (*slot(table, i) != tok[i]) {
              corrupted.fetch_add(1);
              break;
            }
        };
        auto pick = [&] {
          auto it = mine.begin();
          std::advance(it, static_cast<std::ptrdiff_t>(rng() % mine.size()));
          return it->first;
        };
        for (int i = 0; i < kv_ops_per_thread; ++i) {
          ops.fetch_add(1);
          const auto r = rng() % 100;
          try {
            if (mine.empty() || r < 25) {
              std::vector<token_id> prompt;
              if (rng() % 2) prompt = prefix;
              const std::size_t extra = rng() % 40;
              for (std::size_t k = 0; k < extra; ++k)
                prompt.push_back(static_cast<token_id>(1 + rng() % 50000));
              auto a = kv.add_sequence(prompt);
              mine[a.id] = prompt;
              write(a.id, a.cached_tokens);
            } else if (r < 55) {
              const auto id = pick();
              if (kv.is_swapped(id)) {
                kv.swap_in(id);
                continue;
              }
              if (mine[id].size() > 400) continue;
              std::vector<token_id> more(1 + rng() % 20);
              for (auto& x : more) x = static_cast<token_id>(1 + rng() % 50000);
              kv.append(id, more);
              auto& tok = mine[id];
              const std::size_t from = tok.size();
              tok.insert(tok.end(), more.begin(), more.end());
              write(id, from);
            } else if (r < 65) {
              const auto id = pick();
              if (!kv.is_swapped(id)) mine[kv.fork(id)] = mine[id];
            } else if (r < 70) {
              const auto id = pick();
              if (!kv.is_swapped(id)) kv.swap_out(id);
            } else if (r < 95 || mine.size() > 12) {
              const auto id = pick();
              verify(id);
              kv.free(id);
              mine.erase(id);
            } else {
              (void)kv.evict(rng() % 4);
            }
          } catch (const gpumem::out_of_memory&) {
            refusals.fetch_add(1);  // the cache is full: refused, nothing changed
          } catch (const std::exception&) {
            failures.fetch_add(1);
          }
        }
        for (auto& [id, tok] : mine) {
          try {
            verify(id);
          } catch (const gpumem::out_of_memory&) {
            refusals.fetch_add(1);  // no room to swap it back in: free it swapped
          }
          try {
            kv.free(id);
          } catch (const std::exception&) {
            failures.fetch_add(1);
          }
        }
      });
    }
    // The pool's own user, sharing the budget with the cache.
    workers.emplace_back([&] {
      std::mt19937_64 rng(77);
      std::uint64_t checked = 0, serial = 0;
      std::vector<std::pair<void*, std::pair<std::size_t, std::uint64_t>>> held;
      for (int i = 0; i < kv_ops_per_thread; ++i) {
        if (held.size() < 8 && (held.empty() || rng() % 2)) {
          const std::size_t n = 1 + rng() % (4 * MiB);
          try {
            void* p = pages.allocate(n);
            gpumem_fuzz::detail::write_pattern(p, n, ++serial);
            held.push_back({p, {n, serial}});
            pool_allocs.fetch_add(1);
          } catch (const gpumem::out_of_memory&) {
            refusals.fetch_add(1);
          }
        } else {
          auto [p, ns] = held.back();
          held.pop_back();
          if (!gpumem_fuzz::detail::pattern_holds(p, ns.first, ns.second, true, checked))
            corrupted.fetch_add(1);
          pages.deallocate(p, ns.first);
        }
      }
      for (auto& [p, ns] : held) {
        if (!gpumem_fuzz::detail::pattern_holds(p, ns.first, ns.second, true, checked))
          corrupted.fetch_add(1);
        pages.deallocate(p, ns.first);
      }
    });
    for (auto& w : workers) w.join();

    EXPECT_EQ(corrupted.load(), 0u) << "a token or block was overwritten by another owner";
    EXPECT_EQ(failures.load(), 0u) << "an operation failed with something other than out_of_memory";
    EXPECT_EQ(kv.validate(), "");
    const auto st = kv.stats();
    EXPECT_EQ(st.sequences, 0u);
    EXPECT_EQ(st.used_blocks, 0u);
    EXPECT_GT(st.prefix_hits, 0u);
    EXPECT_GT(st.cow_copies, 0u);
    EXPECT_GT(st.swaps_in, 0u);
    EXPECT_GT(pool_allocs.load(), 0u);
    std::printf("[stress] kv_cache: %d threads x %d operations + a pool thread: %llu prefix hits, "
                "%llu copies on write, %llu swaps in, %llu evictions, %llu refusals, %llu corrupted\n",
                kv_threads, kv_ops_per_thread, static_cast<unsigned long long>(st.prefix_hits),
                static_cast<unsigned long long>(st.cow_copies),
                static_cast<unsigned long long>(st.swaps_in),
                static_cast<unsigned long long>(st.evictions),
                static_cast<unsigned long long>(refusals.load()),
                static_cast<unsigned long long>(corrupted.load()));
    (void)kv.shrink(0, true);
    EXPECT_EQ(kv.validate(), "");
    EXPECT_EQ(pages.stats().live_bytes, 0u);
    EXPECT_EQ(pages.validate(), "");
  }
  EXPECT_TRUE(sim.stream_destroy(stream.value()).ok());
  const auto live = sim.live_objects();
  EXPECT_TRUE(live.none()) << "left on the sim device: " << live.describe();
}

}  // namespace
