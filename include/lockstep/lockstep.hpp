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
#include "lockstep/optim_math.hpp"
#include "lockstep/traverse.hpp"
#include "lockstep/synchronize.hpp"
#include "lockstep/rules.hpp"
#include "lockstep/distributed_optimizer.hpp"
#include "lockstep/data.hpp"
#include "lockstep/reliability.hpp"
#include "lockstep/replicas.hpp"
#include "lockstep/checkpoint.hpp"
#include "lockstep/remote.hpp"
