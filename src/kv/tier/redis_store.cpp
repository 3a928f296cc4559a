// The Redis tier: one server, or a Redis Cluster routed by hash slot (redis_store.hpp).
#include "gpumem/kv/tier/redis_store.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

#include "gpumem/errors.hpp"
#include "gpumem/kv/tier/kv_record.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "redis_link.hpp"

namespace gpumem {

bool redis_tier_available() noexcept { return true; }

namespace {

using detail::redis_command;
using detail::redis_link;
using detail::redis_reply;
using detail::steady_time;
using std::chrono::steady_clock;

constexpr std::size_t slot_count = 16384;
constexpr int max_rounds = 4;  // a key followed through at most 3 redirects

std::string hex(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool is_error(const redis_reply& r) { return r && r->type == REDIS_REPLY_ERROR; }

bool is_redirect(const redis_reply& r) {
  if (!is_error(r)) return false;
  const std::string_view msg(r->str, r->len);
  return msg.starts_with("ASK ") || msg.starts_with("MOVED ");
}

bool numeric_host(const std::string& host) {
  in_addr a4{};
  in6_addr a6{};
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}

// "MOVED 3999 127.0.0.1:6381" / "ASK 3999 127.0.0.1:6381" -> endpoint; false otherwise
// (a redirect that names no slot, no port, or a host name).
bool parse_redirect(std::string_view msg, bool& ask, std::size_t& slot, redis_endpoint& to) {
  ask = msg.starts_with("ASK ");
  if (!ask && !msg.starts_with("MOVED ")) return false;
  msg.remove_prefix(ask ? 4 : 6);
  const auto space = msg.find(' ');
  if (space == std::string_view::npos) return false;
  slot = static_cast<std::size_t>(std::strtoul(std::string(msg.substr(0, space)).c_str(), nullptr, 10));
  const std::string_view addr = msg.substr(space + 1);
  const auto colon = addr.rfind(':');
  if (colon == std::string_view::npos || slot >= slot_count) return false;
  to.host = std::string(addr.substr(0, colon));
  const std::string port(addr.substr(colon + 1));
  char* end = nullptr;
  const long p = std::strtol(port.c_str(), &end, 10);
  to.port = static_cast<int>(p);
  return !port.empty() && *end == '\0' && p > 0 && p < 65536 && numeric_host(to.host);
}

// The answers each command may give besides an error reply (its own check of the value
// follows in put/get/contains); anything else leaves the connection untrusted.
bool expected_reply(std::string_view command, const redisReply& r) {
  if (r.type == REDIS_REPLY_ERROR) return true;
  if (command == "SET" || command == "ASKING")
    return r.type == REDIS_REPLY_STATUS && std::string_view(r.str, r.len) == "OK";
  if (command == "GET") return r.type == REDIS_REPLY_STRING || r.type == REDIS_REPLY_NIL;
  if (command == "EXISTS") return r.type == REDIS_REPLY_INTEGER && (r.integer == 0 || r.integer == 1);
  return true;
}

std::string describe(const redisReply& r) {
  switch (r.type) {
    case REDIS_REPLY_STATUS: return "status '" + std::string(r.str, std::min<std::size_t>(r.len, 40)) + "'";
    case REDIS_REPLY_INTEGER: return "integer " + std::to_string(r.integer);
    case REDIS_REPLY_NIL: return "nil";
    case REDIS_REPLY_STRING: return "a string of " + std::to_string(r.len) + " bytes";
    case REDIS_REPLY_ARRAY: return "an array of " + std::to_string(r.elements);
    default: return "a reply of type " + std::to_string(r.type);
  }
}

class redis_kv_store final : public kv_store {
 public:
  redis_kv_store(std::string url, std::vector<redis_endpoint> seeds, bool cluster,
                 redis_store_options options)
      : url_(std::move(url)), cluster_(cluster), options_(std::move(options)),
        health_(url_, options_.report), slots_(slot_count, -1) {
    for (auto& e : seeds) link_for(e);
    seed_count_ = links_.size();
  }

  const detail::redis_health& health() const { return health_; }
  std::size_t link_count() const { return links_.size(); }
  std::mutex& mutex() const { return mutex_; }

  std::string name() const override { return url_; }
  bool is_local() const noexcept override { return false; }

  void put(std::span<const kv_block_key> keys, std::span<const std::span<const std::byte>> values,
           std::span<bool> stored, const spill_fn*) noexcept override {
    std::lock_guard lock(mutex_);
    try {
      std::vector<std::string> names = key_names(keys);
      std::vector<redis_reply> replies;
      execute(op::set, names, values, replies);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        const redis_reply& r = replies[i];
        stored[i] = r && r->type == REDIS_REPLY_STATUS;  // +OK: execute() checked the rest
        if (is_error(r)) health_.error_reply({r->str, r->len});
        if (stored[i]) {
          ++counters_.puts;
          counters_.put_bytes += values[i].size();
        } else {
          ++counters_.put_failures;
        }
      }
    } catch (...) {
      fail_all(stored);
    }
  }

  void get(std::span<const kv_block_key> keys, std::span<const std::span<std::byte>> dst,
           std::span<kv_get_status> out) noexcept override {
    std::lock_guard lock(mutex_);
    try {
      std::vector<std::string> names = key_names(keys);
      std::vector<redis_reply> replies;
      execute(op::get, names, {}, replies, dst);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        const redis_reply& r = replies[i];
        ++counters_.gets;
        kv_get_status st = kv_get_status::error;
        if (!r) {
          st = kv_get_status::error;
        } else if (r->type == REDIS_REPLY_NIL) {
          st = kv_get_status::miss;
        } else if (r->type == REDIS_REPLY_STRING) {
          if (r->len == dst[i].size() && dst[i].size() != 0) {
            // Read straight into dst by the link (str == nullptr), or copied here.
            if (r->str != nullptr) std::memcpy(dst[i].data(), r->str, r->len);
            st = kv_record::verify(dst[i], keys[i]) ? kv_get_status::hit : kv_get_status::corrupt;
          } else {
            st = kv_get_status::corrupt;  // truncated, or not a block of this layout
          }
        } else if (is_error(r)) {
          health_.error_reply({r->str, r->len});
        }
        out[i] = st;
        if (st == kv_get_status::hit) ++counters_.hits;
        else if (st == kv_get_status::corrupt) ++counters_.corrupt;
        else ++counters_.misses;
      }
    } catch (...) {
      for (auto& o : out) o = kv_get_status::error;
      ++health_.errors;
    }
  }

