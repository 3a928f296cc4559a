// vmm_page_pool's counters as pool_base reports them (pool_counters): its page counts,
// typed, and by the names gpumem_pool_counter reads them by.
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem {

pool_counters vmm_page_pool::counters() const {
  const vmm_page_counts c = page_counts();
  pool_counters r;
  r.has_pages = true;
  r.page_size = c.page_size;
  r.mapped_pages = c.mapped_pages;
  r.spare_pages = c.spare_pages;
  r.handles = c.handles;
  r.pages_created = c.pages_created;
  r.pages_reclaimed = c.pages_reclaimed;
  r.pages_released = c.pages_released;
  r.named = {{"page_size", c.page_size, false},
             {"pages_mapped", c.mapped_pages},
             {"pages_spare", c.spare_pages},
             {"physical_handles", c.handles},
             {"pages_created", c.pages_created},
             {"pages_reclaimed", c.pages_reclaimed},
             {"pages_released", c.pages_released},
             {"remap_ns", c.remap_ns},
             {"growth_slack_permille", static_cast<std::uint64_t>(c.growth_slack * 1000.0 + 0.5),
              false},
             {"slack_raises", c.slack_raises},
             {"long_lived_allocations", c.long_lived_allocations},
             {"long_lived_pages_moved", c.long_lived_pages_moved},
             {"lifetime_hints_active", c.lifetime_hints_active ? 1u : 0u, false},
             {"long_lived_bytes_handed_over", c.long_lived_bytes_handed_over}};
  return r;
}

}  // namespace gpumem
