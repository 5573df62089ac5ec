// MPIBackend's 16-bit wire forms (allreduce_wire16, reduce_scatter_wire16 of f32 host data),
// fused where the ranks share memory (ShmCollectives) or span machines (HierarchicalCollectives:
// only the inter-host part on the 16-bit wire); Backend's three passes otherwise.
#include "mpi/mpi_backend_impl.hpp"

namespace lockstep {

void MPIBackend::do_allreduce_wire16(TensorView buf, DType wire, ReduceOp op) try {
  if (impl_->path) {
    // The path agrees on the call first, whatever its size (an empty call or one below the
    // path's threshold included), and only then says whether it moves it: false on every rank
    // alike, and then the three passes run, whose allreduce has its own agreement.
    bool taken = false;
    {
      // Fingerprinted as what goes between the ranks, a 16-bit allreduce with sum (the same
      // record as the three passes' allreduce over MPI); the path's record tells the two apart.
      TensorView onwire{buf.data, buf.numel, wire, Device::cpu()};
      detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::allreduce, &onwire, onwire.numel,
                                    static_cast<int>(ReduceOp::sum), -1);  // reliability hook
      if (guard.skipped()) return;
      // An injected fault may have changed the count or the dtype: the record carries them, so
      // the ranks see the disagreement. A dtype that is not a wire dtype any more goes as `wire`.
      const DType w = onwire.dtype == DType::bf16 || onwire.dtype == DType::f16 ? onwire.dtype : wire;
      taken = impl_->path->allreduce_wire16(static_cast<float*>(buf.data), onwire.numel, w, op);
    }
    if (taken) return;
  }
  Backend::do_allreduce_wire16(buf, wire, op);
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_reduce_scatter_wire16(TensorView send, TensorView recv, DType wire, ReduceOp op) try {
  if (impl_->path) {
    // Agreed first, as above.
    bool taken = false;
    {
      TensorView onwire{send.data, send.numel, wire, Device::cpu()};
      detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::reduce_scatter, &onwire, recv.numel,
                                    static_cast<int>(ReduceOp::sum), -1);  // reliability hook
      if (guard.skipped()) return;
      const DType w = onwire.dtype == DType::bf16 || onwire.dtype == DType::f16 ? onwire.dtype : wire;
      taken = impl_->path->reduce_scatter_wire16(static_cast<const float*>(send.data), static_cast<float*>(recv.data),
                                                 recv.numel, w, op);
    }
    if (taken) return;
  }
  Backend::do_reduce_scatter_wire16(send, recv, wire, op);
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

}  // namespace lockstep
