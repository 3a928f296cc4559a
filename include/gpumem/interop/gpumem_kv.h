/* gpumem C API: the paged KV cache (include/gpumem/kv/kv_cache.hpp) over a gpumem pool.
 *
 *   gpumem_kv_create(pool, &config, &cache)        a cache whose pages come from `pool`
 *   gpumem_kv_add_sequence(cache, tokens, n, ...)  a sequence, sharing cached prompt blocks
 *   gpumem_kv_append / _fork / _free               grow, share (copy on write), release
 *   gpumem_kv_block_table(cache, seq, ...)         block ids in token order
 *   gpumem_kv_storage(cache, &storage)             base pointer and byte strides
 *
 * The pool must be a vmm_page_pool (the C API's default allocator): the cache borrows
 * whole physical pages from it, so the cache and the pool's other allocations share one
 * budget (its limit, the device). The pages come from the tag that is the calling
 * thread's current tag at create (gpumem_set_current_tag; gpumem.torch.tag in Python):
 * tag 0, the pool itself, by default; another tag's own pages otherwise, so the cache's
 * memory is the tag's (its stats) and goes back with it: a gpumem_sleep of the tag is
 * refused while the cache holds pages (destroy it first, then the sleep gives its pages
 * back); a create or growth in a tag asleep, or in the shared tag, is refused with
 * GPUMEM_ERROR_INVALID_ARGUMENT. Sequence sets (gpumem_kv_vseqs_create) do the same.
 * The cache must be destroyed before its pool:
 * gpumem_pool_destroy refuses a pool that caches or sequence sets still stand on
 * (GPUMEM_ERROR_INVALID_ARGUMENT, the pool left live). The stream is checked at create.
 *
 * Storage layout (one virtual range reserved for max_blocks blocks, fixed for the cache's
 * life; only blocks named by a live block table are mapped and meaningful):
 *
 *   address(block, layer, kv, token, head, dim) = base + block * block_stride
 *       + layer * layer_stride + kv * kv_stride (0 keys, 1 values)
 *       + token * token_stride + head * head_stride + dim * dtype_bytes
 *
 * i.e. a C array [max_blocks][layers][2][block_tokens][kv_heads][head_dim] of the dtype.
 * The library only manages blocks: the caller writes keys and values into the slots of
 * the blocks its sequences name (token t of a sequence lives in block table[t /
 * block_tokens], slot t % block_tokens), on the cache's stream or a stream ordered after
 * it. Copies the cache makes itself (copy on write, swap) are queued on that stream.
 *
 * Contract (as gpumem.h): no exception crosses the boundary; every failure returns a
 * status and sets gpumem_last_error(); a failed call changes nothing (all or nothing).
 *  - bad layout, non-zero reserved fields, a stream the pool's platform does not know (or of
 *    another device), unknown or freed sequence, a token count past what a sequence can
 *    ever hold (max_sequence_tokens, else the capacity max_blocks * block_tokens; any
 *    count, SIZE_MAX included: counts are compared, never added past their type), a
 *    count whose buffer cannot exist (its bytes overflow or wrap the address space), fork or
 *    append of a swapped-out sequence, swap without host memory, a layout that does not
 *    match the model (gpumem_kv_check_layout), an output buffer too small ->
 *    GPUMEM_ERROR_INVALID_ARGUMENT;
 *  - no block available for a count within those limits -> GPUMEM_ERROR_OUT_OF_MEMORY (the
 *    text is the cache's report);
 *  - a driver failure -> GPUMEM_ERROR_CUDA.
 * Sequence ids are never reused within a cache, so an id kept after gpumem_kv_free is
 * always refused ("... was freed"), never taken for another sequence.
 * Calls on one cache may come from several threads (the cache serializes them);
 * gpumem_kv_destroy must not race with other calls on the same cache. A cache handle is
 * not checked after gpumem_kv_destroy (using it is the caller's bug).
 */
#ifndef GPUMEM_INTEROP_GPUMEM_KV_H
#define GPUMEM_INTEROP_GPUMEM_KV_H

#include "gpumem/interop/gpumem.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gpumem_kv_cache gpumem_kv_cache;

