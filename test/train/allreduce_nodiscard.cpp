// Must not compile with -Werror=unused-result (tests_20_training.cmake): the scalar allreduce
// returns the reduced value and leaves its argument unchanged, so a call that drops the result
// is a mistake the compiler names.
#include "lockstep/train/synchronize.hpp"

void drop(lockstep::Backend& b, double loss) { lockstep::allreduce(b, loss, lockstep::ReduceOp::avg); }
