#include "redis_link.hpp"

#include <limits.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

// Commands go out by writev straight from the callers' buffers (a 2 MiB value is not
// copied into a client buffer first), and replies come in through large reads fed to
// hiredis's protocol reader; the socket's timeouts (SO_SNDTIMEO/SO_RCVTIMEO, set at
// connect) bound every call.
bool redis_link::run(const std::vector<redis_command>& commands,
                     std::vector<redis_reply>& replies) {
  replies.clear();
  if (!ready()) return false;
  // RESP framing: "*<argc>\r\n" then "$<len>\r\n<arg>\r\n" per argument.
  std::string framing;
  framing.reserve(commands.size() * 64);
  struct piece {
    bool own;           // framing[offset, offset + len) or the argument's own bytes
    std::size_t offset;
    const char* data;
    std::size_t len;
  };
  std::vector<piece> pieces;
  pieces.reserve(commands.size() * 8);
  auto add_framing = [&](const std::string& text) {
    if (!pieces.empty() && pieces.back().own) {
      pieces.back().len += text.size();
    } else {
      pieces.push_back({true, framing.size(), nullptr, text.size()});
    }
    framing += text;
  };
  for (const redis_command& cmd : commands) {
    add_framing("*" + std::to_string(cmd.size()) + "\r\n");
    for (std::string_view a : cmd) {
      add_framing("$" + std::to_string(a.size()) + "\r\n");
      if (a.size() <= 256) {
        framing.append(a.data(), a.size());
        pieces.back().len += a.size();
      } else {
        pieces.push_back({false, 0, a.data(), a.size()});
      }
      add_framing("\r\n");
    }
  }
  std::vector<iovec> iov;
  iov.reserve(pieces.size());
  for (const piece& p : pieces)
    iov.push_back({const_cast<char*>(p.own ? framing.data() + p.offset : p.data), p.len});
  std::size_t first = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min<std::size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n = ::writev(ctx_->fd, iov.data() + first, count);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(errno == EAGAIN || errno == EWOULDBLOCK ? "timed out writing"
                                                   : std::string("write: ") + std::strerror(errno));
      return false;
    }
    auto left = static_cast<std::size_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  std::vector<char> buf(std::size_t{1} << 20);
  while (replies.size() < commands.size()) {
    void* r = nullptr;
    if (redisReaderGetReply(ctx_->reader, &r) != REDIS_OK) {
      fail("protocol error");
      return false;
    }
    if (r != nullptr) {
      replies.emplace_back(static_cast<redisReply*>(r));
      continue;
    }
    const ssize_t n = ::read(ctx_->fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      fail(n == 0 ? "connection closed by the server"
           : errno == EAGAIN || errno == EWOULDBLOCK
               ? "timed out (no reply within the command timeout)"
               : std::string("read: ") + std::strerror(errno));
      return false;
    }
    if (redisReaderFeed(ctx_->reader, buf.data(), static_cast<std::size_t>(n)) != REDIS_OK) {
      fail("protocol error");
      return false;
    }
  }
  health_.connection_ok();
  return true;
}

}  // namespace gpumem::detail
