#include "redis_link.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include <algorithm>
#include <iostream>

namespace gpumem::detail {

using std::chrono::steady_clock;

namespace {

std::chrono::milliseconds left_until(steady_time deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - steady_clock::now());
  return std::max(left, std::chrono::milliseconds{0});
}

timeval to_timeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

enum class wait_result { ready, deadline, error };

// Waits until `fd` is ready for `events` (or has hung up: the next read or write says
// so), or the deadline passes.
wait_result wait_fd(int fd, short events, steady_time deadline) {
  for (;;) {
    const auto left = left_until(deadline);
    if (left.count() <= 0) return wait_result::deadline;
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), INT_MAX)));
    if (r > 0) return wait_result::ready;
    if (r < 0 && errno != EINTR) return wait_result::error;
  }
}

bool numeric_address(const std::string& host) {
  in6_addr a6{};
  in_addr a4{};
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

// The reader's replies, built by hiredis's own functions once the round trip's budget
// (the reader's privdata) admits them: a part that does not fit is refused (hiredis
// then stops with an out-of-memory error, which read_replies names reply_too_large).
const redisReplyObjectFunctions* hiredis_functions() {
  static const redisReplyObjectFunctions* fn = [] {
    redisReader* r = redisReaderCreate();
    const redisReplyObjectFunctions* f = r->fn;  // hiredis's static defaults
    redisReaderFree(r);
    return f;
  }();
  return fn;
}

bool take(const redisReadTask* task, std::size_t bytes) {
  auto* budget = static_cast<redis_link::reply_budget*>(task->privdata);
  if (budget == nullptr) return true;
  bytes += sizeof(redisReply);
  if (bytes > budget->left) {
    budget->refused = bytes;
    return false;
  }
  budget->left -= bytes;
  return true;
}

void* capped_string(const redisReadTask* task, char* str, std::size_t len) {
  return take(task, len + 1) ? hiredis_functions()->createString(task, str, len) : nullptr;
}
void* capped_array(const redisReadTask* task, int elements) {
  const std::size_t n = elements > 0 ? static_cast<std::size_t>(elements) : 0;
  return take(task, n * sizeof(redisReply*)) ? hiredis_functions()->createArray(task, elements)
                                             : nullptr;
}
void* capped_integer(const redisReadTask* task, long long value) {
  return take(task, 0) ? hiredis_functions()->createInteger(task, value) : nullptr;
}
void* capped_nil(const redisReadTask* task) {
  return take(task, 0) ? hiredis_functions()->createNil(task) : nullptr;
}
void free_reply(void* reply) { hiredis_functions()->freeObject(reply); }

redisReplyObjectFunctions capped_functions{capped_string, capped_array, capped_integer,
                                           capped_nil, free_reply};

// The length a bulk reply ("$<n>\r\n") at the start of `text` declares; -1 when `text`
// does not start with a complete bulk header.
long long declared_bulk(const char* text, std::size_t size) {
  if (size < 4 || text[0] != '$') return -1;
  long long n = 0;
  for (std::size_t i = 1; i < size && i < 24; ++i) {
    if (text[i] == '\r') return i > 1 ? n : -1;
    if (text[i] < '0' || text[i] > '9') return -1;
    n = n * 10 + (text[i] - '0');
  }
  return -1;
}

}  // namespace

struct resolution {
  std::mutex m;
  std::condition_variable done_cv;
  bool done = false;
  std::string ip, error;
};

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

void redis_health::count(redis_fault kind, const std::string& what) {
  ++errors;
  ++faults[static_cast<std::size_t>(kind)];
  last_error = std::string(redis_fault_name(kind)) + ": " + what;
}

void redis_health::say_once(const std::string& kind, const std::string& line) {
  if (std::find(reported_kinds_.begin(), reported_kinds_.end(), kind) != reported_kinds_.end())
    return;
  reported_kinds_.push_back(kind);
  say(line);
}

