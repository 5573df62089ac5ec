#pragma once  // the 0.1.0 path, kept for one release; removed in 0.3.0: include "lockstep/train/synchronize.hpp" instead
#include "lockstep/train/synchronize.hpp"