  void contains(std::span<const kv_block_key> keys, std::span<bool> out) noexcept override {
    std::lock_guard lock(mutex_);
    try {
      std::vector<std::string> names = key_names(keys);
      std::vector<redis_reply> replies;
      execute(op::exists, names, {}, replies);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        const redis_reply& r = replies[i];
        out[i] = r && r->type == REDIS_REPLY_INTEGER && r->integer == 1;
        if (is_error(r)) health_.error_reply({r->str, r->len});
      }
    } catch (...) {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = false;
      ++health_.errors;
    }
  }

  kv_store_stats stats() const override {
    std::lock_guard lock(mutex_);
    kv_store_stats s = counters_;
    s.errors = health_.errors;
    s.reconnects = health_.reconnects;
    s.redirects = health_.redirects;
    s.last_error = health_.last_error;
    return s;
  }

 private:
  enum class op { set, get, exists };
  struct pending {
    std::size_t index;
    std::size_t link;
    bool asking = false;
  };

  void fail_all(std::span<bool> stored) noexcept {
    for (std::size_t i = 0; i < stored.size(); ++i) stored[i] = false;
    counters_.put_failures += stored.size();
    ++health_.errors;
  }

  std::vector<std::string> key_names(std::span<const kv_block_key> keys) const {
    std::vector<std::string> names;
    names.reserve(keys.size());
    for (const auto& k : keys)
      names.push_back(options_.key_prefix + hex(k.space) + ":" + hex(k.salt) + ":" + hex(k.hash));
    return names;
  }

