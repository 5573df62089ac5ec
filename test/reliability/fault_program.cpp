// A small training-like program for the reliability tests: a fixed sequence of collectives at
// distinct call sites. Faults come from LOCKSTEP_FAULT, checks and deadlines from LOCKSTEP_CHECK
// and LOCKSTEP_TIMEOUT. Each rank writes what happened ("OK" or "<ErrorType>: <message>") to
// <outdir>/rank<R>.txt, which run_fault.sh then checks rank by rank.
//
// Usage: fault_program <outdir> [steps]
//            [blocking|nonblocking|optimizer|sharded|remote|synchronize|checkpoint|verify]
//   nonblocking: the loop's allreduce is an iallreduce followed by wait() (as DistributedOptimizer
//   reduces its buckets), so that the deadline of Request::wait is exercised.
//   optimizer: `steps` DistributedOptimizer(SGD) updates with skip_non_finite and
//   check_replicas_every = 1; reports "OK skipped=S applied=A".
//   sharded: `steps` DistributedOptimizer(Adam) updates with the optimizer state sharded across
//   the ranks (reduce-scatter of the gradients, each rank's shard step, allgather of the
//   parameters); reports "OK applied=A".
//   remote: rank 0 drives (run_driver) `steps` rounds of a remote call to every other rank (a
//   64 KiB tensor each way), the others serve; reports "OK calls=C".
//   synchronize, checkpoint: `steps` synchronize calls or collective checkpoint saves (to
//   <outdir>/ck.safetensors); verify: one process without MPI checks that file is one save whole.
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

