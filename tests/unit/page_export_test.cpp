// Exporting the physical pages under any live allocation (vmm_page_pool::export_pages,
// pool_options::shareable) and mapping them elsewhere (shared_memory::import_pieces), on
// the sim device, whose shareable frames are memfds: the bytes another pool maps are the
// exporter's, in place.
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/vmm/tagged_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::MiB;

class PageExport : public gpumem_test::sim_pool_test {
 protected:
  static pool_options shareable() {
    pool_options o;
    o.shareable = true;
    return o;
  }
  static void fill(void* p, std::size_t n, unsigned char seed) {
    auto* b = static_cast<unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(i * 7 + seed);
  }
  static bool same(const void* p, std::size_t n, unsigned char seed) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i)
      if (b[i] != static_cast<unsigned char>(i * 7 + seed)) return false;
    return true;
  }
  static void close_all(const vmm_page_pool::page_export& e) {
    for (const int fd : e.fds) ::close(fd);
  }
};

// An allocation that starts mid-page and spans several pages: the export covers whole
// handles, the offset finds the allocation in them, and the importer sees the exporter's
// bytes and its later writes (the same memory, no copy).
TEST_F(PageExport, AnyAllocationsPagesMapElsewhereWithItsBytes) {
  vmm_page_pool exporter(sim, 0, shareable());
  tagged_pool importer_pool(exporter, shareable());
  void* small = exporter.allocate(4096);  // so the next allocation may start mid-page
  const std::size_t bytes = 5 * MiB + 123;
  void* p = exporter.allocate(bytes);
  fill(p, bytes, 3);
  auto e = exporter.export_pages(p, bytes);
  ASSERT_FALSE(e.fds.empty());
  std::size_t total = 0;
  for (const std::size_t b : e.bytes) {
    EXPECT_EQ(b % exporter.page_size(), 0u);
    total += b;
  }
  EXPECT_GE(total, e.offset + bytes);
  EXPECT_LT(e.offset, e.bytes.front());
  void* base = importer_pool.import_pages(e.fds, e.bytes);
  close_all(e);
  auto* q = static_cast<unsigned char*>(base) + e.offset;
  EXPECT_TRUE(same(q, bytes, 3));
  std::memset(p, 0x5a, 4096);  // the exporter writes: the importer sees it
  EXPECT_EQ(q[0], 0x5a);
  EXPECT_EQ(q[4095], 0x5a);
  importer_pool.deallocate(base, total);
  EXPECT_TRUE(importer_pool.validate().empty());
  exporter.deallocate(p, bytes);
  exporter.deallocate(small, 4096);
  EXPECT_EQ(exporter.validate(), "");
}

