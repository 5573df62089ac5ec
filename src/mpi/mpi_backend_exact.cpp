// MPIBackend's exact sum of deterministic mode (Backend::do_exact_sum): fused into the
// shared-memory path where every rank is on one machine (ShmCollectives::exact_sum); the caller's
// int64 path otherwise (across machines, one rank).
#include "mpi/mpi_backend_impl.hpp"

namespace lockstep {

bool MPIBackend::do_exact_sum(const detail::ExactSumCall& call) try {
  check_usable();
  // The same answer on every rank: the shared-memory path exists on every rank or on none.
  if (!impl_->shm || impl_->size == 1) return false;
  // Fingerprinted as the f32 allreduce with sum that the values' bytes make between the ranks;
  // the shared-memory header tells the exact sum apart. An injected fault may change the count:
  // the header carries it, so the ranks see the disagreement.
  // The view's data is the part holding element 0 (an injected NaN lands in the values).
  float* first = nullptr;
  for (std::int64_t j = 0; j < call.nparts; ++j)
    if (call.parts[j].at == 0 && call.parts[j].n > 0) first = const_cast<float*>(call.parts[j].x);
  TensorView data{first, call.numel, DType::f32, Device::cpu()};
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::allreduce, &data, data.numel,
                                static_cast<int>(ReduceOp::sum), -1);  // reliability hook
  if (guard.skipped()) return true;
  detail::ExactSumCall agreed = call;
  agreed.numel = data.numel;
  return impl_->shm->exact_sum(agreed);
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

std::uint64_t MPIBackend::exact_sums_fused() const noexcept {
  return impl_ && impl_->shm ? impl_->shm->exact_sums() : 0;
}

}  // namespace lockstep
