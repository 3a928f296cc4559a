// The reference-model fuzz driver, shared by the libFuzzer targets (fuzz_pools.cpp,
// fuzz_kv_cache.cpp) and the fixed-seed corpus test (fuzz_corpus_test.cpp).
//
// It decodes bytes into operations on one pool (or the KV cache) on a fresh sim device
// (sim maps real host memory, so bytes can be checked) and, after every step, checks the
// pool against a simple model:
//  - no two live allocations overlap, and each address honours its alignment;
//  - each live allocation still holds the bytes written at allocate (its own byte and its
//    serial number at both ends; sampled every step, checked in full at free and at the end);
//  - stats().live_bytes / live_allocations equal the model's, and validate() is "";
//  - bad input (double free, interior / unknown / null pointer, size mismatch, size 0,
//    absurd size, bad alignment, a free or allocation on a stream the platform refuses: a
//    value it never made, or a stream released from the pool and destroyed) throws
//    gpumem::invalid_argument and changes no counter; a refused free leaves the allocation
//    live (the model keeps it);
//  - frees go to any stream: the allocation's, another the pool knows, or one it never saw
//    (made just before the free); the reserved bytes stay within reserved_bound() of the
//    model's peak live bytes after every step, whatever stream frees;
//  - fault mode: sim fails the nth call of a chosen platform op; every failure is
//    gpumem::cuda_error naming an armed call or gpumem::out_of_memory, the model is
//    unchanged by the failed operation, and the pool stays valid and usable;
//  - at teardown everything is freed and sim.live_objects().none().
// Each run returns "" when all held, otherwise what broke (the front end reports it).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/kv.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/pool/fixed_block_pool.hpp"
#include "gpumem/pool/pinned_host_pool.hpp"

