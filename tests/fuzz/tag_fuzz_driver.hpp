// The tags' reference-model fuzz driver (shared by fuzz_tags.cpp and tag_fuzz_corpus_test.cpp),
// through the C API on a private sim device. Bytes decode into tagged and untagged
// allocations (tags 0-3 and the shared tag), frees (of live allocations, and refused ones:
// interior, already freed), sleep (offload or discard) and wake of every tag (never used,
// empty, holding pages, asleep), trim, record_stream on a side stream, export / import of
// shared allocations, and stats. The model checks after each step:
//  - the pool's live bytes and count are the model's (imports excepted: another process's
//    memory); the pool's stats equal the sum of its tags' (tag_stats), reserved and live;
//  - each tag's live bytes, and asleep state (gpumem_tag_asleep), are the model's; a call
//    the model refuses is refused with GPUMEM_ERROR_INVALID_ARGUMENT and changes nothing;
//  - no two live allocations overlap; each awake allocation keeps its bytes, across
//    offload sleep and wake too (discard leaves them unspecified: not checked after);
//  - a free of an allocation recorded on the side stream adds one cross-stream wait,
//    whatever its tag; no other free does.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include "fuzz/fuzz_driver.hpp"
#include "gpumem/interop/gpumem.h"

namespace gpumem_fuzz {

namespace detail {

class tag_driver {
 public:
  tag_driver(gpumem_pool* pool, void* side, byte_source& in, fuzz_counts& counts)
      : pool_(pool), side_(side), in_(in), counts_(counts) {}

  std::string run(std::size_t max_ops) {
    std::string why;
    for (std::size_t step = 0; why.empty() && !in_.exhausted() && (max_ops == 0 || step < max_ops);
         ++step) {
      ++counts_.operations;
      why = one_step();
      if (why.empty()) why = check(step % 8 == 0);
      if (!why.empty()) why = "step " + std::to_string(step) + ": " + why;
    }
    if (why.empty()) why = check(true);
    if (why.empty()) why = teardown();
    return why;
  }

 private:
  static constexpr std::uint32_t shared = GPUMEM_TAG_SHARED;
  static constexpr std::size_t checked_bytes = 8192;  // head and tail of each allocation
  struct allocation {
    std::size_t bytes = 0;
    std::uint32_t tag = 0;
    unsigned seed = 0;
    bool intact = true;     // false once a discard sleep dropped its bytes
    bool recorded = false;  // on the side stream
    bool imported = false;  // an import of a shared allocation: not in the live totals
  };
  struct tag_model {
    bool used = false;  // allocated in at least once (tag 0 always)
    bool asleep = false;
    // Partly asleep after a failed wake: a sleep completes the sleep (in the first sleep's
    // mode), a wake completes the wake.
    bool partly = false;
  };

  std::uint32_t pick_tag() {
    const std::uint32_t t = in_.u8() % 5;
    return t == 4 ? shared : t;
  }
  tag_model& model_of(std::uint32_t tag) { return tags_[tag]; }

  static unsigned char byte_at(std::size_t i, unsigned seed) {
    return static_cast<unsigned char>((i * 131u + seed * 17u) & 0xffu);
  }
  template <class F>
  static void for_checked(std::size_t bytes, F&& f) {
    const std::size_t head = std::min(bytes, checked_bytes);
    for (std::size_t i = 0; i < head; ++i) f(i);
    for (std::size_t i = std::max(head, bytes > checked_bytes ? bytes - checked_bytes : 0); i < bytes; ++i) f(i);
  }
  void write(void* p, const allocation& a) {
    auto* b = static_cast<unsigned char*>(p);
    for_checked(a.bytes, [&](std::size_t i) { b[i] = byte_at(i, a.seed); });
  }
  bool intact(std::uintptr_t addr, const allocation& a) {
    const auto* b = reinterpret_cast<const unsigned char*>(addr);
    bool ok = true;
    for_checked(a.bytes, [&](std::size_t i) { ok = ok && b[i] == byte_at(i, a.seed); });
    counts_.bytes_checked += std::min(a.bytes, 2 * checked_bytes);
    return ok;
  }
  bool readable(const allocation& a) {
    return !a.imported && a.intact && !(a.tag != shared && model_of(a.tag).asleep);
  }

