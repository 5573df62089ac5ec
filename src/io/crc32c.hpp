// CRC-32C (Castagnoli) implementations behind lockstep::crc32c: the SSE4.2 instruction where the
// CPU has it (chosen once, at the first call), slice-by-8 tables otherwise. Internal: the public
// entry point is lockstep::crc32c in checkpoint.hpp; the tests call both paths directly.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lockstep::detail {

/// The table path: works on every CPU.
std::uint32_t crc32c_table(const std::byte* data, std::size_t n, std::uint32_t crc) noexcept;

/// Whether this CPU has the SSE4.2 CRC32 instruction (false on other architectures).
bool crc32c_hardware_available() noexcept;

/// The SSE4.2 path. Only call it when crc32c_hardware_available() is true.
std::uint32_t crc32c_hardware(const std::byte* data, std::size_t n, std::uint32_t crc) noexcept;

/// Which path lockstep::crc32c takes on this machine: "sse4.2" or "table".
const char* crc32c_implementation() noexcept;

}  // namespace lockstep::detail
