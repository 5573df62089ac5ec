// NCCLBackend: every collective on cuda buffers against MPIBackend on host buffers, grouped
// reductions, host fallback, argument errors, and the global initialize/get hooks.
#include <catch2/catch.hpp>

#include <iostream>
#include <vector>

#include "../../cuda/test/gpu_test_util.hpp"
#include "lockstep/lockstep.hpp"
#include "lockstep/nccl.hpp"

namespace ls = lockstep;
namespace gt = lockstep::gpu_test;

namespace {
// The global backend, created on first use so that each test case also runs alone.
ls::NCCLBackend& nccl_backend() {
  ls::initialize<ls::NCCLBackend>();
  return ls::get_distributed_backend<ls::NCCLBackend>();
}
}  // namespace

TEST_CASE("NCCLBackend: initialize and get_distributed_backend", "[nccl]") {
  ls::initialize<ls::NCCLBackend>();
  ls::initialize<ls::NCCLBackend>();  // idempotent
  REQUIRE(ls::initialized<ls::NCCLBackend>());
  auto& nccl = nccl_backend();
  auto& mpi = ls::get_distributed_backend<ls::MPIBackend>();
  CHECK(nccl.name() == "nccl");
  CHECK(nccl.rank() == mpi.rank());
  CHECK(nccl.size() == mpi.size());
  CHECK(nccl.local_rank() == mpi.local_rank());
  CHECK(nccl.device() == mpi.local_rank() % ls::cuda::device_count());
  CHECK_FALSE(nccl.aborted());
}

TEST_CASE("NCCLBackend: every collective on cuda buffers equals MPI on the host", "[nccl]") {
  auto& nccl = nccl_backend();
  auto& ref = ls::get_distributed_backend<ls::MPIBackend>();
  gt::Checker c;
  gt::sweep_collectives(nccl, ref, ls::Device::cuda(nccl.device()), c,
                        {ls::DType::f32, ls::DType::f64, ls::DType::f16, ls::DType::bf16, ls::DType::i32,
                         ls::DType::i64, ls::DType::u8});
  const bool ok = gt::all_ranks(c.ok);
  if (!c.ok) std::cerr << c.log.str();
  REQUIRE(ok);
}

TEST_CASE("NCCLBackend: host tensors go through MPI", "[nccl]") {
  auto& nccl = nccl_backend();
  auto& ref = ls::get_distributed_backend<ls::MPIBackend>();
  gt::Checker c;
  gt::sweep_collectives(nccl, ref, ls::Device::cpu(), c, {ls::DType::f32, ls::DType::bf16});
  const bool ok = gt::all_ranks(c.ok);
  if (!c.ok) std::cerr << c.log.str();
  REQUIRE(ok);
}

TEST_CASE("NCCLBackend: allreduce_many reduces a set of buckets in one group", "[nccl]") {
  auto& nccl = nccl_backend();
  auto& ref = ls::get_distributed_backend<ls::MPIBackend>();
  const ls::Device dev = ls::Device::cuda(nccl.device());
  gt::Checker c;
  for (ls::ReduceOp op : {ls::ReduceOp::sum, ls::ReduceOp::avg}) {
    std::vector<ls::Tensor> host, device;
    std::vector<ls::TensorView> views;
    int k = 0;
    for (std::int64_t n : {0, 1, 1000, 262147, 3}) {
      const ls::DType dt = (k++ % 2) ? ls::DType::f32 : ls::DType::bf16;  // mixed dtypes in one group
      host.push_back(gt::make_host(dt, n, [&](std::int64_t i) { return gt::value(ref.rank(), i, k, op, dt); }));
      device.push_back(host.back().to(dev));
      views.push_back(device.back().view());
    }
    nccl.allreduce_many(views, op);
    for (std::size_t i = 0; i < host.size(); ++i) {
      ref.allreduce(host[i].view(), op);
      c.compare(device[i], host[i], op == ls::ReduceOp::avg ? gt::avg_tolerance(host[i].dtype()) : 0,
                "allreduce_many bucket " + std::to_string(i));
    }
    ls::Request r = nccl.iallreduce_many(views, ls::ReduceOp::max);
    r.wait();
    for (std::size_t i = 0; i < host.size(); ++i) {
      ref.allreduce(host[i].view(), ls::ReduceOp::max);
      c.compare(device[i], host[i], 0, "iallreduce_many bucket " + std::to_string(i));
    }
  }
  const bool ok = gt::all_ranks(c.ok);
  if (!c.ok) std::cerr << c.log.str();
  REQUIRE(ok);
}

