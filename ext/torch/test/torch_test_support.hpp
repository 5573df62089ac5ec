// What the LibTorch tests (torch_test, sync_batchnorm_test, sharded_test, deterministic_test; one
// program, test_torch) share: the global backend, a pass flag combined across ranks, an error's
// text as a string (so that a rank records it and goes on to the next collective instead of
// stopping between two), the comparison of models, the MLP batches of torch_test and
// sharded_test, and a user's own optimizer.
//
// The four files are compiled as one unit (one parse of LibTorch's headers), so each keeps its
// own helpers and test cases in a namespace of its own: a helper of one file can neither clash
// with nor be chosen by overload resolution in place of another file's.
#pragma once

#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "lockstep/torch.hpp"
#include "test_support.hpp"

namespace lttest {

namespace ls = lockstep;
namespace lt = lockstep::torch;

/// The global MPIBackend (main_mpi.cpp initialises it).
inline ls::MPIBackend& backend() { return ls::get_distributed_backend<ls::MPIBackend>(); }

/// True on every rank of b (the global backend) if `ok` is true on every rank; collective.
inline bool all_ranks(ls::Backend& b, bool ok) { return lstest::all_ranks(b, ok); }
inline bool all_ranks(bool ok) { return lstest::all_ranks(backend(), ok); }

/// The message of the E thrown by f on this rank ("" if none, "other: ..." for another type).
template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("other: ") + e.what();
  }
  return "";
}

/// Whether s contains part.
inline bool mentions(const std::string& s, const std::string& part) { return lstest::contains(s, part); }

/// The module's parameters and buffers equal on every rank of b, bitwise (the MismatchError's
/// text is recorded otherwise).
inline bool replicas_equal(ls::Backend& b, torch::nn::Module& m) {
  std::map<std::string, ls::Tensor> x;
  for (const auto& p : m.named_parameters()) x.emplace(p.key(), lt::borrow(p.value()));
  for (const auto& buf : m.named_buffers()) x.emplace(buf.key(), lt::borrow(buf.value()));
  const std::string e = error_of<ls::MismatchError>([&] { ls::check_replicas(b, x); });
  if (!e.empty()) UNSCOPED_INFO(e);
  return e.empty();
}
inline bool replicas_equal(torch::nn::Module& m) { return replicas_equal(backend(), m); }

/// The largest absolute difference between the parameters of a and b, in order.
inline float max_abs_diff(torch::nn::Module& a, torch::nn::Module& b) {
  float d = 0;
  auto pa = a.parameters(), pb = b.parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) d = std::max(d, (pa[i] - pb[i]).abs().max().item<float>());
  return d;
}

/// The global batch of step s for a 6 => 3 MLP (the same on every rank), and this rank's rows
/// of it (rows divisible by the number of ranks).
inline std::pair<torch::Tensor, torch::Tensor> global_batch(int s, int rows) {
  torch::manual_seed(1000 + s);
  return {torch::randn({rows, 6}), torch::randn({rows, 3})};
}
inline torch::Tensor rows_of(const torch::Tensor& t, int rank, int size) {
  const auto per = t.size(0) / size;
  return t.narrow(0, rank * per, per);
}

/// A user's own optimizer, which Lockstep does not know field by field: plain gradient descent
/// with a step counter kept in the optimizer.
class MyDescent : public torch::optim::Optimizer {
 public:
  explicit MyDescent(std::vector<torch::Tensor> params, double lr)
      : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                                std::make_unique<torch::optim::SGDOptions>(lr)),
        lr_(lr) {}
  torch::Tensor step(LossClosure = nullptr) override {
    torch::NoGradGuard g;
    for (auto& p : param_groups()[0].params())
      if (p.grad().defined()) p.add_(p.grad(), -lr_);
    ++steps;
    return {};
  }
  int steps = 0;

 private:
  double lr_;
};

}  // namespace lttest
