// Lockstep: data-parallel training over MPI (and NCCL, with the extension).
// The umbrella header of the core: include this one.
#pragma once

#include "lockstep/config.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/core/device_runtime.hpp"
#include "lockstep/comm/backend.hpp"
#include "lockstep/mpi/mpi_backend.hpp"
#include "lockstep/mpi/world.hpp"
#include "lockstep/train/optim_math.hpp"
#include "lockstep/core/traverse.hpp"
#include "lockstep/train/synchronize.hpp"
#include "lockstep/train/rules.hpp"
#include "lockstep/train/distributed_optimizer.hpp"
#include "lockstep/train/data.hpp"
#include "lockstep/reliability/settings.hpp"
#include "lockstep/train/replicas.hpp"
#include "lockstep/io/checkpoint.hpp"
#include "lockstep/io/model_hash.hpp"
#include "lockstep/io/rescue.hpp"
#include "lockstep/remote/remote.hpp"
