// Real redis-server processes for the KV tier tests: each on a free loopback port, in a
// temporary folder of its own, stopped (and the folder removed) when the object goes.
// Nothing else is assumed to run. Tests skip, saying why, when redis-server or
// redis-cli is not installed or the build has no Redis tier.
#pragma once

#include <gtest/gtest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpumem/kv/tier/redis_store.hpp"

extern char** environ;

namespace gpumem_test {

inline std::string find_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  std::size_t start = 0;
  while (start <= p.size()) {
    const std::size_t end = p.find(':', start);
    const std::string dir = p.substr(start, end == std::string::npos ? std::string::npos : end - start);
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return {};
}

// Why Redis tests cannot run here ("" when they can).
inline std::string redis_unavailable() {
  if (!gpumem::redis_tier_available())
    return "this build has no Redis tier (hiredis not found at build time)";
  if (find_program("redis-server").empty()) return "redis-server is not installed";
  if (find_program("redis-cli").empty()) return "redis-cli is not installed";
  return {};
}

#define GPUMEM_REQUIRE_REDIS()                                         \
  do {                                                                 \
    if (auto why = ::gpumem_test::redis_unavailable(); !why.empty())   \
      GTEST_SKIP() << why;                                             \
  } while (0)

// Binds `port` on loopback (0: any) and returns the port bound, 0 when it is taken.
inline int bind_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  socklen_t len = sizeof a;
  int bound = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    bound = ntohs(a.sin_port);
  ::close(fd);
  return bound;
}

// A free loopback port whose cluster bus port (port + 10000) is free too.
inline int free_loopback_port() {
  for (int i = 0; i < 100; ++i) {
    const int p = bind_loopback(0);
    if (p > 0 && p + 10000 < 65536 && bind_loopback(p + 10000) != 0) return p;
  }
  return bind_loopback(0);
}

// Runs a program, waits, returns its standard output.
inline std::string run_output(const std::vector<std::string>& args) {
  std::string cmd;
  for (const auto& a : args) cmd += "'" + a + "' ";
  cmd += "2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> f(::popen(cmd.c_str(), "r"), ::pclose);
  std::string out;
  if (!f) return out;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f.get())) > 0) out.append(buf, n);
  return out;
}

