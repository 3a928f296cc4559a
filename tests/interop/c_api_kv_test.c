/* The KV cache's C API (gpumem_kv.h) used from C99 (-Werror) on a private sim device,
 * where device memory is host memory: sequences, prefix sharing, bytes written through the
 * documented strides surviving copy on write and swap, block tables for a kernel, shrink,
 * stats, and bad input (layout mismatch, append past the maximum, a freed sequence's
 * block table, a too small buffer, counts at the edges of their types, a bogus stream, a
 * pool destroyed before its cache) refused with a status and a text, state intact.
 * Exits non-zero on the first failed check, naming it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem/interop/gpumem_kv.h"

#include "c_check.h"

/* 2 layers, 2 KV heads, head_dim 64, f16, 16 tokens a block: 16 KiB blocks. */
static gpumem_kv_config small_config(void) {
  gpumem_kv_config c;
  gpumem_kv_config_init(&c);
  c.layout.layers = 2;
  c.layout.kv_heads = 2;
  c.layout.head_dim = 64;
  c.layout.dtype = GPUMEM_KV_F16;
  c.max_blocks = 256;
  c.max_sequence_tokens = 1000;
  return c;
}

static int valid(gpumem_kv_cache* kv) {
  char text[256];
  size_t n = gpumem_kv_validate(kv, text, sizeof text);
  if (n != 0) fprintf(stderr, "validate: %s\n", text);
  return n == 0;
}

/* Layer 1's value slot of token `pos` (head 1, dim 3) of a sequence, by the strides. */
static unsigned short* slot(const gpumem_kv_storage* st, const uint32_t* table, size_t pos) {
  const uint64_t bt = st->layout.block_tokens;
  uint64_t addr = st->base + table[pos / bt] * st->block_stride + 1 * st->layer_stride +
                  1 * st->kv_stride + (pos % bt) * st->token_stride + 1 * st->head_stride +
                  3 * st->dtype_bytes;
  return (unsigned short*)(size_t)addr;
}

