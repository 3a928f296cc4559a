// Lifetime hints (src/pool/core/lifetime_hints.hpp, pool_options::lifetime_hints): which large
// requests are guessed long-lived, and what vmm_page_pool does with them (their blocks side
// by side in runs of their own, unrounded; the large arena takes their free space before
// it grows; off with a reservation).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "gpumem/replay/trace.hpp"
#include "pool/core/lifetime_hints.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem::detail::block;
using gpumem::detail::lifetime_hints;
using gpumem_test::KiB;
using gpumem_test::MiB;

// --- the guesses, on block records made here -----------------------------------------------

// Block records as an arena keeps them: allocated when placed, free when the user frees.
class records {
 public:
  block* allocate() {
    all_.emplace_back();
    block* b = &all_.back();
    b->addr = next_addr_;
    next_addr_ += 64 * MiB;
    b->st = block::state::allocated;
    return b;
  }
  static void free(block* b) { b->st = block::state::free; }

 private:
  std::deque<block> all_;  // stable addresses
  std::uintptr_t next_addr_ = 0x10000000;
};

// A pool's reserved bytes so large that no move-budget window closes in these tests.
constexpr std::size_t no_window = std::size_t{1} << 50;

struct request {
  bool guessed_long = false;
  block* b = nullptr;
};

request ask(lifetime_hints& h, records& r, std::size_t bytes) {
  const lifetime_hints::guess g = h.on_request(bytes, no_window);
  block* b = r.allocate();
  h.on_placed(g, b);
  return {g.long_lived, b};
}

constexpr std::size_t temp_a = 22 * MiB, kept = 5718016, temp_b = 2859008;

TEST(LifetimeHintsGuess, BlocksOfAKeyThatPileUpAreGuessedLongLivedAndTemporariesNever) {
  // A layer's loop: a temporary, a block kept to the end, another temporary; the temporaries
  // die within the layer.
  lifetime_hints h;
  records r;
  std::vector<bool> kept_long, temp_long;
  for (int layer = 0; layer < 12; ++layer) {
    const request a = ask(h, r, temp_a);
    const request k = ask(h, r, kept);
    const request b = ask(h, r, temp_b);
    records::free(a.b);
    records::free(b.b);
    kept_long.push_back(k.guessed_long);
    temp_long.push_back(a.guessed_long || b.guessed_long);
  }
  // Layer 0's key differs (no history yet); layers 1 and 2 make the key's first two blocks,
  // and layer 3 finds the one two back still live.
  for (int layer = 0; layer < 12; ++layer) {
    EXPECT_EQ(kept_long[layer], layer >= 3) << "layer " << layer;
    EXPECT_FALSE(temp_long[layer]) << "layer " << layer;
  }
}

TEST(LifetimeHintsGuess, AKeyWhoseBlocksStopPilingUpIsGuessedShortAgain) {
  lifetime_hints h;
  records r;
  for (int layer = 0; layer < 6; ++layer) {
    records::free(ask(h, r, temp_a).b);
    ask(h, r, kept);  // kept
  }
  // The same loop, now freeing the kept blocks within the layer: the score falls (it had
  // saturated at 2) and the guesses turn short, in at most three layers.
  int long_guesses = 0, layer = 0;
  bool last = true;
  for (; layer < 6; ++layer) {
    records::free(ask(h, r, temp_a).b);
    const request k = ask(h, r, kept);
    records::free(k.b);
    long_guesses += k.guessed_long ? 1 : 0;
    last = k.guessed_long;
  }
  EXPECT_FALSE(last);
  EXPECT_LE(long_guesses, 3);
}

TEST(LifetimeHintsGuess, ARecordReusedForAnotherRequestIsNotTakenForTheBlockItHeld) {
  // A freed record made again at the same address for another key's block (arenas recycle
  // records) is not the old block still live: the stamp in free_epoch tells them apart.
  lifetime_hints h;
  records r;
  std::vector<block*> reused;
  for (int layer = 0; layer < 8; ++layer) {
    records::free(ask(h, r, temp_a).b);
    const request k = ask(h, r, kept);
    records::free(k.b);
    // The kept block's record comes back at once, for a request of another size.
    const lifetime_hints::guess g = h.on_request(temp_b, no_window);
    k.b->st = block::state::allocated;
    h.on_placed(g, k.b);
    reused.push_back(k.b);
  }
  // Were the reused records taken for the dead blocks, the key would look like it piles up.
  EXPECT_FALSE(h.on_request(temp_a, no_window).long_lived);
  EXPECT_FALSE(h.on_request(kept, no_window).long_lived);
}

