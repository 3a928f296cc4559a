#include "redis_link.hpp"

#include <limits.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
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

// AUTH and SELECT on a fresh connection, as the options ask; "" when it is ready for
// commands, else what went wrong (never the password).
std::string redis_link::introduce(redisContext* c) const {
  const auto ask = [c](std::vector<std::string_view> args, const char* what) -> std::string {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (auto a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    redis_reply r(static_cast<redisReply*>(
        redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data())));
    if (!r) return std::string(what) + ": " + (c->err != 0 ? c->errstr : "no reply");
    if (r->type == REDIS_REPLY_ERROR) return std::string(what) + ": " + std::string(r->str, r->len);
    return {};
  };
  if (!options_.password.empty()) {
    auto why = options_.username.empty()
                   ? ask({"AUTH", options_.password}, "AUTH")
                   : ask({"AUTH", options_.username, options_.password}, "AUTH");
    if (!why.empty()) return why;
  }
  if (options_.database != 0) {
    const std::string db = std::to_string(options_.database);
    if (auto why = ask({"SELECT", db}, "SELECT"); !why.empty()) return why;
  }
  return {};
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
  if (auto why = introduce(c); !why.empty()) {
    redisFree(c);
    fail(why);
    return false;
  }
  ctx_ = c;
  if (ever_connected_ && failed_since_connect_) ++health_.reconnects;
  ever_connected_ = true;
  failed_since_connect_ = false;
  backoff_ = options_.backoff_min;
  return true;
}

namespace {

// RESP framing of a pipeline ("*<argc>\r\n" then "$<len>\r\n<arg>\r\n" per argument) as
// writev pieces: the framing text and short arguments in `framing`, each long argument
// (over 256 bytes) as a piece of its own, pointing at the caller's bytes.
// `iov` points into `framing`: neither changes until the pipeline is written.
void frame_pipeline(const std::vector<redis_command>& commands, std::string& framing,
                    std::vector<iovec>& iov) {
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
  iov.reserve(pieces.size());
  for (const piece& p : pieces)
    iov.push_back({const_cast<char*>(p.own ? framing.data() + p.offset : p.data), p.len});
}

}  // namespace

// Commands go out by writev straight from the callers' buffers (a 2 MiB value is not
// copied into a client buffer first), and replies come in through large reads fed to
// hiredis's protocol reader; the socket's timeouts (SO_SNDTIMEO/SO_RCVTIMEO, set at
// connect) bound every call.
bool redis_link::run(const std::vector<redis_command>& commands,
                     std::vector<redis_reply>& replies,
                     std::span<const std::span<std::byte>> into) {
  replies.clear();
  if (!ready()) return false;
  std::string framing;
  std::vector<iovec> iov;
  frame_pipeline(commands, framing, iov);
  if (!write_all(iov)) return false;
  if (!into.empty()) {
    if (!read_simple_replies(commands.size(), replies, into)) return false;
  } else if (!read_replies(commands.size(), replies)) {
    return false;
  }
  health_.connection_ok();
  return true;
}

bool redis_link::write_all(std::vector<iovec>& iov) {
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
  return true;
}

