// kv_cache: a paged KV cache for LLM serving, as a library an engine embeds.
//
// Sequences own block tables (ids into kv_block_storage; layout in kv_layout.hpp).
// Blocks are reference counted:
//  - fork() shares every block of a sequence (parallel sampling, beam search); a later
//    append that would write into a shared, partly filled last block first copies it to a
//    new block on the device (copy on write);
//  - prefix caching: a full block is named by the chain hash of its tokens
//    (prefix_hash.hpp); add_sequence() reuses cached full blocks of a matching prompt
//    prefix instead of allocating (the engine skips computing those tokens);
//  - a full, hashed block whose last reference goes stays cached (unreferenced) and is
//    evicted least recently used first, when a block is needed and none is free or
//    mappable;
//  - swap_out() copies the blocks a sequence alone holds to pinned host memory (async, on
//    the cache's stream) and releases them — blocks shared with others stay resident, as
//    freeing them would free nothing; swap_in() brings them back, bytes intact;
//  - tiers below the GPU (config.tiers, kv/tier/kv_tiers.hpp): an evicted full block is
//    written back, asynchronously (its device-to-host copy queued on the stream); when
//    add_sequence's GPU prefix lookup misses, the following prompt blocks are looked up in
//    the tiers in one batch, and the leading run found is confirmed like a GPU hit (parent
//    hash, salt, tokens) and copied into fresh blocks on the stream. A tier that fails
//    is a miss: nothing of it throws out of the cache;
//  - capacity grows by VMM pages borrowed from a vmm_page_pool as blocks are needed, and
//    shrink() gives pages back to that pool (one memory budget with the rest of the
//    program).
// Device work (copy on write, swap copies) is queued on config.stream; a block released
// is reused in stream order on that stream, so an engine running its kernels on that
// stream needs no extra synchronization.
//
// Errors (typed; the cache is left exactly as before the call): unknown or freed
// sequence, a token count past sequence_token_limit() (max_sequence_tokens, or the
// capacity of max_blocks blocks), fork or append of a swapped-out sequence,
// swap without a host pool -> gpumem::invalid_argument; no block available ->
// gpumem::out_of_memory whose report gives capacity, used, cached and the pool's state.
//
// Invariants (validate()):
//  - each used block's reference count == the number of block tables naming it (a swapped
//    sequence's table names its resident blocks; the others are not_resident, and its host
//    copy holds exactly those); an unreferenced used block is cached (hashed, in the LRU);
//  - every prefix-map entry names a used, hashed block, and every hashed block has one;
//  - with scrub, a block reaches the free set only after a memset to zero on the stream;
//  - a sequence of n tokens has ceil(n / block_tokens) blocks.
// Thread-safe: one mutex around each call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpumem/kv/kv_block_storage.hpp"
#include "gpumem/kv/kv_layout.hpp"
#include "gpumem/kv/prefix_hash.hpp"
#include "gpumem/kv/tier/kv_tiers.hpp"
#include "gpumem/pool/pinned_host_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem {

struct kv_cache_config {
  kv_layout layout;
  std::size_t max_blocks = 0;           // cap on blocks (0: as many as device memory holds)
  std::size_t initial_blocks = 0;       // mapped at construction
  std::size_t max_sequence_tokens = 0;  // 0: no cap
  std::size_t grow_pages = 0;           // pages mapped per growth at least (0: one block's)
  bool prefix_caching = true;
  // Zero every block on the device (memset on `stream`) when it leaves its last owner, so
  // no sequence or tenant ever reads another's keys and values.
  bool scrub = false;
  stream_handle stream{};               // copies and scrubbing run here
  // Stores below the GPU (nullptr: none). Not owned; it outlives the cache. Requires
  // prefix_caching.
  kv_tiers* tiers = nullptr;
};

