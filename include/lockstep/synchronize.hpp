// synchronize(backend, x, root): make every tensor and arithmetic scalar reachable from x equal,
// bitwise, to root's. Knows only Backend&.
#pragma once

#include <source_location>

#include "lockstep/reliability.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/backend.hpp"
#include "lockstep/traverse.hpp"

namespace lockstep {

namespace detail {

/// One leaf as synchronize sees it: where its bytes are.
struct SyncLeaf {
  void* data = nullptr;
  std::size_t bytes = 0;
  Device device = Device::cpu();
  bool is_tensor = false;
};

/// One line of a structure description, with the path it describes.
struct StructureEntry {
  std::string path;
  std::string desc;
};

/// Collects the structure of x: a compact signature string (hashed by the structure check) and,
/// when asked, the per-entry description with paths (built only to explain a mismatch).
class StructureWriter {
 public:
  explicit StructureWriter(bool with_entries) : with_entries_(with_entries) {}
  void leaf(const std::string& path, const Tensor& t);
  template <class S>
    requires std::is_arithmetic_v<S>
  void leaf(const std::string& path, const S&) {
    add(path, scalar_desc(sizeof(S), std::is_floating_point_v<S>, std::is_signed_v<S>));
  }
  void node(const std::string& path, const char* kind, std::size_t n);
  void key(const std::string& path, const std::string& k);

  const std::string& signature() const noexcept { return sig_; }
  std::vector<StructureEntry>& entries() noexcept { return entries_; }

 private:
  static std::string scalar_desc(std::size_t bytes, bool floating, bool is_signed);
  void add(const std::string& path, const std::string& desc);
  bool with_entries_;
  std::string sig_;
  std::vector<StructureEntry> entries_;
};

/// Structure of x as a StructureWriter.
template <class X>
StructureWriter describe(X& x, bool with_entries) {
  StructureWriter w(with_entries);
  PathBuilder path;
  if (with_entries)
    walk<true>(x, w, path);
  else
    walk<false>(x, w, path);
  return w;
}

/// Checks that every rank of `b` holds a structure with the same signature as root's; on a
/// mismatch, calls entries() for the described structure and throws MismatchError on every rank,
/// naming each differing rank's first differing leaf. `what` prefixes the message. Returns
/// whether every rank passed the same `layout` value too (one allgather carries both).
bool check_same_structure(Backend& b, const std::string& signature, std::uint64_t layout, int root,
                          const char* what,
                          const std::function<std::vector<StructureEntry>()>& entries);

/// A hash of how the leaves lie in memory (which tensors are back to back), which decides the
/// broadcasts broadcast_leaves makes; ranks must agree on it to use in-place runs.
std::uint64_t layout_of(const std::vector<SyncLeaf>& leaves);

/// Broadcasts the leaves' bytes from root. With use_runs, tensors that lie back to back in host
/// memory (64 KiB or more) and device tensors are broadcast in place and the rest is packed
/// into one buffer; without, everything on the host is packed (device tensors go one by one).
void broadcast_leaves(Backend& b, const std::vector<SyncLeaf>& leaves, int root, bool use_runs);

/// 64-bit FNV-1a hash.
std::uint64_t fnv1a(const void* data, std::size_t bytes,
                    std::uint64_t h = 14695981039346656037ull) noexcept;

/// Validates root against the backend's size; throws InvalidArgument.
void check_root(const Backend& b, int root, const char* what);

struct SyncLeafCollector {
  std::vector<SyncLeaf> leaves;
  void leaf(const std::string&, Tensor& t) {
    leaves.push_back(SyncLeaf{t.raw_data(), t.nbytes(), t.device(), true});
  }
  template <class S>
    requires std::is_arithmetic_v<S>
  void leaf(const std::string&, S& s) {
    leaves.push_back(SyncLeaf{&s, sizeof(S), Device::cpu(), false});
  }
};

}  // namespace detail

/// Makes every tensor and arithmetic scalar reachable from x bitwise equal to root's. Collective.
/// First checks that all ranks hold the same structure (container sizes, map keys, optionals,
/// tensor shapes and dtypes, scalar types) and throws MismatchError on every rank otherwise,
/// naming the first differing leaf; then moves the data in few large broadcasts (tensors that lie
/// back to back in memory in place, everything else packed into one buffer with the scalars).
/// x may be a tuple of references: synchronize(b, std::tie(model, state)).
template <class X>
void synchronize(Backend& backend, X&& x, int root = 0,
                 std::source_location loc = std::source_location::current()) {
  static_assert(!std::is_const_v<std::remove_reference_t<X>>,
                "lockstep::synchronize writes into x: pass a non-const object");
  detail::CallSiteScope site(loc, "synchronize");  // its collectives name this call too
  detail::check_root(backend, root, "synchronize");
  auto& ref = x;
  const auto sig = detail::describe(ref, false);
  detail::SyncLeafCollector c;
  detail::PathBuilder path;
  detail::walk<false>(ref, c, path);
  const bool same_layout = detail::check_same_structure(
      backend, sig.signature(), detail::layout_of(c.leaves), root, "synchronize",
      [&] { return std::move(detail::describe(ref, true).entries()); });
  detail::broadcast_leaves(backend, c.leaves, root, same_layout);
}

}  // namespace lockstep
