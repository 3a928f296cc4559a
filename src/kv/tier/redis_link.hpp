// redis_link: one hiredis connection to one Redis server, used by one thread at a time.
//
//  - run() writes a whole pipeline, then reads one reply per command, all before the
//    caller's deadline: the socket is non-blocking and every wait is a poll() for the
//    time left, so a server that drips bytes costs the deadline, not a timeout per read.
//  - The replies of a round trip buffer at most options.max_reply_bytes: a bulk reply
//    declaring more fails as soon as its header is read, a reply built of many parts
//    fails when its parts pass the bound, before hiredis allocates them.
//  - A failure of the connection (refused, reset, deadline, reply too large, bytes that
//    are not RESP or that nobody asked for) closes it, arms a backoff (doubling from
//    backoff_min to backoff_max) and returns false; until the backoff expires, run()
//    returns false at once, so a dead server costs no time per call.
//  - A host name resolves on a helper thread waited for at most until the connect
//    deadline; IP addresses connect without a lookup.
//  - Errors go to the store's redis_health: counted by kind, reported once per outage.
#pragma once

#include <hiredis/hiredis.h>
#include <sys/uio.h>

#include <array>
#include <chrono>
#include <functional>
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

using steady_time = std::chrono::steady_clock::time_point;

// A store's error accounting and its one-line reports.
class redis_health {
 public:
  redis_health(std::string name, std::function<void(const std::string&)> report)
      : name_(std::move(name)), report_(std::move(report)) {}
  // A connection-level failure: counted; reported when the store was healthy.
  void connection_failed(redis_fault kind, const std::string& what);
  // A round that worked: ends an outage (reported once).
  void connection_ok();
  // An error reply (OOM, CLUSTERDOWN, ...): counted; each kind reported once.
  void error_reply(std::string_view message);
  // A fault of one key or call (a redirect refused, a value over the reply bound):
  // counted; each kind reported once.
  void key_fault(redis_fault kind, const std::string& what);
  std::uint64_t errors = 0, reconnects = 0, redirects = 0;
  std::array<std::uint64_t, redis_fault_kinds> faults{};
  std::string last_error;

 private:
  void say(const std::string& line);
  void count(redis_fault kind, const std::string& what);
  // Says `line` unless a line of `kind` was said before.
  void say_once(const std::string& kind, const std::string& line);
  std::string name_;
  std::function<void(const std::string&)> report_;
  bool in_outage_ = false;
  std::uint64_t errors_at_outage_ = 0;
  std::vector<std::string> reported_kinds_;
};

// A host name lookup on its helper thread (redis_link.cpp).
struct resolution;

class redis_link {
 public:
  redis_link(redis_endpoint endpoint, const redis_store_options& options, redis_health& health)
      : endpoint_(std::move(endpoint)), options_(options), health_(health),
        backoff_(options.backoff_min) {}
  ~redis_link() { close(); }
  redis_link(const redis_link&) = delete;
  redis_link& operator=(const redis_link&) = delete;

  // Sends every command in one pipeline and reads every reply into `replies` (same
  // order), connecting first when needed, all before `deadline`. false when the
  // connection failed (replies then holds those read before).
  // into (empty, or one span per command): a bulk-string reply to command i is read
  // straight from the socket into into[i] when its length is into[i].size(); its reply
  // is then a string with str == nullptr (of another length: skipped, str == nullptr, len
  // its length). With `into`, replies must be simple (no arrays).
  bool run(const std::vector<redis_command>& commands, std::vector<redis_reply>& replies,
           steady_time deadline, std::span<const std::span<std::byte>> into = {});
  // Connected now, or connectable before `deadline` (backoff expired, the connect and
  // AUTH/SELECT worked within connect_timeout).
  bool ready(steady_time deadline);
  bool connected() const noexcept { return ctx_ != nullptr; }
  const redis_endpoint& endpoint() const noexcept { return endpoint_; }
  std::string address() const { return endpoint_.host + ":" + std::to_string(endpoint_.port); }
  // Drops the connection without arming the backoff (the server asked us elsewhere).
  void close() noexcept;
  // Drops the connection as failed (a reply the caller cannot use): counted as `kind`,
  // backoff armed.
  void fail(redis_fault kind, const std::string& what);

  // The reply bytes this round trip may still buffer (hiredis's reader draws on it).
  struct reply_budget {
    std::size_t left = 0;
    std::size_t refused = 0;  // the size of the part that did not fit (0: none)
  };

 private:
  // "" when ctx_ is ready for commands (AUTH and SELECT answered +OK), else why not.
  std::string introduce(steady_time deadline, redis_fault& kind);
  // A numeric address for the endpoint before `deadline`; false with `why` otherwise.
  bool resolve(steady_time deadline, std::string& ip, std::string& why);
  // One round trip on the connection: the pipeline written, `count` replies read.
  bool exchange(const std::vector<redis_command>& commands, std::vector<redis_reply>& replies,
                steady_time deadline, std::span<const std::span<std::byte>> into);
  // exchange()'s steps: the whole pipeline written (iov advanced as it goes), then `count`
  // replies read through hiredis's reader; false, after fail(), when the connection fails.
  bool write_all(std::vector<iovec>& iov, steady_time deadline);
  bool read_replies(std::size_t count, std::vector<redis_reply>& replies, steady_time deadline);
  // The replies of a pipeline with `into` buffers, parsed here (see run()).
  bool read_simple_replies(std::size_t count, std::vector<redis_reply>& replies,
                           std::span<const std::span<std::byte>> into, steady_time deadline);
  // A connection that is readable before anything was asked (closed by the server while
  // idle, or bytes nobody asked for) is dropped; true when it was.
  bool drop_if_stale();

  redis_endpoint endpoint_;
  const redis_store_options& options_;
  redis_health& health_;
  redisContext* ctx_ = nullptr;
  reply_budget budget_;
  std::string resolved_;                 // the endpoint's address, while it connects
  std::shared_ptr<resolution> resolving_;  // a lookup still running
  bool ever_connected_ = false, failed_since_connect_ = false;
  std::chrono::steady_clock::time_point next_attempt_{};
  std::chrono::milliseconds backoff_;
};

}  // namespace gpumem::detail
