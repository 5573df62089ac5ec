// Data-parallel equivalence on the GPU: N ranks, each on its slice of a global batch, with
// parameters, gradients and optimizer state in cuda tensors, gradients averaged by NCCLBackend
// (one grouped allreduce) and the update done by the fused CUDA kernel (one launch for all
// parameter tensors), match one process training on the whole batch with the CPU arithmetic to
// 1e-5 relative over 50 steps; after every step all ranks hold bitwise identical parameters.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <iostream>
#include <random>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "lockstep/nccl.hpp"

namespace ls = lockstep;

// A two-tensor model for the DistributedOptimizer test (traversable).
struct GpuModel {
  ls::Tensor w, b;
};
LOCKSTEP_FIELDS(GpuModel, w, b)

namespace {

constexpr int kFeatures = 16;
constexpr int kBatch = 48;  // divisible by 1, 2, 3 and 4 ranks
constexpr int kSteps = 50;

struct Data {
  std::vector<double> x;  // kBatch x kFeatures, per step
  std::vector<double> y;
};

// Step s's global batch: the same on every rank (same seed), y = x . w_true + 0.5.
Data batch(int step) {
  std::mt19937 gen(1234 + step);
  std::uniform_real_distribution<double> u(-1, 1);
  Data d;
  d.x.resize(kBatch * kFeatures);
  d.y.resize(kBatch);
  for (auto& v : d.x) v = u(gen);
  for (int i = 0; i < kBatch; ++i) {
    double t = 0.5;
    for (int j = 0; j < kFeatures; ++j) t += d.x[i * kFeatures + j] * (0.1 * (j + 1) - 0.8);
    d.y[i] = t;
  }
  return d;
}

// Hand-written backward of the mean squared error / 2 over samples [lo, hi): gradients (in
// double, then rounded to float) of w and b, divided by the number of samples in the range.
void grads_of(const Data& d, int lo, int hi, const float* w, float b, std::vector<float>& gw, float& gb) {
  std::vector<double> acc(kFeatures, 0.0);
  double accb = 0;
  for (int i = lo; i < hi; ++i) {
    double pred = b;
    for (int j = 0; j < kFeatures; ++j) pred += d.x[i * kFeatures + j] * w[j];
    const double err = pred - d.y[i];
    for (int j = 0; j < kFeatures; ++j) acc[j] += err * d.x[i * kFeatures + j];
    accb += err;
  }
  const double n = hi - lo;
  gw.resize(kFeatures);
  for (int j = 0; j < kFeatures; ++j) gw[j] = static_cast<float>(acc[j] / n);
  gb = static_cast<float>(accb / n);
}

enum class Rule { sgd_momentum, adam, adamw };

void run_equivalence(Rule rule) {
  ls::initialize<ls::NCCLBackend>();
  auto& nccl = ls::get_distributed_backend<ls::NCCLBackend>();
  auto& mpi = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = nccl.rank(), size = nccl.size();
  REQUIRE(kBatch % size == 0);  // same on every rank
  const ls::Device dev = ls::Device::cuda(nccl.device());

  // Reference: one process, whole batch, CPU arithmetic of optim_math.hpp.
  std::vector<float> rw(kFeatures, 0.0f), rmw(kFeatures, 0.0f), rvw(kFeatures, 0.0f);
  float rb = 0, rmb = 0, rvb = 0;

  // Distributed: everything on the device.
  ls::Tensor w = ls::Tensor::zeros({kFeatures}, ls::DType::f32, dev), b = ls::Tensor::zeros({1}, ls::DType::f32, dev);
  ls::Tensor gw = ls::Tensor::zeros({kFeatures}, ls::DType::f32, dev), gb = ls::Tensor::zeros({1}, ls::DType::f32, dev);
  ls::Tensor mw = ls::Tensor::zeros({kFeatures}, ls::DType::f32, dev), mb = ls::Tensor::zeros({1}, ls::DType::f32, dev);
  ls::Tensor vw = ls::Tensor::zeros({kFeatures}, ls::DType::f32, dev), vb = ls::Tensor::zeros({1}, ls::DType::f32, dev);

  bool identical = true;
  const int lo = rank * (kBatch / size), hi = lo + kBatch / size;
  for (int step = 1; step <= kSteps; ++step) {
    const Data d = batch(step);
    // Local backward on this rank's slice (the "model" is read back from the device).
    ls::Tensor hw = w.to(ls::Device::cpu()), hb = b.to(ls::Device::cpu());
    std::vector<float> lgw;
    float lgb = 0;
    grads_of(d, lo, hi, hw.data<float>(), hb.data<float>()[0], lgw, lgb);
    gw.copy_from(ls::view_of(std::span<float>(lgw)));
    gb.copy_from(ls::view_of(std::span<float>(&lgb, 1)));
    const std::vector<ls::TensorView> buckets = {gw.view(), gb.view()};
    nccl.allreduce_many(buckets, ls::ReduceOp::avg);

    std::vector<float> fgw;
    float fgb = 0;
    grads_of(d, 0, kBatch, rw.data(), rb, fgw, fgb);
    if (rule == Rule::sgd_momentum) {
      auto c = ls::math::sgd_coeffs<float>(0.05, 0.9, 0.0, 0.001, false, step);
      const std::vector<ls::cuda::SgdSpan> spans = {{w.view(), gw.view(), mw.view()}, {b.view(), gb.view(), mb.view()}};
      ls::cuda::sgd_update(spans, c);
      ls::math::sgd_update(rw.data(), fgw.data(), rmw.data(), kFeatures, c);
      ls::math::sgd_update(&rb, &fgb, &rmb, 1, c);
    } else {
      auto c = ls::math::adam_coeffs<float>(1e-2, 0.9, 0.999, 1e-8, 0.01, rule == Rule::adamw, step);
      const std::vector<ls::cuda::AdamSpan> spans = {{w.view(), gw.view(), mw.view(), vw.view()},
                                                     {b.view(), gb.view(), mb.view(), vb.view()}};
      ls::cuda::adam_update(spans, c);
      ls::math::adam_update(rw.data(), fgw.data(), rmw.data(), rvw.data(), kFeatures, c);
      ls::math::adam_update(&rb, &fgb, &rmb, &rvb, 1, c);
    }
    // Lockstep: every rank's parameters equal rank 0's, bitwise.
    ls::Tensor mine = w.to(ls::Device::cpu());
    ls::Tensor all = ls::Tensor::zeros({kFeatures * size});
    mpi.allgather(mine.view(), all.view());
    for (int r = 1; r < size; ++r)
      identical = identical && std::memcmp(all.data<float>() + r * kFeatures, all.data<float>(), kFeatures * 4) == 0;
  }
  ls::Tensor fw = w.to(ls::Device::cpu()), fb = b.to(ls::Device::cpu());
  bool close = true;
  double worst = 0;
  for (int j = 0; j <= kFeatures; ++j) {
    const double a = j < kFeatures ? fw.data<float>()[j] : fb.data<float>()[0];
    const double e = j < kFeatures ? rw[j] : rb;
    const double rel = std::fabs(a - e) / std::max(1.0, std::fabs(e));
    worst = std::max(worst, rel);
    close = close && rel <= 1e-5;
  }
  if (!close) std::cerr << "rank " << rank << ": largest relative difference " << worst << "\n";
  const bool moved = std::fabs(fw.data<float>()[0]) > 1e-3;  // training did something
  int local = close && identical && moved ? 1 : 0, global = 0;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  CHECK(identical);
  CHECK(moved);
  REQUIRE(global == 1);
}

}  // namespace

