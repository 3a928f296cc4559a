// The KV cache's reference-model fuzz driver (shared by fuzz_kv_cache.cpp and
// fuzz_corpus_test.cpp). Bytes decode into add_sequence (with shared prompt prefixes, so
// prefix hits happen) / append / fork / free / swap_out / swap_in / evict / shrink, direct
// allocations from the same vmm_page_pool (one budget), bad input, and in fault mode sim
// faults. Every token's id is written into its KV slot (layer 0, key, head 0) and checked
// against the model: a sequence's tokens survive copy on write, prefix sharing, eviction
// of others, swap out and in, and shrink. After each step kv.validate() and the pool's
// validate() hold, sequence_tokens() matches the model; a refused or failed call changes
// no sequence. At teardown sim.live_objects().none().
#pragma once

#include <map>
#include <numeric>
#include <vector>

#include "fuzz/fuzz_driver.hpp"

namespace gpumem_fuzz {

namespace detail {

inline gpumem::kv_layout fuzz_kv_layout() {
  gpumem::kv_layout l;  // 16 KiB blocks of 16 tokens, 128 to a 2 MiB page
  l.layers = 2;
  l.kv_heads = 2;
  l.head_dim = 64;
  l.dtype = gpumem::kv_dtype::bf16;
  l.block_tokens = 16;
  return l;
}

class kv_driver {
 public:
  using seq = gpumem::kv_cache::sequence_id;
  using token = gpumem::token_id;

  kv_driver(gpumem::sim_platform& sim, gpumem::vmm_page_pool& pages, gpumem::kv_cache& kv,
            byte_source& in, bool fault_mode, fuzz_counts& counts, std::size_t fault_rules = 1)
      : sim_(sim), pages_(pages), kv_(kv), in_(in), fault_mode_(fault_mode), counts_(counts),
        faults_(fault_rules) {
    for (int p = 0; p < 3; ++p) {
      std::vector<token> t(16 * (1 + p) + 16);
      std::iota(t.begin(), t.end(), 10000 * (p + 1));
      prefixes_.push_back(std::move(t));
    }
  }

  std::string run(std::size_t max_ops) {
    std::string why;
    for (std::size_t step = 0; why.empty() && !in_.exhausted() && (max_ops == 0 || step < max_ops);
         ++step) {
      ++counts_.operations;
      why = one_step();
      if (why.empty()) why = check(step % 16 == 0);
      if (!why.empty()) why = "step " + std::to_string(step) + ": " + why;
    }
    faults_.clear(sim_);
    if (why.empty()) why = check(true);
    if (why.empty()) why = teardown();
    return why;
  }

 private:
  token* slot(const std::vector<gpumem::kv_cache::block_id>& table, std::size_t pos) const {
    const auto& l = kv_.layout();
    const auto b = table[pos / l.block_tokens];
    return reinterpret_cast<token*>(kv_.base() + l.offset(b, 0, 0, pos % l.block_tokens, 0, 0));
  }

  void write_tokens(seq id, std::size_t from) {
    auto table = kv_.block_table(id);
    const auto& t = model_[id];
    for (std::size_t i = from; i < t.size(); ++i) *slot(table, i) = t[i];
  }

  std::string check_sequence(seq id) {
    const auto& t = model_.at(id);
    if (kv_.sequence_tokens(id) != t.size())
      return "sequence " + std::to_string(id) + " has " + std::to_string(kv_.sequence_tokens(id)) +
             " tokens, the model " + std::to_string(t.size());
    if (kv_.is_swapped(id)) return {};
    auto table = kv_.block_table(id);
    for (std::size_t i = 0; i < t.size(); ++i)
      if (*slot(table, i) != t[i])
        return "sequence " + std::to_string(id) + " token " + std::to_string(i) + " reads " +
               std::to_string(*slot(table, i)) + ", wrote " + std::to_string(t[i]);
    counts_.bytes_checked += t.size() * sizeof(token);
    return {};
  }

  std::string check(bool all) {
    if (auto why = kv_.validate(); !why.empty()) return "kv validate: " + why;
    if (auto why = pages_.validate(); !why.empty()) return "pool validate: " + why;
    if (kv_.stats().sequences != model_.size()) return "sequence count disagrees with the model";
    for (auto& [id, t] : model_) {
      if (!all && id != touched_) {
        if (kv_.sequence_tokens(id) != t.size()) return "a sequence's token count changed";
        continue;
      }
      if (auto why = check_sequence(id); !why.empty()) return why;
    }
    std::size_t bytes = 0;
    for (auto& [p, n] : direct_) bytes += n;
    if (pages_.stats().live_bytes != bytes) return "pool live bytes disagree with direct allocations";
    return {};
  }