struct kv_cache_stats {
  std::size_t capacity_blocks = 0;   // mapped
  std::size_t used_blocks = 0;       // named by some sequence
  std::size_t cached_blocks = 0;     // unreferenced, kept for prefix reuse
  std::size_t free_blocks = 0;       // mapped, holding nothing
  std::size_t filled_slots = 0;      // token slots holding a token, in used blocks
  std::size_t sequences = 0;
  std::size_t swapped_sequences = 0;
  std::size_t mapped_bytes = 0;
  std::uint64_t block_allocations = 0;
  std::uint64_t block_releases = 0;
  std::uint64_t prefix_queries = 0;  // full prompt blocks looked up
  std::uint64_t prefix_hits = 0;     // of them, found cached
  std::uint64_t evictions = 0;
  std::uint64_t cow_copies = 0;
  std::uint64_t blocks_scrubbed = 0;
  std::uint64_t swaps_out = 0, swaps_in = 0;
  std::uint64_t bytes_swapped_out = 0, bytes_swapped_in = 0;
  std::uint64_t tier_lookups = 0;    // prompt blocks looked up in the tiers (GPU misses)
  std::uint64_t tier_hits = 0;       // of them, brought back from a tier
  std::uint64_t writebacks = 0;      // evicted blocks handed to the tiers
  // Slots allocated to sequences but holding no token, as a fraction of allocated slots.
  double waste_fraction(std::size_t block_tokens) const noexcept {
    const double slots = static_cast<double>(used_blocks) * static_cast<double>(block_tokens);
    return slots == 0 ? 0.0 : 1.0 - static_cast<double>(filled_slots) / slots;
  }
};

class kv_cache {
 public:
  using sequence_id = std::uint64_t;
  using block_id = kv_block_storage::block_id;
  // In a swapped-out sequence's block table: this block's bytes are in host memory.
  static constexpr block_id not_resident = 0xffffffffu;

  // host: staging memory for swap (optional; swap throws without it).
  // Throws gpumem::invalid_argument for a bad layout or config.
  kv_cache(vmm_page_pool& pages, kv_cache_config config, pinned_host_pool* host = nullptr);
  ~kv_cache();
  kv_cache(const kv_cache&) = delete;
  kv_cache& operator=(const kv_cache&) = delete;

  struct admission {
    sequence_id id = 0;
    std::size_t cached_tokens = 0;  // leading prompt tokens whose KV is already there
  };
  // A new sequence holding `prompt` (may be empty). Leading full blocks whose chain hash
  // (with `salt`) is cached are shared, at most up to the block before the last prompt
  // token (the engine must compute at least one token). All or nothing.
  admission add_sequence(std::span<const token_id> prompt, std::uint64_t salt = 0);
  // Appends tokens, allocating blocks as they fill. All or nothing.
  void append(sequence_id seq, std::span<const token_id> tokens);
  // A new sequence sharing every block of `seq`.
  sequence_id fork(sequence_id seq);
  void free(sequence_id seq);
  void swap_out(sequence_id seq);
  void swap_in(sequence_id seq);

  // The block ids of a sequence, in token order (not_resident where swapped out).
  std::vector<block_id> block_table(sequence_id seq) const;
  std::size_t sequence_tokens(sequence_id seq) const;
  bool is_swapped(sequence_id seq) const;
  // Blocks an append of `tokens` tokens to `seq` would take (copy on write included).
  std::size_t blocks_needed(sequence_id seq, std::size_t tokens) const;
  // The most tokens one sequence can ever hold: max_sequence_tokens when set, and never
  // more than the cache's capacity (max_blocks * block_tokens). A count past it is an
  // invalid_argument naming the limit; one within it that finds no block is out_of_memory.
  std::size_t sequence_token_limit() const noexcept;
  // Throws gpumem::invalid_argument when `more` tokens on top of `have` exceed
  // sequence_token_limit() (id 0: tokens of no sequence yet). REQUIRES have <= the limit.
  void check_token_count(std::size_t have, std::size_t more, const char* what,
                         sequence_id id = 0) const;
  // Blocks obtainable now without failing: free, cached (evictable) and mappable under
  // the cap (the pool may still run out of memory).
  std::size_t available_blocks() const;

  // Evicts up to `blocks` cached blocks (least recently used first); returns how many.
  std::size_t evict(std::size_t blocks);
  // Gives pages above the highest used block back to the pool, keeping `keep_free` free
  // blocks; with drop_cached, evicts every cached block first. Returns pages given back.
  std::size_t shrink(std::size_t keep_free = 0, bool drop_cached = false);

  const kv_layout& layout() const noexcept { return config_.layout; }
  std::uintptr_t base() const noexcept { return storage_.base(); }
  // Blocks the virtual range holds (ids below it); those below capacity are mapped.
  std::size_t max_blocks() const noexcept { return storage_.max_blocks(); }
  void* block_address(block_id b) const noexcept { return storage_.address(b); }
  kv_cache_stats stats() const;
  std::string validate() const;
  // The `space` of this cache's tier keys: its layout's fingerprint (0 without tiers).
  std::uint64_t tier_space() const noexcept { return space_; }

