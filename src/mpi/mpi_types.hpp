// Internal to the mpi layer: the MPI datatype and operator of every DType and ReduceOp, and
// avg's division on the host (defined in mpi_backend_types.cpp). Shared by MPIBackend and the
// hierarchical path, so that both reduce with the same operators (the 16-bit ones included).
#pragma once

#include <mpi.h>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep::detail::mpib {

/// The MPI datatype of t (f16 and bf16 travel as MPI_UINT16_T).
MPI_Datatype mpi_type(DType t);
/// The MPI operator of op for t (avg is sum; f16/bf16: Lockstep's user-defined operators,
/// created on first use and freed by free_half_ops()).
MPI_Op mpi_op(ReduceOp op, DType t);
/// Frees the f16/bf16 operators (finalize<MPIBackend>, before MPI_Finalize); mpi_op() creates
/// them again if MPI lives on (a program that owns MPI may initialise the backend again).
void free_half_ops() noexcept;
/// Divides every element of host memory by n, for avg.
void scale_host(TensorView v, int n);

}  // namespace lockstep::detail::mpib
