// paged_kv_cache: the KV cache API in one walk-through, on the GPU when present (else the
// sim device). Two requests share a system prompt (prefix caching), one samples two
// continuations (fork, copy on write), one is preempted to pinned host memory and brought
// back (swap), and the cache gives its pages back to the pool when load falls (elastic).
//
// Usage: paged_kv_cache [--device auto|cuda|sim]
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "gpumem/kv.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

using namespace gpumem;

namespace {
void print(const char* what, const kv_cache& kv) {
  const kv_cache_stats s = kv.stats();
  std::printf("%-34s blocks: %4zu mapped, %4zu used, %3zu cached, %4zu free; %zu sequences; "
              "waste %.1f%%\n",
              what, s.capacity_blocks, s.used_blocks, s.cached_blocks, s.free_blocks, s.sequences,
              100 * s.waste_fraction(kv.layout().block_tokens));
}
}  // namespace

int main(int argc, char** argv) {
  const std::string device = argc == 3 && !std::strcmp(argv[1], "--device") ? argv[2] : "auto";
  platform& gpu = platform_by_name(device);
  auto stream = gpu.stream_create(0);
  if (!stream) return 1;
  {
    // One page pool for everything the program allocates; the cache borrows its pages.
    vmm_page_pool pages(gpu, 0, pool_options::from_environment());
    pinned_host_pool host(gpu, 0);  // staging for swap

    kv_cache_config config;
    config.layout = {32, 8, 128, kv_dtype::bf16, 16};  // Llama-3-8B: 2 MiB blocks
    config.max_blocks = 2048;                           // at most 4 GiB of KV
    config.max_sequence_tokens = 8192;
    config.stream = stream.value();                     // copies run here
    kv_cache kv(pages, config, &host);
    std::printf("layout: block %zu B = %zu layers x K,V x %zu tokens x %zu heads x %zu dims; "
                "base %#zx\n",
                kv.layout().block_stride(), kv.layout().layers, kv.layout().block_tokens,
                kv.layout().kv_heads, kv.layout().head_dim, static_cast<std::size_t>(kv.base()));

    std::vector<token_id> system(512);
    std::iota(system.begin(), system.end(), 1000);
    std::vector<token_id> first = system, second = system;
    first.insert(first.end(), {1, 2, 3});
    second.insert(second.end(), {7, 8, 9, 10});

    auto a = kv.add_sequence(first);
    auto b = kv.add_sequence(second);  // its system prompt's full blocks are a's
    std::printf("request b: %zu of %zu prompt tokens already cached\n", b.cached_tokens,
                second.size());
    print("two requests admitted", kv);

    auto b2 = kv.fork(b.id);  // a second sample of b: shares every block
    const token_id next[1] = {42};
    kv.append(b2, next);      // its shared last block is copied first (on the device)
    kv.append(b.id, next);
    print("b sampled twice, one token each", kv);

    // Block tables are what an attention kernel reads: block b of layer l at
    // base + b * block_stride + l * layer_stride.
    const auto table = kv.block_table(b2);
    std::printf("b2's block table: %zu blocks, first %u, last %u\n", table.size(), table.front(),
                table.back());

    kv.swap_out(a.id);  // preempted: its blocks are copied to pinned host memory and freed
    print("a swapped out", kv);
    kv.swap_in(a.id);   // and back, bytes intact
    print("a swapped in", kv);

    for (auto id : {a.id, b.id, b2}) kv.free(id);
    print("all finished (prefix blocks cached)", kv);
    const std::size_t pages_back = kv.shrink(0, /*drop_cached=*/true);
    print("load fell: shrink", kv);
    std::printf("%zu pages went back to the page pool, which now holds %zu spare pages for any "
                "allocation\n",
                pages_back, pages.page_counts().spare_pages);
  }
  (void)gpu.stream_destroy(stream.value());
  return 0;
}
