// sim: a host-memory GPU with the driver's semantics, for tests and laptop replays.
//
// Physical memory is one sparse memfd per platform (so thousands of handles need one fd).
// As a GPU's pages, it need not be contiguous: a physical handle owns a list of frame runs
// (extents), each a multiple of the granularity, taken best-fit or else largest-first
// wherever frames are free. Virtual ranges are PROT_NONE, MAP_NORESERVE reservations; map
// is one mmap(MAP_FIXED|MAP_SHARED) per extent at consecutive addresses (PROT_NONE until
// set_access grants read/write), so bytes written through one mapping are read through
// another, a remap keeps the bytes, and touching unmapped memory faults (SIGSEGV, like
// the GPU's illegal address). runtime_malloc / driver_alloc / async_malloc take frame
// runs too (in host pages), mapped into one contiguous host range. Every host mmap,
// munmap and mprotect is checked: at the host's vm.max_map_count a call fails with
// out_of_memory and changes nothing.
//
// Several devices: each has its own slice of the memfd (its capacity), granularity, frames
// and streams. A device other than the one memory lives on reaches it only when granted:
// VMM pages through set_access / set_access_for for that device (each mapping records the
// devices that may touch it), classic allocations through enable_peer_access; a pair listed
// in sim_options::no_peer can be granted neither. check_access models a kernel of one
// device touching memory; memcpy_async and memset_async check the stream's device the same
// way on sim device memory (VMM pages; classic allocations of another device are copied
// without peer access, as the CUDA driver stages such copies), so a missing grant fails
// with invalid_value instead of faulting.
//
// Invariants (checked by is_valid()):
//  - used_bytes(d) == sum of the extents owned by device d's handles and allocations
//    <= capacity_of(d); no frame has two owners;
//  - a mapping's access devices are its memory's device or peers that can reach it;
//  - every mapping lies inside one reserved range and names a live or released-but-mapped
//    handle; a handle's frames return to the free list when it is released and unmapped;
//  - frames on the free list hold no host memory (holes are punched on free).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpumem/platform/platform.hpp"

namespace gpumem {

enum class sim_latency : std::uint8_t {
  off,     // calls cost what the host code costs
  model,   // add each call's modelled H200 latency to modelled_ns() (no waiting)
  spin,    // as model, and also busy-wait that long, for end-to-end timing estimates
};

struct sim_options {
  std::size_t capacity = std::size_t{80} << 30;        // per device
  std::size_t granularity = std::size_t{2} << 20;      // minimum = recommended
  int device_count = 1;                                // 1 to sim_max_devices
  sim_latency latency = sim_latency::off;
  std::uint64_t seed = 0x5eed;                         // for probabilistic faults
  // Per device: entry d, where present (and non-zero), replaces capacity / granularity for
  // device d.
  std::vector<std::size_t> capacities{};
  std::vector<std::size_t> granularities{};
  // Pairs of devices with no peer path between them (cuDeviceCanAccessPeer 0 both ways).
  // Every other pair of distinct devices can reach each other, as GPUs on NVLink do.
  std::vector<std::pair<int, int>> no_peer{};

  std::size_t capacity_of(int device) const noexcept;
  std::size_t granularity_of(int device) const noexcept;
};

inline constexpr int sim_max_devices = 64;

// The process-wide sim device's options: defaults, with GPUMEM_SIM_DEVICES=N (1 to 64)
// devices. Throws gpumem::invalid_argument for another value.
sim_options sim_options_from_environment();

// Fails chosen calls of one operation. nth counts that op's calls from when the rule is
// set, starting at 1; probability applies to every call. The failure is `kind`.
struct sim_fault {
  std::uint64_t nth = 0;        // 0: not by count
  bool every_after = false;     // fail nth and all later calls
  double probability = 0.0;
  failure_kind kind = failure_kind::out_of_memory;
};

// Objects alive on the sim device. All zero after a leak-free teardown.
struct sim_live_objects {
  std::size_t ranges = 0;
  std::size_t handles = 0;
  std::size_t mappings = 0;
  std::size_t device_allocations = 0;   // runtime + driver
  std::size_t host_allocations = 0;
  std::size_t streams = 0;
  std::size_t events = 0;
  bool none() const noexcept {
    return ranges + handles + mappings + device_allocations + host_allocations + streams +
               events == 0;
  }
  std::string describe() const;
};

class sim_platform final : public platform {
 public:
  explicit sim_platform(sim_options options = {});
  ~sim_platform() override;

