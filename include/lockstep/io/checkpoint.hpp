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
#include <source_location>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/comm/consensus.hpp"
#include "lockstep/reliability/call_site.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/train/synchronize.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/core/traverse.hpp"

namespace lockstep {

namespace detail {
/// Checkpoint's index of its names (see Checkpoint::find): name -> position in `tensors`, for
/// the first `covered` entries. Moves with the tensors; its mutex guards lookups.
struct CheckpointNames {
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  std::mutex mutex;
  std::unordered_map<std::string, std::size_t, Hash, std::equal_to<>> pos;
  std::size_t covered = 0;

  CheckpointNames() = default;
  CheckpointNames(CheckpointNames&& o) noexcept : pos(std::move(o.pos)), covered(std::exchange(o.covered, 0)) {
    o.pos.clear();
  }
  CheckpointNames& operator=(CheckpointNames&& o) noexcept {
    pos = std::move(o.pos);
    covered = std::exchange(o.covered, 0);
    o.pos.clear();
    return *this;
  }
};
}  // namespace detail

/// Named tensors (in file order) and string metadata: what one checkpoint file holds.
/// Move-only like Tensor. A moved-from Checkpoint is empty (no tensors, no metadata) and usable;
/// self-move keeps it as it is.
struct Checkpoint {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;

  Checkpoint() = default;
  Checkpoint(Checkpoint&& other) noexcept
      : tensors(std::move(other.tensors)), metadata(std::move(other.metadata)), index_(std::move(other.index_)) {
    other.tensors.clear();
    other.metadata.clear();
  }
  Checkpoint& operator=(Checkpoint&& other) noexcept {
    if (this != &other) {
      tensors = std::move(other.tensors);
      metadata = std::move(other.metadata);
      index_ = std::move(other.index_);
      other.tensors.clear();
      other.metadata.clear();
    }
    return *this;
  }
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  /// Appends a tensor; throws InvalidArgument if the name is empty, starts with "__" or is taken.
  void add(std::string name, Tensor t);
  /// The tensor called `name` (the first one, if `tensors` was given a name twice), or nullptr.
  /// Names are indexed with a hash map, built on first use and extended by what was appended to
  /// `tensors` since (through add or directly): a name that is there is found in O(1). A name
  /// that is not there costs one scan of `tensors`, so that entries renamed, replaced or
  /// removed in `tensors` directly are still seen (the index is then rebuilt).
  [[nodiscard]] const Tensor* find(std::string_view name) const noexcept;
  Tensor* find(std::string_view name) noexcept;
  /// The tensor called `name`; throws CheckpointError if there is none.
  [[nodiscard]] const Tensor& at(std::string_view name) const;
  Tensor& at(std::string_view name);

 private:
  /// Position of `name` in `tensors` (verified against `tensors`), or tensors.size();
  /// `scan_on_miss` confirms a miss with a scan.
  std::size_t position(std::string_view name, bool scan_on_miss) const noexcept;
  mutable detail::CheckpointNames index_;
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
[[nodiscard]] std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept;

/// The safetensors bytes of `ck` (CPU tensors of any dtype; the checksum and format keys are
/// added to the metadata). Throws InvalidArgument for a device tensor or a reserved/invalid name.
[[nodiscard]] std::vector<std::byte> serialize_checkpoint(const Checkpoint& ck);

/// Parses and validates safetensors bytes; throws CheckpointError naming the first problem.
/// Never reads outside `bytes`, whatever they hold (this is the fuzzing entry point).
[[nodiscard]] Checkpoint parse_checkpoint(std::span<const std::byte> bytes, const CheckpointReadOptions& opts = {});

/// Writes `ck` to `path` atomically (temp file in the same directory, fsync, rename, fsync dir).
/// Throws CheckpointError (with the OS error) if any step fails; the old file is then untouched.
void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ck);

/// Reads and validates the checkpoint at `path`; throws CheckpointError.
[[nodiscard]] Checkpoint load_checkpoint(const std::filesystem::path& path, const CheckpointReadOptions& opts = {});

/// Writes `bytes` to `path` atomically (the primitive behind save_checkpoint).
void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes);

