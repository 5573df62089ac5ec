// Must not compile with -Werror=unused-result (tests_20_training.cmake): each function below
// drops a result that the API marks [[nodiscard]] with a reason, and the compiler names each.
//   - the scalar allreduce returns the reduced value and leaves its argument unchanged;
//   - a Request dropped where it is returned waits at once (the nonblocking call blocks);
//   - a Future dropped abandons the remote call, its result and its error.
#include "lockstep/remote/future.hpp"
#include "lockstep/train/synchronize.hpp"

void drop(lockstep::Backend& b, double loss) { lockstep::allreduce(b, loss, lockstep::ReduceOp::avg); }

void drop_request(lockstep::Backend& b, lockstep::TensorView grads) { b.iallreduce(grads, lockstep::ReduceOp::sum); }

lockstep::Future<double> remote_loss();
void drop_future() { remote_loss(); }
