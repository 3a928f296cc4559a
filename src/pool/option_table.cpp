#include "gpumem/pool/option_table.hpp"

#include <array>

namespace gpumem {

namespace {

// Descriptions hold no '|' (they are Markdown table cells) and no line breaks.
constexpr std::array<pool_option_info, 34> table{{
    {"reserve", "0 (none)",
     "Physical memory taken up front (suffixes K, M, G, T). vmm_page_pool also maps it up "
     "front, so requests within it make no driver call. Trades memory held from the start "
     "(unusable by other processes) for no driver time within it.",
     "reserve:8G"},
    {"reserve_fraction", "0 (none)",
     "As reserve, as a fraction of device memory (0 < F <= 1).", "reserve_fraction:0.9"},
    {"limit", "0 (none)",
     "Hard cap on reserved bytes; a request that would pass it fails with out_of_memory. "
     "Trades throughput near the cap for a bound other processes can count on.",
     "limit:60G"},
    {"release_threshold", "never",
     "Cached free bytes kept before the pool gives memory back to the driver (never: keep "
     "all, as cudaMemPool's default). Lower gives memory back sooner at the cost of driver "
     "calls when it is needed again.",
     "release_threshold:4G"},
    {"small_threshold", "1M",
     "Requests up to this size use the small-block arena; larger ones are large blocks.",
     "small_threshold:1M"},
    {"cross_stream", "event",
     "Reuse of a block freed on another stream: event waits until the freeing stream's "
     "event completed; wait makes the new stream wait on it (reuse at once, serialising the "
     "streams); wait_before_growth is event, but where the pool would otherwise take more "
     "memory the new stream waits on those frees and reuses their blocks. FSDP on 2 H200s: "
     "1.005-1.006 of the requested bytes (1.24-1.39 under event) at a 27% slower step.",
     "cross_stream:wait"},
    {"va_reserve", "2x device memory",
     "vmm_page_pool's virtual address range. Virtual address space costs no memory.",
     "va_reserve:256G"},
    {"keep_free", "0 (none)",
     "vmm_page_pool: device memory (the driver's free bytes) that every new physical handle "
     "leaves free, for other processes and libraries: a growth that would pass it gathers "
     "free pages or fails with out_of_memory, a wake leaves the tag asleep, its bytes on the "
     "host. torch_memory_saver's memory_margin_bytes. A free-memory query per new handle, one "
     "step with it in the process (pools growing at once never pass it together).",
     "keep_free:1G"},
    {"big_chunk", "0",
     "vmm_page_pool: growths of at least 2N pages use N-page physical handles (0: one page "
     "per handle, but for huge growths). Fewer driver calls per growth, against handles "
     "that smaller blocks can pin.",
     "big_chunk:16"},
    {"huge_growth", "1G",
     "vmm_page_pool without big_chunk: a growth creating at least this many bytes takes "
     "handles of a sixteenth of it (64 MiB by default), which serve only requests of that "
     "size or more (with footprint:fast, any request: the run is part of the arena's heap; "
     "there without a limit or set_budget a growth is one handle anyway); 0: one page per "
     "handle always. Faster large growths, against coarser handles.",
     "huge_growth:0"},
    {"scrub", "off",
     "Zero every block (a memset on the freeing stream) at free, before any other owner can "
     "get it. Costs a memset per free.",
     "scrub:on"},
    {"shareable", "off",
     "vmm_page_pool: create physical pages exportable (POSIX file descriptor handles), so any "
     "live allocation's pages can be mapped by another process (gpumem_export_pages; "
     "PyTorch's CUDA IPC under the native allocator). The PyTorch plug-in turns it on.",
     "shareable:on"},
    {"guard", "off",
     "vmm_page_pool debug mode: every allocation gets pages of its own ending at an unmapped "
     "guard page, so an overrun faults at once. Costs a page or more per allocation, and "
     "frees wait for their stream.",
     "guard:on"},
    {"thread_cache", "on",
     "Per-thread caches in front of the pool: a thread reuses the small blocks it freed and "
     "frees its own small allocations without the pool's lock. Large blocks are never kept "
     "(they merge at once). off: every call takes the pool lock.",
     "thread_cache:off"},
    {"round_large", "0 (512 B)",
     "Round large blocks up to a multiple of this power of two when that loses less than "
     "half of it. With the page size, large blocks mostly own whole pages and a tensor "
     "re-allocated a little larger fits its predecessor's block; costs under half of it per "
     "live large block, at most 1/32 of the live bytes.",
     "round_large:2M"},
    {"small_classes", "4",
     "Round small requests up to size classes, N to an octave (0 or a power of two up to "
     "64; 0: 512-byte units), so every freed small block serves all later requests of its "
     "class and the thread caches keep them. Applied only while the thread caches are on. "
     "Trades under 1/N of each small block for faster mixed-size allocation.",
     "small_classes:0"},
    {"small_cache", "16M",
     "With small_classes: the bytes of small blocks each thread's cache keeps.",
     "small_cache:64M"},
    {"map_worker", "auto",
     "vmm_page_pool: unmap the old mappings of remapped pages on a helper thread, so the "
     "allocating thread does not wait for them (auto: on for a GPU, off on sim). With it on, "
     "peak memory can differ slightly from run to run; off gives the same layout every run.",
     "map_worker:off"},
    {"footprint", "fast",
     "vmm_page_pool: fast keeps freed blocks mapped and reuses, splits and merges them as a "
     "cache, each arena's memory one heap that grows with new pages while the reserved bytes "
     "stay within the budget (the smallest of limit, the device's memory less 1/32, and "
     "set_budget): a loop that repeats settles with no driver call. A growth into the last "
     "32nd of the budget gathers free pages as tight does, and large requests are then not "
     "rounded. Without a limit or set_budget a growth's new pages are one physical handle "
     "(one create, map and access grant, at most 1/32 of the budget's room left). "
     "A tag's sleep keeps its cache (released uncopied, mapped again by the wake "
     "where there is room) and a wake maps side-by-side pages in handles of up to 64 MiB. "
     "tight gathers scattered free pages on every growth they can serve: reserved bytes "
     "within about 1% of the live bytes, at a map, access grant and unmap per page moved in "
     "every step, for colocation where reserved bytes must stay low; a tag's sleep gives its "
     "cache back first, and a wake maps a handle per page.",
     "footprint:tight"},
    {"growth_slack", "0",
     "vmm_page_pool with footprint:tight: memory it may hold beyond the peak live bytes, "
     "as a fraction (0 to 1). "
     "Within it, large free runs stay whole and growth takes new pages rather than "
     "remapping scattered free ones: memory traded for driver time.",
     "growth_slack:0.03"},
    {"remap_budget", "0 (off)",
     "vmm_page_pool with footprint:tight: the share of elapsed time it may spend gathering "
     "scattered free pages "
     "(0 to 1). When gathers take more, judged in windows of at least 250 ms with no new "
     "peak of live bytes, growth_slack is raised (up to 0.1): memory spent on speed only "
     "where the workload makes the pool remap often.",
     "remap_budget:0.05"},
    {"soft_budget", "0 (off)",
     "vmm_page_pool with footprint:fast: a soft budget at (1 + F) x the live bytes' peak so "
     "far (or the live bytes with the request, if more), F a fraction (0 to 1). A growth "
     "past it first gathers the free pages of physical handles lying wholly in cached free "
     "blocks, the rest made as one new handle. Less memory (sim, 45 traces: fragmentation "
     "geomean 1.0863 -> 1.0567 with 0.03, 1.0638 with 0.1) for memory-moving driver calls "
     "in every pass (over 1% of a pass's allocations on 13 / 6 traces, against none) and "
     "the first pass's modelled driver time 2.35x / 2.0x caching_pool's, against 1.27x.",
     "soft_budget:0.1"},
    {"release_idle", "off",
     "caching_pool: before a new segment would raise the reserved peak, free wholly idle "
     "segments first. Lower peaks, at a cudaFree (which waits for the device) each time. "
     "vmm_page_pool accepts it and always does the like.",
     "release_idle:on"},
    {"lifetime_hints", "on",
     "vmm_page_pool with footprint:tight: place large blocks whose kind piles up (a layer's "
     "saved activation, a "
     "prefill's KV block) side by side in runs of their own, so their partial last pages "
     "are shared rather than pinned by dead temporaries. A move budget turns the hints off "
     "for good where those runs trade pages with the others every step. No effect with "
     "reserve or guard, nor with footprint:fast (its guesses change as they learn, so a "
     "repeated loop would place its blocks anew).",
     "lifetime_hints:off"},
    {"peer_access", "none",
     "vmm_page_pool: devices besides its own granted read/write access to every page it "
     "maps (cuMemSetAccess, in the same call as its own), so NCCL, kernels and copies on "
     "those GPUs can use its buffers; growths, wakes and guarded pages get it too. Device "
     "numbers joined by +, or all (every device that can reach it). A named device that "
     "cannot reach the pool's (cuDeviceCanAccessPeer 0) is refused when the pool is made. "
     "Costs nothing per allocation; set_access calls cover more devices.",
     "peer_access:1"},
    {"allocator", "vmm_page_pool",
     "gpumem_pool_create: the pool to make, vmm_page_pool or caching_pool (over the backend "
     "below).",
     "allocator:caching_pool", option_scope::pool_create},
    {"backend", "runtime",
     "gpumem_pool_create: caching_pool's upstream: runtime (cudaMalloc), driver (cuMemAlloc) "
     "or vmm (cuMemCreate and cuMemMap per segment).",
     "backend:driver", option_scope::pool_create},
    {"platform", "auto",
     "gpumem_pool_create: cuda, sim (gpumem's simulated device) or auto (cuda when a GPU is "
     "present). Without it, GPUMEM_DEVICE decides, as auto when unset.",
     "platform:sim", option_scope::pool_create},
    {"device", "0",
     "gpumem_pool_create: the device the pool serves; one pool per device (the PyTorch "
     "plug-in makes one for each device PyTorch names). Streams of another device are refused.",
     "device:0", option_scope::pool_create},
    {"step_plan", "on",
     "gpumem_pool_create: serve a loop whose steps repeat (gpumem_pool_mark_step) from a "
     "layout planned after two equal steps.",
     "step_plan:off", option_scope::pool_create},
    {"sim_capacity", "80G",
     "gpumem_pool_create: a sim device of its own for this pool with this memory per device; "
     "sizes joined by + give each device its own (1G+2G).",
     "sim_capacity:1G", option_scope::pool_create},
    {"sim_devices", "1",
     "gpumem_pool_create: a sim device of its own for this pool with this many GPUs (1 to "
     "64; the shared sim device takes GPUMEM_SIM_DEVICES).",
     "sim_devices:2", option_scope::pool_create},
    {"sim_granularity", "2M",
     "gpumem_pool_create: a sim device of its own for this pool with this VMM granularity "
     "(a power of two, at least 4K); sizes joined by + give each device its own (2M+64K).",
     "sim_granularity:64K", option_scope::pool_create},
    {"sim_no_peer", "none",
     "gpumem_pool_create: a sim device of its own for this pool where these pairs of devices "
     "cannot reach each other (cuDeviceCanAccessPeer 0), as A-B joined by + (0-1+2-3).",
     "sim_no_peer:0-1", option_scope::pool_create},
}};

void append_escaped(std::string& out, std::string_view s) {
  for (char c : s) {
    if (c == '|') out += '\\';
    out += c;
  }
}

}  // namespace

std::span<const pool_option_info> pool_option_table() noexcept { return table; }

const pool_option_info* find_pool_option(std::string_view name) noexcept {
  for (const auto& row : table)
    if (row.name == name) return &row;
  return nullptr;
}

std::string pool_option_names(option_scope scope) {
  std::string out;
  for (const auto& row : table) {
    if (row.scope != scope) continue;
    if (!out.empty()) out += ", ";
    out += row.name;
  }
  return out;
}

std::string pool_options_markdown() {
  std::string out =
      "# Pool options\n"
      "\n"
      "<!-- Generated by `gpumem options --markdown` from src/pool/option_table.cpp; do not "
      "edit. -->\n"
      "\n"
      "Every pool reads these keys from a configuration string `key:value,key:value`: the "
      "`GPUMEM_CONF` environment variable, `gpumem replay --config`, `python -m gpumem run "
      "--conf`, or `gpumem::pool_options::parse` in C++. Sizes take the suffixes K, M, G, T. "
      "An unknown key or a malformed value is refused with `gpumem::invalid_argument` naming "
      "it. Measured effects of each trade are in [RESULTS.md](RESULTS.md).\n"
      "\n"
      "| Option | Default | What it does and trades | Example |\n"
      "|---|---|---|---|\n";
  bool pool_create_header = false;
  for (const auto& row : table) {
    if (row.scope == option_scope::pool_create && !pool_create_header) {
      pool_create_header = true;
      out +=
          "\n"
          "## Keys of gpumem_pool_create\n"
          "\n"
          "The C API's `gpumem_pool_create` (and so Python's `gpumem.Pool` and the PyTorch "
          "plug-in, which read `GPUMEM_CONF`) takes these keys as well, in the same string: "
          "which pool it makes, on which device and platform. A pool option given to "
          "`gpumem_pool_create` goes to the pool; one of these given to a pool alone "
          "(`gpumem replay --config`) is refused naming it.\n"
          "\n"
          "| Key | Default | What it does | Example |\n"
          "|---|---|---|---|\n";
    }
    out += "| `";
    out += row.name;
    out += "` | ";
    append_escaped(out, row.default_text);
    out += " | ";
    append_escaped(out, row.description);
    out += " | `";
    out += row.example;
    out += "` |\n";
  }
  return out;
}

std::string pool_options_text() {
  std::string out;
  bool pool_create_header = false;
  for (const auto& row : table) {
    if (row.scope == option_scope::pool_create && !pool_create_header) {
      pool_create_header = true;
      out += "\nkeys of gpumem_pool_create (C API, Python, PyTorch plug-in):\n";
    }
    out += row.name;
    out += " (default ";
    out += row.default_text;
    out += "; e.g. ";
    out += row.example;
    out += ")\n    ";
    out += row.description;
    out += "\n";
  }
  return out;
}

}  // namespace gpumem
