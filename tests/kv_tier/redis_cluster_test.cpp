// The Redis Cluster tier against a real 3-node cluster on loopback (each test builds its
// own with redis-cli --cluster create): keys spread by slot, MOVED after a slot migrated,
// ASK during a migration, a node killed (its keys miss, the rest hit, nothing throws) and
// restarted, a node removed after its slots moved away.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "gpumem/kv/tier/kv_record.hpp"
#include "gpumem/kv/tier/redis_store.hpp"
#include "kv_tier/redis_server.hpp"
#include "kv_tier/tier_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;
using namespace std::chrono_literals;

constexpr std::size_t payload = 16 * 1024;
const std::size_t record_bytes = kv_record::size(16, payload);

redis_store_options fast_options() {
  redis_store_options o;
  o.connect_timeout = 200ms;
  o.command_timeout = 500ms;
  o.backoff_min = 50ms;
  o.backoff_max = 200ms;
  o.report = [](const std::string&) {};
  return o;
}

std::string key_name(const kv_block_key& k) {
  char buf[80];
  std::snprintf(buf, sizeof buf, "gpumem:kv:%016llx:%016llx:%016llx",
                static_cast<unsigned long long>(k.space), static_cast<unsigned long long>(k.salt),
                static_cast<unsigned long long>(k.hash));
  return buf;
}

std::size_t put_range(kv_store& s, std::uint64_t first, std::size_t n) {
  std::vector<kv_block_key> keys;
  std::vector<std::vector<std::byte>> recs;
  for (std::size_t i = 0; i < n; ++i) {
    keys.push_back(key(first + i));
    recs.push_back(make_record(keys.back(), payload, 0, 16, static_cast<unsigned>(first + i)));
  }
  std::vector<std::span<const std::byte>> vals(recs.begin(), recs.end());
  std::unique_ptr<bool[]> ok(new bool[n]);
  s.put(keys, vals, {ok.get(), n});
  std::size_t stored = 0;
  for (std::size_t i = 0; i < n; ++i) stored += ok[i];
  return stored;
}

std::vector<kv_get_status> get_range(kv_store& s, std::uint64_t first, std::size_t n) {
  std::vector<kv_block_key> keys;
  std::vector<std::vector<std::byte>> bufs(n, std::vector<std::byte>(record_bytes));
  for (std::size_t i = 0; i < n; ++i) keys.push_back(key(first + i));
  std::vector<std::span<std::byte>> dst(bufs.begin(), bufs.end());
  std::vector<kv_get_status> st(n, kv_get_status::miss);
  s.get(keys, dst, st);
  for (std::size_t i = 0; i < n; ++i) {
    if (st[i] == kv_get_status::hit) {
      EXPECT_EQ(bufs[i], make_record(keys[i], payload, 0, 16, static_cast<unsigned>(first + i)));
    }
  }
  return st;
}

std::size_t hits(const std::vector<kv_get_status>& st) {
  return static_cast<std::size_t>(std::count(st.begin(), st.end(), kv_get_status::hit));
}

long dbsize(redis_server& s) { return std::atol(s.cli({"DBSIZE"}).c_str()); }

// Moves `slot` from node `from` to node `to`, key by key; with finish=false the slot is
// left mid-migration (MIGRATING on `from`, IMPORTING on `to`), so `from` answers ASK.
void migrate_slot(redis_cluster& c, std::uint16_t slot, std::size_t from, std::size_t to,
                  const std::vector<std::string>& keys, bool finish) {
  const std::string s = std::to_string(slot);
  c.node(to).cli({"CLUSTER", "SETSLOT", s, "IMPORTING", c.id(from)});
  c.node(from).cli({"CLUSTER", "SETSLOT", s, "MIGRATING", c.id(to)});
  for (const auto& k : keys)
    c.node(from).cli({"MIGRATE", "127.0.0.1", std::to_string(c.node(to).port()), k, "0", "5000"});
  if (!finish) return;
  for (std::size_t i = 0; i < c.size(); ++i) c.node(i).cli({"CLUSTER", "SETSLOT", s, "NODE", c.id(to)});
}

TEST(RedisCluster, KeysSpreadOverTheMastersBySlot) {
  GPUMEM_REQUIRE_REDIS();
  redis_cluster c;
  auto s = make_redis_store(c.url(), fast_options());
  EXPECT_EQ(put_range(*s, 1, 60), 60u);
  EXPECT_EQ(hits(get_range(*s, 1, 60)), 60u);
  long total = 0;
  for (std::size_t i = 0; i < c.size(); ++i) {
    EXPECT_GT(dbsize(c.node(i)), 0) << "node " << i << " holds none of 60 keys";
    total += dbsize(c.node(i));
  }
  EXPECT_EQ(total, 60);
  // Each key is on its slot's owner.
  for (std::uint64_t h = 1; h <= 5; ++h) {
    const std::string k = key_name(key(h));
    const int owner = c.owner(redis_key_slot(k));
    ASSERT_GE(owner, 0);
    EXPECT_EQ(c.node(static_cast<std::size_t>(owner)).cli({"EXISTS", k}), "1\n");
  }
}