 private:
  static constexpr block_id no_block = 0xfffffffeu;  // LRU list end
  struct block_meta {
    std::uint32_t refs = 0;
    std::uint32_t filled = 0;   // tokens written
    bool hashed = false;        // in prefix_ (full, named by `hash`)
    std::uint64_t hash = 0, parent = 0, salt = 0;
    block_id lru_prev = no_block, lru_next = no_block;  // when cached
  };
  struct sequence {
    std::vector<block_id> blocks;
    std::vector<std::uint64_t> full_hashes;  // chain hash of each full block
    std::vector<token_id> tail;              // tokens of the last, partly filled block
    std::size_t tokens = 0;
    std::uint64_t salt = 0;
    bool swapped = false;
    void* host = nullptr;                    // swapped-out bytes
    std::size_t host_bytes = 0;
  };

  sequence& find_locked(sequence_id id, const char* what);
  const sequence& find_locked(sequence_id id, const char* what) const;
  // A block for writing: free, else mapped anew, else evicted; no_block when none.
  block_id take_block();
  // One reference less; the block becomes cached (hashed) or free.
  void release_block(block_id b);
  void lru_push(block_id b);
  void lru_remove(block_id b);
  void evict_one();
  // Gives a block nobody holds back to storage, zeroed first when scrubbing (a block whose
  // memset failed waits in dirty_ and is retried before the next operation).
  void return_to_storage(block_id b);
  // Zeroes the blocks in dirty_ and frees them; throws gpumem::cuda_error (keeping the rest).
  void scrub_dirty();
  // Registers a block that just filled, under its chain hash, unless an equal one is there.
  void register_full(block_id b, std::uint64_t parent, std::uint64_t salt,
                     std::span<const token_id> tokens, std::uint64_t& hash_out);
  // Appends with no capacity check; REQUIRES the blocks are available.
  void append_locked(sequence& s, std::span<const token_id> tokens);
  std::size_t blocks_needed_locked(const sequence& s, std::size_t tokens) const;
  std::size_t available_locked() const;
  // Makes `need` blocks obtainable (free or evictable, not counting `protected_cached`
  // cached blocks the caller will reuse) or throws out_of_memory, changing nothing else.
  void ensure_available(std::size_t need, std::size_t protected_cached, const char* what);
  // Tiers (kv_cache_tiers.cpp): hands an evicted block to the tiers; never throws.
  void write_back(block_id b) noexcept;
  // Looks prompt blocks [first, last) up in the tiers (parent: the chain hash before
  // `first`); returns how many leading ones were found and confirmed.
  std::size_t lookup_tiers(std::span<const token_id> prompt, std::uint64_t salt,
                           std::size_t first, std::size_t last, std::uint64_t parent,
                           kv_tiers::fetched& found);
  // Copies the first `count` found blocks into fresh blocks of `s` (REQUIRES they are
  // available); returns how many were adopted (a failed copy ends the run).
  std::size_t adopt_tier_blocks(sequence& s, kv_tiers::fetched& found, std::size_t count);
  static std::uint64_t layout_space(const kv_layout& layout, std::uint64_t extra) noexcept;
  [[noreturn]] void throw_out_of_blocks(std::size_t wanted, const char* what) const;

  kv_cache_config config_;
  vmm_page_pool& pages_;
  pinned_host_pool* host_;
  kv_block_storage storage_;
  mutable std::mutex mutex_;
  std::vector<block_meta> meta_;
  std::vector<token_id> tokens_;  // per block: its tokens when hashed (for exact hits)
  std::unordered_map<std::uint64_t, block_id> prefix_;
  block_id lru_head_ = no_block, lru_tail_ = no_block;  // head: least recently used
  std::size_t cached_ = 0;
  std::vector<block_id> dirty_;  // released, not yet zeroed (scrub only)
  std::size_t filled_in_use_ = 0;
  std::unordered_map<sequence_id, sequence> sequences_;
  sequence_id next_id_ = 1;
  kv_cache_stats counters_{};
  std::uint64_t space_ = 0;  // the tiers' key space: this layout's fingerprint
};

}  // namespace gpumem
