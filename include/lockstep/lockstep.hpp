// Lockstep: data-parallel training over MPI (and NCCL, with the extension).
// The umbrella header of the core: include this one.
#pragma once

#include "lockstep/config.hpp"
#include "lockstep/errors.hpp"
#include "lockstep/dtype.hpp"
#include "lockstep/tensor.hpp"
#include "lockstep/device_runtime.hpp"
#include "lockstep/backend.hpp"
#include "lockstep/mpi_backend.hpp"
#include "lockstep/world.hpp"