typedef enum gpumem_kv_dtype {
  GPUMEM_KV_FP8 = 0, /* 1 byte (e4m3 or e5m2: the cache does not interpret the bytes) */
  GPUMEM_KV_F16 = 1,
  GPUMEM_KV_BF16 = 2,
  GPUMEM_KV_F32 = 3
} gpumem_kv_dtype;

typedef struct gpumem_kv_layout {
  uint64_t layers;
  uint64_t kv_heads;
  uint64_t head_dim;
  uint64_t block_tokens; /* tokens per block (16 by default) */
  int32_t dtype;         /* a gpumem_kv_dtype */
  int32_t reserved;      /* 0 */
} gpumem_kv_layout;

typedef struct gpumem_kv_config {
  gpumem_kv_layout layout;
  uint64_t max_blocks;          /* cap on blocks; 0: as many as the device's memory holds */
  uint64_t initial_blocks;      /* mapped at creation */
  uint64_t max_sequence_tokens; /* 0: no cap */
  uint64_t grow_pages;          /* pages mapped per growth at least; 0: one block's */
  int32_t prefix_caching;       /* 1 (default): share full prompt blocks by token hash */
  int32_t scrub;                /* 1: zero every block when its last owner lets it go */
  int32_t swap;                 /* 1 (default): a pinned host pool for swap_out/swap_in */
  int32_t reserved;             /* 0 */
  void* stream;                 /* cudaStream_t for the cache's copies; NULL: default */
} gpumem_kv_config;

/* Byte strides of the storage; see the file comment. */
typedef struct gpumem_kv_storage {
  uint64_t base;           /* device address of block 0 */
  uint64_t max_blocks;     /* the range covers max_blocks * block_stride bytes */
  uint64_t capacity_blocks; /* blocks mapped now (ids below it); changes as the cache grows */
  uint64_t block_stride;
  uint64_t layer_stride;
  uint64_t kv_stride;
  uint64_t token_stride;
  uint64_t head_stride;
  uint64_t dtype_bytes;
  gpumem_kv_layout layout;
} gpumem_kv_storage;

typedef struct gpumem_kv_stats {
  uint64_t capacity_blocks; /* mapped */
  uint64_t used_blocks;     /* named by some sequence */
  uint64_t cached_blocks;   /* unreferenced, kept for prefix reuse */
  uint64_t free_blocks;     /* mapped, holding nothing */
  uint64_t filled_slots;    /* token slots holding a token, in used blocks */
  uint64_t sequences;
  uint64_t swapped_sequences;
  uint64_t mapped_bytes;    /* device memory the cache holds */
  uint64_t block_bytes;
  uint64_t block_allocations;
  uint64_t block_releases;
  uint64_t prefix_queries;  /* full prompt blocks looked up */
  uint64_t prefix_hits;     /* of them, found cached */
  uint64_t evictions;
  uint64_t cow_copies;
  uint64_t blocks_scrubbed;
  uint64_t swaps_out;
  uint64_t swaps_in;
  uint64_t bytes_swapped_out;
  uint64_t bytes_swapped_in;
  double waste_fraction;    /* allocated slots holding no token / allocated slots */
} gpumem_kv_stats;

/* Marks a block of a swapped-out sequence's table: its bytes are in host memory. */
#define GPUMEM_KV_NOT_RESIDENT 0xffffffffu

/* Defaults: block_tokens 16, dtype bf16, prefix_caching 1, swap 1, the rest 0. The
 * caller then sets layers, kv_heads and head_dim. REQUIRES: config != NULL. */
GPUMEM_API void gpumem_kv_config_init(gpumem_kv_config* config);

/* REQUIRES: out != NULL (set to NULL on failure). */
GPUMEM_API gpumem_status gpumem_kv_create(gpumem_pool* pool, const gpumem_kv_config* config,
                                          gpumem_kv_cache** out);
/* Unmaps every block and gives the pages back to the pool. NULL is a no-op. */
GPUMEM_API void gpumem_kv_destroy(gpumem_kv_cache* cache);

