// Streams under the reference model, where fuzz_driver.hpp's single-threaded pool driver
// does not reach:
//  - several threads, each on its own stream, freeing each other's blocks (and trying
//    streams the platform refuses), with the reserved bound of fuzz_driver.hpp checked
//    after every step;
//  - the C API, byte-driven: gpumem_malloc / gpumem_free / gpumem_record_stream on any
//    pointer (live, freed, never allocated) and any stream (the default one, made by
//    gpumem_stream_create, destroyed by gpumem_stream_destroy, a value never made), with
//    step marks so planned allocations (step_planner) are freed on every kind of stream too.
//    What the C API answers, asserted exactly:
//      free of a live pointer on a live stream            GPUMEM_SUCCESS
//      free on a destroyed stream or a value never made   GPUMEM_ERROR_INVALID_ARGUMENT,
//                                                         the allocation stays live
//      record_stream of a pointer that is not live        GPUMEM_ERROR_INVALID_ARGUMENT
//      record_stream on a destroyed / never-made stream   GPUMEM_ERROR_INVALID_ARGUMENT
//      record_stream of a live pointer on a live stream   GPUMEM_SUCCESS; destroying that
//                                                         stream later drops the record
//                                                         (its work is waited for first),
//                                                         so the free still succeeds
//    and after every step the stats' live bytes equal the model's and reserved stays within
//    the bound of the peak live bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fuzz/fuzz_driver.hpp"
#include "gpumem/interop/gpumem.h"

namespace {

using namespace gpumem_fuzz;

std::size_t ramp_or_random(byte_source& in, std::size_t& ramp) {
  if (in.u8() % 2 == 0) {
    ramp = ramp >= 3 * MiB ? KiB : ramp + KiB * (1 + in.u8() % 16);
    return ramp;
  }
  return 1 + in.u32() % (2 * MiB);
}

// --- threads ---------------------------------------------------------------------------

struct shared_block {
  void* p;
  std::size_t n;
  std::uint64_t serial;
};

std::string run_threads(bool paged, std::uint64_t seed) {
  constexpr int threads = 4;
  constexpr std::size_t ops = 1500;
  constexpr std::size_t live_cap = 24 * MiB;
  constexpr std::size_t largest_request = 3 * MiB;
  gpumem::sim_platform sim(detail::device_options());
  std::string why;
  {
    std::unique_ptr<gpumem::runtime_resource> upstream;
    std::unique_ptr<gpumem::pool_base> pool;
    if (paged) {
      pool = std::make_unique<gpumem::vmm_page_pool>(sim, 0);
    } else {
      upstream = std::make_unique<gpumem::runtime_resource>(sim);
      pool = std::make_unique<gpumem::caching_pool>(*upstream);
    }
    std::vector<gpumem::stream_handle> streams;
    for (int t = 0; t < threads; ++t) streams.push_back(sim.stream_create(0).value());
    std::mutex m;
    std::vector<shared_block> shared;  // guarded by m
    std::size_t live = 0, peak = 0;    // guarded by m
    std::uint64_t serial = 0;          // guarded by m
    std::string failure;               // guarded by m: the first failure
    auto fail = [&](std::string w) {
      std::lock_guard lock(m);
      if (failure.empty()) failure = std::move(w);
    };
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        const auto bytes = corpus_bytes(seed * 16 + t, ops * 12);
        byte_source in(bytes.data(), bytes.size());
        std::size_t ramp = 0;
        std::uint64_t checked = 0;
        for (std::size_t step = 0; step < ops; ++step) {
          {
            std::lock_guard lock(m);
            if (!failure.empty()) return;
          }
          const std::uint8_t op = in.u8() % 8;
          if (op < 4) {  // allocate on this thread's stream
            const std::size_t n = ramp_or_random(in, ramp);
            {
              std::lock_guard lock(m);
              if (live + n > live_cap) continue;
            }
            void* p = nullptr;
            try {
              p = pool->allocate(n, gpumem::default_alignment, streams[t]);
            } catch (const std::exception& e) {
              return fail(std::string("allocate: ") + e.what());
            }
            std::lock_guard lock(m);
            detail::write_pattern(p, n, ++serial);
            shared.push_back({p, n, serial});
            live += n;
            peak = std::max(peak, live);
          } else {  // free any thread's block on this thread's stream (or try a refused one)
            shared_block b{};
            {
              std::lock_guard lock(m);
              if (shared.empty()) continue;
              const std::size_t k = in.below(shared.size());
              b = shared[k];
              shared[k] = shared.back();
              shared.pop_back();
            }
            if (!detail::pattern_holds(b.p, b.n, b.serial, true, checked))
              return fail("block " + std::to_string(b.serial) + " lost its bytes before its free");
            if (op == 7) {
              const gpumem::stream_handle bad{0x1000 + 2 * std::uintptr_t{in.u16()}};
              try {
                pool->deallocate(b.p, b.n, bad);
                return fail("a free on refused stream " + std::to_string(bad.value) + " was accepted");
              } catch (const gpumem::invalid_argument&) {
              } catch (const std::exception& e) {
                return fail(std::string("a free on a refused stream: wrong exception: ") + e.what());
              }
              std::lock_guard lock(m);
              shared.push_back(b);  // still live
              continue;
            }
            try {
              pool->deallocate(b.p, b.n, streams[t]);
            } catch (const std::exception& e) {
              return fail(std::string("deallocate: ") + e.what());
            }
            std::lock_guard lock(m);
            live -= b.n;
          }
          // Each other thread may have grown the pool for one request not yet in the model.
          std::size_t bound = 0;
          {
            std::lock_guard lock(m);
            bound = detail::reserved_bound(peak + threads * largest_request);
          }
          if (const auto st = pool->stats(); st.reserved_bytes > bound)
            return fail("thread " + std::to_string(t) + " step " + std::to_string(step) +
                        ": reserved " + std::to_string(st.reserved_bytes) + " over the bound " +
                        std::to_string(bound));
        }
      });
    }
    for (auto& w : workers) w.join();
    why = failure;
    std::uint64_t checked = 0;
    for (auto& b : shared) {
      if (why.empty() && !detail::pattern_holds(b.p, b.n, b.serial, true, checked))
        why = "block " + std::to_string(b.serial) + " lost its bytes";
      pool->deallocate(b.p, b.n, streams[0]);
    }
    if (why.empty()) why = pool->validate();
    (void)pool->trim();
    for (auto s : streams) pool->release_stream(s);
    pool.reset();
    for (auto s : streams) (void)sim.stream_destroy(s);
  }
  if (why.empty()) why = detail::leak_check(sim);
  return why.empty() ? why : std::string(paged ? "vmm_page_pool" : "caching_pool") + ": " + why;
}

