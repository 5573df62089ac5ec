// Reliability features that run inside one test process (under mpiexec): check_replicas,
// in-code check levels and deadlines, the settings' argument checks. The fault-injection paths
// that end a job are in tests_50_reliability.cmake (fault_program + run_fault.sh).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "test_support.hpp"

namespace ls = lockstep;

namespace {

struct Layer {
  ls::Tensor w, b;
};
LOCKSTEP_FIELDS(Layer, w, b)

struct Net {
  std::vector<Layer> layers;
  double lr = 0.1;
  std::int64_t step = 0;
};
LOCKSTEP_FIELDS(Net, layers, lr, step)

Net make_net() {
  Net n;
  for (int i = 0; i < 3; ++i)
    n.layers.push_back(Layer{ls::Tensor::full({4, 3}, 0.5 + i), ls::Tensor::full({3}, -1.0 * i)});
  return n;
}

// Runs f (a collective that must throw MismatchError on every rank) and returns the message, or
// "" if it did not throw.
template <class F>
std::string mismatch_text(F&& f) {
  return lstest::error_message<ls::MismatchError>(std::forward<F>(f));
}

using lstest::contains;

// Restores the process-wide settings a test changes.
struct SettingsGuard {
  ls::CheckLevel level = ls::check_level();
  int first = ls::check_first_calls();
  double timeout = ls::timeout();
  ~SettingsGuard() {
    ls::set_check_level(level, first);
    ls::set_timeout(timeout);
  }
};

}  // namespace

TEST_CASE("check_replicas passes on identical replicas, including NaN, empty and zero-size leaves") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  Net n = make_net();
  n.layers[0].w.data<float>()[1] = std::numeric_limits<float>::quiet_NaN();  // same bits everywhere
  CHECK_NOTHROW(ls::check_replicas(b, n));
  std::vector<ls::Tensor> empty;
  CHECK_NOTHROW(ls::check_replicas(b, empty));
  ls::Tensor zero = ls::Tensor::zeros({0});
  CHECK_NOTHROW(ls::check_replicas(b, zero));
  CHECK_NOTHROW(ls::check_replicas(b, std::tie(n, zero)));
}

TEST_CASE("check_replicas names the first differing tensor and the rank that differs") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  if (b.size() < 2) return;
  Net n = make_net();
  if (b.rank() == 1) {
    n.layers[1].w.data<float>()[2] += 1e-6f;  // one ulp-ish drift
    n.layers[2].b.data<float>()[0] = 7;
  }
  const std::string msg = mismatch_text([&] { ls::check_replicas(b, n); });
  CHECK(contains(msg, "differ at leaf 'layers[1].w'"));
  CHECK(contains(msg, "(leaf 2 of 8; 2 leafs differ in all)"));
  CHECK(contains(msg, "rank 1: f32 [4, 3] = 1.5, 1.5, 1.50000095"));
  CHECK(contains(msg, "rank 0: f32 [4, 3] = 1.5, 1.5, 1.5, 1.5, ..."));
  if (b.size() >= 3) CHECK(contains(msg, "rank 1 disagrees with ranks 0, 2"));
  if (b.size() == 2) CHECK(contains(msg, "no majority"));
  INFO(msg);
}

TEST_CASE("check_replicas names a differing scalar") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  if (b.size() < 2) return;
  Net n = make_net();
  n.step = b.rank() == b.size() - 1 ? 41 : 40;
  const std::string msg = mismatch_text([&] { ls::check_replicas(b, n); });
  CHECK(contains(msg, "differ at leaf 'step'"));
  CHECK(contains(msg, "i64 scalar = 41"));
  CHECK(contains(msg, "i64 scalar = 40"));
  INFO(msg);
}

TEST_CASE("check_replicas reports different structures like synchronize does") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  if (b.size() < 2) return;
  Net n = make_net();
  if (b.rank() == 1) n.layers.pop_back();
  const std::string msg = mismatch_text([&] { ls::check_replicas(b, n); });
  CHECK(contains(msg, "check_replicas: the ranks hold different structures"));
  CHECK(contains(msg, "rank 1"));
  INFO(msg);
}

