// MPIBackend collectives under mpiexec: every collective x op x dtype x size
// {0, 1, 7, 1000003} x in place / out of place, broadcast and reduce from every root (reduce:
// every root at the small sizes, the last at the large one), the nonblocking forms, and the
// argument checks. Every rank checks its own results and records
// mismatches; a CHECK at the end of each test case (never between collectives) reports them,
// and the test main combines the verdict across ranks.
#include <catch2/catch.hpp>

#include <mpi.h>

#include <cstring>
#include <string>
#include <vector>

#include "collective_common.hpp"
#include "lockstep/lockstep.hpp"

namespace ls = lockstep;
using namespace lstest;

namespace {

ls::Backend& backend() { return ls::get_distributed_backend<ls::MPIBackend>(); }

// One reduction case, precomputed once: this rank's input, the expected result (computed
// without MPI), and a sentinel for buffers that must not change. Tests copy and memcmp these,
// so that the time goes into the collectives rather than into filling and checking.
struct ReductionCase {
  ls::Tensor mine, want, untouched;
  ReductionCase(ls::ReduceOp op, ls::DType t, std::int64_t size, int rank, int n, std::int64_t offset = 0)
      : mine(make_periodic(t, size, kInputPeriod, [&](std::int64_t i) { return input(op, t, rank, offset + i); })),
        want(make_periodic(t, size, kInputPeriod, [&](std::int64_t i) { return expected(op, t, n, offset + i); })),
        untouched(make_periodic(t, size, kSentinelPeriod, [&](std::int64_t i) { return sentinel(rank, i); })) {}
};

// Calls f(dtype, op, size) for every dtype of `types`, every op valid for it and every size.
template <class F>
void for_each_reduction(F&& f, const std::vector<ls::DType>& types = kAllDTypes) {
  for (ls::DType t : types)
    for (ls::ReduceOp op : kAllOps) {
      if (!op_valid(op, t)) continue;
      for (std::int64_t size : kSizes) f(t, op, size);
    }
}

// One broadcast case: root's data, and the buffer this rank passes (root's data on root, a
// sentinel elsewhere).
struct BroadcastCase {
  ls::Tensor want, buf;
  BroadcastCase(ls::DType t, std::int64_t size, int root, int rank)
      : want(make_periodic(t, size, kBcastPeriod, [&](std::int64_t i) { return bcast_value(root, i); })),
        buf(rank == root ? want.clone()
                         : make_periodic(t, size, kSentinelPeriod, [&](std::int64_t i) { return sentinel(rank, i); })) {}
};

// Completes the k-th request: by wait() when k is even, by polling test() otherwise. Returns
// whether it waited.
bool complete(ls::Request& req, int k) {
  if (k % 2 == 0) {
    req.wait();
    return true;
  }
  while (!req.test()) {
  }
  return false;
}

}  // namespace

TEST_CASE("allreduce: every dtype, op and size, in place and out of place") {
  ls::Backend& b = backend();
  const int r = b.rank(), n = b.size();
  Failures f;
  for_each_reduction([&](ls::DType t, ls::ReduceOp op, std::int64_t size) {
    const ReductionCase c(op, t, size, r, n);
    ls::Tensor buf = c.mine.clone();
    ls::allreduce(b, buf, op);
    f.expect_same(label("allreduce", t, ls::name(op), size, "in-place"), buf, c.want);

    ls::Tensor send = c.mine.clone(), recv = c.untouched.clone();
    b.allreduce(send, recv, op);
    f.expect_same(label("allreduce", t, ls::name(op), size, "out-of-place"), recv, c.want);
    f.expect_same(label("allreduce", t, ls::name(op), size, "send unchanged"), send, c.mine);
  });
  INFO(f.report());
  CHECK(f.ok());
  CHECK(f.checked() > 0);
}