TEST(stream_fuzz, threads_on_their_own_streams_freeing_each_others_blocks_keep_the_bound) {
  for (bool paged : {false, true})
    for (std::uint64_t seed = 0; seed < 4; ++seed) ASSERT_EQ(run_threads(paged, seed), "") << "seed " << seed;
}

// --- the C API -------------------------------------------------------------------------

std::string status_text(gpumem_status s) {
  return std::string(gpumem_status_name(s)) + " (" + gpumem_last_error() + ")";
}

class c_api_driver {
 public:
  c_api_driver(gpumem_pool* pool, byte_source& in) : pool_(pool), in_(in) {}

  std::string run(std::size_t ops) {
    for (std::size_t step = 0; step < ops; ++step) {
      std::string why = one_step();
      if (why.empty()) why = check();
      if (!why.empty()) return "step " + std::to_string(step) + ": " + why;
    }
    return teardown();
  }

  std::uint64_t refused = 0, recorded = 0, foreign_frees = 0, streams_destroyed = 0;

 private:
  struct block {
    std::size_t n;
    std::uint64_t serial;
  };

  // A stream that works: the default one or one made and not destroyed; sometimes a new one.
  void* live_stream() {
    if (live_streams_.size() < 4 && in_.u8() % 8 == 0) {
      void* s = nullptr;
      if (gpumem_stream_create(pool_, &s) == GPUMEM_SUCCESS) live_streams_.push_back(s);
    }
    const std::size_t k = in_.below(live_streams_.size() + 1);
    return k == live_streams_.size() ? nullptr : live_streams_[k];
  }
  // A stream the platform refuses: destroyed, or a value never made.
  void* refused_stream() {
    if (!destroyed_.empty() && in_.u8() % 2) return destroyed_[in_.below(destroyed_.size())];
    return reinterpret_cast<void*>(0x1000 + 2 * std::uintptr_t{in_.u16()});
  }