  std::string expect(gpumem_status got, gpumem_status want, const char* what) {
    if (got == want) return {};
    return std::string(what) + ": " + gpumem_status_name(got) + " where the model expects " +
           gpumem_status_name(want) + " (" + gpumem_last_error() + ")";
  }

  std::string overlaps(std::uintptr_t addr, std::size_t bytes) const {
    auto next = live_.lower_bound(addr);
    if (next != live_.end() && next->first < addr + bytes) return "overlaps a live allocation";
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.bytes > addr) return "overlaps a live allocation";
    }
    return {};
  }

  std::string allocate() {
    // 48 MiB: a few of them, over tags, fill the 256 MiB device (out of memory is reached).
    static constexpr std::size_t sizes[] = {512, 4096, 100 * 1024, 2 * MiB + 100, 6 * MiB, 48 * MiB};
    const std::uint32_t tag = pick_tag();
    const std::size_t bytes = sizes[in_.u8() % 6];
    void* p = nullptr;
    const gpumem_status st = tag == 0 && in_.u8() % 2 == 0
                                 ? gpumem_allocate(pool_, bytes, 256, nullptr, &p)
                                 : gpumem_allocate_tagged(pool_, bytes, 256, nullptr, tag, &p);
    if (tag != shared && model_of(tag).asleep) {
      ++counts_.bad_inputs;
      return expect(st, GPUMEM_ERROR_INVALID_ARGUMENT, "allocation in a sleeping tag");
    }
    if (st == GPUMEM_ERROR_OUT_OF_MEMORY) {
      ++counts_.out_of_memory;
      return {};
    }
    if (auto why = expect(st, GPUMEM_SUCCESS, "allocation"); !why.empty()) return why;
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    if (auto why = overlaps(addr, bytes); !why.empty()) return why;
    allocation a{bytes, tag, ++seed_};
    write(p, a);
    live_.emplace(addr, a);
    model_of(tag).used = true;
    ++counts_.allocations;
    return {};
  }

  std::map<std::uintptr_t, allocation>::iterator pick_live() {
    auto it = live_.begin();
    std::advance(it, in_.below(live_.size()));
    return it;
  }

  std::string free_one() {
    if (live_.empty()) return {};
    auto it = pick_live();
    const allocation a = it->second;
    if (readable(a) && !intact(it->first, a))
      return "the bytes of an allocation of tag " + std::to_string(a.tag) + " changed";
    const std::uint64_t waits = cross_stream_waits();
    if (auto why = expect(gpumem_free(pool_, reinterpret_cast<void*>(it->first), a.bytes, nullptr),
                          GPUMEM_SUCCESS, "free");
        !why.empty())
      return why;
    if (cross_stream_waits() != waits + (a.recorded ? 1 : 0))
      return "a free of a " + std::string(a.recorded ? "recorded" : "unrecorded") +
             " allocation of tag " + std::to_string(a.tag) + " made " +
             std::to_string(cross_stream_waits() - waits) + " cross-stream waits";
    freed_.insert(it->first);
    live_.erase(it);
    return {};
  }

  std::string bad_free() {
    ++counts_.bad_inputs;
    if (!live_.empty() && in_.u8() % 2) {
      auto it = pick_live();
      if (it->second.bytes <= 512) return {};
      return expect(gpumem_free(pool_, reinterpret_cast<void*>(it->first + 256), 256, nullptr),
                    GPUMEM_ERROR_INVALID_ARGUMENT, "free of an interior pointer");
    }
    for (std::uintptr_t addr : freed_)
      if (overlaps(addr, 1).empty())
        return expect(gpumem_free(pool_, reinterpret_cast<void*>(addr), 512, nullptr),
                      GPUMEM_ERROR_INVALID_ARGUMENT, "double free");
    return {};
  }

  std::string sleep() {
    const std::uint32_t tag = pick_tag();
    const int mode = in_.u8() % 2 ? GPUMEM_SLEEP_OFFLOAD : GPUMEM_SLEEP_DISCARD;
    const gpumem_status st = gpumem_sleep(pool_, tag, mode, nullptr);
    tag_model& m = model_of(tag);
    if (tag == shared || !m.used || (m.asleep && !m.partly)) {
      ++counts_.bad_inputs;
      return expect(st, GPUMEM_ERROR_INVALID_ARGUMENT, "refused sleep");
    }
    if (st == GPUMEM_ERROR_OUT_OF_MEMORY) {  // no pinned host memory for the copy
      ++counts_.out_of_memory;
      return {};
    }
    if (auto why = expect(st, GPUMEM_SUCCESS, "sleep"); !why.empty()) return why;
    m.asleep = true;
    m.partly = false;
    if (mode == GPUMEM_SLEEP_DISCARD)
      for (auto& [addr, a] : live_)
        if (a.tag == tag) a.intact = false;
    return {};
  }

