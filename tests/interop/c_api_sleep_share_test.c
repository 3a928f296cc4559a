/* The C API's tags, sleep / wake and sharing between processes, compiled as C (C99 with
 * POSIX): a pattern written through tagged pointers survives sleep (offload) and wake at
 * the same addresses while the device's free memory rises by the tag's bytes in between;
 * the refusals; out of memory during wake and its retry; two real processes sharing memory
 * over a Unix socket, and an importer killed without closing. Exits non-zero on the first
 * failed check, naming it. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem/interop/gpumem.h"

#include "c_check.h"

static unsigned char pattern_byte(size_t i, unsigned seed) {
  return (unsigned char)((i * 131u + seed * 17u + (i >> 12)) & 0xffu);
}
static void write_pattern(void* p, size_t n, unsigned seed) {
  unsigned char* b = (unsigned char*)p;
  size_t i;
  for (i = 0; i < n; ++i) b[i] = pattern_byte(i, seed);
}
static int has_pattern(const void* p, size_t n, unsigned seed) {
  const unsigned char* b = (const unsigned char*)p;
  size_t i;
  for (i = 0; i < n; ++i)
    if (b[i] != pattern_byte(i, seed)) return 0;
  return 1;
}
static size_t device_free(gpumem_pool* pool) {
  size_t free_bytes = 0, total = 0;
  CHECK(gpumem_device_memory(pool, &free_bytes, &total) == GPUMEM_SUCCESS);
  return free_bytes;
}
static uint64_t tag_reserved(gpumem_pool* pool, uint32_t tag) {
  gpumem_stats s;
  CHECK(gpumem_tag_stats(pool, tag, &s) == GPUMEM_SUCCESS);
  return s.reserved_bytes;
}

static void sleep_wake_keeps_pattern_and_addresses(void) {
  enum { n = 3 };
  const size_t sizes[n] = {6 * MIB, 2 * MIB + 100, 20 * MIB};
  void* ptrs[n];
  void* other = NULL;
  void* refused = (void*)&failures;
  gpumem_pool* pool = NULL;
  size_t before, asleep;
  uint64_t reserved;
  int i;
  CHECK(gpumem_pool_create("sim_capacity:1G", &pool) == GPUMEM_SUCCESS);
  for (i = 0; i < n; ++i) {
    CHECK(gpumem_allocate_tagged(pool, sizes[i], 256, NULL, 1, &ptrs[i]) == GPUMEM_SUCCESS);
    write_pattern(ptrs[i], sizes[i], (unsigned)i + 1);
  }
  CHECK(gpumem_allocate_tagged(pool, 4 * MIB, 256, NULL, 2, &other) == GPUMEM_SUCCESS);
  write_pattern(other, 4 * MIB, 99);
  reserved = tag_reserved(pool, 1);
  CHECK(reserved >= 28 * MIB);
  before = device_free(pool);

  CHECK(gpumem_sleep(pool, 1, GPUMEM_SLEEP_OFFLOAD, NULL) == GPUMEM_SUCCESS);
  asleep = device_free(pool);
  CHECK(asleep - before == reserved); /* every byte of the tag went back to the device */
  CHECK(tag_reserved(pool, 1) == 0);
  CHECK(gpumem_tag_asleep(pool, 1) == 1);
  CHECK(gpumem_tag_asleep(pool, 2) == 0);
  /* Refusals, nothing changed. */
  CHECK(gpumem_allocate_tagged(pool, MIB, 256, NULL, 1, &refused) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(refused == NULL);
  CHECK(strstr(gpumem_last_error(), "asleep") != NULL);
  CHECK(gpumem_sleep(pool, 1, GPUMEM_SLEEP_OFFLOAD, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_wake(pool, 2, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_sleep(pool, 1, 7, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  /* Another tag works on. */
  CHECK(has_pattern(other, 4 * MIB, 99));
  CHECK(device_free(pool) == asleep);

  CHECK(gpumem_wake(pool, 1, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_stream_synchronize(pool, NULL) == GPUMEM_SUCCESS);
  CHECK(device_free(pool) == before);
  CHECK(tag_reserved(pool, 1) == reserved);
  for (i = 0; i < n; ++i) CHECK(has_pattern(ptrs[i], sizes[i], (unsigned)i + 1));
  CHECK(gpumem_wake(pool, 1, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  for (i = 0; i < n; ++i) CHECK(gpumem_free(pool, ptrs[i], sizes[i], NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_free(pool, other, 4 * MIB, NULL) == GPUMEM_SUCCESS);
  gpumem_pool_destroy(pool);
}

/* Untagged memory sleeps too (gpumem_malloc refused meanwhile); a free while asleep is
 * allowed and its pages are the tag's cache at wake, given back by a trim; discard gives
 * fresh pages. */
static void untagged_discard_and_free_while_asleep(void) {
  gpumem_pool* pool = NULL;
  void* a;
  void* b;
  CHECK(gpumem_pool_create("sim_capacity:256M", &pool) == GPUMEM_SUCCESS);
  a = gpumem_malloc(pool, 8 * MIB, NULL);
  b = gpumem_malloc(pool, 8 * MIB, NULL);
  CHECK(a != NULL && b != NULL);
  CHECK(gpumem_sleep(pool, 0, GPUMEM_SLEEP_DISCARD, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_malloc(pool, MIB, NULL) == NULL);
  CHECK(gpumem_last_status() == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(gpumem_free(pool, b, 8 * MIB, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_wake(pool, 0, NULL) == GPUMEM_SUCCESS);
  CHECK(tag_reserved(pool, 0) == 16 * MIB);
  memset(a, 0x5a, 8 * MIB); /* mapped and writable again */
  CHECK(gpumem_pool_trim(pool, NULL) == GPUMEM_SUCCESS);
  CHECK(tag_reserved(pool, 0) == 8 * MIB);
  CHECK(gpumem_free(pool, a, 8 * MIB, NULL) == GPUMEM_SUCCESS);
  gpumem_pool_destroy(pool);
}

/* Out of memory during wake: the bytes stay on the host, a later wake succeeds. */
static void wake_out_of_memory_then_retry(void) {
  gpumem_pool* pool = NULL;
  void* slept = NULL;
  void* squatter = NULL;
  void* refused = NULL;
  uint64_t released = 0;
  CHECK(gpumem_pool_create("sim_capacity:64M", &pool) == GPUMEM_SUCCESS);
  CHECK(gpumem_allocate_tagged(pool, 40 * MIB, 256, NULL, 1, &slept) == GPUMEM_SUCCESS);
  write_pattern(slept, 40 * MIB, 5);
  CHECK(gpumem_sleep(pool, 1, GPUMEM_SLEEP_OFFLOAD, NULL) == GPUMEM_SUCCESS);
  squatter = gpumem_malloc(pool, 40 * MIB, NULL); /* untagged memory takes the room */
  CHECK(squatter != NULL);
  CHECK(gpumem_wake(pool, 1, NULL) == GPUMEM_ERROR_OUT_OF_MEMORY);
  CHECK(strstr(gpumem_last_error(), "stay on the host") != NULL);
  CHECK(gpumem_tag_asleep(pool, 1) == 1);
  CHECK(gpumem_allocate_tagged(pool, MIB, 256, NULL, 1, &refused) == GPUMEM_ERROR_INVALID_ARGUMENT);
  /* Room again: the retry succeeds, the bytes at their addresses. */
  CHECK(gpumem_free(pool, squatter, 40 * MIB, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_pool_trim(pool, &released) == GPUMEM_SUCCESS);
  CHECK(released >= 40 * MIB);
  CHECK(gpumem_wake(pool, 1, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_stream_synchronize(pool, NULL) == GPUMEM_SUCCESS);
  CHECK(has_pattern(slept, 40 * MIB, 5));
  CHECK(gpumem_free(pool, slept, 40 * MIB, NULL) == GPUMEM_SUCCESS);
  gpumem_pool_destroy(pool);
}

static void caching_pool_cannot_sleep(void) {
  gpumem_pool* pool = NULL;
  CHECK(gpumem_pool_create("sim_capacity:64M,allocator:caching_pool", &pool) == GPUMEM_SUCCESS);
  CHECK(gpumem_sleep(pool, 0, GPUMEM_SLEEP_OFFLOAD, NULL) == GPUMEM_ERROR_NOT_SUPPORTED);
  CHECK(gpumem_wake(pool, 0, NULL) == GPUMEM_ERROR_NOT_SUPPORTED);
  gpumem_pool_destroy(pool);
}

/* The importer: its own pool (its own sim device), the memory from the socket. `mode` 0:
 * check the pattern, write the second half, acknowledge, close, exit; 1: map, acknowledge,
 * then wait to be killed. */
static int importer(int sock, int mode) {
  gpumem_pool* pool = NULL;
  int fd = -1;
  uint64_t size = 0;
  void* p = NULL;
  char ack = 'k';
  if (gpumem_pool_create("sim_capacity:256M", &pool) != GPUMEM_SUCCESS) return 10;
  if (gpumem_receive_fd(sock, &fd, &size) != GPUMEM_SUCCESS) return 11;
  if (gpumem_import(pool, fd, (size_t)size, &p) != GPUMEM_SUCCESS) return 12;
  close(fd);
  if (!has_pattern(p, (size_t)size / 2, 42)) return 13;
  memset((char*)p + size / 2, 0xab, (size_t)size / 2);
  if (write(sock, &ack, 1) != 1) return 14;
  if (mode == 1) {
    for (;;) pause();
  }
  if (gpumem_free(pool, p, (size_t)size, NULL) != GPUMEM_SUCCESS) return 15;
  gpumem_pool_destroy(pool);
  return 0;
}

static void share_with(int mode) {
  const size_t size = 8 * MIB;
  gpumem_pool* pool = NULL;
  void* p = NULL;
  int fd = -1, sv[2], status = 0;
  size_t free_before;
  char ack = 0;
  pid_t child;
  const unsigned char* bytes;
  CHECK(gpumem_pool_create("sim_capacity:256M", &pool) == GPUMEM_SUCCESS);
  free_before = device_free(pool);
  CHECK(gpumem_allocate_tagged(pool, size, 256, NULL, GPUMEM_TAG_SHARED, &p) == GPUMEM_SUCCESS);
  write_pattern(p, size / 2, 42);
  CHECK(gpumem_export(pool, p, &fd) == GPUMEM_SUCCESS);
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  fflush(NULL);
  child = fork();
  if (child == 0) {
    close(sv[0]);
    _exit(importer(sv[1], mode));
  }
  close(sv[1]);
  CHECK(gpumem_send_fd(sv[0], fd, size) == GPUMEM_SUCCESS);
  close(fd);
  CHECK(read(sv[0], &ack, 1) == 1 && ack == 'k');
  bytes = (const unsigned char*)p;
  CHECK(bytes[size / 2] == 0xab && bytes[size - 1] == 0xab); /* the importer's writes */
  if (mode == 1) CHECK(kill(child, SIGKILL) == 0);
  CHECK(waitpid(child, &status, 0) == child);
  if (mode == 0) CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  else CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  close(sv[0]);
  /* Nothing of the exporter's went with the importer. */
  CHECK(has_pattern(p, size / 2, 42));
  {
    gpumem_stats s;
    CHECK(gpumem_tag_stats(pool, GPUMEM_TAG_SHARED, &s) == GPUMEM_SUCCESS);
    CHECK(s.live_bytes == size && s.reserved_bytes == size);
  }
  CHECK(gpumem_free(pool, p, size, NULL) == GPUMEM_SUCCESS);
  CHECK(device_free(pool) == free_before);
  gpumem_pool_destroy(pool);
}

static void bad_sharing_input(void) {
  gpumem_pool* pool = NULL;
  void* shared = NULL;
  void* plain = NULL;
  void* out = (void*)&failures;
  int fd = -1, closed_fd = -1, pipe_fds[2];
  CHECK(gpumem_pool_create("sim_capacity:256M", &pool) == GPUMEM_SUCCESS);
  CHECK(gpumem_allocate_tagged(pool, 4 * MIB, 256, NULL, GPUMEM_TAG_SHARED, &shared) == GPUMEM_SUCCESS);
  plain = gpumem_malloc(pool, 4 * MIB, NULL);
  CHECK(gpumem_export(pool, plain, &fd) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(fd == -1);
  CHECK(gpumem_export(pool, shared, &fd) == GPUMEM_SUCCESS);
  CHECK(gpumem_import(pool, fd, 6 * MIB, &out) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(out == NULL);
  CHECK(strstr(gpumem_last_error(), "does not match") != NULL);
  CHECK(gpumem_export(pool, shared, &closed_fd) == GPUMEM_SUCCESS);
  close(closed_fd);
  CHECK(gpumem_import(pool, closed_fd, 4 * MIB, &out) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(pipe(pipe_fds) == 0);
  CHECK(gpumem_import(pool, pipe_fds[0], 4 * MIB, &out) == GPUMEM_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(gpumem_last_error(), "not an exported") != NULL);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  CHECK(gpumem_sleep(pool, GPUMEM_TAG_SHARED, GPUMEM_SLEEP_OFFLOAD, NULL) == GPUMEM_ERROR_INVALID_ARGUMENT);
  /* The right size imports, in this process too: the same bytes at another address. */
  CHECK(gpumem_import(pool, fd, 4 * MIB, &out) == GPUMEM_SUCCESS);
  memset(shared, 0x11, 4 * MIB);
  CHECK(out != shared && ((unsigned char*)out)[4 * MIB - 1] == 0x11);
  CHECK(gpumem_free(pool, out, 4 * MIB, NULL) == GPUMEM_SUCCESS);
  close(fd);
  CHECK(gpumem_free(pool, shared, 4 * MIB, NULL) == GPUMEM_SUCCESS);
  CHECK(gpumem_free(pool, plain, 4 * MIB, NULL) == GPUMEM_SUCCESS);
  gpumem_pool_destroy(pool);
}

int main(void) {
  sleep_wake_keeps_pattern_and_addresses();
  untagged_discard_and_free_while_asleep();
  wake_out_of_memory_then_retry();
  caching_pool_cannot_sleep();
  share_with(0);
  share_with(1);
  bad_sharing_input();
  if (failures != 0) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  printf("c_api_sleep_share_test: all checks passed\n");
  return 0;
}