namespace detail {
/// What the temporary file of `path` written by process `pid` of this host is called, before
/// mkstemp's six characters: ".NAME.tmp.PID.HOST." (NAME shortened when long). A save removes
/// only such leftovers of this host whose process is gone and whose flock is free.
std::string temporary_file_prefix(const std::filesystem::path& path, long pid);
}  // namespace detail

/// "F32", "BF16", ...: the safetensors name of a dtype.
[[nodiscard]] const char* safetensors_dtype_name(DType t) noexcept;
/// The dtype for a safetensors name, or nullopt for one Lockstep does not support.
[[nodiscard]] std::optional<DType> dtype_from_safetensors_name(std::string_view name) noexcept;

// ---- Traversable structures (model, optimizer state, scalars) by leaf path ----------------
//
// Each leaf of a structure is stored under its leaf path (see traverse.hpp), prefixed:
// add_to_checkpoint(ck, model, "model") stores model.w1 as "model.w1". Arithmetic scalars
// become 0-d tensors: float F32, double F64, bool and uint8 U8, other integers of up to 32 bits
// I32, wider integers I64 (unsigned values round-trip bit for bit through the cast). Scalars no
// safetensors dtype holds exactly are refused with InvalidArgument naming the leaf: long double
// (where it is wider than double, as on x86 and aarch64) and 128-bit integers.

namespace detail {

/// Why a scalar of type S cannot be stored in a checkpoint without loss, or nullptr if it can.
template <class S>
constexpr const char* unstorable_scalar_reason() {
  if constexpr (std::is_floating_point_v<S> &&
                (std::numeric_limits<S>::digits > std::numeric_limits<double>::digits ||
                 std::numeric_limits<S>::max_exponent > std::numeric_limits<double>::max_exponent))
    return std::is_same_v<S, long double>
               ? "a long double, wider than any safetensors dtype (F64 would lose its precision); "
                 "store it as a double"
               : "a floating-point type wider than any safetensors dtype (F64 would lose its "
                 "precision); store it as a double";
  else if constexpr (std::is_integral_v<S> && sizeof(S) > 8)
    return "a 128-bit integer, wider than any safetensors dtype (I64 would truncate it)";
  else
    return nullptr;
}

template <class S>
constexpr DType scalar_checkpoint_dtype() {
  static_assert(unstorable_scalar_reason<S>() == nullptr, "this scalar type has no checkpoint dtype");
  if constexpr (std::is_same_v<S, float>) return DType::f32;
  else if constexpr (std::is_floating_point_v<S>) return DType::f64;  // double (or a double-sized long double)
  else if constexpr (std::is_same_v<S, bool> || std::is_same_v<S, std::uint8_t>) return DType::u8;
  else if constexpr (std::is_signed_v<S> && sizeof(S) <= 4) return DType::i32;
  else if constexpr (std::is_unsigned_v<S> && sizeof(S) < 4) return DType::i32;
  else return DType::i64;
}

/// prefix + path joined the way paths are: "model" + "w1" is "model.w1", "opt" + "[0]" is "opt[0]".
std::string join_leaf_name(std::string_view prefix, std::string_view path);

/// Throws InvalidArgument naming leaf `name` (`what` says which call) if `t` is not a usable
/// tensor: its element count disagrees with its shape, or it has elements but no memory (a
/// moved-from Tensor).
void check_tensor_usable(const char* what, const std::string& name, const Tensor& t);

/// Throws InvalidArgument naming leaf `name` for a scalar type that has no checkpoint dtype.
[[noreturn]] void throw_unstorable_scalar(const char* what, const std::string& name, const char* reason);

/// Checks that every leaf of x can go into (or come out of) a checkpoint: scalar types a
/// checkpoint holds exactly, tensors in a usable state. Throws InvalidArgument naming the leaf.
template <class X>
void check_storable(const char* what, const X& x, std::string_view prefix = "") {
  for_each_leaf_with_path(x, [&](const std::string& path, const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (std::is_same_v<L, Tensor>) {
      check_tensor_usable(what, join_leaf_name(prefix, path), leaf);
    } else if constexpr (unstorable_scalar_reason<L>() != nullptr) {
      throw_unstorable_scalar(what, join_leaf_name(prefix, path), unstorable_scalar_reason<L>());
    }
  });
}

/// Throws CheckpointError naming `name` if `t` does not have `dtype` and `shape`.
void check_checkpoint_leaf(const std::string& name, const Tensor& t, DType dtype, const Shape& shape);
/// The same, for a tensor known by its dtype and shape only.
void check_checkpoint_leaf(const std::string& name, DType file_dtype, const Shape& file_shape, DType dtype,
                           const Shape& shape);

/// Throws CheckpointError if ck holds a tensor under `prefix` whose name is not in `used`.
void check_no_extra_leaves(const Checkpoint& ck, std::string_view prefix,
                           const std::vector<std::string>& used);

/// The tensors of a checkpoint by name (constant-time lookups), built from a Checkpoint (which
/// it borrows) or from a table of contents made by pack_contents() (which it owns: names,
/// dtypes and shapes, no data).
class CheckpointIndex {
 public:
  struct Entry {
    DType dtype;
    const Shape* shape;
    const Tensor* tensor;  // nullptr for an index built from a table of contents
  };
  explicit CheckpointIndex(const Checkpoint& ck);
  /// Throws CheckpointError if `contents` is not what pack_contents() makes.
  static CheckpointIndex from_contents(std::string_view contents);
  CheckpointIndex(CheckpointIndex&&) noexcept = default;
  CheckpointIndex(const CheckpointIndex&) = delete;