  std::string wake() {
    const std::uint32_t tag = pick_tag();
    const gpumem_status st = gpumem_wake(pool_, tag, nullptr);
    tag_model& m = model_of(tag);
    if (tag == shared || !m.asleep) {
      ++counts_.bad_inputs;
      return expect(st, GPUMEM_ERROR_INVALID_ARGUMENT, "refused wake");
    }
    if (st == GPUMEM_ERROR_OUT_OF_MEMORY) {  // the device is full: the tag stays (partly) asleep
      ++counts_.out_of_memory;
      m.partly = true;
      return {};
    }
    if (auto why = expect(st, GPUMEM_SUCCESS, "wake"); !why.empty()) return why;
    m.asleep = false;
    m.partly = false;
    return {};
  }

  std::string record() {
    if (live_.empty()) return {};
    auto it = pick_live();
    if (auto why = expect(gpumem_record_stream(pool_, reinterpret_cast<void*>(it->first), side_),
                          GPUMEM_SUCCESS, "record_stream");
        !why.empty())
      return why + " (tag " + std::to_string(it->second.tag) + ")";
    it->second.recorded = true;
    if (it->second.bytes > 512) {
      ++counts_.bad_inputs;
      return expect(gpumem_record_stream(pool_, reinterpret_cast<void*>(it->first + 256), side_),
                    GPUMEM_ERROR_INVALID_ARGUMENT, "record_stream of an interior pointer");
    }
    return {};
  }

  std::string import() {
    for (auto& [addr, a] : live_) {
      if (a.tag != shared || a.imported) continue;
      int fd = -1;
      if (auto why = expect(gpumem_export(pool_, reinterpret_cast<void*>(addr), &fd),
                            GPUMEM_SUCCESS, "export");
          !why.empty())
        return why;
      void* p = nullptr;
      const gpumem_status st = gpumem_import(pool_, fd, a.bytes, &p);
      close(fd);
      if (st == GPUMEM_ERROR_OUT_OF_MEMORY) return {};
      if (auto why = expect(st, GPUMEM_SUCCESS, "import"); !why.empty()) return why;
      const auto at = reinterpret_cast<std::uintptr_t>(p);
      if (auto why = overlaps(at, a.bytes); !why.empty()) return "import " + why;
      allocation imp = a;
      imp.imported = true;
      imp.recorded = false;
      live_.emplace(at, imp);
      return {};
    }
    return {};
  }

  std::string trim() {
    std::uint64_t released = 0;
    return expect(gpumem_pool_trim(pool_, &released), GPUMEM_SUCCESS, "trim");
  }

  std::string one_step() {
    switch (in_.u8() % 16) {
      case 0: case 1: case 2: case 3: case 4: return allocate();
      case 5: case 6: case 7: return free_one();
      case 8: return bad_free();
      case 9: case 10: return sleep();
      case 11: case 12: return wake();
      case 13: return record();
      case 14: return import();
      default: return trim();
    }
  }

  std::uint64_t cross_stream_waits() {
    gpumem_stats s{};
    gpumem_pool_stats(pool_, &s);
    return s.cross_stream_waits;
  }