  std::string one_step() {
    switch (in_.u8() % 16) {
      case 0: case 1: case 2: case 3: case 4: {
        std::size_t n = ramp_or_random(in_, ramp_);
        if (live_bytes_ + n > 24 * MiB) return {};
        void* s = live_stream();
        void* p = gpumem_malloc(pool_, n, s);
        if (p == nullptr) return "gpumem_malloc: " + status_text(gpumem_last_status());
        detail::write_pattern(p, n, ++serial_);
        live_.emplace(p, block{n, serial_});
        by_serial_.emplace(serial_, p);
        live_bytes_ += n;
        peak_ = std::max(peak_, live_bytes_);
        return {};
      }
      case 5: case 6: case 7: case 8: {  // free on a stream that works
        if (live_.empty()) return {};
        auto it = pick();
        std::uint64_t c = 0;
        if (!detail::pattern_holds(it->first, it->second.n, it->second.serial, true, c))
          return "allocation " + std::to_string(it->second.serial) + " lost its bytes";
        if (const auto st = gpumem_free(pool_, it->first, it->second.n, live_stream()); st != GPUMEM_SUCCESS)
          return "gpumem_free on a live stream: " + status_text(st);
        ++foreign_frees;
        live_bytes_ -= it->second.n;
        freed_.push_back(it->first);
        if (freed_.size() > 8) freed_.erase(freed_.begin());
        by_serial_.erase(it->second.serial);
        live_.erase(it);
        return {};
      }
      case 9: {  // free on a refused stream
        if (live_.empty()) return {};
        auto it = pick();
        void* s = refused_stream();
        ++refused;
        if (const auto st = gpumem_free(pool_, it->first, it->second.n, s); st != GPUMEM_ERROR_INVALID_ARGUMENT)
          return "gpumem_free on refused stream " + std::to_string(reinterpret_cast<std::uintptr_t>(s)) +
                 ": " + status_text(st);
        return {};  // the model keeps it; check() sees it still live
      }
      case 10: case 11: {  // record_stream of a live pointer
        if (live_.empty()) return {};
        auto it = pick();
        const bool bad = in_.u8() % 3 == 0;
        void* s = bad ? refused_stream() : live_stream();
        const auto st = gpumem_record_stream(pool_, it->first, s);
        if (bad) {
          ++refused;
          if (st != GPUMEM_ERROR_INVALID_ARGUMENT) return "record_stream on a refused stream: " + status_text(st);
        } else {
          ++recorded;
          if (st != GPUMEM_SUCCESS) return "record_stream on a live stream: " + status_text(st);
        }
        return {};
      }
      case 12: {  // record_stream of a pointer that is not live
        static int outside = 0;
        void* p = &outside;
        const auto k = in_.u8() % 3;
        if (k == 0 && !freed_.empty()) p = freed_[in_.below(freed_.size())];
        if (k == 1 && !live_.empty()) p = static_cast<char*>(pick()->first) + 1 + in_.u8();
        if (live_.contains(p)) return {};  // a freed address handed out again
        ++refused;
        if (const auto st = gpumem_record_stream(pool_, p, live_stream()); st != GPUMEM_ERROR_INVALID_ARGUMENT)
          return "record_stream of a pointer that is not live: " + status_text(st);
        return {};
      }
      case 13: {  // destroy a stream (its allocations stay live, freed later elsewhere)
        if (live_streams_.empty()) return {};
        const std::size_t k = in_.below(live_streams_.size());
        void* s = live_streams_[k];
        if (const auto st = gpumem_stream_destroy(pool_, s); st != GPUMEM_SUCCESS)
          return "gpumem_stream_destroy: " + status_text(st);
        live_streams_.erase(live_streams_.begin() + static_cast<std::ptrdiff_t>(k));
        destroyed_.push_back(s);
        ++streams_destroyed;
        return {};
      }
      case 14:
        if (const auto st = gpumem_pool_mark_step(pool_); st != GPUMEM_SUCCESS)
          return "gpumem_pool_mark_step: " + status_text(st);
        return {};
      default: {
        std::uint64_t released = 0;
        if (in_.u8() % 4 == 0)
          if (const auto st = gpumem_pool_trim(pool_, &released); st != GPUMEM_SUCCESS)
            return "gpumem_pool_trim: " + status_text(st);
        return {};
      }
    }
  }

