// Trace parsing (PyTorch-derived and RMM CSV) and deterministic replay on the backends and
// pools over sim, including the shipped real training trace.
#include "gpumem/replay/trace.hpp"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <thread>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <ostream>
#include <string>

#if GPUMEM_TEST_HAVE_ZLIB
#include <zlib.h>
#endif

#include "gpumem/backend/backends.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/core/pool_observer.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;
constexpr std::size_t GiB = 1024 * MiB;

// `passes` passes, writing each block's first bytes (sim: proves it is mapped).
replay_options touching_passes(int passes) {
  replay_options o;
  o.passes = passes;
  o.touch = true;
  return o;
}

// --- parsing -------------------------------------------------------------------------------

const char* const pytorch_text =
    "action,addr,size,stream,time_us\n"
    "segment_alloc,1000000,2097152,0,1\n"   // skipped: what PyTorch did
    "alloc,1000000,512,0,2\n"               // id 0
    "alloc,1000512,1024,0,3\n"              // id 1
    "free_requested,1000000,512,0,4\n"      // skipped
    "free_completed,1000000,512,0,5\n"      // frees id 0
    "free_completed,99999999,512,0,6\n"     // never allocated in the trace: unmatched
    "alloc,5000000,2048,77,7\n"             // id 2, on a second stream
    "alloc,6000000,0,0,8\n"                 // zero bytes: nothing to replay
    "free_completed,1000512,1024,0,9\n"     // frees id 1
    "segment_free,1000000,2097152,0,10\n";  // skipped

TEST(ParseTrace, PyTorchFormat) {
  const trace t = parse_trace(pytorch_text, "inline.csv");
  EXPECT_EQ(t.format, "pytorch");
  EXPECT_EQ(t.source, "inline.csv");
  EXPECT_EQ(t.allocs, 3u);
  EXPECT_EQ(t.frees, 2u);
  EXPECT_EQ(t.unmatched_frees, 1u);
  EXPECT_EQ(t.live_at_end, 1u);
  EXPECT_EQ(t.peak_live_bytes, 1024u + 2048u);  // ids 1 and 2 together, after id 0 is freed
  EXPECT_EQ(t.max_size, 2048u);
  ASSERT_EQ(t.streams.size(), 2u);
  EXPECT_EQ(t.streams[0], 0u);
  EXPECT_EQ(t.streams[1], 77u);

  ASSERT_EQ(t.events.size(), 5u);
  using k = trace_event::kind;
  const struct {
    k op;
    std::uint32_t id;
    std::uint64_t size;
    std::uint32_t stream;
  } want[] = {{k::alloc, 0, 512, 0}, {k::alloc, 1, 1024, 0}, {k::free, 0, 512, 0},
              {k::alloc, 2, 2048, 1}, {k::free, 1, 1024, 0}};
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(t.events[i].op, want[i].op) << "event " << i;
    EXPECT_EQ(t.events[i].id, want[i].id) << "event " << i;
    EXPECT_EQ(t.events[i].size, want[i].size) << "event " << i;
    EXPECT_EQ(t.events[i].stream, want[i].stream) << "event " << i;
  }
}

TEST(ParseTrace, RmmFormatWithHexPointersAndCrLf) {
  const std::string text =
      "Thread,Time,Action,Pointer,Size,Stream\r\n"
      "140234,10:00:00.000001,allocate,0x7f0000000000,4096,0x0\r\n"
      "140234,10:00:00.000002,allocate,0x7f0000100000,1048576,0x5a\r\n"
      "140234,10:00:00.000003,allocate failure,0x0,999999999999,0x0\r\n"
      "140234,10:00:00.000004,free,0x7f0000000000,4096,0x0\r\n"
      "140234,10:00:00.000005,allocate,0x7f0000000000,8192,0x0\r\n"
      "140234,10:00:00.000006,free,0x7f0000100000,1048576,0x5a\r\n"
      "\r\n";
  const trace t = parse_trace(text, "rmm.csv");
  EXPECT_EQ(t.format, "rmm");
  EXPECT_EQ(t.allocs, 3u);
  EXPECT_EQ(t.frees, 2u);
  EXPECT_EQ(t.unmatched_frees, 0u);
  EXPECT_EQ(t.live_at_end, 1u);
  EXPECT_EQ(t.peak_live_bytes, 1048576u + 8192u);
  EXPECT_EQ(t.max_size, 1048576u);
  ASSERT_EQ(t.streams.size(), 2u);
  EXPECT_EQ(t.streams[1], 0x5au);
  ASSERT_EQ(t.events.size(), 5u);
  // The address reused after its free is a new allocation.
  EXPECT_EQ(t.events[3].op, trace_event::kind::alloc);
  EXPECT_EQ(t.events[3].id, 2u);
  EXPECT_EQ(t.events[4].op, trace_event::kind::free);
  EXPECT_EQ(t.events[4].id, 1u);
  EXPECT_EQ(t.events[4].stream, 1u);
}

TEST(ParseTrace, EveryFreeNamesAnEarlierLiveAllocation) {
  const trace t = parse_trace(pytorch_text, "inline.csv");
  std::vector<bool> live(t.allocs, false);
  for (const trace_event& e : t.events) {
    ASSERT_LT(e.id, t.allocs);
    if (e.op == trace_event::kind::alloc) {
      EXPECT_FALSE(live[e.id]);
      live[e.id] = true;
    } else {
      EXPECT_TRUE(live[e.id]);
      live[e.id] = false;
    }
  }
}

void expect_refused(const std::string& text, const std::string& must_name) {
  try {
    (void)parse_trace(text, "bad.csv");
    ADD_FAILURE() << "accepted:\n" << text;
  } catch (const gpumem::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(must_name), std::string::npos)
        << "message should name '" << must_name << "': " << e.what();
  }
}

