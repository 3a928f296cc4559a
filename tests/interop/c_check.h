/* CHECK for the C API's tests written in C: a failed condition is printed with its file,
 * line and the library's last status and error text, and counted in `failures`; the test
 * goes on, and main returns non-zero when any check failed. One test program per
 * translation unit includes it. */
#ifndef GPUMEM_TESTS_C_CHECK_H
#define GPUMEM_TESTS_C_CHECK_H

#include <stddef.h>
#include <stdio.h>

#include "gpumem/interop/gpumem.h"

static int failures = 0;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: [%s] %s\n", __FILE__,    \
              __LINE__, #cond, gpumem_status_name(gpumem_last_status()),             \
              gpumem_last_error());                                                  \
      ++failures;                                                                    \
    }                                                                                \
  } while (0)

#define MIB ((size_t)1 << 20)

#endif
