// Adversarial scenarios for the trust mechanisms (front-end checks, refusal notices, the
// shared-memory header exchange, deadlines, settings). Run by run_trust.sh, which checks every
// rank's lines and the time taken: each scenario may hang, end the job or give wrong data if a
// promise is broken. Each rank prints "rank R: <outcome>" lines, flushed.
#include <lockstep/lockstep.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "reliability/scenario.hpp"

namespace ls = lockstep;
using namespace lstest::scenario;

namespace {
// A user's Backend that forwards to another one (like test/training_common.hpp's
// CountingBackend); a refusal by this wrapper's front end is told to the ranks of the inner
// backend.
class Wrapper final : public lstest::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

 protected:
  void abandon(const CallInfo& call, const std::exception& e) override { forward_abandon(inner(), call, e); }
};
}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  ls::MPIBackend* world = start();
  if (world == nullptr) return 0;
  auto& b = *world;
  const int r = b.rank(), n = b.size();
  const bool last = r == n - 1;
  say(std::string("started, shared memory ") + (b.shared_memory() ? "on" : "off"));
  try {
    if (scenario == "settings") {
      say("OK");
    } else if (scenario == "mixed_reduce") {
      // Root uses the out-of-place form, the others the in-place form: for the others the two
      // forms are documented as the same call (in-place and out-of-place are the same operation).
      ls::Tensor send = ls::Tensor::full({4}, r + 1.0);
      ls::Tensor recv = ls::Tensor::zeros({4});
      if (r == 0) b.reduce(send, recv, ls::ReduceOp::sum, 0);
      else b.reduce(send, ls::ReduceOp::sum, 0);
      if (r == 0) say("reduce gave " + std::to_string(recv.data<float>()[0]));
      // The next broadcast must carry root's data.
      std::vector<std::uint8_t> bytes(256, r == 0 ? 7 : 0);
      b.broadcast(ls::TensorView{bytes.data(), 256, ls::DType::u8, ls::Device::cpu()}, 0);
      say("broadcast gave " + std::to_string(bytes[0]));
      ls::Tensor flag = ls::Tensor::full({1}, 1.0, ls::DType::i32);
      b.allreduce(flag, ls::ReduceOp::sum);
      say("OK");
    } else if (scenario == "refuse_then_continue") {
      // Unchecked. The last rank's first allreduce is refused (null pointer); it catches the
      // error and goes on with its next allreduce at once. The others are inside the first one.
      ls::Tensor x = ls::Tensor::full({8}, 1.0);
      ls::TensorView bad{nullptr, 8, ls::DType::f32, ls::Device::cpu()};
      const std::string first = outcome([&] { b.allreduce(last ? bad : x.view(), ls::ReduceOp::sum); });
      say("first: " + first + " value " + std::to_string(x.data<float>()[0]));
      ls::Tensor y = ls::Tensor::full({8}, 100.0);
      const std::string second = outcome([&] { b.allreduce(y, ls::ReduceOp::sum); });
      say("second: " + second + " value " + std::to_string(y.data<float>()[0]));
      say("usable " + std::to_string(b.usable()));
    } else if (scenario == "refuse_flood") {
      // Every rank refuses the same collective thousands of times (nothing moves anywhere, the
      // backend must stay usable and in step), then a correct one.
      ls::TensorView bad{nullptr, 8, ls::DType::f32, ls::Device::cpu()};
      int refused = 0;
      const char* count_env = std::getenv("ADV_REFUSALS");
      const int count = count_env != nullptr ? std::atoi(count_env) : 6000;
      for (int i = 0; i < count; ++i) {
        try {
          b.allreduce(bad, ls::ReduceOp::sum);
        } catch (const ls::InvalidArgument&) {
          ++refused;
        }
      }
      say("refused " + std::to_string(refused));
      ls::Tensor x = ls::Tensor::full({1024}, 1.0);
      for (int i = 0; i < 3; ++i) {
        b.allreduce(x, ls::ReduceOp::sum);
      }
      say("value " + std::to_string(x.data<float>()[0]) + " expected " + std::to_string(n * n * n));
      b.barrier();
      say("OK");
    } else if (scenario == "refuse_iallreduce_checked") {
      // LOCKSTEP_CHECK=always: the last rank's iallreduce is refused; the others issued theirs.
      ls::Tensor x = ls::Tensor::full({8}, 1.0);
      ls::TensorView bad{nullptr, 8, ls::DType::f32, ls::Device::cpu()};
      say("iallreduce: " + outcome([&] {
            ls::Request q = b.iallreduce(last ? bad : x.view(), ls::ReduceOp::sum);
            q.wait();
          }));
      say("usable " + std::to_string(b.usable()));
      ls::Tensor y = ls::Tensor::full({8}, 1.0);
      say("next allreduce: " + outcome([&] { b.allreduce(y, ls::ReduceOp::sum); }));
      say("DONE");
    } else if (scenario == "one_rank_timeout") {
      // A deadline set in code on rank 0 only (documented: the same on every rank).
      if (r == 0) ls::set_timeout(5);
      ls::Tensor x = ls::Tensor::full({16}, 1.0);
      std::string got = outcome([&] {
        for (int i = 0; i < 200; ++i) b.allreduce(x, ls::ReduceOp::sum);
        b.barrier();
      });
      say("loop: " + got);
      say("DONE");
    } else if (scenario == "huge_timeout") {
      // LOCKSTEP_TIMEOUT=1e300 (finite, accepted): collectives must not time out at once.
      ls::Tensor x = ls::Tensor::full({16}, 1.0);
      say("timeout " + std::to_string(ls::timeout()));
      say("allreduce: " + outcome([&] {
            for (int i = 0; i < 10; ++i) b.allreduce(x, ls::ReduceOp::sum);
            ls::Tensor big = ls::Tensor::ones({1 << 20});
            b.allreduce(big, ls::ReduceOp::sum);
            ls::Request q = b.iallreduce(x, ls::ReduceOp::sum);
            q.wait();
            b.barrier();
          }));
      say("DONE");
    } else if (scenario == "wrapper_refused") {
      // A user's Backend wrapping MPIBackend; the last rank's arguments are refused by the
      // wrapper's front end. The others must not wait for it until the default deadline.
      Wrapper w(b);
      ls::Tensor x = ls::Tensor::full({8}, 1.0);
      ls::TensorView bad{nullptr, 8, ls::DType::f32, ls::Device::cpu()};
      say("wrapped allreduce: " + outcome([&] { w.allreduce(last ? bad : x.view(), ls::ReduceOp::sum); }));
      // The refusing rank stays busy for a while (as a rank that handles its error would); the
      // others must have been told by then.
      if (last) std::this_thread::sleep_for(std::chrono::seconds(8));
      say("DONE");
    } else if (scenario == "reduce_root_bad_send") {
      // Root's send is refused by the front end (before the verdict broadcast); the others wait in
      // the verdict broadcast.
      ls::Tensor send = ls::Tensor::full({4}, 1.0);
      ls::Tensor recv = ls::Tensor::zeros({4});
      ls::TensorView bad{nullptr, 4, ls::DType::f32, ls::Device::cpu()};
      say("reduce: " + outcome([&] { b.reduce(r == 0 ? bad : send.view(), recv, ls::ReduceOp::sum, 0); }));
      say("DONE");
    } else {
      say("unknown scenario " + scenario);
      return 2;
    }
  } catch (const std::exception& e) {
    report(e);
    return 0;
  }
  return 0;
}