  std::string judge(const std::exception_ptr& e) {
    return judge_failure(e, faults_.any(), faults_.names(), true, counts_);
  }

  seq pick() {
    auto it = model_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(in_.below(model_.size())));
    return it->first;
  }

  std::vector<token> fresh_tokens(std::size_t n) {
    std::vector<token> t(n);
    for (auto& x : t) x = static_cast<token>(in_.u16() + 1);
    return t;
  }

  std::string one_step() {
    const std::uint8_t op = in_.u8() % 24;
    touched_ = 0;
    if (model_.empty() && op < 20) return add();
    try {
      switch (op) {
        case 0: case 1: case 2: case 3: return add();
        case 4: case 5: case 6: case 7: return append();
        case 8: case 9: {
          const seq id = pick();
          if (kv_.is_swapped(id)) return {};
          const seq child = kv_.fork(id);
          model_[child] = model_[id];
          touched_ = child;
          return {};
        }
        case 10: case 11: case 12: {
          const seq id = pick();
          kv_.free(id);
          model_.erase(id);
          freed_.push_back(id);
          return {};
        }
        case 13: {
          const seq id = pick();
          touched_ = id;
          if (!kv_.is_swapped(id)) kv_.swap_out(id);
          return {};
        }
        case 14: {
          const seq id = pick();
          touched_ = id;
          if (kv_.is_swapped(id)) kv_.swap_in(id);
          return {};
        }
        case 15: (void)kv_.evict(in_.u8() % 8); return {};
        case 16: (void)kv_.shrink(in_.u8() % 8, in_.u8() % 4 == 0); return {};
        case 17: return direct();
        case 18: case 19: return bad_input();
        default:
          if (fault_mode_) return arm_fault();
          return append();
      }
    } catch (...) {
      return judge(std::current_exception());
    }
  }

  std::string add() {
    std::vector<token> prompt;
    if (in_.u8() % 2) prompt = prefixes_[in_.u8() % prefixes_.size()];
    auto extra = fresh_tokens(in_.u8() % 40);
    prompt.insert(prompt.end(), extra.begin(), extra.end());
    const std::size_t before = model_.size();
    gpumem::kv_cache::admission a;
    try {
      a = kv_.add_sequence(prompt);
    } catch (...) {
      if (kv_.stats().sequences != before) return "a failed add_sequence added a sequence";
      return judge(std::current_exception());
    }
    model_[a.id] = prompt;
    write_tokens(a.id, a.cached_tokens);
    touched_ = a.id;
    ++counts_.allocations;
    return {};
  }

  std::string append() {
    if (model_.empty()) return add();
    const seq id = pick();
    if (kv_.is_swapped(id)) return {};
    auto more = fresh_tokens(1 + in_.u8() % 24);
    if (model_[id].size() + more.size() > max_tokens) return {};
    touched_ = id;
    try {
      kv_.append(id, more);
    } catch (...) {
      return judge(std::current_exception());  // check() confirms nothing changed
    }
    auto& t = model_[id];
    const std::size_t from = t.size();
    t.insert(t.end(), more.begin(), more.end());
    write_tokens(id, from);
    return {};
  }

  // Allocations from the page pool itself: the cache and the pool share one budget.
  std::string direct() {
    if (!direct_.empty() && in_.u8() % 2) {
      auto [p, n] = direct_.back();
      direct_.pop_back();
      pages_.deallocate(p, n);
      return {};
    }
    const std::size_t n = 1 + in_.u32() % (6 * MiB);
    try {
      direct_.emplace_back(pages_.allocate(n), n);
    } catch (...) {
      return judge(std::current_exception());
    }
    return {};
  }

  std::string arm_fault() {
    faults_.arm(sim_, in_, counts_);
    return {};
  }

