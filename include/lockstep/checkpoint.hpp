// Checkpoints: named tensors plus string metadata in the safetensors format, so Python tools
// (safetensors, numpy) can read what Lockstep writes.
//
// File layout (all integers little-endian):
//   8 bytes    N, the length of the JSON header in bytes
//   N bytes    JSON: {"name": {"dtype": "F32", "shape": [256, 1], "data_offsets": [b, e]}, ...,
//                     "__metadata__": {"key": "value", ...}}  (padded with spaces to 8 bytes)
//   the rest   raw tensor data; data_offsets are relative to the first byte after the header
//
// Lockstep adds two metadata keys: "lockstep.format" ("1") and "lockstep.checksum"
// ("crc32c:" + 8 hex digits over the data and a canonical form of the header: names, dtypes,
// shapes, offsets and the other metadata), so a flipped bit anywhere that matters is caught. Files are written atomically (temporary file in the same directory, fsync,
// rename, fsync of the directory): a crash mid-write leaves the previous checkpoint intact.
//
// The reader trusts nothing: header length against file size, a strict JSON parser, dtypes,
// shapes against byte counts, offsets ordered, contiguous and in range, and the checksum. Every
// problem is a CheckpointError naming it. parse_checkpoint() works on bytes in memory, for
// fuzzing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lockstep/errors.hpp"
#include "lockstep/tensor.hpp"

namespace lockstep {

/// A checkpoint file is unreadable, corrupted, truncated, or does not fit what it is loaded into.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// Named tensors (in file order) and string metadata: what one checkpoint file holds.
/// Move-only like Tensor.
struct Checkpoint {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;

  /// Appends a tensor; throws InvalidArgument if the name is empty, starts with "__" or is taken.
  void add(std::string name, Tensor t);
  /// The tensor called `name`, or nullptr.
  const Tensor* find(std::string_view name) const noexcept;
  Tensor* find(std::string_view name) noexcept;
  /// The tensor called `name`; throws CheckpointError if there is none.
  const Tensor& at(std::string_view name) const;
  Tensor& at(std::string_view name);
};

/// How strictly parse_checkpoint() treats files from other writers.
struct CheckpointReadOptions {
  /// Refuse a file without "lockstep.checksum" (files written by other safetensors tools have
  /// none; set false to read them).
  bool require_checksum = true;
};

/// The metadata key holding the checksum, and the one holding the format version.
inline constexpr std::string_view kChecksumKey = "lockstep.checksum";
inline constexpr std::string_view kFormatKey = "lockstep.format";

/// CRC-32C (Castagnoli) of `bytes`, continuing from `crc` (0 to start).
std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept;

/// The safetensors bytes of `ck` (CPU tensors of any dtype; the checksum and format keys are
/// added to the metadata). Throws InvalidArgument for a device tensor or a reserved/invalid name.
std::vector<std::byte> serialize_checkpoint(const Checkpoint& ck);

/// Parses and validates safetensors bytes; throws CheckpointError naming the first problem.
/// Never reads outside `bytes`, whatever they hold (this is the fuzzing entry point).
Checkpoint parse_checkpoint(std::span<const std::byte> bytes, const CheckpointReadOptions& opts = {});

/// Writes `ck` to `path` atomically (temp file in the same directory, fsync, rename, fsync dir).
/// Throws CheckpointError (with the OS error) if any step fails; the old file is then untouched.
void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ck);

/// Reads and validates the checkpoint at `path`; throws CheckpointError.
Checkpoint load_checkpoint(const std::filesystem::path& path, const CheckpointReadOptions& opts = {});

/// Writes `bytes` to `path` atomically (the primitive behind save_checkpoint).
void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes);

/// "F32", "BF16", ...: the safetensors name of a dtype.
const char* safetensors_dtype_name(DType t) noexcept;
/// The dtype for a safetensors name, or nullopt for one Lockstep does not support.
std::optional<DType> dtype_from_safetensors_name(std::string_view name) noexcept;

}  // namespace lockstep