  const Entry* find(std::string_view name) const;
  /// Throws CheckpointError naming the first tensor under `prefix` (in file order) whose name is
  /// not in `used`.
  void check_no_extra(std::string_view prefix, const std::vector<std::string>& used) const;

 private:
  CheckpointIndex() = default;
  void build();
  std::vector<std::string> owned_names_;
  std::vector<Shape> owned_shapes_;
  std::vector<std::pair<std::string_view, Entry>> order_;  // file order
  std::unordered_map<std::string_view, std::size_t> by_name_;
};

/// The table of contents of ck (every tensor's name, dtype and shape) and its metadata, packed
/// into bytes for a broadcast; unpack_metadata() and CheckpointIndex::from_contents read it.
std::string pack_contents(const Checkpoint& ck);
std::map<std::string, std::string> unpack_metadata(std::string_view contents);

/// Checks x against the tensors of `index` without writing anything: every leaf of x is there
/// with the same dtype and shape, and no tensor under prefix is left over. Throws
/// CheckpointError ("checkpoint from a different model?") or, for a leaf no checkpoint can hold,
/// InvalidArgument, naming the leaf. Returns the leaf names in traversal order.
template <class X>
std::vector<std::string> check_against_checkpoint(const CheckpointIndex& index, const X& x,
                                                  std::string_view prefix) {
  std::vector<std::string> used;
  for_each_leaf_with_path(x, [&](const std::string& path, const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    std::string name = join_leaf_name(prefix, path);
    if constexpr (std::is_same_v<L, Tensor>) {
      check_tensor_usable("restore_from_checkpoint", name, leaf);
    } else if constexpr (unstorable_scalar_reason<L>() != nullptr) {
      throw_unstorable_scalar("restore_from_checkpoint", name, unstorable_scalar_reason<L>());
    }
    const CheckpointIndex::Entry* e = index.find(name);
    if (e == nullptr)
      throw CheckpointError("checkpoint: has no tensor \"" + name +
                            "\" that the structure being restored needs (checkpoint from a "
                            "different model?)");
    if constexpr (std::is_same_v<L, Tensor>) {
      check_checkpoint_leaf(name, e->dtype, *e->shape, leaf.dtype(), leaf.shape());
    } else if constexpr (unstorable_scalar_reason<L>() == nullptr) {
      check_checkpoint_leaf(name, e->dtype, *e->shape, scalar_checkpoint_dtype<L>(), Shape{});
    }
    used.push_back(std::move(name));
  });
  index.check_no_extra(prefix, used);
  return used;
}

/// Appends `add` to ck's tensors, all or nothing: throws InvalidArgument (and adds none) if a
/// name is empty, reserved, not UTF-8, repeated, or already in ck. Linear in the sizes.
void append_tensors(Checkpoint& ck, std::vector<std::pair<std::string, Tensor>> add);

/// Root broadcasts `meta` to every rank; returns it on every rank.
std::map<std::string, std::string> broadcast_metadata(Backend& backend,
                                                      const std::map<std::string, std::string>& meta,
                                                      int root);

}  // namespace detail

