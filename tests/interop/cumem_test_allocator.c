/* A CUDAPluggableAllocator library that maps every allocation with cuMemCreate / cuMemMap,
 * as vLLM's CuMemAllocator and torch_memory_saver do, with their pause / resume: pause
 * unmaps and releases every allocation's physical memory (keeping its addresses), resume
 * creates and maps it again at the same addresses. For torch_native_allocator_test.py:
 * torch.cuda.MemPool(CUDAPluggableAllocator(this, "cumem_test_malloc", "cumem_test_free"))
 * inside a process whose allocator is gpumem.
 *
 * Built by the test with the C compiler and -lcuda. Invariants: every live allocation is in
 * allocs[] once; a paused allocation has no handle and no mapping, only its address range. */
#include <cuda.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#define MAX_ALLOCS 4096

struct alloc {
  CUdeviceptr ptr;
  size_t size; /* rounded to the granularity */
  int device;
  CUmemGenericAllocationHandle handle;
  int mapped;
};

static struct alloc allocs[MAX_ALLOCS];
static int failures;

static int map_one(struct alloc* a) {
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = a->device;
  if (cuMemCreate(&a->handle, a->size, &prop, 0) != CUDA_SUCCESS) return 0;
  if (cuMemMap(a->ptr, a->size, 0, a->handle, 0) != CUDA_SUCCESS) {
    cuMemRelease(a->handle);
    return 0;
  }
  CUmemAccessDesc access = {0};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = a->device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (cuMemSetAccess(a->ptr, a->size, &access, 1) != CUDA_SUCCESS) {
    cuMemUnmap(a->ptr, a->size);
    cuMemRelease(a->handle);
    return 0;
  }
  a->mapped = 1;
  return 1;
}

static void unmap_one(struct alloc* a) {
  if (!a->mapped) return;
  if (cuMemUnmap(a->ptr, a->size) != CUDA_SUCCESS) ++failures;
  if (cuMemRelease(a->handle) != CUDA_SUCCESS) ++failures;
  a->mapped = 0;
}

void* cumem_test_malloc(ssize_t size, int device, void* stream) {
  (void)stream;
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t gran = 0;
  if (cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS)
    return NULL;
  for (int i = 0; i < MAX_ALLOCS; ++i)
    if (allocs[i].ptr == 0) {
      struct alloc* a = &allocs[i];
      a->size = ((size_t)size + gran - 1) / gran * gran;
      a->device = device;
      if (cuMemAddressReserve(&a->ptr, a->size, 0, 0, 0) != CUDA_SUCCESS) {
        a->ptr = 0;
        return NULL;
      }
      if (!map_one(a)) {
        cuMemAddressFree(a->ptr, a->size);
        a->ptr = 0;
        return NULL;
      }
      return (void*)a->ptr;
    }
  return NULL;
}

void cumem_test_free(void* ptr, ssize_t size, int device, void* stream) {
  (void)size, (void)device, (void)stream;
  for (int i = 0; i < MAX_ALLOCS; ++i)
    if (allocs[i].ptr == (CUdeviceptr)ptr) {
      unmap_one(&allocs[i]);
      if (cuMemAddressFree(allocs[i].ptr, allocs[i].size) != CUDA_SUCCESS) ++failures;
      allocs[i].ptr = 0;
      return;
    }
  ++failures;
}

/* torch_memory_saver's pause: the memory goes back to the driver, the addresses stay. */
size_t cumem_test_pause(void) {
  size_t released = 0;
  for (int i = 0; i < MAX_ALLOCS; ++i)
    if (allocs[i].ptr != 0 && allocs[i].mapped) {
      unmap_one(&allocs[i]);
      released += allocs[i].size;
    }
  return released;
}

/* Its resume: new memory at the same addresses (contents not kept, as vLLM's discard). */
int cumem_test_resume(void) {
  for (int i = 0; i < MAX_ALLOCS; ++i)
    if (allocs[i].ptr != 0 && !allocs[i].mapped && !map_one(&allocs[i])) return 0;
  return 1;
}

int cumem_test_failures(void) { return failures; }