TEST(ParseTrace, MalformedInputIsRefusedNamingTheLine) {
  expect_refused("when,where,what\n1,2,3\n", "bad.csv:1");
  expect_refused("when,where,what\n1,2,3\n", "unknown header");
  expect_refused("action,addr,size,stream,time_us\nalloc,100,512,0,1\nalloc,12x,512,0,2\n",
                 "bad.csv:3");
  expect_refused("action,addr,size,stream,time_us\nalloc,100,512,0,1\nalloc,12x,512,0,2\n", "12x");
  expect_refused("action,addr,size,stream,time_us\nalloc,100,-5,0,1\n", "bad.csv:2");
  expect_refused("action,addr,size,stream,time_us\nalloc,100,512,0,1\n\nrealloc,100,512,0,2\n",
                 "bad.csv:4");
  expect_refused("action,addr,size,stream,time_us\nrealloc,100,512,0,2\n", "realloc");
  expect_refused("action,addr,size,stream,time_us\nalloc,100\n", "bad.csv:2");
  expect_refused("Thread,Time,Action,Pointer,Size,Stream\n1,2,allocate,0xZZ,16,0x0\n", "bad.csv:2");
  expect_refused("", "bad.csv");
  // Each number names its field, the value and the range.
  expect_refused("action,addr,size,stream,time_us\nalloc,100,x7,0,1\n",
                 "bad.csv:2: size 'x7' is not a whole number in 0..18446744073709551615");
  expect_refused("action,addr,size,stream,time_us\nalloc,18446744073709551616,512,0,1\n",
                 "bad.csv:2: addr '18446744073709551616' is not a whole number");
  expect_refused("action,addr,size,stream,time_us\nalloc,100,281474976710657,0,1\n",
                 "bad.csv:2: size '281474976710657' is not a size in 0..281474976710656");
  expect_refused("action,addr,size,stream,time_us\nalloc,100,512,0,abc\n",
                 "bad.csv:2: time_us 'abc' is not a whole number of microseconds in 0..9223372036854775");
  expect_refused("action,addr,size,stream,time_us\nalloc,100,512,0,99999999999999999\n",
                 "bad.csv:2: time_us '99999999999999999' is not");
  expect_refused("Thread,Time,Action,Pointer,Size,Stream\n1,10:99:00.5,allocate,0x10,16,0x0\n",
                 "bad.csv:2: Time '10:99:00.5' is not a time H:MM:SS.fraction");
  expect_refused(std::string("action,addr,size,stream,time_us\nalloc,100,512,0,1\nalloc,1\x00" "00,512,0,2\n", 69),
                 "bad.csv:3: binary data, not text (byte 0x00 at column 8: a NUL)");
}

TEST(ParseTrace, LoadTraceNamesAMissingFile) {
  try {
    (void)load_trace("/nonexistent/dir/trace.csv.gz");
    ADD_FAILURE() << "a missing file loaded";
  } catch (const gpumem::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/trace.csv.gz"), std::string::npos)
        << e.what();
  }
}

TEST(ParseTrace, AByteOrderMarkBeforeTheHeaderIsSkipped) {
  const trace t = parse_trace(std::string("\xEF\xBB\xBF") + pytorch_text, "bom.csv");
  EXPECT_EQ(t.format, "pytorch");
  EXPECT_EQ(t.allocs, 3u);
  // Only before the header: a mark anywhere else is no header.
  expect_refused(std::string("\n\xEF\xBB\xBF") + pytorch_text, "bad.csv:2");
}

TEST(ParseTrace, AnomaliesAreCountedAndHandledAsDocumented) {
  const trace t = parse_trace(
      "action,addr,size,stream,time_us\n"
      "alloc,100,512,0,1\n"             // id 0
      "free_completed,100,512,0,2\n"
      "free_completed,100,512,0,3\n"    // double free: dropped
      "free_completed,777,64,0,4\n"     // never allocated: dropped
      "alloc,200,1024,0,5\n"            // id 1
      "alloc,200,2048,0,6\n"            // id 2 at an address still live: id 1 stays live
      "free_completed,200,4096,0,7\n"   // frees id 2 (2048 bytes), naming another size
      "alloc,100,256,0,8\n"             // the freed address reused: no anomaly
      "free_completed,100,256,0,9\n",
      "anomalies.csv");
  EXPECT_EQ(t.unmatched_frees, 1u);
  EXPECT_EQ(t.double_frees, 1u);
  EXPECT_EQ(t.reused_addresses, 1u);
  EXPECT_EQ(t.mismatched_free_sizes, 1u);
  EXPECT_EQ(t.allocs, 4u);
  EXPECT_EQ(t.frees, 3u);
  EXPECT_EQ(t.live_at_end, 1u) << "id 1, its address reused while it lived";
  ASSERT_EQ(t.events.size(), 7u);
  EXPECT_EQ(t.events[4].op, trace_event::kind::free);
  EXPECT_EQ(t.events[4].id, 2u);
  EXPECT_EQ(t.events[4].size, 2048u) << "the allocation's size is freed";
  EXPECT_EQ(t.peak_live_bytes, 1024u + 2048u);

  const trace clean = parse_trace(pytorch_text, "inline.csv");
  EXPECT_EQ(clean.double_frees + clean.reused_addresses + clean.mismatched_free_sizes, 0u);
}

// --- reading files -------------------------------------------------------------------------

// A file of its own under the test's temporary directory, removed at the end.
struct temp_file {
  explicit temp_file(const std::string& name)
      : path((std::filesystem::temp_directory_path() /
              ("gpumem_replay_test_" + std::to_string(::getpid()) + "_" + name))
                 .string()) {}
  ~temp_file() { std::filesystem::remove(path); }
  void write(const std::string& bytes) const {
    std::ofstream(path, std::ios::binary) << bytes;
  }
  std::string path;
};

// The bytes this process has read through read(2) and its kind so far (Linux's rchar).
std::uint64_t bytes_read_by_process() {
  std::ifstream io("/proc/self/io");
  std::string key;
  std::uint64_t value = 0;
  while (io >> key >> value)
    if (key == "rchar:") return value;
  return 0;
}

