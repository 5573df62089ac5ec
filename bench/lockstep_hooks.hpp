// The benchmarks' adapters to Lockstep's training API (DistributedOptimizer, synchronize,
// optimizer rules). Kept apart so the communication benchmarks build while that API evolves.
#pragma once

#include <lockstep/lockstep.hpp>

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>

namespace bench::hooks {

/// A named timed body that averages the given gradients through DistributedOptimizer, or
/// nothing when this build has no DistributedOptimizer.
inline std::optional<std::pair<std::string, std::function<void()>>> distributed_average(
    lockstep::Backend&, std::span<const lockstep::TensorView>, bool /*flat*/) {
  return std::nullopt;
}

}  // namespace bench::hooks
