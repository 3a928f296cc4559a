// The KV cache C API's reference-model fuzz driver (gpumem_kv.h; shared by
// fuzz_kv_c_api.cpp and fuzz_corpus_test.cpp). Bytes decode into pool create / destroy,
// cache and sequence-set create / destroy in any order, add_sequence / append /
// append_each / fork / free / blocks_needed / block_table(s) / evict / shrink, and the
// sequence-set calls, with counts, ids and sizes drawn from the edges of their types (0, 1,
// the limit and one past it, SIZE_MAX / UINT64_MAX and their neighbours, the counts whose
// bytes overflow). The model predicts each status:
//  - an unknown or freed id, a count past the cache's limit (max_sequence_tokens, else the
//    capacity of max_blocks blocks), a buffer that cannot exist, a bad config or stream, a
//    pool destroyed while something stands on it -> GPUMEM_ERROR_INVALID_ARGUMENT;
//  - a count within the limit -> success, or GPUMEM_ERROR_OUT_OF_MEMORY changing nothing;
// and after each step every cache validates, holds the model's sequences and token counts,
// and every token's id written into its slot (layer 0, key, head 0) reads back.
// A count larger than the driver's own token buffer is passed only where the model expects
// a refusal before any token is read.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "fuzz/fuzz_driver.hpp"
#include "gpumem/interop/gpumem_kv.h"

namespace gpumem_fuzz {

namespace detail {

class kv_c_api_driver {
 public:
  kv_c_api_driver(byte_source& in, fuzz_counts& counts) : in_(in), counts_(counts) {
    tokens_.resize(token_buffer);
    for (std::size_t i = 0; i < tokens_.size(); ++i)
      tokens_[i] = static_cast<std::int32_t>(i * 2654435761u);
  }
  kv_c_api_driver(const kv_c_api_driver&) = delete;
  kv_c_api_driver& operator=(const kv_c_api_driver&) = delete;
  ~kv_c_api_driver() { teardown(); }

  std::string run(std::size_t max_ops) {
    std::string why;
    for (std::size_t step = 0; why.empty() && !in_.exhausted() && (max_ops == 0 || step < max_ops);
         ++step) {
      ++counts_.operations;
      why = one_step();
      if (why.empty()) why = check(step % 16 == 0);
      if (!why.empty()) why = "step " + std::to_string(step) + ": " + why;
    }
    if (why.empty()) why = check(true);
    if (why.empty()) why = teardown();
    return why;
  }

 private:
  static constexpr std::size_t token_buffer = 4096;
  static constexpr std::uint64_t block_tokens = 16;

  struct pool_model {
    gpumem_pool* h = nullptr;
    void* stream = nullptr;
    bool live = true;
  };
  struct cache_model {
    gpumem_kv_cache* h = nullptr;
    std::size_t pool = 0;
    std::uint64_t limit = 0;  // sequence_token_limit
    std::map<std::uint64_t, std::vector<std::int32_t>> seqs;
    std::vector<std::uint64_t> freed;
    gpumem_kv_storage st{};
  };
  struct vseqs_model {
    gpumem_kv_vseqs* h = nullptr;
    std::size_t pool = 0;
    std::uint64_t max_tokens = 0;
    std::map<std::uint64_t, std::uint64_t> seqs;
    std::vector<std::uint64_t> freed;
  };

  // --- inputs at the edges --------------------------------------------------------------

  // A value near `limit` or at an edge of 64 bits.
  std::uint64_t edge(std::uint64_t limit) {
    switch (in_.u8() % 14) {
      case 0: return 0;
      case 1: return 1;
      case 2: return limit == 0 ? 0 : limit - 1;
      case 3: return limit;
      case 4: return limit + 1;  // wraps to 0 for UINT64_MAX: still an edge
      case 5: return UINT64_MAX;
      case 6: return UINT64_MAX - 1;
      case 7: return UINT64_MAX - block_tokens;
      case 8: return SIZE_MAX / 4;
      case 9: return SIZE_MAX / 4 + 1;
      case 10: return SIZE_MAX / 8 + 1;
      case 11: return std::uint64_t{1} << 31;
      case 12: return std::uint64_t{1} << 32;
      default: return in_.u8() % 40;
    }
  }