TEST_CASE("NCCLBackend: collectives follow the work queued on the current stream", "[nccl]") {
  auto& nccl = nccl_backend();
  auto& ref = ls::get_distributed_backend<ls::MPIBackend>();
  const ls::Device dev = ls::Device::cuda(nccl.device());
  ls::cuda::Stream user = ls::cuda::Stream::create(dev.index);
  const std::int64_t n = 1 << 22;
  ls::Tensor h = gt::make_host(ls::DType::f32, n, [&](std::int64_t i) { return gt::value(ref.rank(), i, 3, ls::ReduceOp::sum, ls::DType::f32); });
  ls::Tensor d = h.to(dev);
  {
    ls::cuda::StreamGuard guard(user);  // the producer's stream is the current stream
    for (int k = 0; k < 8; ++k) ls::cuda::scale(d.view(), 2.0);
    nccl.allreduce(d.view(), ls::ReduceOp::sum);
  }
  for (std::int64_t i = 0; i < n; ++i) h.data<float>()[i] *= 256.0f;
  ref.allreduce(h.view(), ls::ReduceOp::sum);
  gt::Checker c;
  c.compare(d, h, 0, "allreduce after kernels on the current stream");
  const bool ok = gt::all_ranks(c.ok);
  if (!c.ok) std::cerr << c.log.str();
  REQUIRE(ok);
}

TEST_CASE("NCCLBackend: bad arguments throw before any communication", "[nccl]") {
  auto& nccl = nccl_backend();
  const ls::Device dev = ls::Device::cuda(nccl.device());
  ls::Tensor a = ls::Tensor::zeros({8}, ls::DType::f32, dev);
  ls::Tensor b = ls::Tensor::zeros({9}, ls::DType::f32, dev);
  ls::Tensor i = ls::Tensor::zeros({8}, ls::DType::i32, dev);
  ls::Tensor h = ls::Tensor::zeros({8}, ls::DType::f32);
  CHECK_THROWS_AS(nccl.allreduce(a.view(), b.view(), ls::ReduceOp::sum), ls::InvalidArgument);
  CHECK_THROWS_AS(nccl.allreduce(a.view(), h.view(), ls::ReduceOp::sum), ls::InvalidArgument);
  CHECK_THROWS_AS(nccl.allreduce(i.view(), ls::ReduceOp::avg), ls::InvalidArgument);
  CHECK_THROWS_AS(nccl.broadcast(a.view(), nccl.size()), ls::InvalidArgument);
  CHECK_THROWS_AS(nccl.allgather(a.view(), b.view()), ls::InvalidArgument);
  std::vector<ls::TensorView> mixed = {a.view(), h.view()};
  CHECK_THROWS_AS(nccl.allreduce_many(mixed, ls::ReduceOp::sum), ls::InvalidArgument);
  ls::Tensor other = ls::Tensor::borrow(a.raw_data(), {8}, ls::DType::f32, ls::Device::cuda(nccl.device() + 1));
  CHECK_THROWS_AS(nccl.allreduce(other.view(), ls::ReduceOp::sum), ls::InvalidArgument);
  CHECK_FALSE(nccl.aborted());
}

TEST_CASE("NCCLBackend: a second backend over a duplicate communicator, and finalize", "[nccl]") {
  ls::NCCLBackend own(MPI_COMM_WORLD, ls::NCCLBackend::Options{.device = nccl_backend().device()});
  ls::Tensor t = ls::Tensor::full({5}, 1.0, ls::DType::f32, ls::Device::cuda(own.device()));
  own.allreduce(t.view(), ls::ReduceOp::sum);
  ls::Tensor back = t.to(ls::Device::cpu());
  bool ok = true;
  for (float v : back.span<float>()) ok = ok && v == static_cast<float>(own.size());
  ls::NCCLBackend moved = std::move(own);
  moved.barrier();
  REQUIRE(gt::all_ranks(ok));
  ls::finalize<ls::NCCLBackend>();
  CHECK_FALSE(ls::initialized<ls::NCCLBackend>());
  CHECK_THROWS_AS(ls::get_distributed_backend<ls::NCCLBackend>(), ls::Error);
}