class redis_server {
 public:
  // extra: more redis-server arguments ("--maxmemory", "2mb", ...).
  // A "--requirepass", "PASSWORD" pair in extra: redis-cli here authenticates with it.
  explicit redis_server(std::vector<std::string> extra = {}, int port = 0)
      : extra_(std::move(extra)), port_(port != 0 ? port : free_loopback_port()) {
    for (std::size_t i = 0; i + 1 < extra_.size(); ++i)
      if (extra_[i] == "--requirepass") password_ = extra_[i + 1];
    char tmpl[] = "/tmp/gpumem-redis-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    start();
  }
  ~redis_server() {
    stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  redis_server(const redis_server&) = delete;
  redis_server& operator=(const redis_server&) = delete;

  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  bool running() const { return pid_ > 0; }

  void start() {
    std::vector<std::string> args{"redis-server", "--port", std::to_string(port_), "--bind",
                                  "127.0.0.1", "--dir", dir_, "--save", "", "--appendonly",
                                  "no", "--daemonize", "no", "--logfile", dir_ + "/redis.log",
                                  "--enable-debug-command", "local"};
    args.insert(args.end(), extra_.begin(), extra_.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string exe = find_program("redis-server");
    pid_t pid = 0;
    if (::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
      ADD_FAILURE() << "cannot start redis-server";
      return;
    }
    pid_ = pid;
    for (int i = 0; i < 200; ++i) {
      if (cli({"PING"}).find("PONG") != std::string::npos) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ADD_FAILURE() << "redis-server on port " << port_ << " did not answer PING";
  }
  // SIGTERM (a clean stop) or SIGKILL (a crash).
  void stop(bool kill_hard = false) {
    if (pid_ <= 0) return;
    ::kill(pid_, kill_hard ? SIGKILL : SIGTERM);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = 0;
  }
  // redis-cli against this server.
  std::string cli(std::vector<std::string> args) const {
    std::vector<std::string> full{find_program("redis-cli"), "-h", "127.0.0.1", "-p",
                                  std::to_string(port_)};
    if (!password_.empty()) full.insert(full.end(), {"--no-auth-warning", "-a", password_});
    full.insert(full.end(), args.begin(), args.end());
    return run_output(full);
  }
  // Runs a redis-cli command in the background (e.g. DEBUG SLEEP) and returns at once.
  void cli_async(std::vector<std::string> args) const {
    std::vector<std::string> full{"redis-cli", "-h", "127.0.0.1", "-p", std::to_string(port_)};
    if (!password_.empty()) full.insert(full.end(), {"--no-auth-warning", "-a", password_});
    full.insert(full.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : full) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    const std::string exe = find_program("redis-cli");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    if (::posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv.data(), environ) == 0)
      background_.push_back(pid);
    posix_spawn_file_actions_destroy(&fa);
  }
  void wait_background() {
    for (pid_t p : background_) {
      int st = 0;
      ::waitpid(p, &st, 0);
    }
    background_.clear();
  }

 private:
  std::vector<std::string> extra_;
  std::string password_;
  int port_;
  std::string dir_;
  pid_t pid_ = 0;
  mutable std::vector<pid_t> background_;
};

// A Redis Cluster of `n` masters (no replicas) on loopback; a node that dies leaves its
// slots uncovered while the others keep serving theirs (full coverage not required).
class redis_cluster {
 public:
  explicit redis_cluster(int n = 3) {
    for (int i = 0; i < n; ++i)
      nodes_.push_back(std::make_unique<redis_server>(std::vector<std::string>{
          "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
          "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"}));
    std::vector<std::string> create{find_program("redis-cli"), "--cluster", "create"};
    for (auto& s : nodes_) create.push_back(s->address());
    create.insert(create.end(), {"--cluster-replicas", "0", "--cluster-yes"});
    run_output(create);
    for (int i = 0; i < 250 && !ok(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!ok()) ADD_FAILURE() << "the cluster did not reach cluster_state:ok";
  }
  bool ok() const {
    for (auto& s : nodes_)
      if (s->running() && s->cli({"CLUSTER", "INFO"}).find("cluster_state:ok") == std::string::npos)
        return false;
    return true;
  }
  std::string url() const {
    std::string u = "redis-cluster://";
    for (std::size_t i = 0; i < nodes_.size(); ++i) u += (i ? "," : "") + nodes_[i]->address();
    return u;
  }
  redis_server& node(std::size_t i) { return *nodes_[i]; }
  std::size_t size() const { return nodes_.size(); }
  // The node id of node i.
  std::string id(std::size_t i) const {
    std::string out = nodes_[i]->cli({"CLUSTER", "MYID"});
    while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
    return out;
  }
  // Which node serves `slot` now, by node 0's view (CLUSTER NODES), or -1.
  int owner(std::uint16_t slot, std::size_t asked = 0) const {
    const std::string nodes = nodes_[asked]->cli({"CLUSTER", "NODES"});
    std::size_t pos = 0;
    while (pos < nodes.size()) {
      std::size_t end = nodes.find('\n', pos);
      if (end == std::string::npos) end = nodes.size();
      std::vector<std::string> f;
      std::size_t p = pos;
      while (p < end) {
        std::size_t sp = nodes.find(' ', p);
        if (sp == std::string::npos || sp > end) sp = end;
        f.push_back(nodes.substr(p, sp - p));
        p = sp + 1;
      }
      for (std::size_t k = 8; k < f.size(); ++k) {
        if (f[k].empty() || f[k][0] == '[') continue;
        const auto dash = f[k].find('-');
        const long lo = std::atol(f[k].substr(0, dash).c_str());
        const long hi = dash == std::string::npos ? lo : std::atol(f[k].substr(dash + 1).c_str());
        if (slot >= lo && slot <= hi)
          for (std::size_t i = 0; i < nodes_.size(); ++i)
            if (f.size() > 1 && f[1].rfind(nodes_[i]->address(), 0) == 0) return static_cast<int>(i);
      }
      pos = end + 1;
    }
    return -1;
  }

 private:
  std::vector<std::unique_ptr<redis_server>> nodes_;
};

}  // namespace gpumem_test
