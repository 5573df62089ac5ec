// lockstep::torch::Join (see lockstep/torch/join.hpp).
#include "lockstep/torch/join.hpp"

#include "lockstep/reliability/call_site.hpp"

namespace lockstep::torch {

bool Join::next(bool has_batch, std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::Join::next");
  std::int32_t active = has_batch ? 1 : 0;
  backend_->allreduce(TensorView{&active, 1, DType::i32, Device::cpu()}, ReduceOp::sum, loc);
  active_ = active;
  if (active == 0) return false;
  ++steps_;
  if (!has_batch) ++joined_steps_;
  return true;
}

}  // namespace lockstep::torch
