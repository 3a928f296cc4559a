// redis_link: one hiredis connection to one Redis server, used by one thread at a time.
//
//  - run() writes a whole pipeline, then reads one reply per command. A failure of the
//    connection (refused, reset, timed out) closes it, arms a backoff (doubling from
//    backoff_min to backoff_max) and returns false; until the backoff expires, run()
//    returns false at once, so a dead server costs no time per call.
//  - Errors go to the store's redis_health: counted, reported once per outage.
#pragma once

#include <hiredis/hiredis.h>
#include <sys/uio.h>

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gpumem/kv/tier/redis_store.hpp"

namespace gpumem::detail {

struct reply_deleter {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};
using redis_reply = std::unique_ptr<redisReply, reply_deleter>;

// One command's arguments; the views must outlive the run() call.
using redis_command = std::vector<std::string_view>;

// A store's error accounting and its one-line reports.
class redis_health {
 public:
  redis_health(std::string name, std::function<void(const std::string&)> report)
      : name_(std::move(name)), report_(std::move(report)) {}
  // A connection-level failure: counted; reported when the store was healthy.
  void connection_failed(const std::string& what);
  // A round that worked: ends an outage (reported once).
  void connection_ok();
  // An error reply (OOM, CLUSTERDOWN, ...): counted; each kind reported once.
  void error_reply(std::string_view message);
  std::uint64_t errors = 0, reconnects = 0, redirects = 0;
  std::string last_error;

 private:
  void say(const std::string& line);
  std::string name_;
  std::function<void(const std::string&)> report_;
  bool in_outage_ = false;
  std::uint64_t errors_at_outage_ = 0;
  std::vector<std::string> reported_kinds_;
};

class redis_link {
 public:
  redis_link(redis_endpoint endpoint, const redis_store_options& options, redis_health& health)
      : endpoint_(std::move(endpoint)), options_(options), health_(health),
        backoff_(options.backoff_min) {}
  ~redis_link() { close(); }
  redis_link(const redis_link&) = delete;
  redis_link& operator=(const redis_link&) = delete;

  // Sends every command in one pipeline and reads every reply into `replies` (same
  // order). false when the connection failed (replies then holds those read before).
  // into (empty, or one span per command): a bulk-string reply to command i is read
  // straight from the socket into into[i] when its length is into[i].size(); its reply
  // is then a string with str == nullptr (of another length: skipped, str == nullptr, len
  // its length). With `into`, replies must be simple (no arrays).
  bool run(const std::vector<redis_command>& commands, std::vector<redis_reply>& replies,
           std::span<const std::span<std::byte>> into = {});
  // Connected now, or connectable (backoff expired and the connect worked).
  bool ready();
  bool connected() const noexcept { return ctx_ != nullptr; }
  const redis_endpoint& endpoint() const noexcept { return endpoint_; }
  std::string address() const { return endpoint_.host + ":" + std::to_string(endpoint_.port); }
  // Drops the connection without arming the backoff (the server asked us elsewhere).
  void close() noexcept;

 private:
  void fail(const std::string& what);
  std::string introduce(redisContext* c) const;
  // run()'s steps: the whole pipeline written (iov advanced as it goes), then `count`
  // replies read through hiredis's reader; false, after fail(), when the connection fails.
  bool write_all(std::vector<iovec>& iov);
  bool read_replies(std::size_t count, std::vector<redis_reply>& replies);
  // The replies of a pipeline with `into` buffers, parsed here (see run()).
  bool read_simple_replies(std::size_t count, std::vector<redis_reply>& replies,
                           std::span<const std::span<std::byte>> into);

  redis_endpoint endpoint_;
  const redis_store_options& options_;
  redis_health& health_;
  redisContext* ctx_ = nullptr;
  bool ever_connected_ = false, failed_since_connect_ = false;
  std::chrono::steady_clock::time_point next_attempt_{};
  std::chrono::milliseconds backoff_;
};

}  // namespace gpumem::detail
