#pragma once  // the 0.1.0 path, kept for one release; removed in 0.3.0: include "lockstep/mpi/mpi_backend.hpp" instead
#include "lockstep/mpi/mpi_backend.hpp"
