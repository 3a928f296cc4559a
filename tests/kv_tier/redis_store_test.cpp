// The Redis tier against a real redis-server on loopback (started and stopped by each
// test): put/get/contains, corrupt and truncated values, tenants, and faults — the server
// down at start, killed mid-run, restarted, slow, full. Every fault is a miss or a "not
// stored", counted and reported once; nothing throws.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "gpumem/kv/tier/kv_record.hpp"
#include "gpumem/kv/tier/redis_store.hpp"
#include "kv_tier/redis_server.hpp"
#include "kv_tier/redis_test_support.hpp"
#include "kv_tier/tier_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;
using namespace std::chrono_literals;

constexpr std::size_t payload = 64 * 1024;
const std::size_t record_bytes = kv_record::size(16, payload);

TEST(RedisStore, PutGetContainsInOnePipelinedBatch) {
  GPUMEM_REQUIRE_REDIS();
  redis_server server;
  auto s = make_redis_store(server.url(), fast_redis_options(300ms));
  EXPECT_EQ(put_records(*s, payload, 1, 20), 20u);
  auto st = get_records(*s, payload, 1, 25);
  EXPECT_EQ(hits(st), 20u);
  for (std::size_t i = 20; i < 25; ++i) EXPECT_EQ(st[i], kv_get_status::miss);
  const kv_block_key ask[] = {key(1), key(99)};
  bool has[2];
  s->contains(ask, has);
  EXPECT_TRUE(has[0]);
  EXPECT_FALSE(has[1]);
  const auto stats = s->stats();
  EXPECT_EQ(stats.puts, 20u);
  EXPECT_EQ(stats.hits, 20u);
  EXPECT_EQ(stats.misses, 5u);
  EXPECT_EQ(stats.errors, 0u);
  EXPECT_EQ(server.cli({"DBSIZE"}), "20\n");
}

TEST(RedisStore, ACorruptOrTruncatedValueIsAMissCounted) {
  GPUMEM_REQUIRE_REDIS();
  redis_server server;
  auto s = make_redis_store(server.url(), fast_redis_options(300ms));
  ASSERT_EQ(put_records(*s, payload, 1, 3), 3u);
  // Flip one payload byte of key 1 in place; cut key 2 short.
  server.cli({"SETRANGE", redis_key_name(key(1)), std::to_string(record_bytes - 100), "Z"});
  server.cli({"EVAL",
              R"(redis.call("SET", KEYS[1], string.sub(redis.call("GET", KEYS[1]), 1, 1000)))", "1",
              redis_key_name(key(2))});
  ASSERT_EQ(server.cli({"STRLEN", redis_key_name(key(2))}), "1000\n");
  const auto st = get_records(*s, payload, 1, 3);
  EXPECT_EQ(st[0], kv_get_status::corrupt);
  EXPECT_EQ(st[1], kv_get_status::corrupt);
  EXPECT_EQ(st[2], kv_get_status::hit);
  EXPECT_EQ(s->stats().corrupt, 2u);
}

TEST(RedisStore, TenantsAreApartBecauseTheSaltIsInTheKey) {
  GPUMEM_REQUIRE_REDIS();
  redis_server server;
  auto s = make_redis_store(server.url(), fast_redis_options(300ms));
  ASSERT_EQ(put_records(*s, payload, 1, 4, /*salt*/ 1), 4u);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 4, /*salt*/ 2)), 0u);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 4, /*salt*/ 1)), 4u);
}