  // The link to `e`, made when there is none; -1 when the table is full of links this
  // call uses. Beyond the seeds, at most max_links links are kept: a new one takes the
  // place of the least recently used one that this call has not used (its slots are
  // forgotten, so the map is asked for again).
  long link_for(const redis_endpoint& e) {
    for (std::size_t i = 0; i < links_.size(); ++i)
      if (links_[i]->endpoint().host == e.host && links_[i]->endpoint().port == e.port) {
        used_[i] = call_;
        return static_cast<long>(i);
      }
    if (seed_count_ == 0 || links_.size() < seed_count_ + options_.max_links) {  // 0: seeding
      links_.push_back(std::make_unique<redis_link>(e, options_, health_));
      used_.push_back(call_);
      return static_cast<long>(links_.size() - 1);
    }
    std::size_t oldest = links_.size();
    for (std::size_t i = seed_count_; i < links_.size(); ++i)
      if (used_[i] != call_ && (oldest == links_.size() || used_[i] < used_[oldest])) oldest = i;
    if (oldest == links_.size()) return -1;
    links_[oldest] = std::make_unique<redis_link>(e, options_, health_);
    used_[oldest] = call_;
    for (long& owner : slots_)
      if (owner == static_cast<long>(oldest)) {
        owner = -1;
        slots_stale_ = true;
      }
    return static_cast<long>(oldest);
  }

  // The link serving `key`, or -1 when no node is known for its slot.
  long route(const std::string& key) {
    if (!cluster_) return 0;
    const long link = slots_[redis_key_slot(key)];
    if (link >= 0) used_[static_cast<std::size_t>(link)] = call_;
    return link;
  }

  // One range of a CLUSTER SLOTS reply -> [first, last] and its master; false when it is
  // not one (types, bounds, a host that is neither an address nor the node asked).
  static bool slot_range(const redisReply* range, const std::string& asked_host,
                         std::size_t& first, std::size_t& last, redis_endpoint& e) {
    if (range->type != REDIS_REPLY_ARRAY || range->elements < 3) return false;
    const redisReply* lo = range->element[0];
    const redisReply* hi = range->element[1];
    const redisReply* master = range->element[2];
    if (lo->type != REDIS_REPLY_INTEGER || hi->type != REDIS_REPLY_INTEGER || lo->integer < 0 ||
        hi->integer < lo->integer || hi->integer >= static_cast<long long>(slot_count))
      return false;
    if (master->type != REDIS_REPLY_ARRAY || master->elements < 2) return false;
    const redisReply* host = master->element[0];
    const redisReply* port = master->element[1];
    if (host->type != REDIS_REPLY_STRING || port->type != REDIS_REPLY_INTEGER ||
        port->integer <= 0 || port->integer > 65535)
      return false;
    const std::string_view name(host->str, host->len);
    e.host = name.empty() || name == "?" ? asked_host : std::string(name);
    if (e.host != asked_host && !numeric_host(e.host)) return false;
    e.port = static_cast<int>(port->integer);
    first = static_cast<std::size_t>(lo->integer);
    last = static_cast<std::size_t>(hi->integer);
    return true;
  }

  // Asks any reachable node for the slot map (CLUSTER SLOTS); at most once per
  // backoff_min while the map is stale, so a cluster that is down costs nothing per call.
  // A map with a range that is not one is not taken (unexpected_reply).
  void refresh_slots(steady_time deadline) {
    const auto now = steady_clock::now();
    if (!slots_stale_ || now < next_refresh_) return;
    next_refresh_ = now + options_.backoff_min;
    std::vector<redis_reply> replies;
    const std::vector<redis_command> cmd{{"CLUSTER", "SLOTS"}};
    for (std::size_t l = 0; l < links_.size() && steady_clock::now() < deadline; ++l) {
      if (!links_[l]->run(cmd, replies, deadline) || replies.empty()) continue;
      const redisReply* r = replies[0].get();
      if (r->type != REDIS_REPLY_ARRAY) {
        if (r->type == REDIS_REPLY_ERROR) health_.error_reply({r->str, r->len});
        else links_[l]->fail(redis_fault::unexpected_reply, "CLUSTER SLOTS answered " + describe(*r));
        continue;
      }
      const std::string asked_host = links_[l]->endpoint().host;
      std::vector<std::pair<std::size_t, std::size_t>> ranges;
      std::vector<redis_endpoint> masters;
      bool whole = true;
      for (std::size_t i = 0; i < r->elements && whole; ++i) {
        std::size_t first = 0, last = 0;
        redis_endpoint e;
        whole = slot_range(r->element[i], asked_host, first, last, e);
        ranges.emplace_back(first, last);
        masters.push_back(std::move(e));
      }
      if (!whole) {
        links_[l]->fail(redis_fault::unexpected_reply,
                        "CLUSTER SLOTS answered a range that is not one (types, bounds, or a "
                        "host name where nodes are named by address)");
        continue;
      }
      std::vector<long> fresh(slot_count, -1);
      for (std::size_t i = 0; i < ranges.size(); ++i) {
        const long link = link_for(masters[i]);
        if (link < 0) continue;  // no link free: those slots stay unknown (misses)
        for (std::size_t s = ranges[i].first; s <= ranges[i].second; ++s) fresh[s] = link;
      }
      slots_ = std::move(fresh);
      slots_stale_ = false;
      return;
    }
  }