  std::string check(bool bytes) {
    gpumem_stats all{};
    if (auto why = expect(gpumem_pool_stats(pool_, &all), GPUMEM_SUCCESS, "pool stats"); !why.empty())
      return why;
    std::map<std::uint32_t, std::pair<std::uint64_t, std::uint64_t>> model;  // bytes, count
    std::uint64_t live_bytes = 0, live_count = 0;
    for (auto& [addr, a] : live_) {
      if (a.imported) continue;
      live_bytes += a.bytes;
      ++live_count;
      model[a.tag].first += a.bytes;
      model[a.tag].second += 1;
      if (bytes && readable(a) && !intact(addr, a))
        return "the bytes of a live allocation of tag " + std::to_string(a.tag) + " changed";
    }
    if (all.live_bytes != live_bytes || all.live_allocations != live_count)
      return "pool stats: " + std::to_string(all.live_bytes) + " live bytes in " +
             std::to_string(all.live_allocations) + ", the model " + std::to_string(live_bytes) +
             " in " + std::to_string(live_count);
    std::uint64_t reserved = 0, tagged_live = 0;
    for (std::uint32_t tag : {0u, 1u, 2u, 3u, shared}) {
      gpumem_stats s{};
      if (auto why = expect(gpumem_tag_stats(pool_, tag, &s), GPUMEM_SUCCESS, "tag stats"); !why.empty())
        return why;
      reserved += s.reserved_bytes;
      tagged_live += s.live_bytes;
      if (s.live_bytes != model[tag].first || s.live_allocations != model[tag].second)
        return "tag " + std::to_string(tag) + ": " + std::to_string(s.live_bytes) +
               " live bytes, the model " + std::to_string(model[tag].first);
      const int asleep = gpumem_tag_asleep(pool_, tag);
      if (tag != shared && asleep != (model_of(tag).asleep ? 1 : 0))
        return "tag " + std::to_string(tag) + ": gpumem_tag_asleep " + std::to_string(asleep) +
               ", the model " + (model_of(tag).asleep ? "asleep" : "awake");
    }
    if (reserved != all.reserved_bytes || tagged_live != all.live_bytes)
      return "pool stats (" + std::to_string(all.reserved_bytes) + " reserved, " +
             std::to_string(all.live_bytes) + " live) are not the sum over tags (" +
             std::to_string(reserved) + ", " + std::to_string(tagged_live) + ")";
    return {};
  }

  // Frees first (allowed while a tag sleeps), then wakes: a wake that finds the device
  // full gets the other tags' free memory.
  std::string teardown() {
    while (!live_.empty()) {
      auto it = live_.begin();
      if (auto why = expect(gpumem_free(pool_, reinterpret_cast<void*>(it->first), it->second.bytes,
                                        nullptr),
                            GPUMEM_SUCCESS, "final free");
          !why.empty())
        return why;
      live_.erase(it);
    }
    for (std::uint32_t tag : {0u, 1u, 2u, 3u})
      if (model_of(tag).asleep) {
        if (auto why = expect(gpumem_wake(pool_, tag, nullptr), GPUMEM_SUCCESS, "final wake");
            !why.empty())
          return why;
        model_of(tag).asleep = false;
      }
    std::uint64_t released = 0;
    if (auto why = expect(gpumem_pool_trim(pool_, &released), GPUMEM_SUCCESS, "final trim"); !why.empty())
      return why;
    gpumem_stats all{};
    gpumem_pool_stats(pool_, &all);
    if (all.live_bytes != 0) return "live bytes left after every free";
    return {};
  }

  gpumem_pool* pool_;
  void* side_;
  byte_source& in_;
  fuzz_counts& counts_;
  std::map<std::uintptr_t, allocation> live_;
  std::set<std::uintptr_t> freed_;
  std::map<std::uint32_t, tag_model> tags_{{0, {true, false}}};
  unsigned seed_ = 0;
};

}  // namespace detail

// One run: a fresh C API pool on a private 256 MiB sim device (step_plan off or on, from
// the first byte), the operations the bytes decode into, then everything freed.
inline std::string run_tag_fuzz(const std::uint8_t* data, std::size_t size, std::size_t max_ops,
                                fuzz_counts& counts) {
  ++counts.runs;
  byte_source in(data, size);
  const char* config = in.u8() % 2 ? "platform:sim,sim_capacity:256M,step_plan:off"
                                   : "platform:sim,sim_capacity:256M";
  gpumem_pool* pool = nullptr;
  if (gpumem_pool_create(config, &pool) != GPUMEM_SUCCESS)
    return std::string("pool_create: ") + gpumem_last_error();
  std::string why;
  void* side = nullptr;
  if (gpumem_stream_create(pool, &side) != GPUMEM_SUCCESS) {
    why = std::string("stream_create: ") + gpumem_last_error();
  } else {
    detail::tag_driver driver(pool, side, in, counts);
    why = driver.run(max_ops);
  }
  gpumem_pool_destroy(pool);
  return why;
}

}  // namespace gpumem_fuzz
