// CRC-32C (Castagnoli): the polynomial storage systems use (iSCSI, ext4, leveldb), which detects
// more error patterns at checkpoint lengths than zlib's. Two implementations give the same
// results: the SSE4.2 CRC32 instruction, used when the CPU has it, and slice-by-8 tables.
#include "io/crc32c.hpp"

#include <array>
#include <cstring>

#include "lockstep/io/checkpoint.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define LOCKSTEP_CRC_X86 1
#endif

namespace lockstep {
namespace detail {
namespace {

constexpr std::uint32_t kCrcPoly = 0x82F63B78u;  // reflected 0x1EDC6F41

struct CrcTables {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  constexpr CrcTables() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kCrcPoly : (c >> 1);
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
  }
};
constexpr CrcTables kCrc{};

#if LOCKSTEP_CRC_X86
// The instruction has a latency of three cycles and a throughput of one per cycle, so one chain
// of CRC32 instructions uses a third of what the core can do. Three chains run side by side over
// three consecutive blocks of kBlock bytes and are combined at the end of each block: the CRC
// register is linear over GF(2), so the register of A followed by B is the register of A
// advanced over |B| zero bytes, xor the register of B started from zero. Advancing over kBlock
// zero bytes is itself linear in the 32 register bits: four 256-entry tables, built once.
constexpr std::size_t kBlock = 8192;

struct ShiftTables {
  std::array<std::array<std::uint32_t, 256>, 4> t{};
  ShiftTables() {
    // The image of each of the 32 register bits, advanced over kBlock zero bytes.
    std::array<std::uint32_t, 32> basis{};
    for (int bit = 0; bit < 32; ++bit) {
      std::uint32_t c = 1u << bit;
      for (std::size_t i = 0; i < kBlock; ++i) c = (c >> 8) ^ kCrc.t[0][c & 0xFFu];
      basis[static_cast<std::size_t>(bit)] = c;
    }
    for (int k = 0; k < 4; ++k)
      for (std::uint32_t b = 0; b < 256; ++b) {
        std::uint32_t v = 0;
        for (int j = 0; j < 8; ++j)
          if (b & (1u << j)) v ^= basis[static_cast<std::size_t>(8 * k + j)];
        t[static_cast<std::size_t>(k)][b] = v;
      }
  }
  std::uint32_t advance(std::uint32_t c) const noexcept {
    return t[0][c & 0xFFu] ^ t[1][(c >> 8) & 0xFFu] ^ t[2][(c >> 16) & 0xFFu] ^ t[3][c >> 24];
  }
};

const ShiftTables& shift_tables() {
  static const ShiftTables s;
  return s;
}

std::uint64_t load64(const unsigned char* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
#endif

using CrcFn = std::uint32_t (*)(const std::byte*, std::size_t, std::uint32_t) noexcept;

CrcFn pick() noexcept {
  if (crc32c_hardware_available()) {
#if LOCKSTEP_CRC_X86
    (void)shift_tables();  // built here, once, rather than on the first long input
#endif
    return &crc32c_hardware;
  }
  return &crc32c_table;
}

}  // namespace

std::uint32_t crc32c_table(const std::byte* data, std::size_t n, std::uint32_t crc) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  crc = ~crc;
  while (n >= 8) {
    // Byte-wise loads keep this independent of alignment and host byte order.
    const std::uint32_t lo = crc ^ (std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 |
                                    std::uint32_t{p[2]} << 16 | std::uint32_t{p[3]} << 24);
    crc = kCrc.t[7][lo & 0xFF] ^ kCrc.t[6][(lo >> 8) & 0xFF] ^ kCrc.t[5][(lo >> 16) & 0xFF] ^
          kCrc.t[4][lo >> 24] ^ kCrc.t[3][p[4]] ^ kCrc.t[2][p[5]] ^ kCrc.t[1][p[6]] ^
          kCrc.t[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ kCrc.t[0][(crc ^ *p++) & 0xFF];
  return ~crc;
}

bool crc32c_hardware_available() noexcept {
#if LOCKSTEP_CRC_X86
  __builtin_cpu_init();  // idempotent; needed if the first call comes from a static initialiser
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

#if LOCKSTEP_CRC_X86
__attribute__((target("sse4.2"))) std::uint32_t crc32c_hardware(const std::byte* data, std::size_t n,
                                                                 std::uint32_t crc) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  std::uint64_t c = ~crc;
  c &= 0xFFFFFFFFu;
  // Bytes up to an 8-byte boundary, so that the wide loads below are aligned.
  while (n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0) {
    c = _mm_crc32_u8(static_cast<std::uint32_t>(c), *p++);
    --n;
  }
  if (n >= 3 * kBlock) {
    const ShiftTables& shift = shift_tables();
    while (n >= 3 * kBlock) {
      std::uint64_t c1 = 0, c2 = 0;
      for (std::size_t i = 0; i < kBlock; i += 8) {
        c = _mm_crc32_u64(c, load64(p + i));
        c1 = _mm_crc32_u64(c1, load64(p + kBlock + i));
        c2 = _mm_crc32_u64(c2, load64(p + 2 * kBlock + i));
      }
      const std::uint32_t ab = shift.advance(static_cast<std::uint32_t>(c)) ^ static_cast<std::uint32_t>(c1);
      c = shift.advance(ab) ^ static_cast<std::uint32_t>(c2);
      p += 3 * kBlock;
      n -= 3 * kBlock;
    }
  }
  while (n >= 8) {
    c = _mm_crc32_u64(c, load64(p));
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = _mm_crc32_u8(static_cast<std::uint32_t>(c), *p++);
  return ~static_cast<std::uint32_t>(c);
}
#else
std::uint32_t crc32c_hardware(const std::byte* data, std::size_t n, std::uint32_t crc) noexcept {
  return crc32c_table(data, n, crc);  // never chosen: crc32c_hardware_available() is false
}
#endif

const char* crc32c_implementation() noexcept {
  return crc32c_hardware_available() ? "sse4.2" : "table";
}

}  // namespace detail

std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc) noexcept {
  static const detail::CrcFn fn = detail::pick();
  return fn(bytes.data(), bytes.size(), crc);
}

}  // namespace lockstep
