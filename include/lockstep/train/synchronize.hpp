// synchronize(backend, x, root): make every tensor and arithmetic scalar reachable from x equal,
// bitwise, to root's. Knows only Backend&.
#pragma once

#include <source_location>

#include "lockstep/reliability/call_site.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/traverse.hpp"

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

// ---- allreduce of scalars and small structs (metrics) ---------------------------------------

namespace detail {
/// The Lockstep dtype a scalar of type S travels as in allreduce(backend, value, op): its own
/// where Lockstep has it, else a wider one that holds it exactly.
template <class S>
constexpr DType scalar_wire_dtype() {
  using T = std::remove_cv_t<S>;
  static_assert(!std::is_same_v<T, long double>, "lockstep::allreduce: long double has no Lockstep dtype");
  static_assert(!(std::is_integral_v<T> && std::is_unsigned_v<T> && sizeof(T) == 8),
                "lockstep::allreduce: 64-bit unsigned integers have no Lockstep dtype (use int64_t)");
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_floating_point_v<T>) return DType::f64;
  else if constexpr (std::is_same_v<T, std::int32_t>) return DType::i32;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return DType::u8;
  else return DType::i64;
}
}  // namespace detail

/// Allreduce of one arithmetic value, returned on every rank (a metric: a loss, a count):
///   double loss = ls::allreduce(backend, local_loss, ls::ReduceOp::avg);
/// float, double, int32 and uint8 travel as themselves; other integers (bool, int16, long...) as
/// int64 (exact). Collective, with the checks of Backend::allreduce.
/// [[nodiscard]]: the value passed in is not changed (unlike the tensor and structure forms,
/// which reduce in place); a call whose result is dropped did nothing but communicate.
template <class S>
  requires std::is_arithmetic_v<S>
[[nodiscard("the scalar allreduce returns the reduced value; the argument is unchanged")]]
S allreduce(Backend& backend, S value, ReduceOp op, std::source_location loc = std::source_location::current()) {
  constexpr DType dt = detail::scalar_wire_dtype<S>();
  if constexpr (dt == DType::f32) {
    float v = value;
    backend.allreduce(TensorView{&v, 1, dt, Device::cpu()}, op, loc);
    return static_cast<S>(v);
  } else if constexpr (dt == DType::f64) {
    double v = static_cast<double>(value);
    backend.allreduce(TensorView{&v, 1, dt, Device::cpu()}, op, loc);
    return static_cast<S>(v);
  } else if constexpr (dt == DType::i32) {
    std::int32_t v = value;
    backend.allreduce(TensorView{&v, 1, dt, Device::cpu()}, op, loc);
    return static_cast<S>(v);
  } else if constexpr (dt == DType::u8) {
    std::uint8_t v = value;
    backend.allreduce(TensorView{&v, 1, dt, Device::cpu()}, op, loc);
    return static_cast<S>(v);
  } else {
    std::int64_t v = static_cast<std::int64_t>(value);
    backend.allreduce(TensorView{&v, 1, dt, Device::cpu()}, op, loc);
    return static_cast<S>(v);
  }
}

/// Allreduce, in place, of every leaf of a LOCKSTEP_FIELDS struct (or vector, map, tuple...)
/// of scalars and tensors, for metrics:
///   struct Metrics { double loss; std::int64_t correct, seen; };  LOCKSTEP_FIELDS(Metrics, ...)
///   ls::allreduce(backend, m, ls::ReduceOp::sum);
/// Scalars go in at most two allreduces (floating-point ones as f64, integers as int64), each
/// tensor in one of its own. Collective: the ranks must pass the same structure (checked by the
/// fingerprints of the allreduces under LOCKSTEP_CHECK, as any collective).
template <class X>
  requires(!std::is_arithmetic_v<std::remove_cvref_t<X>> && !std::is_convertible_v<X&, TensorView> &&
           Traversable<X>)
void allreduce(Backend& backend, X& x, ReduceOp op, std::source_location loc = std::source_location::current()) {
  std::vector<double> floats;
  std::vector<std::int64_t> ints;
  for_each_leaf(x, [&](auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (std::is_same_v<L, Tensor>) {
      backend.allreduce(leaf.view(), op, loc);
    } else if constexpr (std::is_floating_point_v<L>) {
      static_assert(!std::is_same_v<L, long double>, "lockstep::allreduce: long double has no Lockstep dtype");
      floats.push_back(static_cast<double>(leaf));
    } else {
      static_assert(!(std::is_unsigned_v<L> && sizeof(L) == 8),
                    "lockstep::allreduce: 64-bit unsigned integers have no Lockstep dtype (use int64_t)");
      ints.push_back(static_cast<std::int64_t>(leaf));
    }
  });
  if (!floats.empty())
    backend.allreduce(TensorView{floats.data(), static_cast<std::int64_t>(floats.size()), DType::f64, Device::cpu()},
                      op, loc);
  if (!ints.empty())
    backend.allreduce(TensorView{ints.data(), static_cast<std::int64_t>(ints.size()), DType::i64, Device::cpu()}, op,
                      loc);
  std::size_t fi = 0, ii = 0;
  for_each_leaf(x, [&](auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (std::is_same_v<L, Tensor>) {
    } else if constexpr (std::is_floating_point_v<L>) {
      leaf = static_cast<L>(floats[fi++]);
    } else {
      leaf = static_cast<L>(ints[ii++]);
    }
  });
}

}  // namespace lockstep