  // Runs one command per key (values for SET) on the node owning each key, following
  // redirects; out[i] is the final reply, or null when the key's node could not answer
  // by the call's deadline (command_timeout per pipeline_bytes of values, at least one).
  void execute(op kind, const std::vector<std::string>& keys,
               std::span<const std::span<const std::byte>> values, std::vector<redis_reply>& out,
               std::span<const std::span<std::byte>> dst = {}) {
    out.clear();
    out.resize(keys.size());
    ++call_;
    std::size_t call_bytes = 0;
    for (std::size_t i = 0; i < keys.size(); ++i)
      call_bytes += kind == op::set ? values[i].size() : i < dst.size() ? dst[i].size() : 0;
    const std::size_t pipelines = std::max<std::size_t>(1, (call_bytes + options_.pipeline_bytes - 1) / options_.pipeline_bytes);
    const steady_time deadline =
        steady_clock::now() + options_.command_timeout * static_cast<long>(std::min<std::size_t>(pipelines, 1u << 20));
    if (cluster_) refresh_slots(deadline);
    std::vector<pending> todo;
    todo.reserve(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const std::size_t bytes = kind == op::set ? values[i].size() : i < dst.size() ? dst[i].size() : 0;
      if (bytes > options_.max_reply_bytes) {
        health_.key_fault(redis_fault::reply_too_large,
                          "a value of " + std::to_string(bytes) + " bytes is over max_reply_bytes (" +
                              std::to_string(options_.max_reply_bytes) + ")");
        continue;  // out[i] stays null: not stored, or an error
      }
      const long link = route(keys[i]);
      if (link >= 0) todo.push_back({i, static_cast<std::size_t>(link)});
      else ++health_.errors;  // no node known for its slot: a miss
    }
    const std::string ttl = std::to_string(options_.ttl_seconds);
    const char* verb = kind == op::set ? "SET" : kind == op::get ? "GET" : "EXISTS";
    bool late = false;  // the deadline passed before every round trip was made
    for (int round = 0; round < max_rounds && !todo.empty(); ++round) {
      std::map<std::size_t, std::vector<pending>> by_link;
      for (const pending& p : todo) by_link[p.link].push_back(p);
      todo.clear();
      bool moved = false;
      std::vector<pending> failed;  // their node did not answer
      for (auto& [link, ops] : by_link) {
        for (std::size_t first = 0; first < ops.size();) {
          // One pipeline of at most pipeline_bytes of values (one value at least).
          std::size_t last = first, bytes = 0;
          std::vector<redis_command> cmds;
          std::vector<long> which;  // per command: index into ops, -1 for ASKING
          std::vector<std::span<std::byte>> into;  // GET: where each value goes
          while (last < ops.size() && (last == first || bytes < options_.pipeline_bytes)) {
            const pending& p = ops[last];
            if (p.asking) {
              cmds.push_back({"ASKING"});
              which.push_back(-1);
              if (!dst.empty()) into.emplace_back();
            }
            const std::string& key = keys[p.index];
            if (kind == op::set) {
              const auto& v = values[p.index];
              cmds.push_back({"SET", key, {reinterpret_cast<const char*>(v.data()), v.size()}});
              if (options_.ttl_seconds != 0) {
                cmds.back().push_back("EX");
                cmds.back().push_back(ttl);
              }
              bytes += v.size();
            } else {
              cmds.push_back({verb, key});
              if (!dst.empty()) {
                into.push_back(dst[p.index]);
                bytes += dst[p.index].size();
              }
            }
            which.push_back(static_cast<long>(last));
            ++last;
          }
          std::vector<redis_reply> replies;
          if (steady_clock::now() < deadline) {
            links_[link]->run(cmds, replies, deadline, into);  // on failure: those read so far
          } else {
            late = true;
          }
          // The replies up to the first one its command does not answer with: that one
          // and those after it are failures (the connection is dropped as untrusted).
          for (std::size_t c = 0; c < replies.size(); ++c) {
            if (expected_reply(cmds[c][0], *replies[c])) continue;
            links_[link]->fail(redis_fault::unexpected_reply,
                               std::string(cmds[c][0]) + " answered " + describe(*replies[c]));
            replies.resize(c);
            break;
          }
          for (std::size_t c = 0; c < cmds.size(); ++c) {
            if (which[c] < 0) continue;
            const pending& p = ops[static_cast<std::size_t>(which[c])];
            if (c >= replies.size()) {
              failed.push_back(p);  // out[p.index] stays null (an error) unless rerouted
              continue;
            }
            redis_reply& r = replies[c];
            bool ask = false;
            std::size_t slot = 0;
            redis_endpoint to;
            if (cluster_ && is_redirect(r)) {
              const std::string msg(r->str, r->len);
              const long target = parse_redirect(msg, ask, slot, to) ? link_for(to) : -2;
              if (target < 0) {
                health_.key_fault(redis_fault::redirect,
                                  target == -2 ? "a redirect that names no node by address: '" +
                                                     msg.substr(0, 80) + "'"
                                               : "no link free for '" + msg.substr(0, 80) +
                                                     "' (max_links " +
                                                     std::to_string(options_.max_links) + ")");
                continue;
              }
              ++health_.redirects;
              if (!ask) {
                slots_[slot] = target;
                moved = true;
              }
              todo.push_back({p.index, static_cast<std::size_t>(target), ask});
              continue;
            }
            out[p.index] = std::move(r);
          }
          first = last;
        }
      }
      if (moved) slots_stale_ = true;  // one MOVED: more slots probably moved too
      if (cluster_ && !failed.empty() && steady_clock::now() < deadline) {
        // A node failed: ask the others for the map now; a key whose slot has another
        // owner (the node was removed, or failed over) is retried there.
        slots_stale_ = true;
        next_refresh_ = {};
        refresh_slots(deadline);
        for (const pending& p : failed) {
          const long link = route(keys[p.index]);
          if (link >= 0 && static_cast<std::size_t>(link) != p.link)
            todo.push_back({p.index, static_cast<std::size_t>(link)});
        }
      }
    }
    if (late)
      health_.key_fault(redis_fault::deadline,
                        "timed out: the call's deadline passed before every key was asked "
                        "(command_timeout " + std::to_string(options_.command_timeout.count()) + " ms)");
    if (!todo.empty())
      health_.key_fault(redis_fault::redirect,
                        std::to_string(todo.size()) + " key(s) redirected more than " +
                            std::to_string(max_rounds - 1) + " times");
  }