  // A sequence id: a live one mostly, else freed, never made, 0 or the top of 64 bits.
  template <class Model>
  std::uint64_t pick_id(const Model& m) {
    const std::uint8_t k = in_.u8() % 8;
    if (k < 5 && !m.seqs.empty()) {
      auto it = m.seqs.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(in_.below(m.seqs.size())));
      return it->first;
    }
    if (k == 5 && !m.freed.empty()) return m.freed[in_.below(m.freed.size())];
    const std::uint64_t ids[] = {0, UINT64_MAX, UINT64_MAX - 1, 999999, std::uint64_t{1} << 32};
    return ids[in_.u8() % 5];
  }

  // --- expectations ---------------------------------------------------------------------

  std::string expect(gpumem_status got, gpumem_status want, const std::string& what) {
    if (got == want) {
      if (want != GPUMEM_SUCCESS) ++counts_.bad_inputs;
      return {};
    }
    return what + ": " + gpumem_status_name(got) + " (" + gpumem_last_error() + "), the model " +
           gpumem_status_name(want);
  }
  // Within the limits: success, or out of memory (counted).
  std::string expect_fit(gpumem_status got, const std::string& what) {
    if (got == GPUMEM_SUCCESS) return {};
    if (got == GPUMEM_ERROR_OUT_OF_MEMORY) {
      ++counts_.out_of_memory;
      return {};
    }
    return what + ": " + gpumem_status_name(got) + " (" + gpumem_last_error() +
           "), the model: success or out of memory";
  }

  // --- steps ----------------------------------------------------------------------------

  std::string one_step() {
    const std::uint8_t op = in_.u8() % 32;
    if (pools_live() == 0 || op < 1) return create_pool();
    if (caches_.empty() || op < 3) return create_cache();
    switch (op) {
      case 3: return destroy_pool();
      case 4: return destroy_cache();
      case 5: case 6: return vseqs_step();
      case 7: case 8: case 9: case 10: return add();
      case 11: case 12: case 13: case 14: return append();
      case 15: case 16: return append_each();
      case 17: case 18: return fork();
      case 19: case 20: return free_seq();
      case 21: case 22: return blocks_needed();
      case 23: case 24: return block_tables();
      case 25: return block_table();
      case 26: return evict_or_shrink();
      default: return append();
    }
  }

  std::size_t pools_live() const {
    return static_cast<std::size_t>(
        std::count_if(pools_.begin(), pools_.end(), [](const pool_model& p) { return p.live; }));
  }

  std::string create_pool() {
    if (pools_live() >= 2) return {};
    pool_model p;
    const char* config = in_.u8() % 3 == 0 ? "platform:sim,sim_capacity:64M,limit:8M"
                                           : "platform:sim,sim_capacity:64M";
    if (auto why = expect(gpumem_pool_create(config, &p.h), GPUMEM_SUCCESS, "pool create");
        !why.empty())
      return why;
    if (gpumem_stream_create(p.h, &p.stream) != GPUMEM_SUCCESS) return "stream create failed";
    pools_.push_back(p);
    return {};
  }

  // Any pool, destroyed ones included (calls on them are refused).
  std::size_t pick_pool() { return in_.below(pools_.size()); }

  std::string destroy_pool() {
    const std::size_t i = pick_pool();
    pool_model& p = pools_[i];
    const bool borrowed =
        std::any_of(caches_.begin(), caches_.end(), [&](const cache_model& c) { return c.pool == i; }) ||
        std::any_of(vseqs_.begin(), vseqs_.end(), [&](const vseqs_model& v) { return v.pool == i; });
    const gpumem_status want =
        p.live && !borrowed ? GPUMEM_SUCCESS : GPUMEM_ERROR_INVALID_ARGUMENT;
    if (auto why = expect(gpumem_pool_destroy(p.h), want, "pool destroy"); !why.empty()) return why;
    if (want == GPUMEM_SUCCESS) p.live = false;  // its stream died with it
    return {};
  }

  gpumem_kv_layout layout() {
    gpumem_kv_layout l{};
    l.layers = 2;
    l.kv_heads = 2;
    l.head_dim = 64;
    l.block_tokens = block_tokens;
    l.dtype = GPUMEM_KV_F16;
    switch (in_.u8() % 16) {  // mostly good
      case 0: l.layers = 0; break;
      case 1: l.kv_heads = UINT64_MAX; break;
      case 2: l.head_dim = 65537; break;
      case 3: l.dtype = -1; break;
      case 4: l.reserved = 1; break;
      default: break;
    }
    return l;
  }
  static bool good(const gpumem_kv_layout& l) {
    return l.layers == 2 && l.kv_heads == 2 && l.head_dim == 64 && l.dtype == GPUMEM_KV_F16 &&
           l.reserved == 0;
  }

