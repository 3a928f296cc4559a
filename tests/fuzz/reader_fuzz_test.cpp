// Fixed-seed fuzzing of every reader of files given on the command line: the shared text
// rule (text_lines) against a reference model of it, fed in chunks of every size; trace
// CSV read from text and from a file (plain and gzip'd) agreeing on every mutated input;
// snapshot pickles and serve-sim workloads mutated (cut anywhere, NULs and byte-order marks
// inserted, lengths and counts made huge, nesting added). Every input is read or refused
// with an invalid_argument naming its source; nothing else escapes, nothing crashes (also
// under ASan+UBSan), and memory stays within the limits given.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "../../tools/serve_workload.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/replay/text_lines.hpp"
#include "gpumem/replay/torch_snapshot.hpp"
#include "gpumem/replay/trace.hpp"

#if GPUMEM_TEST_HAVE_ZLIB
#include <zlib.h>
#endif

namespace {

using rng = std::mt19937_64;

// The text rule of text_lines.hpp, written plainly over the whole text: the lines, or the
// line number of the first refusal.
struct model_result {
  std::vector<std::string> lines;
  std::size_t refused_at = 0;  // 0: none
};
model_result model_lines(std::string text, std::size_t max_line) {
  model_result r;
  std::size_t line_no = 0, start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    const bool last = end == std::string::npos;
    if (last) end = text.size();
    std::string line = text.substr(start, end - start);
    ++line_no;
    if (line.size() > max_line + 1 || (line.size() == max_line + 1 && line.back() != '\r')) {
      r.refused_at = line_no;
      return r;
    }
    if (line_no == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    for (unsigned char c : line)
      if (c < 0x20 && c != '\t') {
        r.refused_at = line_no;
        return r;
      }
    r.lines.push_back(line);
    start = end + 1;
  }
  return r;
}

std::string random_text(rng& g, std::size_t n) {
  static const std::vector<std::string> alphabet = {
      "a", "7", " ", ",", "\n", "\n", "\r", "\r\n", "\t", std::string(1, '\0'), "\xEF\xBB\xBF",
      "\x1b", "\xff", "xyz"};
  std::string out;
  if (g() % 4 == 0) out += "\xEF\xBB\xBF";
  while (out.size() < n) out += alphabet[g() % alphabet.size()];
  return out;
}

TEST(reader_fuzz, text_lines_follows_its_model_in_chunks_of_every_size) {
  std::size_t refused = 0, lines = 0;
  for (std::uint64_t seed = 0; seed < 400; ++seed) {
    rng g(7'000'000 + seed);
    const std::size_t max_line = 4 + g() % 40;
    const std::string text = random_text(g, g() % 300);
    const model_result want = model_lines(text, max_line);
    gpumem::text_lines t("fuzz", max_line);
    std::vector<std::string> got;
    std::size_t refused_at = 0;
    auto add = [&](std::string_view line, std::size_t n) {
      ASSERT_EQ(n, got.size() + 1);
      got.emplace_back(line);
    };
    try {
      for (std::size_t at = 0; at < text.size();) {
        const std::size_t n = std::min<std::size_t>(1 + g() % 64, text.size() - at);
        t.feed(std::string_view(text).substr(at, n), add);
        at += n;
      }
      t.finish(add);
    } catch (const gpumem::invalid_argument& e) {
      const std::string why = e.what();
      ASSERT_EQ(why.rfind("fuzz:", 0), 0u) << why;
      refused_at = std::stoul(why.substr(5));
    }
    // A long line is found while it streams, before its end: at the same line.
    ASSERT_EQ(refused_at, want.refused_at) << "seed " << seed;
    if (want.refused_at == 0) {
      ASSERT_EQ(got, want.lines) << "seed " << seed;
    }
    refused += refused_at != 0;
    lines += got.size();
  }
  EXPECT_GT(refused, 100u);
  EXPECT_GT(lines, 300u);
}

// A file of its own, removed at the end.
struct temp_file {
  explicit temp_file(const std::string& name)
      : path((std::filesystem::temp_directory_path() /
              ("gpumem_reader_fuzz_" + std::to_string(::getpid()) + "_" + name))
                 .string()) {}
  ~temp_file() { std::filesystem::remove(path); }
  void write(const std::string& bytes) const { std::ofstream(path, std::ios::binary) << bytes; }
  std::string path;
};

// One mutation of `s`: a cut, a NUL, a byte-order mark, a CR, a huge number, a byte
// changed, or a run of bytes repeated.
std::string mutate(rng& g, std::string s) {
  const std::size_t at = s.empty() ? 0 : g() % s.size();
  switch (g() % 8) {
    case 0: s.resize(at); break;
    case 1: s.insert(at, 1, '\0'); break;
    case 2: s.insert(g() % 2 == 0 ? 0 : at, "\xEF\xBB\xBF"); break;
    case 3: s.insert(at, "\r"); break;
    case 4: s.insert(at, "99999999999999999999999"); break;
    case 5: if (!s.empty()) s[at] = static_cast<char>(g()); break;
    case 6: s.insert(at, s.substr(at, 1 + g() % 16)); break;
    default: if (!s.empty()) s[at] = static_cast<char>(0xff); break;
  }
  return s;
}

#if GPUMEM_TEST_HAVE_ZLIB
std::string gzip(const std::string& text) {
  uLongf n = compressBound(static_cast<uLong>(text.size())) + 32;
  std::string out(n, '\0');
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  z.avail_in = static_cast<uInt>(text.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}
#endif

TEST(reader_fuzz, trace_text_and_trace_files_agree_on_every_mutation) {
  const std::string base =
      "\xEF\xBB\xBF" "action,addr,size,stream,time_us\r\n"
      "alloc,4096,512,0,1\nalloc,8192,1024,7,2\nfree_completed,4096,512,0,3\n"
      "segment_alloc,0,2097152,0,4\nfree_completed,8192,1024,7,5\n";
  const temp_file plain("trace.csv");
  const temp_file gz("trace.csv.gz");
  std::size_t loaded = 0, refused = 0;
  for (std::uint64_t seed = 0; seed < 150; ++seed) {
    rng g(8'000'000 + seed);
    std::string text = base;
    for (int k = g() % 3 == 0 ? 2 : 1; k > 0; --k) text = mutate(g, text);
    auto outcome = [](auto&& read) {
      try {
        const gpumem::trace t = read();
        std::string s = "events " + std::to_string(t.events.size()) + " frees " +
                        std::to_string(t.frees) + " timed " + std::to_string(t.timed);
        for (const auto& e : t.events) s += " " + std::to_string(e.size) + "@" + std::to_string(e.time_ns);
        return s;
      } catch (const gpumem::invalid_argument& e) {
        return std::string("refused: ") + e.what();
      }
    };
    plain.write(text);
    const std::string from_text = outcome([&] { return gpumem::parse_trace(text, plain.path); });
    const std::string from_file = outcome([&] { return gpumem::load_trace(plain.path); });
    ASSERT_EQ(from_text, from_file) << "seed " << seed;
    if (from_text.rfind("refused: ", 0) == 0) {
      ASSERT_NE(from_text.find("trace: " + plain.path), std::string::npos) << from_text;
      ++refused;
    } else {
      ++loaded;
    }
#if GPUMEM_TEST_HAVE_ZLIB
    gz.write(gzip(text));
    std::string from_gzip = outcome([&] { return gpumem::load_trace(gz.path); });
    for (std::size_t p; (p = from_gzip.find(gz.path)) != std::string::npos;)
      from_gzip.replace(p, gz.path.size(), plain.path);
    ASSERT_EQ(from_gzip, from_file) << "seed " << seed;
#endif
  }
  EXPECT_GT(loaded, 5u);
  EXPECT_GT(refused, 15u);
}

// pickle.dumps(protocol=4) of a two-entry snapshot (as torch_snapshot_reader_test's).
const std::string small_snapshot(
    "\x80\x04\x95\x92\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x08\x73\x65\x67\x6d\x65\x6e\x74\x73"
    "\x94\x5d\x94\x8c\x0d\x64\x65\x76\x69\x63\x65\x5f\x74\x72\x61\x63\x65\x73\x94\x5d\x94\x5d\x94\x28"
    "\x7d\x94\x28\x8c\x06\x61\x63\x74\x69\x6f\x6e\x94\x8c\x05\x61\x6c\x6c\x6f\x63\x94\x8c\x04\x61\x64"
    "\x64\x72\x94\x4d\x00\x10\x8c\x04\x73\x69\x7a\x65\x94\x4d\x00\x02\x8c\x06\x73\x74\x72\x65\x61\x6d"
    "\x94\x4b\x00\x8c\x07\x74\x69\x6d\x65\x5f\x75\x73\x94\x4b\x0a\x75\x7d\x94\x28\x68\x07\x8c\x0e\x66"
    "\x72\x65\x65\x5f\x63\x6f\x6d\x70\x6c\x65\x74\x65\x64\x94\x68\x09\x4d\x00\x10\x68\x0a\x4d\x00\x02"
    "\x68\x0b\x4b\x00\x68\x0c\x4b\x0b\x75\x65\x61\x75\x2e",
    157);

TEST(reader_fuzz, snapshot_pickles_are_read_or_refused_within_the_budget) {
  ASSERT_EQ(gpumem::torch_snapshot_to_trace_csv(small_snapshot, "snap.pickle"),
            "action,addr,size,stream,time_us\nalloc,4096,512,0,10\nfree_completed,4096,512,0,11\n");
  std::size_t read = 0, refused = 0;
  for (std::uint64_t seed = 0; seed < 2000; ++seed) {
    rng g(9'000'000 + seed);
    std::string bytes = small_snapshot;
    for (int k = 1 + static_cast<int>(g() % 3); k > 0; --k) {
      if (g() % 6 == 0) {  // nesting: tuples around a value, or a list appended to itself
        const std::size_t at = 2 + g() % (bytes.size() - 2);
        bytes.insert(at, g() % 2 == 0 ? std::string(1 + g() % 300, '\x85')
                                      : std::string("]\x94") + std::string(g() % 300, 'h') + "a");
      } else {
        bytes = mutate(g, bytes);
      }
    }
    try {
      (void)gpumem::torch_snapshot_to_trace_csv(bytes, "snap.pickle", -1, 1 << 20, 1 << 20);
      ++read;
    } catch (const gpumem::invalid_argument& e) {
      ASSERT_EQ(std::string(e.what()).rfind("torch snapshot 'snap.pickle'", 0), 0u) << e.what();
      ++refused;
    }
  }
  EXPECT_GT(refused, 1000u);
  EXPECT_GT(read, 10u);
}

TEST(reader_fuzz, workloads_are_read_or_refused_naming_the_file) {
  const std::string base = "\xEF\xBB\xBF# t\r\n0 8 1 5 6 7\n0.5 4 2 5 6 9\r\n\n3 16 1 100 101\n";
  const temp_file f("workload.txt");
  std::size_t read = 0, refused = 0;
  for (std::uint64_t seed = 0; seed < 150; ++seed) {
    rng g(10'000'000 + seed);
    std::string text = base;
    for (int k = g() % 3 == 0 ? 2 : 1; k > 0; --k) text = mutate(g, text);
    f.write(text);
    try {
      const auto w = gpumem::cli::read_serve_workload(f.path, 1 << 16);
      for (const auto& r : w) {
        ASSERT_GE(r.samples, 1u);
        ASSERT_LE(r.arrival, gpumem::cli::serve_max_arrival_seconds);
        ASSERT_FALSE(r.prompt.empty());
      }
      ++read;
    } catch (const gpumem::invalid_argument& e) {
      ASSERT_EQ(std::string(e.what()).rfind("serve-sim: workload", 0), 0u) << e.what();
      ASSERT_NE(std::string(e.what()).find(f.path), std::string::npos) << e.what();
      ++refused;
    }
  }
  EXPECT_GT(read, 5u);
  EXPECT_GT(refused, 30u);
}

}  // namespace
