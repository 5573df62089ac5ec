// Remote calls: the tests' hooks (remote/test_hooks.hpp), and the one per-thread setting of them
// that the executor reads.
#include "remote/test_hooks.hpp"

#include "remote/engine.hpp"

namespace lockstep::detail::remote {

thread_local double t_reply_tensor_delay = 0;

TestHooks& test_hooks() {
  static TestHooks h;
  return h;
}
void delay_reply_tensors_for_test(double seconds) { t_reply_tensor_delay = seconds; }

}  // namespace lockstep::detail::remote
