// check_replicas(backend, x): are the replicas still in lockstep? Hashes every tensor and
// arithmetic scalar reachable from x, compares across ranks, and names the first leaf that
// differs and the ranks that disagree.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <source_location>
#include <string>
#include <type_traits>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/reliability/call_site.hpp"
#include "lockstep/train/synchronize.hpp"
#include "lockstep/core/traverse.hpp"

namespace lockstep {

namespace detail {

/// Hash of a tensor's dtype, shape and bytes (device tensors are copied to the host first).
std::uint64_t hash_leaf(const Tensor& t);
/// How many of a scalar's bytes hold its value. All of them, except for x86's 80-bit extended
/// long double: 10 value bytes stored in 16 (12 on i386), the rest padding whose contents are
/// whatever the stack held, and differ between identical replicas.
template <class S>
constexpr std::size_t scalar_value_bytes() {
  if constexpr (std::is_floating_point_v<S> && std::numeric_limits<S>::digits == 64 && sizeof(S) > 10)
    return 10;
  else
    return sizeof(S);
}
/// Hash of a scalar's type size and value bytes (never its padding).
template <class S>
  requires std::is_arithmetic_v<S>
std::uint64_t hash_leaf(const S& s) {
  return hash_bytes(&s, scalar_value_bytes<S>()) ^ sizeof s;
}
/// "f32 [2, 3] = 0.5, 1.5, ..." (the first few values).
std::string describe_leaf(const Tensor& t);
/// "f64 scalar = 0.25".
std::string describe_scalar(double v, bool floating, std::size_t bytes);
/// "long double scalar = 0.100000000000000000001" (every digit a long double holds).
std::string describe_long_double(long double v);
template <class S>
  requires std::is_arithmetic_v<S>
std::string describe_leaf(const S& s) {
  if constexpr (std::is_same_v<S, long double>)
    return describe_long_double(s);
  else
    return describe_scalar(static_cast<double>(s), std::is_floating_point_v<S>, sizeof(S));
}

/// Index of the first tensor in `ts` holding a NaN or an infinity (ts.size() if none); `element`
/// receives the index of the first such element and `value` its text ("nan", "inf", "-inf").
/// Integer tensors are finite by definition; device tensors are copied to the host.
std::size_t first_non_finite(const std::vector<Tensor*>& ts, std::int64_t* element = nullptr,
                             std::string* value = nullptr);

/// "'layers[0].w' (element 3 = nan)" for the first non-finite tensor of gs, "" if all are
/// finite; paths() gives the tensors' paths (called only when one is found).
template <class PathsFn>
std::string describe_non_finite(const std::vector<Tensor*>& gs, PathsFn&& paths) {
  std::int64_t element = 0;
  std::string value;
  const std::size_t k = first_non_finite(gs, &element, &value);
  if (k == gs.size()) return "";
  const auto p = paths();
  return "'" + (k < p.size() ? p[k] : std::to_string(k)) + "' (element " + std::to_string(element) + " = " +
         value + ")";
}

/// Logs (stderr) that optimizer step `step` was skipped on every rank because the reduced
/// gradient `reduced_path` is not finite; `local_bad` (describe_non_finite of this rank's own
/// gradients, before the reduction) names the tensor on the rank it came from. Logged by every
/// rank that had a non-finite gradient, and by rank 0.
void log_skipped_step(Backend& b, std::int64_t step, const std::string& local_bad, const std::string& reduced_path);

/// Compares the per-leaf hashes across ranks (two small collectives when they agree); on a
/// difference, throws MismatchError on every rank naming the first differing leaf (path_of,
/// describe are called for that leaf only) and the ranks that disagree.
void compare_replica_hashes(Backend& b, const std::vector<std::uint64_t>& hashes,
                            const std::function<std::string(std::size_t)>& path_of,
                            const std::function<std::string(std::size_t)>& describe);

}  // namespace detail

/// Checks that every tensor and scalar reachable from x is bitwise equal on every rank.
/// Collective. Throws MismatchError on every rank if the structures differ (as synchronize does)
/// or if any leaf differs, naming the first differing leaf, its value on each rank, and the ranks
/// that disagree with the majority. x may be a tuple of references (std::tie(model, state)).
template <class X>
void check_replicas(Backend& backend, X&& x, std::source_location loc = std::source_location::current()) {
  detail::CallSiteScope site(loc);
  auto& ref = x;
  const auto sig = detail::describe(ref, false);
  detail::check_same_structure(backend, sig.signature(), 0, 0, "check_replicas",
                               [&] { return std::move(detail::describe(ref, true).entries()); });
  std::vector<std::uint64_t> hashes;
  for_each_leaf(ref, [&](const auto& leaf) { hashes.push_back(detail::hash_leaf(leaf)); });
  auto path_of = [&](std::size_t i) {
    std::string p;
    std::size_t k = 0;
    for_each_leaf_with_path(ref, [&](const std::string& path, const auto&) {
      if (k++ == i) p = path;
    });
    return p;
  };
  auto describe = [&](std::size_t i) {
    std::string d;
    std::size_t k = 0;
    for_each_leaf(ref, [&](const auto& leaf) {
      if (k++ == i) d = detail::describe_leaf(leaf);
    });
    return d;
  };
  detail::compare_replica_hashes(backend, hashes, path_of, describe);
}

}  // namespace lockstep