// --- the move budget --------------------------------------------------------------------------

// The layer loop of the guesses' tests in move-budget windows: a pool reserving 64 MiB
// judges every 128 MiB requested, and four layers of 16 + 8 + 8 MiB fill one window
// exactly (judged at its last request). Before window w's first request, moved(w) bytes are
// noted as gathered out of the long-lived runs. Returns the window whose judgement stopped
// the hints, or -1; *kept_long_at_end: whether the last kept block was guessed long-lived.
template <class Moved>
int run_windows(int windows, Moved moved, bool* kept_long_at_end) {
  constexpr std::size_t reserved = 64 * MiB;
  static_assert(lifetime_hints::window_reserves * reserved == 4 * (16 + 8 + 8) * MiB);
  lifetime_hints h;
  records r;
  bool kept_long = false;
  int stopped = -1;
  for (int w = 0; w < windows; ++w) {
    h.note_moved(moved(w));
    for (int layer = 0; layer < 4; ++layer) {
      auto ask_here = [&](std::size_t bytes) {
        const lifetime_hints::guess g = h.on_request(bytes, reserved);
        block* b = r.allocate();
        h.on_placed(g, b);
        return request{g.long_lived, b};
      };
      records::free(ask_here(16 * MiB).b);
      kept_long = ask_here(8 * MiB - 512).guessed_long;
      records::free(ask_here(8 * MiB + 512).b);
    }
    if (stopped < 0 && !h.active()) stopped = w;
  }
  *kept_long_at_end = kept_long;
  return stopped;
}

constexpr std::size_t over_budget = 2 * MiB;  // a page moved: over 128 MiB / 256

TEST(LifetimeHintsBudget, PagesMovedWhileThePoolLearnsKeepTheHints) {
  // Three windows in a row over budget (a new peak's growths), then none: a pool learning
  // its workload, not long-lived runs that fill and empty every step.
  bool kept_long = false;
  EXPECT_EQ(run_windows(48, [](int w) { return w >= 1 && w <= 3 ? over_budget : 0; }, &kept_long), -1);
  EXPECT_TRUE(kept_long);
  // Four over budget, but never four within 32 windows.
  EXPECT_EQ(run_windows(160, [](int w) { return w % 40 == 5 ? over_budget : 0; }, &kept_long), -1);
  EXPECT_TRUE(kept_long);
  // Within budget every window: a 256th of what is requested.
  EXPECT_EQ(run_windows(48, [](int) { return 128 * MiB / 256; }, &kept_long), -1);
  EXPECT_TRUE(kept_long);
}

TEST(LifetimeHintsBudget, PagesMovedStepAfterStepStopTheHintsForGood) {
  // Over budget every eighth window (a training step's backward pass): the fourth such
  // window within 32 stops the hints, and no request is guessed long-lived after.
  bool kept_long = true;
  EXPECT_EQ(run_windows(64, [](int w) { return w % 8 == 2 ? over_budget : 0; }, &kept_long), 26);
  EXPECT_FALSE(kept_long);
  // Every window over budget: stopped at the fourth.
  EXPECT_EQ(run_windows(8, [](int) { return over_budget; }, &kept_long), 3);
}

TEST(LifetimeHintsBudget, SizesThatNeverRepeatStopTheHints) {
  // Random sizes (pool_bench's mixed pairs): nearly every request makes a new key, and each
  // look-up misses the cache. One window of them stops the hints.
  lifetime_hints h;
  records r;
  for (std::uint32_t i = 0; i < lifetime_hints::novelty_window; ++i) {
    ASSERT_TRUE(h.active()) << "request " << i;
    records::free(ask(h, r, 2 * MiB + 512 * std::size_t{i}).b);
  }
  EXPECT_FALSE(h.active());
  EXPECT_FALSE(h.on_request(kept, no_window).long_lived);
}

TEST(LifetimeHintsBudget, ALoopOfManySizesKeepsThem) {
  // 600 sizes in a loop: the first window's requests are mostly new keys, the later ones
  // none; and a kept size in the loop is guessed long-lived.
  lifetime_hints h;
  records r;
  bool kept_long = false;
  for (int round = 0; round < 24; ++round) {
    for (std::size_t i = 0; i < 600; ++i) records::free(ask(h, r, 2 * MiB + 512 * i).b);
    kept_long = ask(h, r, kept).guessed_long;
  }
  EXPECT_TRUE(h.active());
  EXPECT_TRUE(kept_long);
}