  // The stream: the pool's own, the default, or a value no platform knows.
  void* stream_for(const pool_model& p, bool& bogus) {
    const std::uint8_t k = in_.u8() % 8;
    bogus = k == 0;
    if (bogus) return reinterpret_cast<void*>(std::uintptr_t{0x5eed});
    return k < 4 ? p.stream : nullptr;
  }

  std::string create_cache() {
    if (pools_.empty() || caches_.size() >= 3) return {};
    const std::size_t pi = pick_pool();
    pool_model& p = pools_[pi];
    gpumem_kv_config c;
    gpumem_kv_config_init(&c);
    c.layout = layout();
    // 16 KiB blocks: 4096 fill the 64 MiB device; max_blocks may reserve 4x that.
    constexpr std::uint64_t device_blocks = 64 * MiB / (16 * 1024);
    const std::uint64_t max_blocks_choices[] = {0, 1, 32, 300, 4 * device_blocks,
                                                4 * device_blocks + 1, std::uint64_t{1} << 31,
                                                UINT64_MAX};
    c.max_blocks = max_blocks_choices[in_.u8() % 8];
    const std::uint64_t effective = c.max_blocks == 0 ? device_blocks : c.max_blocks;
    const std::uint64_t seq_caps[] = {0, 1, 15, 16, 17, 100, 1000, UINT64_MAX};
    c.max_sequence_tokens = seq_caps[in_.u8() % 8];
    const std::uint64_t grows[] = {0, 1, 3, UINT64_MAX};
    c.grow_pages = grows[in_.u8() % 4];
    const std::uint8_t init = in_.u8() % 8;
    c.initial_blocks = init == 0 ? effective + 1 : init == 1 ? UINT64_MAX : init == 2 ? 1 : 0;
    c.prefix_caching = in_.u8() % 4 != 0;
    c.swap = 0;
    c.reserved = in_.u8() % 16 == 0 ? 7 : 0;
    bool bogus = false;
    c.stream = stream_for(p, bogus);
    const bool valid = p.live && good(c.layout) && effective <= 4 * device_blocks &&
                       c.initial_blocks <= effective && c.reserved == 0 && !bogus;
    cache_model m;
    m.h = reinterpret_cast<gpumem_kv_cache*>(&m);  // must become NULL on failure
    m.pool = pi;
    const gpumem_status got = gpumem_kv_create(p.h, &c, &m.h);
    // Initial blocks map at create (grow_pages pages at least): out of memory is an answer.
    if (valid && c.initial_blocks != 0 && got == GPUMEM_ERROR_OUT_OF_MEMORY) {
      ++counts_.out_of_memory;
      return m.h == nullptr ? std::string() : "a failed create returned a handle";
    }
    if (auto why = expect(got, valid ? GPUMEM_SUCCESS : GPUMEM_ERROR_INVALID_ARGUMENT,
                          "kv create");
        !why.empty())
      return why;
    if (!valid) return m.h == nullptr ? std::string() : "a refused create returned a handle";
    if (gpumem_kv_storage_get(m.h, &m.st) != GPUMEM_SUCCESS) return "storage_get failed";
    if (m.st.max_blocks != effective) return "max_blocks disagrees with the config";
    m.limit = m.st.max_blocks * block_tokens;
    if (c.max_sequence_tokens != 0) m.limit = std::min(m.limit, c.max_sequence_tokens);
    caches_.push_back(std::move(m));
    return {};
  }

  std::string destroy_cache() {
    const std::size_t i = in_.below(caches_.size());
    gpumem_kv_destroy(caches_[i].h);
    caches_.erase(caches_.begin() + static_cast<std::ptrdiff_t>(i));
    return {};
  }

  cache_model& pick_cache() { return caches_[in_.below(caches_.size())]; }

  // A token count for a sequence holding `have` of `limit`: an edge, or a small one.
  std::uint64_t count_for(std::uint64_t have, std::uint64_t limit) {
    return in_.u8() % 2 ? edge(limit - have) : in_.u8() % 40;
  }
  // Whether a call with `count` tokens may run: the driver's buffer holds them, or the
  // model expects a refusal before any is read.
  static bool runnable(std::uint64_t count, std::uint64_t room) {
    return count <= token_buffer || count > room;
  }