  std::string url_;
  bool cluster_;
  redis_store_options options_;
  mutable std::mutex mutex_;
  detail::redis_health health_;
  std::vector<std::unique_ptr<redis_link>> links_;
  std::vector<std::uint64_t> used_;  // per link: the last call that used it
  std::size_t seed_count_ = 0;       // links_[0, seed_count_) are the seeds, always kept
  std::uint64_t call_ = 0;           // calls to execute() so far
  std::vector<long> slots_;
  bool slots_stale_ = true;
  std::chrono::steady_clock::time_point next_refresh_{};
  kv_store_stats counters_{};
};

// "h:p,h:p" -> endpoints; throws invalid_argument.
std::vector<redis_endpoint> parse_endpoints(std::string_view list, std::string_view url) {
  std::vector<redis_endpoint> out;
  while (!list.empty()) {
    const auto comma = list.find(',');
    std::string_view item = list.substr(0, comma);
    list = comma == std::string_view::npos ? std::string_view{} : list.substr(comma + 1);
    const auto colon = item.rfind(':');
    redis_endpoint e;
    e.host = std::string(item.substr(0, colon));
    if (colon != std::string_view::npos) {
      const std::string port(item.substr(colon + 1));
      char* end = nullptr;
      const long v = std::strtol(port.c_str(), &end, 10);
      if (port.empty() || *end != '\0' || v <= 0 || v > 65535)
        throw invalid_argument("kv store URL '" + std::string(url) + "': bad port '" + port + "'");
      e.port = static_cast<int>(v);
    }
    if (e.host.empty())
      throw invalid_argument("kv store URL '" + std::string(url) + "': a host is missing");
    out.push_back(std::move(e));
  }
  if (out.empty())
    throw invalid_argument("kv store URL '" + std::string(url) + "': no host:port given");
  return out;
}