// --- in vmm_page_pool ------------------------------------------------------------------------

class LifetimeHints : public gpumem_test::sim_pool_test {};

// A prefill's shape (infer_llama's sizes): per layer, a temporary of 22 MiB, two KV blocks
// of 2.73 pages each kept to the end, and a temporary of 1.36 pages; the temporaries die
// within the layer. Returns the KV blocks, in order; frees nothing else. The weights (600
// MiB, live throughout) are the caller's: beside them whole-page rounding stays within its
// cap (1/32 of the live bytes), as in the trace.
constexpr std::size_t weights = 600 * MiB;
std::vector<void*> prefill(vmm_page_pool& pool, int layers) {
  std::vector<void*> kv;
  for (int layer = 0; layer < layers; ++layer) {
    void* a = pool.allocate(temp_a);
    kv.push_back(pool.allocate(kept));
    kv.push_back(pool.allocate(kept));
    void* b = pool.allocate(temp_b);
    pool.deallocate(a, temp_a);
    pool.deallocate(b, temp_b);
  }
  return kv;
}

pool_options with_hints() {
  pool_options o = gpumem_test::tight_footprint();
  o.lifetime_hints = true;
  return o;
}

TEST_F(LifetimeHints, OnByDefaultAndParsed) {
  EXPECT_TRUE(pool_options{}.lifetime_hints);
  EXPECT_FALSE(pool_options::parse("lifetime_hints:off").lifetime_hints);
  EXPECT_TRUE(pool_options::parse("lifetime_hints:on").lifetime_hints);
  EXPECT_NE(pool_options::parse("lifetime_hints:off").to_string().find("lifetime_hints:off"),
            std::string::npos);
  EXPECT_THROW(pool_options::parse("lifetime_hints:maybe"), invalid_argument);
}