/* GPUMEM_ERROR_INVALID_ARGUMENT naming each field that differs when the model's layout
 * (layers, kv_heads, head_dim, dtype; block_tokens is the cache's choice and ignored) is
 * not the cache's. */
GPUMEM_API gpumem_status gpumem_kv_check_layout(gpumem_kv_cache* cache,
                                                const gpumem_kv_layout* model);

/* A new sequence holding `count` prompt tokens (tokens may be NULL when count is 0).
 * Leading full blocks whose tokens (with `salt`) are cached are shared; *cached_tokens
 * (may be NULL) receives how many leading tokens need no computing. */
GPUMEM_API gpumem_status gpumem_kv_add_sequence(gpumem_kv_cache* cache, const int32_t* tokens,
                                                size_t count, uint64_t salt, uint64_t* seq,
                                                uint64_t* cached_tokens);
GPUMEM_API gpumem_status gpumem_kv_append(gpumem_kv_cache* cache, uint64_t seq,
                                          const int32_t* tokens, size_t count);
/* One token appended to each of `count` sequences, in order (a decode step). Each append
 * is all or nothing; the first failure stops: *done (may be NULL) receives how many
 * sequences got their token, and the status is that failure's. */
GPUMEM_API gpumem_status gpumem_kv_append_each(gpumem_kv_cache* cache, const uint64_t* seqs,
                                               const int32_t* tokens, size_t count,
                                               size_t* done);
/* A new sequence sharing every block of `seq` (copy on write on its next append). */
GPUMEM_API gpumem_status gpumem_kv_fork(gpumem_kv_cache* cache, uint64_t seq, uint64_t* child);
GPUMEM_API gpumem_status gpumem_kv_free(gpumem_kv_cache* cache, uint64_t seq);
GPUMEM_API gpumem_status gpumem_kv_swap_out(gpumem_kv_cache* cache, uint64_t seq);
GPUMEM_API gpumem_status gpumem_kv_swap_in(gpumem_kv_cache* cache, uint64_t seq);

/* The block ids of `seq` in token order (GPUMEM_KV_NOT_RESIDENT where swapped out).
 * *count receives the number of blocks; with out == NULL nothing else happens; otherwise
 * capacity must be at least that number (else GPUMEM_ERROR_INVALID_ARGUMENT, nothing
 * written). */
GPUMEM_API gpumem_status gpumem_kv_block_table(gpumem_kv_cache* cache, uint64_t seq,
                                               uint32_t* out, size_t capacity, size_t* count);
/* The block tables of `count` sequences as the rows of a [count][row_blocks] array
 * (unused entries set to `pad`), and each sequence's token count in lengths (may be
 * NULL): what a paged-attention kernel takes. Refused, nothing written, when a sequence is
 * unknown, freed or swapped out, or has more than row_blocks blocks. */
GPUMEM_API gpumem_status gpumem_kv_block_tables(gpumem_kv_cache* cache, const uint64_t* seqs,
                                                size_t count, uint32_t* out,
                                                size_t row_blocks, uint32_t pad,
                                                uint64_t* lengths);
GPUMEM_API gpumem_status gpumem_kv_sequence_tokens(gpumem_kv_cache* cache, uint64_t seq,
                                                   uint64_t* tokens);
GPUMEM_API gpumem_status gpumem_kv_is_swapped(gpumem_kv_cache* cache, uint64_t seq,
                                              int32_t* swapped);
/* Blocks an append of `tokens` tokens to `seq` would take (copy on write and, for a
 * swapped-out sequence, its blocks away included). A count the append would refuse as
 * past the limit is refused the same way, *blocks untouched. */
GPUMEM_API gpumem_status gpumem_kv_blocks_needed(gpumem_kv_cache* cache, uint64_t seq,
                                                 uint64_t tokens, uint64_t* blocks);
/* Blocks obtainable now: free, cached (evictable) and mappable under max_blocks. */
GPUMEM_API gpumem_status gpumem_kv_available_blocks(gpumem_kv_cache* cache, uint64_t* blocks);
/* Evicts up to `blocks` cached blocks, least recently used first. */
GPUMEM_API gpumem_status gpumem_kv_evict(gpumem_kv_cache* cache, uint64_t blocks,
                                         uint64_t* evicted);
