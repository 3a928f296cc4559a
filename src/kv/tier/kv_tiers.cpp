#include "gpumem/kv/tier/kv_tiers.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "gpumem/errors.hpp"
#include "gpumem/kv/tier/kv_record.hpp"

namespace gpumem {

namespace {
pool_options staging_options() {
  pool_options o;
  o.thread_cache = false;  // the worker frees what the cache's thread staged
  return o;
}
constexpr std::size_t worker_batch = 32;  // records per put batch
// Staging segments of an 8th of what may be pending, from 2 MiB to 64 MiB: a record (a
// block and its header, a little over 2 MiB for Llama-3-8B) then shares a segment with
// others instead of pinning 4 MiB of its own, and cudaMallocHost is called seldom.
std::size_t staging_segment_bytes(std::size_t max_pending) {
  return std::clamp<std::size_t>(max_pending / 8, std::size_t{2} << 20, std::size_t{64} << 20);
}
}  // namespace

kv_tiers::kv_tiers(platform& platform, int device, std::vector<std::unique_ptr<kv_store>> stores,
                   kv_tiers_options options)
    : platform_(platform), device_(device), stores_(std::move(stores)), options_(options),
      staging_(platform, device, staging_options(), staging_segment_bytes(options.max_pending_bytes)) {
  if (stores_.empty()) throw invalid_argument("kv_tiers: no store given");
  for (const auto& s : stores_)
    if (s == nullptr) throw invalid_argument("kv_tiers: a store is null");
  tier_hits_.assign(stores_.size(), 0);
  if (options_.reserve_staging_bytes != 0) {
    try {
      void* p = staging_.allocate(options_.reserve_staging_bytes);
      staging_.deallocate(p, options_.reserve_staging_bytes);
    } catch (const out_of_memory&) {
      // Best effort: staging is then allocated as write-backs need it.
    }
  }
  worker_ = std::thread([this] { worker(); });
}

kv_tiers::~kv_tiers() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  worker_.join();
  reap(true);
  for (event_handle e : events_) (void)platform_.event_destroy(e);
}

void kv_tiers::free_staging(std::byte* p, std::size_t bytes, stream_handle stream) noexcept {
  try {
    staging_.deallocate(p, bytes, stream);
  } catch (...) {
    // Only thrown for a pointer the pool did not hand out: none here.
  }
}

std::optional<kv_tiers::staged> kv_tiers::stage(const kv_block_key& key, std::uint64_t parent,
                                                std::span<const token_id> tokens,
                                                std::size_t payload_bytes,
                                                stream_handle stream) noexcept {
  const std::size_t bytes = kv_record::size(tokens.size(), payload_bytes);
  {
    std::lock_guard lock(mutex_);
    if (counters_.pending_bytes + bytes > options_.max_pending_bytes) {
      ++counters_.writebacks_dropped;
      return std::nullopt;
    }
    counters_.pending_bytes += bytes;  // reserved now, so two stagers cannot both pass
  }
  std::byte* p = nullptr;
  try {
    p = static_cast<std::byte*>(staging_.allocate(bytes, stream));
  } catch (...) {
    std::lock_guard lock(mutex_);
    counters_.pending_bytes -= bytes;
    ++counters_.writebacks_dropped;
    return std::nullopt;
  }
  kv_record::write_head({p, bytes}, key, parent, tokens);
  return staged{p, bytes, kv_record::payload_offset(tokens.size()), key};
}

void kv_tiers::commit(const staged& s, stream_handle stream) noexcept {
  job j{s, stream, {}, false};
  j.has_event = take_event(j.event);
  std::unique_lock lock(mutex_);
  if (j.has_event && !platform_.event_record(j.event, stream)) {
    events_.push_back(j.event);
    j.has_event = false;  // the worker synchronizes the stream instead
  }
  ++counters_.writebacks;
  try {
    queue_.push_back(j);
  } catch (...) {
    counters_.pending_bytes -= s.bytes;
    ++counters_.writebacks_dropped;
    lock.unlock();
    if (j.has_event) {
      (void)platform_.event_synchronize(j.event);
      std::lock_guard relock(mutex_);
      events_.push_back(j.event);
    } else {
      (void)platform_.stream_synchronize(stream);
    }
    free_staging(s.record, s.bytes, stream);
    return;
  }
  lock.unlock();
  wake_.notify_one();
}

void kv_tiers::abandon(const staged& s, stream_handle stream) noexcept {
  {
    std::lock_guard lock(mutex_);
    counters_.pending_bytes -= s.bytes;
    ++counters_.writebacks_dropped;
  }
  free_staging(s.record, s.bytes, stream);
}

