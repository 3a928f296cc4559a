// redis_store and redis_cluster_store: KV tiers in Redis, through hiredis, so several
// serving instances (processes, hosts) share the prefixes any of them computed.
//
//  - A batch is one pipeline per server: every command of it is written, then every
//    reply read (one round trip, not one per block); values go in chunks of at most
//    options.pipeline_bytes.
//  - Keys: "<prefix><space>:<salt>:<hash>" (hex). The salt is part of the key, so tenants
//    never see each other's blocks; the space (the KV layout's fingerprint) keeps models
//    apart.
//  - Faults never throw into the caller and never block longer than the timeouts: a
//    connection that fails (refused, reset, timed out) is dropped; the batch's remaining
//    keys are misses (errors counted); the next connection attempt waits a backoff that
//    doubles from backoff_min to backoff_max, during which calls answer at once (misses,
//    "not stored"). An error reply (OOM under maxmemory, CLUSTERDOWN) fails that key
//    only. The first error of an outage is reported once (options.report, stderr by
//    default) and so is the recovery; every error is counted.
//  - redis_cluster_store maps the 16384 hash slots (CRC16 of the key, or of its {tag})
//    to masters from CLUSTER SLOTS, sends each key to its slot's master, follows MOVED
//    (and refreshes the map) and ASK (ASKING, then the command, on the named node), and
//    refreshes the map after a node fails; keys of a node that went away are misses.
// Thread-safe: one mutex per store (one batch at a time; hiredis contexts are not
// shared between threads).
// Without hiredis at build time, make_redis_store throws gpumem::invalid_argument saying
// so (kv_tier_available("redis") is false).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gpumem/kv/tier/kv_store.hpp"

namespace gpumem {

struct redis_store_options {
  std::chrono::milliseconds connect_timeout{500};
  std::chrono::milliseconds command_timeout{1000};  // per read or write on the socket
  std::chrono::milliseconds backoff_min{100}, backoff_max{5000};
  std::size_t pipeline_bytes = std::size_t{64} << 20;  // values per pipeline round
  std::string key_prefix = "gpumem:kv:";
  std::uint32_t ttl_seconds = 0;  // 0: keys live until Redis evicts them (maxmemory-policy)
  // Where an outage's first error and its recovery are reported (nullptr: stderr).
  std::function<void(const std::string&)> report;
  // Sent on every connection before any command: AUTH [username] password when password
  // is not empty (username empty: the server's default user), then SELECT database when
  // it is not 0. A URL's user information and /DB take the place of these.
  std::string username, password;
  unsigned database = 0;
};

// "host:port" endpoints.
struct redis_endpoint {
  std::string host;
  int port = 6379;
};

// true when this build has the Redis tier (hiredis was found at build time).
bool redis_tier_available() noexcept;

// A store for a URL: redis://[[USER]:PASSWORD@]HOST:PORT[/DB] (one server) or
// redis-cluster://[[USER]:PASSWORD@]HOST:PORT,HOST:PORT,... (seed nodes of a cluster, whose
// only database is 0). USER and PASSWORD are percent-decoded (%40 for '@', %3A for ':');
// the store's name() and its reports show the URL with the password as "***". Connects
// lazily: a server that is down at start, or refuses the credentials, is a miss counted
// and reported, not an error here. Throws gpumem::invalid_argument for a malformed URL or
// when the build has no Redis tier.
std::unique_ptr<kv_store> make_redis_store(std::string_view url, redis_store_options options = {});

// The Redis Cluster hash slot of a key: CRC16 (XMODEM) of the key, or of the part between
// the first '{' and the next '}' when that part is not empty, modulo 16384.
std::uint16_t redis_key_slot(std::string_view key) noexcept;

}  // namespace gpumem
