// redis_store and redis_cluster_store: KV tiers in Redis, through hiredis, so several
// serving instances (processes, hosts) share the prefixes any of them computed.
//
//  - A batch is one pipeline per server: every command of it is written, then every
//    reply read (one round trip, not one per block); values go in chunks of at most
//    options.pipeline_bytes.
//  - Keys: "<prefix><space>:<salt>:<hash>" (hex). The salt is part of the key, so tenants
//    never see each other's blocks; the space (the KV layout's fingerprint) keeps models
//    apart.
//  - Faults never throw into the caller and never outlast the call's deadline: a call
//    (put, get, contains) ends within command_timeout for each pipeline_bytes of values
//    it sends or asks for (one command_timeout for a batch under pipeline_bytes), every
//    resolve, connect, AUTH/SELECT, write, read, redirect and slot-map refresh included;
//    the keys not answered by then are misses. A connection that fails (refused, reset,
//    past the deadline, a reply over max_reply_bytes, bytes that are not RESP, a reply the
//    command does not answer with) is dropped; the batch's remaining keys are misses
//    (errors counted by kind, redis_faults()); the next connection attempt waits a
//    backoff that doubles from backoff_min to backoff_max, during which calls answer at
//    once (misses, "not stored"). An error reply (OOM under maxmemory, CLUSTERDOWN) fails
//    that key only. The first error of an outage is reported once (options.report,
//    stderr by default) and so is the recovery; every error is counted.
//  - Memory: the replies of one round trip buffer at most max_reply_bytes (a bulk reply
//    declaring more is refused before its bytes are read); a GET's value of the expected
//    size is read straight into the caller's buffer.
//  - redis_cluster_store maps the 16384 hash slots (CRC16 of the key, or of its {tag})
//    to masters from CLUSTER SLOTS, sends each key to its slot's master, follows MOVED
//    (and refreshes the map) and ASK (ASKING, then the command, on the named node), and
//    refreshes the map after a node fails; keys of a node that went away are misses.
//    A key follows at most 3 redirects per call. The store keeps at most max_links
//    connections besides the seeds (the least recently used one beyond goes). Redirects
//    and the slot map name nodes by IP address (as Redis Cluster announces them); a
//    host name there is refused (a miss, counted), so no name lookup runs outside the
//    seeds, whose names resolve within connect_timeout.
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
  // A resolve and connect (AUTH/SELECT included) that takes longer fails.
  std::chrono::milliseconds connect_timeout{500};
  // The deadline of one call per pipeline_bytes of values (see above): every connect,
  // write and read of the call, not each read on its own.
  std::chrono::milliseconds command_timeout{1000};
  // The reply bytes one round trip may buffer, and the largest value put or got: a
  // bulk reply declaring more fails the round trip (reply_too_large) before it is read;
  // a put of a larger value is not stored. Above the largest record (a 2 MiB block is
  // a record of 2 MiB and a few hundred bytes).
  std::size_t max_reply_bytes = std::size_t{64} << 20;
  // Connections kept to nodes other than the seeds (cluster redirects, slot map).
  std::size_t max_links = 64;
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

// What went wrong in a Redis tier's round trip, counted per kind (redis_faults) and named
// at the start of kv_store_stats::last_error ("deadline: 127.0.0.1:6379: ...").
enum class redis_fault : std::uint8_t {
  connect,           // the name did not resolve, the connect or AUTH/SELECT failed
  deadline,          // no complete answer within the call's deadline
  closed,            // the server closed or reset the connection
  reply_too_large,   // a reply declared or buffered more than max_reply_bytes
  protocol,          // bytes that are not RESP, or bytes nobody asked for
  unexpected_reply,  // well-formed, but not what the command answers (SET: +OK only)
  error_reply,       // -OOM, -CLUSTERDOWN, -ERR, ... (the connection stays)
  redirect,          // a key redirected too often, or to a host name, or no link free
};
inline constexpr std::size_t redis_fault_kinds = 8;
// "deadline", "reply_too_large", ...
const char* redis_fault_name(redis_fault f) noexcept;

struct redis_fault_counts {
  std::uint64_t count[redis_fault_kinds] = {};
  std::size_t links = 0;  // connections the store keeps now (connected or not)
  std::uint64_t of(redis_fault f) const noexcept { return count[static_cast<std::size_t>(f)]; }
  std::uint64_t total() const noexcept {
    std::uint64_t t = 0;
    for (auto c : count) t += c;
    return t;
  }
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

// The faults a store made by make_redis_store counted so far, per kind. Throws
// gpumem::invalid_argument for another store.
redis_fault_counts redis_faults(const kv_store& store);

// The Redis Cluster hash slot of a key: CRC16 (XMODEM) of the key, or of the part between
// the first '{' and the next '}' when that part is not empty, modulo 16384.
std::uint16_t redis_key_slot(std::string_view key) noexcept;

}  // namespace gpumem