void kv_tiers::worker() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, everything written
    std::vector<job> jobs;
    while (!queue_.empty() && jobs.size() < worker_batch) {
      jobs.push_back(queue_.front());
      queue_.pop_front();
    }
    in_flight_ += jobs.size();
    lock.unlock();
    write(jobs);
    lock.lock();
    in_flight_ -= jobs.size();
    for (const job& j : jobs) {
      counters_.pending_bytes -= j.s.bytes;
      if (j.has_event) events_.push_back(j.event);
    }
    if (queue_.empty() && in_flight_ == 0) idle_.notify_all();
  }
}

bool kv_tiers::wait_event(event_handle e) noexcept {
  // Polled, so the worker only ever waits on its own copies (a short sleep between polls
  // costs nothing next to a block's trip to a store).
  for (;;) {
    auto q = platform_.event_query(e);
    if (!q.ok()) return false;
    if (q.value()) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void kv_tiers::write(std::vector<job>& jobs) {
  std::vector<kv_block_key> keys;
  std::vector<std::span<const std::byte>> values;
  std::size_t ready = 0;
  for (job& j : jobs) {
    // The payload copy was queued on the cache's stream before the event.
    const bool copied = j.has_event ? wait_event(j.event)
                                    : platform_.stream_synchronize(j.stream).ok();
    if (!copied) continue;
    kv_record::seal({j.s.record, j.s.bytes});
    keys.push_back(j.s.key);
    values.emplace_back(j.s.record, j.s.bytes);
    ++ready;
  }
  try {
    if (!keys.empty()) {
      if (options_.write_through) {
        for (std::size_t level = 0; level < stores_.size(); ++level)
          put_into(level, keys, values);
      } else {
        put_into(0, keys, values);
      }
    }
  } catch (...) {
    // put_into allocates; a failure loses this batch only.
  }
  for (const job& j : jobs) free_staging(j.s.record, j.s.bytes, j.stream);
  std::lock_guard lock(mutex_);
  counters_.writebacks_written += ready;
  counters_.writebacks_dropped += jobs.size() - ready;
}

void kv_tiers::put_into(std::size_t level, std::span<const kv_block_key> keys,
                        std::span<const std::span<const std::byte>> values) {
  kv_store& store = *stores_[level];
  std::vector<kv_block_key> k(keys.begin(), keys.end());
  std::vector<std::span<const std::byte>> v(values.begin(), values.end());
  if (!store.is_local()) {
    // Do not send bytes the store holds already (another instance wrote them).
    std::unique_ptr<bool[]> present(new bool[k.size()]);
    store.contains(k, {present.get(), k.size()});
    std::size_t out = 0;
    for (std::size_t i = 0; i < k.size(); ++i) {
      if (present[i]) continue;
      k[out] = k[i];
      v[out] = v[i];
      ++out;
    }
    {
      std::lock_guard lock(mutex_);
      counters_.writebacks_present += k.size() - out;
    }
    k.resize(out);
    v.resize(out);
    if (k.empty()) return;
  }
  // Spilled records are copied: the store frees its own bytes right after the call.
  std::vector<kv_block_key> spilled_keys;
  std::vector<std::vector<std::byte>> spilled;
  kv_store::spill_fn spill;
  if (level + 1 < stores_.size() && !options_.write_through)
    spill = [&](const kv_block_key& key, std::span<const std::byte> bytes) {
      spilled_keys.push_back(key);
      spilled.emplace_back(bytes.begin(), bytes.end());
    };
  std::unique_ptr<bool[]> stored(new bool[k.size()]);
  store.put(k, v, {stored.get(), k.size()}, spill ? &spill : nullptr);
  if (spilled.empty()) return;
  std::vector<std::span<const std::byte>> spans(spilled.begin(), spilled.end());
  put_into(level + 1, spilled_keys, spans);
}

void kv_tiers::flush() {
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [&] { return queue_.empty() && in_flight_ == 0; });
}

kv_tiers::fetched kv_tiers::fetch(std::span<const kv_block_key> keys, std::size_t record_bytes,
                                  stream_handle stream) noexcept {
  fetched f;
  f.record_bytes = record_bytes;
  reap(false);
  try {
    // Which tier holds each key (contains: no bytes move), tier by tier for the keys
    // still unclaimed, as far as the leading run reaches: staging memory and transfers are
    // then spent on blocks that will be used only.
    const std::size_t n = keys.size();
    constexpr std::size_t none = ~std::size_t{0};
    std::vector<std::size_t> owner(n, none);
    std::size_t run = 0;
    for (std::size_t t = 0; t < stores_.size(); ++t) {
      std::vector<kv_block_key> ask;
      std::vector<std::size_t> where;
      for (std::size_t i = run; i < n; ++i)
        if (owner[i] == none) {
          ask.push_back(keys[i]);
          where.push_back(i);
        }
      if (ask.empty()) break;
      std::unique_ptr<bool[]> has(new bool[ask.size()]);
      stores_[t]->contains(ask, {has.get(), ask.size()});
      for (std::size_t j = 0; j < ask.size(); ++j)
        if (has[j]) owner[where[j]] = t;
      while (run < n && owner[run] != none) ++run;
    }
    // The bytes of the run, one batch per tier; a key that fails its get (evicted
    // meanwhile, corrupt, the store failed) ends the run there.
    for (std::size_t i = 0; i < run; ++i) {
      try {
        f.staging.push_back(static_cast<std::byte*>(staging_.allocate(record_bytes, stream)));
      } catch (const out_of_memory&) {
        break;  // the blocks that have room
      }
    }
    run = f.staging.size();
    std::vector<bool> got(run, false);
    for (std::size_t t = 0; t < stores_.size(); ++t) {
      std::vector<kv_block_key> ask;
      std::vector<std::span<std::byte>> dst;
      std::vector<std::size_t> where;
      for (std::size_t i = 0; i < run; ++i)
        if (owner[i] == t) {
          ask.push_back(keys[i]);
          dst.emplace_back(f.staging[i], record_bytes);
          where.push_back(i);
        }
      if (ask.empty()) continue;
      std::vector<kv_get_status> st(ask.size(), kv_get_status::miss);
      stores_[t]->get(ask, dst, st);
      for (std::size_t j = 0; j < ask.size(); ++j) got[where[j]] = st[j] == kv_get_status::hit;
    }
    for (std::size_t i = 0; i < run && got[i]; ++i) {
      f.records.push_back(f.staging[i]);
      f.tier.push_back(owner[i]);
    }
    std::lock_guard lock(mutex_);
    counters_.lookups += keys.size();
    counters_.lookup_hits += f.records.size();
  } catch (...) {
    f.records.clear();
    f.tier.clear();
  }
  return f;
}

void kv_tiers::count_used(const fetched& f, std::size_t used) noexcept {
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < used && i < f.tier.size(); ++i) ++tier_hits_[f.tier[i]];
}