  void write_tokens(cache_model& m, std::uint64_t id, std::size_t from) {
    (void)gpumem_kv_synchronize(m.h);  // copies on write land before the writes
    const auto& t = m.seqs[id];
    std::vector<std::uint32_t> table(t.size() / block_tokens + 1);
    std::size_t n = 0;
    if (gpumem_kv_block_table(m.h, id, table.data(), table.size(), &n) != GPUMEM_SUCCESS) return;
    for (std::size_t i = from; i < t.size(); ++i) *slot(m, table, i) = t[i];
  }
  std::int32_t* slot(const cache_model& m, const std::vector<std::uint32_t>& table,
                     std::size_t pos) const {
    return reinterpret_cast<std::int32_t*>(static_cast<std::uintptr_t>(
        m.st.base + table[pos / block_tokens] * m.st.block_stride +
        (pos % block_tokens) * m.st.token_stride));
  }

  std::string add() {
    cache_model& m = pick_cache();
    const std::uint64_t count = count_for(0, m.limit);
    if (!runnable(count, m.limit)) return {};
    std::uint64_t id = 0, cached = 0;
    const gpumem_status got = gpumem_kv_add_sequence(
        m.h, tokens_.data(), static_cast<std::size_t>(count), in_.u8() % 4, &id, &cached);
    const std::string what = "add_sequence of " + std::to_string(count);
    if (count > m.limit) return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, what);
    if (auto why = expect_fit(got, what); !why.empty() || got != GPUMEM_SUCCESS) return why;
    if (m.seqs.count(id) != 0 || std::count(m.freed.begin(), m.freed.end(), id) != 0)
      return "add_sequence reused id " + std::to_string(id);
    m.seqs[id].assign(tokens_.begin(), tokens_.begin() + static_cast<std::ptrdiff_t>(count));
    write_tokens(m, id, static_cast<std::size_t>(cached));
    ++counts_.allocations;
    return {};
  }