TEST_CASE("reduce: every dtype, op, size and root, in place and out of place") {
  ls::Backend& b = backend();
  const int r = b.rank(), n = b.size();
  Failures f;
  for_each_reduction([&](ls::DType t, ls::ReduceOp op, std::int64_t size) {
    const ReductionCase c(op, t, size, r, n);
    // Every root at the small sizes; the large size (the slow part on an oversubscribed CI
    // machine) from the last rank only, since the chunking does not depend on the root.
    for (int root = size > 7 ? n - 1 : 0; root < n; ++root) {
      const std::string where = " root=" + std::to_string(root);
      // In place: root gets the reduction, the others keep their input.
      ls::Tensor buf = c.mine.clone();
      ls::reduce(b, buf, op, root);
      f.expect_same(label("reduce", t, ls::name(op), size, "in-place") + where, buf, r == root ? c.want : c.mine);

      // Out of place with a recv on every rank: only the root's is written.
      ls::Tensor send = c.mine.clone(), recv = c.untouched.clone();
      b.reduce(send, recv, op, root);
      f.expect_same(label("reduce", t, ls::name(op), size, "out-of-place") + where, recv,
                    r == root ? c.want : c.untouched);
      f.expect_same(label("reduce", t, ls::name(op), size, "send unchanged") + where, send, c.mine);

      // Out of place with an empty recv on non-roots (the documented shortcut).
      if (size == 7) {
        ls::Tensor out = c.untouched.clone();
        ls::reduce(b, send, r == root ? out.view() : ls::TensorView{}, op, root);
        f.expect_same(label("reduce", t, ls::name(op), size, "empty recv elsewhere") + where, out,
                      r == root ? c.want : c.untouched);
      }
    }
  });
  INFO(f.report());
  CHECK(f.ok());
}

TEST_CASE("broadcast: every dtype, size and root") {
  ls::Backend& b = backend();
  const int r = b.rank(), n = b.size();
  Failures f;
  for (ls::DType t : kAllDTypes)
    for (std::int64_t size : kSizes)
      for (int root = 0; root < n; ++root) {
        BroadcastCase c(t, size, root, r);
        ls::broadcast(b, c.buf, root);
        f.expect_same(label("broadcast", t, "-", size, "root=") + std::to_string(root), c.buf, c.want);
      }
  INFO(f.report());
  CHECK(f.ok());
}

TEST_CASE("allgather: every dtype and size") {
  ls::Backend& b = backend();
  const int r = b.rank(), n = b.size();
  Failures f;
  for (ls::DType t : kAllDTypes)
    for (std::int64_t size : kSizes) {
      ls::Tensor send = make_periodic(t, size, kBcastPeriod, [&](std::int64_t i) { return bcast_value(r, i); });
      ls::Tensor mine = send.clone();
      ls::Tensor recv = make_periodic(t, size * n, kSentinelPeriod, [&](std::int64_t i) { return sentinel(r, i); });
      // Block q of recv holds rank q's send.
      ls::Tensor want({size * n}, t);
      for (int q = 0; q < n; ++q) {
        ls::Tensor block = make_periodic(t, size, kBcastPeriod, [&](std::int64_t i) { return bcast_value(q, i); });
        if (size > 0) std::memcpy(static_cast<char*>(want.raw_data()) + q * block.nbytes(), block.raw_data(), block.nbytes());
      }
      ls::allgather(b, send, recv);
      f.expect_same(label("allgather", t, "-", size, "out-of-place"), recv, want);
      f.expect_same(label("allgather", t, "-", size, "send unchanged"), send, mine);
    }
  INFO(f.report());
  CHECK(f.ok());
}

TEST_CASE("reduce_scatter: every dtype, op and size") {
  ls::Backend& b = backend();
  const int r = b.rank(), n = b.size();
  Failures f;
  for_each_reduction([&](ls::DType t, ls::ReduceOp op, std::int64_t size) {
    // Element i of the (size * n)-element send is input(op, t, rank, i); rank r receives block r,
    // i.e. the reduction at global index r * size + j.
    ls::Tensor send = make_periodic(t, size * n, kInputPeriod, [&](std::int64_t i) { return input(op, t, r, i); });
    const ReductionCase block(op, t, size, r, n, r * size);
    ls::Tensor recv = block.untouched.clone();
    ls::reduce_scatter(b, send, recv, op);
    f.expect_same(label("reduce_scatter", t, ls::name(op), size, "out-of-place"), recv, block.want);
  });
  INFO(f.report());
  CHECK(f.ok());
}

