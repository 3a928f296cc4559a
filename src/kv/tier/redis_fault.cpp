// The names of the Redis tier's fault kinds (redis_store.hpp), in builds with and without
// hiredis.
#include "gpumem/kv/tier/redis_store.hpp"

namespace gpumem {

const char* redis_fault_name(redis_fault f) noexcept {
  switch (f) {
    case redis_fault::connect: return "connect";
    case redis_fault::deadline: return "deadline";
    case redis_fault::closed: return "closed";
    case redis_fault::reply_too_large: return "reply_too_large";
    case redis_fault::protocol: return "protocol";
    case redis_fault::unexpected_reply: return "unexpected_reply";
    case redis_fault::error_reply: return "error_reply";
    case redis_fault::redirect: return "redirect";
  }
  return "unknown";
}

}  // namespace gpumem
