// Call sites and the fingerprint hash (call_site.hpp).
#include "lockstep/reliability/call_site.hpp"

#include <cstring>

#include "lockstep/core/errors.hpp"

namespace lockstep::detail {

std::string describe_call_site() {
  const CallSite& s = t_call_site;
  if (!s.known) return "lockstep";
  std::string out = concat(s.op != nullptr ? s.op : "collective", " called at ", where(s.loc));
  if (s.has_outer) out += concat(" (inside the call at ", where(s.outer), ")");
  return out;
}

std::uint64_t hash_bytes(const void* data, std::size_t bytes, std::uint64_t seed) noexcept {
  // Word-at-a-time multiply-xorshift; fast enough to hash a model every few steps.
  constexpr std::uint64_t kMul = 0x9E3779B97F4A7C15ull;
  auto mix = [](std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
  };
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t h = 0x243F6A8885A308D3ull ^ (bytes * kMul) ^ mix(seed);  // mix(0) == 0
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ mix(w)) * kMul;
    h = (h << 27) | (h >> 37);
  }
  if (i < bytes) {
    std::uint64_t w = 0;
    std::memcpy(&w, p + i, bytes - i);
    h = (h ^ mix(w ^ 0xA5)) * kMul;
  }
  return mix(h);
}

}  // namespace lockstep::detail
