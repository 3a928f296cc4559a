// The one factory from a name to a resource (make_resource), the one configuration grammar
// (for_each_config_item), and the typed counters every pool reports (pool_base::counters).
#include "gpumem/pool/pool_factory.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::MiB;

class PoolFactory : public gpumem_test::sim_pool_test {};

TEST_F(PoolFactory, MakesEachNamedPoolAndBackend) {
  for (std::string_view name : pool_names()) {
    resource_spec spec;
    spec.allocator = name;
    made_resource m = make_resource(sim, spec);
    ASSERT_NE(m.pool, nullptr) << name;
    EXPECT_EQ(m.backend, nullptr) << name;
    EXPECT_EQ(m.pool->name(), name);
    EXPECT_EQ(m.upstream != nullptr, name == "caching_pool") << name;
    void* p = m.resource().allocate(MiB);
    m.resource().deallocate(p, MiB);
    EXPECT_TRUE(m.pool->is_valid()) << m.pool->validate();
  }
  for (std::string_view name : backend_names()) {
    resource_spec spec;
    spec.allocator = name;
    made_resource m = make_resource(sim, spec);
    EXPECT_EQ(m.pool, nullptr) << name;
    ASSERT_NE(m.backend, nullptr) << name;
    EXPECT_EQ(m.backend->name(), m.resource().name());
    void* p = m.resource().allocate(MiB);
    m.resource().deallocate(p, MiB);
  }
}

TEST_F(PoolFactory, CachingPoolStandsOnTheNamedBackend) {
  for (std::string_view backend : backend_names()) {
    resource_spec spec;
    spec.allocator = "caching_pool";
    spec.backend = backend;
    made_resource m = make_resource(sim, spec);
    ASSERT_NE(m.upstream, nullptr);
    resource_spec alone;
    alone.allocator = backend;
    EXPECT_EQ(m.upstream->name(), make_resource(sim, alone).resource().name());
  }
}

TEST_F(PoolFactory, RefusesUnknownNamesMakingNothing) {
  resource_spec spec;
  spec.allocator = "bump";
  try {
    (void)make_resource(sim, spec);
    FAIL() << "an unknown allocator was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'bump'"), std::string::npos) << e.what();
  }
  spec.allocator = "caching_pool";
  spec.backend = "carrier_pigeon";
  EXPECT_THROW((void)make_resource(sim, spec), invalid_argument);
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

TEST(ConfigGrammar, SplitsItemsTrimsAndSkipsEmptyOnes) {
  std::vector<std::string> seen;
  for_each_config_item(" a:1 ,, b : x:y ,\tc:\t", [&](std::string_view k, std::string_view v,
                                                     std::string_view item) {
    seen.push_back(std::string(k) + "=" + std::string(v) + "|" + std::string(item));
  });
  EXPECT_EQ(seen, (std::vector<std::string>{"a=1|a:1", "b=x:y|b : x:y", "c=|c:"}));
  seen.clear();
  try {
    for_each_config_item("a:1,justakey,b:2", [&](std::string_view k, std::string_view,
                                                 std::string_view) { seen.emplace_back(k); });
    FAIL() << "an item without a colon was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'justakey' is not key:value"), std::string::npos);
  }
  EXPECT_EQ(seen, std::vector<std::string>{"a"});  // the items before it, not after
}

TEST_F(PoolFactory, CountersAreTypedForEveryPool) {
  resource_spec spec;
  spec.allocator = "caching_pool";
  const pool_counters none = make_resource(sim, spec).pool->counters();
  EXPECT_FALSE(none.has_pages);
  EXPECT_TRUE(none.named.empty());

  vmm_page_pool pool(sim);
  void* p = pool.allocate(3 * MiB);
  const pool_base& base = pool;
  const pool_counters c = base.counters();
  const vmm_page_counts pages = pool.page_counts();
  EXPECT_TRUE(c.has_pages);
  EXPECT_EQ(c.page_size, pages.page_size);
  EXPECT_EQ(c.mapped_pages, pages.mapped_pages);
  EXPECT_GE(c.mapped_pages, 2u);
  EXPECT_EQ(c.handles, pages.handles);
  EXPECT_EQ(c.pages_created, pages.pages_created);
  auto named = [&](std::string_view n) -> std::uint64_t {
    for (const pool_counter& k : c.named)
      if (k.name == n) return k.value;
    ADD_FAILURE() << "no counter named " << n;
    return 0;
  };
  EXPECT_EQ(named("page_size"), pages.page_size);
  EXPECT_EQ(named("pages_mapped"), pages.mapped_pages);
  EXPECT_EQ(named("physical_handles"), pages.handles);
  EXPECT_EQ(c.named.size(), 14u);
  pool.deallocate(p, 3 * MiB);
}

}  // namespace