namespace {

std::string report_path(const std::string& outdir, int rank) {
  return outdir + "/rank" + std::to_string(rank) + ".txt";
}

// Writes the rank's report whole (a temporary file renamed into place), so a rank that sees a
// peer's file sees all of it.
void report(const std::string& outdir, const std::string& text) {
  int rank = 0, init = 0;
  MPI_Initialized(&init);
  if (init) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string path = report_path(outdir, rank);
  {
    std::ofstream out(path + ".part");
    out << text << "\n";
  }
  std::rename((path + ".part").c_str(), path.c_str());
  std::cerr << "[rank " << rank << "] " << text << "\n";
}

// After an error that leaves the backend unusable, a rank ends without MPI_Finalize and mpiexec
// then ends the whole job at once: a rank that exited first would take with it a peer that had
// not yet written its own report. So under run_fault.sh (FAULT_PROGRAM_AWAIT_REPORTS=1) a failing
// rank waits, at most 10 s, until every other rank has written its report, except the one the
// job ends while it is stalled (FAULT_PROGRAM_ENDED_RANK). The reports share one directory.
void await_peer_reports(const std::string& outdir) {
  int init = 0, size = 1;
  MPI_Initialized(&init);
  const char* await = std::getenv("FAULT_PROGRAM_AWAIT_REPORTS");
  if (!init || await == nullptr || std::string(await) != "1") return;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const char* ended = std::getenv("FAULT_PROGRAM_ENDED_RANK");
  const int stalled = ended != nullptr && *ended != '\0' ? std::atoi(ended) : -1;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (int r = 0; r < size; ++r) {
    if (r == stalled) continue;
    while (!std::ifstream(report_path(outdir, r)) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// The work: `steps` allreduces at one call site (a training loop), a broadcast, a barrier.
std::string run(ls::MPIBackend& b, int steps, bool nonblocking) {
  ls::Tensor grads = ls::Tensor::full({16}, 1.0);
  ls::Tensor params = ls::Tensor::zeros({8});
  for (int step = 0; step < steps; ++step) {
    if (nonblocking) {
      ls::Request r = b.iallreduce(grads, ls::ReduceOp::sum);     // a bucket's reduction
      r.wait();
    } else {
      ls::allreduce(b, grads, ls::ReduceOp::sum);                  // the training loop's sync
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));   // "compute"
  }
  ls::broadcast(b, params, 0);                                      // parameters from rank 0
  ls::barrier(b);                                                   // end of the epoch
  bool finite = true;
  for (float g : grads.span<float>()) finite = finite && std::isfinite(g);
  return finite ? "OK" : "OK (non-finite values in the result)";
}

struct Params {
  ls::Tensor w, b;
};
LOCKSTEP_FIELDS(Params, w, b)

std::string run_optimizer(ls::MPIBackend& b, int steps) {
  Params model{ls::Tensor::full({16}, 1.0), ls::Tensor::full({3}, 0.5)};
  auto opt = ls::DistributedOptimizer(
      b, ls::SGD{.lr = 0.1f}, ls::DistributedOptions{.skip_non_finite = true, .check_replicas_every = 1});
  auto state = ls::setup(opt, model);
  for (int step = 0; step < steps; ++step) {
    Params grads{ls::Tensor::full({16}, 1.0), ls::Tensor::full({3}, 2.0)};
    ls::update(state, model, grads);
  }
  return "OK skipped=" + std::to_string(state.skipped_steps()) + " applied=" + std::to_string(state.applied_steps());
}

// A sharded optimizer step across hosts (test/multihost/host_faults.sh): 64 Ki parameters, so
// that every rank's shard holds some of both tensors.
std::string run_sharded(ls::MPIBackend& b, int steps) {
  Params model{ls::Tensor::full({64 * 1024}, 1.0), ls::Tensor::full({3}, 0.5)};
  auto opt = ls::DistributedOptimizer(b, ls::Adam{.lr = 1e-3f}, ls::DistributedOptions{.shard_optimizer_state = true});
  auto state = ls::setup(opt, model);
  if (!state.sharded()) return "other error: the optimizer state is not sharded";
  for (int step = 0; step < steps; ++step) {
    Params grads{ls::Tensor::full({64 * 1024}, 0.01), ls::Tensor::full({3}, 0.02)};
    ls::update(state, model, grads);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "OK applied=" + std::to_string(state.applied_steps());
}

// A remote call across hosts: the driver sends a tensor to every other rank and gets it back.
ls::Tensor fault_echo(ls::Tensor t) { return t; }
LOCKSTEP_REMOTE(fault_echo)

std::string run_remote(ls::MPIBackend& b, int steps) {
  const long calls = ls::run_driver(b, [&] {
    long n = 0;
    for (int step = 0; step < steps; ++step) {
      std::vector<ls::Future<ls::Tensor>> out;
      for (int r = 1; r < b.size(); ++r) out.push_back(ls::remote_async_call(b, r, fault_echo, ls::Tensor::ones({16 * 1024})));
      n += static_cast<long>(ls::wait_all(out).size());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return n;
  });
  return "OK calls=" + std::to_string(calls);
}

// Cross-host faults (test/multihost/host_faults.sh): `steps` synchronize calls of a 1 MiB model
// from rank 0, or `steps` collective checkpoint saves to <outdir>/ck.safetensors, each of a model
// whose every value is the step number (metadata "step"), so that `verify` can tell a file that
// is whole from one that mixes two saves.
std::string run_synchronize(ls::MPIBackend& b, int steps) {
  Params model{ls::Tensor::full({256 * 1024}, 1.0), ls::Tensor::full({3}, 0.5)};
  for (int step = 0; step < steps; ++step) {
    ls::synchronize(b, model, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "OK";
}

std::string run_checkpoint(ls::MPIBackend& b, const std::string& outdir, int steps) {
  for (int step = 0; step < steps; ++step) {
    Params model{ls::Tensor::full({4096}, step), ls::Tensor::full({3}, step)};
    ls::save_checkpoint(b, outdir + "/ck.safetensors", model, {{"step", std::to_string(step)}});
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "OK";
}

// One process, no MPI: <outdir>/ck.safetensors loads (its checksum holds) and is one save whole.
int verify_checkpoint(const std::string& outdir) {
  try {
    const ls::Checkpoint ck = ls::load_checkpoint(outdir + "/ck.safetensors");
    const std::string step = ck.metadata.at("step");
    Params model{ls::Tensor::zeros({4096}), ls::Tensor::zeros({3})};
    ls::restore_from_checkpoint(ck, model);
    for (const ls::Tensor* t : {&model.w, &model.b})
      for (float v : t->span<float>())
        if (v != std::stof(step)) {
          std::cout << "MIXED: step " << step << " holds " << v << "\n";
          return 1;
        }
    std::cout << "OK step=" << step << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cout << "BAD: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: fault_program <outdir> [steps]\n";
    return 2;
  }
  const std::string outdir = argv[1];
  const int steps = argc > 2 ? std::atoi(argv[2]) : 8;
  const std::string mode = argc > 3 ? argv[3] : "blocking";
  const bool nonblocking = mode == "nonblocking";
  if (mode == "verify") return verify_checkpoint(outdir);
  int code = 0;
  try {
    ls::initialize<ls::MPIBackend>();
    auto& b = ls::get_distributed_backend<ls::MPIBackend>();
    const bool optimizer = argc > 3 && std::string(argv[3]) == "optimizer";
    report(outdir, optimizer                ? run_optimizer(b, steps)
                   : mode == "synchronize" ? run_synchronize(b, steps)
                   : mode == "sharded"     ? run_sharded(b, steps)
                   : mode == "remote"      ? run_remote(b, steps)
                   : mode == "checkpoint"  ? run_checkpoint(b, outdir, steps)
                                           : run(b, steps, nonblocking));
  } catch (const ls::MismatchError& e) {
    report(outdir, std::string("MismatchError: ") + e.what());
    code = 3;
  } catch (const ls::TimeoutError& e) {
    report(outdir, std::string("TimeoutError: ") + e.what());
    code = 4;
  } catch (const ls::InvalidArgument& e) {
    report(outdir, std::string("InvalidArgument: ") + e.what());
    code = 5;
  } catch (const std::exception& e) {
    report(outdir, std::string("other error: ") + e.what());
    code = 6;
  }
  if (code != 0) await_peer_reports(outdir);
  ls::finalize<ls::MPIBackend>();
  return code;
}