bool redis_link::read_replies(std::size_t count, std::vector<redis_reply>& replies) {
  std::vector<char> buf(std::size_t{1} << 20);
  while (replies.size() < count) {
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
  return true;
}

namespace {

// Replies allocated as hiredis allocates them (malloc/calloc; freeReplyObject frees).
redisReply* new_reply(int type) {
  auto* r = static_cast<redisReply*>(std::calloc(1, sizeof(redisReply)));
  if (r != nullptr) r->type = type;
  return r;
}

// Buffered reads from the socket, with bulk payloads read straight into their target.
class socket_reader {
 public:
  explicit socket_reader(int fd) : fd_(fd), buf_(std::size_t{1} << 20) {}
  const std::string& error() const { return error_; }
  // One CRLF-terminated line, without the CRLF.
  bool line(std::string& out) {
    for (;;) {
      for (std::size_t i = pos_; i + 1 < end_; ++i)
        if (buf_[i] == '\r' && buf_[i + 1] == '\n') {
          out.assign(buf_.data() + pos_, i - pos_);
          pos_ = i + 2;
          return true;
        }
      if (!fill()) return false;
    }
  }
  // n bytes into dst (nullptr: dropped).
  bool bytes(char* dst, std::size_t n) {
    const std::size_t have = std::min(n, end_ - pos_);
    if (dst != nullptr) std::memcpy(dst, buf_.data() + pos_, have);
    pos_ += have;
    n -= have;
    if (dst != nullptr) dst += have;
    while (n > 0) {
      if (dst == nullptr || n < buf_.size() / 4) {  // small rests go through the buffer
        if (!fill()) return false;
        const std::size_t take = std::min(n, end_ - pos_);
        if (dst != nullptr) std::memcpy(dst, buf_.data() + pos_, take);
        pos_ += take;
        n -= take;
        if (dst != nullptr) dst += take;
        continue;
      }
      const ssize_t r = ::read(fd_, dst, n);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return failed(r);
      dst += r;
      n -= static_cast<std::size_t>(r);
    }
    return true;
  }

 private:
  bool fill() {
    if (pos_ == end_) pos_ = end_ = 0;
    if (end_ == buf_.size()) {
      std::memmove(buf_.data(), buf_.data() + pos_, end_ - pos_);
      end_ -= pos_;
      pos_ = 0;
    }
    for (;;) {
      const ssize_t r = ::read(fd_, buf_.data() + end_, buf_.size() - end_);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return failed(r);
      end_ += static_cast<std::size_t>(r);
      return true;
    }
  }
  bool failed(ssize_t r) {
    error_ = r == 0 ? "connection closed by the server"
             : errno == EAGAIN || errno == EWOULDBLOCK
                 ? "timed out (no reply within the command timeout)"
                 : std::string("read: ") + std::strerror(errno);
    return false;
  }
  int fd_;
  std::vector<char> buf_;
  std::size_t pos_ = 0, end_ = 0;
  std::string error_;
};

}  // namespace

bool redis_link::read_simple_replies(std::size_t count, std::vector<redis_reply>& replies,
                                     std::span<const std::span<std::byte>> into) {
  socket_reader in(ctx_->fd);
  std::string head;
  for (std::size_t i = 0; i < count; ++i) {
    if (!in.line(head)) {
      fail(in.error());
      return false;
    }
    if (head.empty()) {
      fail("protocol error (an empty reply line)");
      return false;
    }
    const char kind = head[0];
    const std::string rest = head.substr(1);
    redisReply* r = nullptr;
    if (kind == '+' || kind == '-') {
      r = new_reply(kind == '+' ? REDIS_REPLY_STATUS : REDIS_REPLY_ERROR);
      if (r != nullptr) {
        r->str = static_cast<char*>(std::malloc(rest.size() + 1));
        if (r->str != nullptr) std::memcpy(r->str, rest.c_str(), rest.size() + 1);
        r->len = r->str != nullptr ? rest.size() : 0;
      }
    } else if (kind == ':') {
      r = new_reply(REDIS_REPLY_INTEGER);
      if (r != nullptr) r->integer = std::atoll(rest.c_str());
    } else if (kind == '$') {
      const long long n = std::atoll(rest.c_str());
      if (n < 0) {
        r = new_reply(REDIS_REPLY_NIL);
      } else {
        const auto len = static_cast<std::size_t>(n);
        r = new_reply(REDIS_REPLY_STRING);
        if (r == nullptr) {
          fail("out of memory for a reply");
          return false;
        }
        r->len = len;
        const std::span<std::byte> target = i < into.size() ? into[i] : std::span<std::byte>{};
        char* dst = nullptr;
        if (!target.empty() && target.size() == len) {
          dst = reinterpret_cast<char*>(target.data());
        } else if (target.empty()) {
          r->str = static_cast<char*>(std::malloc(len + 1));
          if (r->str != nullptr) r->str[len] = '\0';
          dst = r->str;
        }
        if (!in.bytes(dst, len) || !in.bytes(nullptr, 2)) {
          freeReplyObject(r);
          fail(in.error());
          return false;
        }
      }
    } else {
      fail(std::string("protocol error (an unexpected reply type '") + kind + "')");
      return false;
    }
    if (r == nullptr) {
      fail("out of memory for a reply");
      return false;
    }
    replies.emplace_back(r);
  }
  return true;
}

}  // namespace gpumem::detail