TEST_CASE("data-parallel SGD with momentum on cuda tensors over NCCL equals one process", "[nccl][training]") {
  run_equivalence(Rule::sgd_momentum);
}
TEST_CASE("data-parallel Adam on cuda tensors over NCCL equals one process", "[nccl][training]") {
  run_equivalence(Rule::adam);
}
TEST_CASE("data-parallel AdamW on cuda tensors over NCCL equals one process", "[nccl][training]") {
  run_equivalence(Rule::adamw);
}

namespace {
// The training core's own path on the GPU: synchronize from rank 0 over NCCL (cuda tensors),
// then DistributedOptimizer(NCCLBackend, rule) with the rule's updates running through the
// CUDA kernels the extension installs; `flat` selects zero-copy gradients (one allocation)
// instead of separate tensors (packed into a bucket). The reference is ls::update on the host
// over the whole batch; `tol` the largest relative difference allowed (16-bit gradients on the
// wire round each gradient, so their runs get a looser one).
template <class Rule>
void run_distributed_optimizer(const Rule& rule, bool flat, ls::DistributedOptions options = {}, double tol = 1e-5) {
  ls::initialize<ls::NCCLBackend>();
  auto& nccl = ls::get_distributed_backend<ls::NCCLBackend>();
  auto& mpi = ls::get_distributed_backend<ls::MPIBackend>();
  const int rank = nccl.rank(), size = nccl.size();
  REQUIRE(kBatch % size == 0);
  const ls::Device dev = ls::Device::cuda(nccl.device());

  // Rank-dependent start; synchronize makes every rank start from rank 0's values.
  auto init = [](int r) {
    std::vector<float> w(kFeatures);
    for (int j = 0; j < kFeatures; ++j) w[j] = 0.01f * static_cast<float>((j * 7 + r * 5) % 11) - 0.05f;
    return w;
  };
  GpuModel model{ls::Tensor::from(init(rank), {kFeatures}).to(dev), ls::Tensor::full({1}, 0.1 * rank, ls::DType::f32, dev)};
  ls::synchronize(nccl, model, 0);
  GpuModel ref{ls::Tensor::from(init(0), {kFeatures}), ls::Tensor::full({1}, 0.0)};

  auto opt = ls::DistributedOptimizer(nccl, rule, options);
  auto state = ls::setup(opt, model);
  auto ref_state = ls::setup(rule, ref);
  if (options.shard_optimizer_state) {
    // Rule state for this rank's shard only: the replicated state's bytes per element times
    // the shard's elements.
    auto rep_opt = ls::DistributedOptimizer(nccl, rule);
    const auto rep_state = ls::setup(rep_opt, model);
    const std::size_t per_elem = rep_state.local_state_bytes() / static_cast<std::size_t>(kFeatures + 1);
    CHECK(state.sharded());
    CHECK(state.local_state_bytes() == static_cast<std::size_t>(state.reducer().shard_numel()) * per_elem);
  }
  auto flat_grads = ls::flat_zeros_like(model);
  GpuModel sep_grads = ls::zeros_like(model);
  GpuModel& grads = flat ? flat_grads.get() : sep_grads;
  GpuModel ref_grads = ls::zeros_like(ref);

  bool identical = true;
  const int lo = rank * (kBatch / size), hi = lo + kBatch / size;
  for (int step = 1; step <= kSteps; ++step) {
    const Data d = batch(step);
    ls::Tensor hw = model.w.to(ls::Device::cpu()), hb = model.b.to(ls::Device::cpu());
    std::vector<float> lgw;
    float lgb = 0;
    grads_of(d, lo, hi, hw.data<float>(), hb.data<float>()[0], lgw, lgb);
    grads.w.copy_from(ls::view_of(std::span<float>(lgw)));
    grads.b.copy_from(ls::view_of(std::span<float>(&lgb, 1)));
    ls::update(state, model, grads);

    std::vector<float> fgw;
    float fgb = 0;
    grads_of(d, 0, kBatch, ref.w.data<float>(), ref.b.data<float>()[0], fgw, fgb);
    ref_grads.w.copy_from(ls::view_of(std::span<float>(fgw)));
    ref_grads.b.copy_from(ls::view_of(std::span<float>(&fgb, 1)));
    ls::update(ref_state, ref, ref_grads);

    ls::Tensor mine = model.w.to(ls::Device::cpu());
    ls::Tensor all = ls::Tensor::zeros({kFeatures * size});
    mpi.allgather(mine.view(), all.view());
    for (int r = 1; r < size; ++r)
      identical = identical && std::memcmp(all.data<float>() + r * kFeatures, all.data<float>(), kFeatures * 4) == 0;
  }
  ls::Tensor fw = model.w.to(ls::Device::cpu()), fb = model.b.to(ls::Device::cpu());
  double worst = 0;
  for (int j = 0; j <= kFeatures; ++j) {
    const double a = j < kFeatures ? fw.data<float>()[j] : fb.data<float>()[0];
    const double e = j < kFeatures ? ref.w.data<float>()[j] : ref.b.data<float>()[0];
    worst = std::max(worst, std::fabs(a - e) / std::max(1.0, std::fabs(e)));
  }
  if (worst > tol) std::cerr << "rank " << rank << ": largest relative difference " << worst << "\n";
  int local = worst <= tol && identical ? 1 : 0, global = 0;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  CHECK(identical);
  REQUIRE(global == 1);
}
}  // namespace

