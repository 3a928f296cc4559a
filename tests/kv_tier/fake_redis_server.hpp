// A Redis server that misbehaves on command, for the Redis tier's fault tests: one thread,
// listening on a free loopback port, answering RESP2. Well behaved it keeps SET/GET/EXISTS
// in a map, answers ASKING/AUTH/SELECT with +OK and CLUSTER SLOTS with one range (every
// slot) on its own port. behave() sets how it answers the data commands (SET, GET, EXISTS)
// from then on; the other commands stay well behaved. It counts what a test checks: the
// connections the client keeps open, and the bytes of a huge reply it streamed before the
// client hung up.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace gpumem_test {

enum class misbehaviour {
  none,              // a Redis server
  wrong_type,        // a reply of a type the command never answers with (nothing done)
  corrupt_value,     // GET: a value of random bytes; SET/EXISTS: as wrong_type
  other_key_value,   // GET: the value of another key (nothing done otherwise)
  huge_bulk,         // "$25769803776" and bytes streamed until the client hangs up
  huge_array,        // "*2000000000" and ":1" streamed until the client hangs up
  drip,              // the right answer (done), one byte per drip_interval
  moved,             // "-MOVED <slot> 127.0.0.1:<a port opened for it>" (nothing done)
  ask,               // "-ASK <slot> 127.0.0.1:<a port opened for it>" (nothing done)
  moved_to_name,     // "-MOVED <slot> redis.invalid:6379"
  reset_mid_reply,   // half the right answer (done), then a TCP reset
  garbage,           // random bytes that are not RESP, then CRLF
  silence,           // no answer, the connection kept open
  extra_reply,       // the right answer (done), then a reply nobody asked for
  close,             // the connection closed, no answer
};
inline constexpr int misbehaviour_kinds = 15;

class fake_redis_server {
 public:
  explicit fake_redis_server(std::uint64_t seed = 1) : rng_(seed) {
    port_ = listen_on();
    if (::pipe(wake_) != 0) wake_[0] = wake_[1] = -1;
    thread_ = std::thread([this] { serve(); });
  }
  ~fake_redis_server() {
    stop_ = true;
    if (wake_[1] >= 0) (void)!::write(wake_[1], "x", 1);
    thread_.join();
    for (auto& c : conns_) ::close(c.fd);
    for (auto& l : listeners_) ::close(l.fd);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }
  fake_redis_server(const fake_redis_server&) = delete;
  fake_redis_server& operator=(const fake_redis_server&) = delete;

  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  std::string cluster_url() const { return "redis-cluster://127.0.0.1:" + std::to_string(port_); }

  void behave(misbehaviour m) {
    std::lock_guard l(m_);
    mode_ = m;
  }
  // A dripped answer's pace, and the bytes after which a huge reply stops.
  void set_drip_interval(std::chrono::milliseconds d) {
    std::lock_guard l(m_);
    drip_interval_ = d;
  }
  void set_stream_limit(std::size_t bytes) {
    std::lock_guard l(m_);
    stream_limit_ = bytes;
  }

  // Connections accepted and not yet closed by the client.
  std::size_t open_connections() {
    std::lock_guard l(m_);
    return open_;
  }
  // The most bytes of one huge reply sent before the client hung up (or the limit).
  std::size_t most_streamed() {
    std::lock_guard l(m_);
    return most_streamed_;
  }
  // Ports opened for redirects so far.
  std::size_t redirect_ports() {
    std::lock_guard l(m_);
    return listeners_.size() - 1;
  }
  bool holds(const std::string& key) {
    std::lock_guard l(m_);
    return data_.count(key) != 0;
  }

 private:
  struct listener {
    int fd;
    int port;
  };
  struct connection {
    int fd;
    std::string in, out;
    bool drip = false, reset_after = false, close_after = false;
    std::chrono::steady_clock::time_point next_drip{};
    std::size_t stream_left = 0, streamed = 0;
    std::string stream_unit;
  };