/// Adds every leaf of x to ck as prefix.path. Host tensors are added as views that share their
/// memory and keep it alive (a tensor that itself borrows memory is borrowed: that memory must
/// outlive ck), device tensors copied to the host, scalars stored as 0-d tensors. All or nothing:
/// throws InvalidArgument naming the leaf (and adds nothing) for a scalar no checkpoint dtype
/// holds exactly (long double, 128-bit integers), a moved-from tensor, or a name already in ck.
template <class X>
void add_to_checkpoint(Checkpoint& ck, const X& x, std::string_view prefix = "") {
  detail::check_storable("add_to_checkpoint", x, prefix);
  std::vector<std::pair<std::string, Tensor>> add;
  for_each_leaf_with_path(x, [&](const std::string& path, const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    std::string name = detail::join_leaf_name(prefix, path);
    if constexpr (std::is_same_v<L, Tensor>) {
      if (leaf.device().is_cpu())
        add.emplace_back(std::move(name), leaf.reshape_view(leaf.shape()));
      else
        add.emplace_back(std::move(name), leaf.to(Device::cpu()));
    } else if constexpr (detail::unstorable_scalar_reason<L>() == nullptr) {
      constexpr DType dt = detail::scalar_checkpoint_dtype<L>();
      Tensor t = Tensor::empty(Shape{}, dt);
      if constexpr (dt == DType::f32) *t.data<float>() = static_cast<float>(leaf);
      else if constexpr (dt == DType::f64) *t.data<double>() = static_cast<double>(leaf);
      else if constexpr (dt == DType::u8) *t.data<std::uint8_t>() = static_cast<std::uint8_t>(leaf);
      else if constexpr (dt == DType::i32) *t.data<std::int32_t>() = static_cast<std::int32_t>(leaf);
      else *t.data<std::int64_t>() = static_cast<std::int64_t>(leaf);
      add.emplace_back(std::move(name), std::move(t));
    }
  });
  detail::append_tensors(ck, std::move(add));
}

namespace detail {
/// Copies the tensors named in `used` (check_against_checkpoint's result) into the leaves of x.
template <class X>
void copy_from_checkpoint(const CheckpointIndex& index, const std::vector<std::string>& used, X& x) {
  std::size_t i = 0;
  for_each_leaf(x, [&](auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    const Tensor& t = *index.find(used[i++])->tensor;
    if constexpr (std::is_same_v<L, Tensor>) {
      leaf.copy_from(t.view());
    } else if constexpr (unstorable_scalar_reason<L>() == nullptr) {
      constexpr DType dt = scalar_checkpoint_dtype<L>();
      if constexpr (dt == DType::f32) leaf = static_cast<L>(*t.data<float>());
      else if constexpr (dt == DType::f64) leaf = static_cast<L>(*t.data<double>());
      else if constexpr (dt == DType::u8) leaf = static_cast<L>(*t.data<std::uint8_t>());
      else if constexpr (dt == DType::i32) leaf = static_cast<L>(*t.data<std::int32_t>());
      else leaf = static_cast<L>(*t.data<std::int64_t>());
    }
  });
}
}  // namespace detail

/// Copies the tensors named prefix.path in ck into the leaves of x. All or nothing: first every
/// leaf is checked (present, same dtype and shape) and no extra tensor may exist under prefix,
/// else CheckpointError naming the leaf ("checkpoint from a different model?"); a leaf no
/// checkpoint can hold (long double, a moved-from tensor) is an InvalidArgument naming it; then
/// values are copied. Linear in the number of tensors.
template <class X>
void restore_from_checkpoint(const Checkpoint& ck, X& x, std::string_view prefix = "") {
  const detail::CheckpointIndex index(ck);
  const std::vector<std::string> used = detail::check_against_checkpoint(index, std::as_const(x), prefix);
  detail::copy_from_checkpoint(index, used, x);
}

// ---- Rank-aware save and resume ---------------------------------------------------------
//
// Collectives: every rank of `backend` calls them, with the same root. Only `root` touches the
// file. Before anything is written (the file, or any rank's structure), the ranks agree on a
// verdict with one allgather: a rank whose arguments or structure are unfit makes every rank
// throw the same error. A failure on the root (disk full, corrupted file, different model) is
// broadcast, so it becomes the same CheckpointError on every rank instead of a hang in the next
// collective.

