// kv_tiers: the ordered stores below the GPU (host memory first, then Redis, ...) that a
// kv_cache writes evicted blocks to and looks missed prefix blocks up in.
//
// Write-back (kv_cache evicts a full, hashed block):
//  - the cache stages a record (header and tokens written on the host), queues the
//    device-to-host copy of the block's bytes on its stream and records an event, then
//    hands the record here: stage() and commit() never block and never throw;
//  - a worker thread waits for each copy's event, seals the record (checksum) and puts
//    it into the first tier; a bounded tier that must make room spills its least recently
//    used records to the next tier down (so a block goes to the first tier with room).
//    With write_through, every record also goes to every lower tier (instances sharing a
//    remote store see each other's blocks at once). A remote tier is asked first whether
//    it holds the key already (the bytes are not sent twice).
//  - more than max_pending_bytes queued: the block is dropped (counted), not waited for.
// Lookup (kv_cache::add_sequence, after the GPU prefix lookup missed): fetch() asks the
// tiers in order which of the keys still unclaimed they hold (contains, one batch per
// tier), then gets the leading run's records (one batch per tier); every record is
// verified (sizes, key, checksum) by its store; the cache confirms the leading run
// (parent hash, salt, tokens) and copies it into fresh blocks, stream-ordered.
// Invariants: pending_bytes == bytes of records queued or being written; every staged
// buffer is freed exactly once (by the worker after its put, or by the cache).
// Thread-safe. The destructor writes what is queued, then stops the worker.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gpumem/kv/prefix_hash.hpp"
#include "gpumem/kv/tier/kv_store.hpp"
#include "gpumem/pool/pinned_host_pool.hpp"

namespace gpumem {

struct kv_tiers_options {
  std::size_t max_pending_bytes = std::size_t{256} << 20;
  bool write_through = false;
  std::uint64_t space = 0;  // mixed into every key's space (e.g. a model id)
  // Pinned staging memory allocated (and kept cached) at construction, so the first
  // write-backs do not pay cudaMallocHost (about 0.7 ms per 2 MiB on an H200 host).
  std::size_t reserve_staging_bytes = 0;
};

struct kv_tier_stats {
  std::string name;
  std::uint64_t hits = 0;  // blocks brought back to the GPU from this tier
  kv_store_stats store;    // the store's own counters (puts, errors, corrupt, ...)
};

struct kv_tiers_stats {
  std::vector<kv_tier_stats> tiers;
  std::uint64_t writebacks = 0;          // records queued
  std::uint64_t writebacks_written = 0;  // records put into some tier
  std::uint64_t writebacks_dropped = 0;  // queue full, no staging memory, copy failed
  std::uint64_t writebacks_present = 0;  // a remote tier held the key already
  std::uint64_t lookups = 0;             // blocks asked for
  std::uint64_t lookup_hits = 0;         // of them, found verified in some tier
  std::size_t pending_bytes = 0;
};

class kv_tiers {
 public:
  // stores: the tiers, first asked first. `device`: where the caches' blocks live (the
  // events of the write-back copies are created there). Throws gpumem::invalid_argument
  // for no stores or a null one.
  kv_tiers(platform& platform, int device, std::vector<std::unique_ptr<kv_store>> stores,
           kv_tiers_options options = {});
  ~kv_tiers();
  kv_tiers(const kv_tiers&) = delete;
  kv_tiers& operator=(const kv_tiers&) = delete;

  std::size_t size() const noexcept { return stores_.size(); }
  kv_store& store(std::size_t i) const { return *stores_.at(i); }
  const kv_tiers_options& options() const noexcept { return options_; }
  // Waits until every record queued before the call is written (or dropped).
  void flush();
  kv_tiers_stats stats() const;

  // --- the cache's side ------------------------------------------------------------------
  struct staged {
    std::byte* record = nullptr;
    std::size_t bytes = 0;
    std::size_t payload_offset = 0;
    kv_block_key key;
  };
  // A record with its header and tokens written, its payload still to be copied in;
  // nullopt (counted as dropped) when the queue is full or staging memory is short.
  std::optional<staged> stage(const kv_block_key& key, std::uint64_t parent,
                              std::span<const token_id> tokens, std::size_t payload_bytes,
                              stream_handle stream) noexcept;
  // Queues a staged record whose payload copy is queued on `stream`.
  void commit(const staged& s, stream_handle stream) noexcept;
  // Gives back a staged record that will not be written (its copy failed).
  void abandon(const staged& s, stream_handle stream) noexcept;

  struct fetched {
    std::vector<std::byte*> records;  // the leading run of keys found, verified by a store
    std::vector<std::size_t> tier;    // which tier each came from
    std::size_t record_bytes = 0;
    // Everything staged for the lookup (run or not), freed by release().
    std::vector<std::byte*> staging;
  };
  // Looks keys (a prefix chain, in order) up: which tier holds each, then the bytes of the
  // leading run, one batch per tier and step.
  fetched fetch(std::span<const kv_block_key> keys, std::size_t record_bytes,
                stream_handle stream) noexcept;
  // Counts the blocks of a fetch that the cache used, per tier.
  void count_used(const fetched& f, std::size_t used) noexcept;
  // Frees a fetch's staging memory once `stream`'s work queued so far (the copies out of
  // it) is done: the CPU writes the next staged records, so stream order alone is not
  // enough; the buffers wait for an event.
  void release(fetched& f, stream_handle stream) noexcept;

 private:
  struct job {
    staged s;
    stream_handle stream{};
    event_handle event{};
    bool has_event = false;
  };
  void worker();
  // Waits until a recorded event completed; false when the platform reports a failure.
  bool wait_event(event_handle e) noexcept;
  void write(std::vector<job>& jobs);
  // Puts records into tier `level`; what it spills goes one tier down.
  void put_into(std::size_t level, std::span<const kv_block_key> keys,
                std::span<const std::span<const std::byte>> values);
  void free_staging(std::byte* p, std::size_t bytes, stream_handle stream) noexcept;
  // Frees released fetch buffers whose event completed (all of them when `wait`).
  void reap(bool wait) noexcept;
  // An event from the reuse list or a new one; false when none can be made.
  bool take_event(event_handle& e) noexcept;

  platform& platform_;
  int device_;
  std::vector<std::unique_ptr<kv_store>> stores_;
  kv_tiers_options options_;
  pinned_host_pool staging_;
  mutable std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<job> queue_;
  std::vector<event_handle> events_;  // recorded-and-waited events for reuse
  struct deferred {
    event_handle event;
    stream_handle stream;
    std::size_t bytes;
    std::vector<std::byte*> buffers;
  };
  std::vector<deferred> deferred_;  // released fetch buffers waiting for their copies
  std::size_t in_flight_ = 0;         // jobs taken by the worker, not yet done
  bool stopping_ = false;
  kv_tiers_stats counters_{};
  std::vector<std::uint64_t> tier_hits_;
  std::thread worker_;
};

}  // namespace gpumem
