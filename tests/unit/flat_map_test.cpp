// flat_map against std::unordered_map as a reference model: random inserts (operator[] and
// insert_new), lookups and erases (backward-shift deletion is where open addressing goes
// wrong) across rehashes.
#include <gtest/gtest.h>

#include <random>
#include <unordered_map>

#include "pool/core/flat_map.hpp"

namespace {

using gpumem::detail::flat_map;
using gpumem::detail::mix_hash;

// Both loads the pools use: 1/4 (the arenas' quick lists) and 1/8 (the live records).
template <std::size_t MaxLoadInverse>
void agrees_with_a_reference_map() {
  flat_map<std::uint64_t, int, mix_hash, MaxLoadInverse> m;
  std::unordered_map<std::uint64_t, int> ref;
  std::mt19937_64 rng(11);
  // Keys from a small range so erases hit and probe runs collide; multiples of 512 like
  // block addresses.
  std::uniform_int_distribution<std::uint64_t> key(1, 3000);
  for (int step = 0; step < 200000; ++step) {
    const std::uint64_t k = key(rng) * 512;
    switch (rng() % 3) {
      case 0: {
        const int v = static_cast<int>(rng() % 1000);
        if (ref.count(k) == 0 && rng() % 2 == 0)
          m.insert_new(k, v);  // the pools' inserts: a block address not live before
        else
          m[k] = v;
        ref[k] = v;
        break;
      }
      case 1:
        if (rng() % 2 == 0) {
          ASSERT_EQ(m.erase(k), ref.erase(k) == 1) << "step " << step;
        } else {
          // The one-probe path the pools' frees take: look up, check, erase the slot.
          const std::size_t slot = m.slot_of(k);
          auto want = ref.find(k);
          ASSERT_EQ(slot != m.npos, want != ref.end()) << "step " << step;
          if (slot != m.npos) {
            ASSERT_EQ(m.value_at(slot), want->second);
            m.erase_slot(slot);
            ref.erase(want);
          }
        }
        break;
      default: {
        const int* got = m.find(k);
        auto want = ref.find(k);
        ASSERT_EQ(got != nullptr, want != ref.end()) << "step " << step;
        if (got != nullptr) {
          ASSERT_EQ(*got, want->second);
        }
      }
    }
    ASSERT_EQ(m.size(), ref.size());
  }
  std::size_t seen = 0;
  m.for_each([&](std::uint64_t k, int v) {
    ++seen;
    EXPECT_EQ(ref.at(k), v);
  });
  EXPECT_EQ(seen, ref.size());
}

TEST(FlatMap, AgreesWithAReferenceMapUnderRandomOperations) {
  agrees_with_a_reference_map<4>();
  agrees_with_a_reference_map<8>();
}

TEST(FlatMap, PairKeysAndClear) {
  flat_map<std::pair<std::uint64_t, std::uint64_t>, int, mix_hash> m;
  m[{0, 512}] = 1;  // stream 0 is a valid key: only (0, 0) is reserved
  m[{7, 512}] = 2;
  ASSERT_NE(m.find({0, 512}), nullptr);
  EXPECT_EQ(*m.find({0, 512}), 1);
  EXPECT_EQ(*m.find({7, 512}), 2);
  EXPECT_EQ(m.find({7, 1024}), nullptr);
  m.clear();
  EXPECT_EQ(m.size(), 0u);
  EXPECT_EQ(m.find({0, 512}), nullptr);
}

}  // namespace
