// gpumem: the command-line tool. Dispatches `gpumem <command> [args]` to the subcommands
// declared in commands.hpp and turns every exception into a message and an exit status:
//   0 success, 1 failure (any gpumem or std exception: "gpumem: error: <what()>"),
//   2 bad command line (usage on stderr).
#include <algorithm>
#include <exception>
#include <iostream>
#include <string>
#include <string_view>

#include "args.hpp"
#include "commands.hpp"
#include "json_writer.hpp"
#include "gpumem/platform/cuda_platform.hpp"

#ifndef GPUMEM_VERSION_STRING
#define GPUMEM_VERSION_STRING "unknown"
#endif

namespace {

using gpumem::cli::usage_error;

struct subcommand {
  std::string_view name;
  std::string_view summary;
  int (*run)(int argc, char** argv);
};

// Register new subcommands here (declare run_<name> in commands.hpp).
constexpr subcommand subcommands[] = {
    {"info", "show the GPU (or the simulated device) and what gpumem can use of it",
     gpumem::cli::run_info},
    {"replay", "replay a recorded allocation trace on each allocator and compare them",
     gpumem::cli::run_replay},
    {"serve-sim", "simulate LLM serving and compare KV cache memory strategies on one budget",
     gpumem::cli::run_serve_sim},
    {"kv-tier-bench", "throughput of the KV tiers below the GPU (host memory, Redis)",
     gpumem::cli::run_kv_tier_bench},
    {"options", "list every pool option (GPUMEM_CONF, --config) with its default",
     gpumem::cli::run_options},
};

const subcommand* find_subcommand(std::string_view name) {
  for (const auto& c : subcommands)
    if (c.name == name) return &c;
  return nullptr;
}

std::string top_level_help() {
  std::string out =
      "usage: gpumem <command> [options]\n"
      "       gpumem --help | --version\n"
      "\n"
      "gpumem: GPU memory management for large-model training and inference.\n"
      "\n"
      "commands:\n";
  std::size_t width = 0;
  for (const auto& c : subcommands) width = std::max(width, c.name.size());
  for (const auto& c : subcommands) {
    out += "  ";
    out += c.name;
    out += std::string(width - c.name.size() + 3, ' ');
    out += c.summary;
    out += "\n";
  }
  out +=
      "\n"
      "Run 'gpumem <command> --help' for a command's options.\n"
      "\n"
      "environment:\n"
      "  GPUMEM_DEVICE   platform when --device is not given: auto (default: cuda if a\n"
      "                  GPU is present, else sim), cuda or sim\n";
  return out;
}

std::string version_text() {
  std::string out = "gpumem " GPUMEM_VERSION_STRING " (cuda platform ";
  out += gpumem::cuda_platform_compiled() ? "compiled in" : "not compiled in: sim only";
  out += ")\n";
  return out;
}

int dispatch(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << top_level_help();
    return 2;
  }
  const std::string_view first = argv[1];
  if (first == "--help" || first == "-h") {
    std::cout << top_level_help();
    return 0;
  }
  if (first == "--version" || first == "-V") {
    std::cout << version_text();
    return 0;
  }
  if (first == "help") {  // "gpumem help [command]"
    if (argc < 3) {
      std::cout << top_level_help();
      return 0;
    }
    const subcommand* c = find_subcommand(argv[2]);
    if (c == nullptr) throw usage_error("unknown command '" + std::string(argv[2]) + "'");
    char help_flag[] = "--help";
    char* help_argv[] = {argv[2], help_flag, nullptr};
    return c->run(2, help_argv);
  }
  const subcommand* c = find_subcommand(first);
  if (c == nullptr) {
    if (!first.empty() && first[0] == '-')
      throw usage_error("unknown option '" + std::string(first) +
                        "' (options go after the command: gpumem <command> [options])");
    throw usage_error("unknown command '" + std::string(first) + "'");
  }
  return c->run(argc - 1, argv + 1);
}

// With --json a refusal that comes before any output is also one JSON text on stdout, so a
// script that parses stdout reads why instead of nothing.
void json_refusal(int argc, char** argv, const char* what, bool usage) {
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]) == "--json") {
      std::cout << "{\"error\": " << gpumem::cli::json_writer::quote(what)
                << ", \"usage_error\": " << (usage ? "true" : "false") << "}\n";
      std::cout.flush();
      return;
    }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return dispatch(argc, argv);
  } catch (const usage_error& e) {
    std::cout.flush();
    std::cerr << "gpumem: error: " << e.what() << "\n";
    json_refusal(argc, argv, e.what(), true);
    if (!e.usage().empty()) {
      std::cerr << e.usage() << "\n";
      // The usage line starts "usage: gpumem <command>"; point at that command's help.
      const std::string_view command = argc >= 2 ? std::string_view(argv[1]) : "";
      if (find_subcommand(command) != nullptr)
        std::cerr << "Run 'gpumem " << command << " --help' for details.\n";
    } else {
      std::cerr << "\n" << top_level_help();
    }
    return 2;
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "gpumem: error: " << e.what() << "\n";
    json_refusal(argc, argv, e.what(), false);
    return 1;
  } catch (...) {
    std::cout.flush();
    std::cerr << "gpumem: error: unknown exception\n";
    return 1;
  }
}
