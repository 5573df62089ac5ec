#pragma once  // the 0.1.0 path, kept for one release; removed in 0.3.0: include "lockstep/core/device_runtime.hpp" instead
#include "lockstep/core/device_runtime.hpp"
