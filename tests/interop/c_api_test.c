/* The C API used from C (compiled as C99, -Wall -Wextra -Wpedantic -Werror): pools on a
 * private sim device, typed error codes with their texts, out of memory, stats, streams and
 * record_stream, a refused free leaving the allocation intact. Exits non-zero on the first
 * failed check, naming it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem/interop/gpumem.h"

#include "c_check.h"

static void bad_config(void) {
  gpumem_pool* pool = (gpumem_pool*)&failures; /* must be reset to NULL on failure */
  CHECK(gpumem_pool_create("platform:sim,colour:blue", &pool) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(pool == NULL);
  CHECK(strstr(gpumem_last_error(), "colour") != NULL);
  CHECK(gpumem_pool_create("allocator:bump,platform:sim", &pool) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "bump") != NULL);
  CHECK(gpumem_pool_create("platform:sim,device:7", &pool) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "device 7") != NULL);
  CHECK(gpumem_pool_create("platform:sim,limit:lots", &pool) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_last_status() == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_pool_create("platform:sim", NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
}

static void malloc_free_and_errors(const char* config) {
  gpumem_pool* pool = NULL;
  gpumem_stats s;
  void *a, *b;
  CHECK(gpumem_pool_create(config, &pool) == GPUMEM_SUCCESS);
  if (pool == NULL) return;

  a = gpumem_malloc(pool, 3 * MIB, NULL);
  b = gpumem_malloc(pool, 1000, NULL);
  CHECK(a != NULL && b != NULL && a != b);
  CHECK(((size_t)a % 256) == 0 && ((size_t)b % 256) == 0);
  memset(a, 0x11, 3 * MIB); /* sim memory is host memory */
  memset(b, 0x22, 1000);

  /* Bad frees: refused with a code and a text, the allocation still live. */
  CHECK(gpumem_free(pool, (char*)a + 256, 3 * MIB, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "interior") != NULL);
  CHECK(gpumem_free(pool, a, 2 * MIB, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "size mismatch") != NULL);
  CHECK(gpumem_free(pool, NULL, 16, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_pool_stats(pool, &s) == GPUMEM_SUCCESS);
  CHECK(s.live_allocations == 2 && s.live_bytes == 3 * MIB + 1000);
  CHECK(((unsigned char*)a)[3 * MIB - 1] == 0x11 && ((unsigned char*)b)[999] == 0x22);

  CHECK(gpumem_free(pool, a, 3 * MIB, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_free(pool, a, 3 * MIB, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "double free") != NULL);

  /* Size 0: refused, NULL, a code. */
  CHECK(gpumem_malloc(pool, 0, NULL) == NULL);
  CHECK(gpumem_last_status() == GPUMEM_ERROR_INVALID_ARGUMENT);

  /* Out of memory (limit:64M): the code, the report, the OOM count; state intact. */
  CHECK(gpumem_malloc(pool, 80 * MIB, NULL) == NULL);
  CHECK(gpumem_last_status() == GPUMEM_ERROR_OUT_OF_MEMORY);
  CHECK(strstr(gpumem_last_error(), "out of memory") != NULL);
  CHECK(gpumem_pool_stats(pool, &s) == GPUMEM_SUCCESS);
  CHECK(s.oom_count == 1 && s.live_allocations == 1 && s.live_bytes == 1000);
  CHECK(s.allocations == 2 && s.deallocations == 1);
  CHECK(s.peak_live_bytes == 3 * MIB + 1000);
  CHECK(s.peak_reserved_bytes >= s.peak_live_bytes);
  CHECK(s.fragmentation == (double)s.peak_reserved_bytes / (double)s.peak_live_bytes);
  CHECK(((unsigned char*)b)[0] == 0x22);

  CHECK(gpumem_free(pool, b, 1000, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_pool_stats(pool, &s) == GPUMEM_SUCCESS && s.live_bytes == 0);
  gpumem_pool_destroy(pool);
}

static void streams(void) {
  gpumem_pool* pool = NULL;
  void* stream = NULL;
  void* p;
  gpumem_stats s;
  CHECK(gpumem_pool_create("platform:sim,sim_capacity:256M", &pool) == GPUMEM_SUCCESS);
  if (pool == NULL) return;
  CHECK(gpumem_stream_create(pool, &stream) == GPUMEM_SUCCESS && stream != NULL);
  /* Used on a second stream, freed on the default stream: the free waits for it. */
  p = gpumem_malloc(pool, MIB, NULL);
  CHECK(p != NULL);
  CHECK(gpumem_record_stream(pool, p, stream) == GPUMEM_SUCCESS);
  CHECK(gpumem_free(pool, p, MIB, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_pool_stats(pool, &s) == GPUMEM_SUCCESS && s.cross_stream_waits == 1);
  /* Allocated and freed on the second stream. */
  p = gpumem_malloc(pool, MIB, stream);
  CHECK(p != NULL);
  CHECK(gpumem_free(pool, p, MIB, stream) == GPUMEM_SUCCESS);
  CHECK(gpumem_stream_synchronize(pool, stream) == GPUMEM_SUCCESS);
  CHECK(gpumem_stream_destroy(pool, stream) == GPUMEM_SUCCESS);
  CHECK(gpumem_stream_destroy(pool, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_pool_stats(pool, &s) == GPUMEM_SUCCESS && s.live_allocations == 0);
  gpumem_pool_destroy(pool);
}

static void null_handles(void) {
  gpumem_stats s;
  void* out = NULL;
  CHECK(gpumem_malloc(NULL, 16, NULL) == NULL);
  CHECK(gpumem_last_status() == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "null pool") != NULL);
  CHECK(gpumem_free(NULL, &out, 16, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_pool_stats(NULL, &s) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_allocate(NULL, 16, 256, NULL, &out) == GPUMEM_ERROR_INVALID_ARGUMENT && out == NULL);
  CHECK(gpumem_snapshot(NULL, "x") == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strcmp(gpumem_pool_allocator(NULL), "") == 0);
  CHECK(gpumem_pool_device(NULL) == -1);
  gpumem_pool_destroy(NULL);
}

int main(void) {
  char expected[32];
  sprintf(expected, "%d.%d.%d", GPUMEM_VERSION_MAJOR, GPUMEM_VERSION_MINOR, GPUMEM_VERSION_PATCH);
  CHECK(strcmp(gpumem_version(), expected) == 0);
  CHECK(gpumem_version_number() ==
        GPUMEM_VERSION_MAJOR * 10000 + GPUMEM_VERSION_MINOR * 100 + GPUMEM_VERSION_PATCH);
  CHECK(strcmp(gpumem_status_name(GPUMEM_ERROR_OUT_OF_MEMORY), "GPUMEM_ERROR_OUT_OF_MEMORY") == 0);
  bad_config();
  malloc_free_and_errors("platform:sim,sim_capacity:1G,limit:64M");
  malloc_free_and_errors("allocator:caching_pool,backend:driver,platform:sim,sim_capacity:1G,limit:64M");
  streams();
  null_handles();
  if (failures != 0) {
    fprintf(stderr, "c_api_c_test: %d check(s) failed\n", failures);
    return EXIT_FAILURE;
  }
  printf("c_api_c_test: all checks passed\n");
  return EXIT_SUCCESS;
}