  std::string_view kind() const noexcept override { return "sim"; }
  const sim_options& options() const noexcept;

  // --- test controls -------------------------------------------------------------------
  void inject_fault(platform_op op, sim_fault fault);
  void clear_faults();
  // While held, event_record leaves the event incomplete until complete_events().
  void hold_events(bool hold);
  void complete_events();
  sim_live_objects live_objects() const;
  std::size_t used_bytes(int device) const;
  // Modelled H200 time of all calls so far (sim_latency::model or spin), nanoseconds.
  std::uint64_t modelled_ns() const noexcept;
  std::uint64_t modelled_ns(platform_op op) const noexcept;
  // A kernel of `device` touching [ptr, ptr+bytes): success when every byte is memory the
  // device may use (its own or granted VMM pages, its own or peer-enabled classic
  // allocations); invalid_value (an illegal address) otherwise, host memory included.
  status check_access(int device, const void* ptr, std::size_t bytes) const;
  // Structural self-check; returns "" when valid, otherwise what is wrong.
  std::string validate() const;
  bool is_valid() const { return validate().empty(); }

  // --- platform ------------------------------------------------------------------------
  result<int> device_count() override;
  result<device_properties> properties(int device) override;
  result<allocation_granularity> granularity(int device) override;
  result<memory_info> mem_info(int device) override;
  result<std::uintptr_t> reserve_range(std::size_t size, std::size_t alignment) override;
  status free_range(std::uintptr_t base, std::size_t size) override;
  result<physical_handle> create_physical(int device, std::size_t size) override;
  status release_physical(physical_handle handle) override;
  status map(std::uintptr_t va, std::size_t size, physical_handle handle,
             std::size_t offset) override;
  status unmap(std::uintptr_t va, std::size_t size) override;
  status set_access(int device, std::uintptr_t va, std::size_t size) override;
  status set_access_for(std::span<const int> devices, std::uintptr_t va,
                        std::size_t size) override;
  result<bool> can_access_peer(int device, int peer) override;
  status enable_peer_access(int device, int peer) override;
  result<void*> runtime_malloc(int device, std::size_t size) override;
  status runtime_free(int device, void* ptr) override;
  result<void*> driver_alloc(int device, std::size_t size) override;
  status driver_free(int device, void* ptr) override;
  result<void*> host_alloc_pinned(std::size_t size) override;
  status host_free_pinned(void* ptr) override;
  result<stream_handle> stream_create(int device) override;
  status stream_destroy(stream_handle stream) override;
  status stream_synchronize(stream_handle stream) override;
  result<int> stream_device(stream_handle stream) override;
  result<event_handle> event_create(int device) override;
  status event_destroy(event_handle event) override;
  status event_record(event_handle event, stream_handle stream) override;
  result<bool> event_query(event_handle event) override;
  status event_synchronize(event_handle event) override;
  status stream_wait_event(stream_handle stream, event_handle event) override;
  status memcpy_async(void* dst, const void* src, std::size_t bytes,
                      stream_handle stream) override;
  status memset_async(void* dst, int value, std::size_t bytes, stream_handle stream) override;
  // Sim has no stream-ordered pool of its own: these allocate and free at once.
  result<void*> async_malloc(int device, std::size_t size, stream_handle stream) override;
  status async_free(void* ptr, stream_handle stream) override;
  // Sharing (src/platform/sim_sharing.cpp): a shareable handle's bytes are a memfd of its
  // own, exported as a duplicate of it and imported by another process's sim device.
  result<physical_handle> create_shareable_physical(int device, std::size_t size) override;
  result<int> export_handle(physical_handle handle) override;
  result<physical_handle> import_handle(int device, int fd, std::size_t size) override;

  struct state;  // detail

 private:
  std::unique_ptr<state> state_;
};

// Modelled H200 latency of one call of `op` moving `bytes` (the H200 table in src/platform/sim_latency.cpp, interpolated
// in log-size between the measured points), nanoseconds.
std::uint64_t modelled_latency_ns(platform_op op, std::size_t bytes) noexcept;
// Modelled cost per mapping (handle) covered, for the calls whose cost grows with the number
// of handles in the range (cuMemSetAccess, cuMemUnmap); 0 for others. Such a call is charged
// modelled_latency_ns for its size plus this for each mapping after the first.
std::uint64_t modelled_per_mapping_ns(platform_op op) noexcept;

}  // namespace gpumem