/* Gives the pages above the highest used block back to the pool, keeping `keep_free`
 * free blocks; drop_cached != 0 evicts every cached block first. Waits for the cache's
 * stream. *pages (may be NULL) receives the pages given back. */
GPUMEM_API gpumem_status gpumem_kv_shrink(gpumem_kv_cache* cache, uint64_t keep_free,
                                          int32_t drop_cached, uint64_t* pages);
GPUMEM_API gpumem_status gpumem_kv_stats_get(gpumem_kv_cache* cache, gpumem_kv_stats* out);
GPUMEM_API gpumem_status gpumem_kv_storage_get(gpumem_kv_cache* cache, gpumem_kv_storage* out);
/* Waits for the cache's stream (its copies on write and swaps). */
GPUMEM_API gpumem_status gpumem_kv_synchronize(gpumem_kv_cache* cache);
/* The cache's invariant check: "" when valid, else what is wrong; written to buf as
 * gpumem_pool_report does (truncated, NUL-terminated); returns the full length. */
GPUMEM_API size_t gpumem_kv_validate(gpumem_kv_cache* cache, char* buf, size_t capacity);

/* --- Virtually contiguous sequences (include/gpumem/kv/kv_virtual_sequences.hpp) ---------
 * Each sequence's keys and values in one virtual range of its own that grows by mapping
 * pages, token-major (all layers of a token side by side):
 *
 *   address(seq, token, layer, kv, head, dim) = base(seq) + token * token_stride
 *       + layer * layer_stride + kv * kv_stride + head * head_stride + dim * dtype_bytes
 *
 * so one layer's keys of a sequence are an ordinary strided [tokens][kv_heads][head_dim]
 * array that stock attention (SDPA) reads without a block table. A sequence holds at most
 * one partly used page. Pages come from the pool and go back at free (which waits for the
 * stream). Errors as above; layout.block_tokens is ignored. */
typedef struct gpumem_kv_vseqs gpumem_kv_vseqs;

typedef struct gpumem_kv_vseqs_info {
  uint64_t sequences;
  uint64_t mapped_bytes;        /* device memory held */
  uint64_t live_bytes;          /* tokens held * token_stride */
  uint64_t max_sequence_tokens; /* each range is reserved for this many */
  uint64_t page_size;
  uint64_t token_stride;
  uint64_t layer_stride;
  uint64_t kv_stride;
  uint64_t head_stride;
  uint64_t dtype_bytes;
} gpumem_kv_vseqs_info;

GPUMEM_API gpumem_status gpumem_kv_vseqs_create(gpumem_pool* pool, const gpumem_kv_layout* layout,
                                                uint64_t max_sequence_tokens, void* stream,
                                                gpumem_kv_vseqs** out);
GPUMEM_API void gpumem_kv_vseqs_destroy(gpumem_kv_vseqs* vseqs);
/* A sequence with room for `tokens` tokens. */
GPUMEM_API gpumem_status gpumem_kv_vseqs_add(gpumem_kv_vseqs* vseqs, uint64_t tokens,
                                             uint64_t* seq);
/* Room for `tokens` more (all or nothing). */
GPUMEM_API gpumem_status gpumem_kv_vseqs_append(gpumem_kv_vseqs* vseqs, uint64_t seq,
                                                uint64_t tokens);
GPUMEM_API gpumem_status gpumem_kv_vseqs_free(gpumem_kv_vseqs* vseqs, uint64_t seq);
/* The sequence's base address and token count (either output may be NULL). */
GPUMEM_API gpumem_status gpumem_kv_vseqs_sequence(gpumem_kv_vseqs* vseqs, uint64_t seq,
                                                  uint64_t* base, uint64_t* tokens);
GPUMEM_API gpumem_status gpumem_kv_vseqs_info_get(gpumem_kv_vseqs* vseqs,
                                                  gpumem_kv_vseqs_info* out);
/* As gpumem_kv_validate. */
GPUMEM_API size_t gpumem_kv_vseqs_validate(gpumem_kv_vseqs* vseqs, char* buf, size_t capacity);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GPUMEM_INTEROP_GPUMEM_KV_H */
