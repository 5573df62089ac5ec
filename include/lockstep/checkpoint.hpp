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

#include "lockstep/backend.hpp"
#include "lockstep/errors.hpp"
#include "lockstep/synchronize.hpp"
#include "lockstep/tensor.hpp"
#include "lockstep/traverse.hpp"

namespace lockstep {

/// A checkpoint file is unreadable, corrupted, truncated, or does not fit what it is loaded into.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// Named tensors (in file order) and string metadata: what one checkpoint file holds.
/// Move-only like Tensor. A moved-from Checkpoint is empty (no tensors, no metadata) and usable;
/// self-move keeps it as it is.
struct Checkpoint {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;

  Checkpoint() = default;
  Checkpoint(Checkpoint&& other) noexcept
      : tensors(std::move(other.tensors)), metadata(std::move(other.metadata)) {
    other.tensors.clear();
    other.metadata.clear();
  }
  Checkpoint& operator=(Checkpoint&& other) noexcept {
    if (this != &other) {
      tensors = std::move(other.tensors);
      metadata = std::move(other.metadata);
      other.tensors.clear();
      other.metadata.clear();
    }
    return *this;
  }
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

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

// ---- Traversable structures (model, optimizer state, scalars) by leaf path ----------------
//
// Each leaf of a structure is stored under its leaf path (see traverse.hpp), prefixed:
// add_to_checkpoint(ck, model, "model") stores model.w1 as "model.w1". Arithmetic scalars
// become 0-d tensors: float F32, double F64, bool and uint8 U8, other integers of up to 32 bits
// I32, wider integers I64 (unsigned values round-trip bit for bit through the cast).

namespace detail {

template <class S>
constexpr DType scalar_checkpoint_dtype() {
  if constexpr (std::is_same_v<S, float>) return DType::f32;
  else if constexpr (std::is_same_v<S, double> || std::is_same_v<S, long double>) return DType::f64;
  else if constexpr (std::is_same_v<S, bool> || std::is_same_v<S, std::uint8_t>) return DType::u8;
  else if constexpr (std::is_signed_v<S> && sizeof(S) <= 4) return DType::i32;
  else if constexpr (std::is_unsigned_v<S> && sizeof(S) < 4) return DType::i32;
  else return DType::i64;
}

/// prefix + path joined the way paths are: "model" + "w1" is "model.w1", "opt" + "[0]" is "opt[0]".
std::string join_leaf_name(std::string_view prefix, std::string_view path);

/// Throws CheckpointError naming `name` if `t` does not have `dtype` and `shape`.
void check_checkpoint_leaf(const std::string& name, const Tensor& t, DType dtype, const Shape& shape);

/// Throws CheckpointError if ck holds a tensor under `prefix` whose name is not in `used`.
void check_no_extra_leaves(const Checkpoint& ck, std::string_view prefix,
                           const std::vector<std::string>& used);

/// Root broadcasts `error` (empty: success) to every rank; returns it on every rank.
std::string broadcast_status(Backend& backend, std::string error, int root);

/// Root broadcasts `meta` to every rank; returns it on every rank.
std::map<std::string, std::string> broadcast_metadata(Backend& backend,
                                                      const std::map<std::string, std::string>& meta,
                                                      int root);

}  // namespace detail

/// Adds every leaf of x to ck as prefix.path. Host tensors are added as views that share their
/// memory and keep it alive (a tensor that itself borrows memory is borrowed: that memory must
/// outlive ck), device tensors copied to the host, scalars stored as 0-d tensors.
template <class X>
void add_to_checkpoint(Checkpoint& ck, const X& x, std::string_view prefix = "") {
  for_each_leaf_with_path(x, [&](const std::string& path, const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    std::string name = detail::join_leaf_name(prefix, path);
    if constexpr (std::is_same_v<L, Tensor>) {
      if (leaf.device().is_cpu())
        ck.add(std::move(name), leaf.reshape_view(leaf.shape()));
      else
        ck.add(std::move(name), leaf.to(Device::cpu()));
    } else {
      constexpr DType dt = detail::scalar_checkpoint_dtype<L>();
      Tensor t = Tensor::empty(Shape{}, dt);
      if constexpr (dt == DType::f32) *t.data<float>() = static_cast<float>(leaf);
      else if constexpr (dt == DType::f64) *t.data<double>() = static_cast<double>(leaf);
      else if constexpr (dt == DType::u8) *t.data<std::uint8_t>() = static_cast<std::uint8_t>(leaf);
      else if constexpr (dt == DType::i32) *t.data<std::int32_t>() = static_cast<std::int32_t>(leaf);
      else *t.data<std::int64_t>() = static_cast<std::int64_t>(leaf);
      ck.add(std::move(name), std::move(t));
    }
  });
}

/// Copies the tensors named prefix.path in ck into the leaves of x. All or nothing: first every
/// leaf is checked (present, same dtype and shape) and no extra tensor may exist under prefix,
/// else CheckpointError naming the leaf ("checkpoint from a different model?"); then values are
/// copied.
template <class X>
void restore_from_checkpoint(const Checkpoint& ck, X& x, std::string_view prefix = "") {
  std::vector<std::string> used;
  for_each_leaf_with_path(std::as_const(x), [&](const std::string& path, const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    std::string name = detail::join_leaf_name(prefix, path);
    const Tensor* t = ck.find(name);
    if (t == nullptr)
      throw CheckpointError("checkpoint: has no tensor \"" + name +
                            "\" that the structure being restored needs (checkpoint from a "
                            "different model?)");
    if constexpr (std::is_same_v<L, Tensor>)
      detail::check_checkpoint_leaf(name, *t, leaf.dtype(), leaf.shape());
    else
      detail::check_checkpoint_leaf(name, *t, detail::scalar_checkpoint_dtype<L>(), Shape{});
    used.push_back(std::move(name));
  });
  detail::check_no_extra_leaves(ck, prefix, used);
  std::size_t i = 0;
  for_each_leaf(x, [&](auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    const Tensor& t = *ck.find(used[i++]);
    if constexpr (std::is_same_v<L, Tensor>) {
      leaf.copy_from(t.view());
    } else {
      constexpr DType dt = detail::scalar_checkpoint_dtype<L>();
      if constexpr (dt == DType::f32) leaf = static_cast<L>(*t.data<float>());
      else if constexpr (dt == DType::f64) leaf = static_cast<L>(*t.data<double>());
      else if constexpr (dt == DType::u8) leaf = static_cast<L>(*t.data<std::uint8_t>());
      else if constexpr (dt == DType::i32) leaf = static_cast<L>(*t.data<std::int32_t>());
      else leaf = static_cast<L>(*t.data<std::int64_t>());
    }
  });
}

// ---- Rank-aware save and resume ---------------------------------------------------------
//
// Collectives: every rank of `backend` calls them. Only `root` touches the file; its outcome is
// broadcast first, so a failure there (disk full, corrupted file, different model) becomes the
// same CheckpointError on every rank instead of a hang in the next collective.

namespace detail {
/// Message of the exception being handled, for broadcasting (never empty).
std::string current_error_message();
/// Throws CheckpointError(msg) on every rank, saying on non-root ranks that root reported it.
[[noreturn]] void throw_root_error(const Backend& backend, const std::string& msg, int root);
}  // namespace detail

/// Root writes every leaf of x (and `metadata`) to `path` atomically; a collective. Every rank
/// returns, or every rank throws the same CheckpointError.
template <class X>
void save_checkpoint(Backend& backend, const std::filesystem::path& path, const X& x,
                     const std::map<std::string, std::string>& metadata = {}, int root = 0) {
  detail::check_root(backend, root, "save_checkpoint");
  std::string err;
  if (backend.rank() == root) {
    try {
      Checkpoint ck;
      ck.metadata = metadata;
      add_to_checkpoint(ck, x);
      save_checkpoint(path, ck);
    } catch (...) {
      err = detail::current_error_message();
    }
  }
  err = detail::broadcast_status(backend, std::move(err), root);
  if (!err.empty()) detail::throw_root_error(backend, err, root);
}

/// Resume: root reads `path`, verifies it (checksum, and that it matches x leaf for leaf) and
/// restores x; then x is synchronized from root to every rank. Returns the metadata on every
/// rank. A collective; on any failure every rank throws the same CheckpointError and x is left
/// unchanged on every rank.
template <class X>
std::map<std::string, std::string> load_checkpoint(Backend& backend, const std::filesystem::path& path,
                                                   X& x, int root = 0,
                                                   const CheckpointReadOptions& opts = {}) {
  detail::check_root(backend, root, "load_checkpoint");
  std::string err;
  std::map<std::string, std::string> meta;
  if (backend.rank() == root) {
    try {
      Checkpoint ck = load_checkpoint(path, opts);
      restore_from_checkpoint(ck, x);
      meta = std::move(ck.metadata);
    } catch (...) {
      err = detail::current_error_message();
    }
  }
  err = detail::broadcast_status(backend, std::move(err), root);
  if (!err.empty()) detail::throw_root_error(backend, err, root);
  synchronize(backend, x, root);
  return detail::broadcast_metadata(backend, meta, root);
}

}  // namespace lockstep