  // The k-th live allocation in the order they were made, never in address order (sim's
  // addresses follow the host's layout, so the operations would vary from run to run).
  std::map<void*, block>::iterator pick() {
    auto by = by_serial_.begin();
    std::advance(by, static_cast<std::ptrdiff_t>(in_.below(by_serial_.size())));
    return live_.find(by->second);
  }

  std::string check() {
    gpumem_stats st{};
    if (const auto s = gpumem_pool_stats(pool_, &st); s != GPUMEM_SUCCESS) return "stats: " + status_text(s);
    if (st.live_bytes != live_bytes_ || st.live_allocations != live_.size())
      return "stats say " + std::to_string(st.live_bytes) + " bytes in " +
             std::to_string(st.live_allocations) + " allocations, the model " +
             std::to_string(live_bytes_) + " in " + std::to_string(live_.size());
    if (st.reserved_bytes > detail::reserved_bound(peak_))
      return "reserved " + std::to_string(st.reserved_bytes) + " over the bound " +
             std::to_string(detail::reserved_bound(peak_)) + " for peak live " + std::to_string(peak_);
    return {};
  }

  std::string teardown() {
    for (auto& [p, b] : live_) {
      std::uint64_t c = 0;
      if (!detail::pattern_holds(p, b.n, b.serial, true, c)) return "allocation lost its bytes at the end";
      if (const auto st = gpumem_free(pool_, p, b.n, nullptr); st != GPUMEM_SUCCESS)
        return "final free: " + status_text(st);
    }
    live_.clear();
    by_serial_.clear();
    live_bytes_ = 0;
    if (auto why = check(); !why.empty()) return "at the end: " + why;
    for (void* s : live_streams_)
      if (const auto st = gpumem_stream_destroy(pool_, s); st != GPUMEM_SUCCESS)
        return "final stream destroy: " + status_text(st);
    return {};
  }

  gpumem_pool* pool_;
  byte_source& in_;
  std::map<void*, block> live_;
  std::map<std::uint64_t, void*> by_serial_;  // the live allocations: serial -> pointer
  std::size_t live_bytes_ = 0, peak_ = 0, ramp_ = 0;
  std::uint64_t serial_ = 0;
  std::vector<void*> live_streams_, destroyed_, freed_;
};

class stream_fuzz_c_api : public ::testing::TestWithParam<const char*> {};

TEST_P(stream_fuzz_c_api, frees_and_records_on_any_stream_are_answered_exactly) {
  std::uint64_t refused = 0, recorded = 0, frees = 0, destroyed = 0;
  for (std::uint64_t seed = 0; seed < 10; ++seed) {
    gpumem_pool* pool = nullptr;
    ASSERT_EQ(gpumem_pool_create(GetParam(), &pool), GPUMEM_SUCCESS) << gpumem_last_error();
    const auto bytes = corpus_bytes(7'000'000 + seed, 20000);
    byte_source in(bytes.data(), bytes.size());
    c_api_driver d(pool, in);
    const std::string why = d.run(1500);
    gpumem_pool_destroy(pool);
    ASSERT_EQ(why, "") << "seed " << seed;
    refused += d.refused;
    recorded += d.recorded;
    frees += d.foreign_frees;
    destroyed += d.streams_destroyed;
  }
  std::printf("[fuzz] C API %s: %llu frees, %llu records, %llu refused calls, %llu streams destroyed\n",
              GetParam(), static_cast<unsigned long long>(frees),
              static_cast<unsigned long long>(recorded), static_cast<unsigned long long>(refused),
              static_cast<unsigned long long>(destroyed));
  EXPECT_GT(frees, 1000u);
  EXPECT_GT(recorded, 300u);
  EXPECT_GT(refused, 500u);
  EXPECT_GT(destroyed, 50u);
}

INSTANTIATE_TEST_SUITE_P(pools, stream_fuzz_c_api,
                         ::testing::Values("sim_capacity:256M",
                                           "sim_capacity:256M,allocator:caching_pool"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.index == 0 ? "vmm_page_pool" : "caching_pool");
                         });

}  // namespace
