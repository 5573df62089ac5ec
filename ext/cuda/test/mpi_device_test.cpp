// MPIBackend with cuda tensors, both paths: staged through pinned host memory (MPI not
// CUDA-aware) and device pointers handed to MPI (CUDA-aware MPI; exercised only where the MPI
// reports CUDA support). Every collective is compared with MPIBackend on host copies.
#include <catch2/catch.hpp>

#include <iostream>
#include <vector>

#include "gpu_test_util.hpp"
#include "lockstep/cuda.hpp"
#include "lockstep/lockstep.hpp"

namespace ls = lockstep;
namespace gt = lockstep::gpu_test;

namespace {
ls::Device my_device() {
  auto& world = ls::get_distributed_backend<ls::MPIBackend>();
  return ls::Device::cuda(world.local_rank() % ls::cuda::device_count());
}
const std::vector<ls::DType> kDtypes = {ls::DType::f32, ls::DType::f64, ls::DType::f16, ls::DType::bf16,
                                        ls::DType::i32};
}  // namespace

TEST_CASE("MPIBackend stages cuda tensors through pinned memory", "[mpi][cuda][staged]") {
  auto& ref = ls::get_distributed_backend<ls::MPIBackend>();
  ls::MPIBackend b(MPI_COMM_WORLD);
  b.set_cuda_aware(false);
  gt::Checker c;
  gt::sweep_collectives(b, ref, my_device(), c, kDtypes);
  const bool ok = gt::all_ranks(c.ok);
  if (!c.ok) std::cerr << c.log.str();
  REQUIRE(ok);
}

TEST_CASE("MPIBackend hands cuda tensors to a CUDA-aware MPI", "[mpi][cuda][aware]") {
  auto& ref = ls::get_distributed_backend<ls::MPIBackend>();
  ls::MPIBackend b(MPI_COMM_WORLD);
  // Detected (MPIX_Query_cuda_support) or forced with LOCKSTEP_CUDA_AWARE_MPI=1.
  const bool aware = gt::all_ranks(b.cuda_aware());
  if (!aware) {
    WARN("this MPI is not CUDA-aware: the direct path was not exercised (set "
         "LOCKSTEP_CUDA_AWARE_MPI=1 only with an MPI built with CUDA support)");
    SUCCEED("skipped: MPI is not CUDA-aware");
    return;
  }
  gt::Checker c;
  gt::sweep_collectives(b, ref, my_device(), c, kDtypes);
  const bool ok = gt::all_ranks(c.ok);
  if (!c.ok) std::cerr << c.log.str();
  REQUIRE(ok);
}

TEST_CASE("MPIBackend waits for the producing stream before MPI reads a cuda tensor",
          "[mpi][cuda][staged]") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  const ls::Device dev = my_device();
  ls::cuda::Stream user = ls::cuda::Stream::create(dev.index);  // non-blocking: not ordered with ours
  const std::int64_t n = 1 << 22;
  ls::Tensor h = gt::make_host(ls::DType::f32, n, [&](std::int64_t i) { return gt::value(b.rank(), i, 0, ls::ReduceOp::sum, ls::DType::f32); });
  ls::Tensor d = h.to(dev);
  // Queued, not finished, when allreduce starts: without the synchronisation MPI would see the
  // unscaled values (the Flux.jl #2591 failure: wrong averages).
  for (int k = 0; k < 8; ++k) ls::cuda::scale(d.view(), 2.0, user.get());
  b.allreduce(d.view(), ls::ReduceOp::sum);
  for (std::int64_t i = 0; i < n; ++i) h.data<float>()[i] *= 256.0f;
  b.allreduce(h.view(), ls::ReduceOp::sum);
  gt::Checker c;
  c.compare(d, h, 0, "allreduce after a kernel on the user's stream");
  const bool ok = gt::all_ranks(c.ok);
  if (!c.ok) std::cerr << c.log.str();
  REQUIRE(ok);
}

TEST_CASE("MPIBackend nonblocking ops on cuda tensors reuse pooled pinned buffers",
          "[mpi][cuda][staged]") {
  auto& ref = ls::get_distributed_backend<ls::MPIBackend>();
  ls::MPIBackend b(MPI_COMM_WORLD);
  b.set_cuda_aware(false);
  const ls::Device dev = my_device();
  gt::Checker c;
  for (int round = 0; round < 3; ++round) {  // later rounds take their buffers from the pool
    std::vector<ls::Tensor> host, device;
    std::vector<ls::Request> reqs;
    for (std::int64_t n : {1, 100, 5000, 100000, 7}) {
      host.push_back(gt::make_host(ls::DType::f32, n, [&](std::int64_t i) { return gt::value(ref.rank(), i, round, ls::ReduceOp::sum, ls::DType::f32); }));
      device.push_back(host.back().to(dev));
    }
    for (auto& d : device) reqs.push_back(b.iallreduce(d.view(), ls::ReduceOp::sum));  // all in flight
    for (auto& h : host) ref.allreduce(h.view(), ls::ReduceOp::sum);
    for (auto& r : reqs) r.wait();
    for (std::size_t i = 0; i < host.size(); ++i) c.compare(device[i], host[i], 0, "iallreduce in flight together");
  }
  const bool ok = gt::all_ranks(c.ok);
  if (!c.ok) std::cerr << c.log.str();
  REQUIRE(ok);
}