void redis_health::connection_failed(redis_fault kind, const std::string& what) {
  count(kind, what);
  if (in_outage_) return;
  in_outage_ = true;
  errors_at_outage_ = errors - 1;
  say("gpumem: kv tier " + name_ + ": " + last_error +
      "; its blocks are misses (served from the GPU) until it is back; retrying with backoff");
}

void redis_health::connection_ok() {
  if (!in_outage_) return;
  in_outage_ = false;
  say("gpumem: kv tier " + name_ + ": back after " + std::to_string(errors - errors_at_outage_) +
      " error(s)");
}

void redis_health::error_reply(std::string_view message) {
  count(redis_fault::error_reply, std::string(message));
  last_error = std::string(message);
  say_once(std::string(message.substr(0, message.find(' '))),
           "gpumem: kv tier " + name_ + ": the server answered '" + std::string(message) +
               "'; those blocks are not stored or are misses (reported once, counted each time)");
}

void redis_health::key_fault(redis_fault kind, const std::string& what) {
  count(kind, what);
  say_once(redis_fault_name(kind), "gpumem: kv tier " + name_ + ": " + last_error +
                                       "; those blocks are not stored or are misses (reported "
                                       "once, counted each time)");
}

void redis_link::close() noexcept {
  if (ctx_ != nullptr) redisFree(ctx_);
  ctx_ = nullptr;
}

void redis_link::fail(redis_fault kind, const std::string& what) {
  close();
  resolved_.clear();  // the name is looked up again: the server may have moved
  health_.connection_failed(kind, address() + ": " + what);
  failed_since_connect_ = true;
  next_attempt_ = steady_clock::now() + backoff_;
  backoff_ = std::min(backoff_ * 2, options_.backoff_max);
}

bool redis_link::resolve(steady_time deadline, std::string& ip, std::string& why) {
  if (numeric_address(endpoint_.host)) {
    ip = endpoint_.host;
    return true;
  }
  if (!resolved_.empty()) {
    ip = resolved_;
    return true;
  }
  if (!resolving_) {
    // The lookup may outlive this link (getaddrinfo cannot be cancelled): it owns what
    // it writes, and a late answer is kept for the next attempt.
    auto r = std::make_shared<resolution>();
    try {
      std::thread([r, host = endpoint_.host] {
        addrinfo hints{};
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        addrinfo* found = nullptr;
        std::string ip_text, error;
        const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
        if (rc != 0 || found == nullptr) {
          error = rc != 0 ? ::gai_strerror(rc) : "no address";
        } else {
          char text[INET6_ADDRSTRLEN] = {};
          const void* addr =
              found->ai_family == AF_INET6
                  ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(found->ai_addr)->sin6_addr)
                  : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr);
          if (::inet_ntop(found->ai_family, addr, text, sizeof text) != nullptr) ip_text = text;
          else error = "no printable address";
        }
        if (found != nullptr) ::freeaddrinfo(found);
        std::lock_guard lock(r->m);
        r->ip = std::move(ip_text);
        r->error = std::move(error);
        r->done = true;
        r->done_cv.notify_all();
      }).detach();
    } catch (const std::system_error& e) {
      why = std::string("resolve ") + endpoint_.host + ": " + e.what();
      return false;
    }
    resolving_ = std::move(r);
  }
  std::unique_lock lock(resolving_->m);
  if (!resolving_->done_cv.wait_until(lock, deadline, [&] { return resolving_->done; })) {
    why = "resolve " + endpoint_.host + ": no answer within the connect timeout";
    return false;
  }
  const std::shared_ptr<resolution> r = std::move(resolving_);
  lock.unlock();
  if (r->ip.empty()) {
    why = "resolve " + endpoint_.host + ": " + r->error;
    return false;
  }
  ip = resolved_ = r->ip;
  return true;
}

