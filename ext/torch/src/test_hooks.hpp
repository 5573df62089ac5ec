// Internal (not installed): lockstep::torch's test hooks, which the tests in ext/torch/test
// include. They change what the library does, so they stay out of the installed lockstep/torch.hpp
// (the test headers.installed refuses a test hook in an installed header).
#pragma once

#include <string>

namespace lockstep::torch::testing {

/// The next gradient hook of a DistributedOptimizer in this process fails with
/// InvalidArgument(message), as a hook whose gradient cannot be taken would. The step that ends
/// the cycle then throws that error on every rank.
void fail_next_gradient(std::string message);

}  // namespace lockstep::torch::testing
