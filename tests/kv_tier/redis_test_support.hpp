// What the Redis tier tests share beyond the servers (redis_server.hpp): store options with
// timeouts short enough for a test, the reports a store makes, the key a record is stored
// under, and batches of records put and read back through any store.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "gpumem/kv/tier/kv_record.hpp"
#include "gpumem/kv/tier/kv_store.hpp"
#include "gpumem/kv/tier/redis_store.hpp"
#include "kv_tier/tier_test_support.hpp"

namespace gpumem_test {

// The lines a store reported (its outages and recoveries), for tests that count them.
struct report_lines {
  std::mutex m;
  std::vector<std::string> lines;
  std::size_t count(const std::string& part) {
    std::lock_guard l(m);
    std::size_t n = 0;
    for (auto& s : lines) n += s.find(part) != std::string::npos;
    return n;
  }
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      std::lock_guard l(m);
      lines.push_back(line);
    };
  }
};

// Drops a report: for tests whose outages are expected and checked otherwise.
inline void drop_report(const std::string&) {}

// Connects in 200 ms, waits `command_timeout` per command, backs off 50-200 ms; reports
// go to `report` (empty: stderr, the store's default).
inline gpumem::redis_store_options fast_redis_options(
    std::chrono::milliseconds command_timeout,
    std::function<void(const std::string&)> report = {}) {
  using namespace std::chrono_literals;
  gpumem::redis_store_options o;
  o.connect_timeout = 200ms;
  o.command_timeout = command_timeout;
  o.backoff_min = 50ms;
  o.backoff_max = 200ms;
  if (report) o.report = std::move(report);
  return o;
}

// The Redis key the store keeps the record of `k` under.
inline std::string redis_key_name(const gpumem::kv_block_key& k) {
  char buf[80];
  std::snprintf(buf, sizeof buf, "gpumem:kv:%016llx:%016llx:%016llx",
                static_cast<unsigned long long>(k.space), static_cast<unsigned long long>(k.salt),
                static_cast<unsigned long long>(k.hash));
  return buf;
}

// Puts records of `payload` bytes (16 tokens) for hashes [first, first + n) of `salt`, each
// seeded by its hash, in one batch; returns how many were stored.
inline std::size_t put_records(gpumem::kv_store& s, std::size_t payload, std::uint64_t first,
                               std::size_t n, std::uint64_t salt = 0) {
  std::vector<gpumem::kv_block_key> keys;
  std::vector<std::vector<std::byte>> recs;
  for (std::size_t i = 0; i < n; ++i) {
    keys.push_back(key(first + i, salt));
    recs.push_back(make_record(keys.back(), payload, 0, 16, static_cast<unsigned>(first + i)));
  }
  std::vector<std::span<const std::byte>> vals(recs.begin(), recs.end());
  std::unique_ptr<bool[]> ok(new bool[n]);
  s.put(keys, vals, {ok.get(), n});
  std::size_t stored = 0;
  for (std::size_t i = 0; i < n; ++i) stored += ok[i];
  return stored;
}

// Gets hashes [first, first + n) of `salt` in one batch: their statuses; every hit's bytes
// are checked to be the ones put_records put.
inline std::vector<gpumem::kv_get_status> get_records(gpumem::kv_store& s, std::size_t payload,
                                                      std::uint64_t first, std::size_t n,
                                                      std::uint64_t salt = 0) {
  std::vector<gpumem::kv_block_key> keys;
  std::vector<std::vector<std::byte>> bufs(
      n, std::vector<std::byte>(gpumem::kv_record::size(16, payload)));
  for (std::size_t i = 0; i < n; ++i) keys.push_back(key(first + i, salt));
  std::vector<std::span<std::byte>> dst(bufs.begin(), bufs.end());
  std::vector<gpumem::kv_get_status> st(n, gpumem::kv_get_status::miss);
  s.get(keys, dst, st);
  for (std::size_t i = 0; i < n; ++i) {
    if (st[i] == gpumem::kv_get_status::hit) {
      EXPECT_EQ(bufs[i], make_record(keys[i], payload, 0, 16, static_cast<unsigned>(first + i)));
    }
  }
  return st;
}

inline std::size_t hits(const std::vector<gpumem::kv_get_status>& st) {
  return static_cast<std::size_t>(std::count(st.begin(), st.end(), gpumem::kv_get_status::hit));
}

}  // namespace gpumem_test