  std::string bad_input() {
    const auto before = kv_.stats();
    const std::uint8_t kind = in_.u8() % 7;
    std::string what;
    bool threw = false, tried = true;
    auto attempt = [&](auto&& fn) {
      try {
        fn();
      } catch (const gpumem::invalid_argument&) {
        threw = true;
      } catch (const std::exception& e) {
        what += std::string(" (wrong exception: ") + e.what() + ")";
      }
    };
    const seq id = model_.empty() ? 0 : pick();
    const bool swapped = id != 0 && kv_.is_swapped(id);
    switch (kind) {
      case 0:
        what = "free of a freed sequence";
        if (freed_.empty()) tried = false;
        else attempt([&] { kv_.free(freed_[in_.below(freed_.size())]); });
        break;
      case 1:
        what = "append to a sequence never made";
        attempt([&] { std::vector<token> t{1}; kv_.append(999999999, t); });
        break;
      case 2:
        what = "fork of a swapped-out sequence";
        if (!swapped) tried = false;
        else attempt([&] { (void)kv_.fork(id); });
        break;
      case 3:
        what = "append to a swapped-out sequence";
        if (!swapped) tried = false;
        else attempt([&] { std::vector<token> t{1}; kv_.append(id, t); });
        break;
      case 4:
        what = "swap_in of a resident sequence";
        if (id == 0 || swapped) tried = false;
        else attempt([&] { kv_.swap_in(id); });
        break;
      case 5:
        what = "swap_out of a swapped-out sequence";
        if (!swapped) tried = false;
        else attempt([&] { kv_.swap_out(id); });
        break;
      default:
        what = "append past max_sequence_tokens";
        if (id == 0 || swapped) tried = false;
        else attempt([&] { kv_.append(id, std::vector<token>(max_tokens + 1 - model_[id].size(), 7)); });
        break;
    }
    if (!tried) return {};
    ++counts_.bad_inputs;
    if (!threw) return what + " was not refused with invalid_argument";
    const auto after = kv_.stats();
    if (after.sequences != before.sequences || after.used_blocks != before.used_blocks ||
        after.cached_blocks != before.cached_blocks || after.filled_slots != before.filled_slots ||
        after.capacity_blocks != before.capacity_blocks)
      return what + " changed the cache";
    touched_ = id;
    return {};
  }

  std::string teardown() {
    for (auto& [id, t] : model_) {
      try {
        kv_.free(id);
      } catch (const std::exception& e) {
        return std::string("teardown free: ") + e.what();
      }
    }
    model_.clear();
    for (auto& [p, n] : direct_) pages_.deallocate(p, n);
    direct_.clear();
    (void)kv_.shrink(0, true);
    if (auto st = kv_.stats(); st.used_blocks != 0 || st.cached_blocks != 0)
      return "blocks left after freeing every sequence";
    if (auto why = kv_.validate(); !why.empty()) return "kv invalid at the end: " + why;
    return {};
  }

 public:
  static constexpr std::size_t max_tokens = 512;

 private:
  gpumem::sim_platform& sim_;
  gpumem::vmm_page_pool& pages_;
  gpumem::kv_cache& kv_;
  byte_source& in_;
  bool fault_mode_;
  fuzz_counts& counts_;
  std::map<seq, std::vector<token>> model_;
  std::vector<seq> freed_;
  std::vector<std::vector<token>> prefixes_;
  std::vector<std::pair<void*, std::size_t>> direct_;
  fault_arm faults_;
  seq touched_ = 0;
};

}  // namespace detail

// fault_rules: how many sim fault rules may be armed at once in fault mode (fault_arm).
inline std::string run_kv_cache_fuzz(const std::uint8_t* data, std::size_t size, bool fault_mode,
                                     std::size_t max_ops, fuzz_counts& counts,
                                     std::size_t fault_rules = 1) {
  ++counts.runs;
  gpumem::sim_platform sim(detail::device_options());
  byte_source in(data, size);
  std::string why;
  auto stream = sim.stream_create(0);
  if (!stream) return "stream_create failed";
  {
    gpumem::pool_options o;
    if (in.u8() % 2) o.limit_bytes = (16 + in.u8() % 48) * MiB;  // the cache competes
    gpumem::vmm_page_pool pages(sim, 0, o);
    gpumem::pinned_host_pool host(sim);
    gpumem::kv_cache_config c;
    c.layout = detail::fuzz_kv_layout();
    c.max_blocks = 32 + in.u8() % 256;
    c.grow_pages = in.u8() % 2;
    c.max_sequence_tokens = detail::kv_driver::max_tokens;
    c.prefix_caching = in.u8() % 8 != 0;
    c.stream = stream.value();
    try {
      gpumem::kv_cache kv(pages, c, &host);
      detail::kv_driver driver(sim, pages, kv, in, fault_mode, counts, fault_rules);
      why = driver.run(max_ops);
    } catch (const std::exception& e) {
      why = std::string("unexpected exception: ") + e.what();
    }
    sim.clear_faults();
    if (why.empty() && pages.stats().live_bytes != 0) why = "pool live bytes left";
    if (why.empty()) {
      pages.trim();
      host.trim();
      if (auto w = pages.validate(); !w.empty()) why = "pool invalid at the end: " + w;
    }
  }
  if (!sim.stream_destroy(stream.value())) why += " stream_destroy failed";
  if (why.empty()) why = detail::leak_check(sim);
  return why.empty() ? why : std::string("kv_cache") + (fault_mode ? " (faults)" : "") + ": " + why;
}

}  // namespace gpumem_fuzz
