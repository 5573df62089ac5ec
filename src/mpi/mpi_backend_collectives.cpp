// MPIBackend's blocking collectives, each described as a CollectiveCall and handed to
// run_collective (collective_sequence.cpp), which owns what happens to it: the monitor's scope,
// staging, the path after the agreement, flat MPI, the copy out and the error report.
#include "mpi/collective_sequence.hpp"
#include "mpi/mpi_backend_impl.hpp"

namespace lockstep {

using detail::CallKind;
using mpib::CollectiveCall;

void MPIBackend::do_broadcast(TensorView buf, int root) {
  mpib::run_collective(*impl_, CollectiveCall{.kind = CallKind::broadcast, .send = buf, .one_buffer = true,
                                              .root = root});
}

void MPIBackend::do_allreduce(TensorView buf, ReduceOp op) {
  mpib::run_collective(*impl_, CollectiveCall{.kind = CallKind::allreduce, .send = buf, .one_buffer = true, .op = op});
}

void MPIBackend::do_allreduce(TensorView send, TensorView recv, ReduceOp op) {
  mpib::run_collective(*impl_, CollectiveCall{.kind = CallKind::allreduce, .send = send, .recv = recv, .op = op});
}

void MPIBackend::do_reduce(TensorView buf, ReduceOp op, int root) {
  mpib::run_collective(*impl_, CollectiveCall{.kind = CallKind::reduce, .send = buf, .one_buffer = true, .op = op,
                                              .root = root});
}

void MPIBackend::do_reduce(TensorView send, TensorView recv, ReduceOp op, int root) {
  // Only the root's recv is written (the front end checks it there only).
  if (impl_->rank != root) recv = TensorView{};
  mpib::run_collective(*impl_, CollectiveCall{.kind = CallKind::reduce, .send = send, .recv = recv, .op = op,
                                              .root = root});
}

void MPIBackend::do_allgather(TensorView send, TensorView recv) {
  mpib::run_collective(*impl_, CollectiveCall{.kind = CallKind::allgather, .send = send, .recv = recv});
}

void MPIBackend::do_reduce_scatter(TensorView send, TensorView recv, ReduceOp op) {
  mpib::run_collective(*impl_, CollectiveCall{.kind = CallKind::reduce_scatter, .send = send, .recv = recv, .op = op});
}

void MPIBackend::do_barrier() { mpib::run_collective(*impl_, CollectiveCall{.kind = CallKind::barrier}); }

// The 16-bit wire forms of f32 host data: fused on a path (shared memory: the three passes in
// one; hierarchical: only the inter-host part on the 16-bit wire), else Backend's three passes.
void MPIBackend::do_allreduce_wire16(TensorView buf, DType wire, ReduceOp op) {
  if (!mpib::run_collective(*impl_, CollectiveCall{.kind = CallKind::allreduce_wire16, .send = buf,
                                                   .one_buffer = true, .op = op, .wire = wire}))
    Backend::do_allreduce_wire16(buf, wire, op);
}

void MPIBackend::do_reduce_scatter_wire16(TensorView send, TensorView recv, DType wire, ReduceOp op) {
  if (!mpib::run_collective(*impl_, CollectiveCall{.kind = CallKind::reduce_scatter_wire16, .send = send,
                                                   .recv = recv, .op = op, .wire = wire}))
    Backend::do_reduce_scatter_wire16(send, recv, wire, op);
}

}  // namespace lockstep