  int listen_on() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(fd, 64);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ::fcntl(fd, F_SETFL, O_NONBLOCK);
    const int port = ntohs(a.sin_port);
    listeners_.push_back({fd, port});
    return port;
  }

  static std::string bulk(const std::string& s) {
    return "$" + std::to_string(s.size()) + "\r\n" + s + "\r\n";
  }

  // One whole command off the front of `in` ("*N\r\n$len\r\narg\r\n..."); false when it
  // is not all there yet.
  static bool take_command(std::string& in, std::vector<std::string>& args) {
    args.clear();
    std::size_t pos = 0;
    auto line = [&](std::string& out) {
      const auto e = in.find("\r\n", pos);
      if (e == std::string::npos) return false;
      out = in.substr(pos, e - pos);
      pos = e + 2;
      return true;
    };
    std::string head;
    if (!line(head) || head.empty() || head[0] != '*') return false;
    const long n = std::atol(head.c_str() + 1);
    for (long i = 0; i < n; ++i) {
      std::string len;
      if (!line(len)) return false;
      const auto size = static_cast<std::size_t>(std::atol(len.c_str() + 1));
      if (in.size() < pos + size + 2) return false;
      args.push_back(in.substr(pos, size));
      pos += size + 2;
    }
    in.erase(0, pos);
    return true;
  }

  // The right answer, done (the map changed).
  std::string execute(const std::vector<std::string>& a) {
    const std::string& cmd = a[0];
    if (cmd == "SET" && a.size() >= 3) {
      data_[a[1]] = a[2];
      return "+OK\r\n";
    }
    if (cmd == "GET" && a.size() == 2) {
      const auto it = data_.find(a[1]);
      return it == data_.end() ? "$-1\r\n" : bulk(it->second);
    }
    if (cmd == "EXISTS" && a.size() == 2) return data_.count(a[1]) != 0 ? ":1\r\n" : ":0\r\n";
    if (cmd == "ASKING" || cmd == "AUTH" || cmd == "SELECT") return "+OK\r\n";
    if (cmd == "CLUSTER" && a.size() == 2 && a[1] == "SLOTS")
      return "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n" + bulk("127.0.0.1") + ":" +
             std::to_string(port_) + "\r\n";
    return "-ERR unknown command '" + cmd + "'\r\n";
  }

  std::string random_bytes(std::size_t n) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng_() & 0xff);
    return s;
  }

  std::string wrong_type(const std::string& cmd) {
    // Never the type `cmd` answers with: SET +OK, GET a string or nil, EXISTS an integer.
    std::vector<std::string> choices{"*2\r\n:1\r\n:2\r\n", "*-1\r\n", "*0\r\n"};
    if (cmd != "SET") choices.insert(choices.end(), {"+QUEUED\r\n", "+OK\r\n"});
    if (cmd == "SET") choices.insert(choices.end(), {"+QUEUED\r\n", "$-1\r\n", bulk("OK"), ":1\r\n"});
    if (cmd != "GET") choices.push_back(bulk(random_bytes(rng_() % 32)));
    if (cmd != "EXISTS") choices.insert(choices.end(), {":" + std::to_string(rng_() % 100) + "\r\n"});
    if (cmd == "EXISTS") choices.insert(choices.end(), {":7\r\n", ":-1\r\n", "$-1\r\n"});
    return choices[rng_() % choices.size()];
  }

  // The answer to one data command under `mode`; sets how `c` sends it.
  std::string answer(connection& c, const std::vector<std::string>& a, misbehaviour mode) {
    const std::string& cmd = a[0];
    const bool data_command = cmd == "SET" || cmd == "GET" || cmd == "EXISTS";
    if (!data_command || mode == misbehaviour::none) return execute(a);
    const std::size_t slot = rng_() % 16384;
    switch (mode) {
      case misbehaviour::none: break;
      case misbehaviour::wrong_type: return wrong_type(cmd);
      case misbehaviour::corrupt_value:
        return cmd == "GET" ? bulk(random_bytes(1 + rng_() % 2048)) : wrong_type(cmd);
      case misbehaviour::other_key_value: {
        if (cmd != "GET") return wrong_type(cmd);
        for (auto& [k, v] : data_)
          if (k != a[1]) return bulk(v);
        return bulk(random_bytes(64));
      }
      case misbehaviour::huge_bulk:
        c.stream_left = stream_limit_;
        c.stream_unit = std::string(64 << 10, 'x');
        return "$25769803776\r\n";
      case misbehaviour::huge_array:
        c.stream_left = stream_limit_;
        c.stream_unit.clear();
        for (int i = 0; i < (16 << 10); ++i) c.stream_unit += ":1\r\n";
        return "*2000000000\r\n";
      case misbehaviour::drip:
        c.drip = true;
        return execute(a);
      case misbehaviour::moved:
      case misbehaviour::ask:
        return std::string(mode == misbehaviour::moved ? "-MOVED " : "-ASK ") +
               std::to_string(slot) + " 127.0.0.1:" + std::to_string(listen_on()) + "\r\n";
      case misbehaviour::moved_to_name:
        return "-MOVED " + std::to_string(slot) + " redis.invalid:6379\r\n";
      case misbehaviour::reset_mid_reply: {
        const std::string full = execute(a);
        c.reset_after = true;
        return full.substr(0, std::max<std::size_t>(1, full.size() / 2));
      }
      case misbehaviour::garbage: {
        std::string g = random_bytes(1 + rng_() % 64);
        g[0] = "!@#%^&?~"[rng_() % 8];  // no RESP type byte
        return g + "\r\n";
      }
      case misbehaviour::silence: return {};
      case misbehaviour::extra_reply: return execute(a) + "+OK\r\n";
      case misbehaviour::close: c.close_after = true; return {};
    }
    return execute(a);
  }

  void drop(std::size_t i, bool reset) {
    if (reset) {
      linger l{1, 0};
      ::setsockopt(conns_[i].fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    }
    if (conns_[i].streamed > most_streamed_) most_streamed_ = conns_[i].streamed;
    ::close(conns_[i].fd);
    conns_.erase(conns_.begin() + static_cast<long>(i));
    --open_;
  }

  void serve() {
    while (!stop_) {
      std::vector<pollfd> fds;
      std::unique_lock lock(m_);
      fds.push_back({wake_[0], POLLIN, 0});
      for (auto& l : listeners_) fds.push_back({l.fd, POLLIN, 0});
      const std::size_t first_conn = fds.size();
      const auto now = std::chrono::steady_clock::now();
      int wait_ms = 50;
      for (auto& c : conns_) {
        short ev = POLLIN;
        const bool paced = c.drip && !c.out.empty() && now < c.next_drip;
        if ((!c.out.empty() && !paced) || c.stream_left > 0) ev |= POLLOUT;
        if (paced) wait_ms = 1;
        fds.push_back({c.fd, ev, 0});
      }
      lock.unlock();
      ::poll(fds.data(), fds.size(), wait_ms);
      if (stop_) return;
      lock.lock();
      for (std::size_t i = 1; i < first_conn; ++i) {
        if ((fds[i].revents & POLLIN) == 0) continue;
        const int fd = ::accept(fds[i].fd, nullptr, nullptr);
        if (fd < 0) continue;
        ::fcntl(fd, F_SETFL, O_NONBLOCK);
        conns_.push_back({fd, {}, {}});
        ++open_;
      }
      // Connections accepted just now (at the end) are not in fds: those polled come first.
      for (std::size_t k = std::min(conns_.size(), fds.size() - first_conn); k-- > 0;) {
        pollfd& p = fds[first_conn + k];
        connection& c = conns_[k];
        if (p.fd != c.fd) continue;
        if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
          char buf[1 << 16];
          const ssize_t n = ::read(c.fd, buf, sizeof buf);
          if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
            drop(k, false);
            continue;
          }
          if (n > 0) c.in.append(buf, static_cast<std::size_t>(n));
          std::vector<std::string> args;
          while (!c.close_after && take_command(c.in, args) && !args.empty())
            c.out += answer(c, args, mode_);
          if (c.close_after) {
            drop(k, false);
            continue;
          }
        }
        if (!c.out.empty()) {
          const bool paced = c.drip;
          if (paced && std::chrono::steady_clock::now() < c.next_drip) continue;
          const std::size_t len = paced ? 1 : c.out.size();
          const ssize_t n = ::send(c.fd, c.out.data(), len, MSG_NOSIGNAL);
          if (n > 0) c.out.erase(0, static_cast<std::size_t>(n));
          if (paced) c.next_drip = std::chrono::steady_clock::now() + drip_interval_;
          if (c.out.empty()) c.drip = false;
          if (c.out.empty() && c.reset_after) {
            drop(k, true);
            continue;
          }
        } else if (c.stream_left > 0 && (p.revents & POLLOUT)) {
          const std::size_t len = std::min(c.stream_left, c.stream_unit.size());
          const ssize_t n = ::send(c.fd, c.stream_unit.data(), len, MSG_NOSIGNAL);
          if (n > 0) {
            c.stream_left -= static_cast<std::size_t>(n);
            c.streamed += static_cast<std::size_t>(n);
            if (c.streamed > most_streamed_) most_streamed_ = c.streamed;
          } else if (n < 0 && errno != EAGAIN) {
            drop(k, false);
            continue;
          }
        }
      }
      if (fds[0].revents & POLLIN) {
        char b[16];
        (void)!::read(wake_[0], b, sizeof b);
      }
    }
  }

  std::mutex m_;
  std::mt19937_64 rng_;
  misbehaviour mode_ = misbehaviour::none;
  std::chrono::milliseconds drip_interval_{2};
  std::size_t stream_limit_ = std::size_t{64} << 20;
  std::map<std::string, std::string> data_;
  std::vector<listener> listeners_;
  std::vector<connection> conns_;
  std::size_t open_ = 0, most_streamed_ = 0;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace gpumem_test
