// A sharded (ZeRO-1) training loop with DistributedOptions::rescue_buddy, for
// rescue_buddy.sh: a collective that fails makes each survivor write its shard rescue file;
// `resume` assembles the whole state from the survivors' files (resume_freshest) and goes on.
// The gradients are exact in any rank count (each element comes from one rank, the others add
// zero), so the final model hash is the same bits at any size, interrupted or not.
//
//   rescue_buddy_main STEPS [resume] [plain]     (plain: without rescue_buddy)
// Rescue directory: LOCKSTEP_RESCUE_DIR (per simulated host, set by the script).
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

namespace buddytest {
struct Net {
  ls::Tensor w, b;
};
LOCKSTEP_FIELDS(Net, w, b)
}  // namespace buddytest

int run(int argc, char** argv) {
  auto& backend = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = backend.rank(), n = backend.size();
  const long steps = argc > 1 ? std::atol(argv[1]) : 12;
  bool resume = false, plain = false;
  for (int i = 2; i < argc; ++i) {
    resume = resume || std::strcmp(argv[i], "resume") == 0;
    plain = plain || std::strcmp(argv[i], "plain") == 0;
  }
  buddytest::Net net{ls::Tensor::empty({37, 29}), ls::Tensor::empty({53})};
  for (ls::Tensor* t : {&net.w, &net.b}) {
    auto s = t->span<float>();
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = 0.125f * static_cast<float>(static_cast<int>(i % 13) - 6);
  }
  buddytest::Net grads{ls::Tensor::zeros({37, 29}), ls::Tensor::zeros({53})};
  ls::DistributedOptions o;
  o.op = ls::ReduceOp::sum;
  o.shard_optimizer_state = true;
  o.rescue_buddy = !plain;
  o.bucket_bytes = 1024;  // several buckets: a shard of several ranges
  ls::DistributedOptimizer opt(backend, ls::Adam{.lr = 0.01f}, o);
  auto state = ls::setup(opt, net);
  const auto dir = ls::rescue_directory();
  std::int64_t done = 0;
  if (resume) {
    auto both = std::tie(net, state);
    auto found = ls::resume_freshest(backend, both, dir, {});
    if (!found) {
      if (rank == 0) std::printf("no state to resume from\n");
      return 2;
    }
    done = found->step;
    if (rank == 0)
      std::printf("resumed from %s of rank %d (step %lld, %s, rescue %d)\n", found->path.c_str(), found->holder,
                  static_cast<long long>(found->step), found->hash.c_str(), found->rescue ? 1 : 0);
  }
  for (; done < steps; ++done) {
    // Step s's gradient: a few bits per element, each element from rank (i % n) alone.
    const auto s = static_cast<int>(done + 1);
    std::size_t at = 0;
    for (ls::Tensor* g : {&grads.w, &grads.b}) {
      auto v = g->span<float>();
      for (std::size_t i = 0; i < v.size(); ++i, ++at)
        v[i] = static_cast<int>(at % static_cast<std::size_t>(n)) == rank
                   ? static_cast<float>(static_cast<int>((at * 7 + static_cast<std::size_t>(s) * 3) % 17) - 8) / 16.0f
                   : 0.0f;
    }
    try {
      ls::update(state, net, grads);
    } catch (const std::exception& e) {
      if (!ls::is_collective_failure(e)) throw;
      std::fprintf(stderr, "rank %d: step %lld failed: %s\n", rank, static_cast<long long>(done + 1), e.what());
      ls::write_rescue_state(dir, done, rank, std::tie(net, state));
      return 3;
    }
  }
  if (rank == 0) std::printf("done: %ld steps on %d ranks, model hash %s\n", steps, n, ls::model_hash(net).c_str());
  return 0;
}

int main(int argc, char** argv) {
  ls::initialize<ls::MPIBackend>();
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