namespace detail {
/// Throws CheckpointError(msg) on every rank, saying on non-root ranks that root reported it.
[[noreturn]] void throw_root_error(const Backend& backend, const std::string& msg, int root);

/// hash_bytes of x's structure signature (what synchronize compares).
template <class X>
std::uint64_t structure_hash(const X& x) {
  const auto sig = describe(x, false);
  return hash_bytes(sig.signature().data(), sig.signature().size());
}

/// Every rank: the structure check synchronize makes (the ranks' structures differ: some rank's
/// signature is not root's), as a CheckpointError on every rank.
template <class X>
[[noreturn]] void throw_structure_mismatch(Backend& backend, const X& x, int root, const char* what) {
  try {
    check_same_structure(backend, describe(x, false).signature(), 0, root, what,
                         [&] { return std::move(describe(x, true).entries()); });
  } catch (const MismatchError& e) {
    throw CheckpointError(std::string("checkpoint: ") + e.what() + "; no rank's structure was modified");
  }
  // Not reached: check_same_structure compares the same hashes agree() found different, and
  // throws on every rank. Refuse anyway, on every rank alike.
  throw CheckpointError(std::string("checkpoint: ") + what + ": the ranks' structure hashes differ");
}
}  // namespace detail

/// Root writes every leaf of x (and `metadata`) to `path` atomically; a collective. First every
/// rank checks its own x (every leaf storable: no long double, no moved-from tensor) and the
/// ranks agree: any problem is the same InvalidArgument on every rank, and nothing is written.
/// Then every rank returns, or every rank throws the same CheckpointError.
template <class X>
void save_checkpoint(Backend& backend, const std::filesystem::path& path, const X& x,
                     const std::map<std::string, std::string>& metadata = {}, int root = 0,
                     std::source_location loc = std::source_location::current()) {
  detail::CallSiteScope site(loc, "save_checkpoint");  // its collectives name this call too
  detail::agree(backend, "save_checkpoint", root,
                detail::verdict_of([&] { detail::check_storable("save_checkpoint", x); }), 0,
                "nothing was written");
  // A sharded optimizer state gathers its shards onto root here (collective), so the file holds
  // what a replicated state would; the guard drops the gathered copy whatever happens next.
  detail::checkpoint_phase(backend, x, root, detail::CheckpointPhase::before_save);
  struct After {
    Backend& b;
    const X& x;
    int root;
    ~After() { detail::checkpoint_phase(b, x, root, detail::CheckpointPhase::after); }
  } after{backend, x, root};
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

/// Resume: root reads `path` and verifies it (checksum, structure) and sends every rank its
/// table of contents (names, dtypes, shapes); every rank checks its own x against it, and the
/// ranks agree, before any rank's x is written. Then root restores x and x is synchronized from
/// root to every rank. Returns the metadata on every rank. A collective; on any failure (the
/// file, or the structure on any rank) every rank throws the same error (CheckpointError;
/// InvalidArgument for bad arguments or a leaf no checkpoint holds) and x is bitwise unchanged
/// on every rank.
template <class X>
std::map<std::string, std::string> load_checkpoint(Backend& backend, const std::filesystem::path& path,
                                                   X& x, int root = 0,
                                                   const CheckpointReadOptions& opts = {},
                                                   std::source_location loc = std::source_location::current()) {
  detail::CallSiteScope site(loc, "load_checkpoint");  // its collectives name this call too
  // A sharded optimizer state shows full-size slots for the file to fill (on every rank); after
  // a successful load each rank keeps its own shard of them, after a failure its shard as it was.
  detail::checkpoint_phase(backend, x, root, detail::CheckpointPhase::before_load);
  struct After {
    Backend& b;
    X& x;
    int root;
    bool ok = false;
    ~After() {
      detail::checkpoint_phase(b, x, root, ok ? detail::CheckpointPhase::after_load_ok : detail::CheckpointPhase::after);
    }
  } after{backend, x, root};
  detail::agree(backend, "load_checkpoint", root,
                detail::verdict_of([&] { detail::check_storable("load_checkpoint", std::as_const(x)); }), 0,
                "nothing was restored on any rank");
  // Root reads and verifies the file, then broadcasts either its error ("E...") or the table of
  // contents and metadata ("C...").
  std::optional<Checkpoint> ck;
  std::string blob;
  if (backend.rank() == root) {
    try {
      ck.emplace(load_checkpoint(path, opts));
      blob = "C" + detail::pack_contents(*ck);
    } catch (...) {
      blob = "E" + detail::current_error_message();
    }
  }
  blob = detail::broadcast_string(backend, blob, root);
  if (blob.empty() || blob[0] != 'C')
    detail::throw_root_error(backend, blob.empty() ? std::string("checkpoint: empty reply from the root") : blob.substr(1),
                             root);
  const std::string_view contents = std::string_view(blob).substr(1);
  // Every rank checks its own structure against the file; the ranks agree before any write.
  std::vector<std::string> used;
  std::optional<detail::CheckpointIndex> index;
  const detail::Verdict mine = detail::verdict_of([&] {
    index.emplace(backend.rank() == root ? detail::CheckpointIndex(*ck)
                                         : detail::CheckpointIndex::from_contents(contents));
    used = detail::check_against_checkpoint(*index, std::as_const(x), "");
  });
  const std::string consequence = "nothing was restored on any rank (loading " + path.string() + ")";
  if (!detail::agree(backend, "load_checkpoint", root, mine, detail::structure_hash(std::as_const(x)),
                     consequence.c_str()))
    detail::throw_structure_mismatch(backend, std::as_const(x), root, "load_checkpoint");
  std::string err;
  if (backend.rank() == root) {
    try {
      detail::copy_from_checkpoint(*index, used, x);
    } catch (...) {
      err = detail::current_error_message();
    }
  }
  index.reset();  // the file's tensors are not needed any more: free them before synchronize
  ck.reset();
  err = detail::broadcast_status(backend, std::move(err), root);
  if (!err.empty()) detail::throw_root_error(backend, err, root);
  synchronize(backend, x, root);
  after.ok = true;
  return detail::unpack_metadata(contents);
}

// ---- Rotating checkpoints for restarts ----------------------------------------------------
//
// A run that may be killed and restarted (lockstep-run, Slurm requeue) writes numbered
// checkpoints next to a pointer file naming the newest complete one:
//
//   STEM-000050.safetensors   one checkpoint per step (or epoch) number, written atomically
//   STEM.latest               one line: the file name of the newest complete checkpoint
//
// A checkpoint is committed in three steps, each one atomic: the file is written (temporary
// file, fsync, rename), then STEM.latest is replaced (same way) to name it, and only then are
// the files beyond the newest `keep` removed. A writer killed at any point leaves STEM.latest
// naming a complete file: the previous one until the pointer moved, the new one after. Files the
// pointer never named (numbered above the step it named: a writer killed between its file and
// the pointer) are removed by the next commit. The paths are the root's: on a cluster, STEM is a
// path on rank 0's host (or a shared file system), and a restart finds the checkpoint only where
// it runs rank 0.
//
// A committed checkpoint is never destroyed for being newer than the step committed: a run
// resumed by hand from an older checkpoint (or one whose pointer was removed to start afresh)
// commits steps below checkpoints of the run it left (committed: numbered at or below the step
// the pointer named; every numbered file when there is no readable pointer). Those are moved
// into the folder STEM.set-aside-NNNNNN (NNNNNN: the step committed; ".2", ".3", ... when that
// exists), not counted by `keep`, and root says so in one line on stderr. save() at a step
// whose file is such a checkpoint writes the new one beside it first (.staged), and keeps the
// old one aside too unless the two are byte-identical (a re-save of the same state).
// Newer::remove deletes them instead, and says so.
//
// STEM comes from a path the way rotation_stem() says: "run/ck.safetensors" and "run/ck" are
// the stem "run/ck"; an existing directory or a path ending in '/' is the stem "DIR/ck".

/// The stem of the rotated checkpoints for `path` (see above).
[[nodiscard]] std::filesystem::path rotation_stem(const std::filesystem::path& path);

/// The newest complete checkpoint of the stem of `path`: the file STEM.latest names, if that
/// file exists; nullopt if there is no pointer (nothing committed yet, a fresh start). Throws
/// CheckpointError if the pointer exists but cannot be read, is malformed, or names a file that
/// is missing (someone removed it: a restart must not silently start over).
[[nodiscard]] std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& path);