namespace gpumem_fuzz {

inline constexpr std::size_t KiB = 1024;
inline constexpr std::size_t MiB = 1024 * KiB;

// Reads the input; past its end every read is 0 and exhausted() is true.
class byte_source {
 public:
  byte_source(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool exhausted() const noexcept { return at_ >= size_; }
  std::uint8_t u8() noexcept { return at_ < size_ ? data_[at_++] : 0; }
  std::uint32_t u16() noexcept { return static_cast<std::uint32_t>(u8()) | (u8() << 8); }
  std::uint32_t u32() noexcept { return u16() | (u16() << 16); }
  // A value in [0, n), n > 0.
  std::size_t below(std::size_t n) noexcept { return n <= 256 ? u8() % n : u32() % n; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

// Totals over runs, for the figures in docs/RELIABILITY.md.
struct fuzz_counts {
  std::uint64_t runs = 0;
  std::uint64_t operations = 0;        // operations attempted (good and bad)
  std::uint64_t allocations = 0;       // successful allocations (blocks, sequences)
  std::uint64_t bad_inputs = 0;        // bad inputs tried, each refused intact
  std::uint64_t faults_armed = 0;      // sim fault rules set
  std::uint64_t typed_failures = 0;    // operations that failed with a typed error under faults
  std::uint64_t out_of_memory = 0;     // out_of_memory seen (genuine or injected)
  std::uint64_t bytes_checked = 0;     // bytes compared against their pattern
  // out_of_memory although the device had 4x the request + 16 MiB free and no fault was
  // pending (a pool refusing memory the device has; see docs/RELIABILITY.md)
  std::uint64_t oom_with_device_memory_free = 0;
  std::uint64_t first_such_seed_step = 0;
  std::uint64_t foreign_frees = 0;     // frees on a stream other than the allocation's
  std::uint64_t bad_stream_calls = 0;  // calls on a refused stream (among bad_inputs)
  std::size_t worst_reserved_over_peak = 0;  // largest reserved - 2 x peak live seen, bytes
  // The reserved bytes after every checked step, summed: two runs of one corpus that took
  // the same decisions agree on it (the pools' choices must not depend on host addresses).
  std::uint64_t reserved_sum = 0;
  void add(const fuzz_counts& o) {
    reserved_sum += o.reserved_sum;
    foreign_frees += o.foreign_frees;
    bad_stream_calls += o.bad_stream_calls;
    worst_reserved_over_peak = std::max(worst_reserved_over_peak, o.worst_reserved_over_peak);
    runs += o.runs;
    operations += o.operations;
    allocations += o.allocations;
    bad_inputs += o.bad_inputs;
    faults_armed += o.faults_armed;
    typed_failures += o.typed_failures;
    out_of_memory += o.out_of_memory;
    bytes_checked += o.bytes_checked;
    oom_with_device_memory_free += o.oom_with_device_memory_free;
  }
};

enum class pool_target : std::uint8_t {
  caching_over_runtime,
  caching_over_vmm,
  caching_release_threshold,  // caching_pool over runtime, release_threshold 0, cross_stream wait
  vmm_page,
  vmm_page_big_chunk,
  pinned_host,
  fixed_block_over_vmm_page,
  fixed_block_over_caching,
  vmm_page_map_worker,  // vmm_page_pool with map_worker:on (grants and unmaps on a thread)
  vmm_page_growth_slack,  // vmm_page_pool with growth_slack:0.25 (large runs kept whole)
  caching_release_idle,   // caching_pool over runtime, release_idle:on (idle segments freed
                          // before a new peak)
  vmm_page_small_classes,     // vmm_page_pool, small_classes:4, small_cache:256K (small
  caching_small_classes,      // blocks kept apart and often drained); caching_pool over
                              // runtime, the same
  count_
};
inline constexpr std::size_t pool_target_count = static_cast<std::size_t>(pool_target::count_);

inline const char* target_name(pool_target t) {
  switch (t) {
    case pool_target::caching_over_runtime: return "caching_pool_over_runtime";
    case pool_target::caching_over_vmm: return "caching_pool_over_vmm";
    case pool_target::caching_release_threshold: return "caching_pool_release_threshold_0";
    case pool_target::vmm_page: return "vmm_page_pool";
    case pool_target::vmm_page_big_chunk: return "vmm_page_pool_big_chunk_4";
    case pool_target::pinned_host: return "pinned_host_pool";
    case pool_target::fixed_block_over_vmm_page: return "fixed_block_pool_over_vmm_page_pool";
    case pool_target::fixed_block_over_caching: return "fixed_block_pool_over_caching_pool";
    case pool_target::vmm_page_map_worker: return "vmm_page_pool_map_worker";
    case pool_target::vmm_page_growth_slack: return "vmm_page_pool_growth_slack";
    case pool_target::caching_release_idle: return "caching_pool_release_idle";
    case pool_target::vmm_page_small_classes: return "vmm_page_pool_small_classes";
    case pool_target::caching_small_classes: return "caching_pool_small_classes";
    default: return "?";
  }
}

// Random bytes for one corpus entry: the same seed gives the same bytes everywhere.
inline std::vector<std::uint8_t> corpus_bytes(std::uint64_t seed, std::size_t bytes) {
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + 1);
  std::vector<std::uint8_t> out(bytes);
  for (auto& b : out) b = static_cast<std::uint8_t>(rng());
  return out;
}

namespace detail {

inline gpumem::sim_options device_options() {
  gpumem::sim_options o;
  o.capacity = 256 * MiB;  // small: the fuzzer reaches out of memory
  o.granularity = 2 * MiB;
  return o;
}

// The platform ops a fault may be injected into (streams are created by the driver
// itself, and event_destroy / stream_destroy run only in teardown paths that ignore them).
inline constexpr std::array<gpumem::platform_op, 16> fault_ops = {
    gpumem::platform_op::reserve_range,   gpumem::platform_op::free_range,
    gpumem::platform_op::create_physical, gpumem::platform_op::release_physical,
    gpumem::platform_op::map,             gpumem::platform_op::unmap,
    gpumem::platform_op::set_access,      gpumem::platform_op::runtime_malloc,
    gpumem::platform_op::runtime_free,    gpumem::platform_op::host_alloc,
    gpumem::platform_op::host_free,       gpumem::platform_op::stream_synchronize,
    gpumem::platform_op::event_create,    gpumem::platform_op::event_record,
    gpumem::platform_op::event_query,     gpumem::platform_op::memcpy_async,
};

// Arms one sim fault at a time: a new rule only once the previous one has fired (its op
// was called nth times since) or was passed over three times, so each failure is a single
// fault, as a driver gives them; undo paths run with the driver healthy. names(): every call a rule has targeted.
// With rules_at_once > 1, up to that many rules on different calls stay armed together, so
// a failure may strike inside another's undo (two faults in a row: RELIABILITY.md finding 4).
class fault_arm {
 public:
  explicit fault_arm(std::size_t rules_at_once = 1) : rules_at_once_(std::max<std::size_t>(1, rules_at_once)) {}
  void arm(gpumem::sim_platform& sim, byte_source& in, fuzz_counts& counts) {
    const auto op = fault_ops[in.u8() % fault_ops.size()];
    gpumem::sim_fault f;
    f.nth = 1 + in.u8() % 6;
    f.kind = in.u8() % 2 ? gpumem::failure_kind::out_of_memory : gpumem::failure_kind::driver_error;
    std::erase_if(rules_, [&](const rule& r) { return sim.calls_made(r.op) >= r.due; });
    // A rule whose op is not called for a while (not on this pool's paths) gives way.
    if (rules_.size() >= rules_at_once_ && ++waited_ < 3) return;
    waited_ = 0;
    if (rules_.size() >= rules_at_once_) {
      sim.clear_faults();
      rules_.clear();
    }
    std::erase_if(rules_, [&](const rule& r) { return r.op == op; });  // sim keeps one rule a call
    sim.inject_fault(op, f);
    rules_.push_back(rule{op, sim.calls_made(op) + f.nth});
    const std::string name(gpumem::platform_op_name(op));
    if (std::find(names_.begin(), names_.end(), name) == names_.end()) names_.push_back(name);
    ++counts.faults_armed;
  }
  bool pending(const gpumem::sim_platform& sim) const {
    return std::any_of(rules_.begin(), rules_.end(),
                       [&](const rule& r) { return sim.calls_made(r.op) < r.due; });
  }
  bool any() const { return !names_.empty(); }
  const std::vector<std::string>& names() const { return names_; }
  void clear(gpumem::sim_platform& sim) {
    sim.clear_faults();
    rules_.clear();
  }

 private:
  struct rule {
    gpumem::platform_op op;
    std::uint64_t due;  // calls_made(op) once it has fired
  };
  std::size_t rules_at_once_;
  std::vector<rule> rules_;
  int waited_ = 0;
  std::vector<std::string> names_;
};

// Bytes an allocation holds: its serial at both ends (n >= 16) and its byte in between —
// every byte up to 64 KiB; above that the first and last 4 KiB and a 64-byte stripe every
// 64 KiB (32 in each 2 MiB page), so multi-MiB blocks cost little to write and check
// (touching every host page of sim memory dominated the run time) while any page handed
// out twice, or remapped wrongly, still shows; address overlap is checked exactly.
inline constexpr std::size_t full_pattern_limit = 64 * KiB;

template <class Fn>
void for_each_pattern_range(std::size_t n, Fn&& fn) {
  if (n < 16) return fn(std::size_t{0}, n);
  if (n <= full_pattern_limit) return fn(std::size_t{8}, n - 8);
  fn(std::size_t{8}, std::size_t{4096});
  for (std::size_t k = full_pattern_limit; k + 4096 < n; k += full_pattern_limit) fn(k, k + 64);
  fn(n - 4096, n - 8);
}

inline unsigned char pattern_byte(std::uint64_t serial) {
  return static_cast<unsigned char>(1 + serial % 251);
}

inline void write_pattern(void* p, std::size_t n, std::uint64_t serial) {
  auto* bytes = static_cast<unsigned char*>(p);
  const unsigned char byte = pattern_byte(serial);
  for_each_pattern_range(n, [&](std::size_t from, std::size_t to) { std::memset(bytes + from, byte, to - from); });
  if (n >= 16) {
    std::memcpy(bytes, &serial, 8);
    std::memcpy(bytes + n - 8, &serial, 8);
  }
}

// Compares [from, to) of p against the pattern byte (a reference page per byte value,
// built once: refilling one buffer per call cost more than the comparisons).
inline bool range_holds(const void* p, std::size_t from, std::size_t to, unsigned char byte) {
  constexpr std::size_t chunk = 4 * KiB;
  static const std::vector<unsigned char> refs = [] {
    std::vector<unsigned char> r(256 * chunk);
    for (std::size_t b = 0; b < 256; ++b) std::memset(r.data() + b * chunk, static_cast<int>(b), chunk);
    return r;
  }();
  const unsigned char* ref = refs.data() + static_cast<std::size_t>(byte) * chunk;
  const auto* bytes = static_cast<const unsigned char*>(p);
  for (std::size_t at = from; at < to; at += chunk)
    if (std::memcmp(bytes + at, ref, std::min(chunk, to - at)) != 0) return false;
  return true;
}

// full: every patterned byte; otherwise the serials and the first 64 patterned bytes.
inline bool pattern_holds(const void* p, std::size_t n, std::uint64_t serial, bool full,
                          std::uint64_t& checked) {
  const unsigned char byte = pattern_byte(serial);
  if (n >= 16) {
    std::uint64_t head = 0, tail = 0;
    std::memcpy(&head, p, 8);
    std::memcpy(&tail, static_cast<const char*>(p) + n - 8, 8);
    if (head != serial || tail != serial) return false;
    checked += 16;
  }
  if (!full) {
    const std::size_t from = n < 16 ? 0 : 8, to = n < 16 ? n : std::min(n - 8, std::size_t{72});
    checked += to - from;
    return range_holds(p, from, to, byte);
  }
  bool ok = true;
  for_each_pattern_range(n, [&](std::size_t from, std::size_t to) {
    checked += to - from;
    ok = ok && range_holds(p, from, to, byte);
  });
  return ok;
}

// What every pool keeps within, whatever stream frees: reserved bytes at most twice the
// peak of the live (requested) bytes plus 64 MiB. The factor covers a freed block's memory
// that no later request fits (the pools serve a request from free memory when any free
// block fits it, so the free memory that is not reused is at most what was live at once)
// and rounding (a large block to whole 2 MiB pages or segments, an alignment's pad); the
// constant covers the per-size-class pieces of the small arena and the small caches (a few
// 2 MiB pages each) and one growth made before a merge could serve it. A pool that keeps a
// freed block apart for the stream that freed it (so the allocation's stream grows instead)
// passes this within tens of operations when frees go to other streams and little is live.
inline std::size_t reserved_bound(std::size_t peak_live) { return 2 * peak_live + 64 * MiB; }

// One pool under test, as the driver sees it.
class pool_under_test {
 public:
  virtual ~pool_under_test() = default;
  virtual void* allocate(std::size_t bytes, std::size_t alignment, gpumem::stream_handle s) = 0;
  virtual void deallocate(void* p, std::size_t bytes, gpumem::stream_handle s) = 0;
  virtual std::size_t trim() = 0;
  virtual void release_stream(gpumem::stream_handle s) = 0;
  virtual gpumem::resource_stats stats() const = 0;
  virtual std::string validate() const = 0;
  virtual std::size_t max_alignment() const = 0;
  virtual bool takes_alignment() const { return true; }
};

template <class Pool>
class resource_pool final : public pool_under_test {
 public:
  explicit resource_pool(Pool& p) : p_(p) {}
  void* allocate(std::size_t b, std::size_t a, gpumem::stream_handle s) override {
    return p_.allocate(b, a, s);
  }
  void deallocate(void* p, std::size_t b, gpumem::stream_handle s) override { p_.deallocate(p, b, s); }
  std::size_t trim() override { return p_.trim(); }
  void release_stream(gpumem::stream_handle s) override { p_.release_stream(s); }
  gpumem::resource_stats stats() const override { return p_.stats(); }
  std::string validate() const override { return p_.validate(); }
  std::size_t max_alignment() const override { return p_.max_alignment(); }

 private:
  Pool& p_;
};

class pinned_pool final : public pool_under_test {
 public:
  explicit pinned_pool(gpumem::pinned_host_pool& p) : p_(p) {}
  void* allocate(std::size_t b, std::size_t, gpumem::stream_handle s) override { return p_.allocate(b, s); }
  void deallocate(void* p, std::size_t b, gpumem::stream_handle s) override { p_.deallocate(p, b, s); }
  std::size_t trim() override { return p_.trim(); }
  void release_stream(gpumem::stream_handle s) override { p_.release_stream(s); }
  gpumem::resource_stats stats() const override { return p_.stats(); }
  std::string validate() const override { return p_.validate(); }
  std::size_t max_alignment() const override { return gpumem::default_alignment; }
  bool takes_alignment() const override { return false; }

 private:
  gpumem::pinned_host_pool& p_;
};

// Why a failure is acceptable: "" when it is typed as the circumstances allow.
inline std::string judge_failure(const std::exception_ptr& e, bool faults_armed,
                                 const std::vector<std::string>& armed_calls, bool oom_ok,
                                 fuzz_counts& counts) {
  try {
    std::rethrow_exception(e);
  } catch (const gpumem::out_of_memory& x) {
    ++counts.out_of_memory;
    if (faults_armed) ++counts.typed_failures;
    if (!oom_ok && !faults_armed) return std::string("unexpected out_of_memory: ") + x.what();
    if (std::string(x.what()).empty()) return "out_of_memory without a report";
    return {};
  } catch (const gpumem::cuda_error& x) {
    if (!faults_armed) return std::string("cuda_error with no fault injected: ") + x.what();
    if (std::find(armed_calls.begin(), armed_calls.end(), x.call()) == armed_calls.end())
      return "cuda_error names '" + x.call() + "', which no fault rule targets: " + x.what();
    if (std::string(x.what()).find("injected") == std::string::npos)
      return std::string("cuda_error does not carry the driver's message: ") + x.what();
    ++counts.typed_failures;
    return {};
  } catch (const gpumem::invalid_argument& x) {
    return std::string("unexpected invalid_argument: ") + x.what();
  } catch (const std::exception& x) {
    return std::string("untyped error: ") + x.what();
  } catch (...) {
    return "a non-std exception";
  }
}

}  // namespace detail

// --- pools --------------------------------------------------------------------------------

// Runs one input on `target`. fault_mode: the input may arm sim faults. max_ops bounds the
// operations (0: until the input ends).
// cross_stream: most frees on another stream than the allocation's, little live
// (pool_driver).
inline std::string run_pool_fuzz(pool_target target, const std::uint8_t* data, std::size_t size,
                                 bool fault_mode, std::size_t max_ops, fuzz_counts& counts,
                                 std::size_t fault_rules = 1, bool cross_stream = false);

// The fixed_block_pool driver (ids, not pointers). fault_rules as for run_pool_fuzz.
inline std::string run_fixed_block_fuzz(bool over_vmm_page, const std::uint8_t* data,
                                        std::size_t size, bool fault_mode, std::size_t max_ops,
                                        fuzz_counts& counts, std::size_t fault_rules = 1);

namespace detail {

struct live_block {
  std::size_t bytes;
  std::size_t alignment;
  std::size_t stream_slot;
  std::uint64_t serial;
};

class pool_driver {
 public:
  // cross_stream: most frees go to another stream than the allocation's, and at most
  // 24 MiB is live (so a pool that keeps freed memory apart per stream is caught quickly
  // by the reserved bound).
  pool_driver(gpumem::sim_platform& sim, pool_under_test& pool, byte_source& in, bool fault_mode,
              fuzz_counts& counts, std::size_t fault_rules = 1, bool cross_stream = false)
      : sim_(sim), pool_(pool), in_(in), fault_mode_(fault_mode), counts_(counts),
        faults_(fault_rules), cross_stream_(cross_stream) {}

  std::string run(std::size_t max_ops) {
    for (int i = 0; i < 2; ++i) {
      auto s = sim_.stream_create(0);
      if (!s) return "stream_create: " + s.error().describe();
      streams_[1 + i] = s.value();
    }
    std::string why;
    for (std::size_t step = 0; why.empty() && !in_.exhausted() && (max_ops == 0 || step < max_ops);
         ++step) {
      ++counts_.operations;
      why = one_step();
      if (why.empty()) why = check_model(false);
      if (!why.empty()) why = "step " + std::to_string(step) + ": " + why;
    }
    if (why.empty()) why = teardown();
    return why;
  }

  std::string teardown() {
    faults_.clear(sim_);
    sim_.complete_events();
    sim_.hold_events(false);
    if (auto why = check_model(true); !why.empty()) return "before teardown: " + why;
    // A map worker's unmap that failed while faults were armed is kept mapped and retried by
    // the pool's next call; trim retries it at once (waiting for the worker) and throws if
    // the retry fails, so what follows sees only failures of its own.
    if (fault_mode_) {
      try {
        pool_.trim();
      } catch (const gpumem::cuda_error&) {
        ++counts_.typed_failures;
      }
    }
    // Usable after everything: one round trip. When the pool refuses it with the device's
    // memory free (counted as oom_with_device_memory_free, which the corpus test requires
    // to be 0), it must at least work once everything is freed.
    bool refused = false;
    if (auto why = round_trip(refused); !why.empty()) return why;
    if (refused) ++counts_.oom_with_device_memory_free;
    while (!live_.empty()) {
      const auto it = live_.find(by_serial_.begin()->second);
      if (auto why = free_one(it, it->second.stream_slot); !why.empty()) return "teardown free: " + why;
    }
    try {
      pool_.trim();
      for (std::size_t i = 1; i < streams_.size(); ++i) pool_.release_stream(streams_[i]);
      for (auto s : extra_) pool_.release_stream(s);
    } catch (const std::exception& e) {
      return std::string("teardown: ") + e.what();
    }
    if (auto st = pool_.stats(); st.live_bytes != 0 || st.live_allocations != 0)
      return "live bytes left after freeing everything";
    if (refused) {
      bool again = false;
      if (auto why = round_trip(again); !why.empty() || again)
        return "pool unusable even with everything freed: " + why;
    }
    if (auto why = pool_.validate(); !why.empty()) return "invalid at the end: " + why;
    for (std::size_t i = 1; i < streams_.size(); ++i)
      if (!sim_.stream_destroy(streams_[i])) return "stream_destroy failed";
    for (auto s : extra_)
      if (!sim_.stream_destroy(s)) return "stream_destroy failed";
    return {};
  }

 private:
  using live_map = std::map<std::uintptr_t, live_block>;

  // Allocates, fills, checks and frees 3 MiB. refused: out_of_memory although the device
  // had 16 MiB free (then "" is returned); other failures are returned.
  std::string round_trip(bool& refused) {
    constexpr std::size_t n = 3 * MiB + 5;
    void* p = nullptr;
    try {
      p = pool_.allocate(n, gpumem::default_alignment, {});
    } catch (const gpumem::out_of_memory& e) {
      auto info = sim_.mem_info(0);
      if (info && info.value().free >= 16 * MiB) {
        refused = true;
        return {};
      }
      return std::string("pool unusable at the end: ") + e.what();
    } catch (const std::exception& e) {
      return std::string("pool unusable at the end: ") + e.what();
    }
    write_pattern(p, n, 0xfeed);
    std::uint64_t c = 0;
    if (!pattern_holds(p, n, 0xfeed, true, c)) return "final round trip lost bytes";
    try {
      pool_.deallocate(p, n, {});
    } catch (const std::exception& e) {
      return std::string("final free: ") + e.what();
    }
    return {};
  }

  // Slots 0-2: the default stream and the driver's two; from 3: streams made for a free
  // on a stream the pool never saw (extra_).
  gpumem::stream_handle stream(std::size_t slot) const {
    return slot < streams_.size() ? streams_[slot] : extra_[slot - streams_.size()];
  }
  std::size_t stream_slots() const { return streams_.size() + extra_.size(); }

  // A stream slot for a free: another stream the pool knows, or (up to 6 of them) a new
  // stream it has never seen.
  std::string any_stream_slot(std::size_t& slot) {
    if (in_.u8() % 4 == 0 && extra_.size() < 6) {
      auto s = sim_.stream_create(0);
      if (!s) return "stream_create: " + s.error().describe();
      extra_.push_back(s.value());
      slot = stream_slots() - 1;
      return {};
    }
    slot = in_.below(stream_slots());
    return {};
  }

  // A stream value the platform refuses: one it never made (sim makes odd values only), or
  // one the pool released and the driver destroyed.
  gpumem::stream_handle refused_stream() {
    if (!destroyed_.empty() && in_.u8() % 2) return destroyed_[in_.below(destroyed_.size())];
    return gpumem::stream_handle{0x1000 + 2 * std::uintptr_t{in_.u16()}};
  }

  std::size_t decode_size() {
    const std::uint8_t cls = in_.u8();
    if (cross_stream_ && cls % 2 == 0) {
      // Half the sizes climb from 1 KiB to 3 MiB and again, as a growing batch or
      // sequence does: a freed block then rarely fits the next request by itself, and
      // only merged with its free neighbours (whatever stream freed them) it serves.
      ramp_ = ramp_ >= 3 * MiB ? KiB : ramp_ + KiB * (1 + in_.u8() % 16);
      return ramp_;
    }
    const std::uint32_t r = in_.u32();
    switch (cls % 16) {
      case 0: case 1: case 2: return 1 + r % 64;                // tiny
      case 3: case 4: case 5: return 1 + r % (4 * KiB);         // small
      case 6: case 7: case 8: return 1 + r % (256 * KiB);
      case 9: case 10: return 1 + r % MiB;                      // up to the small threshold
      case 11: case 12: return MiB + r % (3 * MiB);             // a few MiB
      case 13: return 2 * MiB * (1 + r % 4);                    // exact pages
      case 14: return 4 * MiB + r % (12 * MiB);                 // multi-MiB
      default: return 1 + r % (64 * KiB);
    }
  }

  std::size_t decode_alignment() {
    static constexpr std::size_t choices[] = {0, 0, 0, 256, 512, 4096, 64 * KiB, 2 * MiB};
    const std::size_t a = choices[in_.u8() % 8];
    return a == 0 || a > pool_.max_alignment() ? gpumem::default_alignment : a;
  }

  // Every failure here is judged; a failed operation must leave the model's numbers.
  std::string judge(const std::exception_ptr& e, bool oom_ok) {
    return judge_failure(e, faults_.any(), faults_.names(), oom_ok, counts_);
  }

  std::string one_step() {
    const std::uint8_t op = in_.u8();
    switch (op % 32) {
      case 0: case 1: case 2: case 3: case 4: case 5: case 6: case 7: case 8: case 9:
      case 10: case 11:
        return allocate_one();
      case 12: case 13: case 14: case 15: case 16: case 17: case 18: case 19: {
        if (live_.empty()) return allocate_one();
        auto it = nth_live();
        // Its own stream mostly, another one sometimes (most times with cross_stream).
        std::size_t slot = it->second.stream_slot;
        if (in_.u8() % 4 < (cross_stream_ ? 3 : 1))
          if (auto why = any_stream_slot(slot); !why.empty()) return why;
        return free_one(it, slot);
      }
      case 20: return trim();
      case 21: return release_stream();
      case 22:
        if (in_.u8() % 2) sim_.hold_events(true);
        else {
          sim_.complete_events();
          sim_.hold_events(false);
        }
        return {};
      case 23: case 24: case 25: case 26: case 27: return bad_input();
      case 28: case 29:
        if (fault_mode_) return arm_fault();
        return allocate_one();
      case 30: return bad_stream();
      default: return allocate_one();
    }
  }

  std::string allocate_one() {
    const std::size_t bytes = decode_size();
    const std::size_t alignment = decode_alignment();
    // cross_stream: mostly on the driver's first stream, so most frees (on others) are
    // of memory that stream allocated and would reuse.
    const std::uint8_t pick = in_.u8();
    const std::size_t slot = cross_stream_ && pick % 4 != 0 ? 1 : pick % 3;
    if (live_bytes_ + bytes > (cross_stream_ ? 24 * MiB : 160 * MiB))
      return {};  // keep checking cheap; OOM still reached
    void* p = nullptr;
    try {
      p = pool_.allocate(bytes, alignment, stream(slot));
    } catch (const gpumem::out_of_memory&) {
      if (!faults_.pending(sim_)) {
        auto info = sim_.mem_info(0);
        if (info && info.value().free > 4 * bytes + 16 * MiB) ++counts_.oom_with_device_memory_free;
      }
      return judge(std::current_exception(), true);
    } catch (...) {
      return judge(std::current_exception(), true);
    }
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    if (p == nullptr) return "allocate returned null";
    if (addr % alignment != 0)
      return "address " + std::to_string(addr) + " breaks alignment " + std::to_string(alignment);
    // Overlap with the neighbours in address order.
    auto next = live_.lower_bound(addr);
    if (next != live_.end() && next->first < addr + bytes)
      return "new allocation of " + std::to_string(bytes) + " overlaps a live one of " +
             std::to_string(next->second.bytes) + " bytes";
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.bytes > addr)
        return "new allocation overlaps the live one before it";
    }
    const std::uint64_t serial = ++serial_;
    write_pattern(p, bytes, serial);
    live_.emplace(addr, live_block{bytes, alignment, slot, serial});
    by_serial_.emplace(serial, addr);
    live_bytes_ += bytes;
    peak_live_ = std::max(peak_live_, live_bytes_);
    ++counts_.allocations;
    return {};
  }

  std::string free_one(live_map::iterator it, std::size_t slot) {
    const auto addr = it->first;
    const live_block b = it->second;
    if (!pattern_holds(reinterpret_cast<void*>(addr), b.bytes, b.serial, true, counts_.bytes_checked))
      return "allocation " + std::to_string(b.serial) + " of " + std::to_string(b.bytes) +
             " bytes lost its bytes before its free";
    try {
      pool_.deallocate(reinterpret_cast<void*>(addr), b.bytes, stream(slot));
    } catch (...) {
      return judge(std::current_exception(), false);  // still owned: the model keeps it
    }
    if (stream(slot).value != stream(b.stream_slot).value) ++counts_.foreign_frees;
    by_serial_.erase(b.serial);
    live_.erase(it);
    live_bytes_ -= b.bytes;
    recently_freed_.push_back({addr, b.bytes});
    if (recently_freed_.size() > 16) recently_freed_.erase(recently_freed_.begin());
    return {};
  }

  std::string trim() {
    try {
      (void)pool_.trim();
    } catch (...) {
      return judge(std::current_exception(), false);
    }
    return {};
  }

  // Forgets a stream and replaces it by a fresh one; live allocations of it are freed
  // later on the default stream.
  std::string release_stream() {
    const std::size_t slot = 1 + in_.u8() % 2;
    try {
      pool_.release_stream(streams_[slot]);
    } catch (...) {
      return judge(std::current_exception(), false);
    }
    if (!sim_.stream_destroy(streams_[slot])) return "stream_destroy failed";
    destroyed_.push_back(streams_[slot]);
    auto s = sim_.stream_create(0);
    if (!s) return "stream_create: " + s.error().describe();
    streams_[slot] = s.value();
    for (auto& [a, b] : live_)
      if (b.stream_slot == slot) b.stream_slot = 0;
    return {};
  }

  // A free (of a live allocation) or an allocation on a stream the platform refuses:
  // invalid_argument, no counter changed, the allocation still live and intact (checked by
  // the step's model check).
  std::string bad_stream() {
    const auto before = pool_.stats();
    const gpumem::stream_handle bad = refused_stream();
    std::string what;
    std::string message = "not refused";
    auto attempt = [&](auto&& fn) {
      try {
        fn();
      } catch (const gpumem::invalid_argument&) {
        message.clear();
      } catch (const std::exception& e) {
        message = std::string("wrong exception type: ") + e.what();
      }
    };
    if (!live_.empty() && in_.u8() % 4 != 0) {
      auto it = nth_live();
      what = "a free on refused stream " + std::to_string(bad.value);
      attempt([&] { pool_.deallocate(reinterpret_cast<void*>(it->first), it->second.bytes, bad); });
    } else {
      what = "an allocation on refused stream " + std::to_string(bad.value);
      attempt([&] { (void)pool_.allocate(4096, gpumem::default_alignment, bad); });
    }
    ++counts_.bad_inputs;
    ++counts_.bad_stream_calls;
    if (!message.empty()) return what + ": " + message;
    const auto after = pool_.stats();
    if (after.live_bytes != before.live_bytes || after.live_allocations != before.live_allocations ||
        after.reserved_bytes != before.reserved_bytes || after.allocations != before.allocations ||
        after.deallocations != before.deallocations)
      return what + " changed the pool's counters";
    return {};
  }

  std::string arm_fault() {
    faults_.arm(sim_, in_, counts_);
    return {};
  }

  // One bad input: it must throw invalid_argument and change no counter.
  std::string bad_input() {
    const auto before = pool_.stats();
    const std::uint8_t kind = in_.u8() % 9;
    std::string what;
    bool threw = false;
    std::string message;
    auto attempt = [&](auto&& fn) {
      try {
        fn();
      } catch (const gpumem::invalid_argument& e) {
        threw = true;
        message = e.what();
      } catch (const std::exception& e) {
        message = std::string("wrong exception type: ") + e.what();
      }
    };
    int local = 0;
    static int static_object = 0;
    switch (kind) {
      case 0: {  // double free of a recent free whose address is not live again
        what = "double free";
        auto f = std::find_if(recently_freed_.rbegin(), recently_freed_.rend(), [&](const auto& r) {
          return !covered_by_live(r.first);
        });
        if (f == recently_freed_.rend()) return {};
        attempt([&] { pool_.deallocate(reinterpret_cast<void*>(f->first), f->second, stream(0)); });
        break;
      }
      case 1: {  // interior pointer
        what = "interior pointer";
        auto it = pick_live(2);
        if (it == live_.end()) return {};
        const std::size_t off = 1 + in_.u32() % (it->second.bytes - 1);
        attempt([&] { pool_.deallocate(reinterpret_cast<void*>(it->first + off), 1, stream(0)); });
        break;
      }
      case 2:
        what = "unknown (stack) pointer";
        attempt([&] { pool_.deallocate(&local, sizeof local, stream(0)); });
        break;
      case 3:
        what = "unknown (static) pointer";
        attempt([&] { pool_.deallocate(&static_object, sizeof static_object, stream(0)); });
        break;
      case 4:
        what = "null pointer";
        attempt([&] { pool_.deallocate(nullptr, 64, stream(0)); });
        break;
      case 5: {
        what = "size mismatch";
        auto it = pick_live(1);
        if (it == live_.end()) return {};
        attempt([&] { pool_.deallocate(reinterpret_cast<void*>(it->first), it->second.bytes + 1, stream(0)); });
        break;
      }
      case 6:
        what = "size 0";
        attempt([&] { (void)pool_.allocate(0, gpumem::default_alignment, stream(0)); });
        break;
      case 7: {
        what = "absurd size";
        const std::size_t sizes[] = {std::size_t{1} << 62, ~std::size_t{0}, 300 * gpumem_fuzz::MiB * 1024};
        const std::size_t n = sizes[in_.u8() % 3];
        attempt([&] { (void)pool_.allocate(n, gpumem::default_alignment, stream(0)); });
        break;
      }
      default: {
        if (!pool_.takes_alignment()) return {};
        what = "bad alignment";
        const std::size_t a = in_.u8() % 2 ? 3 + 2 * (in_.u8() % 100) : pool_.max_alignment() * 2;
        attempt([&] { (void)pool_.allocate(64, a, stream(0)); });
        break;
      }
    }
    ++counts_.bad_inputs;
    if (!threw) {
      // Under a fault a refusal could not be reached only if the call failed otherwise:
      // bad input is checked before any driver call, so it must still be refused.
      return what + " was not refused with invalid_argument" +
             (message.empty() ? "" : " (" + message + ")");
    }
    const auto after = pool_.stats();
    if (after.live_bytes != before.live_bytes || after.live_allocations != before.live_allocations ||
        after.reserved_bytes != before.reserved_bytes || after.allocations != before.allocations ||
        after.deallocations != before.deallocations)
      return what + " changed the pool's counters";
    return {};
  }

  bool covered_by_live(std::uintptr_t addr) const {
    auto next = live_.upper_bound(addr);
    if (next == live_.begin()) return false;
    auto prev = std::prev(next);
    return addr == prev->first;  // a live block's start: freeing it would be a real free
  }

  // The live allocation the input names: the k-th in the order they were made, never in
  // address order (addresses come from the host's layout on sim, so an address-ordered
  // pick would make the operations, and the pool's results, vary from run to run).
  live_map::iterator nth_live() {
    auto by = by_serial_.begin();
    std::advance(by, static_cast<std::ptrdiff_t>(in_.below(by_serial_.size())));
    return live_.find(by->second);
  }
  live_map::iterator pick_live(std::size_t min_bytes) {
    if (live_.empty()) return live_.end();
    auto it = nth_live();
    return it->second.bytes >= min_bytes ? it : live_.end();
  }

  std::string check_model(bool full) {
    std::size_t bytes = 0;
    for (auto& [addr, b] : live_) {
      bytes += b.bytes;
      if (!pattern_holds(reinterpret_cast<void*>(addr), b.bytes, b.serial, full, counts_.bytes_checked))
        return "live allocation " + std::to_string(b.serial) + " (" + std::to_string(b.bytes) +
               " bytes) was overwritten";
    }
    const auto st = pool_.stats();
    if (st.live_bytes != bytes || st.live_allocations != live_.size())
      return "stats say " + std::to_string(st.live_bytes) + " bytes in " +
             std::to_string(st.live_allocations) + " allocations, the model " +
             std::to_string(bytes) + " in " + std::to_string(live_.size());
    if (auto why = pool_.validate(); !why.empty()) return "validate: " + why;
    counts_.reserved_sum += st.reserved_bytes;
    if (st.reserved_bytes > 2 * peak_live_)
      counts_.worst_reserved_over_peak =
          std::max(counts_.worst_reserved_over_peak, st.reserved_bytes - 2 * peak_live_);
    if (st.reserved_bytes > reserved_bound(peak_live_))
      return "reserved " + std::to_string(st.reserved_bytes) + " bytes, over the bound " +
             std::to_string(reserved_bound(peak_live_)) + " for peak live " +
             std::to_string(peak_live_) + " bytes (" + std::to_string(counts_.foreign_frees) +
             " frees on another stream so far)";
    return {};
  }

  gpumem::sim_platform& sim_;
  pool_under_test& pool_;
  byte_source& in_;
  bool fault_mode_;
  fuzz_counts& counts_;
  std::array<gpumem::stream_handle, 3> streams_{};
  live_map live_;
  std::size_t live_bytes_ = 0;
  std::uint64_t serial_ = 0;
  std::vector<std::pair<std::uintptr_t, std::size_t>> recently_freed_;
  std::map<std::uint64_t, std::uintptr_t> by_serial_;  // the live allocations: serial -> address
  fault_arm faults_;
  bool cross_stream_ = false;
  std::size_t peak_live_ = 0;                    // the model's peak of live_bytes_
  std::size_t ramp_ = 0;                         // cross_stream's climbing size
  std::vector<gpumem::stream_handle> extra_;     // made for frees, released at teardown
  std::vector<gpumem::stream_handle> destroyed_;  // released, then destroyed
};

// Destroys the pool stack, then checks sim holds nothing.
inline std::string leak_check(gpumem::sim_platform& sim) {
  sim.clear_faults();
  if (auto live = sim.live_objects(); !live.none()) return "left on the sim device: " + live.describe();
  if (auto why = sim.validate(); !why.empty()) return "sim invalid: " + why;
  return {};
}

}  // namespace detail

inline std::string run_pool_fuzz(pool_target target, const std::uint8_t* data, std::size_t size,
                                 bool fault_mode, std::size_t max_ops, fuzz_counts& counts,
                                 std::size_t fault_rules, bool cross_stream) {
  if (target == pool_target::fixed_block_over_vmm_page || target == pool_target::fixed_block_over_caching)
    return run_fixed_block_fuzz(target == pool_target::fixed_block_over_vmm_page, data, size,
                                fault_mode, max_ops, counts, fault_rules);
  ++counts.runs;
  gpumem::sim_platform sim(detail::device_options());
  byte_source in(data, size);
  std::string why;
  {
    std::unique_ptr<gpumem::memory_resource> upstream;
    std::unique_ptr<gpumem::caching_pool> caching;
    std::unique_ptr<gpumem::vmm_page_pool> pages;
    std::unique_ptr<gpumem::pinned_host_pool> pinned;
    std::unique_ptr<detail::pool_under_test> pool;
    gpumem::pool_options o;
    switch (target) {
      case pool_target::caching_over_runtime:
        upstream = std::make_unique<gpumem::runtime_resource>(sim);
        caching = std::make_unique<gpumem::caching_pool>(*upstream, o);
        break;
      case pool_target::caching_over_vmm:
        upstream = std::make_unique<gpumem::vmm_resource>(sim);
        caching = std::make_unique<gpumem::caching_pool>(*upstream, o);
        break;
      case pool_target::caching_release_threshold:
        o.release_threshold = 0;
        o.cross_stream = gpumem::cross_stream_policy::wait;
        upstream = std::make_unique<gpumem::runtime_resource>(sim);
        caching = std::make_unique<gpumem::caching_pool>(*upstream, o);
        break;
      case pool_target::vmm_page:
        pages = std::make_unique<gpumem::vmm_page_pool>(sim, 0, o);
        break;
      case pool_target::vmm_page_big_chunk:
        o.big_chunk_pages = 4;
        // Requests of 8 MiB and more count as huge: a free run holding half of one is grown
        // in place, and new runs keep off the address space above such runs.
        o.huge_growth_bytes = 8 * MiB;
        pages = std::make_unique<gpumem::vmm_page_pool>(sim, 0, o);
        break;
      case pool_target::vmm_page_map_worker:
        o.map_worker = gpumem::map_worker_mode::on;
        pages = std::make_unique<gpumem::vmm_page_pool>(sim, 0, o);
        break;
      case pool_target::vmm_page_growth_slack:
        o.growth_slack = 0.25;
        pages = std::make_unique<gpumem::vmm_page_pool>(sim, 0, o);
        break;
      case pool_target::caching_release_idle:
        o.release_idle = true;
        upstream = std::make_unique<gpumem::runtime_resource>(sim);
        caching = std::make_unique<gpumem::caching_pool>(*upstream, o);
        break;
      case pool_target::vmm_page_small_classes:
        o.small_classes = 4;
        o.small_cache = 256 * KiB;
        pages = std::make_unique<gpumem::vmm_page_pool>(sim, 0, o);
        break;
      case pool_target::caching_small_classes:
        o.small_classes = 4;
        o.small_cache = 256 * KiB;
        upstream = std::make_unique<gpumem::runtime_resource>(sim);
        caching = std::make_unique<gpumem::caching_pool>(*upstream, o);
        break;
      default:
        pinned = std::make_unique<gpumem::pinned_host_pool>(sim, 0, o);
        break;
    }
    if (caching) pool = std::make_unique<detail::resource_pool<gpumem::caching_pool>>(*caching);
    else if (pages) pool = std::make_unique<detail::resource_pool<gpumem::vmm_page_pool>>(*pages);
    else pool = std::make_unique<detail::pinned_pool>(*pinned);
    detail::pool_driver driver(sim, *pool, in, fault_mode, counts, fault_rules, cross_stream);
    why = driver.run(max_ops);
    sim.clear_faults();
  }
  if (why.empty()) why = detail::leak_check(sim);
  return why.empty() ? why
                     : std::string(target_name(target)) + (fault_mode ? " (faults)" : "") +
                           (cross_stream ? " (cross-stream)" : "") + ": " + why;
}

inline std::string run_fixed_block_fuzz(bool over_vmm_page, const std::uint8_t* data,
                                        std::size_t size, bool fault_mode, std::size_t max_ops,
                                        fuzz_counts& counts, std::size_t fault_rules) {
  ++counts.runs;
  gpumem::sim_platform sim(detail::device_options());
  byte_source in(data, size);
  std::string why;
  detail::fault_arm faults(fault_rules);
  {
    std::unique_ptr<gpumem::memory_resource> runtime;
    std::unique_ptr<gpumem::memory_resource> upstream;
    if (over_vmm_page) {
      upstream = std::make_unique<gpumem::vmm_page_pool>(sim);
    } else {
      runtime = std::make_unique<gpumem::runtime_resource>(sim);
      upstream = std::make_unique<gpumem::caching_pool>(*runtime);
    }
    static constexpr std::size_t block_sizes[] = {256, 4 * KiB, 64 * KiB, 768 * KiB, 2 * MiB, 3 * MiB};
    const std::size_t block = block_sizes[in.u8() % 6];
    const std::size_t per_chunk = in.u8() % 3 == 0 ? 1 + in.u8() % 8 : 0;
    std::size_t cap = in.u8() % 2 ? 0 : 8 + in.u8() % 200;
    if (per_chunk != 0 && cap != 0 && cap < per_chunk) cap = per_chunk;
    gpumem::fixed_block_pool pool(*upstream, block, per_chunk, cap);
    std::map<gpumem::fixed_block_pool::block_id, std::uint64_t> live;  // id -> serial
    std::map<std::uintptr_t, gpumem::fixed_block_pool::block_id> by_address;
    std::vector<gpumem::fixed_block_pool::block_id> freed;
    std::uint64_t serial = 0;
    auto judge = [&](const std::exception_ptr& e, bool oom_ok) {
      return detail::judge_failure(e, faults.any(), faults.names(), oom_ok, counts);
    };
    auto check = [&](bool full) -> std::string {
      for (auto& [id, s] : live) {
        if (!pool.is_used(id)) return "live block " + std::to_string(id) + " not marked used";
        if (!detail::pattern_holds(pool.address(id), block, s, full, counts.bytes_checked))
          return "block " + std::to_string(id) + " lost its bytes";
      }
      if (pool.used_blocks() != live.size())
        return "used_blocks " + std::to_string(pool.used_blocks()) + " != model " + std::to_string(live.size());
      if (auto w = pool.validate(); !w.empty()) return "validate: " + w;
      if (auto w = upstream->validate(); !w.empty()) return "upstream validate: " + w;
      return {};
    };
    for (std::size_t step = 0; why.empty() && !in.exhausted() && (max_ops == 0 || step < max_ops); ++step) {
      ++counts.operations;
      const std::uint8_t op = in.u8() % 16;
      if (op < 7 || live.empty()) {
        std::optional<gpumem::fixed_block_pool::block_id> id;
        try {
          if (op % 2) id = pool.try_allocate();
          else id = pool.allocate();
        } catch (...) {
          why = judge(std::current_exception(), true);
        }
        if (why.empty() && id) {
          const auto addr = reinterpret_cast<std::uintptr_t>(pool.address(*id));
          if (live.contains(*id)) why = "id " + std::to_string(*id) + " handed out twice";
          auto next = by_address.lower_bound(addr);
          if (next != by_address.end() && next->first < addr + block) why = "blocks overlap";
          if (next != by_address.begin() && std::prev(next)->first + block > addr) why = "blocks overlap";
          if (addr % 256 != 0) why = "block address not 256-byte aligned";
          if (why.empty()) {
            live.emplace(*id, ++serial);
            by_address.emplace(addr, *id);
            detail::write_pattern(pool.address(*id), block, serial);
            ++counts.allocations;
          }
        }
      } else if (op < 12) {
        auto it = live.begin();
        std::advance(it, static_cast<std::ptrdiff_t>(in.below(live.size())));
        if (!detail::pattern_holds(pool.address(it->first), block, it->second, true, counts.bytes_checked))
          why = "block lost its bytes before its free";
        else {
          by_address.erase(reinterpret_cast<std::uintptr_t>(pool.address(it->first)));
          pool.free(it->first);
          freed.push_back(it->first);
          live.erase(it);
        }
      } else if (op == 12) {
        try {
          (void)pool.shrink();
        } catch (...) {
          why = judge(std::current_exception(), false);
        }
        freed.clear();  // ids of given-back chunks read "never allocated" now: still refused
      } else if (op == 13) {
        try {
          (void)pool.reserve(pool.capacity_blocks() + in.u8() % 16);
        } catch (...) {
          why = judge(std::current_exception(), false);
        }
      } else if (op == 14) {  // bad input: double free, never-allocated id, absurd id
        const std::size_t used_before = pool.used_blocks(), cap_before = pool.capacity_blocks();
        gpumem::fixed_block_pool::block_id bad;
        const std::uint8_t k = in.u8() % 3;
        if (k == 0 && !freed.empty() && !live.contains(freed.back())) bad = freed.back();
        else if (k == 1) bad = static_cast<gpumem::fixed_block_pool::block_id>(pool.capacity_blocks() + in.u8());
        else bad = 0xfffffff0u;
        if (live.contains(bad)) continue;
        ++counts.bad_inputs;
        try {
          pool.free(bad);
          why = "free of bad id " + std::to_string(bad) + " was accepted";
        } catch (const gpumem::invalid_argument&) {
        } catch (const std::exception& e) {
          why = std::string("bad id: wrong exception: ") + e.what();
        }
        if (why.empty() && (pool.used_blocks() != used_before || pool.capacity_blocks() != cap_before))
          why = "a refused free changed the pool";
      } else if (fault_mode) {
        faults.arm(sim, in, counts);
      }
      if (why.empty()) why = check(false);
      if (!why.empty()) why = "step " + std::to_string(step) + ": " + why;
    }
    sim.clear_faults();
    if (why.empty()) why = check(true);
    if (why.empty()) {
      for (auto& [id, s] : live) pool.free(id);
      live.clear();
      (void)pool.shrink();
      if (pool.capacity_blocks() != 0) why = "capacity left after shrinking an empty pool";
      if (auto w = pool.validate(); !w.empty()) why = "validate at the end: " + w;
    }
  }
  if (why.empty()) why = detail::leak_check(sim);
  return why.empty() ? why
                     : std::string(over_vmm_page ? "fixed_block_pool_over_vmm_page_pool"
                                                 : "fixed_block_pool_over_caching_pool") +
                           (fault_mode ? " (faults)" : "") + ": " + why;
}

}  // namespace gpumem_fuzz