TEST_CASE("DistributedOptimizer(NCCLBackend, Adam) on cuda tensors equals ls::update on the host",
          "[nccl][training]") {
  run_distributed_optimizer(ls::Adam{.lr = 1e-2f}, false);
  run_distributed_optimizer(ls::Adam{.lr = 1e-2f}, true);
}
TEST_CASE("DistributedOptimizer(NCCLBackend, SGD with momentum) on cuda tensors equals the host",
          "[nccl][training]") {
  run_distributed_optimizer(ls::SGD{.lr = 0.05f, .momentum = 0.9f}, true);
}

TEST_CASE("DistributedOptimizer(NCCLBackend) with sharded state on cuda tensors equals the host",
          "[nccl][training][sharded]") {
  // ncclReduceScatter and ncclAllGather per bucket, in place; the rule over the shard's pieces.
  const ls::DistributedOptions shard{.shard_optimizer_state = true};
  run_distributed_optimizer(ls::Adam{.lr = 1e-2f}, false, shard);
  run_distributed_optimizer(ls::AdamW(1e-2f, 0.05f), true, shard);
  run_distributed_optimizer(ls::SGD{.lr = 0.05f, .momentum = 0.9f, .nesterov = true}, true, shard);
}
TEST_CASE("DistributedOptimizer(NCCLBackend) with bf16 and f16 gradients on the wire, cuda tensors",
          "[nccl][training][wire]") {
  // Converted on the device, summed by NCCL in 16 bits, converted back with the division.
  for (const ls::DType dt : {ls::DType::bf16, ls::DType::f16}) {
    ls::DistributedOptions o{};
    o.wire_dtype = dt;
    run_distributed_optimizer(ls::Adam{.lr = 1e-2f}, false, o, 2e-2);
    o.shard_optimizer_state = true;
    run_distributed_optimizer(ls::Adam{.lr = 1e-2f}, true, o, 2e-2);
  }
}
