// Compiled by tests/layering/check_include.cmake with one layer's include flags and
// GPUMEM_PROBE_HEADER naming a header: it compiles when the layer may include that header
// and fails with "not found" when the header belongs to a layer above it.
#ifndef GPUMEM_PROBE_HEADER
#define GPUMEM_PROBE_HEADER "gpumem/pool/core/pool_base.hpp"
#endif
#include GPUMEM_PROBE_HEADER

int main() { return 0; }
