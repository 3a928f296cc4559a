// The tier building blocks without a server: the block record (sizes, key, checksum), the
// Redis Cluster key slot, and the host store (bounded LRU in pinned host memory).
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "gpumem/errors.hpp"
#include "gpumem/kv/tier/host_store.hpp"
#include "gpumem/kv/tier/redis_store.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "kv_tier/tier_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;

TEST(KvRecord, ASealedRecordVerifiesAndCarriesItsHeaderAndTokens) {
  const auto r = make_record(key(5, 3), 4096, 99);
  EXPECT_TRUE(kv_record::verify(r, key(5, 3), 4096));
  EXPECT_TRUE(kv_record::verify(r, key(5, 3)));
  const auto h = kv_record::header(r);
  EXPECT_EQ(h.parent, 99u);
  EXPECT_EQ(h.salt, 3u);
  EXPECT_EQ(kv_record::tokens(r).size(), 16u);
  EXPECT_EQ(kv_record::tokens(r)[0], 1);
  EXPECT_EQ(kv_record::payload(r).size(), 4096u);
}

TEST(KvRecord, EveryFlippedByteTruncationOrOtherKeyIsRefused) {
  const auto good = make_record(key(5, 3), 1000);
  for (std::size_t i = 0; i < good.size(); i += 37) {
    auto bad = good;
    bad[i] ^= std::byte{0x10};
    EXPECT_FALSE(kv_record::verify(bad, key(5, 3), 1000)) << "byte " << i;
  }
  auto cut = good;
  cut.pop_back();
  EXPECT_FALSE(kv_record::verify(cut, key(5, 3), 1000));
  EXPECT_FALSE(kv_record::verify(cut, key(5, 3)));
  EXPECT_FALSE(kv_record::verify({good.data(), 10}, key(5, 3)));
  EXPECT_FALSE(kv_record::verify(good, key(5, 4), 1000)) << "another tenant's key";
  EXPECT_FALSE(kv_record::verify(good, key(6, 3), 1000));
  EXPECT_FALSE(kv_record::verify(good, {43, 3, 5}, 1000)) << "another layout's space";
  EXPECT_FALSE(kv_record::verify(good, key(5, 3), 999)) << "another payload size";
}

TEST(KvChecksum, DependsOnEveryByteAndTheSeed) {
  std::vector<std::byte> a(257, std::byte{1});
  const auto c = kv_checksum(a);
  EXPECT_NE(c, kv_checksum(a, 1));
  for (std::size_t i : {0u, 63u, 64u, 200u, 256u}) {
    auto b = a;
    b[i] = std::byte{2};
    EXPECT_NE(kv_checksum(b), c) << i;
  }
  EXPECT_NE(kv_checksum({a.data(), 256}), c);
}

TEST(RedisKeySlot, FollowsTheClusterSpec) {
  // The Redis Cluster specification's check value: CRC16("123456789") = 0x31C3.
  EXPECT_EQ(redis_key_slot("123456789"), 0x31C3 % 16384);
  EXPECT_EQ(redis_key_slot("{user1000}.following"), redis_key_slot("{user1000}.followers"));
  EXPECT_EQ(redis_key_slot("foo{}{bar}"), redis_key_slot("foo{}{bar}"));
  EXPECT_NE(redis_key_slot("foo{}{bar}"), redis_key_slot("bar")) << "an empty {} hashes the whole key";
  EXPECT_EQ(redis_key_slot("foo{{bar}}zap"), redis_key_slot("{bar"));
  EXPECT_EQ(redis_key_slot("foo{bar}{zap}"), redis_key_slot("bar"));
}

