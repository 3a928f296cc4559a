/* Uses the installed C API from C99: a pool on a private sim device, an allocation, a
 * refused double free with its error code and text. Exit status 0 only if all held. */
#include <stdio.h>
#include <string.h>

#include <gpumem/interop/gpumem.h>

int main(void) {
  gpumem_pool* pool = NULL;
  void* p;
  gpumem_stats stats;
  if (gpumem_pool_create("platform:sim,sim_capacity:256M", &pool) != GPUMEM_SUCCESS) {
    fprintf(stderr, "create: %s\n", gpumem_last_error());
    return 1;
  }
  p = gpumem_malloc(pool, 1 << 20, NULL);
  if (p == NULL) return 2;
  if (gpumem_free(pool, p, 1 << 20, NULL) != GPUMEM_SUCCESS) return 3;
  if (gpumem_free(pool, p, 1 << 20, NULL) != GPUMEM_ERROR_INVALID_ARGUMENT) return 4;
  if (strstr(gpumem_last_error(), "double free") == NULL) return 5;
  if (gpumem_pool_stats(pool, &stats) != GPUMEM_SUCCESS || stats.allocations != 1) return 6;
  gpumem_pool_destroy(pool);
  printf("consumer_c: ok (gpumem %s)\n", gpumem_version());
  return 0;
}