TEST_CASE("barrier completes on every rank") {
  ls::Backend& b = backend();
  // Each rank increments a counter between barriers; after the second barrier everyone has
  // seen the same number of rounds (a broken barrier hangs or throws instead).
  int rounds = 0;
  for (int k = 0; k < 5; ++k) {
    ls::barrier(b);
    ++rounds;
  }
  b.barrier();
  int total = 0;
  MPI_Allreduce(&rounds, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK(total == 5 * b.size());
}

TEST_CASE("iallreduce and ibroadcast: wait and test") {
  ls::Backend& b = backend();
  const int r = b.rank(), n = b.size();
  Failures f;
  int k = 0;
  for (ls::DType type : kAllDTypes) {
    for_each_reduction(
        [&](ls::DType t, ls::ReduceOp op, std::int64_t size) {
          const ReductionCase c(op, t, size, r, n);
          ls::Tensor buf = c.mine.clone();
          ls::Request req = b.iallreduce(buf, op);
          const bool waited = complete(req, ++k);
          if (req.pending()) f.fail("request still pending after completion");
          req.wait();  // idempotent
          f.expect_same(label("iallreduce", t, ls::name(op), size, waited ? "wait" : "test"), buf, c.want);
        },
        {type});
    for (std::int64_t size : kSizes)
      for (int root = 0; root < n; ++root) {
        BroadcastCase c(type, size, root, r);
        ls::Request req = b.ibroadcast(c.buf, root);
        complete(req, ++k);
        f.expect_same(label("ibroadcast", type, "-", size, "root=") + std::to_string(root), c.buf, c.want);
      }
  }

  // Several requests in flight at once, completed in reverse order; the last one is completed
  // by its destructor.
  {
    ls::Tensor a = make(ls::DType::f32, 1000, [&](std::int64_t i) { return input(ls::ReduceOp::sum, ls::DType::f32, r, i); });
    ls::Tensor c = make(ls::DType::f64, 1000, [&](std::int64_t i) { return input(ls::ReduceOp::avg, ls::DType::f64, r, i); });
    ls::Tensor d = make(ls::DType::i32, 1000, [&](std::int64_t i) { return input(ls::ReduceOp::max, ls::DType::i32, r, i); });
    {
      ls::Request ra = b.iallreduce(a, ls::ReduceOp::sum);
      ls::Request rc = b.iallreduce(c, ls::ReduceOp::avg);
      ls::Request rd = b.iallreduce(d, ls::ReduceOp::max);
      ls::Request moved = std::move(rc);
      if (rc.pending()) f.fail("moved-from request still pending");
      moved.wait();
      ra.wait();
    }
    f.expect("overlapping iallreduce f32 sum", a, [&](std::int64_t i) { return expected(ls::ReduceOp::sum, ls::DType::f32, n, i); });
    f.expect("overlapping iallreduce f64 avg", c, [&](std::int64_t i) { return expected(ls::ReduceOp::avg, ls::DType::f64, n, i); });
    f.expect("overlapping iallreduce i32 max (destructor)", d,
             [&](std::int64_t i) { return expected(ls::ReduceOp::max, ls::DType::i32, n, i); });
  }
  ls::Request none;
  if (none.pending() || !none.test()) f.fail("a default Request should be complete");
  none.wait();
  INFO(f.report());
  CHECK(f.ok());
}

TEST_CASE("slices of one buffer are independent collectives") {
  ls::Backend& b = backend();
  const int r = b.rank(), n = b.size();
  ls::Tensor buf = make(ls::DType::f64, 30, [&](std::int64_t i) { return input(ls::ReduceOp::sum, ls::DType::f64, r, i); });
  ls::TensorView v = buf.view();
  b.allreduce(v.slice(0, 10), ls::ReduceOp::sum);
  b.allreduce(v.slice(10, 10), ls::ReduceOp::max);
  // Elements 20..29 stay this rank's input.
  Failures f;
  f.expect("slice sum", v.slice(0, 10), [&](std::int64_t i) { return expected(ls::ReduceOp::sum, ls::DType::f64, n, i); });
  f.expect("slice max", v.slice(10, 10), [&](std::int64_t i) {
    // input(sum, ...) at 10 + i, maximised over ranks: (10+i) % 5 + (n - 1).
    return static_cast<double>((10 + i) % 5 + n - 1);
  });
  f.expect("slice untouched", v.slice(20, 10), [&](std::int64_t i) { return input(ls::ReduceOp::sum, ls::DType::f64, r, 20 + i); });
  INFO(f.report());
  CHECK(f.ok());
}

namespace {

// True when `fn` throws exactly InvalidArgument (recorded in f otherwise).
template <class Fn>
void expect_invalid(Failures& f, const std::string& what, Fn&& fn, const char* must_mention = nullptr) {
  try {
    fn();
    f.fail(what + ": no exception");
  } catch (const ls::InvalidArgument& e) {
    if (must_mention != nullptr && std::string(e.what()).find(must_mention) == std::string::npos)
      f.fail(what + ": message does not mention '" + must_mention + "': " + e.what());
    if (std::string(e.what()).find("[rank ") == std::string::npos)
      f.fail(what + ": message does not name the rank: " + e.what());
  } catch (const std::exception& e) {
    f.fail(what + ": wrong exception: " + e.what());
  }
}

}  // namespace

TEST_CASE("bad arguments throw InvalidArgument on every rank, before any communication") {
  ls::Backend& b = backend();
  const int n = b.size();
  Failures f;
  ls::Tensor x = ls::Tensor::zeros({8}, ls::DType::f32);
  ls::Tensor x64 = ls::Tensor::zeros({8}, ls::DType::f64);
  ls::Tensor x7 = ls::Tensor::zeros({7}, ls::DType::f32);
  ls::Tensor big = ls::Tensor::zeros({8 * n + 1}, ls::DType::f32);
  ls::Tensor gathered = ls::Tensor::zeros({8 * n}, ls::DType::f32);

  expect_invalid(f, "broadcast root -1", [&] { b.broadcast(x, -1); }, "root");
  expect_invalid(f, "broadcast root n", [&] { b.broadcast(x, n); }, "root");
  expect_invalid(f, "ibroadcast root n", [&] { (void)b.ibroadcast(x, n); }, "root");
  expect_invalid(f, "reduce root n", [&] { b.reduce(x, ls::ReduceOp::sum, n); }, "root");
  expect_invalid(f, "reduce out-of-place root -2", [&] { b.reduce(x, x64, ls::ReduceOp::sum, -2); }, "root");

  expect_invalid(f, "allreduce dtype mismatch", [&] { b.allreduce(x, x64, ls::ReduceOp::sum); }, "dtype");
  expect_invalid(f, "allreduce size mismatch", [&] { b.allreduce(x, x7, ls::ReduceOp::sum); }, "elements");
  expect_invalid(f, "reduce dtype mismatch", [&] { b.reduce(x, x64, ls::ReduceOp::sum, 0); }, "dtype");
  expect_invalid(f, "reduce size mismatch", [&] { b.reduce(x, x7, ls::ReduceOp::sum, 0); }, "elements");

  for (ls::DType t : {ls::DType::i32, ls::DType::i64, ls::DType::u8}) {
    ls::Tensor xi = ls::Tensor::zeros({8}, t), yi = ls::Tensor::zeros({8}, t);
    ls::Tensor si = ls::Tensor::zeros({8 * n}, t);
    const std::string dt = ls::name(t);
    expect_invalid(f, "allreduce avg " + dt, [&] { b.allreduce(xi, ls::ReduceOp::avg); }, "avg");
    expect_invalid(f, "allreduce avg out-of-place " + dt, [&] { b.allreduce(xi, yi, ls::ReduceOp::avg); }, "avg");
    expect_invalid(f, "reduce avg " + dt, [&] { b.reduce(xi, ls::ReduceOp::avg, 0); }, "avg");
    expect_invalid(f, "reduce avg out-of-place " + dt, [&] { b.reduce(xi, yi, ls::ReduceOp::avg, 0); }, "avg");
    expect_invalid(f, "reduce_scatter avg " + dt, [&] { b.reduce_scatter(si, yi, ls::ReduceOp::avg); }, "avg");
    expect_invalid(f, "iallreduce avg " + dt, [&] { (void)b.iallreduce(xi, ls::ReduceOp::avg); }, "avg");
  }
  expect_invalid(f, "invalid ReduceOp value", [&] { b.allreduce(x, static_cast<ls::ReduceOp>(9)); });

  expect_invalid(f, "allgather recv too small", [&] { b.allgather(x, x7); }, "allgather");
  expect_invalid(f, "allgather recv too large", [&] { b.allgather(x, big); }, "allgather");
  expect_invalid(f, "allgather dtype mismatch",
                 [&] { b.allgather(x, ls::Tensor::zeros({8 * n}, ls::DType::f64)); }, "dtype");
  expect_invalid(f, "reduce_scatter send wrong size", [&] { b.reduce_scatter(big, x, ls::ReduceOp::sum); },
                 "reduce_scatter");
  expect_invalid(f, "reduce_scatter dtype mismatch",
                 [&] { b.reduce_scatter(gathered, x64, ls::ReduceOp::sum); }, "dtype");

  // Overlapping send and recv (but not the same buffer, which is the in-place form).
  ls::Tensor pool = ls::Tensor::zeros({8 * n + 16}, ls::DType::f32);
  ls::TensorView g = pool.view();
  expect_invalid(f, "allreduce overlap", [&] { b.allreduce(g.slice(0, 8), g.slice(4, 8), ls::ReduceOp::sum); },
                 "overlap");
  expect_invalid(f, "reduce overlap", [&] { b.reduce(g.slice(0, 8), g.slice(1, 8), ls::ReduceOp::sum, 0); },
                 "overlap");
  // (send = this rank's block of recv is the in-place form; a shifted block is no rank's.)
  expect_invalid(f, "allgather overlap", [&] { b.allgather(g.slice(1, 8), g.slice(0, 8 * n)); }, "overlap");
  expect_invalid(f, "reduce_scatter overlap",
                 [&] { b.reduce_scatter(g.slice(0, 8 * n), g.slice(8 * n - 4, 8), ls::ReduceOp::sum); }, "overlap");

  ls::TensorView negative = x.view();
  negative.numel = -1;
  expect_invalid(f, "negative numel", [&] { b.broadcast(negative, 0); }, "negative");
  ls::TensorView null_data{nullptr, 4, ls::DType::f32, ls::Device::cpu()};
  expect_invalid(f, "null data", [&] { b.allreduce(null_data, ls::ReduceOp::sum); }, "null");
  ls::TensorView on_gpu = x.view();
  on_gpu.device = ls::Device::cuda(0);
  expect_invalid(f, "send and recv on different devices", [&] { b.allreduce(x, on_gpu, ls::ReduceOp::sum); },
                 "cuda");
#if !LOCKSTEP_HAS_CUDA
  try {
    b.broadcast(on_gpu, 0);
    f.fail("broadcast of a cuda view: no exception");
  } catch (const ls::NotCompiled&) {
  } catch (const std::exception& e) {
    f.fail(std::string("broadcast of a cuda view: wrong exception: ") + e.what());
  }
#endif

  // The backend is still usable, and every rank made the same calls: one real allreduce.
  ls::Tensor one = ls::Tensor::ones({3}, ls::DType::i64);
  b.allreduce(one, ls::ReduceOp::sum);
  f.expect("allreduce after the errors", one, [&](std::int64_t) { return static_cast<double>(n); });
  INFO(f.report());
  CHECK(f.ok());
}

TEST_CASE("an MPI failure becomes MpiError naming the call, file:line and rank") {
  // A message longer than the receive buffer is only caught by MPI itself: provoke one on a
  // private duplicate of MPI_COMM_SELF (it cannot hang other ranks) and check it through the
  // library's check macro.
  std::int64_t got = 0;
  MPI_Request req;
  MPI_Comm self;
  MPI_Comm_dup(MPI_COMM_SELF, &self);
  MPI_Comm_set_errhandler(self, MPI_ERRORS_RETURN);
  std::int64_t two[2] = {1, 2};
  MPI_Isend(two, 2, MPI_INT64_T, 0, 7, self, &req);
  std::string msg;
  int code = 0;
  try {
    LOCKSTEP_MPI_CHECK(MPI_Recv(&got, 1, MPI_INT64_T, 0, 7, self, MPI_STATUS_IGNORE));
  } catch (const ls::MpiError& e) {
    msg = e.what();
    code = e.code();
  }
  MPI_Wait(&req, MPI_STATUS_IGNORE);
  MPI_Comm_free(&self);
  CHECK(code != 0);
  CHECK(msg.find("MPI_Recv") != std::string::npos);
  CHECK(msg.find("collective_test.cpp:") != std::string::npos);
  CHECK(msg.find("[rank ") != std::string::npos);
  CHECK(msg.find("TRUNCATE") != std::string::npos);
}