// Percent-decodes a URL's user or password; throws invalid_argument on a bad escape.
std::string percent_decoded(std::string_view text, std::string_view url) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '%') {
      out.push_back(text[i]);
      continue;
    }
    const auto hex = [](char ch) {
      return ch >= '0' && ch <= '9'   ? ch - '0'
             : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
             : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10
                                      : -1;
    };
    if (i + 2 >= text.size())
      throw invalid_argument("kv store URL '" + std::string(url) + "': a '%' escape is cut short");
    const int hi = hex(text[i + 1]), lo = hex(text[i + 2]);
    if (hi < 0 || lo < 0)
      throw invalid_argument("kv store URL '" + std::string(url) + "': a '%' escape is not two hex digits");
    out.push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return out;
}

// A whole number in [lo, hi] from a URL option's value; throws invalid_argument naming it.
std::uint64_t url_whole(const std::string& value, std::string_view key, std::uint64_t lo,
                        std::uint64_t hi, const std::string& url) {
  const bool digits = !value.empty() && value.size() <= 19 &&
                      value.find_first_not_of("0123456789") == std::string::npos;
  const std::uint64_t v = digits ? std::stoull(value) : 0;
  if (!digits || v < lo || v > hi)
    throw invalid_argument("kv store URL '" + url + "': " + std::string(key) + "='" + value +
                           "' is not a whole number in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "]");
  return v;
}

// The options a URL's query (?KEY=VALUE&...) sets; each key at most once. Throws
// invalid_argument naming the key and, for an unknown one, the keys there are.
void apply_url_options(std::string_view query, const std::string& url, redis_store_options& o) {
  constexpr std::uint64_t hour_ms = 3'600'000;
  std::vector<std::string> seen;
  // Every '&' separates two items, so "a=1&" has an empty second item, refused.
  for (bool more = !query.empty(); more;) {
    const auto amp = query.find('&');
    const std::string_view item = query.substr(0, amp);
    more = amp != std::string_view::npos;
    query = more ? query.substr(amp + 1) : std::string_view{};
    const auto eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0)
      throw invalid_argument("kv store URL '" + url + "': option '" + std::string(item) +
                             "' is not KEY=VALUE");
    const std::string key(item.substr(0, eq));
    const std::string value = percent_decoded(item.substr(eq + 1), url);
    if (std::find(seen.begin(), seen.end(), key) != seen.end())
      throw invalid_argument("kv store URL '" + url + "': option '" + key + "' given twice");
    seen.push_back(key);
    const auto ms = [&](std::uint64_t lo) {
      return std::chrono::milliseconds(url_whole(value, key, lo, hour_ms, url));
    };
    const auto bytes = [&] {
      try {
        return parse_bytes(value);
      } catch (const invalid_argument& e) {
        throw invalid_argument("kv store URL '" + url + "': " + key + ": " + e.what());
      }
    };
    if (key == "connect_timeout_ms") {
      o.connect_timeout = ms(1);
    } else if (key == "command_timeout_ms") {
      o.command_timeout = ms(1);
    } else if (key == "backoff_min_ms") {
      o.backoff_min = ms(1);
    } else if (key == "backoff_max_ms") {
      o.backoff_max = ms(1);
    } else if (key == "max_reply_bytes") {
      o.max_reply_bytes = bytes();
    } else if (key == "pipeline_bytes") {
      o.pipeline_bytes = bytes();
    } else if (key == "max_links") {
      o.max_links = url_whole(value, key, 1, 4096, url);
    } else if (key == "ttl_seconds") {
      o.ttl_seconds = static_cast<std::uint32_t>(url_whole(value, key, 0, 0x7fffffff, url));
    } else if (key == "key_prefix") {
      if (value.size() > 256)
        throw invalid_argument("kv store URL '" + url + "': key_prefix is over 256 bytes");
      o.key_prefix = value;
    } else {
      throw invalid_argument("kv store URL '" + url + "': unknown option '" + key +
                             "' (there are connect_timeout_ms, command_timeout_ms, "
                             "backoff_min_ms, backoff_max_ms, max_reply_bytes, pipeline_bytes, "
                             "max_links, ttl_seconds, key_prefix)");
    }
  }
}

}  // namespace