// Another process maps the pages and reads the bytes; the descriptors pass by fork here as
// they pass by pidfd_getfd or SCM_RIGHTS between unrelated processes.
TEST_F(PageExport, AChildProcessReadsTheExportedBytes) {
  vmm_page_pool exporter(sim, 0, shareable());
  const std::size_t bytes = 3 * MiB;
  void* p = exporter.allocate(bytes);
  fill(p, bytes, 9);
  auto e = exporter.export_pages(p, bytes);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 1;
    try {
      shared_memory importer(sim, 0);
      void* base = importer.import_pieces(e.fds, e.bytes);
      code = same(static_cast<char*>(base) + e.offset, bytes, 9) ? 0 : 2;
    } catch (...) {
      code = 3;
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  close_all(e);
  exporter.deallocate(p, bytes);
}

TEST_F(PageExport, BadInputIsRefusedAndExportsNothing) {
  vmm_page_pool plain(sim, 0);
  void* a = plain.allocate(MiB);
  EXPECT_THROW(plain.export_pages(a, MiB), not_supported);  // pages not made exportable
  plain.deallocate(a, MiB);

  vmm_page_pool pool(sim, 0, shareable());
  void* p = pool.allocate(2 * MiB);
  int probe = ::dup(0);  // the next descriptor number: nothing may be left open
  ::close(probe);
  EXPECT_THROW(pool.export_pages(p, 0), invalid_argument);
  EXPECT_THROW(pool.export_pages(reinterpret_cast<void*>(0x1000), MiB), invalid_argument);
  EXPECT_THROW(pool.export_pages(p, static_cast<std::size_t>(-1)), invalid_argument);
  // Past the allocation into pages the pool has not mapped.
  EXPECT_THROW(pool.export_pages(p, 64 * MiB), invalid_argument);
  int after = ::dup(0);
  EXPECT_EQ(after, probe);
  ::close(after);

  shared_memory importer(sim, 0);
  auto e = pool.export_pages(p, 2 * MiB);
  std::vector<std::size_t> wrong = e.bytes;
  wrong.front() += 4096;  // not whole pages
  EXPECT_THROW(importer.import_pieces(e.fds, wrong), invalid_argument);
  wrong.front() = e.bytes.front() * 2;  // more than the piece holds
  EXPECT_THROW(importer.import_pieces(e.fds, wrong), invalid_argument);
  EXPECT_THROW(importer.import_pieces({}, {}), invalid_argument);
  std::vector<std::size_t> overflow(2, static_cast<std::size_t>(-1) / 2 + 1);
  overflow[0] -= overflow[0] % pool.page_size();
  overflow[1] = overflow[0];
  const std::vector<int> two{e.fds.front(), e.fds.front()};
  EXPECT_THROW(importer.import_pieces(two, overflow), invalid_argument);
  EXPECT_EQ(importer.imported_bytes(), 0u);
  EXPECT_EQ(importer.validate(), "");
  close_all(e);
  pool.deallocate(p, 2 * MiB);
}

// A platform that refuses shareable memory (sim: its first creation answers
// not_supported): a shareable pool still serves, with plain pages from then on, and says
// not_supported when asked to export them.
TEST_F(PageExport, APlatformRefusingSharingServesWithPlainPages) {
  vmm_page_pool pool(sim, 0, shareable());
  sim.inject_fault(platform_op::create_physical, sim_fault{1, false, 0.0, failure_kind::not_supported});
  void* p = pool.allocate(3 * MiB);
  sim.clear_faults();
  fill(p, 3 * MiB, 2);
  EXPECT_TRUE(same(p, 3 * MiB, 2));
  EXPECT_THROW(pool.export_pages(p, 3 * MiB), not_supported);
  void* q = pool.allocate(8 * MiB);  // later growths take plain pages too
  EXPECT_THROW(pool.export_pages(q, 8 * MiB), not_supported);
  pool.deallocate(q, 8 * MiB);
  pool.deallocate(p, 3 * MiB);
  EXPECT_EQ(pool.validate(), "");
}

// A tag that sleeps has no pages to export; the shared tag exports its one handle.
TEST_F(PageExport, TagsAsleepAreRefusedAndTheSharedTagExportsOnePiece) {
  vmm_page_pool untagged(sim, 0, shareable());
  tagged_pool pool(untagged, shareable());
  void* t = pool.allocate(3 * MiB, 256, {}, 7);
  pool.sleep(7, sleep_mode::offload);
  EXPECT_THROW(pool.export_pages(t, 3 * MiB), invalid_argument);
  pool.wake(7);
  auto e = pool.export_pages(t, 3 * MiB);
  EXPECT_FALSE(e.fds.empty());
  close_all(e);
  pool.deallocate(t, 3 * MiB);

  void* s = pool.allocate(MiB + 1, 256, {}, tagged_pool::shared_tag);
  fill(s, MiB + 1, 1);
  auto one = pool.export_pages(s, MiB + 1);
  ASSERT_EQ(one.fds.size(), 1u);
  EXPECT_EQ(one.offset, 0u);
  void* q = pool.import_pages(one.fds, one.bytes);
  close_all(one);
  EXPECT_TRUE(same(q, MiB + 1, 1));
  EXPECT_THROW(pool.export_pages(q, MiB), invalid_argument);  // an import
  pool.deallocate(q, one.bytes.front());
  pool.deallocate(s, MiB + 1);
  EXPECT_EQ(pool.validate(), "");
}

}  // namespace