TEST(RedisStore, MalformedUrlsAreRefusedWithTheReason) {
  if (!redis_tier_available()) {
    try {
      (void)make_redis_store("redis://127.0.0.1:6379");
      FAIL() << "expected a refusal";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("hiredis"), std::string::npos) << e.what();
    }
    return;
  }
  EXPECT_THROW((void)make_redis_store("http://x:1"), invalid_argument);
  EXPECT_THROW((void)make_redis_store("redis://"), invalid_argument);
  EXPECT_THROW((void)make_redis_store("redis://h:0"), invalid_argument);
  EXPECT_THROW((void)make_redis_store("redis://h:99999"), invalid_argument);
  EXPECT_THROW((void)make_redis_store("redis://h:1,h:2"), invalid_argument);
  EXPECT_THROW((void)make_redis_store("redis-cluster://h:1,:2"), invalid_argument);
  EXPECT_NO_THROW((void)make_redis_store("redis-cluster://127.0.0.1:1,127.0.0.1:2"));
  // Credentials and the database.
  const auto refused = [](const std::string& url, const std::string& says) {
    try {
      (void)make_redis_store(url);
      ADD_FAILURE() << "accepted " << url;
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("sekret"), std::string::npos)
          << "the password is shown: " << e.what();
    }
  };
  refused("redis://sekret@h:1", "[USER]:PASSWORD@");
  refused("redis://:sekret%4@h:1", "cut short");
  refused("redis://:sekret%zz@h:1", "two hex digits");
  refused("redis://:sekret@h:1/x", "database 'x'");
  refused("redis://:sekret@h:1/-1", "database '-1'");
  refused("redis://:sekret@h:1/", "database ''");
  refused("redis-cluster://:sekret@h:1,h:2/3", "database 0 only");
  refused("redis://:sekret@h:0", "bad port");
  refused("redis://:sekret@", "no host:port");
  EXPECT_EQ(make_redis_store("redis://alice:sekret@127.0.0.1:1/2")->name(),
            "redis://alice:***@127.0.0.1:1/2");
  EXPECT_EQ(make_redis_store("redis://:p%40ss@127.0.0.1:1")->name(), "redis://:***@127.0.0.1:1");
  // Options in the query: each checked, named when refused; the password still hidden.
  refused("redis://:sekret@h:1?connect_timeout_ms=0", "connect_timeout_ms='0' is not a whole number in [1, 3600000]");
  refused("redis://:sekret@h:1?command_timeout_ms=-5", "command_timeout_ms='-5'");
  refused("redis://:sekret@h:1?command_timeout_ms=99999999999999999999", "command_timeout_ms=");
  refused("redis://:sekret@h:1?command_timeout_ms=", "command_timeout_ms=''");
  refused("redis://:sekret@h:1?max_links=0", "max_links='0'");
  refused("redis://:sekret@h:1?ttl_seconds=4294967296", "ttl_seconds=");
  refused("redis://:sekret@h:1?max_reply_bytes=lots", "max_reply_bytes");
  refused("redis://:sekret@h:1?max_reply_bytes=100", "max_reply_bytes at least 1024");
  refused("redis://:sekret@h:1?backoff_min_ms=500&backoff_max_ms=100", "backoff");
  refused("redis://:sekret@h:1?timeout=5", "unknown option 'timeout' (there are connect_timeout_ms");
  refused("redis://:sekret@h:1?ttl_seconds=5&ttl_seconds=6", "'ttl_seconds' given twice");
  refused("redis://:sekret@h:1?ttl_seconds", "'ttl_seconds' is not KEY=VALUE");
  refused("redis://:sekret@h:1?=5", "is not KEY=VALUE");
  refused("redis://:sekret@h:1?ttl_seconds=5&", "'' is not KEY=VALUE");
  refused("redis://:sekret@h:1?key_prefix=%zz", "two hex digits");
  refused("redis://:sekret@h:1?key_prefix=" + std::string(257, 'k'), "key_prefix is over 256 bytes");
  refused("redis://:sekret@h:1/x?ttl_seconds=5", "database 'x'");
  EXPECT_EQ(make_redis_store("redis://:p%40ss@127.0.0.1:1/2?key_prefix=a%40b:&ttl_seconds=60")->name(),
            "redis://:***@127.0.0.1:1/2?key_prefix=a%40b:&ttl_seconds=60");
  EXPECT_NO_THROW((void)make_redis_store(
      "redis-cluster://127.0.0.1:1,127.0.0.1:2?connect_timeout_ms=3600000&command_timeout_ms=1&"
      "backoff_min_ms=10&backoff_max_ms=10&max_reply_bytes=2M&pipeline_bytes=1G&max_links=4096&"
      "ttl_seconds=0"));
  EXPECT_EQ(make_redis_store("redis-cluster://:x@127.0.0.1:1,127.0.0.1:2/0")->name(),
            "redis-cluster://:***@127.0.0.1:1,127.0.0.1:2/0");
}