bool kv_tiers::take_event(event_handle& e) noexcept {
  {
    std::lock_guard lock(mutex_);
    if (!events_.empty()) {
      e = events_.back();
      events_.pop_back();
      return true;
    }
  }
  auto made = platform_.event_create(device_);
  if (!made) return false;
  e = made.value();
  return true;
}

void kv_tiers::reap(bool wait) noexcept {
  std::vector<deferred> done;
  {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < deferred_.size();) {
      bool complete = wait;
      if (!complete) {
        auto q = platform_.event_query(deferred_[i].event);
        complete = q.ok() && q.value();
      }
      if (!complete) {
        ++i;
        continue;
      }
      done.push_back(std::move(deferred_[i]));
      deferred_[i] = std::move(deferred_.back());
      deferred_.pop_back();
    }
  }
  for (deferred& d : done) {
    if (wait) (void)platform_.event_synchronize(d.event);
    for (std::byte* p : d.buffers) free_staging(p, d.bytes, d.stream);
    std::lock_guard lock(mutex_);
    events_.push_back(d.event);
  }
}

void kv_tiers::release(fetched& f, stream_handle stream) noexcept {
  if (!f.staging.empty()) {
    event_handle e{};
    bool deferred_ok = false;
    if (take_event(e)) {
      if (platform_.event_record(e, stream)) {
        try {
          std::lock_guard lock(mutex_);
          deferred_.push_back({e, stream, f.record_bytes, f.staging});
          deferred_ok = true;
        } catch (...) {
        }
      }
      if (!deferred_ok) {
        std::lock_guard lock(mutex_);
        events_.push_back(e);
      }
    }
    if (!deferred_ok) {
      (void)platform_.stream_synchronize(stream);  // the copies out of them are done
      for (std::byte* p : f.staging) free_staging(p, f.record_bytes, stream);
    }
  }
  reap(false);
  f.staging.clear();
  f.records.clear();
  f.tier.clear();
}

kv_tiers_stats kv_tiers::stats() const {
  kv_tiers_stats s;
  {
    std::lock_guard lock(mutex_);
    s = counters_;
    s.tiers.clear();
    for (std::size_t t = 0; t < stores_.size(); ++t) s.tiers.push_back({{}, tier_hits_[t], {}});
  }
  for (std::size_t t = 0; t < stores_.size(); ++t) {
    s.tiers[t].name = stores_[t]->name();
    s.tiers[t].store = stores_[t]->stats();
  }
  return s;
}

}  // namespace gpumem
