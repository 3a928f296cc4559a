// The Redis tier against a server that misbehaves (fake_redis_server.hpp): each kind of
// bad answer is a typed, counted fault and a miss or "not stored", within the call's
// deadline and the reply bound, and the store serves again once the server behaves.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "gpumem/errors.hpp"
#include "kv_tier/fake_redis_server.hpp"
#include "kv_tier/redis_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;
using namespace std::chrono_literals;

constexpr std::size_t payload = 4096;

#define GPUMEM_REQUIRE_REDIS_TIER()                                          \
  do {                                                                       \
    if (!gpumem::redis_tier_available())                                     \
      GTEST_SKIP() << "this build has no Redis tier (hiredis not found)";    \
  } while (0)

redis_store_options fault_options(std::chrono::milliseconds deadline = 150ms) {
  redis_store_options o = fast_redis_options(deadline, drop_report);
  o.backoff_min = 20ms;
  o.backoff_max = 40ms;
  o.max_reply_bytes = std::size_t{1} << 20;
  return o;
}

// Past the backoff the store armed after a fault.
void after_backoff() { std::this_thread::sleep_for(60ms); }

std::chrono::milliseconds since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
}

TEST(RedisFaults, AHugeDeclaredBulkIsRefusedBeforeItIsBuffered) {
  GPUMEM_REQUIRE_REDIS_TIER();
  fake_redis_server server;
  auto s = make_redis_store(server.url(), fault_options(2000ms));
  ASSERT_EQ(put_records(*s, payload, 1, 2), 2u);
  // GET (read into the caller's buffers) and EXISTS (through hiredis's reader).
  for (int path = 0; path < 2; ++path) {
    after_backoff();
    server.behave(misbehaviour::huge_bulk);
    if (path == 0) {
      const auto st = get_records(*s, payload, 1, 1);
      EXPECT_EQ(st[0], kv_get_status::error);
    } else {
      bool has = true;
      const kv_block_key k = key(1);
      s->contains({&k, 1}, {&has, 1});
      EXPECT_FALSE(has);
    }
    EXPECT_GE(redis_faults(*s).of(redis_fault::reply_too_large), static_cast<unsigned>(path + 1));
    EXPECT_NE(s->stats().last_error.find("max_reply_bytes"), std::string::npos) << s->stats().last_error;
    server.behave(misbehaviour::none);
    after_backoff();
    // The client hung up within the bound (and what the sockets hold), not 64 MiB later.
    EXPECT_LT(server.most_streamed(), std::size_t{24} << 20) << "path " << path;
    EXPECT_EQ(hits(get_records(*s, payload, 1, 2)), 2u) << "reconnected cleanly";
  }
}

TEST(RedisFaults, AHugeDeclaredArrayIsRefusedBeforeHiredisAllocatesIt) {
  GPUMEM_REQUIRE_REDIS_TIER();
  fake_redis_server server;
  auto s = make_redis_store(server.url(), fault_options(2000ms));
  server.behave(misbehaviour::huge_array);
  bool has = true;
  const kv_block_key k = key(1);
  s->contains({&k, 1}, {&has, 1});
  EXPECT_FALSE(has);
  EXPECT_EQ(redis_faults(*s).of(redis_fault::reply_too_large), 1u) << s->stats().last_error;
  server.behave(misbehaviour::none);
  after_backoff();
  EXPECT_EQ(put_records(*s, payload, 1, 1), 1u);
}