TEST_F(LifetimeHints, KeptBlocksLieSideBySideAndShareTheirPages) {
  constexpr int layers = 16;
  std::size_t reserved_on = 0, reserved_off = 0;
  for (bool on : {true, false}) {
    pool_options o = gpumem_test::tight_footprint();
    o.lifetime_hints = on;
    vmm_page_pool pool(sim, 0, o);
    void* w = pool.allocate(weights);
    const std::vector<void*> kv = prefill(pool, layers);
    (on ? reserved_on : reserved_off) = pool.stats().peak_reserved_bytes;
    if (on) {
      // From layer 3 on (the guesses' test above), each KV block starts where the one
      // before it ends: 26 blocks of 2.73 pages in 71 pages, not 78.
      const std::size_t unit_size = (kept + 511) / 512 * 512;
      for (std::size_t i = 7; i < kv.size(); ++i)
        EXPECT_EQ(reinterpret_cast<std::uintptr_t>(kv[i]),
                  reinterpret_cast<std::uintptr_t>(kv[i - 1]) + unit_size)
            << "KV block " << i;
    } else {
      // Without hints every KV block owns 3 whole pages.
      EXPECT_EQ(pool.bytes_in_arena(false).allocated, weights + kv.size() * 6 * MiB);
    }
    for (void* p : kv) pool.deallocate(p, kept);
    pool.deallocate(w, weights);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
  EXPECT_LE(reserved_on + 6 * 2 * MiB, reserved_off)  // 7 pages fewer, less a page of slop
      << "with hints " << reserved_on / MiB << " MiB, without " << reserved_off / MiB << " MiB";
}

TEST_F(LifetimeHints, TheLargeArenaTakesTheLongLivedBlocksFreeSpaceBeforeGrowing) {
  vmm_page_pool pool(sim, 0, with_hints());
  void* w = pool.allocate(weights);
  const std::vector<void*> kv = prefill(pool, 16);
  for (void* p : kv) pool.deallocate(p, kept);
  // The long-lived blocks' run is now one free block of ~71 pages; the large arena's own
  // free space is a layer's temporaries (~13 pages). 100 MiB fits only the former.
  const auto maps = calls(platform_op::map);
  const std::size_t reserved = pool.stats().reserved_bytes;
  void* p = pool.allocate(100 * MiB);
  EXPECT_EQ(calls(platform_op::map), maps) << "served by remapping instead";
  EXPECT_EQ(pool.stats().reserved_bytes, reserved);
  pool.deallocate(p, 100 * MiB);
  pool.deallocate(w, weights);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(LifetimeHints, WithAReservationRequestsWithinItMakeNoDriverCall) {
  // The reservation's promise outranks the hints: they are off, and no page moves.
  pool_options o = with_hints();
  o.reserve_bytes = 900 * MiB;
  vmm_page_pool pool(sim, 0, o);
  const auto maps = calls(platform_op::map), unmaps = calls(platform_op::unmap);
  void* w = pool.allocate(weights);
  const std::vector<void*> kv = prefill(pool, 16);
  EXPECT_EQ(calls(platform_op::map), maps);
  EXPECT_EQ(calls(platform_op::unmap), unmaps);
  // Whole pages each: all in the large arena, none guessed long-lived.
  EXPECT_EQ(pool.bytes_in_arena(false).allocated, weights + kv.size() * 6 * MiB);
  for (void* p : kv) pool.deallocate(p, kept);
  pool.deallocate(w, weights);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// --- the move budget on recorded traces (sim, 2 passes) ----------------------------------------

struct traced {
  replay_result replay;
  vmm_page_counts counts;
};

traced replay_with_hints(const trace& t, bool hints) {
  sim_options so;
  so.capacity = 24 * gpumem_test::GiB;
  sim_platform sim(so);
  pool_options o = gpumem_test::tight_footprint();
  o.lifetime_hints = hints;
  traced out;
  vmm_page_pool pool(sim, 0, o);
  replay_options ro;
  ro.passes = 2;
  out.replay = replay_trace(t, pool, ro);
  out.counts = pool.page_counts();
  EXPECT_FALSE(out.replay.oom) << out.replay.oom_message;
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  return out;
}

// Replays the trace at `relative` with the hints off and on; false when it is absent.
bool replay_off_and_on(const std::string& relative, traced& off, traced& on) {
  const std::string path = gpumem_test::find_in_source_tree(relative);
  if (path.empty()) return false;
  const trace t = load_trace(path);
  off = replay_with_hints(t, false);
  on = replay_with_hints(t, true);
  return true;
}

TEST(LifetimeHintsOnTraces, ATrainingLoopWhoseLongLivedRunsTradePagesEveryStepStopsThem) {
  // ckpt_train: activations kept for the backward pass fill the long-lived runs in each
  // forward pass and leave them in each backward pass, while the pool is at its peak.
  const std::string file = "data/workloads/ckpt_train.csv.gz";
  traced off, on;
  if (!replay_off_and_on(file, off, on)) GTEST_SKIP() << gpumem_test::not_in_source_tree(file);
  EXPECT_GT(on.counts.long_lived_allocations, 0u);
  EXPECT_GT(on.counts.long_lived_pages_moved, 0u);
  EXPECT_FALSE(on.counts.lifetime_hints_active);
  EXPECT_EQ(off.counts.long_lived_pages_moved, 0u);
  // After the stop the long-lived runs' free blocks went to the large arena.
  EXPECT_GT(on.counts.long_lived_bytes_handed_over, 0u);
  // Stopped within the first pass: the last pass grants access to new mappings about as
  // rarely as without hints (each grant is a gather's or a growth's).
  const auto grants = [](const traced& x) {
    auto it = x.replay.last_pass_driver_calls.find("cuMemSetAccess");
    return it == x.replay.last_pass_driver_calls.end() ? std::uint64_t{0} : it->second;
  };
  EXPECT_LE(grants(on), 2 * grants(off) + 2)
      << "last pass: " << grants(on) << " grants with hints, " << grants(off) << " without";
}

TEST(LifetimeHintsOnTraces, ALoopWhoseLongLivedRunsStayPutKeepsThemAndSavesMemory) {
  const std::string file = "data/train_llama.csv.gz";
  traced off, on;
  if (!replay_off_and_on(file, off, on)) GTEST_SKIP() << gpumem_test::not_in_source_tree(file);
  EXPECT_TRUE(on.counts.lifetime_hints_active);
  EXPECT_GT(on.counts.long_lived_allocations, 0u);
  EXPECT_EQ(on.counts.long_lived_bytes_handed_over, 0u);  // only once stopped
  EXPECT_LT(on.replay.peak_reserved_bytes, off.replay.peak_reserved_bytes)
      << "fragmentation " << on.replay.fragmentation << " with hints, " << off.replay.fragmentation
      << " without";
}

}  // namespace
