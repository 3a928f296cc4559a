#include "backend/ownership_registry.hpp"

#include <array>
#include <cstdio>
#include <map>
#include <mutex>

#include "gpumem/backend/memory_resource.hpp"

namespace gpumem::detail {

namespace {

struct owner_entry {
  std::size_t bytes;
  const memory_resource* owner;
  std::string owner_name;
  bool managed = false;  // a pool's range, not one allocation
};

struct freed_entry {
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
  std::string owner_name;
  bool managed = false;  // a pool's range (or segment), given back by the pool
};

struct registry {
  std::mutex mutex;
  std::map<std::uintptr_t, owner_entry> live;
  // The most recent frees and destroyed pools' ranges, to tell a double free or a pointer of
  // a destroyed pool from a pointer never seen.
  std::array<freed_entry, 4096> freed{};
  std::size_t freed_next = 0;
};

registry& the_registry() {
  static auto* r = new registry();  // never destroyed: frees may run after main()
  return *r;
}

std::string hex(std::uintptr_t a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(a));
  return buf;
}

}  // namespace

void registry_add(const void* ptr, std::size_t bytes, const memory_resource* owner) {
  auto& r = the_registry();
  std::lock_guard lock(r.mutex);
  r.live.insert_or_assign(reinterpret_cast<std::uintptr_t>(ptr),
                          owner_entry{bytes, owner, std::string(owner->name())});
}

void registry_add_managed(const void* ptr, std::size_t bytes, const memory_resource* owner) {
  auto& r = the_registry();
  std::lock_guard lock(r.mutex);
  r.live.insert_or_assign(reinterpret_cast<std::uintptr_t>(ptr),
                          owner_entry{bytes, owner, std::string(owner->name()), true});
}

void registry_remove(const void* ptr) {
  auto& r = the_registry();
  std::lock_guard lock(r.mutex);
  auto it = r.live.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == r.live.end()) return;
  r.freed[r.freed_next] =
      freed_entry{it->first, it->second.bytes, it->second.owner_name, it->second.managed};
  r.freed_next = (r.freed_next + 1) % r.freed.size();
  r.live.erase(it);
}

std::string registry_diagnose(const void* ptr, const memory_resource* asked) {
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  const std::string who = "'" + std::string(asked->name()) + "' resource (device " +
                          std::to_string(asked->device()) + ")";
  if (ptr == nullptr) return "null pointer passed to deallocate of the " + who;
  auto& r = the_registry();
  std::lock_guard lock(r.mutex);
  auto it = r.live.upper_bound(a);
  if (it != r.live.begin()) {
    --it;
    if (a < it->first + it->second.bytes) {
      if (it->second.managed && it->second.owner != asked)
        return "pointer " + hex(a) + " lies in memory managed by the '" + it->second.owner_name +
               "' pool (device " + std::to_string(it->second.owner->device()) + "), not the " +
               who + "; free it through that pool";
      if (it->first == a && it->second.owner != asked)
        return "pointer " + hex(a) + " was allocated by the '" + it->second.owner_name +
               "' resource, not the " + who + "; free it through the resource that made it";
 if (it->first != a && !it->second.managed)
        return "interior pointer " + hex(a) + ": it lies " + std::to_string(a - it->first) +
               " bytes inside the allocation at " + hex(it->first) + " (" +
               std::to_string(it->second.bytes) + " bytes, '" + it->second.owner_name + "')";
    }
  }
  // Newest first: what happened to this address last.
  for (std::size_t i = 1; i <= r.freed.size(); ++i) {
    const freed_entry& f = r.freed[(r.freed_next + r.freed.size() - i) % r.freed.size()];
    if (f.address == 0) break;  // the ring has not wrapped: no older entries
    if (f.managed && a >= f.address && a < f.address + f.bytes)
      return "pointer " + hex(a) + " lies in memory that a '" + f.owner_name +
             "' pool has given back (the pool was destroyed, or released that memory); "
             "nothing to free";
    if (!f.managed && f.address == a)
      return "double free: pointer " + hex(a) + " was already freed (it belonged to the '" +
             f.owner_name + "' resource)";
  }
  return "unknown pointer " + hex(a) + ": the " + who + " never allocated it";
}

}  // namespace gpumem::detail