TEST(RedisFaults, ADrippingServerCostsOneDeadlineNotATimeoutPerByte) {
  GPUMEM_REQUIRE_REDIS_TIER();
  fake_redis_server server;
  server.set_drip_interval(10ms);  // a 4 KiB record: 40 s at one byte per 10 ms
  auto s = make_redis_store(server.url(), fault_options(150ms));
  ASSERT_EQ(put_records(*s, payload, 1, 1), 1u);
  server.behave(misbehaviour::drip);
  const auto t0 = std::chrono::steady_clock::now();
  const auto st = get_records(*s, payload, 1, 1);
  EXPECT_LT(since(t0), 1500ms) << "one deadline of 150 ms for the call, whatever the reads";
  EXPECT_EQ(st[0], kv_get_status::error);
  EXPECT_EQ(redis_faults(*s).of(redis_fault::deadline), 1u);
  EXPECT_NE(s->stats().last_error.find("timed out"), std::string::npos) << s->stats().last_error;
  server.behave(misbehaviour::none);
  after_backoff();
  EXPECT_EQ(hits(get_records(*s, payload, 1, 1)), 1u);
}

TEST(RedisFaults, ASilentServerCostsOneDeadlinePerCall) {
  GPUMEM_REQUIRE_REDIS_TIER();
  fake_redis_server server;
  auto s = make_redis_store(server.url(), fault_options(100ms));
  server.behave(misbehaviour::silence);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(put_records(*s, payload, 1, 8), 0u);
  EXPECT_LT(since(t0), 1000ms);
  EXPECT_EQ(redis_faults(*s).of(redis_fault::deadline), 1u);
}

TEST(RedisFaults, MovedToEverNewNodesKeepsTheLinkTableBounded) {
  GPUMEM_REQUIRE_REDIS_TIER();
  fake_redis_server server;
  redis_store_options o = fault_options();
  o.max_links = 4;
  auto s = make_redis_store(server.cluster_url(), o);
  server.behave(misbehaviour::moved);
  for (int i = 0; i < 30; ++i) {
    EXPECT_EQ(put_records(*s, payload, static_cast<std::uint64_t>(i) * 4, 4), 0u);
    // The client keeps at most the seed and max_links connections open.
    EXPECT_LE(server.open_connections(), 1u + o.max_links) << "call " << i;
  }
  EXPECT_GE(server.redirect_ports(), 30u) << "every call was sent somewhere new";
  EXPECT_LE(redis_faults(*s).links, 1u + o.max_links);
  EXPECT_GE(s->stats().redirects, 30u);
  EXPECT_GE(redis_faults(*s).of(redis_fault::redirect), 1u) << "keys past 3 redirects are counted";
  server.behave(misbehaviour::none);
  after_backoff();
  EXPECT_EQ(put_records(*s, payload, 1000, 4), 4u);
  EXPECT_EQ(hits(get_records(*s, payload, 1000, 4)), 4u);
}

TEST(RedisFaults, ARedirectToAHostNameIsRefusedWithoutALookup) {
  GPUMEM_REQUIRE_REDIS_TIER();
  fake_redis_server server;
  auto s = make_redis_store(server.cluster_url(), fault_options());
  server.behave(misbehaviour::moved_to_name);
  EXPECT_EQ(put_records(*s, payload, 1, 2), 0u);
  EXPECT_EQ(redis_faults(*s).of(redis_fault::redirect), 2u);
  EXPECT_EQ(redis_faults(*s).links, 1u) << "no link made for the name";
  EXPECT_EQ(s->stats().redirects, 0u);
}

TEST(RedisFaults, EveryReplyTypeIsCheckedAgainstTheCommand) {
  GPUMEM_REQUIRE_REDIS_TIER();
  fake_redis_server server;
  auto s = make_redis_store(server.url(), fault_options());
  // SET answered by anything but +OK (+QUEUED, :1, nil, an array, a string "OK"): not
  // stored, counted, typed. The fake picks the wrong type at random: enough tries see all.
  server.behave(misbehaviour::wrong_type);
  std::uint64_t before = 0;
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ(put_records(*s, payload, 1, 1), 0u);
    const auto f = redis_faults(*s);
    EXPECT_GT(f.of(redis_fault::unexpected_reply), before) << "try " << i << ": " << s->stats().last_error;
    EXPECT_FALSE(server.holds(redis_key_name(key(1))));
    before = f.of(redis_fault::unexpected_reply);
    after_backoff();
  }
  EXPECT_EQ(s->stats().puts, 0u);
  EXPECT_EQ(s->stats().put_failures, 12u);
  // EXISTS answered by 7, a status or nil; GET by an integer or a status.
  for (int i = 0; i < 6; ++i) {
    bool has = true;
    const kv_block_key k = key(1);
    s->contains({&k, 1}, {&has, 1});
    EXPECT_FALSE(has);
    after_backoff();
    EXPECT_NE(get_records(*s, payload, 1, 1)[0], kv_get_status::hit);
    after_backoff();
  }
  EXPECT_GE(redis_faults(*s).of(redis_fault::unexpected_reply), 12u + 6u);
}

