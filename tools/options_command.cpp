// gpumem options: every pool option (GPUMEM_CONF / --config key) with its default, what it
// trades and an example, from the one option table (gpumem/pool/option_table.hpp).
// --markdown prints docs/OPTIONS.md exactly.
#include <iostream>

#include "args.hpp"
#include "commands.hpp"
#include "gpumem/pool/option_table.hpp"

namespace gpumem::cli {

int run_options(int argc, char** argv) {
  arg_parser parser("gpumem options",
                    "list every pool option (GPUMEM_CONF, --config) with its default");
  parser.flag("markdown", "print the table as Markdown (the text of docs/OPTIONS.md)")
      .epilog("Example:\n  GPUMEM_CONF=growth_slack:0.03,scrub:on gpumem replay TRACE\n");
  const parsed_args args = parser.parse(argc, argv);
  if (args.help_requested()) {
    std::cout << parser.help();
    return 0;
  }
  std::cout << (args.has("markdown") ? pool_options_markdown() : pool_options_text());
  return 0;
}

}  // namespace gpumem::cli
