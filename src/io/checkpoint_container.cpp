// The in-memory checkpoint (Checkpoint: named tensors, metadata, the name index) and the
// safetensors dtype names.
#include "io/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "io/atomic_file.hpp"

namespace lockstep {

using detail::fail;
using detail::valid_utf8;

const char* safetensors_dtype_name(DType t) noexcept {
  switch (t) {
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
  }
  return "?";
}

std::optional<DType> dtype_from_safetensors_name(std::string_view n) noexcept {
  for (DType t : {DType::f16, DType::bf16, DType::f32, DType::f64, DType::i32, DType::i64, DType::u8})
    if (n == safetensors_dtype_name(t)) return t;
  return std::nullopt;
}

namespace {
using Entries = std::vector<std::pair<std::string, Tensor>>;

void rebuild(detail::CheckpointNames& ix, const Entries& tensors);
// Indexes what was appended to `tensors` since; the first of two equal names keeps its entry.
void extend(detail::CheckpointNames& ix, const Entries& tensors) {
  if (tensors.size() < ix.covered) return rebuild(ix, tensors);
  ix.pos.reserve(tensors.size());
  for (; ix.covered < tensors.size(); ++ix.covered) ix.pos.emplace(tensors[ix.covered].first, ix.covered);
}
void rebuild(detail::CheckpointNames& ix, const Entries& tensors) {
  ix.pos.clear();
  ix.covered = 0;
  extend(ix, tensors);
}
// The indexed position of `name` if `tensors` still holds it there, else tensors.size().
std::size_t lookup(const detail::CheckpointNames& ix, const Entries& tensors, std::string_view name) {
  const auto it = ix.pos.find(name);
  if (it == ix.pos.end() || it->second >= tensors.size() || tensors[it->second].first != name) return tensors.size();
  return it->second;
}
}  // namespace

std::size_t Checkpoint::position(std::string_view name, bool scan_on_miss) const noexcept {
  const std::size_t n = tensors.size();
  auto scan = [&] {
    for (std::size_t i = 0; i < n; ++i)
      if (tensors[i].first == name) return i;
    return n;
  };
  std::lock_guard lock(index_.mutex);
  try {
    extend(index_, tensors);
    std::size_t i = lookup(index_, tensors, name);
    // A stale entry (the name moved or went) is not a miss to trust: rebuild and look again.
    if (i == n && index_.pos.find(name) != index_.pos.end()) {
      rebuild(index_, tensors);
      return lookup(index_, tensors, name);  // the index now covers `tensors` as it is
    }
    if (i < n || !scan_on_miss) return i;
    // A miss, confirmed by a scan: `tensors` may have been edited in place.
    i = scan();
    if (i < n) rebuild(index_, tensors);
    return i;
  } catch (...) {  // no memory for the index: the scan needs none
    index_.pos.clear();
    index_.covered = 0;
    return scan();
  }
}

void Checkpoint::add(std::string name, Tensor t) {
  LOCKSTEP_CHECK_ARG(!name.empty(), "Checkpoint::add: a tensor name must not be empty");
  LOCKSTEP_CHECK_ARG(!name.starts_with("__"), "Checkpoint::add: name \"", name,
                     "\" starts with \"__\", which safetensors reserves");
  LOCKSTEP_CHECK_ARG(valid_utf8(name), "Checkpoint::add: name is not valid UTF-8");
  // The index's word, without a scan: a name renamed in place in `tensors` and added again
  // gets past this check, and the writer's own duplicate check refuses the file.
  LOCKSTEP_CHECK_ARG(position(name, false) == tensors.size(), "Checkpoint::add: duplicate tensor name \"", name,
                     "\"");
  tensors.emplace_back(std::move(name), std::move(t));
}

const Tensor* Checkpoint::find(std::string_view name) const noexcept {
  const std::size_t i = position(name, true);
  return i < tensors.size() ? &tensors[i].second : nullptr;
}
Tensor* Checkpoint::find(std::string_view name) noexcept {
  const std::size_t i = position(name, true);
  return i < tensors.size() ? &tensors[i].second : nullptr;
}
const Tensor& Checkpoint::at(std::string_view name) const {
  const Tensor* t = find(name);
  if (t == nullptr) fail("no tensor named \"" + std::string(name) + "\"");
  return *t;
}
Tensor& Checkpoint::at(std::string_view name) {
  Tensor* t = find(name);
  if (t == nullptr) fail("no tensor named \"" + std::string(name) + "\"");
  return *t;
}

}  // namespace lockstep