/// The same as a collective: root looks, every rank gets root's answer (or root's error, as the
/// same CheckpointError on every rank).
[[nodiscard]] std::optional<std::filesystem::path> latest_checkpoint(Backend& backend, const std::filesystem::path& path,
                                                                     int root = 0);

/// Numbered checkpoints of one stem, the newest `keep` retained (see above).
///
///   CheckpointRotation rot("run/ck.safetensors", 3);
///   rot.save(backend, epoch, state, meta);       // a collective: root writes, commits, prunes
///   auto p = latest_checkpoint(backend, "run/ck.safetensors");   // on restart
class CheckpointRotation {
 public:
  /// What a commit does with committed checkpoints numbered above the step it commits (a run
  /// resumed from an older checkpoint): move them into STEM.set-aside-NNNNNN (the default), or
  /// delete them. Either is said on stderr.
  enum class Newer { set_aside, remove };

  /// keep >= 1 (InvalidArgument otherwise): how many committed checkpoints stay on disk.
  explicit CheckpointRotation(const std::filesystem::path& path, int keep = 3, Newer newer = Newer::set_aside);

  const std::filesystem::path& stem() const noexcept { return stem_; }
  int keep() const noexcept { return keep_; }
  Newer newer() const noexcept { return newer_; }
  /// STEM-NNNNNN.safetensors (at least six digits; step >= 0, InvalidArgument otherwise).
  [[nodiscard]] std::filesystem::path path_for(std::int64_t step) const;
  /// STEM.latest.
  std::filesystem::path pointer_path() const;
  /// The folder a commit of `step` sets newer checkpoints aside in: STEM.set-aside-NNNNNN, or
  /// the first of STEM.set-aside-NNNNNN.2, .3, ... that does not exist yet.
  [[nodiscard]] std::filesystem::path set_aside_dir(std::int64_t step) const;