TEST_CASE("a fingerprint mismatch throws on every rank before data moves, and the backend stays usable") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  if (b.size() < 2) return;
  SettingsGuard keep;
  ls::set_check_level(ls::CheckLevel::always);
  ls::Tensor x = ls::Tensor::full({b.rank() == 0 ? 5 : 6}, 2.0);
  const std::string msg = mismatch_text([&] { ls::allreduce(b, x, ls::ReduceOp::sum); });
  CHECK(contains(msg, "disagree on the element count"));
  CHECK(contains(msg, "rank 0: allreduce #"));
  CHECK(contains(msg, "(f32 x 5, op sum) at reliability_test.cpp:"));
  CHECK(contains(msg, "(f32 x 6, op sum) at reliability_test.cpp:"));
  CHECK(x.data<float>()[0] == 2.0f);  // no data moved
  // Root disagreement on a broadcast, called through the member function: the front end records
  // the member's call site too.
  ls::Tensor y = ls::Tensor::full({3}, 1.0);
  const std::string msg2 = mismatch_text([&] { b.broadcast(y, b.rank() == 0 ? 0 : 1); });
  CHECK(contains(msg2, "disagree on the root"));
  CHECK(contains(msg2, "at reliability_test.cpp:"));
  // The communicator is still in step: a correct collective works.
  ls::Tensor z = ls::Tensor::full({4}, 1.0);
  ls::allreduce(b, z, ls::ReduceOp::sum);
  CHECK(z.data<float>()[3] == static_cast<float>(b.size()));
}

TEST_CASE("collectives run without checks keep the sequence numbers in step for a later check") {
  // With the check level off and no deadline, collectives take the reliability hook's fast path
  // (no fingerprint); their sequence numbers must still agree when checks are switched on, so a
  // later mismatch is reported for what differs and not as a sequence-number disagreement.
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  if (b.size() < 2) return;
  SettingsGuard keep;
  ls::set_check_level(ls::CheckLevel::off);
  ls::set_timeout(0);
  ls::Tensor w = ls::Tensor::full({16}, 1.0);
  for (int i = 0; i < 5; ++i) ls::allreduce(b, w, ls::ReduceOp::sum);
  b.barrier();
  ls::set_check_level(ls::CheckLevel::always);
  ls::Tensor x = ls::Tensor::full({b.rank() == 0 ? 7 : 8}, 2.0);
  const std::string msg = mismatch_text([&] { ls::allreduce(b, x, ls::ReduceOp::sum); });
  CHECK(contains(msg, "disagree on the element count"));
  CHECK_FALSE(contains(msg, "sequence number"));
  // And back to the fast path: results still right.
  ls::set_check_level(ls::CheckLevel::off);
  ls::Tensor z = ls::Tensor::full({4}, 1.0);
  ls::allreduce(b, z, ls::ReduceOp::sum);
  CHECK(z.data<float>()[0] == static_cast<float>(b.size()));
}

TEST_CASE("level first checks the first N calls of each call site") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  if (b.size() < 2) return;
  SettingsGuard keep;
  ls::set_check_level(ls::CheckLevel::first, 2);
  int caught = 0;
  for (int i = 0; i < 4; ++i) {
    // The first two calls of this site disagree in count (and are caught, no data moves); the
    // later ones agree and run.
    ls::Tensor x = ls::Tensor::full({i < 2 && b.rank() == 1 ? 5 : 4}, 1.0);
    try {
      ls::allreduce(b, x, ls::ReduceOp::max);
    } catch (const ls::MismatchError&) {
      ++caught;
    }
  }
  CHECK(caught == 2);
  // Another call site has its own count: its first call is checked.
  ls::Tensor y = ls::Tensor::full({b.rank() == 1 ? 2 : 3}, 1.0);
  CHECK(!mismatch_text([&] { ls::allreduce(b, y, ls::ReduceOp::max); }).empty());
}

TEST_CASE("collectives with a deadline give the same results as without") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  SettingsGuard keep;
  ls::set_timeout(60);
  ls::set_check_level(ls::CheckLevel::always);
  const int n = b.size();
  ls::Tensor x = ls::Tensor::full({1000}, b.rank() + 1.0);
  ls::allreduce(b, x, ls::ReduceOp::sum);
  CHECK(x.data<float>()[999] == static_cast<float>(n * (n + 1) / 2));
  ls::Tensor y = ls::Tensor::full({7}, b.rank() == 0 ? 3.0 : 0.0);
  ls::broadcast(b, y, 0);
  CHECK(y.data<float>()[6] == 3.0f);
  ls::Tensor g = ls::Tensor::full({2}, static_cast<double>(b.rank()));
  ls::Tensor all = ls::Tensor::zeros({2 * n});
  ls::allgather(b, g, all);
  CHECK(all.data<float>()[2 * n - 1] == static_cast<float>(n - 1));
  ls::barrier(b);
}

