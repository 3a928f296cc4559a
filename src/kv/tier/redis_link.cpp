#include "redis_link.hpp"

#include <sys/time.h>

#include <algorithm>
#include <iostream>

namespace gpumem::detail {

namespace {
timeval to_timeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}
}  // namespace

void redis_health::say(const std::string& line) {
  if (report_) {
    try {
      report_(line);
    } catch (...) {
      // A reporter that throws must not reach the decode loop.
    }
    return;
  }
  std::cerr << line << std::endl;
}

void redis_health::connection_failed(const std::string& what) {
  ++errors;
  last_error = what;
  if (in_outage_) return;
  in_outage_ = true;
  errors_at_outage_ = errors - 1;
  say("gpumem: kv tier " + name_ + ": " + what +
      "; its blocks are misses (served from the GPU) until it is back; retrying with backoff");
}

void redis_health::connection_ok() {
  if (!in_outage_) return;
  in_outage_ = false;
  say("gpumem: kv tier " + name_ + ": back after " + std::to_string(errors - errors_at_outage_) +
      " error(s)");
}

void redis_health::error_reply(std::string_view message) {
  ++errors;
  last_error = std::string(message);
  const std::string kind(message.substr(0, message.find(' ')));
  if (std::find(reported_kinds_.begin(), reported_kinds_.end(), kind) != reported_kinds_.end())
    return;
  reported_kinds_.push_back(kind);
  say("gpumem: kv tier " + name_ + ": the server answered '" + std::string(message) +
      "'; those blocks are not stored or are misses (reported once, counted each time)");
}

void redis_link::close() noexcept {
  if (ctx_ != nullptr) redisFree(ctx_);
  ctx_ = nullptr;
}

void redis_link::fail(const std::string& what) {
  close();
  health_.connection_failed(address() + ": " + what);
  failed_since_connect_ = true;
  next_attempt_ = std::chrono::steady_clock::now() + backoff_;
  backoff_ = std::min(backoff_ * 2, options_.backoff_max);
}

bool redis_link::ready() {
  if (ctx_ != nullptr) return true;
  if (std::chrono::steady_clock::now() < next_attempt_) return false;
  redisContext* c = redisConnectWithTimeout(endpoint_.host.c_str(), endpoint_.port,
                                            to_timeval(options_.connect_timeout));
  if (c == nullptr) {
    fail("cannot allocate a hiredis context");
    return false;
  }
  if (c->err != 0) {
    const std::string why = c->errstr;
    redisFree(c);
    fail("connect: " + why);
    return false;
  }
  if (redisSetTimeout(c, to_timeval(options_.command_timeout)) != REDIS_OK) {
    const std::string why = c->errstr;
    redisFree(c);
    fail("set timeout: " + why);
    return false;
  }
  ctx_ = c;
  if (ever_connected_ && failed_since_connect_) ++health_.reconnects;
  ever_connected_ = true;
  failed_since_connect_ = false;
  backoff_ = options_.backoff_min;
  return true;
}

bool redis_link::run(const std::vector<redis_command>& commands,
                     std::vector<redis_reply>& replies) {
  replies.clear();
  if (!ready()) return false;
  std::vector<const char*> argv;
  std::vector<std::size_t> lens;
  for (const redis_command& cmd : commands) {
    argv.clear();
    lens.clear();
    for (std::string_view a : cmd) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    if (redisAppendCommandArgv(ctx_, static_cast<int>(argv.size()), argv.data(), lens.data()) !=
        REDIS_OK) {
      fail(std::string("append: ") + ctx_->errstr);
      return false;
    }
  }
  for (std::size_t i = 0; i < commands.size(); ++i) {
    void* r = nullptr;
    if (redisGetReply(ctx_, &r) != REDIS_OK || r == nullptr) {
      const std::string why = ctx_->err != 0 ? ctx_->errstr : "no reply";
      fail(why == "Resource temporarily unavailable" ? "timed out (" + why + ")" : why);
      return false;
    }
    replies.emplace_back(static_cast<redisReply*>(r));
  }
  health_.connection_ok();
  return true;
}

}  // namespace gpumem::detail