TEST(RedisStore, CredentialsAndTheDatabaseFromTheUrlOrTheOptions) {
  GPUMEM_REQUIRE_REDIS();
  redis_server server({"--requirepass", "s3cr:t@x"});
  const std::string at = "127.0.0.1:" + std::to_string(server.port());
  // The password percent-encoded in the URL, database 3.
  auto s = make_redis_store("redis://:s3cr%3At%40x@" + at + "/3", fast_redis_options(300ms));
  EXPECT_EQ(s->name(), "redis://:***@" + at + "/3");
  ASSERT_EQ(put_records(*s, payload, 1, 5), 5u);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 5)), 5u);
  EXPECT_EQ(server.cli({"-n", "3", "DBSIZE"}), "5\n");
  EXPECT_EQ(server.cli({"DBSIZE"}), "0\n");
  // The same through the options; a named ACL user.
  server.cli({"ACL", "SETUSER", "kv", "on", ">pw2", "~*", "+@all"});
  auto o = fast_redis_options(300ms);
  o.username = "kv";
  o.password = "pw2";
  o.database = 3;
  auto named = make_redis_store("redis://" + at, o);
  EXPECT_EQ(hits(get_records(*named, payload, 1, 5)), 5u);
  EXPECT_EQ(named->stats().errors, 0u);
}

TEST(RedisStore, OptionsFromTheUrlQueryReachTheServer) {
  GPUMEM_REQUIRE_REDIS();
  redis_server server;
  // key_prefix, ttl_seconds and max_reply_bytes from the query; the options given in code
  // stay where the query is silent.
  auto s = make_redis_store(server.url() + "?key_prefix=run%2F7:&ttl_seconds=600&max_reply_bytes=" +
                                std::to_string(record_bytes + 1024),
                            fast_redis_options(300ms, drop_report));
  ASSERT_EQ(put_records(*s, payload, 1, 3), 3u);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 3)), 3u);
  const std::string keys = server.cli({"KEYS", "run/7:*"});
  EXPECT_EQ(std::count(keys.begin(), keys.end(), '\n'), 3) << keys;
  EXPECT_EQ(server.cli({"KEYS", "gpumem:kv:*"}).find("gpumem"), std::string::npos)
      << "the default prefix is replaced";
  const std::string first = keys.substr(0, keys.find('\n'));
  const int ttl = std::stoi(server.cli({"TTL", first}));
  EXPECT_GT(ttl, 500);
  EXPECT_LE(ttl, 600);
  // A record over the query's max_reply_bytes is not stored.
  EXPECT_EQ(put_records(*s, 2 * payload, 10, 1), 0u);
  EXPECT_EQ(server.cli({"DBSIZE"}), "3\n");
}

TEST(RedisStore, RefusedCredentialsAreMissesCountedAndReportedWithoutThePassword) {
  GPUMEM_REQUIRE_REDIS();
  redis_server server({"--requirepass", "right"});
  const std::string at = "127.0.0.1:" + std::to_string(server.port());
  for (const std::string& url : {"redis://:xyzzy42@" + at, "redis://" + at}) {
    report_lines r;
    auto s = make_redis_store(url, fast_redis_options(300ms, r.sink()));
    EXPECT_EQ(put_records(*s, payload, 1, 3), 0u) << url;
    EXPECT_EQ(hits(get_records(*s, payload, 1, 3)), 0u) << url;
    EXPECT_GE(s->stats().errors, 1u) << url;
    EXPECT_EQ(r.count("xyzzy42"), 0u) << "the password is shown";
    // A wrong password fails the connection's AUTH; none at all, its first command (the
    // server answers NOAUTH, or drops an unauthenticated client's large value).
    EXPECT_GE(r.count(url.find('@') != std::string::npos ? "AUTH: WRONGPASS" : ""), 1u) << url;
  }
  EXPECT_EQ(server.cli({"DBSIZE"}), "0\n");
}

TEST(RedisStore, ServerDownAtStartIsMissesThenItConnectsWhenItComes) {
  GPUMEM_REQUIRE_REDIS();
  report_lines r;
  const int port = free_loopback_port();
  auto s = make_redis_store("redis://127.0.0.1:" + std::to_string(port), fast_redis_options(300ms, r.sink()));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(put_records(*s, payload, 1, 4), 0u);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 4)), 0u);
  for (int i = 0; i < 20; ++i) (void)get_records(*s, payload, 1, 4);  // within the backoff: at once
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_GE(s->stats().errors, 1u);
  EXPECT_EQ(r.count("retrying with backoff"), 1u) << "an outage is reported once";
  redis_server server({}, port);
  std::this_thread::sleep_for(250ms);  // past the longest backoff
  EXPECT_EQ(put_records(*s, payload, 1, 4), 4u);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 4)), 4u);
  EXPECT_EQ(r.count("back after"), 1u);
}

