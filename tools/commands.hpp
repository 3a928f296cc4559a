// The gpumem tool's subcommands. Each is `int run_<name>(int argc, char** argv)`:
//  - argv[0] is the subcommand's name ("info"), argv[1..argc) its arguments;
//  - it returns the exit status (0 success, 1 failure);
//  - it throws gpumem::cli::usage_error for a bad command line (main prints it with the
//    usage line, exit 2) and lets gpumem's errors (gpumem::cuda_error, out_of_memory,
//    invalid_argument, any std::exception) propagate: main prints
//    "gpumem: error: <what()>" and exits 1.
//
// To add a subcommand:
//   1. declare its run_<name> below;
//   2. define it in tools/<name>_command.cpp (tools/CMakeLists.txt picks up tools/*.cpp);
//   3. add a row {name, one-line summary, run_<name>} to the `subcommands` table in
//      tools/main.cpp.
// Parse arguments with tools/args.hpp and write --json output with tools/json_writer.hpp.
#pragma once

namespace gpumem::cli {

// gpumem info: the device (or the simulated one) and what gpumem can use of it.
int run_info(int argc, char** argv);

// gpumem replay TRACE: the trace replayed on each allocator, side by side.
int run_replay(int argc, char** argv);

// gpumem serve-sim: KV cache strategies compared on a simulated serving workload.
int run_serve_sim(int argc, char** argv);

// gpumem kv-tier-bench: put/get throughput of the KV tiers, and the device-to-store path.
int run_kv_tier_bench(int argc, char** argv);

// gpumem options: every pool option with its default, what it trades and an example.
int run_options(int argc, char** argv);

}  // namespace gpumem::cli
