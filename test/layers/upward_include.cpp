// An include of a higher layer does not build: compiled with the include path of the train
// layer (test layers.upward_include_fails), the first include is found, the second is not.
#include "lockstep/train/synchronize.hpp"
#include "lockstep/io/checkpoint.hpp"