// The message of the invalid_argument that load_trace(path) throws, or "" when it loads.
std::string load_error(const std::string& path) {
  try {
    (void)load_trace(path);
  } catch (const gpumem::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(LoadTrace, StreamsAFileAsParseTraceReadsItsText) {
  // Over a few read buffers, lines cut at every place by the buffer's edges, CRLF, no final
  // newline.
  std::string text = "Thread,Time,Action,Pointer,Size,Stream\r\n";
  for (int i = 0; i < 6000; ++i) {
    const std::string addr = "0x7f" + std::to_string(100000 + i % 50);
    text += "1,10:00:00." + std::to_string(100000 + i) + ",allocate," + addr + "," +
            std::to_string(256 + i % 7 * 512) + ",0x0\r\n";
    text += "1,10:00:00." + std::to_string(100000 + i) + ",free," + addr + "," +
            std::to_string(256 + i % 7 * 512) + ",0x0" + (i + 1 < 6000 ? "\r\n" : "");
  }
  ASSERT_GT(text.size(), 3 * trace_header_window);
  const temp_file f("stream.csv");
  f.write(text);
  const trace read = load_trace(f.path);
  const trace parsed = parse_trace(text, f.path);
  EXPECT_EQ(read.allocs, 6000u);
  EXPECT_EQ(read.frees, 6000u);
  ASSERT_EQ(read.events.size(), parsed.events.size());
  for (std::size_t i = 0; i < read.events.size(); ++i) {
    ASSERT_EQ(read.events[i].id, parsed.events[i].id) << i;
    ASSERT_EQ(read.events[i].size, parsed.events[i].size) << i;
    ASSERT_EQ(read.events[i].time_ns, parsed.events[i].time_ns) << i;
  }
}

TEST(LoadTrace, AFileThatIsNoTraceIsRefusedAfterABoundedRead) {
  // 256 MiB of zeros (a sparse file: no disk), as /dev/zero reads: refused after its first
  // window, not read whole.
  const temp_file zeros("zeros.bin");
  zeros.write("");
  std::filesystem::resize_file(zeros.path, 256 * MiB);
  const std::uint64_t before = bytes_read_by_process();
  const std::string why = load_error(zeros.path);
  const std::uint64_t read = bytes_read_by_process() - before;
  EXPECT_NE(why.find(zeros.path), std::string::npos) << why;
  EXPECT_NE(why.find("not a trace"), std::string::npos) << why;
  EXPECT_LT(read, 4 * MiB) << "bytes read before refusing it";

  // A header, then a line with no end.
  const temp_file endless("endless.csv");
  endless.write("action,addr,size,stream,time_us\nalloc,100,512,0,1\n" +
                std::string(2 * trace_max_line, '7'));
  const std::string long_line = load_error(endless.path);
  EXPECT_NE(long_line.find(endless.path + ":3"), std::string::npos) << long_line;
  EXPECT_NE(long_line.find("line longer than"), std::string::npos) << long_line;

  // A long line that ends, a buffer's edge inside it.
  std::string text = "action,addr,size,stream,time_us\n";
  std::size_t lines = 1;
  for (; text.size() < trace_header_window - 100; lines += 2)
    text += "alloc,100,512,0,1\nfree_completed,100,512,0,2\n";
  const temp_file long_one("long.csv");
  long_one.write(text + std::string(trace_max_line + 1, '7') + "\nalloc,100,512,0,1\n");
  const std::string ended = load_error(long_one.path);
  EXPECT_NE(ended.find(long_one.path + ":" + std::to_string(lines + 1) + ":"), std::string::npos)
      << ended;
  EXPECT_NE(ended.find("line longer than"), std::string::npos) << ended;

  // Binary data with line ends in it.
  const temp_file binary("binary.bin");
  binary.write(std::string("\x7f" "ELF\x02\x01\x01\0\0\0\n\0\0", 13));
  const std::string binary_why = load_error(binary.path);
  EXPECT_NE(binary_why.find(binary.path + ":1"), std::string::npos) << binary_why;
  EXPECT_NE(binary_why.find("binary data"), std::string::npos) << binary_why;

  const std::string empty = load_error("/dev/null");
  EXPECT_NE(empty.find("/dev/null is empty"), std::string::npos) << empty;
}

TEST(LoadTrace, AFifoIsReadWithinTheLimitWhateverItHolds) {
  // A FIFO fed without end, as a pickle (read whole before it is unpickled) and as CSV
  // text: each refused at the limit, naming the file and the limit.
  for (const std::string& head : {std::string("\x80\x02"), std::string("action,addr,size,stream,time_us\n")}) {
    const temp_file fifo("endless.fifo");
    ASSERT_EQ(::mkfifo(fifo.path.c_str(), 0600), 0);
    std::thread writer([&] {
      const int fd = ::open(fifo.path.c_str(), O_WRONLY);
      if (fd < 0) return;
      std::string chunk = head;
      while (chunk.size() < 64 * KiB) chunk += head[0] == '\x80' ? "N" : "alloc,4096,512,0,1\n";
      chunk.erase(0, head.size());
      bool first = true;
      // Stops when the reader closes its end (EPIPE; SIGPIPE is ignored below).
      for (;;) {
        const std::string& out = first ? head : chunk;
        first = false;
        if (::write(fd, out.data(), out.size()) < 0) break;
      }
      ::close(fd);
    });
    const auto old = std::signal(SIGPIPE, SIG_IGN);
    trace_read_limits limits;
    limits.max_bytes = 2 * MiB;
    std::string why;
    try {
      (void)load_trace(fifo.path, limits);
    } catch (const gpumem::invalid_argument& e) {
      why = e.what();
    }
    writer.join();
    std::signal(SIGPIPE, old);
    EXPECT_NE(why.find("trace: " + fifo.path), std::string::npos) << why;
    EXPECT_NE(why.find("more than 2.00 MiB, this reader's limit"), std::string::npos) << why;
  }
}

#if GPUMEM_TEST_HAVE_ZLIB
// `text` gzip'd.
std::string gzip(const std::string& text) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&z, text.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  z.avail_in = static_cast<uInt>(text.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

TEST(LoadTrace, ACutOrCorruptGzipTraceIsRefusedNamingTheFileAndLine) {
  std::string text = "action,addr,size,stream,time_us\n";
  for (int i = 0; i < 20000; ++i)
    text += "alloc," + std::to_string(1000000 + 4096 * (i * 7919 % 20000)) + "," +
            std::to_string(512 + i * 37 % 9000) + ",0," + std::to_string(i) + "\n";
  const std::string gz = gzip(text);
  const temp_file whole("whole.csv.gz");
  whole.write(gz);
  EXPECT_EQ(load_trace(whole.path).allocs, 20000u);

  // Cut in the middle: the lines before the cut are what zlib could decompress; the error
  // names the line after them (the cut one), whatever that line's text became.
  const temp_file cut("cut.csv.gz");
  cut.write(gz.substr(0, gz.size() / 2));
  std::size_t whole_lines = 0;
  {
    gzFile f = gzopen(cut.path.c_str(), "rb");
    ASSERT_NE(f, nullptr);
    char buf[4096];
    int n;
    while ((n = gzread(f, buf, sizeof buf)) > 0)
      whole_lines += static_cast<std::size_t>(std::count(buf, buf + n, '\n'));
    gzclose(f);
  }
  ASSERT_GT(whole_lines, 10u);
  const std::string why = load_error(cut.path);
  EXPECT_NE(why.find(cut.path + ":" + std::to_string(whole_lines + 1) + ":"), std::string::npos)
      << why;
  EXPECT_NE(why.find("truncated"), std::string::npos) << why;

  // Cut in the trailer alone (every line there, the checksum missing).
  const temp_file no_trailer("no_trailer.csv.gz");
  no_trailer.write(gz.substr(0, gz.size() - 4));
  const std::string trailer_why = load_error(no_trailer.path);
  EXPECT_NE(trailer_why.find(no_trailer.path + ":20002:"), std::string::npos) << trailer_why;
  EXPECT_NE(trailer_why.find("truncated"), std::string::npos) << trailer_why;

  // A byte changed in the middle: zlib yields garbage until the checksum fails; the error
  // names the corruption, not only the garbage.
  std::string bad = gz;
  bad[bad.size() / 2] = static_cast<char>(bad[bad.size() / 2] ^ 0x5a);
  const temp_file corrupt("corrupt.csv.gz");
  corrupt.write(bad);
  const std::string corrupt_why = load_error(corrupt.path);
  EXPECT_NE(corrupt_why.find(corrupt.path + ":"), std::string::npos) << corrupt_why;
  EXPECT_TRUE(corrupt_why.find("cannot read") != std::string::npos ||
              corrupt_why.find("gzip data is corrupt") != std::string::npos)
      << corrupt_why;
}
TEST(LoadTrace, AGzipBombIsRefusedAtTheLimitOfEitherForm) {
  // 64 MiB of trace lines in some 200 KiB of gzip: refused once 1 MiB is decompressed.
  std::string text = "action,addr,size,stream,time_us\n";
  while (text.size() < 64 * MiB) text += "alloc,4096,512,0,1\nfree_completed,4096,512,0,2\n";
  const temp_file bomb("bomb.csv.gz");
  bomb.write(gzip(text));
  trace_read_limits limits;
  limits.max_bytes = MiB;
  std::string why;
  try {
    (void)load_trace(bomb.path, limits);
  } catch (const gpumem::invalid_argument& e) {
    why = e.what();
  }
  EXPECT_NE(why.find("trace: " + bomb.path + ":"), std::string::npos) << why;
  EXPECT_NE(why.find("more than 1.00 MiB, this reader's limit"), std::string::npos) << why;

  // 8 MiB of empty gzip members (nothing decompressed, ever): refused by the bytes read.
  const std::string empty_member = gzip("");
  std::string members;
  while (members.size() < 8 * MiB) members += empty_member;
  const temp_file empties("empties.csv.gz");
  empties.write(members);
  const std::uint64_t before = bytes_read_by_process();
  const std::string empty_why = [&] {
    try {
      (void)load_trace(empties.path, limits);
    } catch (const gpumem::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  EXPECT_LT(bytes_read_by_process() - before, 2 * MiB) << "bytes read before refusing it";
  EXPECT_NE(empty_why.find("its data runs to more than 1.00 MiB"), std::string::npos) << empty_why;
  // Two members of a trace read as one (as gzip -c a b > c writes).
  const temp_file two("two.csv.gz");
  two.write(gzip("action,addr,size,stream,time_us\nalloc,4096,512,0,1\n") +
            gzip("free_completed,4096,512,0,2\n"));
  EXPECT_EQ(load_trace(two.path).frees, 1u);
}

#else
TEST(LoadTrace, AGzipTraceIsRefusedSayingZlibIsMissing) {
  // gzip's magic and a header: this gpumem reads no gzip without zlib.
  const temp_file f("any.csv.gz");
  f.write(std::string("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", 10));
  const std::string why = load_error(f.path);
  EXPECT_NE(why.find(f.path), std::string::npos) << why;
  EXPECT_NE(why.find("without zlib"), std::string::npos) << why;
}
#endif

// --- replay on sim -------------------------------------------------------------------------

// A synthetic trace: a growing and shrinking working set of mixed sizes on one stream.
std::string synthetic_trace_text() {
  std::string text = "action,addr,size,stream,time_us\n";
  std::uint64_t next_addr = 1 << 20;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> live;
  const std::uint64_t sizes[] = {512, 4096, 100 * KiB, MiB, 3 * MiB, 8 * MiB, 20 * MiB};
  int t = 0;
  for (int round = 0; round < 6; ++round) {
    for (int i = 0; i < 14; ++i) {
      const std::uint64_t size = sizes[(i * 3 + round) % 7];
      text += "alloc," + std::to_string(next_addr) + "," + std::to_string(size) + ",0," +
              std::to_string(t++) + "\n";
      live.push_back({next_addr, size});
      next_addr += size + 4096;
    }
    // Free all but the first three of this round, in a scrambled order.
    for (std::size_t i = 3; i < live.size(); i += 2) {
      text += "free_completed," + std::to_string(live[i].first) + "," +
              std::to_string(live[i].second) + ",0," + std::to_string(t++) + "\n";
      live[i].second = 0;
    }
    for (std::size_t i = 4; i < live.size(); i += 2) {
      if (live[i].second == 0) continue;
      text += "free_completed," + std::to_string(live[i].first) + "," +
              std::to_string(live[i].second) + ",0," + std::to_string(t++) + "\n";
      live[i].second = 0;
    }
    std::erase_if(live, [](const auto& l) { return l.second == 0; });
  }
  return text;
}

class Replay : public ::testing::Test {
 protected:
  static sim_options device_options() {
    sim_options o;
    o.capacity = 4 * GiB;
    o.granularity = 2 * MiB;
    return o;
  }
  void TearDown() override {
    EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
    EXPECT_EQ(sim.validate(), "");
  }
  void expect_common(const replay_result& r, const trace& t, int passes) {
    EXPECT_FALSE(r.oom) << r.oom_message;
    EXPECT_EQ(r.allocs, t.allocs * static_cast<std::uint64_t>(passes));
    EXPECT_EQ(r.frees, t.frees * static_cast<std::uint64_t>(passes));
    EXPECT_EQ(r.peak_live_bytes, t.peak_live_bytes);
    EXPECT_GE(r.fragmentation, 1.0);
    EXPECT_DOUBLE_EQ(r.fragmentation, static_cast<double>(r.peak_reserved_bytes) /
                                          static_cast<double>(r.peak_live_bytes));
    EXPECT_FALSE(r.live_samples.empty());
    EXPECT_EQ(r.live_samples.size(), r.reserved_samples.size());
    for (const auto& [index, live] : r.live_samples) EXPECT_LE(live, t.peak_live_bytes);
  }
  sim_platform sim{device_options()};
};

TEST_F(Replay, SyntheticTraceOnTheRuntimeBackend) {
  const trace t = parse_trace(synthetic_trace_text(), "synthetic");
  ASSERT_GT(t.allocs, 50u);
  runtime_resource res(sim);
  const replay_result r = replay_trace(t, res, touching_passes(1));
  expect_common(r, t, 1);
  EXPECT_EQ(r.allocator, "runtime");
  // Every allocation is a cudaMalloc, and every one is freed (the live ones after the pass).
  EXPECT_EQ(r.driver_calls.at("cudaMalloc"), t.allocs);
  EXPECT_EQ(r.driver_calls.at("cudaFree"), t.allocs);
  EXPECT_EQ(r.driver_calls.count("cuMemCreate"), 0u);
  EXPECT_EQ(res.stats().live_bytes, 0u);
}

// --gpu-lag (sim): a block freed on one stream is reusable on another only once the work
// before its free is known complete. With the GPU modelled behind, it is not yet at the
// next request, so the pool grows; at once (the default) it reuses the block.
TEST_F(Replay, GpuLagKeepsAFreeIncompleteUntilTheGpuCatchesUp) {
  const trace t = parse_trace(
      "action,addr,size,stream,time_us\n"
      "alloc,1000000,4194304,0,1\n"
      "free_completed,1000000,4194304,0,2\n"
      "alloc,9000000,4194304,7,3\n"
      "free_completed,9000000,4194304,7,4\n",
      "two_streams.csv");
  auto peak_reserved = [&](std::size_t lag) {
    sim_platform s{device_options()};
    vmm_page_pool pool(s);
    replay_options o;
    o.gpu_lag = lag;
    const replay_result r = replay_trace(t, pool, o);
    EXPECT_FALSE(r.oom);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    // The replay leaves the device completing work at once again.
    auto st = s.stream_create(0);
    auto ev = s.event_create(0);
    EXPECT_TRUE(st.ok() && ev.ok());
    EXPECT_TRUE(s.event_record(ev.value(), st.value()).ok());
    EXPECT_TRUE(s.event_query(ev.value()).value());
    EXPECT_TRUE(s.event_destroy(ev.value()).ok());
    EXPECT_TRUE(s.stream_destroy(st.value()).ok());
    return r.peak_reserved_bytes;
  };
  EXPECT_EQ(peak_reserved(0), 4 * MiB);
  EXPECT_EQ(peak_reserved(1000), 8 * MiB);
}

TEST_F(Replay, SyntheticTraceOnTheCachingPool) {
  const trace t = parse_trace(synthetic_trace_text(), "synthetic");
  runtime_resource upstream(sim);
  caching_pool pool(upstream);
  const replay_result r = replay_trace(t, pool, touching_passes(2));
  expect_common(r, t, 2);
  EXPECT_EQ(r.allocator, "caching_pool");
  ASSERT_TRUE(r.driver_calls.contains("cudaMalloc"));
  EXPECT_LT(r.driver_calls.at("cudaMalloc"), t.allocs) << "a caching pool must reuse";
  EXPECT_EQ(r.driver_calls.count("cudaFree"), 0u);  // keeps everything cached by default
  EXPECT_EQ(pool.stats().live_bytes, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// The last pass's calls alone: every allocation is a cudaMalloc again on the raw backend;
// a caching pool that has settled calls nothing there.
TEST_F(Replay, TheLastPassCountsItsOwnDriverCalls) {
  const trace t = parse_trace(synthetic_trace_text(), "synthetic");
  runtime_resource res(sim);
  const replay_result raw = replay_trace(t, res, touching_passes(3));
  EXPECT_EQ(raw.driver_calls.at("cudaMalloc"), 3 * t.allocs);
  EXPECT_EQ(raw.last_pass_driver_calls.at("cudaMalloc"), t.allocs);
  EXPECT_EQ(raw.last_pass_driver_calls.at("cudaFree"), t.allocs);
  // Both move memory; the stream and event calls beside them do not.
  EXPECT_EQ(raw.last_pass_memory_calls, 2 * t.allocs);
  EXPECT_EQ(raw.last_pass_allocs, t.allocs);

  runtime_resource upstream(sim);
  caching_pool pool(upstream);
  const replay_result cached = replay_trace(t, pool, touching_passes(3));
  ASSERT_GT(cached.driver_calls.at("cudaMalloc"), 0u);
  EXPECT_EQ(cached.last_pass_driver_calls.at("cudaMalloc"), 0u) << "the pool did not settle";
  EXPECT_EQ(cached.last_pass_memory_calls, 0u);
  EXPECT_EQ(cached.last_pass_allocs, t.allocs);

  const replay_result once = replay_trace(t, pool, touching_passes(1));
  EXPECT_TRUE(once.last_pass_driver_calls.empty()) << "one pass has no separate last pass";
  EXPECT_EQ(once.last_pass_memory_calls, 0u);
  EXPECT_EQ(once.last_pass_allocs, 0u);
}

TEST_F(Replay, SyntheticTraceOnTheVmmPagePool) {
  const trace t = parse_trace(synthetic_trace_text(), "synthetic");
  vmm_page_pool pool(sim);
  const replay_result r = replay_trace(t, pool, touching_passes(2));
  expect_common(r, t, 2);
  EXPECT_EQ(r.allocator, "vmm_page_pool");
  ASSERT_TRUE(r.driver_calls.contains("cuMemCreate"));
  ASSERT_TRUE(r.driver_calls.contains("cuMemMap"));
  ASSERT_TRUE(r.driver_calls.contains("cuMemSetAccess"));
  EXPECT_EQ(r.driver_calls.count("cudaMalloc"), 0u);
  EXPECT_EQ(r.driver_calls.count("cuMemAddressReserve"), 0u);  // the range predates the replay
  EXPECT_LE(r.driver_calls.at("cuMemCreate"), t.allocs);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(Replay, OutOfMemoryIsReportedNotThrown) {
  const trace t = parse_trace(synthetic_trace_text(), "synthetic");
  pool_options o;
  o.limit_bytes = 32 * MiB;
  vmm_page_pool pool(sim, 0, o);
  const replay_result r = replay_trace(t, pool, replay_options{});
  EXPECT_TRUE(r.oom);
  EXPECT_LT(r.oom_event, t.events.size());
  EXPECT_NE(r.oom_message.find("out of memory"), std::string::npos) << r.oom_message;
  EXPECT_LT(r.allocs, t.allocs);
  EXPECT_EQ(pool.stats().live_bytes, 0u) << "the replay frees what it still holds";
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// A request larger than the whole device is an out-of-memory of that replay, as an
// oversized live set is (no allocator could serve it), not a refusal that stops the others.
TEST(ReplayOversized, ARequestLargerThanTheDeviceIsAnOutOfMemoryResult) {
  sim_options so;
  so.capacity = 64 * MiB;
  sim_platform sim(so);
  const trace t = parse_trace("action,addr,size,stream,time_us\n"
                              "alloc,100,1048576,0,1\n"
                              "alloc,200,104857600,0,2\n"  // 100 MiB
                              "free_completed,200,104857600,0,3\n"
                              "free_completed,100,1048576,0,4\n",
                              "oversized.csv");
  runtime_resource runtime(sim, 0);
  caching_pool caching(runtime, pool_options{});
  vmm_page_pool paged(sim, 0, pool_options{});
  for (memory_resource* resource : {static_cast<memory_resource*>(&runtime),
                                    static_cast<memory_resource*>(&caching),
                                    static_cast<memory_resource*>(&paged)}) {
    const replay_result r = replay_trace(t, *resource, replay_options{});
    EXPECT_TRUE(r.oom) << r.allocator;
    EXPECT_EQ(r.oom_event, 1u) << r.allocator;
    EXPECT_EQ(r.allocs, 1u) << r.allocator;
    EXPECT_NE(r.oom_message.find("oversized.csv"), std::string::npos) << r.oom_message;
    EXPECT_NE(r.oom_message.find(" on " + r.allocator), std::string::npos) << r.oom_message;
    EXPECT_NE(r.oom_message.find("100.00 MiB"), std::string::npos) << r.oom_message;
    EXPECT_EQ(resource->stats().live_bytes, 0u) << r.allocator << ": the replay frees what it holds";
  }
  EXPECT_TRUE(caching.is_valid()) << caching.validate();
  EXPECT_TRUE(paged.is_valid()) << paged.validate();
}

// A trace on two streams: the replay creates a stream for the second and destroys it at
// the end. The pool is used again afterwards (another replay, then trim).
std::string two_stream_trace_text() {
  std::string text = "action,addr,size,stream,time_us\n";
  for (int i = 0; i < 8; ++i) {
    const std::string a = std::to_string(0x100000 * (i + 1));
    const std::string stream = i % 2 == 0 ? "0" : "94000000";
    text += "alloc," + a + "," + std::to_string(4 * MiB) + "," + stream + ",1\n";
  }
  for (int i = 0; i < 8; ++i) {
    const std::string a = std::to_string(0x100000 * (i + 1));
    const std::string stream = i % 2 == 0 ? "0" : "94000000";
    text += "free_completed," + a + "," + std::to_string(4 * MiB) + "," + stream + ",2\n";
  }
  return text;
}

TEST_F(Replay, TwoStreamTraceOnTheCachingPool) {
  const trace t = parse_trace(two_stream_trace_text(), "two-stream");
  ASSERT_EQ(t.streams.size(), 2u);
  runtime_resource upstream(sim);
  caching_pool pool(upstream);
  const auto streams_before = sim.calls_made(platform_op::stream_create);
  const replay_result r = replay_trace(t, pool, replay_options{});
  expect_common(r, t, 1);
  EXPECT_EQ(sim.calls_made(platform_op::stream_create), streams_before + 1);
  EXPECT_EQ(sim.live_objects().streams, 0u) << "the replay's stream was not destroyed";
  // The pool remains usable after the replay's stream is gone.
  EXPECT_NO_THROW((void)pool.trim());
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// Regression; the defect was: replay_trace destroys the streams it created while the pool
// still has blocks tagged with them and keeps them in its stream table; the next grow
// (vmm_page_pool::reclaim) or trim (synchronize_streams_with_free_blocks) calls
// cudaStreamSynchronize on the destroyed stream and throws cuda_error.
TEST_F(Replay, APoolStaysUsableAfterAMultiStreamReplay) {
  const trace t = parse_trace(two_stream_trace_text(), "two-stream");
  vmm_page_pool pool(sim);
  const replay_result first = replay_trace(t, pool, replay_options{});
  EXPECT_FALSE(first.oom);
  try {
    const replay_result second = replay_trace(t, pool, replay_options{});
    EXPECT_FALSE(second.oom) << second.oom_message;
  } catch (const cuda_error& e) {
    ADD_FAILURE() << "second replay on the same pool threw: " << e.what();
  }
  try {
    (void)pool.trim();
  } catch (const cuda_error& e) {
    ADD_FAILURE() << "trim after the replays threw: " << e.what();
  }
  void* p = nullptr;
  try {
    p = pool.allocate(64 * MiB);
  } catch (const cuda_error& e) {
    ADD_FAILURE() << "allocate after the replays threw: " << e.what();
  }
  if (p != nullptr) pool.deallocate(p, 64 * MiB);
}

// --- the shipped real trace ------------------------------------------------------------------

TEST(ReplayRealTrace, TrainingTraceOnTheVmmPagePoolStaysWithinOnePercent) {
  const std::string path = gpumem_test::find_in_source_tree("data/train_llama.csv.gz");
  if (path.empty()) GTEST_SKIP() << gpumem_test::not_in_source_tree("data/train_llama.csv.gz");
  const trace t = load_trace(path);
  EXPECT_EQ(t.format, "pytorch");
  EXPECT_EQ(t.allocs, 16213u);  // shared/traces/README.md
  EXPECT_EQ(t.streams.size(), 1u);
  EXPECT_GT(t.peak_live_bytes, 15 * GiB);
  EXPECT_LT(t.peak_live_bytes, 16 * GiB);

  sim_options so;
  so.capacity = 24 * GiB;  // sparse: untouched pages cost no host memory
  sim_platform sim(so);
  {
    vmm_page_pool pool(sim);
    const replay_result r = replay_trace(t, pool, replay_options{});
    EXPECT_FALSE(r.oom) << r.oom_message;
    EXPECT_EQ(r.allocs, t.allocs);
    EXPECT_EQ(r.frees, t.frees);
    EXPECT_GE(r.fragmentation, 1.0);
    EXPECT_LE(r.fragmentation, 1.02) << "peak reserved " << r.peak_reserved_bytes
                                     << " vs peak live " << r.peak_live_bytes
                                     << " (measured 1.004 when this bound was set)";
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    EXPECT_EQ(pool.stats().live_bytes, 0u);
  }
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
  EXPECT_EQ(sim.validate(), "");
}

// Telemetry must not change what it measures. An observer turns the thread caches off (every
// event passes the pool lock); only small blocks wait in the caches, so the layout with and
// without an observer stays close (unet_sample_seed1 on sim: 1.0102 and 2,235 last-pass maps
// without, 1.0090 and 2,364 with).
struct counting_observer final : pool_observer {
  std::size_t allocs = 0;
  void on_event(const pool_event& e) noexcept override {
    allocs += e.kind == pool_event_kind::alloc ? 1 : 0;
  }
};

TEST(ReplayObserved, AnObserverChangesNeitherTheFragmentationNorTheRemapsMuch) {
  const std::string file = "data/workloads/unet_sample_seed1.csv.gz";
  const std::string path = gpumem_test::find_in_source_tree(file);
  if (path.empty()) GTEST_SKIP() << gpumem_test::not_in_source_tree(file);
  const trace t = load_trace(path);
  auto replay = [&](bool observed, std::size_t* seen) {
    sim_platform sim;
    vmm_page_pool pool(sim, 0, gpumem_test::tight_footprint());  // remaps
    counting_observer watch;
    if (observed) pool.set_observer(&watch);
    replay_options o;
    o.passes = 2;
    const replay_result r = replay_trace(t, pool, o);
    pool.set_observer(nullptr);
    *seen = watch.allocs;
    EXPECT_FALSE(r.oom) << r.oom_message;
    return r;
  };
  std::size_t seen_plain = 0, seen_observed = 0;
  const replay_result plain = replay(false, &seen_plain);
  const replay_result observed = replay(true, &seen_observed);
  EXPECT_EQ(seen_plain, 0u);
  EXPECT_EQ(seen_observed, 2 * t.allocs) << "the observer saw every allocation of both passes";
  EXPECT_NEAR(observed.fragmentation, plain.fragmentation, 0.005);
  const double maps_plain = static_cast<double>(plain.last_pass_driver_calls.at("cuMemMap"));
  const double maps_observed = static_cast<double>(observed.last_pass_driver_calls.at("cuMemMap"));
  EXPECT_LE(maps_plain, 1.5 * maps_observed) << "remaps a pass without an observer";
  EXPECT_LE(maps_observed, 1.5 * maps_plain) << "remaps a pass with an observer";
}

// Workloads unlike the shared traces (data/workloads/README.md): the page pool holds close
// to the live bytes on each, where PyTorch held 1.04-3.38 times them while recording.
// (vit_accum's seed 0, also recorded, is left out: see the list below.)
struct recorded_workload {
  const char* file;
  double pytorch;  // PyTorch's peak reserved / allocated while recording
};

// Test output names the trace, not the parameter's raw bytes.
void PrintTo(const recorded_workload& w, std::ostream* os) { *os << w.file; }

class ReplayRecordedWorkload : public ::testing::TestWithParam<recorded_workload> {};

// footprint:tight (footprint:fast, the default, is a cache within its budget: its figures are
// held by the ctest replay_warm_calls).
TEST_P(ReplayRecordedWorkload, TheTightVmmPagePoolHoldsWithinFivePercentOfTheLiveBytes) {
  const recorded_workload w = GetParam();
  const std::string file = std::string("data/workloads/") + w.file;
  const std::string path = gpumem_test::find_in_source_tree(file);
  if (path.empty()) GTEST_SKIP() << gpumem_test::not_in_source_tree(file);
  const trace t = load_trace(path);
  ASSERT_GT(t.allocs, 1000u);
  sim_options so;
  so.capacity = 48 * GiB;  // gnn_varlen_seed1 peaks at 30 GiB live
  sim_platform sim(so);
  {
    vmm_page_pool pool(sim, 0, gpumem_test::tight_footprint());
    replay_options o;
    // Eight passes, as a longer run of the same steps: a slow drift shows there
    // (ckpt_train_seed2 reached 1.1012 by pass 8 before a huge growth's handles were kept
    // for requests that cover one; 1.0257 after 2 passes).
    o.passes = 8;
    const replay_result r = replay_trace(t, pool, o);
    EXPECT_FALSE(r.oom) << r.oom_message;
    EXPECT_GE(r.fragmentation, 1.0);
    // The recorded workloads replay at 1.0004-1.0374 over 8 passes (sim); 1.05 leaves room
    // for placement changes while still catching a pool that strands pages.
    EXPECT_LE(r.fragmentation, 1.05) << "peak reserved " << r.peak_reserved_bytes
                                     << " vs peak live " << r.peak_live_bytes;
    EXPECT_LT(r.fragmentation, w.pytorch);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    EXPECT_EQ(pool.stats().live_bytes, 0u);
  }
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

INSTANTIATE_TEST_SUITE_P(Workloads, ReplayRecordedWorkload,
                         ::testing::Values(recorded_workload{"ckpt_train.csv.gz", 1.4224},
                                           recorded_workload{"conv_multiscale.csv.gz", 1.7582},
                                           recorded_workload{"encode_varlen.csv.gz", 2.0475},
                                           // The same workloads with other seeds (other
                                           // shapes), and side_stream's two streams.
                                           recorded_workload{"ckpt_train_seed1.csv.gz", 1.7444},
                                           recorded_workload{"ckpt_train_seed2.csv.gz", 1.6175},
                                           recorded_workload{"ckpt_train_seed3.csv.gz", 2.1004},
                                           recorded_workload{"conv_multiscale_seed1.csv.gz", 2.2290},
                                           recorded_workload{"conv_multiscale_seed2.csv.gz", 2.4483},
                                           recorded_workload{"conv_multiscale_seed3.csv.gz", 2.1283},
                                           recorded_workload{"encode_varlen_seed1.csv.gz", 2.2045},
                                           recorded_workload{"encode_varlen_seed2.csv.gz", 1.9518},
                                           recorded_workload{"encode_varlen_seed3.csv.gz", 2.2300},
                                           recorded_workload{"side_stream_seed1.csv.gz", 1.3133},
                                           recorded_workload{"side_stream_seed2.csv.gz", 1.2412},
                                           recorded_workload{"side_stream_seed3.csv.gz", 1.3285},
                                           // Kinds recorded later: data-dependent expert
                                           // sizes, repeated sampling steps, graphs.
                                           recorded_workload{"moe_train.csv.gz", 1.0550},
                                           recorded_workload{"moe_train_seed1.csv.gz", 1.0513},
                                           recorded_workload{"moe_train_seed2.csv.gz", 1.0625},
                                           recorded_workload{"unet_sample.csv.gz", 1.3280},
                                           recorded_workload{"unet_sample_seed1.csv.gz", 1.0532},
                                           recorded_workload{"unet_sample_seed2.csv.gz", 2.2924},
                                           recorded_workload{"gnn_varlen.csv.gz", 1.0411},
                                           recorded_workload{"gnn_varlen_seed1.csv.gz", 2.2965},
                                           recorded_workload{"gnn_varlen_seed2.csv.gz", 3.3814},
                                           recorded_workload{"lstm_varlen.csv.gz", 1.7950},
                                           recorded_workload{"lstm_varlen_seed1.csv.gz", 3.2048},
                                           recorded_workload{"recsys_sparse.csv.gz", 1.1171},
                                           recorded_workload{"recsys_sparse_seed1.csv.gz", 1.2965},
                                           recorded_workload{"vit_accum_seed1.csv.gz", 1.1145},
                                           // Recorded before the rounding rule they led to
                                           // (a tail of at most half a page is not rounded):
                                           // flat FSDP buffers, beams, models loaded and
                                           // dropped, a batch-squared loss.
                                           recorded_workload{"fsdp_layers.csv.gz", 1.1387},
                                           recorded_workload{"fsdp_layers_seed1.csv.gz", 1.0902},
                                           recorded_workload{"beam_search.csv.gz", 1.1990},
                                           recorded_workload{"multi_model_serve.csv.gz", 1.9420},
                                           recorded_workload{"multi_model_serve_seed1.csv.gz", 2.1752},
                                           recorded_workload{"clip_contrastive.csv.gz", 1.3427},
                                           recorded_workload{"clip_contrastive_seed1.csv.gz", 1.2558},
                                           // Recorded after it, replayed before any change:
                                           // adapters on a frozen model, activations saved
                                           // to host memory, a decoder's huge activations.
                                           recorded_workload{"lora_finetune.csv.gz", 1.1013},
                                           recorded_workload{"lora_finetune_seed1.csv.gz", 1.1396},
                                           recorded_workload{"offload_train.csv.gz", 1.1125},
                                           recorded_workload{"offload_train_seed1.csv.gz", 1.1145},
                                           recorded_workload{"vae_decode.csv.gz", 1.7220},
                                           recorded_workload{"vae_decode_seed1.csv.gz", 2.0304}),
                         // Not vit_accum (seed 0): vmm_page_pool holds 1.0458 there over 8
                         // passes, under the bound but over PyTorch's 1.0339 of allocated
                         // bytes, an open problem (data/workloads/README.md).
                         [](const ::testing::TestParamInfo<recorded_workload>& i) {
                           std::string n = i.param.file;
                           return n.substr(0, n.find('.'));
                         });

}  // namespace