// AUTH and SELECT on a fresh connection, as the options ask; "" when it is ready for
// commands, else what went wrong (never the password).
std::string redis_link::introduce(steady_time deadline, redis_fault& kind) {
  std::vector<redis_command> cmds;
  std::vector<const char*> what;
  const std::string db = std::to_string(options_.database);
  if (!options_.password.empty()) {
    cmds.push_back(options_.username.empty()
                       ? redis_command{"AUTH", options_.password}
                       : redis_command{"AUTH", options_.username, options_.password});
    what.push_back("AUTH");
  }
  if (options_.database != 0) {
    cmds.push_back({"SELECT", db});
    what.push_back("SELECT");
  }
  if (cmds.empty()) return {};
  std::vector<redis_reply> replies;
  if (!exchange(cmds, replies, deadline, {})) {
    kind = redis_fault::connect;
    return std::string(what[replies.size() < what.size() ? replies.size() : 0]) + ": no answer";
  }
  for (std::size_t i = 0; i < replies.size(); ++i) {
    const redisReply* r = replies[i].get();
    if (r->type == REDIS_REPLY_ERROR) {
      kind = redis_fault::connect;
      return std::string(what[i]) + ": " + std::string(r->str, r->len);
    }
    if (r->type != REDIS_REPLY_STATUS || std::string_view(r->str, r->len) != "OK") {
      kind = redis_fault::unexpected_reply;
      return std::string(what[i]) + ": an answer other than +OK";
    }
  }
  return {};
}

