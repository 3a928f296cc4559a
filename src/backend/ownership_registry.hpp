// Process-wide registry of live backend allocations: which resource handed out which
// pointer. It turns "free of a pointer I do not know" into a precise diagnosis: owned by
// another resource, interior pointer, double free, or never allocated.
//
// Invariant: entries are disjoint [address, address+bytes) ranges; every entry's owner is
// a live resource (resources remove their entries before they die).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpumem {
class memory_resource;
}

namespace gpumem::detail {

void registry_add(const void* ptr, std::size_t bytes, const memory_resource* owner);
// Marks [ptr, ptr+bytes) as memory a pool manages (a pool's virtual range or segments):
// pointers inside it are diagnosed as the pool's, not as interior pointers. Replaces an
// entry at the same address (a segment the pool's upstream registered).
void registry_add_managed(const void* ptr, std::size_t bytes, const memory_resource* owner);
void registry_remove(const void* ptr);
// Why `ptr` is not a live allocation of `asked`: a sentence for an invalid_argument.
std::string registry_diagnose(const void* ptr, const memory_resource* asked);

}  // namespace gpumem::detail
