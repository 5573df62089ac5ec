// The collective checkpoint (checkpoint.hpp's structure-level templates): the helpers they call,
// CheckpointIndex, the table of contents the root broadcasts, and the agreement of the ranks on
// every outcome. The file format is safetensors*.cpp's.
#include "lockstep/io/checkpoint.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "io/safetensors.hpp"

namespace lockstep {
// ---------------------------------------------------------------------------------------------
// Helpers of the structure-level templates in checkpoint.hpp.

namespace detail {

std::string join_leaf_name(std::string_view prefix, std::string_view path) {
  if (prefix.empty()) return std::string(path);
  if (path.empty()) return std::string(prefix);
  if (path.front() == '[') return std::string(prefix) + std::string(path);
  return std::string(prefix) + "." + std::string(path);
}

void check_tensor_usable(const char* what, const std::string& name, const Tensor& t) {
  const Shape& shape = t.shape();
  // numel_of: a zero extent anywhere is zero elements; a negative or overflowing shape throws.
  std::int64_t n = -1;
  bool counted = true;
  try {
    n = numel_of(shape);
  } catch (const Error&) {
    counted = false;
  }
  if (!counted || n != t.numel())
    throw InvalidArgument(std::string(what) + ": tensor \"" + name + "\" is not usable: its shape " +
                          to_string(shape) + " does not hold the " + std::to_string(t.numel()) +
                          " elements it claims (a moved-from Tensor?)");
  if (t.numel() > 0 && t.raw_data() == nullptr)
    throw InvalidArgument(std::string(what) + ": tensor \"" + name + "\" is not usable: " +
                          std::to_string(t.numel()) + " elements but no memory (a moved-from Tensor?)");
}

void throw_unstorable_scalar(const char* what, const std::string& name, const char* reason) {
  throw InvalidArgument(std::string(what) + ": leaf '" + (name.empty() ? std::string("(root)") : name) +
                        "' is " + reason);
}

void check_checkpoint_leaf(const std::string& name, DType file_dtype, const Shape& file_shape, DType dtype,
                           const Shape& shape) {
  if (file_dtype != dtype)
    throw CheckpointError("checkpoint: tensor \"" + name + "\" has dtype " +
                          safetensors_dtype_name(file_dtype) + " but the structure expects " +
                          safetensors_dtype_name(dtype) + " (checkpoint from a different model?)");
  if (file_shape != shape)
    throw CheckpointError("checkpoint: tensor \"" + name + "\" has shape " + to_string(file_shape) +
                          " but the structure expects " + to_string(shape) +
                          " (checkpoint from a different model?)");
}

void check_checkpoint_leaf(const std::string& name, const Tensor& t, DType dtype, const Shape& shape) {
  check_checkpoint_leaf(name, t.dtype(), t.shape(), dtype, shape);
}

namespace {
bool under_prefix(std::string_view name, std::string_view prefix) {
  return prefix.empty() || name == prefix ||
         (name.size() > prefix.size() && name.starts_with(prefix) &&
          (name[prefix.size()] == '.' || name[prefix.size()] == '['));
}

[[noreturn]] void throw_extra(std::string_view name) {
  throw CheckpointError("checkpoint: has tensor \"" + std::string(name) +
                        "\" that the structure being restored does not (checkpoint from a "
                        "different model?)");
}
}  // namespace

void check_no_extra_leaves(const Checkpoint& ck, std::string_view prefix,
                           const std::vector<std::string>& used) {
  const std::unordered_set<std::string_view> u(used.begin(), used.end());
  for (const auto& [name, t] : ck.tensors)
    if (under_prefix(name, prefix) && u.count(name) == 0) throw_extra(name);
}

// ---- CheckpointIndex and the table of contents -------------------------------------------

CheckpointIndex::CheckpointIndex(const Checkpoint& ck) {
  order_.reserve(ck.tensors.size());
  for (const auto& [name, t] : ck.tensors) order_.push_back({name, Entry{t.dtype(), &t.shape(), &t}});
  build();
}

void CheckpointIndex::build() {
  by_name_.reserve(order_.size());
  // The first of two equal names wins, as a linear find would (a Checkpoint's fields are public).
  for (std::size_t i = 0; i < order_.size(); ++i) by_name_.emplace(order_[i].first, i);
}

const CheckpointIndex::Entry* CheckpointIndex::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &order_[it->second].second;
}

void CheckpointIndex::check_no_extra(std::string_view prefix, const std::vector<std::string>& used) const {
  const std::unordered_set<std::string_view> u(used.begin(), used.end());
  for (const auto& [name, e] : order_)
    if (under_prefix(name, prefix) && u.count(name) == 0) throw_extra(name);
}

// Table of contents: u64 count, then per tensor u64 name length, name, u8 dtype, u64 rank,
// i64 extents; then u64 metadata count and per entry u64 length + key, u64 length + value.
// Native byte order: it only travels between the ranks of one job.
namespace {
void put_u64(std::string& out, std::uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
void put_text(std::string& out, std::string_view t) {
  put_u64(out, t.size());
  out.append(t);
}

struct ContentsReader {
  std::string_view s;
  std::size_t pos = 0;
  [[noreturn]] static void bad() { fail("the table of contents received from the root is malformed"); }
  std::uint64_t u64() {
    if (s.size() - pos < 8) bad();
    std::uint64_t v;
    std::memcpy(&v, s.data() + pos, 8);
    pos += 8;
    return v;
  }
  std::uint8_t u8() {
    if (s.size() - pos < 1) bad();
    return static_cast<std::uint8_t>(s[pos++]);
  }
  std::string_view text() {
    const std::uint64_t n = u64();
    if (n > s.size() - pos) bad();
    const std::string_view t = s.substr(pos, n);
    pos += n;
    return t;
  }
  /// Bounds a count read from the input by the bytes left (each item takes at least `min_bytes`).
  std::uint64_t count(std::size_t min_bytes) {
    const std::uint64_t n = u64();
    if (n > (s.size() - pos) / min_bytes) bad();
    return n;
  }
};
}  // namespace

std::string pack_contents(const Checkpoint& ck) {
  std::string out;
  put_u64(out, ck.tensors.size());
  for (const auto& [name, t] : ck.tensors) {
    put_text(out, name);
    out += static_cast<char>(t.dtype());
    put_u64(out, t.shape().size());
    for (const auto e : t.shape()) put_u64(out, static_cast<std::uint64_t>(e));
  }
  put_u64(out, ck.metadata.size());
  for (const auto& [k, v] : ck.metadata) {
    put_text(out, k);
    put_text(out, v);
  }
  return out;
}

CheckpointIndex CheckpointIndex::from_contents(std::string_view contents) {
  ContentsReader r{contents};
  CheckpointIndex idx;
  const std::uint64_t n = r.count(17);
  idx.owned_names_.reserve(n);
  idx.owned_shapes_.reserve(n);
  std::vector<DType> dtypes;
  dtypes.reserve(n);
  for (std::uint64_t i = 0; i < n; ++i) {
    idx.owned_names_.emplace_back(r.text());
    const std::uint8_t dt = r.u8();
    if (dt > static_cast<std::uint8_t>(DType::u8)) ContentsReader::bad();
    dtypes.push_back(static_cast<DType>(dt));
    const std::uint64_t rank = r.count(8);
    Shape shape(rank);
    for (auto& e : shape) e = static_cast<std::int64_t>(r.u64());
    idx.owned_shapes_.push_back(std::move(shape));
  }
  // The vectors are complete: views into them stay valid from here on.
  idx.order_.reserve(n);
  for (std::uint64_t i = 0; i < n; ++i)
    idx.order_.push_back({idx.owned_names_[i], Entry{dtypes[i], &idx.owned_shapes_[i], nullptr}});
  idx.build();
  return idx;
}

std::map<std::string, std::string> unpack_metadata(std::string_view contents) {
  ContentsReader r{contents};
  const std::uint64_t n = r.count(17);
  for (std::uint64_t i = 0; i < n; ++i) {
    (void)r.text();
    (void)r.u8();
    const std::uint64_t rank = r.count(8);
    r.pos += 8 * rank;
  }
  std::map<std::string, std::string> meta;
  const std::uint64_t m = r.count(16);
  for (std::uint64_t i = 0; i < m; ++i) {
    std::string k(r.text());
    meta[std::move(k)] = std::string(r.text());
  }
  return meta;
}

void append_tensors(Checkpoint& ck, std::vector<std::pair<std::string, Tensor>> add) {
  std::unordered_set<std::string_view> names;
  names.reserve(ck.tensors.size() + add.size());
  for (const auto& [name, t] : ck.tensors) names.insert(name);
  for (const auto& [name, t] : add) {
    LOCKSTEP_CHECK_ARG(!name.empty(), "add_to_checkpoint: a tensor name must not be empty");
    LOCKSTEP_CHECK_ARG(!name.starts_with("__"), "add_to_checkpoint: name \"", name,
                       "\" starts with \"__\", which safetensors reserves");
    LOCKSTEP_CHECK_ARG(valid_utf8(name), "add_to_checkpoint: name \"", name, "\" is not valid UTF-8");
    LOCKSTEP_CHECK_ARG(names.insert(name).second, "add_to_checkpoint: duplicate tensor name \"", name,
                       "\" (already in the checkpoint, or two leaves with one name)");
  }
  ck.tensors.reserve(ck.tensors.size() + add.size());
  for (auto& item : add) ck.tensors.push_back(std::move(item));
}

std::map<std::string, std::string> broadcast_metadata(Backend& backend,
                                                      const std::map<std::string, std::string>& meta,
                                                      int root) {
  // Length-prefixed key/value pairs in one string: two broadcasts whatever the size.
  std::string packed;
  if (backend.rank() == root) {
    for (const auto& [k, v] : meta) {
      packed += std::to_string(k.size()) + ':' + k + std::to_string(v.size()) + ':' + v;
    }
  }
  packed = broadcast_string(backend, packed, root);
  std::map<std::string, std::string> out;
  std::size_t pos = 0;
  auto next = [&] {
    const std::size_t colon = packed.find(':', pos);
    const std::size_t len = std::stoul(packed.substr(pos, colon - pos));
    std::string field = packed.substr(colon + 1, len);
    pos = colon + 1 + len;
    return field;
  };
  while (pos < packed.size()) {
    std::string k = next();
    out[std::move(k)] = next();
  }
  return out;
}

void throw_root_error(const Backend& backend, const std::string& msg, int root) {
  if (backend.rank() == root) throw CheckpointError(msg);
  throw CheckpointError(msg + " [reported by rank " + std::to_string(root) + " to rank " +
                        std::to_string(backend.rank()) + "]");
}

}  // namespace detail

}  // namespace lockstep
