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
#include "kv_tier/redis_test_support.hpp"
#include "kv_tier/tier_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;
using namespace std::chrono_literals;

constexpr std::size_t payload = 16 * 1024;

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
  auto s = make_redis_store(c.url(), fast_redis_options(500ms, drop_report));
  EXPECT_EQ(put_records(*s, payload, 1, 60), 60u);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 60)), 60u);
  long total = 0;
  for (std::size_t i = 0; i < c.size(); ++i) {
    EXPECT_GT(dbsize(c.node(i)), 0) << "node " << i << " holds none of 60 keys";
    total += dbsize(c.node(i));
  }
  EXPECT_EQ(total, 60);
  // Each key is on its slot's owner.
  for (std::uint64_t h = 1; h <= 5; ++h) {
    const std::string k = redis_key_name(key(h));
    const int owner = c.owner(redis_key_slot(k));
    ASSERT_GE(owner, 0);
    EXPECT_EQ(c.node(static_cast<std::size_t>(owner)).cli({"EXISTS", k}), "1\n");
  }
}

TEST(RedisCluster, FollowsMovedAfterASlotMigratedAndAskDuringAMigration) {
  GPUMEM_REQUIRE_REDIS();
  redis_cluster c;
  auto s = make_redis_store(c.url(), fast_redis_options(500ms, drop_report));
  ASSERT_EQ(put_records(*s, payload, 1, 10), 10u);
  ASSERT_EQ(hits(get_records(*s, payload, 1, 10)), 10u);  // the store now holds the slot map
  // Key 1's slot moves to another node, completely: the old owner answers MOVED.
  const std::string k1 = redis_key_name(key(1));
  const std::uint16_t slot1 = redis_key_slot(k1);
  const int from1 = c.owner(slot1);
  ASSERT_GE(from1, 0);
  const std::size_t to1 = (static_cast<std::size_t>(from1) + 1) % c.size();
  migrate_slot(c, slot1, static_cast<std::size_t>(from1), to1, {k1}, true);
  EXPECT_EQ(c.node(to1).cli({"EXISTS", k1}), "1\n");
  EXPECT_EQ(get_records(*s, payload, 1, 1)[0], kv_get_status::hit) << "MOVED followed";
  EXPECT_EQ(s->stats().redirects, 1u);
  // Key 2's slot is left mid-migration: its key already moved, so the owner answers ASK.
  const std::string k2 = redis_key_name(key(2));
  const std::uint16_t slot2 = redis_key_slot(k2);
  ASSERT_NE(slot2, slot1);
  const int from2 = c.owner(slot2);
  ASSERT_GE(from2, 0);
  const std::size_t to2 = (static_cast<std::size_t>(from2) + 1) % c.size();
  migrate_slot(c, slot2, static_cast<std::size_t>(from2), to2, {k2}, false);
  EXPECT_EQ(c.node(static_cast<std::size_t>(from2)).cli({"CLUSTER", "COUNTKEYSINSLOT", std::to_string(slot2)}),
            "0\n") << "the key left its old owner";
  EXPECT_EQ(get_records(*s, payload, 2, 1)[0], kv_get_status::hit) << "ASK followed (ASKING, then GET)";
  EXPECT_EQ(s->stats().redirects, 2u);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 10)), 10u);
  EXPECT_EQ(s->stats().errors, 0u);
}

TEST(RedisCluster, ANodeKilledIsMissesForItsKeysOnlyThenItComesBack) {
  GPUMEM_REQUIRE_REDIS();
  redis_cluster c;
  auto s = make_redis_store(c.url(), fast_redis_options(500ms, drop_report));
  ASSERT_EQ(put_records(*s, payload, 1, 60), 60u);
  const long on_dead = dbsize(c.node(2));
  ASSERT_GT(on_dead, 0);
  c.node(2).stop(/*kill_hard*/ true);
  std::vector<kv_get_status> st;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NO_THROW(st = get_records(*s, payload, 1, 60));
  EXPECT_EQ(hits(st), static_cast<std::size_t>(60 - on_dead)) << "the other masters still serve";
  for (int i = 0; i < 10; ++i) EXPECT_NO_THROW((void)get_records(*s, payload, 1, 60));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_GT(s->stats().errors, 0u);
  EXPECT_LT(put_records(*s, payload, 1000, 30), 30u) << "keys of the dead node's slots are not stored";
  // It restarts (empty: no persistence) and rejoins with its slots; the store reconnects.
  c.node(2).start();
  for (int i = 0; i < 250 && !c.ok(); ++i) std::this_thread::sleep_for(20ms);
  std::this_thread::sleep_for(250ms);
  EXPECT_EQ(put_records(*s, payload, 1, 60), 60u);
  EXPECT_EQ(hits(get_records(*s, payload, 1, 60)), 60u);
}

TEST(RedisCluster, ANodeRemovedAfterItsSlotsMovedAwayIsFollowed) {
  GPUMEM_REQUIRE_REDIS();
  redis_cluster c;
  auto s = make_redis_store(c.url(), fast_redis_options(500ms, drop_report));
  ASSERT_EQ(put_records(*s, payload, 1, 40), 40u);
  ASSERT_EQ(hits(get_records(*s, payload, 1, 40)), 40u);
  // Every slot of node 2 to node 0 (keys with them), then node 2 leaves the cluster.
  const std::string id2 = c.id(2);
  run_output({find_program("redis-cli"), "--cluster", "rebalance", c.node(0).address(),
              "--cluster-weight", id2 + "=0", "--cluster-yes"});
  ASSERT_EQ(dbsize(c.node(2)), 0) << "the rebalance moved node 2's keys";
  run_output({find_program("redis-cli"), "--cluster", "del-node", c.node(0).address(), id2});
  c.node(2).stop();
  EXPECT_EQ(hits(get_records(*s, payload, 1, 40)), 40u) << "MOVED, then the map refreshed without node 2";
  EXPECT_EQ(put_records(*s, payload, 100, 20), 20u);
}

}  // namespace
