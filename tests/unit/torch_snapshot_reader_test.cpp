// replay/torch_snapshot.hpp: a PyTorch memory snapshot pickle read as trace CSV, and every
// malformed input (truncated anywhere, code-running opcodes, not a snapshot) refused with a
// typed error naming the file.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "gpumem/errors.hpp"
#include "gpumem/replay/torch_snapshot.hpp"
#include "gpumem/replay/trace.hpp"

namespace {

// pickle.dumps(protocol=4) of a snapshot whose device 0 trace is: alloc 512 B at 0x1000
// (with a frame whose line is negative), free_requested and free_completed of it, and an
// alloc of 3 GiB at 2^47 on stream 7 carrying a float, None and a tuple besides.
const std::string snapshot_v4(
    "\x80\x04\x95\x47\x01\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x08\x73\x65\x67\x6d\x65\x6e\x74\x73\x94\x5d\x94\x8c\x0d\x64\x65\x76\x69\x63\x65\x5f\x74\x72\x61\x63\x65\x73\x94\x5d\x94\x5d\x94\x28\x7d\x94\x28\x8c\x06\x61\x63\x74\x69\x6f\x6e\x94\x8c\x05\x61\x6c\x6c\x6f\x63\x94\x8c\x04\x61\x64\x64\x72\x94\x4d\x00\x10\x8c\x04\x73\x69\x7a\x65\x94\x4d\x00\x02\x8c\x06\x73\x74\x72\x65\x61\x6d\x94\x4b\x00\x8c\x07\x74\x69\x6d\x65\x5f\x75\x73\x94\x4b\x0a\x8c\x06\x66\x72\x61\x6d\x65\x73\x94\x5d\x94\x7d\x94\x28\x8c\x08\x66\x69\x6c\x65\x6e\x61\x6d\x65\x94\x8c\x04\x61\x2e\x70\x79\x94\x8c\x04\x6c\x69\x6e\x65\x94\x4a\xfd\xff\xff\xff\x8c\x04\x6e\x61\x6d\x65\x94\x8c\x01\x66\x94\x75\x61\x75\x7d\x94\x28\x68\x07\x8c\x0e\x66\x72\x65\x65\x5f\x72\x65\x71\x75\x65\x73\x74\x65\x64\x94\x68\x09\x4d\x00\x10\x68\x0a\x4d\x00\x02\x68\x0b\x4b\x00\x68\x0c\x4b\x0b\x68\x0d\x5d\x94\x75\x7d\x94\x28\x68\x07\x8c\x0e\x66\x72\x65\x65\x5f\x63\x6f\x6d\x70\x6c\x65\x74\x65\x64\x94\x68\x09\x4d\x00\x10\x68\x0a\x4d\x00\x02\x68\x0b\x4b\x00\x68\x0c\x4b\x0c\x68\x0d\x5d\x94\x75\x7d\x94\x28\x68\x07\x68\x08\x68\x09\x8a\x07\x00\x00\x00\x00\x00\x80\x00\x68\x0a\x8a\x05\x00\x00\x00\xc0\x00\x68\x0b\x4b\x07\x68\x0c\x8a\x07\x00\x40\x1e\x18\x24\x0a\x06\x8c\x01\x78\x94\x47\x3f\xf8\x00\x00\x00\x00\x00\x00\x8c\x01\x79\x94\x4e\x8c\x01\x7a\x94\x4b\x01\x4b\x02\x86\x94\x68\x0d\x5d\x94\x75\x65\x61\x75\x2e",
    338);

std::string refusal(const std::string& bytes, std::uint64_t max_memory = std::uint64_t{4} << 30,
                    std::uint64_t max_csv_bytes = std::uint64_t{2} << 30) {
  try {
    (void)gpumem::torch_snapshot_to_trace_csv(bytes, "snap.pickle", -1, max_memory, max_csv_bytes);
  } catch (const gpumem::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(TorchSnapshotReader, TheDeviceTraceBecomesTraceCsv) {
  ASSERT_TRUE(gpumem::looks_like_pickle(snapshot_v4));
  EXPECT_EQ(gpumem::torch_snapshot_to_trace_csv(snapshot_v4, "snap.pickle"),
            "action,addr,size,stream,time_us\n"
            "alloc,4096,512,0,10\n"
            "free_completed,4096,512,0,12\n"
            "alloc,140737488355328,3221225472,7,1700000000000000\n");
  const gpumem::trace t = gpumem::parse_trace(
      gpumem::torch_snapshot_to_trace_csv(snapshot_v4, "snap.pickle"), "snap.pickle");
  EXPECT_EQ(t.events.size(), 3u);
  EXPECT_EQ(t.frees, 1u);
}

TEST(TorchSnapshotReader, EveryTruncationIsRefusedNamingTheFile) {
  for (std::size_t n = 0; n < snapshot_v4.size(); ++n) {
    const std::string why = refusal(snapshot_v4.substr(0, n));
    EXPECT_NE(why.find("torch snapshot 'snap.pickle'"), std::string::npos) << n << ": " << why;
  }
}

TEST(TorchSnapshotReader, CodeRunningOpcodesAndOtherShapesAreRefused) {
  // pickle of a class instance: GLOBAL ('c') would import and run code.
  const std::string global("\x80\x02" "cos\nsystem\n" "q\x00.", 16);
  EXPECT_NE(refusal(global).find("pickle opcode 0x63 at byte 2 is not plain data"),
            std::string::npos) << refusal(global);
  EXPECT_NE(refusal(std::string("\x80\x02]q\x00.", 6)).find("not a PyTorch memory snapshot"),
            std::string::npos);
  // A snapshot recorded without history: segments, no device_traces.
  const std::string no_trace("\x80\x02}q\x00X\x08\x00\x00\x00segmentsq\x01]q\x02s.", 25);
  EXPECT_NE(refusal(no_trace).find("_record_memory_history"), std::string::npos) << refusal(no_trace);
  EXPECT_FALSE(gpumem::looks_like_pickle("action,addr,size\n"));
  // A memo index that was never stored.
  EXPECT_NE(refusal(std::string("\x80\x02h\x05.", 5)).find("memo index never stored"),
            std::string::npos);
}

std::string repeat(const std::string& s, std::size_t n) {
  std::string out;
  out.reserve(s.size() * n);
  for (std::size_t k = 0; k < n; ++k) out += s;
  return out;
}

TEST(TorchSnapshotReader, DeepNestingIsRefusedAndNothingRecurses) {
  // A 1 MB pickle of tuples nested a million deep (TUPLE1 over and over): refused at the
  // bound, and freed without a recursion as deep as the input.
  const std::string tuples = std::string("\x80\x02)") + std::string(1'000'000, '\x85') + ".";
  const std::string why = refusal(tuples);
  EXPECT_NE(why.find("torch snapshot 'snap.pickle': values nested more than 100 deep"),
            std::string::npos) << why;
  // Lists nested by APPEND, dicts by SETITEM, and a list appended to itself (a cycle).
  const std::string lists = std::string("\x80\x02") + std::string(200'000, ']') +
                            std::string(199'999, 'a') + ".";
  EXPECT_NE(refusal(lists).find("nested more than 100 deep"), std::string::npos) << refusal(lists);
  const std::string dicts = std::string("\x80\x02}") + repeat("N}", 5000) + repeat("s", 5000) + ".";
  EXPECT_NE(refusal(dicts).find("nested more than 100 deep"), std::string::npos) << refusal(dicts);
  const std::string cycle = std::string("\x80\x02]q\x00", 5) + repeat(std::string("h\x00" "a", 3), 500) + ".";
  EXPECT_NE(refusal(cycle).find("nested more than 100 deep"), std::string::npos) << refusal(cycle);
  // Within the bound, nesting is read (and the result is no snapshot).
  const std::string ninety = std::string("\x80\x02)") + std::string(90, '\x85') + ".";
  EXPECT_NE(refusal(ninety).find("not a PyTorch memory snapshot"), std::string::npos) << refusal(ninety);
}

TEST(TorchSnapshotReader, IndicesAndLengthsAreCheckedBeforeAnythingIsAllocated) {
  constexpr std::uint64_t budget = 4 << 20;  // far below what any of these would take unchecked
  // A 9-byte pickle storing None at memo index 2^26-1, then at 2^32-1.
  EXPECT_NE(refusal(std::string("\x80\x02Nr\xff\xff\xff\x03.", 9), budget).find("not a PyTorch"),
            std::string::npos) << refusal(std::string("\x80\x02Nr\xff\xff\xff\x03.", 9), budget);
  EXPECT_NE(refusal(std::string("\x80\x02Nr\xff\xff\xff\xff\x94.", 10), budget).find("not a PyTorch"),
            std::string::npos);
  EXPECT_NE(refusal(std::string("\x80\x02j\xff\xff\xff\xff.", 8), budget).find("memo index never stored (4294967295)"),
            std::string::npos);
  // Lengths of text, bytes and frames past the data's end.
  for (const std::string& op : {std::string("\x8d\xff\xff\xff\xff\xff\xff\xff\x7f", 9),
                                std::string("\x8e\xff\xff\xff\xff\xff\xff\xff\xff", 9),
                                std::string("X\xff\xff\xff\xff", 5), std::string("T\xff\xff\xff\x7f", 5),
                                std::string("\x95\xff\xff\xff\xff\xff\xff\xff\xff", 9),
                                std::string("\x8b\xff\xff\xff\xff", 5)}) {
    const std::string why = refusal(std::string("\x80\x04", 2) + op + "abc.", budget);
    EXPECT_TRUE(why.find("truncated") != std::string::npos || why.find("past the end") != std::string::npos ||
                why.find("wider than 64 bits") != std::string::npos)
        << why;
  }
}

TEST(TorchSnapshotReader, MemoryAndTextAreBoundedNamingTheLimit) {
  // Values past the memory budget: 100,000 empty lists.
  const std::string many = std::string("\x80\x02(") + std::string(100'000, ']') + "t.";
  const std::string why = refusal(many, 1 << 20);
  EXPECT_NE(why.find("torch snapshot 'snap.pickle': its values take more than 1.00 MiB"),
            std::string::npos) << why;
  // One alloc entry referenced 100,000 times through the memo (2 bytes each): the trace
  // text it makes stops at its limit.
  std::string snap = "\x80\x02}(\x8c\x08segments]\x8c\x0d" "device_traces]](";
  snap += std::string("}(\x8c\x06" "action\x8c\x05" "alloc\x8c\x04" "addrK\x01\x8c\x04" "sizeK\x02\x8c\x06" "streamK\x00uq\x07", 46);
  snap += repeat("h\x07", 100'000) + "eau.";
  const std::string text = refusal(snap, std::uint64_t{1} << 30, 64 << 10);
  EXPECT_NE(text.find("its trace is more than 64.00 KiB of trace text"), std::string::npos) << text;
  // The same snapshot is read whole within the default limits, each entry's line made once.
  EXPECT_EQ(gpumem::torch_snapshot_to_trace_csv(snap, "snap.pickle").size(),
            std::string("action,addr,size,stream,time_us\n").size() + 100'001 * std::string("alloc,1,2,0,\n").size());
}

}  // namespace
