#include <array>

#include "gpumem/kv/tier/redis_store.hpp"

namespace gpumem {

namespace {
// CRC16-CCITT (XMODEM): polynomial 0x1021, initial value 0, no reflection.
constexpr std::array<std::uint16_t, 256> make_crc16_table() {
  std::array<std::uint16_t, 256> t{};
  for (unsigned i = 0; i < 256; ++i) {
    std::uint16_t c = static_cast<std::uint16_t>(i << 8);
    for (int b = 0; b < 8; ++b)
      c = static_cast<std::uint16_t>((c & 0x8000) ? (c << 1) ^ 0x1021 : c << 1);
    t[i] = c;
  }
  return t;
}
constexpr auto crc16_table = make_crc16_table();

std::uint16_t crc16(std::string_view s) noexcept {
  std::uint16_t c = 0;
  for (unsigned char ch : s)
    c = static_cast<std::uint16_t>((c << 8) ^ crc16_table[((c >> 8) ^ ch) & 0xff]);
  return c;
}
}  // namespace

std::uint16_t redis_key_slot(std::string_view key) noexcept {
  if (auto open = key.find('{'); open != std::string_view::npos) {
    auto close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1)
      key = key.substr(open + 1, close - open - 1);
  }
  return static_cast<std::uint16_t>(crc16(key) & 16383);
}

}  // namespace gpumem