TEST(RedisStore, KilledMidRunThenRestartedReconnects) {
  GPUMEM_REQUIRE_REDIS();
  report_lines r;
  redis_server server;
  auto s = make_redis_store(server.url(), fast_redis_options(300ms, r.sink()));
  ASSERT_EQ(put_records(*s, payload, 1, 8), 8u);
  server.stop(/*kill_hard*/ true);
  std::vector<kv_get_status> st;
  EXPECT_NO_THROW(st = get_records(*s, payload, 1, 8));
  EXPECT_EQ(hits(st), 0u);
  EXPECT_EQ(put_records(*s, payload, 100, 2), 0u);
  EXPECT_EQ(r.count("retrying with backoff"), 1u);
  server.start();  // an empty server on the same port
  std::this_thread::sleep_for(250ms);
  EXPECT_EQ(put_records(*s, payload, 1, 8), 8u);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 8)), 8u);
  EXPECT_GE(s->stats().reconnects, 1u);
  EXPECT_EQ(r.count("back after"), 1u);
}

// True once a PING to 127.0.0.1:port goes unanswered for 50 ms (the server is asleep),
// false if it still answers after `within`. Plain sockets: the probe needs no client library.
bool wait_until_unresponsive(int port, std::chrono::milliseconds within) {
  const auto end = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < end) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return false;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool answered = false;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0 &&
        ::send(fd, "PING\r\n", 6, MSG_NOSIGNAL) == 6) {
      pollfd p{fd, POLLIN, 0};
      answered = ::poll(&p, 1, 50) == 1;
    }
    ::close(fd);
    if (!answered) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

TEST(RedisStore, ASlowServerTimesOutIntoMissesNotAStall) {
  GPUMEM_REQUIRE_REDIS();
  report_lines r;
  redis_server server;
  auto s = make_redis_store(server.url(), fast_redis_options(300ms, r.sink()));
  ASSERT_EQ(put_records(*s, payload, 1, 4), 4u);
  server.cli_async({"DEBUG", "SLEEP", "3"});
  ASSERT_TRUE(wait_until_unresponsive(server.port(), 2s)) << "DEBUG SLEEP did not take effect";
  const auto t0 = std::chrono::steady_clock::now();
  const auto st = get_records(*s, payload, 1, 4);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(hits(st), 0u);
  EXPECT_LT(took, 1s) << "bounded by the command timeout (300 ms), not the server's sleep";
  EXPECT_NE(s->stats().last_error.find("timed out"), std::string::npos) << s->stats().last_error;
  server.wait_background();
  std::this_thread::sleep_for(250ms);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 4)), 4u) << "reconnected once the server answers again";
}

TEST(RedisStore, AFullServerRefusesPutsReportedOnceAndEvictsUnderLru) {
  GPUMEM_REQUIRE_REDIS();
  {
    report_lines r;
    redis_server server({"--maxmemory", "2mb", "--maxmemory-policy", "noeviction"});
    auto s = make_redis_store(server.url(), fast_redis_options(300ms, r.sink()));
    const std::size_t stored = put_records(*s, payload, 1, 64);  // 4 MiB into 2 MiB
    EXPECT_GT(stored, 0u);
    EXPECT_LT(stored, 64u);
    EXPECT_EQ(s->stats().put_failures, 64u - stored);
    EXPECT_EQ(r.count("OOM"), 1u) << "each kind of error reply is reported once";
    EXPECT_EQ(hits(get_records(*s, payload, 1, 64)), stored) << "what was stored is still served";
  }
  {
    redis_server server({"--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"});
    auto s = make_redis_store(server.url(), fast_redis_options(300ms));
    EXPECT_EQ(put_records(*s, payload, 1, 64), 64u);
    const std::size_t found = hits(get_records(*s, payload, 1, 64));
    EXPECT_LT(found, 64u) << "older blocks were evicted: misses, not errors";
    EXPECT_EQ(s->stats().corrupt, 0u);
  }
}

}  // namespace
