// A reference-model fuzzer of the Redis tier against fake_redis_server: each step picks a
// call (put, get, contains) of a few keys and how the server answers it (well, or one of
// the misbehaviours), runs it, and checks the store's answer against what the model
// allows for that behaviour:
//  - data is exact: a hit's bytes are the record put under that key, always;
//  - a well-behaved answer is right: hit for a key known stored, miss for one known
//    absent, or `error` (the link may be in its backoff after an earlier fault);
//  - a misbehaving answer is a miss, corrupt, error or "not stored", never a hit or a
//    "stored" for a command the server did not do;
//  - no call outlasts its deadline (plus scheduling slack), and no huge reply is read
//    past max_reply_bytes (plus what the sockets hold).
// The model knows per key: absent, stored, or unknown (the server did the command but
// the client could not hear it said).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kv_tier/fake_redis_server.hpp"
#include "kv_tier/redis_test_support.hpp"

namespace gpumem_test {

struct redis_fuzz_config {
  std::uint64_t seed = 1;
  int steps = 100;
  bool cluster = false;
  std::size_t payload = 1024;
  std::chrono::milliseconds deadline{80};
  // A call's slack over its deadline (scheduling on a loaded 2-core machine, sanitizers).
  std::chrono::milliseconds slack{900};
};

class redis_fuzz_driver {
 public:
  explicit redis_fuzz_driver(redis_fuzz_config c) : c_(c), rng_(c.seed), server_(c.seed) {
    gpumem::redis_store_options o = fast_redis_options(c.deadline, drop_report);
    o.connect_timeout = c.deadline;
    o.backoff_min = std::chrono::milliseconds{5};
    o.backoff_max = std::chrono::milliseconds{10};
    o.max_reply_bytes = std::size_t{256} << 10;
    o.max_links = 4;
    server_.set_drip_interval(std::chrono::milliseconds{1});
    server_.set_stream_limit(std::size_t{32} << 20);
    store_ = gpumem::make_redis_store(c.cluster ? server_.cluster_url() : server_.url(), o);
  }

  void run() {
    for (int step = 0; step < c_.steps && !::testing::Test::HasFatalFailure(); ++step) {
      step_ = step;
      one_step();
    }
    // Once the server behaves (and the backoff has passed), every key the model knows
    // stored is a hit.
    server_.behave(misbehaviour::none);
    std::this_thread::sleep_for(std::chrono::milliseconds{30});
    std::vector<std::uint64_t> stored;
    for (auto& [h, st] : model_)
      if (st == state::stored) stored.push_back(h);
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::size_t got = 0;
      for (auto h : stored) got += get(h) == gpumem::kv_get_status::hit;
      if (got == stored.size()) {
        EXPECT_GE(stored.size(), 2u) << "seed " << c_.seed << ": hardly anything was stored";
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{30});
    }
    ADD_FAILURE() << "seed " << c_.seed << ": stored keys are not all hits once the server behaves";
  }
  // Steps whose call made no fault: a run where faults never end exercises nothing.
  int clean_steps() const { return clean_steps_; }
  std::uint64_t faults() const { return gpumem::redis_faults(*store_).total(); }

 private:
  enum class state { absent, stored, unknown };
  static constexpr std::uint64_t universe = 10;

  misbehaviour pick_behaviour() {
    if (rng_() % 2 == 0) return misbehaviour::none;
    // moved/ask go to fresh ports: a redis:// store answers them as error replies.
    return static_cast<misbehaviour>(1 + rng_() % (misbehaviour_kinds - 1));
  }
  static bool done_by_server(misbehaviour m) {
    return m == misbehaviour::none || m == misbehaviour::drip ||
           m == misbehaviour::reset_mid_reply || m == misbehaviour::extra_reply;
  }
  std::vector<std::byte> record(std::uint64_t h) const {
    return make_record(key(h), c_.payload, 0, 16, static_cast<unsigned>(h));
  }

  gpumem::kv_get_status get(std::uint64_t h) {
    const gpumem::kv_block_key k = key(h);
    std::vector<std::byte> buf(gpumem::kv_record::size(16, c_.payload));
    std::span<std::byte> dst(buf);
    gpumem::kv_get_status st = gpumem::kv_get_status::miss;
    store_->get({&k, 1}, {&dst, 1}, {&st, 1});
    if (st == gpumem::kv_get_status::hit) EXPECT_EQ(buf, record(h)) << where() << "a hit with wrong bytes";
    return st;
  }