static void lifecycle(void) {
  gpumem_pool* pool = NULL;
  gpumem_kv_cache* kv = NULL;
  gpumem_kv_config c = small_config();
  gpumem_kv_storage st;
  gpumem_kv_stats s;
  int32_t prompt[40];
  uint32_t table[8], child_table[8];
  uint64_t a = 0, b = 0, child = 0, cached = 99, tokens = 0, blocks = 0, pages = 0;
  size_t count = 0, i;
  int32_t one = 7, swapped = -1;

  CHECK(gpumem_pool_create("platform:sim,sim_capacity:1G", &pool) == GPUMEM_SUCCESS);
  if (pool == NULL) return;
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_SUCCESS && kv != NULL);
  if (kv == NULL) {
    gpumem_pool_destroy(pool);
    return;
  }

  CHECK(gpumem_kv_storage_get(kv, &st) == GPUMEM_SUCCESS);
  CHECK(st.block_stride == 2 * 2 * 16 * 2 * 64 * 2);
  CHECK(st.layer_stride == st.block_stride / 2 && st.kv_stride == st.layer_stride / 2);
  CHECK(st.token_stride == 2 * 64 * 2 && st.head_stride == 64 * 2 && st.dtype_bytes == 2);
  CHECK(st.max_blocks == 256 && st.base != 0 && st.layout.dtype == GPUMEM_KV_F16);

  for (i = 0; i < 40; ++i) prompt[i] = (int32_t)(100 + i);
  CHECK(gpumem_kv_add_sequence(kv, prompt, 40, 0, &a, &cached) == GPUMEM_SUCCESS);
  CHECK(cached == 0);
  CHECK(gpumem_kv_block_table(kv, a, NULL, 0, &count) == GPUMEM_SUCCESS && count == 3);
  CHECK(gpumem_kv_block_table(kv, a, table, 8, &count) == GPUMEM_SUCCESS && count == 3);
  for (i = 0; i < 40; ++i) *slot(&st, table, i) = (unsigned short)(1000 + i);

  /* The same prompt again: its two full blocks are shared (at most up to the block before
   * the last prompt token). */
  CHECK(gpumem_kv_add_sequence(kv, prompt, 40, 0, &b, &cached) == GPUMEM_SUCCESS);
  CHECK(cached == 32);
  CHECK(gpumem_kv_block_table(kv, b, child_table, 8, &count) == GPUMEM_SUCCESS && count == 3);
  CHECK(child_table[0] == table[0] && child_table[1] == table[1] && child_table[2] != table[2]);
  CHECK(*slot(&st, child_table, 17) == 1017);
  CHECK(gpumem_kv_free(kv, b) == GPUMEM_SUCCESS);

  /* Fork shares everything; the child's append copies the shared last block first. */
  CHECK(gpumem_kv_fork(kv, a, &child) == GPUMEM_SUCCESS && child != a);
  CHECK(gpumem_kv_append(kv, child, &one, 1) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_synchronize(kv) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_block_table(kv, child, child_table, 8, &count) == GPUMEM_SUCCESS && count == 3);
  CHECK(child_table[0] == table[0] && child_table[2] != table[2]);
  CHECK(*slot(&st, child_table, 39) == 1039); /* the copy carries the bytes */
  CHECK(gpumem_kv_sequence_tokens(kv, child, &tokens) == GPUMEM_SUCCESS && tokens == 41);
  CHECK(gpumem_kv_stats_get(kv, &s) == GPUMEM_SUCCESS);
  CHECK(s.cow_copies == 1 && s.sequences == 2 && s.prefix_hits == 2 && s.block_bytes == st.block_stride);
  CHECK(s.mapped_bytes >= s.used_blocks * st.block_stride);

  /* A decode step over two sequences at once, and their tables for a kernel. */
  {
    uint64_t seqs[2];
    int32_t toks[2] = {1, 2};
    uint32_t rows[2 * 4];
    uint64_t lengths[2];
    size_t done = 99;
    seqs[0] = a;
    seqs[1] = child;
    CHECK(gpumem_kv_append_each(kv, seqs, toks, 2, &done) == GPUMEM_SUCCESS && done == 2);
    CHECK(gpumem_kv_block_tables(kv, seqs, 2, rows, 4, 0xdead, lengths) == GPUMEM_SUCCESS);
    CHECK(lengths[0] == 41 && lengths[1] == 42);
    CHECK(rows[0] == table[0] && rows[3] == 0xdead && rows[4 + 3] == 0xdead);
    CHECK(gpumem_kv_block_tables(kv, seqs, 2, rows, 2, 0, lengths) == GPUMEM_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(gpumem_last_error(), "a row holds 2") != NULL);
  }

  /* Swap out and in: bytes intact, the table names new resident blocks. */
  CHECK(gpumem_kv_swap_out(kv, child) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_is_swapped(kv, child, &swapped) == GPUMEM_SUCCESS && swapped == 1);
  CHECK(gpumem_kv_block_table(kv, child, child_table, 8, &count) == GPUMEM_SUCCESS);
  CHECK(child_table[2] == GPUMEM_KV_NOT_RESIDENT && child_table[0] == table[0]);
  CHECK(gpumem_kv_append(kv, child, &one, 1) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "swapped out") != NULL);
  CHECK(gpumem_kv_blocks_needed(kv, child, 1, &blocks) == GPUMEM_SUCCESS && blocks == 1);
  CHECK(gpumem_kv_swap_in(kv, child) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_synchronize(kv) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_block_table(kv, child, child_table, 8, &count) == GPUMEM_SUCCESS);
  CHECK(child_table[2] != GPUMEM_KV_NOT_RESIDENT && *slot(&st, child_table, 38) == 1038);
  CHECK(valid(kv));

  /* Free everything; shrink gives the pages back. */
  CHECK(gpumem_kv_free(kv, a) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_free(kv, child) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_available_blocks(kv, &blocks) == GPUMEM_SUCCESS && blocks == 256);
  CHECK(gpumem_kv_shrink(kv, 0, 1, &pages) == GPUMEM_SUCCESS && pages >= 1);
  CHECK(gpumem_kv_stats_get(kv, &s) == GPUMEM_SUCCESS);
  CHECK(s.mapped_bytes == 0 && s.sequences == 0 && s.cached_blocks == 0);
  CHECK(valid(kv));
  gpumem_kv_destroy(kv);
  gpumem_pool_destroy(pool);
}