bool redis_link::ready(steady_time deadline) {
  if (ctx_ != nullptr && !drop_if_stale()) return true;
  if (steady_clock::now() < next_attempt_) return false;
  const steady_time connect_by = std::min(deadline, steady_clock::now() + options_.connect_timeout);
  std::string ip, why;
  if (!resolve(connect_by, ip, why)) {
    fail(steady_clock::now() >= deadline ? redis_fault::deadline : redis_fault::connect, why);
    return false;
  }
  const auto left = left_until(connect_by);
  if (left.count() <= 0) {
    fail(redis_fault::deadline, "connect: no time left before the deadline");
    return false;
  }
  redisContext* c = redisConnectWithTimeout(ip.c_str(), endpoint_.port, to_timeval(left));
  if (c == nullptr) {
    fail(redis_fault::connect, "cannot allocate a hiredis context");
    return false;
  }
  if (c->err != 0) {
    const std::string text = c->errstr;
    redisFree(c);
    fail(redis_fault::connect, "connect: " + text);
    return false;
  }
  // Every wait is a poll() for the time left (wait_fd): the socket never blocks.
  const int flags = ::fcntl(c->fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(c->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    redisFree(c);
    fail(redis_fault::connect, std::string("fcntl: ") + std::strerror(errno));
    return false;
  }
  c->reader->fn = &capped_functions;
  c->reader->privdata = &budget_;
  ctx_ = c;
  redis_fault kind = redis_fault::connect;
  if (auto text = introduce(connect_by, kind); !text.empty()) {
    if (ctx_ != nullptr) fail(kind, text);  // exchange() failed it already otherwise
    return false;
  }
  if (ever_connected_ && failed_since_connect_) ++health_.reconnects;
  ever_connected_ = true;
  failed_since_connect_ = false;
  backoff_ = options_.backoff_min;
  return true;
}

bool redis_link::drop_if_stale() {
  pollfd p{ctx_->fd, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  char byte = 0;
  const ssize_t n = ::recv(ctx_->fd, &byte, 1, MSG_PEEK);
  if (n > 0) {
    // Replies are read to the last byte each round trip: these were never asked for.
    fail(redis_fault::protocol, "bytes nobody asked for arrived between round trips");
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  close();  // closed while idle (the server's idle timeout): connect again, no fault
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
// hiredis's protocol reader; every wait on the socket is for the deadline's time left.
bool redis_link::run(const std::vector<redis_command>& commands,
                     std::vector<redis_reply>& replies, steady_time deadline,
                     std::span<const std::span<std::byte>> into) {
  replies.clear();
  if (!ready(deadline)) return false;
  if (!exchange(commands, replies, deadline, into)) return false;
  health_.connection_ok();
  return true;
}

bool redis_link::exchange(const std::vector<redis_command>& commands,
                          std::vector<redis_reply>& replies, steady_time deadline,
                          std::span<const std::span<std::byte>> into) {
  std::string framing;
  std::vector<iovec> iov;
  frame_pipeline(commands, framing, iov);
  if (!write_all(iov, deadline)) return false;
  budget_.left = options_.max_reply_bytes;
  budget_.refused = 0;
  if (!into.empty()) return read_simple_replies(commands.size(), replies, into, deadline);
  return read_replies(commands.size(), replies, deadline);
}

namespace {

std::string timed_out(const redis_store_options& o, const char* doing) {
  return std::string("timed out ") + doing + " (the call's deadline passed; command_timeout " +
         std::to_string(o.command_timeout.count()) + " ms)";
}

std::string too_large(std::size_t bytes, const redis_store_options& o) {
  return "a reply of " + std::to_string(bytes) + " bytes or more is over max_reply_bytes (" +
         std::to_string(o.max_reply_bytes) + ")";
}

}  // namespace

bool redis_link::write_all(std::vector<iovec>& iov, steady_time deadline) {
  std::size_t first = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min<std::size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n = ::writev(ctx_->fd, iov.data() + first, count);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        const wait_result w = wait_fd(ctx_->fd, POLLOUT, deadline);
        if (w == wait_result::ready) continue;
        fail(w == wait_result::deadline ? redis_fault::deadline : redis_fault::closed,
             w == wait_result::deadline ? timed_out(options_, "writing")
                                        : std::string("poll: ") + std::strerror(errno));
        return false;
      }
      fail(redis_fault::closed, std::string("write: ") + std::strerror(errno));
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

namespace {

// Reads what the socket has (waiting for it until the deadline): > 0 bytes read, else
// 0 with `kind` and `why` set.
std::size_t read_some(int fd, char* dst, std::size_t n, steady_time deadline,
                      const redis_store_options& o, redis_fault& kind, std::string& why) {
  for (;;) {
    const ssize_t r = ::read(fd, dst, n);
    if (r > 0) return static_cast<std::size_t>(r);
    if (r == 0) {
      kind = redis_fault::closed;
      why = "connection closed by the server";
      return 0;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      kind = redis_fault::closed;
      why = std::string("read: ") + std::strerror(errno);
      return 0;
    }
    const wait_result w = wait_fd(fd, POLLIN, deadline);
    if (w == wait_result::ready) continue;
    kind = w == wait_result::deadline ? redis_fault::deadline : redis_fault::closed;
    why = w == wait_result::deadline ? timed_out(o, "reading the replies")
                                     : std::string("poll: ") + std::strerror(errno);
    return 0;
  }
}

}  // namespace

bool redis_link::read_replies(std::size_t count, std::vector<redis_reply>& replies,
                              steady_time deadline) {
  // Replies read this way are small (statuses, integers, the slot map): reads of 64 KiB
  // keep the buffered bytes within one read of the budget.
  std::vector<char> buf(std::size_t{64} << 10);
  redisReader* reader = ctx_->reader;
  while (replies.size() < count) {
    void* r = nullptr;
    if (redisReaderGetReply(reader, &r) != REDIS_OK) {
      if (budget_.refused != 0) fail(redis_fault::reply_too_large, too_large(budget_.refused, options_));
      else fail(redis_fault::protocol, std::string("protocol error: ") + reader->errstr);
      return false;
    }
    if (r != nullptr) {
      replies.emplace_back(static_cast<redisReply*>(r));
      continue;
    }
    // The reply is incomplete: its bytes wait in the reader's buffer. They, and a bulk
    // length declared at the head of what waits, must fit the budget before more is read.
    const std::size_t waiting = reader->len - reader->pos;
    const long long declared =
        reader->buf != nullptr ? declared_bulk(reader->buf + reader->pos, waiting) : -1;
    if (waiting > budget_.left ||
        (declared >= 0 && static_cast<unsigned long long>(declared) > budget_.left)) {
      fail(redis_fault::reply_too_large,
           too_large(std::max<std::size_t>(waiting, declared > 0 ? static_cast<std::size_t>(declared) : 0),
                     options_));
      return false;
    }
    redis_fault kind{};
    std::string why;
    const std::size_t n = read_some(ctx_->fd, buf.data(), buf.size(), deadline, options_, kind, why);
    if (n == 0) {
      fail(kind, why);
      return false;
    }
    if (redisReaderFeed(reader, buf.data(), n) != REDIS_OK) {
      fail(redis_fault::protocol, "protocol error");
      return false;
    }
  }
  if (reader->len > reader->pos) {
    fail(redis_fault::protocol, "bytes after the last reply");
    return false;
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

// A status or error reply holding `text`.
redisReply* line_reply(int type, std::string_view text) {
  redisReply* r = new_reply(type);
  if (r == nullptr) return nullptr;
  r->str = static_cast<char*>(std::malloc(text.size() + 1));
  if (r->str != nullptr) {
    std::memcpy(r->str, text.data(), text.size());
    r->str[text.size()] = '\0';
  }
  r->len = r->str != nullptr ? text.size() : 0;
  return r;
}

std::string unknown_type(char kind) {
  char shown[8];
  std::snprintf(shown, sizeof shown, std::isprint(static_cast<unsigned char>(kind)) != 0 ? "%c" : "\\x%02x",
                static_cast<unsigned char>(kind));
  return std::string("protocol error (an unknown reply type '") + shown + "')";
}

// Buffered reads from the socket, with bulk payloads read straight into their target;
// every wait ends at the deadline.
class socket_reader {
 public:
  socket_reader(int fd, steady_time deadline, const redis_store_options& o)
      : fd_(fd), deadline_(deadline), options_(o), buf_(std::size_t{1} << 20) {}
  const std::string& error() const { return error_; }
  redis_fault fault() const { return fault_; }
  bool drained() const { return pos_ == end_; }
  // One CRLF-terminated line, without the CRLF.
  bool line(std::string& out) {
    std::size_t scanned = 0;  // unread bytes already searched (fill() keeps them in order)
    for (;;) {
      for (std::size_t i = pos_ + scanned; i + 1 < end_; ++i)
        if (buf_[i] == '\r' && buf_[i + 1] == '\n') {
          out.assign(buf_.data() + pos_, i - pos_);
          pos_ = i + 2;
          return true;
        }
      if (pos_ == 0 && end_ == buf_.size()) {
        fault_ = redis_fault::protocol;
        error_ = "a reply line longer than " + std::to_string(buf_.size()) + " bytes";
        return false;
      }
      scanned = end_ - pos_ > 0 ? end_ - pos_ - 1 : 0;
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
      const std::size_t r = read_some(fd_, dst, n, deadline_, options_, fault_, error_);
      if (r == 0) return false;
      dst += r;
      n -= r;
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
    const std::size_t r =
        read_some(fd_, buf_.data() + end_, buf_.size() - end_, deadline_, options_, fault_, error_);
    end_ += r;
    return r > 0;
  }
  int fd_;
  steady_time deadline_;
  const redis_store_options& options_;
  std::vector<char> buf_;
  std::size_t pos_ = 0, end_ = 0;
  redis_fault fault_ = redis_fault::protocol;
  std::string error_;
};

// A whole decimal number (an optional '-' first), or false.
bool whole_number(std::string_view text, long long& out) {
  if (text.empty() || text.size() > 20) return false;
  char* end = nullptr;
  const std::string s(text);
  errno = 0;
  out = std::strtoll(s.c_str(), &end, 10);
  return errno == 0 && end == s.c_str() + s.size() && (std::isdigit(static_cast<unsigned char>(s.back())) != 0);
}

// Why read_bulk returned null.
struct bulk_failure {
  redis_fault fault = redis_fault::protocol;
  std::string text;
};

// The body of a bulk reply of `len` declared bytes and its CRLF. A value read into its
// target (exactly its size) buffers nothing; any other is refused over the bound before a
// byte of it is read (a declared 24 GB never reaches malloc), and its buffer is charged to
// `budget_left`. Null with `why` set on failure.
redisReply* read_bulk(socket_reader& in, std::size_t len, std::span<std::byte> target,
                      const redis_store_options& options, std::size_t& budget_left,
                      bulk_failure& why) {
  const bool direct = !target.empty() && target.size() == len;
  if (len > options.max_reply_bytes || (!direct && len + 1 > budget_left)) {
    why = {redis_fault::reply_too_large, too_large(len, options)};
    return nullptr;
  }
  redisReply* r = new_reply(REDIS_REPLY_STRING);
  if (r == nullptr) {
    why = {redis_fault::reply_too_large, "out of memory for a reply"};
    return nullptr;
  }
  r->len = len;
  char* dst = nullptr;
  if (direct) {
    dst = reinterpret_cast<char*>(target.data());
  } else if (target.empty()) {
    budget_left -= len + 1;
    r->str = static_cast<char*>(std::malloc(len + 1));
    if (r->str != nullptr) r->str[len] = '\0';
    dst = r->str;
  }
  std::string crlf(2, '\0');
  if (!in.bytes(dst, len) || !in.bytes(crlf.data(), 2)) {
    freeReplyObject(r);
    why = {in.fault(), in.error()};
    return nullptr;
  }
  if (crlf != "\r\n") {
    freeReplyObject(r);
    why = {redis_fault::protocol, "protocol error (a bulk reply not ended by CRLF)"};
    return nullptr;
  }
  return r;
}

}  // namespace

bool redis_link::read_simple_replies(std::size_t count, std::vector<redis_reply>& replies,
                                     std::span<const std::span<std::byte>> into,
                                     steady_time deadline) {
  socket_reader in(ctx_->fd, deadline, options_);
  std::string head;
  for (std::size_t i = 0; i < count; ++i) {
    if (!in.line(head)) {
      fail(in.fault(), in.error());
      return false;
    }
    if (head.empty()) {
      fail(redis_fault::protocol, "protocol error (an empty reply line)");
      return false;
    }
    const char kind = head[0];
    const std::string_view rest = std::string_view(head).substr(1);
    redisReply* r = nullptr;
    if (kind == '+' || kind == '-') {
      if (rest.size() + sizeof(redisReply) > budget_.left) {
        fail(redis_fault::reply_too_large, too_large(rest.size(), options_));
        return false;
      }
      budget_.left -= rest.size() + sizeof(redisReply);
      r = line_reply(kind == '+' ? REDIS_REPLY_STATUS : REDIS_REPLY_ERROR, rest);
    } else if (kind == ':') {
      long long v = 0;
      if (!whole_number(rest, v)) {
        fail(redis_fault::protocol, "protocol error (an integer reply that is no number)");
        return false;
      }
      r = new_reply(REDIS_REPLY_INTEGER);
      if (r != nullptr) r->integer = v;
    } else if (kind == '$') {
      long long n = 0;
      if (!whole_number(rest, n) || n < -1) {
        fail(redis_fault::protocol, "protocol error (a bulk length that is no length)");
        return false;
      }
      if (n == -1) {
        r = new_reply(REDIS_REPLY_NIL);
      } else {
        bulk_failure why;
        r = read_bulk(in, static_cast<std::size_t>(n),
                      i < into.size() ? into[i] : std::span<std::byte>{}, options_,
                      budget_.left, why);
        if (r == nullptr) {
          fail(why.fault, why.text);
          return false;
        }
      }
    } else if (kind == '*') {
      fail(redis_fault::unexpected_reply, "an array where a value, status or number was asked");
      return false;
    } else {
      fail(redis_fault::protocol, unknown_type(kind));
      return false;
    }
    if (r == nullptr) {
      fail(redis_fault::reply_too_large, "out of memory for a reply");
      return false;
    }
    replies.emplace_back(r);
  }
  if (!in.drained()) {
    fail(redis_fault::protocol, "bytes after the last reply");
    return false;
  }
  return true;
}

}  // namespace gpumem::detail