TEST_CASE("finalize with a request still pending is refused on every rank, and nothing breaks") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  ls::Tensor x = ls::Tensor::full({100}, 1.0);
  ls::Request r = b.iallreduce(x, ls::ReduceOp::sum);
  std::string msg;
  try {
    ls::finalize<ls::MPIBackend>();
  } catch (const ls::InvalidArgument& e) {
    msg = e.what();
  }
  CHECK(contains(msg, "finalize<MPIBackend>: 1 nonblocking request is still pending"));
  CHECK(ls::initialized<ls::MPIBackend>());
  r.wait();
  CHECK(x.data<float>()[99] == static_cast<float>(b.size()));
}

TEST_CASE("reliability settings reject bad values") {
  SettingsGuard keep;
  CHECK_THROWS_AS(ls::set_timeout(-1), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::set_timeout(std::nan("")), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::set_check_level(ls::CheckLevel::first, 0), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::set_check_level(static_cast<ls::CheckLevel>(9)), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::set_timeout_action(static_cast<ls::TimeoutAction>(9)), ls::InvalidArgument);
  ls::set_check_level(ls::CheckLevel::first, 4);
  CHECK(ls::check_level() == ls::CheckLevel::first);
  CHECK(ls::check_first_calls() == 4);
  CHECK(std::string(ls::name(ls::CheckLevel::always)) == "always");
}

TEST_CASE("hash_bytes tells apart what differs and agrees on what does not") {
  const char a[] = "abcdefghijklmnopq", b2[] = "abcdefghijklmnopr";
  CHECK(ls::detail::hash_bytes(a, sizeof a) == ls::detail::hash_bytes(a, sizeof a));
  CHECK(ls::detail::hash_bytes(a, sizeof a) != ls::detail::hash_bytes(b2, sizeof b2));
  CHECK(ls::detail::hash_bytes(a, 3) != ls::detail::hash_bytes(a, 4));
  CHECK(ls::detail::hash_bytes(nullptr, 0) == ls::detail::hash_bytes(a, 0));
  // The seed chains hashes: seed 0 is the plain hash, another seed another hash, and the order
  // of the chained parts counts.
  CHECK(ls::detail::hash_bytes(a, sizeof a, 0) == ls::detail::hash_bytes(a, sizeof a));
  CHECK(ls::detail::hash_bytes(a, sizeof a, 1) != ls::detail::hash_bytes(a, sizeof a));
  const auto ab = ls::detail::hash_bytes(b2, sizeof b2, ls::detail::hash_bytes(a, sizeof a));
  const auto ba = ls::detail::hash_bytes(a, sizeof a, ls::detail::hash_bytes(b2, sizeof b2));
  CHECK(ab != ba);
}

namespace {
// The exception that error_record records and throw_error throws again, as a record itself.
ls::detail::ErrorRecord round_trip(const ls::detail::ErrorRecord& r) {
  try {
    ls::detail::throw_error(r);
  } catch (...) {
    return ls::detail::error_record(std::current_exception());
  }
  return {};  // not reached: throw_error always throws
}
}  // namespace