TEST(RedisFaults, GarbageResetsAndRepliesNobodyAskedForDropTheConnection) {
  GPUMEM_REQUIRE_REDIS_TIER();
  fake_redis_server server;
  auto s = make_redis_store(server.url(), fault_options());
  ASSERT_EQ(put_records(*s, payload, 1, 1), 1u);
  const struct {
    misbehaviour m;
    redis_fault expected;
  } cases[] = {{misbehaviour::garbage, redis_fault::protocol},
               {misbehaviour::reset_mid_reply, redis_fault::closed},
               {misbehaviour::close, redis_fault::closed},
               {misbehaviour::extra_reply, redis_fault::protocol}};
  for (const auto& c : cases) {
    after_backoff();
    server.behave(c.m);
    const auto before = redis_faults(*s).of(c.expected);
    const auto st = get_records(*s, payload, 1, 1);
    if (c.m == misbehaviour::extra_reply) {
      // The answer itself was right; the bytes after it end the connection, now or at
      // the next call.
      EXPECT_NE(st[0], kv_get_status::corrupt);
      server.behave(misbehaviour::none);
      (void)get_records(*s, payload, 1, 1);
    } else {
      EXPECT_EQ(st[0], kv_get_status::error);
    }
    EXPECT_GT(redis_faults(*s).of(c.expected), before)
        << static_cast<int>(c.m) << ": " << s->stats().last_error;
    server.behave(misbehaviour::none);
    after_backoff();
    EXPECT_EQ(hits(get_records(*s, payload, 1, 1)), 1u) << static_cast<int>(c.m);
  }
}

TEST(RedisFaults, AValueOfAnotherKeyOrRandomBytesIsNeverAHit) {
  GPUMEM_REQUIRE_REDIS_TIER();
  fake_redis_server server;
  auto s = make_redis_store(server.url(), fault_options());
  ASSERT_EQ(put_records(*s, payload, 1, 2), 2u);
  for (auto m : {misbehaviour::other_key_value, misbehaviour::corrupt_value}) {
    server.behave(m);
    for (int i = 0; i < 4; ++i) EXPECT_NE(get_records(*s, payload, 1, 1)[0], kv_get_status::hit);
  }
  EXPECT_GE(s->stats().corrupt, 1u);
}

TEST(RedisFaults, ADeadlineAndAReplyBoundAreRequired) {
  GPUMEM_REQUIRE_REDIS_TIER();
  redis_store_options o;
  EXPECT_EQ(o.command_timeout, 1000ms);
  EXPECT_EQ(o.max_reply_bytes, std::size_t{64} << 20);
  o.max_reply_bytes = 10;
  EXPECT_THROW(make_redis_store("redis://127.0.0.1:1", o), invalid_argument);
  o = {};
  o.max_links = 0;
  EXPECT_THROW(make_redis_store("redis://127.0.0.1:1", o), invalid_argument);
  // A value over the bound is not sent: it could never be read back.
  fake_redis_server server;
  o = fault_options();
  o.max_reply_bytes = 2048;
  auto s = make_redis_store(server.url(), o);
  EXPECT_EQ(put_records(*s, payload, 1, 1), 0u);
  EXPECT_EQ(redis_faults(*s).of(redis_fault::reply_too_large), 1u);
  EXPECT_FALSE(server.holds(redis_key_name(key(1))));
}

}  // namespace
