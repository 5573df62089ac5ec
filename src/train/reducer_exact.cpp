// GradientReducer in deterministic mode (DistributedOptions::deterministic): every micro-batch's
// gradients go into exact sums (exact_sum.hpp), reduced once per step across the ranks.
#include "train/reducer_impl.hpp"

namespace lockstep {

void GradientReducer::Impl::setup_exact() {
  if (!options.deterministic) return;
  exact.clear();
  exact_out.clear();
  exact_ptrs.clear();
  for (const auto& leaf : leaves) {
    exact.emplace_back(leaf.numel);
    exact_out.push_back(Tensor::zeros(leaf.shape.empty() ? Shape{leaf.numel} : leaf.shape, DType::f32));
  }
  for (auto& t : exact_out) exact_ptrs.push_back(&t);
}

void GradientReducer::Impl::exact_add() {
  for (std::size_t j = 0; j < leaves.size(); ++j) {
    const Tensor& g = *bound[j];
    LOCKSTEP_CHECK_ARG(g.numel() == leaves[j].numel && g.dtype() == DType::f32 && g.device().is_cpu(),
                       "deterministic mode: gradient '", paths[j], "' is no longer host f32 of ", leaves[j].numel,
                       " elements (was it moved from or reassigned?)");
    exact[j].add(g.data<float>());
  }
}

const std::vector<Tensor*>& GradientReducer::Impl::exact_reduce() {
  // One exact reduction per tensor, in the reducer's order on every rank (the same calls
  // everywhere: the sizes are agreed at setup); the mean divides by the total of micro-batches.
  const bool mean = options.op == ReduceOp::avg;
  try {
    for (std::size_t j = 0; j < exact.size(); ++j) exact[j].reduce(*backend, exact_out[j].data<float>(), mean);
  } catch (...) {
    for (auto& e : exact) e.discard();
    throw;
  }
  return exact_ptrs;
}

}  // namespace lockstep
