// Trust: defects found by adversarial testing, each one a case that failed before the checks
// moved into Backend's front end and the shared-memory path agreed on its calls. Every case
// checks that EVERY rank got the error (locally recorded, combined after the last collective)
// and that the data is intact afterwards.
#include <catch2/catch.hpp>

#include <lockstep/lockstep.hpp>

#include <string>
#include <vector>

#include "test_support.hpp"

namespace ls = lockstep;
using namespace lstest;

namespace {
ls::MPIBackend& backend() { return world_backend(); }
}  // namespace

TEST_CASE("reduce: a bad recv on root is the same error on every rank, and the next reduce is right") {
  ls::MPIBackend& b = backend();
  const int n = b.size(), r = b.rank();
  ls::Tensor send = ls::Tensor::full({4}, r + 1.0);
  ls::Tensor bad = ls::Tensor::zeros({3});  // one element short
  ls::Tensor good = ls::Tensor::zeros({4});
  const std::string got = expect_throw<ls::InvalidArgument>(
      [&] { b.reduce(send, r == 0 ? bad.view() : ls::TensorView{}, ls::ReduceOp::sum, 0); });
  bool ok = got.rfind("ok: ", 0) == 0 && got.find("elements") != std::string::npos;
  // No contribution was left in flight: the next reduce sees exactly this call's data.
  ls::Tensor send2 = ls::Tensor::full({4}, 10.0 * (r + 1));
  b.reduce(send2, r == 0 ? good.view() : ls::TensorView{}, ls::ReduceOp::sum, 0);
  if (r == 0) ok = ok && good.data<float>()[0] == 10.0f * n * (n + 1) / 2;
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("shared-memory path: calls that would take different paths are a MismatchError on every rank") {
  ls::MPIBackend& b = backend();
  if (!b.shared_memory()) {
    // One rank, or LOCKSTEP_SHM=0: the same calls go to MPI, where counts that differ are MPI's
    // business; nothing to check here.
    SUCCEED("no shared-memory path at this size");
    return;
  }
  const int r = b.rank();
  // 2048 f32 (8 KiB: the shared-memory path) against 512 f32 (2 KiB: MPI) — each rank alone
  // would have chosen a different path and waited forever.
  ls::Tensor big = ls::Tensor::ones({2048});
  ls::Tensor small = ls::Tensor::ones({512});
  const std::string a = expect_throw<ls::MismatchError>(
      [&] { b.allreduce(r == 0 ? big.view() : small.view(), ls::ReduceOp::sum); });
  // f32 against f16 of the same bytes.
  ls::Tensor f32 = ls::Tensor::ones({2048}, ls::DType::f32);
  ls::Tensor f16 = ls::Tensor::zeros({4096}, ls::DType::f16);
  const std::string c = expect_throw<ls::MismatchError>(
      [&] { b.allreduce(r == 0 ? f32.view() : f16.view(), ls::ReduceOp::sum); });
  // Broadcast from different roots, below and above one slice.
  const std::string d = expect_throw<ls::MismatchError>([&] { b.broadcast(big, r == 0 ? 0 : 1); });
  bool ok = a.rfind("ok: ", 0) == 0 && c.rfind("ok: ", 0) == 0 && d.rfind("ok: ", 0) == 0;
  // Buffers untouched, and the backend still usable.
  for (int i = 0; i < 2048; ++i) ok = ok && big.data<float>()[i] == 1.0f;
  ls::Tensor after = ls::Tensor::ones({4096});
  b.allreduce(after, ls::ReduceOp::sum);
  ok = ok && after.data<float>()[4095] == static_cast<float>(b.size());
  INFO("rank " << r << ":\n  " << a << "\n  " << c << "\n  " << d);
  CHECK(all_ranks(b, ok));
}

TEST_CASE("a refused argument on one rank at a checked call is a MismatchError on every rank") {
  ls::MPIBackend& b = backend();
  const int r = b.rank();
  const ls::CheckLevel level = ls::check_level();
  ls::set_check_level(ls::CheckLevel::always);
  ls::Tensor x = ls::Tensor::ones({16});
  ls::TensorView null_on_last{nullptr, 16, ls::DType::f32, ls::Device::cpu()};
  const bool last = r == b.size() - 1;
  std::string got;
  try {
    b.allreduce(last && b.size() > 1 ? null_on_last : x.view(), ls::ReduceOp::sum);
    got = b.size() == 1 ? "ok: one rank" : "no exception";
  } catch (const ls::MismatchError& e) {
    got = std::string("ok: ") + e.what();
  } catch (const ls::InvalidArgument& e) {
    got = b.size() == 1 ? std::string("ok: ") + e.what() : std::string("wrong exception: ") + e.what();
  } catch (const std::exception& e) {
    got = std::string("wrong exception: ") + e.what();
  }
  bool ok = got.rfind("ok: ", 0) == 0;
  if (b.size() > 1) ok = ok && got.find("refused") != std::string::npos && got.find("null data") != std::string::npos;
  for (int i = 0; i < 16; ++i) ok = ok && x.data<float>()[i] == 1.0f;  // no data moved
  ls::set_check_level(level);
  INFO("rank " << r << ": " << got);
  CHECK(all_ranks(b, ok));  // and the backend is still usable
}

TEST_CASE("a moved-from MPIBackend is empty and refuses collectives") {
  ls::initialize<ls::MPIBackend>();
  ls::MPIBackend a(MPI_COMM_WORLD);
  ls::MPIBackend b(std::move(a));
  CHECK_FALSE(a.usable());
  CHECK(a.size() == 0);
  CHECK(a.comm() == MPI_COMM_NULL);
  ls::Tensor x = ls::Tensor::ones({4});
  CHECK_THROWS_AS(a.allreduce(x, ls::ReduceOp::sum), ls::InvalidArgument);
  CHECK_THROWS_AS(a.barrier(), ls::InvalidArgument);
  b.allreduce(x, ls::ReduceOp::sum);
  CHECK(x.data<float>()[0] == static_cast<float>(b.size()));
}

TEST_CASE("MpiError names what the user called and where, with MPI's text once") {
  ls::MPIBackend& b = backend();
  // A private duplicate of MPI_COMM_SELF: a truncated receive only this rank sees.
  MPI_Comm self;
  MPI_Comm_dup(MPI_COMM_SELF, &self);
  MPI_Comm_set_errhandler(self, MPI_ERRORS_RETURN);
  std::int64_t two[2] = {1, 2}, one = 0;
  MPI_Request req;
  MPI_Isend(two, 2, MPI_INT64_T, 0, 5, self, &req);
  std::string msg;
  try {
    ls::detail::CallSiteScope site(std::source_location::current(), "allreduce");
    LOCKSTEP_MPI_CHECK(MPI_Recv(&one, 1, MPI_INT64_T, 0, 5, self, MPI_STATUS_IGNORE));
  } catch (const ls::MpiError& e) {
    msg = e.what();
  }
  MPI_Wait(&req, MPI_STATUS_IGNORE);
  MPI_Comm_free(&self);
  INFO(msg);
  CHECK(msg.find("allreduce called at trust_test.cpp:") != std::string::npos);
  CHECK(msg.find("MPI_ERR_TRUNCATE") != std::string::npos);
  CHECK(msg.find("MPI_ERR_TRUNCATE") == msg.rfind("MPI_ERR_TRUNCATE"));  // once
  CHECK(msg.find("guarded") == std::string::npos);
  CHECK(all_ranks(b, true));
}