static void bad_input(void) {
  gpumem_pool* pool = NULL;
  gpumem_pool* caching = NULL;
  gpumem_kv_cache* kv = NULL;
  gpumem_kv_config c = small_config();
  gpumem_kv_layout model;
  gpumem_kv_stats before, after;
  int32_t prompt[1000];
  uint32_t table[4];
  uint64_t a = 0, b = 0, gone = 0, child = 0;
  size_t count = 77, i;

  for (i = 0; i < 1000; ++i) prompt[i] = (int32_t)i;
  CHECK(gpumem_pool_create("platform:sim,sim_capacity:1G", &pool) == GPUMEM_SUCCESS);
  if (pool == NULL) return;

  /* Bad layouts and configurations: refused, no cache. */
  kv = (gpumem_kv_cache*)&failures;
  c.layout.kv_heads = 0;
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_ERROR_INVALID_ARGUMENT && kv == NULL);
  CHECK(strstr(gpumem_last_error(), "bad layout") != NULL);
  c = small_config();
  c.layout.dtype = 9;
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "unknown dtype 9") != NULL);
  c = small_config();
  c.layout.head_dim = 3; /* 3 * 2 heads * 2 bytes: blocks not a multiple of 256 bytes */
  c.layout.layers = 1;
  c.layout.block_tokens = 1;
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "multiple of 256") != NULL);
  c = small_config();
  CHECK(gpumem_kv_create(NULL, &c, &kv) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_create(pool, NULL, &kv) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_pool_create("allocator:caching_pool,platform:sim,sim_capacity:1G", &caching) ==
        GPUMEM_SUCCESS);
  CHECK(gpumem_kv_create(caching, &c, &kv) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "vmm_page_pool") != NULL);
  gpumem_pool_destroy(caching);
  CHECK(gpumem_kv_create(caching, &c, &kv) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "destroyed") != NULL);

  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_SUCCESS);
  if (kv == NULL) {
    gpumem_pool_destroy(pool);
    return;
  }

  /* A model whose layout differs: each differing field named. */
  model = c.layout;
  CHECK(gpumem_kv_check_layout(kv, &model) == GPUMEM_SUCCESS);
  model.block_tokens = 32; /* the cache's choice, not the model's */
  CHECK(gpumem_kv_check_layout(kv, &model) == GPUMEM_SUCCESS);
  model.kv_heads = 8;
  model.dtype = GPUMEM_KV_BF16;
  CHECK(gpumem_kv_check_layout(kv, &model) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "kv_heads 8 (the cache has 2)") != NULL);
  CHECK(strstr(gpumem_last_error(), "dtype bf16 (the cache has f16)") != NULL);
  CHECK(strstr(gpumem_last_error(), "head_dim") == NULL);

  /* Append past max_sequence_tokens: refused, the sequence unchanged. */
  CHECK(gpumem_kv_add_sequence(kv, prompt, 990, 0, &a, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_stats_get(kv, &before) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_append(kv, a, prompt, 11) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "max_sequence_tokens 1000") != NULL);
  CHECK(gpumem_kv_stats_get(kv, &after) == GPUMEM_SUCCESS);
  CHECK(after.used_blocks == before.used_blocks && after.filled_slots == before.filled_slots);
  CHECK(gpumem_kv_append(kv, a, prompt, 10) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_add_sequence(kv, prompt, 1001, 0, &b, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_append(kv, a, NULL, 3) == GPUMEM_ERROR_INVALID_ARGUMENT);

  /* A freed sequence: every call on it refused, naming it freed. */
  CHECK(gpumem_kv_add_sequence(kv, prompt, 5, 1, &gone, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_free(kv, gone) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_block_table(kv, gone, table, 4, &count) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "was freed") != NULL && count == 77);
  CHECK(gpumem_kv_block_tables(kv, &gone, 1, table, 4, 0, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_free(kv, gone) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_fork(kv, gone, &child) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_append(kv, gone, prompt, 1) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_swap_out(kv, gone) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_block_table(kv, 12345, table, 4, &count) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "does not exist") != NULL);

  /* A buffer too small: nothing written. */
  table[0] = 0xabcd;
  CHECK(gpumem_kv_block_table(kv, a, table, 4, &count) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "the buffer holds 4") != NULL && table[0] == 0xabcd);

  /* Out of blocks: a typed out-of-memory, the cache intact. */
  CHECK(gpumem_kv_add_sequence(kv, prompt, 1000, 2, &b, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_add_sequence(kv, prompt, 1000, 3, &b, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_add_sequence(kv, prompt, 1000, 4, &b, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_stats_get(kv, &before) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_add_sequence(kv, prompt, 1000, 5, &b, NULL) == GPUMEM_ERROR_OUT_OF_MEMORY);
  CHECK(strstr(gpumem_last_error(), "out of blocks") != NULL);
  CHECK(gpumem_kv_stats_get(kv, &after) == GPUMEM_SUCCESS);
  CHECK(after.used_blocks == before.used_blocks && after.sequences == before.sequences);
  CHECK(valid(kv));

  /* Null handles and outputs. */
  CHECK(gpumem_kv_free(NULL, a) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "null cache") != NULL);
  CHECK(gpumem_kv_stats_get(kv, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_fork(kv, a, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  gpumem_kv_destroy(NULL);

  gpumem_kv_destroy(kv);
  gpumem_pool_destroy(pool);
}

/* The cache's pages come from the pool's budget: under a pool limit, the cache cannot
 * take more than the limit, and its pages go back to the pool at destroy. */
static void one_budget(void) {
  gpumem_pool* pool = NULL;
  gpumem_kv_cache* kv = NULL;
  gpumem_kv_config c = small_config();
  gpumem_stats ps;
  int32_t prompt[512];
  uint64_t seq = 0;
  size_t i, admitted = 0;
  for (i = 0; i < 512; ++i) prompt[i] = (int32_t)i;
  c.max_blocks = 4096;
  c.max_sequence_tokens = 0;
  CHECK(gpumem_pool_create("platform:sim,sim_capacity:1G,limit:8M", &pool) == GPUMEM_SUCCESS);
  if (pool == NULL) return;
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_SUCCESS);
  if (kv != NULL) {
    /* 512 tokens = 32 blocks of 16 KiB = 512 KiB: at most 16 of them under 8 MiB. */
    for (i = 0; i < 40; ++i) {
      if (gpumem_kv_add_sequence(kv, prompt, 512, i, &seq, NULL) != GPUMEM_SUCCESS) break;
      ++admitted;
    }
    CHECK(admitted >= 14 && admitted <= 16);
    CHECK(gpumem_last_status() == GPUMEM_ERROR_OUT_OF_MEMORY);
    CHECK(valid(kv));
    gpumem_kv_destroy(kv);
  }
  CHECK(gpumem_pool_stats(pool, &ps) == GPUMEM_SUCCESS && ps.live_bytes == 0);
  gpumem_pool_destroy(pool);
}

/* Virtually contiguous sequences: a sequence's bytes at base + token * token_stride + ...,
 * growing by pages with the bytes kept, at most one partly used page each, pages back to
 * the pool at free, bad input refused. */
static void virtual_sequences(void) {
  gpumem_pool* pool = NULL;
  gpumem_kv_vseqs* vs = NULL;
  gpumem_kv_config c = small_config();
  gpumem_kv_vseqs_info info;
  gpumem_stats ps;
  uint64_t a = 0, b = 0, base = 0, tokens = 0, base2 = 0;
  unsigned short* p;
  char text[128];
  CHECK(gpumem_pool_create("platform:sim,sim_capacity:1G,limit:6M", &pool) == GPUMEM_SUCCESS);
  if (pool == NULL) return;
  c.layout.dtype = 7;
  CHECK(gpumem_kv_vseqs_create(pool, &c.layout, 8192, NULL, &vs) == GPUMEM_ERROR_INVALID_ARGUMENT);
  c.layout.dtype = GPUMEM_KV_F16;
  CHECK(gpumem_kv_vseqs_create(pool, &c.layout, 0, NULL, &vs) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_vseqs_create(pool, &c.layout, 8192, NULL, &vs) == GPUMEM_SUCCESS && vs != NULL);
  if (vs == NULL) {
    gpumem_pool_destroy(pool);
    return;
  }
  CHECK(gpumem_kv_vseqs_info_get(vs, &info) == GPUMEM_SUCCESS);
  /* 2 layers x 2 (K, V) x 2 heads x 64 dims x 2 bytes = 1 KiB a token: 2048 tokens a page. */
  CHECK(info.token_stride == 1024 && info.layer_stride == 512 && info.kv_stride == 256);
  CHECK(info.head_stride == 128 && info.dtype_bytes == 2 && info.page_size == 2 * MIB);

  CHECK(gpumem_kv_vseqs_add(vs, 10, &a) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_vseqs_sequence(vs, a, &base, &tokens) == GPUMEM_SUCCESS && tokens == 10);
  /* Token 9, layer 1, values, head 1, dim 3. */
  p = (unsigned short*)(size_t)(base + 9 * info.token_stride + info.layer_stride +
                                info.kv_stride + info.head_stride + 3 * info.dtype_bytes);
  *p = 4321;
  CHECK(gpumem_kv_vseqs_append(vs, a, 3000) == GPUMEM_SUCCESS); /* crosses into page 2 */
  CHECK(gpumem_kv_vseqs_sequence(vs, a, &base2, &tokens) == GPUMEM_SUCCESS);
  CHECK(base2 == base && tokens == 3010 && *p == 4321);
  *(unsigned short*)(size_t)(base + 3009 * info.token_stride) = 7; /* mapped and writable */
  CHECK(gpumem_kv_vseqs_add(vs, 1, &b) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_vseqs_info_get(vs, &info) == GPUMEM_SUCCESS);
  CHECK(info.sequences == 2 && info.mapped_bytes == 3 * 2 * MIB);
  CHECK(info.live_bytes == 3011 * 1024);
  CHECK(gpumem_kv_vseqs_validate(vs, text, sizeof text) == 0);

  /* Bad input: past the maximum, a freed sequence, the pool's limit. */
  CHECK(gpumem_kv_vseqs_append(vs, a, 8192) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "max_sequence_tokens 8192") != NULL);
  CHECK(gpumem_kv_vseqs_add(vs, 9000, &b) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_vseqs_free(vs, b) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_vseqs_sequence(vs, b, &base, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "was freed") != NULL);
  CHECK(gpumem_kv_vseqs_append(vs, a, 5000) == GPUMEM_ERROR_OUT_OF_MEMORY); /* 6 MiB limit */
  CHECK(gpumem_kv_vseqs_info_get(vs, &info) == GPUMEM_SUCCESS);
  CHECK(info.mapped_bytes == 2 * 2 * MIB && info.live_bytes == 3010 * 1024);
  CHECK(gpumem_kv_vseqs_append(vs, a, 1000) == GPUMEM_SUCCESS); /* within its 2 pages */
  CHECK(gpumem_kv_vseqs_validate(vs, text, sizeof text) == 0);
  CHECK(gpumem_kv_vseqs_free(vs, a) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_vseqs_info_get(vs, &info) == GPUMEM_SUCCESS && info.mapped_bytes == 0);
  CHECK(gpumem_kv_vseqs_add(NULL, 1, &a) == GPUMEM_ERROR_INVALID_ARGUMENT);
  gpumem_kv_vseqs_destroy(vs);
  CHECK(gpumem_pool_stats(pool, &ps) == GPUMEM_SUCCESS && ps.live_bytes == 0);
  gpumem_pool_destroy(pool);
}

/* Counts at the edges of their types. A count that can never fit (past max_sequence_tokens,
 * or without a cap past the capacity of max_blocks blocks) is an invalid argument naming
 * the limit, however large (SIZE_MAX included: no wrap); one that could fit but finds no
 * block now is out of memory. Nothing changes on either. */
static int32_t many[16384];

static void counts_at_the_edges(void) {
  gpumem_pool* pool = NULL;
  gpumem_kv_cache* kv = NULL;
  gpumem_kv_config c = small_config();
  gpumem_kv_stats before, after;
  int32_t prompt[64];
  uint32_t rows[8];
  uint64_t a = 0, b = 0, blocks = 0, pages = 0, seqs[2];
  size_t done = 99, i;

  for (i = 0; i < 64; ++i) prompt[i] = (int32_t)i;
  CHECK(gpumem_pool_create("platform:sim,sim_capacity:1G", &pool) == GPUMEM_SUCCESS);
  if (pool == NULL) return;
  c.max_sequence_tokens = 0; /* no cap: the capacity, 256 blocks of 16 tokens, bounds */
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_SUCCESS);
  if (kv == NULL) {
    gpumem_pool_destroy(pool);
    return;
  }
  CHECK(gpumem_kv_add_sequence(kv, prompt, 20, 0, &a, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_stats_get(kv, &before) == GPUMEM_SUCCESS);

  CHECK(gpumem_kv_append(kv, a, prompt, SIZE_MAX) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "capacity of 4096 tokens") != NULL);
  CHECK(gpumem_kv_append(kv, a, prompt, SIZE_MAX - 16) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_append(kv, a, prompt, SIZE_MAX / 4) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_append(kv, a, prompt, 4096 - 20 + 1) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "has 20 tokens; 4077 more exceed the cache's capacity") != NULL);
  CHECK(gpumem_kv_add_sequence(kv, prompt, SIZE_MAX, 0, &b, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_add_sequence(kv, prompt, 4097, 0, &b, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "4097 tokens exceed the cache's capacity of 4096") != NULL);

  /* blocks_needed: the same limit, no wrap; exact below it. */
  blocks = 77;
  CHECK(gpumem_kv_blocks_needed(kv, a, UINT64_MAX, &blocks) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(blocks == 77 && strstr(gpumem_last_error(), "capacity of 4096") != NULL);
  CHECK(gpumem_kv_blocks_needed(kv, a, UINT64_MAX - 14, &blocks) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_blocks_needed(kv, a, 4096 - 20, &blocks) == GPUMEM_SUCCESS && blocks == 254);
  CHECK(gpumem_kv_blocks_needed(kv, a, 12, &blocks) == GPUMEM_SUCCESS && blocks == 0);
  CHECK(gpumem_kv_blocks_needed(kv, a, 13, &blocks) == GPUMEM_SUCCESS && blocks == 1);

  /* Caller buffers whose size overflows, or that would wrap the address space. */
  seqs[0] = a;
  seqs[1] = a;
  CHECK(gpumem_kv_append_each(kv, seqs, prompt, SIZE_MAX, &done) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(done == 0 && strstr(gpumem_last_error(), "names no buffer") != NULL);
  CHECK(gpumem_kv_append_each(kv, seqs, prompt, SIZE_MAX / 8 + 1, &done) ==
        GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_block_tables(kv, seqs, SIZE_MAX, rows, 4, 0, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_block_tables(kv, seqs, 2, rows, SIZE_MAX, 0, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_kv_block_tables(kv, seqs, 2, rows, SIZE_MAX / 2 + 1, 0, NULL) ==
        GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "overflows") != NULL);

  CHECK(gpumem_kv_stats_get(kv, &after) == GPUMEM_SUCCESS);
  CHECK(after.used_blocks == before.used_blocks && after.filled_slots == before.filled_slots &&
        after.sequences == before.sequences && after.capacity_blocks == before.capacity_blocks);
  CHECK(valid(kv));

  /* Large counts that could fit are served or are out of memory, never a wrong answer. */
  CHECK(gpumem_kv_evict(kv, UINT64_MAX, &blocks) == GPUMEM_SUCCESS && blocks == 0);
  /* keep_free at the top of its type keeps every page (the sum must not wrap to fewer).
   * Block 128, the first of the second 2 MiB page, is in use: top + keep_free wrapping to
   * 128 or 127 would unmap it. */
  CHECK(gpumem_kv_add_sequence(kv, many, 127 * 16, 0, &b, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_shrink(kv, UINT64_MAX, 0, &pages) == GPUMEM_SUCCESS && pages == 0);
  CHECK(gpumem_kv_shrink(kv, UINT64_MAX - 1, 1, &pages) == GPUMEM_SUCCESS && pages == 0);
  CHECK(gpumem_kv_stats_get(kv, &after) == GPUMEM_SUCCESS && after.used_blocks == 129);
  CHECK(valid(kv));
  gpumem_kv_destroy(kv);
  CHECK(gpumem_pool_destroy(pool) == GPUMEM_SUCCESS);

  /* Under a pool limit, a count within the capacity that finds no block: out of memory. */
  kv = NULL;
  c.max_blocks = 1024; /* 16 MiB of blocks, the pool allows 4 MiB */
  CHECK(gpumem_pool_create("platform:sim,sim_capacity:1G,limit:4M", &pool) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_SUCCESS);
  if (kv != NULL) {
    CHECK(gpumem_kv_add_sequence(kv, prompt, 1, 0, &a, NULL) == GPUMEM_SUCCESS);
    CHECK(gpumem_kv_append(kv, a, many, 16384 - 1) == GPUMEM_ERROR_OUT_OF_MEMORY);
    CHECK(gpumem_kv_blocks_needed(kv, a, 16384 - 1, &blocks) == GPUMEM_SUCCESS && blocks == 1023);
    CHECK(gpumem_kv_append(kv, a, many, 16384) == GPUMEM_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(gpumem_last_error(), "capacity of 16384 tokens") != NULL);
    CHECK(valid(kv));
    gpumem_kv_destroy(kv);
  }
  CHECK(gpumem_pool_destroy(pool) == GPUMEM_SUCCESS);
}

/* A pool is refused destruction while a KV cache or a sequence set stands on it; it stays
 * live and usable, and goes once they are destroyed. */
static void pool_outlives_what_borrows_it(void) {
  gpumem_pool* pool = NULL;
  gpumem_kv_cache* kv = NULL;
  gpumem_kv_vseqs* vs = NULL;
  gpumem_kv_config c = small_config();
  int32_t one = 1;
  uint64_t a = 0, v = 0;
  void* p;

  CHECK(gpumem_pool_create("platform:sim,sim_capacity:1G", &pool) == GPUMEM_SUCCESS);
  if (pool == NULL) return;
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_vseqs_create(pool, &c.layout, 64, NULL, &vs) == GPUMEM_SUCCESS);
  if (kv == NULL || vs == NULL) return;
  CHECK(gpumem_kv_add_sequence(kv, &one, 1, 0, &a, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_vseqs_add(vs, 8, &v) == GPUMEM_SUCCESS);

  CHECK(gpumem_pool_destroy(pool) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "still has 1 KV cache(s) and 1 virtually contiguous") != NULL);
  CHECK(gpumem_last_status() == GPUMEM_ERROR_INVALID_ARGUMENT);
  /* Still live: the pool allocates, the cache and the set work. */
  p = gpumem_malloc(pool, MIB, NULL);
  CHECK(p != NULL);
  CHECK(gpumem_free(pool, p, MIB, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_append(kv, a, &one, 1) == GPUMEM_SUCCESS);
  CHECK(gpumem_kv_vseqs_append(vs, v, 8) == GPUMEM_SUCCESS);
  CHECK(valid(kv));

  gpumem_kv_destroy(kv);
  CHECK(gpumem_pool_destroy(pool) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "still has 0 KV cache(s) and 1 virtually") != NULL);
  gpumem_kv_vseqs_destroy(vs);
  CHECK(gpumem_pool_destroy(pool) == GPUMEM_SUCCESS);
  CHECK(gpumem_pool_destroy(pool) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "destroyed") != NULL);
}

/* The stream is checked at create, as the pools check theirs: a value the platform does
 * not know is refused there, not at the first copy. Reserved fields must be 0. */
static void streams_and_reserved_fields_checked_at_create(void) {
  gpumem_pool* pool = NULL;
  gpumem_kv_cache* kv = NULL;
  gpumem_kv_vseqs* vs = NULL;
  gpumem_kv_config c = small_config();
  void* stream = NULL;

  CHECK(gpumem_pool_create("platform:sim,sim_capacity:1G", &pool) == GPUMEM_SUCCESS);
  if (pool == NULL) return;
  c.stream = (void*)(size_t)0x5eed;
  kv = (gpumem_kv_cache*)&failures;
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_ERROR_INVALID_ARGUMENT && kv == NULL);
  CHECK(strstr(gpumem_last_error(), "stream 0x5eed is not a stream the platform knows") != NULL);
  vs = (gpumem_kv_vseqs*)&failures;
  CHECK(gpumem_kv_vseqs_create(pool, &c.layout, 64, (void*)(size_t)0x5eed, &vs) ==
        GPUMEM_ERROR_INVALID_ARGUMENT && vs == NULL);
  CHECK(strstr(gpumem_last_error(), "stream 0x5eed") != NULL);

  c = small_config();
  c.reserved = 1;
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_ERROR_INVALID_ARGUMENT && kv == NULL);
  CHECK(strstr(gpumem_last_error(), "reserved") != NULL);
  c = small_config();
  c.layout.reserved = -1;
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_ERROR_INVALID_ARGUMENT && kv == NULL);
  CHECK(gpumem_kv_vseqs_create(pool, &c.layout, 64, NULL, &vs) == GPUMEM_ERROR_INVALID_ARGUMENT);

  /* A stream the pool made: accepted, and the cache's copies run on it. */
  c = small_config();
  CHECK(gpumem_stream_create(pool, &stream) == GPUMEM_SUCCESS && stream != NULL);
  c.stream = stream;
  CHECK(gpumem_kv_create(pool, &c, &kv) == GPUMEM_SUCCESS && kv != NULL);
  if (kv != NULL) {
    int32_t t[3] = {1, 2, 3};
    uint64_t a = 0, child = 0;
    CHECK(gpumem_kv_add_sequence(kv, t, 3, 0, &a, NULL) == GPUMEM_SUCCESS);
    CHECK(gpumem_kv_fork(kv, a, &child) == GPUMEM_SUCCESS);
    CHECK(gpumem_kv_append(kv, child, t, 1) == GPUMEM_SUCCESS); /* copy on write */
    CHECK(gpumem_kv_synchronize(kv) == GPUMEM_SUCCESS);
    /* The cache's stream cannot go while the cache lives; nothing changes. */
    CHECK(gpumem_stream_destroy(pool, stream) == GPUMEM_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(gpumem_last_error(), "KV cache") != NULL);
    CHECK(gpumem_kv_append(kv, child, t, 1) == GPUMEM_SUCCESS);
    CHECK(gpumem_kv_synchronize(kv) == GPUMEM_SUCCESS);
    gpumem_kv_destroy(kv);
  }
  CHECK(gpumem_stream_destroy(pool, stream) == GPUMEM_SUCCESS);
  CHECK(gpumem_pool_destroy(pool) == GPUMEM_SUCCESS);
}

int main(void) {
  lifecycle();
  virtual_sequences();
  bad_input();
  one_budget();
  counts_at_the_edges();
  pool_outlives_what_borrows_it();
  streams_and_reserved_fields_checked_at_create();
  if (failures != 0) {
    fprintf(stderr, "c_api_kv_c_test: %d check(s) failed\n", failures);
    return EXIT_FAILURE;
  }
  printf("c_api_kv_c_test: all checks passed\n");
  return EXIT_SUCCESS;
}