class HostStore : public ::testing::Test {
 protected:
  sim_platform sim;
};

TEST_F(HostStore, PutGetContainsBytesIntact) {
  host_store hs(sim, 0, 1 << 20);
  const auto r1 = make_record(key(1), 8192, 0, 16, 1), r2 = make_record(key(2), 8192, 0, 16, 2);
  const kv_block_key keys[] = {key(1), key(2)};
  const std::span<const std::byte> vals[] = {r1, r2};
  bool stored[2] = {};
  hs.put(keys, vals, stored);
  EXPECT_TRUE(stored[0] && stored[1]);
  bool has[3] = {};
  const kv_block_key ask[] = {key(1), key(2), key(3)};
  hs.contains(ask, has);
  EXPECT_TRUE(has[0] && has[1]);
  EXPECT_FALSE(has[2]);
  std::vector<std::byte> a(r1.size()), b(r1.size()), c(r1.size());
  const std::span<std::byte> dst[] = {a, b, c};
  kv_get_status st[3];
  hs.get(ask, dst, st);
  EXPECT_EQ(st[0], kv_get_status::hit);
  EXPECT_EQ(st[1], kv_get_status::hit);
  EXPECT_EQ(st[2], kv_get_status::miss);
  EXPECT_EQ(a, r1);
  EXPECT_EQ(b, r2);
  const auto s = hs.stats();
  EXPECT_EQ(s.puts, 2u);
  EXPECT_EQ(s.hits, 2u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(hs.validate(), "");
}

TEST_F(HostStore, BoundedLeastRecentlyUsedFirstOutAndSpilled) {
  const std::size_t rec = kv_record::size(16, 100000);
  host_store hs(sim, 0, 3 * rec);
  std::vector<kv_block_key> spilled;
  kv_store::spill_fn spill = [&](const kv_block_key& k, std::span<const std::byte> bytes) {
    EXPECT_TRUE(kv_record::verify(bytes, k, 100000));
    spilled.push_back(k);
  };
  for (std::uint64_t h = 1; h <= 3; ++h) {
    const auto r = make_record(key(h), 100000);
    const kv_block_key k[] = {key(h)};
    const std::span<const std::byte> v[] = {r};
    bool ok[1];
    hs.put(k, v, ok, &spill);
    ASSERT_TRUE(ok[0]);
  }
  // Touch 1, so 2 is the least recently used.
  std::vector<std::byte> buf(rec);
  const std::span<std::byte> d[] = {buf};
  kv_get_status st[1];
  const kv_block_key one[] = {key(1)};
  hs.get(one, d, st);
  ASSERT_EQ(st[0], kv_get_status::hit);
  const auto r4 = make_record(key(4), 100000);
  const kv_block_key k4[] = {key(4)};
  const std::span<const std::byte> v4[] = {r4};
  bool ok[1];
  hs.put(k4, v4, ok, &spill);
  EXPECT_TRUE(ok[0]);
  ASSERT_EQ(spilled.size(), 1u);
  EXPECT_EQ(spilled[0], key(2));
  const auto s = hs.stats();
  EXPECT_LE(s.held_bytes, hs.capacity_bytes());
  EXPECT_EQ(s.entries, 3u);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(hs.validate(), "");
  // A value larger than the whole store is refused, nothing dropped for it.
  const auto big = make_record(key(9), 4 * rec);
  const kv_block_key k9[] = {key(9)};
  const std::span<const std::byte> v9[] = {big};
  hs.put(k9, v9, ok, &spill);
  EXPECT_FALSE(ok[0]);
  EXPECT_EQ(hs.stats().entries, 3u);
}

TEST_F(HostStore, CorruptOrWrongSizeValueIsAMissCountedNeverData) {
  host_store hs(sim, 0, 1 << 20);
  auto bad = make_record(key(1), 4096);
  bad[bad.size() / 2] ^= std::byte{1};
  const kv_block_key k[] = {key(1)};
  const std::span<const std::byte> v[] = {bad};
  bool ok[1];
  hs.put(k, v, ok);
  std::vector<std::byte> buf(bad.size()), small(bad.size() - 1);
  const std::span<std::byte> d[] = {buf};
  kv_get_status st[1];
  hs.get(k, d, st);
  EXPECT_EQ(st[0], kv_get_status::corrupt);
  const std::span<std::byte> d2[] = {small};
  hs.get(k, d2, st);
  EXPECT_EQ(st[0], kv_get_status::corrupt);
  EXPECT_EQ(hs.stats().corrupt, 2u);
  EXPECT_EQ(hs.stats().hits, 0u);
}

// Records of a 2 MiB block and its header share slabs of host memory: a store of them
// holds about their bytes from the OS, not 4 MiB each (2 MiB-rounded segments of their own),
// and every one reads back intact.
TEST_F(HostStore, RecordsOfABlockAndAHeaderShareSlabs) {
  const std::size_t payload = std::size_t{2} << 20;
  host_store hs(sim, 0, std::size_t{1} << 30);  // slabs of 64 MiB
  std::vector<std::vector<std::byte>> recs;
  for (std::uint64_t h = 1; h <= 96; ++h) {
    recs.push_back(make_record(key(h), payload, 0, 16, static_cast<unsigned>(h)));
    const kv_block_key k[] = {key(h)};
    const std::span<const std::byte> v[] = {recs.back()};
    bool ok[1] = {false};
    hs.put(k, v, ok);
    ASSERT_TRUE(ok[0]);
  }
  const std::size_t held = hs.stats().held_bytes;
  EXPECT_EQ(held, 96 * recs[0].size());
  // A 64 MiB slab holds 31 records: 4 slabs for 96 (the last partly used).
  EXPECT_LE(hs.reserved_bytes(), held * 32 / 31 + (std::size_t{64} << 20));
  EXPECT_LT(hs.reserved_bytes(), 96 * (std::size_t{4} << 20));
  std::vector<std::byte> buf(recs[0].size());
  for (std::uint64_t h = 1; h <= 96; ++h) {
    const kv_block_key k[] = {key(h)};
    const std::span<std::byte> d[] = {buf};
    kv_get_status st[1];
    hs.get(k, d, st);
    ASSERT_EQ(st[0], kv_get_status::hit);
    ASSERT_EQ(buf, recs[h - 1]);
  }
  EXPECT_EQ(hs.validate(), "");
}

TEST_F(HostStore, TenantsNeverSeeEachOthersBlocks) {
  host_store hs(sim, 0, 1 << 20);
  const auto r = make_record(key(1, /*salt*/ 10), 4096);
  const kv_block_key k[] = {key(1, 10)};
  const std::span<const std::byte> v[] = {r};
  bool ok[1];
  hs.put(k, v, ok);
  std::vector<std::byte> buf(r.size());
  const std::span<std::byte> d[] = {buf};
  kv_get_status st[1];
  const kv_block_key other[] = {key(1, 11)};
  hs.get(other, d, st);
  EXPECT_EQ(st[0], kv_get_status::miss);
  bool has[1];
  hs.contains(other, has);
  EXPECT_FALSE(has[0]);
}

}  // namespace
