// model_hash: a short fingerprint of a model's parameters, to compare runs bit for bit ("the
// run at 4 ranks made the model of the run at 1 rank") by one line of output.
#pragma once

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/tensor.hpp"
#include "lockstep/core/traverse.hpp"

namespace lockstep {

namespace detail {
/// The hash of model_hash over (path, tensor) pairs in any order: sorted by path here.
[[nodiscard]] std::string model_hash_of(std::vector<std::pair<std::string, const Tensor*>> tensors);
}  // namespace detail

/// "crc32c:" and 8 lowercase hex digits: the CRC-32C of the bytes of every Tensor reachable
/// from x (traverse.hpp), back to back, the tensors in the order of their paths ("b1" < "w1",
/// compared bytewise, as Python sorts the names of a checkpoint of x). Only the bytes count:
/// arithmetic scalars, names, dtypes and shapes are not hashed, so equal hashes mean equal
/// parameter bytes (up to CRC collisions), which is what a bitwise comparison of two runs asks.
/// Device tensors are copied to the host first (through the installed DeviceRuntime; without
/// one, NotCompiled). Local: no communication; call it on one rank, or on each to compare.
template <class X>
[[nodiscard]] std::string model_hash(const X& x) {
  std::vector<std::pair<std::string, const Tensor*>> tensors;
  for_each_leaf_with_path(x, [&](const std::string& path, const auto& leaf) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(leaf)>, Tensor>) tensors.emplace_back(path, &leaf);
  });
  return detail::model_hash_of(std::move(tensors));
}

}  // namespace lockstep