  /// After the file path_for(step) is completely written: atomically points STEM.latest at it,
  /// then removes every numbered file of this stem at or below `step` except the `keep` newest,
  /// and every one above it that the pointer never named (the leftover of a writer killed
  /// before its commit). Committed files above `step` are set aside or removed as newer()
  /// says, and root says so on stderr (see above). Throws CheckpointError if the file is
  /// missing or the pointer cannot be written (then the old pointer stands and nothing is
  /// moved or removed); a file that cannot be moved or removed is left.
  void commit(std::int64_t step) const;

  /// Creates the stem's directory (and its parents) if missing; returns false if that failed.
  bool create_directory() const noexcept;

  /// The numbered files of this stem on disk, (step, path), oldest first.
  std::vector<std::pair<std::int64_t, std::filesystem::path>> files() const;

  /// Collective: root creates the stem's directory if missing, save_checkpoint(backend,
  /// path_for(step), x, metadata, root), then root commits;
  /// every rank returns, or every rank throws the same CheckpointError. Returns path_for(step).
  /// When path_for(step) is a committed checkpoint (the pointer names it or a later step), the
  /// new file is written beside it and replaces it at the commit, the old one set aside first
  /// unless the two are byte-identical.
  template <class X>
  std::filesystem::path save(Backend& backend, std::int64_t step, const X& x,
                             const std::map<std::string, std::string>& metadata = {}, int root = 0,
                             std::source_location loc = std::source_location::current()) const {
    const std::filesystem::path p = path_for(step);
    std::filesystem::path target = p;
    if (backend.rank() == root) {
      create_directory();  // a failure is save_checkpoint's error
      target = write_path(step);
    }
    save_checkpoint(backend, target, x, metadata, root, loc);
    std::string err;
    if (backend.rank() == root) {
      try {
        commit_written(step, target);
      } catch (...) {
        err = detail::current_error_message();
      }
    }
    err = detail::broadcast_status(backend, std::move(err), root);
    if (!err.empty()) detail::throw_root_error(backend, err, root);
    return p;
  }

 private:
  // Where save() writes step's file: path_for(step), or STEM-NNNNNN.safetensors.staged when
  // path_for(step) is a committed checkpoint that must not be overwritten before the commit
  // decides whether to set it aside.
  std::filesystem::path write_path(std::int64_t step) const;
  // commit(step) for a file written at `written` (path_for(step) or write_path's staged path).
  void commit_written(std::int64_t step, const std::filesystem::path& written) const;

  std::filesystem::path stem_;
  int keep_;
  Newer newer_;
};

}  // namespace lockstep