  std::string append() {
    cache_model& m = pick_cache();
    const std::uint64_t id = pick_id(m);
    auto it = m.seqs.find(id);
    const std::uint64_t have = it == m.seqs.end() ? 0 : it->second.size();
    const std::uint64_t count = count_for(have, m.limit);
    if (!runnable(count, m.limit - have)) return {};
    const gpumem_status got =
        gpumem_kv_append(m.h, id, tokens_.data(), static_cast<std::size_t>(count));
    const std::string what = "append of " + std::to_string(count) + " to " + std::to_string(id);
    if (it == m.seqs.end() || count > m.limit - have)
      return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, what);
    if (auto why = expect_fit(got, what); !why.empty() || got != GPUMEM_SUCCESS) return why;
    it->second.insert(it->second.end(), tokens_.begin(),
                      tokens_.begin() + static_cast<std::ptrdiff_t>(count));
    write_tokens(m, id, static_cast<std::size_t>(have));
    return {};
  }

  std::string append_each() {
    cache_model& m = pick_cache();
    const std::uint8_t k = in_.u8() % 6;
    std::vector<std::uint64_t> ids(1 + in_.u8() % 6);
    for (auto& id : ids) id = pick_id(m);
    std::size_t done = 99;
    if (k == 0 || k == 1) {  // counts whose bytes overflow or wrap: nothing is read
      const std::size_t count = k == 0 ? SIZE_MAX : SIZE_MAX / 8 + 1;
      const gpumem_status got = gpumem_kv_append_each(m.h, ids.data(), tokens_.data(), count, &done);
      if (done != 0) return "a refused append_each reports " + std::to_string(done) + " done";
      return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, "append_each of a count past any buffer");
    }
    std::map<std::uint64_t, std::size_t> before;  // each live id's length before the call
    for (auto id : ids)
      if (auto it = m.seqs.find(id); it != m.seqs.end()) before.emplace(id, it->second.size());
    const gpumem_status got = gpumem_kv_append_each(m.h, ids.data(), tokens_.data(), ids.size(), &done);
    if (done > ids.size()) return "append_each: done past the count";
    for (std::size_t i = 0; i < done; ++i) {  // these got their token
      auto it = m.seqs.find(ids[i]);
      if (it == m.seqs.end() || it->second.size() + 1 > m.limit)
        return "append_each appended to an id the model refuses";
      it->second.push_back(tokens_[i]);
    }
    for (auto [id, from] : before)
      if (m.seqs[id].size() > from) write_tokens(m, id, from);
    if (done == ids.size()) return expect(got, GPUMEM_SUCCESS, "append_each");
    auto it = m.seqs.find(ids[done]);
    if (it == m.seqs.end() || it->second.size() + 1 > m.limit)
      return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, "append_each stopping at a bad id");
    if (got == GPUMEM_SUCCESS) return "append_each succeeded short of its count";
    return expect_fit(got, "append_each");
  }

  std::string fork() {
    cache_model& m = pick_cache();
    const std::uint64_t id = pick_id(m);
    std::uint64_t child = 0;
    const gpumem_status got = gpumem_kv_fork(m.h, id, &child);
    auto it = m.seqs.find(id);
    if (it == m.seqs.end()) return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, "fork of a bad id");
    if (auto why = expect(got, GPUMEM_SUCCESS, "fork"); !why.empty()) return why;
    if (m.seqs.count(child) != 0) return "fork reused a live id";
    m.seqs[child] = it->second;
    return {};
  }

  std::string free_seq() {
    cache_model& m = pick_cache();
    const std::uint64_t id = pick_id(m);
    const bool live = m.seqs.count(id) != 0;
    if (auto why = expect(gpumem_kv_free(m.h, id),
                          live ? GPUMEM_SUCCESS : GPUMEM_ERROR_INVALID_ARGUMENT, "free");
        !why.empty())
      return why;
    if (live) {
      m.seqs.erase(id);
      m.freed.push_back(id);
    }
    return {};
  }

  std::string blocks_needed() {
    cache_model& m = pick_cache();
    const std::uint64_t id = pick_id(m);
    auto it = m.seqs.find(id);
    const std::uint64_t have = it == m.seqs.end() ? 0 : it->second.size();
    const std::uint64_t count = count_for(have, m.limit);
    std::uint64_t blocks = 12345;
    const gpumem_status got = gpumem_kv_blocks_needed(m.h, id, count, &blocks);
    const std::string what = "blocks_needed of " + std::to_string(count);
    if (it == m.seqs.end() || count > m.limit - have) {
      if (blocks != 12345) return what + " wrote its output on a refusal";
      return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, what);
    }
    if (auto why = expect(got, GPUMEM_SUCCESS, what); !why.empty()) return why;
    const auto ceil = [](std::uint64_t n) { return n / block_tokens + (n % block_tokens != 0); };
    const std::uint64_t fresh = ceil(have + count) - ceil(have);
    const bool may_copy = count != 0 && have % block_tokens != 0;  // a shared last block
    if (blocks != fresh && !(may_copy && blocks == fresh + 1))
      return what + " answered " + std::to_string(blocks) + ", the model " + std::to_string(fresh);
    return {};
  }

  std::string block_table() {
    cache_model& m = pick_cache();
    const std::uint64_t id = pick_id(m);
    std::size_t n = 0;
    std::vector<std::uint32_t> table(1 + in_.u8() % 40, 0xfeed);
    const std::size_t capacity = in_.u8() % 8 == 0 ? 0 : table.size();
    const gpumem_status got = gpumem_kv_block_table(m.h, id, table.data(), capacity, &n);
    auto it = m.seqs.find(id);
    if (it == m.seqs.end()) return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, "block_table of a bad id");
    const std::size_t blocks = (it->second.size() + block_tokens - 1) / block_tokens;
    if (blocks > capacity) {
      if (table[0] != 0xfeed) return "a refused block_table wrote";
      return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, "block_table into a short buffer");
    }
    if (auto why = expect(got, GPUMEM_SUCCESS, "block_table"); !why.empty()) return why;
    return n == blocks ? std::string() : "block_table counted " + std::to_string(n);
  }

  std::string block_tables() {
    cache_model& m = pick_cache();
    std::vector<std::uint64_t> ids(in_.u8() % 5);
    for (auto& id : ids) id = pick_id(m);
    std::size_t need = 0;
    bool bad_id = false;
    for (auto id : ids) {
      auto it = m.seqs.find(id);
      if (it == m.seqs.end()) bad_id = true;
      else need = std::max<std::size_t>(need, (it->second.size() + block_tokens - 1) / block_tokens);
    }
    std::size_t row = need;
    std::size_t count = ids.size();
    bool overflow = false;
    switch (in_.u8() % 8) {
      case 0: row = SIZE_MAX; overflow = count != 0; break;
      case 1: row = SIZE_MAX / 2 + 1; overflow = count != 0; break;
      case 2: row = SIZE_MAX / 4 + 1; overflow = count != 0; break;
      case 3: count = SIZE_MAX; overflow = true; break;
      case 4: row = need == 0 ? 0 : need - 1; break;
      default: row = need + in_.u8() % 3; break;
    }
    std::vector<std::uint32_t> rows(overflow ? 1 : std::max<std::size_t>(1, count * row), 0xfeed);
    std::vector<std::uint64_t> lengths(std::max<std::size_t>(1, ids.size()), 77);
    const gpumem_status got = gpumem_kv_block_tables(
        m.h, ids.empty() ? nullptr : ids.data(), count, ids.empty() && !overflow ? nullptr : rows.data(),
        row, 0xdead, lengths.data());
    if (overflow || (count != 0 && (bad_id || need > row))) {
      if (rows[0] != 0xfeed || lengths[0] != 77) return "a refused block_tables wrote";
      return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, "block_tables refused");
    }
    if (auto why = expect(got, GPUMEM_SUCCESS, "block_tables"); !why.empty()) return why;
    for (std::size_t i = 0; i < count; ++i)
      if (lengths[i] != m.seqs[ids[i]].size()) return "block_tables length disagrees";
    return {};
  }

  std::string evict_or_shrink() {
    cache_model& m = pick_cache();
    std::uint64_t n = 0;
    const std::uint64_t edges[] = {0, 1, UINT64_MAX - 1, UINT64_MAX};
    const std::uint64_t v = edges[in_.u8() % 4];
    if (in_.u8() % 2) return expect(gpumem_kv_evict(m.h, v, &n), GPUMEM_SUCCESS, "evict");
    return expect(gpumem_kv_shrink(m.h, v, in_.u8() % 2, &n), GPUMEM_SUCCESS, "shrink");
  }

  // --- virtually contiguous sequences ---------------------------------------------------

  std::string vseqs_step() {
    const std::uint8_t k = in_.u8() % 8;
    if (vseqs_.empty() || k == 0) {
      if (pools_.empty() || vseqs_.size() >= 2) return {};
      const std::size_t pi = pick_pool();
      gpumem_kv_layout l = layout();
      // 1 KiB a token: the 64 MiB device holds 65536.
      const std::uint64_t caps[] = {0, 1, 64, 4096, std::uint64_t{1} << 20, UINT64_MAX};
      const std::uint64_t cap = caps[in_.u8() % 6];
      bool bogus = false;
      void* stream = stream_for(pools_[pi], bogus);
      const bool valid = pools_[pi].live && good(l) && cap >= 1 && cap <= 65536 && !bogus;
      vseqs_model v;
      v.pool = pi;
      v.max_tokens = cap;
      const gpumem_status got = gpumem_kv_vseqs_create(pools_[pi].h, &l, cap, stream, &v.h);
      if (auto why = expect(got, valid ? GPUMEM_SUCCESS : GPUMEM_ERROR_INVALID_ARGUMENT,
                            "vseqs create");
          !why.empty() || !valid)
        return why;
      vseqs_.push_back(std::move(v));
      return {};
    }
    const std::size_t i = in_.below(vseqs_.size());
    vseqs_model& v = vseqs_[i];
    switch (k) {
      case 1: gpumem_kv_vseqs_destroy(v.h); vseqs_.erase(vseqs_.begin() + static_cast<std::ptrdiff_t>(i)); return {};
      case 2: case 3: {
        const std::uint64_t n = edge(v.max_tokens);
        std::uint64_t id = 0;
        const gpumem_status got = gpumem_kv_vseqs_add(v.h, n, &id);
        if (n > v.max_tokens) return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, "vseqs add");
        if (auto why = expect_fit(got, "vseqs add"); !why.empty() || got != GPUMEM_SUCCESS) return why;
        v.seqs[id] = n;
        return {};
      }
      case 4: case 5: {
        const std::uint64_t id = pick_id(v);
        auto it = v.seqs.find(id);
        const std::uint64_t have = it == v.seqs.end() ? 0 : it->second;
        const std::uint64_t n = edge(v.max_tokens - have);
        const gpumem_status got = gpumem_kv_vseqs_append(v.h, id, n);
        if (it == v.seqs.end() || n > v.max_tokens - have)
          return expect(got, GPUMEM_ERROR_INVALID_ARGUMENT, "vseqs append");
        if (auto why = expect_fit(got, "vseqs append"); !why.empty() || got != GPUMEM_SUCCESS) return why;
        it->second += n;
        return {};
      }
      default: {
        const std::uint64_t id = pick_id(v);
        const bool live = v.seqs.count(id) != 0;
        if (auto why = expect(gpumem_kv_vseqs_free(v.h, id),
                              live ? GPUMEM_SUCCESS : GPUMEM_ERROR_INVALID_ARGUMENT, "vseqs free");
            !why.empty())
          return why;
        if (live) {
          v.seqs.erase(id);
          v.freed.push_back(id);
        }
        return {};
      }
    }
  }

  // --- checks and teardown --------------------------------------------------------------

  // Every step: validate() and token counts; with `bytes`, every token's slot too.
  std::string check(bool bytes) {
    char text[256];
    for (auto& m : caches_) {
      if (gpumem_kv_validate(m.h, text, sizeof text) != 0) return std::string("kv validate: ") + text;
      gpumem_kv_stats s{};
      if (gpumem_kv_stats_get(m.h, &s) != GPUMEM_SUCCESS || s.sequences != m.seqs.size())
        return "sequence count disagrees with the model";
      std::vector<std::uint32_t> table;
      for (auto& [id, t] : m.seqs) {
        std::uint64_t n = 0;
        if (gpumem_kv_sequence_tokens(m.h, id, &n) != GPUMEM_SUCCESS || n != t.size())
          return "sequence " + std::to_string(id) + " holds " + std::to_string(n) +
                 " tokens, the model " + std::to_string(t.size());
        if (!bytes) continue;
        table.assign(t.size() / block_tokens + 1, 0);
        std::size_t blocks = 0;
        if (gpumem_kv_block_table(m.h, id, table.data(), table.size(), &blocks) != GPUMEM_SUCCESS)
          return "block_table of a live sequence failed";
        for (std::size_t i = 0; i < t.size(); ++i)
          if (*slot(m, table, i) != t[i])
            return "sequence " + std::to_string(id) + " token " + std::to_string(i) + " reads " +
                   std::to_string(*slot(m, table, i)) + ", wrote " + std::to_string(t[i]);
        counts_.bytes_checked += t.size() * sizeof(std::int32_t);
      }
    }
    for (auto& v : vseqs_) {
      if (gpumem_kv_vseqs_validate(v.h, text, sizeof text) != 0)
        return std::string("vseqs validate: ") + text;
      for (auto& [id, n] : v.seqs) {
        std::uint64_t tokens = 0;
        if (gpumem_kv_vseqs_sequence(v.h, id, nullptr, &tokens) != GPUMEM_SUCCESS || tokens != n)
          return "a virtual sequence's tokens disagree with the model";
      }
    }
    return {};
  }

  // Everything destroyed, children first; every pool then destroys.
  std::string teardown() {
    std::string why;
    for (auto& m : caches_) gpumem_kv_destroy(m.h);
    caches_.clear();
    for (auto& v : vseqs_) gpumem_kv_vseqs_destroy(v.h);
    vseqs_.clear();
    for (auto& p : pools_) {
      if (!p.live) continue;
      if (gpumem_pool_destroy(p.h) != GPUMEM_SUCCESS && why.empty())
        why = std::string("teardown: pool destroy refused: ") + gpumem_last_error();
      p.live = false;
    }
    return why;
  }

  byte_source& in_;
  fuzz_counts& counts_;
  std::vector<std::int32_t> tokens_;
  std::vector<pool_model> pools_;
  std::vector<cache_model> caches_;
  std::vector<vseqs_model> vseqs_;
};

}  // namespace detail

inline std::string run_kv_c_api_fuzz(const std::uint8_t* data, std::size_t size,
                                     std::size_t max_ops, fuzz_counts& counts) {
  ++counts.runs;
  byte_source in(data, size);
  detail::kv_c_api_driver driver(in, counts);
  const std::string why = driver.run(max_ops);
  return why.empty() ? why : "kv C API: " + why;
}

}  // namespace gpumem_fuzz