TEST(RedisCluster, FollowsMovedAfterASlotMigratedAndAskDuringAMigration) {
  GPUMEM_REQUIRE_REDIS();
  redis_cluster c;
  auto s = make_redis_store(c.url(), fast_options());
  ASSERT_EQ(put_range(*s, 1, 10), 10u);
  ASSERT_EQ(hits(get_range(*s, 1, 10)), 10u);  // the store now holds the slot map
  // Key 1's slot moves to another node, completely: the old owner answers MOVED.
  const std::string k1 = key_name(key(1));
  const std::uint16_t slot1 = redis_key_slot(k1);
  const int from1 = c.owner(slot1);
  ASSERT_GE(from1, 0);
  const std::size_t to1 = (static_cast<std::size_t>(from1) + 1) % c.size();
  migrate_slot(c, slot1, static_cast<std::size_t>(from1), to1, {k1}, true);
  EXPECT_EQ(c.node(to1).cli({"EXISTS", k1}), "1\n");
  EXPECT_EQ(get_range(*s, 1, 1)[0], kv_get_status::hit) << "MOVED followed";
  EXPECT_EQ(s->stats().redirects, 1u);
  // Key 2's slot is left mid-migration: its key already moved, so the owner answers ASK.
  const std::string k2 = key_name(key(2));
  const std::uint16_t slot2 = redis_key_slot(k2);
  ASSERT_NE(slot2, slot1);
  const int from2 = c.owner(slot2);
  ASSERT_GE(from2, 0);
  const std::size_t to2 = (static_cast<std::size_t>(from2) + 1) % c.size();
  migrate_slot(c, slot2, static_cast<std::size_t>(from2), to2, {k2}, false);
  EXPECT_EQ(c.node(static_cast<std::size_t>(from2)).cli({"CLUSTER", "COUNTKEYSINSLOT", std::to_string(slot2)}),
            "0\n") << "the key left its old owner";
  EXPECT_EQ(get_range(*s, 2, 1)[0], kv_get_status::hit) << "ASK followed (ASKING, then GET)";
  EXPECT_EQ(s->stats().redirects, 2u);
  EXPECT_EQ(hits(get_range(*s, 1, 10)), 10u);
  EXPECT_EQ(s->stats().errors, 0u);
}

TEST(RedisCluster, ANodeKilledIsMissesForItsKeysOnlyThenItComesBack) {
  GPUMEM_REQUIRE_REDIS();
  redis_cluster c;
  auto s = make_redis_store(c.url(), fast_options());
  ASSERT_EQ(put_range(*s, 1, 60), 60u);
  const long on_dead = dbsize(c.node(2));
  ASSERT_GT(on_dead, 0);
  c.node(2).stop(/*kill_hard*/ true);
  std::vector<kv_get_status> st;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NO_THROW(st = get_range(*s, 1, 60));
  EXPECT_EQ(hits(st), static_cast<std::size_t>(60 - on_dead)) << "the other masters still serve";
  for (int i = 0; i < 10; ++i) EXPECT_NO_THROW((void)get_range(*s, 1, 60));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_GT(s->stats().errors, 0u);
  EXPECT_LT(put_range(*s, 1000, 30), 30u) << "keys of the dead node's slots are not stored";
  // It restarts (empty: no persistence) and rejoins with its slots; the store reconnects.
  c.node(2).start();
  for (int i = 0; i < 250 && !c.ok(); ++i) std::this_thread::sleep_for(20ms);
  std::this_thread::sleep_for(250ms);
  EXPECT_EQ(put_range(*s, 1, 60), 60u);
  EXPECT_EQ(hits(get_range(*s, 1, 60)), 60u);
}

TEST(RedisCluster, ANodeRemovedAfterItsSlotsMovedAwayIsFollowed) {
  GPUMEM_REQUIRE_REDIS();
  redis_cluster c;
  auto s = make_redis_store(c.url(), fast_options());
  ASSERT_EQ(put_range(*s, 1, 40), 40u);
  ASSERT_EQ(hits(get_range(*s, 1, 40)), 40u);
  // Every slot of node 2 to node 0 (keys with them), then node 2 leaves the cluster.
  const std::string id2 = c.id(2);
  run_output({find_program("redis-cli"), "--cluster", "rebalance", c.node(0).address(),
              "--cluster-weight", id2 + "=0", "--cluster-yes"});
  ASSERT_EQ(dbsize(c.node(2)), 0) << "the rebalance moved node 2's keys";
  run_output({find_program("redis-cli"), "--cluster", "del-node", c.node(0).address(), id2});
  c.node(2).stop();
  EXPECT_EQ(hits(get_range(*s, 1, 40)), 40u) << "MOVED, then the map refreshed without node 2";
  EXPECT_EQ(put_range(*s, 100, 20), 20u);
}

}  // namespace