std::unique_ptr<kv_store> make_redis_store(std::string_view url, redis_store_options options) {
  constexpr std::string_view single = "redis://", cluster = "redis-cluster://";
  bool is_cluster = false;
  std::string_view rest;
  if (url.starts_with(cluster)) {
    is_cluster = true;
    rest = url.substr(cluster.size());
  } else if (url.starts_with(single)) {
    rest = url.substr(single.size());
  } else {
    throw invalid_argument("kv store URL '" + std::string(url) +
                           "': expected redis://HOST:PORT or redis-cluster://HOST:PORT,...");
  }
  const std::size_t scheme = url.size() - rest.size();  // where the part after "//" starts
  // ?KEY=VALUE&... after the hosts and the database: options (apply_url_options).
  std::string_view query;
  if (const auto q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  // The name shown in reports and errors: the URL with the password hidden.
  std::string name(url);
  // [[USER]:PASSWORD@] before the hosts.
  const auto path = rest.find('/');
  if (const auto at = rest.substr(0, path).rfind('@'); at != std::string_view::npos) {
    const std::string_view info = rest.substr(0, at);
    const auto colon = info.find(':');
    if (colon == std::string_view::npos)
      throw invalid_argument("kv store URL '" + std::string(url.substr(0, scheme)) +
                             "***@" + std::string(url.substr(scheme + at + 1)) +
                             "': user information must be [USER]:PASSWORD@");
    name = std::string(url.substr(0, scheme + colon + 1)) + "***" +
           std::string(url.substr(scheme + at));
    options.username = percent_decoded(info.substr(0, colon), name);
    options.password = percent_decoded(info.substr(colon + 1), name);
    rest = rest.substr(at + 1);
  }
  if (auto slash = rest.find('/'); slash != std::string_view::npos) {
    const std::string db(rest.substr(slash + 1));
    char* end = nullptr;
    const unsigned long v = std::strtoul(db.c_str(), &end, 10);
    if (db.empty() || *end != '\0' || db[0] == '-' || v > 1000000)
      throw invalid_argument("kv store URL '" + name + "': database '" + db +
                             "' is not a whole number");
    if (is_cluster && v != 0)
      throw invalid_argument("kv store URL '" + name + "': a cluster has database 0 only");
    options.database = static_cast<unsigned>(v);
    rest = rest.substr(0, slash);
  }
  apply_url_options(query, name, options);
  std::vector<redis_endpoint> seeds = parse_endpoints(rest, name);
  if (!is_cluster && seeds.size() != 1)
    throw invalid_argument("kv store URL '" + std::string(url) +
                           "': redis:// takes one HOST:PORT (redis-cluster:// takes several)");
  if (options.pipeline_bytes == 0 || options.command_timeout.count() <= 0 ||
      options.connect_timeout.count() <= 0 || options.backoff_min.count() <= 0 ||
      options.backoff_max < options.backoff_min || options.max_reply_bytes < 1024 ||
      options.max_links == 0)
    throw invalid_argument("redis store: pipeline_bytes, timeouts, backoff and max_links must be "
                           "positive, max_reply_bytes at least 1024");
  return std::make_unique<redis_kv_store>(std::move(name), std::move(seeds), is_cluster,
                                          std::move(options));
}

redis_fault_counts redis_faults(const kv_store& store) {
  const auto* redis = dynamic_cast<const redis_kv_store*>(&store);
  if (redis == nullptr)
    throw invalid_argument("redis_faults: '" + store.name() + "' is not a Redis store");
  std::lock_guard lock(redis->mutex());
  redis_fault_counts out;
  for (std::size_t i = 0; i < redis_fault_kinds; ++i) out.count[i] = redis->health().faults[i];
  out.links = redis->link_count();
  return out;
}

}  // namespace gpumem