  std::string where() const {
    return "seed " + std::to_string(c_.seed) + " step " + std::to_string(step_) + " (" +
           std::to_string(static_cast<int>(mode_)) + "): ";
  }

  void one_step() {
    mode_ = pick_behaviour();
    server_.behave(mode_);
    const int n = 1 + static_cast<int>(rng_() % 3);
    std::vector<std::uint64_t> hs;
    for (int i = 0; i < n; ++i) {
      const std::uint64_t h = rng_() % universe;
      if (std::find(hs.begin(), hs.end(), h) == hs.end()) hs.push_back(h);
    }
    std::vector<gpumem::kv_block_key> keys;
    for (auto h : hs) keys.push_back(key(h));
    const int what = static_cast<int>(rng_() % 3);
    const auto t0 = std::chrono::steady_clock::now();
    if (what == 0) {
      std::vector<std::vector<std::byte>> recs;
      for (auto h : hs) recs.push_back(record(h));
      std::vector<std::span<const std::byte>> vals(recs.begin(), recs.end());
      std::unique_ptr<bool[]> ok(new bool[hs.size()]);
      store_->put(keys, vals, {ok.get(), hs.size()});
      for (std::size_t i = 0; i < hs.size(); ++i) {
        if (ok[i]) {
          EXPECT_TRUE(done_by_server(mode_)) << where() << "stored, yet the server did not store it";
          model_[hs[i]] = state::stored;
        } else if (done_by_server(mode_)) {
          model_[hs[i]] = state::unknown;
        }
      }
    } else if (what == 1) {
      for (auto h : hs) {
        const auto st = get(h);
        const state m = model_.count(h) ? model_[h] : state::absent;
        if (st == gpumem::kv_get_status::hit) {
          EXPECT_TRUE(done_by_server(mode_)) << where() << "a hit from a misbehaving answer";
          EXPECT_NE(m, state::absent) << where() << "a hit for a key never stored";
        }
        if (st == gpumem::kv_get_status::miss && mode_ == misbehaviour::none)
          EXPECT_NE(m, state::stored) << where() << "a miss for a stored key";
        if (st == gpumem::kv_get_status::corrupt)
          EXPECT_TRUE(mode_ == misbehaviour::corrupt_value || mode_ == misbehaviour::other_key_value)
              << where() << "corrupt from a well-formed record";
      }
    } else {
      std::unique_ptr<bool[]> has(new bool[hs.size()]);
      store_->contains(keys, {has.get(), hs.size()});
      for (std::size_t i = 0; i < hs.size(); ++i) {
        const state m = model_.count(hs[i]) ? model_[hs[i]] : state::absent;
        if (has[i]) {
          EXPECT_TRUE(done_by_server(mode_)) << where() << "held, from a misbehaving answer";
          EXPECT_NE(m, state::absent) << where() << "held, for a key never stored";
        }
      }
    }
    const auto took = std::chrono::steady_clock::now() - t0;
    const std::uint64_t errors = store_->stats().errors;
    if (errors == errors_) ++clean_steps_;
    errors_ = errors;
    // Past the backoff a fault armed, so the next step reaches the server.
    std::this_thread::sleep_for(std::chrono::milliseconds{12});
    // A call of these sizes (under pipeline_bytes) has one deadline; the slot map refresh
    // and every redirect are inside it.
    EXPECT_LT(took, c_.deadline + c_.slack) << where() << "the call outlasted its deadline";
    EXPECT_LT(server_.most_streamed(), std::size_t{24} << 20) << where() << "a huge reply was read on";
  }

  redis_fuzz_config c_;
  std::mt19937_64 rng_;
  fake_redis_server server_;
  std::unique_ptr<gpumem::kv_store> store_;
  std::map<std::uint64_t, state> model_;
  misbehaviour mode_ = misbehaviour::none;
  int step_ = 0;
  int clean_steps_ = 0;
  std::uint64_t errors_ = 0;
};

}  // namespace gpumem_test