TEST_CASE("error_record and throw_error carry every kind of exception, with its code or remote call") {
  using ls::detail::ErrorKind;
  using ls::detail::error_record;
  auto record = [](auto&& x) { return error_record(std::make_exception_ptr(x)); };
  CHECK(error_record(nullptr).kind == ErrorKind::none);
  CHECK(record(ls::InvalidArgument("a")).kind == ErrorKind::invalid_argument);
  CHECK(record(ls::MismatchError("a")).kind == ErrorKind::mismatch);
  CHECK(record(ls::TimeoutError("a")).kind == ErrorKind::timeout);
  CHECK(record(ls::CheckpointError("a")).kind == ErrorKind::checkpoint);
  CHECK(record(ls::NotCompiled("a")).kind == ErrorKind::not_compiled);
  CHECK(record(ls::Error("a")).kind == ErrorKind::error);
  CHECK(record(std::runtime_error("a")).kind == ErrorKind::std_exception);
  CHECK(record(42).kind == ErrorKind::unknown);
  for (const auto& x : {record(ls::MpiError("m", 13)), record(ls::CudaError("c", 2)), record(ls::NcclError("n", 3))}) {
    const auto back = round_trip(x);
    CHECK((back.kind == x.kind && back.what == x.what && back.code == x.code && x.code != 0));
  }
  const auto remote = record(ls::RemoteError(2, "f", "boom"));
  const auto back = round_trip(remote);
  CHECK((back.kind == ErrorKind::remote && back.rank == 2 && back.function == "f" && back.message == "boom" &&
         back.what == remote.what));
  for (auto k : {ErrorKind::invalid_argument, ErrorKind::mismatch, ErrorKind::timeout, ErrorKind::checkpoint,
                 ErrorKind::not_compiled, ErrorKind::error}) {
    ls::detail::ErrorRecord r;
    r.kind = k;
    r.what = "text";
    const auto b = round_trip(r);
    CHECK((b.kind == k && b.what == "text"));
  }
  // What a transport of a kind and a text alone sends: the kinds with more travel as Error.
  CHECK(ls::detail::text_kind(ErrorKind::mpi) == ErrorKind::error);
  CHECK(ls::detail::text_kind(ErrorKind::remote) == ErrorKind::error);
  CHECK(ls::detail::text_kind(ErrorKind::timeout) == ErrorKind::timeout);
  ls::detail::ErrorRecord foreign;
  foreign.kind = ErrorKind::std_exception;
  foreign.what = "f";
  CHECK(round_trip(foreign).kind == ErrorKind::error);
}

TEST_CASE("first_non_finite finds NaN and infinities in every floating dtype, and ignores integers") {
  for (ls::DType t : {ls::DType::f16, ls::DType::bf16, ls::DType::f32, ls::DType::f64}) {
    ls::Tensor a = ls::Tensor::full({3000}, 1.0, t), c = ls::Tensor::full({3000}, 2.0, t);
    std::vector<ls::Tensor*> ts{&a, &c};
    CHECK(ls::detail::first_non_finite(ts) == 2);
    ls::Tensor inf = ls::Tensor::full({1}, -std::numeric_limits<double>::infinity(), t);
    std::memcpy(static_cast<char*>(c.raw_data()) + 2999 * ls::size_of(t), inf.raw_data(), ls::size_of(t));
    std::int64_t element = -1;
    std::string value;
    CHECK(ls::detail::first_non_finite(ts, &element, &value) == 1);
    CHECK(element == 2999);
    CHECK(value == "-inf");
  }
  ls::Tensor ints = ls::Tensor::full({4}, 7.0, ls::DType::i32);
  std::vector<ls::Tensor*> ti{&ints};
  CHECK(ls::detail::first_non_finite(ti) == 1);
}

TEST_CASE("skip_non_finite: a NaN on one rank skips the step on every rank, counted and named") {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  Net model = make_net();
  Net grads = make_net();
  auto opt = ls::DistributedOptimizer(b, ls::SGD{.lr = 0.5f},
                                      ls::DistributedOptions{.skip_non_finite = true, .check_replicas_every = 1});
  auto state = ls::setup(opt, model);
  const float w0 = model.layers[1].w.data<float>()[0];
  ls::update(state, model, grads);  // a normal step: w -= 0.5 * 1.5
  const float w1 = model.layers[1].w.data<float>()[0];
  CHECK(w1 == w0 - 0.5f * 1.5f);
  // The last rank's gradient gets a NaN (an infinity on a single rank): every rank skips.
  if (b.rank() == b.size() - 1) {
    grads.layers[1].w.data<float>()[5] = std::numeric_limits<float>::quiet_NaN();
    grads.layers[2].b.data<float>()[0] = std::numeric_limits<float>::infinity();
  }
  ls::update(state, model, grads);
  CHECK(model.layers[1].w.data<float>()[0] == w1);  // unchanged
  CHECK(state.skipped_steps() == 1);
  CHECK(state.applied_steps() == 1);
  // The next finite step is applied again (every rank still agrees: check_replicas runs each step).
  Net good = make_net();
  ls::update(state, model, good);
  CHECK(model.layers[1].w.data<float>()[0] == w1 - 0.5f * 1.5f);
  CHECK(state.applied_steps() == 2);
  std::vector<ls::Tensor*> gs{&good.layers[0].w, &grads.layers[1].w};
  std::int64_t element = -1;
  std::string value;
  if (b.rank() == b.size() - 1) {
    CHECK(ls::detail::first_non_finite(gs, &element, &value) == 1);
    CHECK(element == 5);
    CHECK(value == "nan");
  }
}

