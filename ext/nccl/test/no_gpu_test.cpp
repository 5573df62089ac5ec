// What lockstep::cuda and lockstep::nccl do on a machine WITHOUT a usable GPU (the CI machine):
// registration, argument checks that need no device, and clean errors, on every rank and
// without a hang, where a device would be needed. On a machine with a GPU the no-device cases
// are not exercised (they check device_count() first, identically on every rank).
#include <catch2/catch.hpp>
#include <mpi.h>

#include <string>
#include <vector>

#include "lockstep/cuda.hpp"
#include "lockstep/lockstep.hpp"
#include "lockstep/nccl.hpp"

namespace ls = lockstep;

namespace {
// True on every rank iff no rank sees a device.
bool no_gpu_anywhere() {
  int mine = ls::cuda::device_count(), most = 0;
  MPI_Allreduce(&mine, &most, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return most == 0;
}
}  // namespace

TEST_CASE("cuda::init registers the device runtime; device_count never throws", "[cuda][nogpu]") {
  ls::cuda::init();
  ls::cuda::init();  // idempotent
  CHECK(ls::find_device_runtime() != nullptr);
  int n = -1;
  CHECK_NOTHROW(n = ls::cuda::device_count());
  CHECK(n >= 0);
  CHECK(ls::cuda::is_available() == (n > 0));
}

TEST_CASE("cuda kernels reject views that are not on a cuda device, before any CUDA call",
          "[cuda][nogpu]") {
  ls::Tensor h = ls::Tensor::zeros({8});
  CHECK_THROWS_AS(ls::cuda::scale(h.view(), 2.0), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::cuda::divide(h.view(), 0.0), ls::InvalidArgument);
  std::vector<ls::TensorView> parts = {h.view()};
  CHECK_THROWS_AS(ls::cuda::pack(parts, h.view()), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::cuda::unpack(h.view(), parts), ls::InvalidArgument);
  const ls::cuda::SgdSpan s{h.view(), h.view(), {}};
  CHECK_THROWS_WITH(ls::cuda::sgd_update({&s, 1}, ls::math::sgd_coeffs<float>(0.1, 0, 0, 0, false, 1)),
                    Catch::Contains("not on a cuda device"));
  const ls::cuda::AdamSpan a{h.view(), h.view(), h.view(), h.view()};
  CHECK_THROWS_AS(ls::cuda::adam_update({&a, 1}, ls::math::adam_coeffs<float>(1e-3, 0.9, 0.999, 1e-8, 0, false, 1)),
                  ls::InvalidArgument);
  // Nothing to do is not an error.
  CHECK_NOTHROW(ls::cuda::adam_update({}, ls::math::adam_coeffs<float>(1e-3, 0.9, 0.999, 1e-8, 0, false, 1)));
}

TEST_CASE("without a GPU, a cuda tensor fails with CudaError naming the CUDA error", "[cuda][nogpu]") {
  if (!no_gpu_anywhere()) {
    SUCCEED("a GPU is present: the no-device path is not exercised here");
    return;
  }
  CHECK_THROWS_AS(ls::Tensor::zeros({4}, ls::DType::f32, ls::Device::cuda(0)), ls::CudaError);
  CHECK_THROWS_WITH(ls::Tensor::zeros({4}, ls::DType::f32, ls::Device::cuda(0)), Catch::Contains("failed: cudaError"));
  CHECK_THROWS_AS(ls::cuda::Stream::create(0), ls::CudaError);
}

TEST_CASE("without a GPU, MPIBackend with a cuda view throws CudaError on every rank",
          "[mpi][cuda][nogpu]") {
  if (!no_gpu_anywhere()) {
    SUCCEED("a GPU is present: the no-device path is not exercised here");
    return;
  }
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  std::vector<float> host(16, 1.0f);
  // Host memory labelled cuda: the backend synchronises the device before touching it, which
  // fails here on every rank alike, before any MPI call (so no rank is left waiting).
  ls::TensorView v{host.data(), 16, ls::DType::f32, ls::Device::cuda(0)};
  CHECK_THROWS_AS(b.allreduce(v, ls::ReduceOp::sum), ls::CudaError);
  CHECK_THROWS_AS(b.iallreduce(v, ls::ReduceOp::sum), ls::CudaError);
  b.barrier();  // every rank got here: no one is stuck in a collective
}

TEST_CASE("without a GPU, NCCLBackend fails on every rank with a clear error, no hang",
          "[nccl][nogpu]") {
  if (!no_gpu_anywhere()) {
    SUCCEED("a GPU is present: the no-device path is not exercised here");
    return;
  }
  CHECK_THROWS_WITH(ls::NCCLBackend(MPI_COMM_WORLD), Catch::Contains("no CUDA device is visible"));
  CHECK_THROWS_AS(ls::initialize<ls::NCCLBackend>(), ls::Error);
  CHECK_FALSE(ls::initialized<ls::NCCLBackend>());
  CHECK_THROWS_WITH(ls::get_distributed_backend<ls::NCCLBackend>(), Catch::Contains("initialize<lockstep::NCCLBackend>"));
  ls::get_distributed_backend<ls::MPIBackend>().barrier();
}
