// replay/torch_snapshot.hpp: a PyTorch memory snapshot pickle read as trace CSV, and every
// malformed input (truncated anywhere, code-running opcodes, not a snapshot) refused with a
// typed error naming the file.
#include <gtest/gtest.h>

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

std::string refusal(const std::string& bytes) {
  try {
    (void)gpumem::torch_snapshot_to_trace_csv(bytes, "snap.pickle");
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

}  // namespace
