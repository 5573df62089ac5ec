// MPIBackend and DistributedOptimizer on cuda tensors, on a machine without a GPU.
//
// The DeviceRuntime installed here (GuardedHostRuntime, test/guarded_device_runtime.hpp, which
// the remote calls' device test shares) is the seam the CUDA extension fills, implemented with
// host memory that host code cannot touch: every "device" allocation is its
// own mmap region, kept PROT_NONE except while the runtime itself copies or zeroes it (as a
// GPU's memory is reachable only through the CUDA runtime). Any host code that reads or writes
// a device pointer (MPI on a path that should have been staged, the avg division, the f16/bf16
// operators, a memcpy) dies with SIGSEGV, which fails the test. The runtime counts what a CUDA
// runtime would do: allocations, copies, synchronisations. The optimizer kernels installed
// here stand in for the CUDA kernels only to count launches: each call is one launch on a GPU,
// and it computes with optim_math.hpp (what the kernels run) so that the results can be checked
// against the host rules. The runtime's batched copies (copy_many: one pack or unpack kernel on
// a GPU) count as launches too.
//
// What this shows and what it cannot: the routing (which calls stage, which hand device
// pointers to MPI) and the per-step counts are those of the real MPIBackend, GradientReducer
// and DistributedOptimizer; the CUDA runtime, the kernels and a CUDA-aware MPI are not involved
// (their tests need a GPU, label nccl).
#include <catch2/catch.hpp>
#include <mpi.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "guarded_device_runtime.hpp"

namespace ls = lockstep;

namespace {

using lstest::GuardedHostRuntime;

// Counts launches; computes as the CUDA kernels do (optim_math.hpp), with the device memory
// opened for the duration, so that the training results can be compared with the host rules.
class CountingKernels final : public ls::DeviceOptimizerKernels {
 public:
  explicit CountingKernels(GuardedHostRuntime& rt) : rt_(rt) {}
  long launches = 0;

  void sgd(ls::TensorView p, ls::TensorView g, ls::TensorView buf, const ls::SGD& r, std::int64_t step) override {
    ++launches;
    REQUIRE(p.dtype == ls::DType::f32);
    rt_.open_all();
    auto c = ls::math::sgd_coeffs<float>(r.lr, r.momentum, r.dampening, r.weight_decay, r.nesterov, step);
    ls::math::sgd_update(static_cast<float*>(p.data), static_cast<const float*>(g.data),
                         r.momentum != 0.0f ? static_cast<float*>(buf.data) : nullptr, p.numel, c);
    rt_.close_all();
  }
  void adam(ls::TensorView p, ls::TensorView g, ls::TensorView m, ls::TensorView v, const ls::Adam& r,
            std::int64_t step) override {
    ++launches;
    REQUIRE(p.dtype == ls::DType::f32);
    rt_.open_all();
    adam_one(p, g, m, v, r, step);
    rt_.close_all();
  }
  // Multi-tensor apply: one launch for every tensor of the group.
  void sgd_many(std::span<const ls::SGDViews> ps, const ls::SGD& r, std::int64_t step) override {
    ++launches;
    rt_.open_all();
    for (const auto& v : ps) {
      REQUIRE(v.param.dtype == ls::DType::f32);
      auto c = ls::math::sgd_coeffs<float>(r.lr, r.momentum, r.dampening, r.weight_decay, r.nesterov, step);
      ls::math::sgd_update(static_cast<float*>(v.param.data), static_cast<const float*>(v.grad.data),
                           r.momentum != 0.0f ? static_cast<float*>(v.momentum_buffer.data) : nullptr, v.param.numel, c);
    }
    rt_.close_all();
  }
  void adam_many(std::span<const ls::AdamViews> ps, const ls::Adam& r, std::int64_t step) override {
    ++launches;
    rt_.open_all();
    for (const auto& v : ps) {
      REQUIRE(v.param.dtype == ls::DType::f32);
      adam_one(v.param, v.grad, v.exp_avg, v.exp_avg_sq, r, step);
    }
    rt_.close_all();
  }

 private:
  static void adam_one(ls::TensorView p, ls::TensorView g, ls::TensorView m, ls::TensorView v, const ls::Adam& r,
                       std::int64_t step) {
    auto c = ls::math::adam_coeffs<float>(r.lr, r.beta1, r.beta2, r.eps, r.weight_decay, r.decoupled_weight_decay,
                                          step);
    ls::math::adam_update(static_cast<float*>(p.data), static_cast<const float*>(g.data),
                          static_cast<float*>(m.data), static_cast<float*>(v.data), p.numel, c);
  }
  GuardedHostRuntime& rt_;
};

// A backend that forwards every collective to an MPIBackend and counts the iallreduce_many
// calls (the group of device buckets DistributedOptimizer sends at once).
class CountingBackend final : public ls::Backend {
 public:
  explicit CountingBackend(ls::MPIBackend& inner) : inner_(inner) {}
  long groups = 0, group_buffers = 0;

  std::string name() const override { return "counting(mpi)"; }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int local_rank() const override { return inner_.local_rank(); }
  int local_size() const override { return inner_.local_size(); }

 protected:
  void do_broadcast(ls::TensorView b, int root) override { inner_.broadcast(b, root); }
  void do_allreduce(ls::TensorView b, ls::ReduceOp op) override { inner_.allreduce(b, op); }
  void do_allreduce(ls::TensorView s, ls::TensorView r, ls::ReduceOp op) override { inner_.allreduce(s, r, op); }
  void do_reduce(ls::TensorView b, ls::ReduceOp op, int root) override { inner_.reduce(b, op, root); }
  void do_reduce(ls::TensorView s, ls::TensorView r, ls::ReduceOp op, int root) override {
    inner_.reduce(s, r, op, root);
  }
  void do_allgather(ls::TensorView s, ls::TensorView r) override { inner_.allgather(s, r); }
  void do_reduce_scatter(ls::TensorView s, ls::TensorView r, ls::ReduceOp op) override {
    inner_.reduce_scatter(s, r, op);
  }
  void do_barrier() override { inner_.barrier(); }
  ls::Request do_iallreduce(ls::TensorView b, ls::ReduceOp op) override { return inner_.iallreduce(b, op); }
  ls::Request do_ibroadcast(ls::TensorView b, int root) override { return inner_.ibroadcast(b, root); }
  ls::Request do_iallreduce_many(std::span<const ls::TensorView> bufs, ls::ReduceOp op) override {
    ++groups;
    group_buffers += static_cast<long>(bufs.size());
    return inner_.iallreduce_many(bufs, op);
  }

 private:
  ls::MPIBackend& inner_;
};

// Installs the runtime and the kernels for one test case (and restores what was there).
struct Installed {
  GuardedHostRuntime rt;
  CountingKernels kernels{rt};
  ls::DeviceRuntime* prev_rt = ls::find_device_runtime();
  ls::DeviceOptimizerKernels* prev_k = ls::find_device_optimizer_kernels();
  Installed() {
    ls::set_device_runtime(&rt);
    ls::set_device_optimizer_kernels(&kernels);
  }
  ~Installed() {
    ls::set_device_runtime(prev_rt);
    ls::set_device_optimizer_kernels(prev_k);
  }
};

const ls::Device kDev = ls::Device::cuda(0);

std::vector<float> host_values(const ls::Tensor& t) {
  ls::Tensor h = t.to(ls::Device::cpu());
  std::vector<float> v(static_cast<std::size_t>(h.numel()));
  if (h.dtype() == ls::DType::f32) {
    std::memcpy(v.data(), h.raw_data(), v.size() * 4);
  } else {
    const auto* s = static_cast<const std::uint16_t*>(h.raw_data());
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = h.dtype() == ls::DType::f16 ? ls::to_float(ls::half{s[i]}) : ls::to_float(ls::bfloat16{s[i]});
  }
  return v;
}

// n f32 elements on the device: (i % 13) + rank.
ls::Tensor device_ramp(std::int64_t n, int rank) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(i % 13) + static_cast<float>(rank);
  return ls::Tensor::from(v, {n}).to(kDev);
}

float expected_sum(std::int64_t i, int size) {
  return static_cast<float>(i % 13) * static_cast<float>(size) + static_cast<float>(size * (size - 1) / 2);
}

}  // namespace

TEST_CASE("MPIBackend with CUDA-aware MPI: device pointers never reach host code", "[device]") {
  Installed in;
  ls::MPIBackend mpi(MPI_COMM_WORLD);
  mpi.set_cuda_aware(true);
  const int rank = mpi.rank(), size = mpi.size();
  const std::int64_t n = 1031;

  auto check_all = [&](const ls::Tensor& t, auto expected) {
    const auto v = host_values(t);
    int bad = 0;
    for (std::int64_t i = 0; i < n; ++i)
      if (std::fabs(v[static_cast<std::size_t>(i)] - expected(i)) > 1e-3f * std::max(1.0f, std::fabs(expected(i)))) ++bad;
    return bad;
  };

  SECTION("avg: the division runs on a staged host copy") {
    ls::Tensor t = device_ramp(n, rank);
    in.rt.reset_counts();
    mpi.allreduce(t.view(), ls::ReduceOp::avg);  // device memory closed: a host access would crash
    const auto c = in.rt.counts();
    CHECK(check_all(t, [&](std::int64_t i) { return expected_sum(i, size) / static_cast<float>(size); }) == 0);
    // At one rank avg is the data itself (no pass, no staging); otherwise one copy in, one out.
    CHECK(c.copies == (size == 1 ? 0 : 2));
  }
  SECTION("out-of-place avg, reduce avg, reduce_scatter avg: staged") {
    // At one rank avg is sum, which needs no host work: the device pointers then go to the
    // CUDA-aware MPI as they are (it copies send to recv), so the memory is opened for it.
    if (size == 1) in.rt.open_all();
    ls::Tensor s = device_ramp(n, rank), r = ls::Tensor::zeros({n}, ls::DType::f32, kDev);
    mpi.allreduce(s.view(), r.view(), ls::ReduceOp::avg);
    CHECK(check_all(r, [&](std::int64_t i) { return expected_sum(i, size) / static_cast<float>(size); }) == 0);
    ls::Tensor q = device_ramp(n, rank);
    mpi.reduce(q.view(), ls::ReduceOp::avg, 0);
    if (rank == 0) CHECK(check_all(q, [&](std::int64_t i) { return expected_sum(i, size) / static_cast<float>(size); }) == 0);
    ls::Tensor big = device_ramp(n * size, rank), part = ls::Tensor::zeros({n}, ls::DType::f32, kDev);
    mpi.reduce_scatter(big.view(), part.view(), ls::ReduceOp::avg);
    const auto v = host_values(part);
    int bad = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t g = rank * n + i;
      if (std::fabs(v[static_cast<std::size_t>(i)] - expected_sum(g, size) / static_cast<float>(size)) > 1e-3f) ++bad;
    }
    CHECK(bad == 0);
    in.rt.close_all();
  }
  SECTION("f16 and bf16: the user-defined MPI operators run on staged host copies") {
    for (ls::DType dt : {ls::DType::f16, ls::DType::bf16}) {
      const std::int64_t m = 64;  // small values: exact in both 16-bit formats
      std::vector<ls::half> vh(m);
      std::vector<ls::bfloat16> vb(m);
      for (std::int64_t i = 0; i < m; ++i) {
        vh[static_cast<std::size_t>(i)] = ls::to_half(static_cast<float>(i % 4 + rank));
        vb[static_cast<std::size_t>(i)] = ls::to_bfloat16(static_cast<float>(i % 4 + rank));
      }
      ls::Tensor t = (dt == ls::DType::f16 ? ls::Tensor::from(vh, {m}) : ls::Tensor::from(vb, {m})).to(kDev);
      in.rt.reset_counts();
      mpi.allreduce(t.view(), ls::ReduceOp::sum);
      CHECK(in.rt.counts().copies == 2);
      const auto got = host_values(t);
      int bad = 0;
      for (std::int64_t i = 0; i < m; ++i)
        if (got[static_cast<std::size_t>(i)] != static_cast<float>((i % 4) * size + size * (size - 1) / 2)) ++bad;
      CHECK(bad == 0);
    }
  }
  SECTION("iallreduce: staged into a pinned buffer the request owns, even with CUDA-aware MPI") {
    ls::Tensor a = device_ramp(n, rank), b = device_ramp(n, rank + 1);
    in.rt.reset_counts();
    ls::Request ra = mpi.iallreduce(a.view(), ls::ReduceOp::sum);
    ls::Request rb = mpi.iallreduce(b.view(), ls::ReduceOp::avg);
    ra.wait();
    rb.wait();
    CHECK(in.rt.counts().copies == 4);
    CHECK(check_all(a, [&](std::int64_t i) { return expected_sum(i, size); }) == 0);
    CHECK(check_all(b, [&](std::int64_t i) { return (expected_sum(i, size) + static_cast<float>(size)) / static_cast<float>(size); }) == 0);
  }
  SECTION("f32 sum: handed to the CUDA-aware MPI directly (no staging copy)") {
    ls::Tensor t = device_ramp(n, rank);
    in.rt.reset_counts();
    in.rt.open_all();  // MPI reads the device pointer here, as a CUDA-aware MPI would
    mpi.allreduce(t.view(), ls::ReduceOp::sum);
    in.rt.close_all();
    CHECK(in.rt.counts().copies == 0);
    CHECK(in.rt.counts().syncs >= 1);  // the producer's work is waited for first
    CHECK(check_all(t, [&](std::int64_t i) { return expected_sum(i, size); }) == 0);
  }
  SECTION("written on the current stream (a reducer's bucket): that stream is waited for, not the device") {
    ls::Tensor t = device_ramp(n, rank);
    in.rt.reset_counts();
    in.rt.open_all();
    {
      ls::detail::StreamOrderedScope ordered;
      mpi.allreduce(t.view(), ls::ReduceOp::sum);
    }
    in.rt.close_all();
    const auto c = in.rt.counts();
    CHECK(c.copies == 0);
    CHECK(c.syncs == 0);
    CHECK(c.stream_syncs == 1);  // MPI reads the device memory itself: the stream must be done
    CHECK(check_all(t, [&](std::int64_t i) { return expected_sum(i, size); }) == 0);
  }
  SECTION("staged, written on the current stream: the staging copy follows the stream, no wait at all") {
    mpi.set_cuda_aware(false);
    ls::Tensor t = device_ramp(n, rank);
    in.rt.reset_counts();
    {
      ls::detail::StreamOrderedScope ordered;
      mpi.allreduce(t.view(), ls::ReduceOp::avg);
      ls::Request r = mpi.iallreduce(t.view(), ls::ReduceOp::sum);
      r.wait();
    }
    const auto c = in.rt.counts();
    CHECK(c.syncs == 0);
    CHECK(c.stream_syncs == 0);
    CHECK(c.copies == 4);  // each call: staged in, and out
    CHECK(check_all(t, [&](std::int64_t i) { return expected_sum(i, size); }) == 0);
  }
}

namespace device_seam {
struct DevModel {
  std::vector<ls::Tensor> layers;
};
LOCKSTEP_FIELDS(DevModel, layers)
}  // namespace device_seam
using device_seam::DevModel;

namespace {
constexpr int kTensors = 8;
constexpr std::int64_t kElems[kTensors] = {256, 16, 4096, 64, 1031, 7, 20000, 1};

DevModel make_model(ls::Device d) {
  DevModel m;
  for (int j = 0; j < kTensors; ++j) {
    std::vector<float> v(static_cast<std::size_t>(kElems[j]));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>((i * 7 + static_cast<std::size_t>(j)) % 17);
    m.layers.push_back(ls::Tensor::from(v, {kElems[j]}).to(d));
  }
  return m;
}

void set_grads(DevModel& g, int rank, int step) {
  for (int j = 0; j < kTensors; ++j) {
    std::vector<float> v(static_cast<std::size_t>(kElems[j]));
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = 0.001f * static_cast<float>((i + static_cast<std::size_t>(j + step)) % 11) + 0.0005f * static_cast<float>(rank);
    g.layers[static_cast<std::size_t>(j)].copy_from(ls::view_of(std::span<const float>(v)));
  }
}

// What one steady-state step of DistributedOptimizer(MPIBackend, Adam) costs on cuda tensors.
struct StepCost {
  long launches;     // optimizer kernels + pack/unpack copy kernels
  long copies;       // waited copies (the staging of MPI)
  long syncs;        // device-wide synchronisations
  long stream_syncs;
  long allocations, pinned_allocations;
};

template <class Grads>
StepCost run_steps(Installed& in, ls::Backend& mpi, DevModel& model, Grads& grads, DevModel& ref,
                   ls::DistributedOptions opts) {
  const int rank = mpi.rank(), size = mpi.size();
  ls::Adam rule{.lr = 1e-2f};
  auto opt = ls::DistributedOptimizer(mpi, rule, opts);
  auto state = ls::setup(opt, model);
  auto ref_state = ls::setup(rule, ref);
  DevModel ref_grads = ls::zeros_like(ref);
  StepCost cost{};
  for (int step = 1; step <= 3; ++step) {
    set_grads(grads, rank, step);
    // The host reference: the mean of every rank's gradients, by the host rule.
    set_grads(ref_grads, 0, step);
    for (auto& t : ref_grads.layers) {
      float* p = static_cast<float*>(t.raw_data());
      for (std::int64_t i = 0; i < t.numel(); ++i) p[i] += 0.0005f * static_cast<float>(size - 1) / 2.0f;
    }
    in.rt.reset_counts();
    in.kernels.launches = 0;
    ls::update(state, model, grads);  // device memory closed: host code touching it would crash
    const auto c = in.rt.counts();
    cost = {in.kernels.launches + c.copy_launches, c.copies, c.syncs, c.stream_syncs, c.allocations,
            c.pinned_allocations};
    ls::update(ref_state, ref, ref_grads);
  }
  // The gradients hold the mean over the ranks after update (unpacked, or reduced in place).
  double worst_grad = 0;
  for (int j = 0; j < kTensors; ++j) {
    const auto got = host_values(grads.layers[static_cast<std::size_t>(j)]);
    const float* want = static_cast<const float*>(ref_grads.layers[static_cast<std::size_t>(j)].raw_data());
    for (std::size_t i = 0; i < got.size(); ++i)
      worst_grad = std::max(worst_grad, static_cast<double>(std::fabs(got[i] - want[i])));
  }
  CHECK(worst_grad < 1e-6);
  double worst = 0;
  for (int j = 0; j < kTensors; ++j) {
    const auto got = host_values(model.layers[static_cast<std::size_t>(j)]);
    const float* want = static_cast<const float*>(ref.layers[static_cast<std::size_t>(j)].raw_data());
    for (std::size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(got[i] - want[i])));
  }
  CHECK(worst < 1e-5);
  return cost;
}

void report(const char* what, const StepCost& c, int rank, int size) {
  if (rank == 0)
    std::cout << "device step cost (" << what << ", " << size << " rank(s), " << kTensors
              << " tensors): launches " << c.launches << ", waited copies " << c.copies
              << ", device synchronisations " << c.syncs << ", stream synchronisations " << c.stream_syncs
              << ", device allocations " << c.allocations
              << ", pinned allocations " << c.pinned_allocations << "\n";
}
}  // namespace

TEST_CASE("DistributedOptimizer on cuda tensors: launches, copies, syncs and allocations per step",
          "[device]") {
  Installed in;
  ls::MPIBackend mpi(MPI_COMM_WORLD);
  mpi.set_cuda_aware(false);  // Debian's Open MPI: the staged path
  const int size = mpi.size();
  DevModel model = make_model(kDev), ref = make_model(ls::Device::cpu());
  // The counts of docs/gpu.md ("What one step costs"): update both together. Before the
  // device path was reworked, a step with separate gradients cost 8 launches, 18 waited copies
  // and 1 device-wide synchronisation.
  const ls::DistributedOptions opts{};  // 25 MiB device buckets: every gradient here fits in one

  SECTION("separate gradient tensors: one pack and one unpack launch per bucket") {
    DevModel grads = ls::zeros_like(model);
    const StepCost c = run_steps(in, mpi, model, grads, ref, opts);
    report("separate gradients", c, mpi.rank(), size);
    CHECK(c.allocations == 0);  // no device allocation in a steady-state step
    CHECK(c.pinned_allocations == 0);
    CHECK(c.syncs == 0);         // the bucket is packed on the current stream: stream order suffices
    CHECK(c.stream_syncs == 0);  // (the staging copies wait for that stream themselves)
    if (size == 1) {
      // One rank's mean is its gradient: nothing is packed, staged or sent.
      CHECK(c.launches == 1);  // the optimizer, once over the 8 tensors
      CHECK(c.copies == 0);
    } else {
      CHECK(c.launches == 3);  // pack, unpack, and the optimizer once over the 8 tensors
      CHECK(c.copies == 2);    // the staging of the one bucket, in and out
    }
  }
  SECTION("flat gradients (flat_zeros_like): reduced in place, no pack or unpack") {
    auto flat = ls::flat_zeros_like(model);
    const StepCost c = run_steps(in, mpi, model, flat.get(), ref, opts);
    report("flat gradients", c, mpi.rank(), size);
    CHECK(c.launches == 1);
    CHECK(c.allocations == 0);
    CHECK(c.pinned_allocations == 0);
    CHECK(c.copies == (size == 1 ? 0 : 2));  // the staging of the one bucket only
    CHECK(c.syncs == 0);
    CHECK(c.stream_syncs == 0);
  }
  SECTION("several device buckets: sent together in one iallreduce_many, never sliced") {
    CountingBackend counting(mpi);
    ls::DistributedOptions small = opts;
    // 32 KiB: the last tensor (4 B) and the 20000-element one (80 KB, whole: device buckets
    // are not sliced) are buckets of their own, the six before them one packed bucket.
    small.device_bucket_bytes = 32 << 10;
    DevModel grads = ls::zeros_like(model);
    const StepCost c = run_steps(in, counting, model, grads, ref, small);
    report("separate gradients, 3 buckets", c, mpi.rank(), size);
    CHECK(c.allocations == 0);
    CHECK(c.pinned_allocations == 0);
    CHECK(c.syncs == 0);
    CHECK(c.stream_syncs == 0);
    if (size == 1) {
      CHECK(counting.groups == 0);
      CHECK(c.launches == 1);
      CHECK(c.copies == 0);
    } else {
      CHECK(counting.groups == 3);         // one group per step, 3 steps
      CHECK(counting.group_buffers == 9);  // of the 3 buckets each
      CHECK(c.launches == 3);              // the two single-tensor buckets are reduced in place
      CHECK(c.copies == 6);                // MPIBackend stages each bucket, in and out
    }
  }
}

TEST_CASE("SGD and Adam on many cuda tensors: one launch per device and dtype, checked first", "[device]") {
  Installed in;
  DevModel model = make_model(kDev), ref = make_model(ls::Device::cpu());
  DevModel grads = ls::zeros_like(model), ref_grads = ls::zeros_like(ref);
  set_grads(grads, 0, 1);
  set_grads(ref_grads, 0, 1);
  ls::SGD sgd{.lr = 0.1f, .momentum = 0.9f};
  auto st = ls::setup(sgd, model);
  auto ref_st = ls::setup(sgd, ref);
  for (int step = 0; step < 2; ++step) {
    in.kernels.launches = 0;
    ls::update(st, model, grads);
    CHECK(in.kernels.launches == 1);
    ls::update(ref_st, ref, ref_grads);
  }
  double worst = 0;
  for (int j = 0; j < kTensors; ++j) {
    const auto got = host_values(model.layers[static_cast<std::size_t>(j)]);
    const float* want = static_cast<const float*>(ref.layers[static_cast<std::size_t>(j)].raw_data());
    for (std::size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(got[i] - want[i])));
  }
  CHECK(worst < 1e-6);  // the same optim_math.hpp arithmetic
  // A bad slot anywhere is refused before any tensor changes.
  auto adam = ls::setup(ls::Adam{}, model);
  adam.slots.back().exp_avg = ls::Tensor::zeros({2}, ls::DType::f32, kDev);
  const auto before = host_values(model.layers[0]);
  in.kernels.launches = 0;
  CHECK_THROWS_AS(ls::update(adam, model, grads), ls::InvalidArgument);
  CHECK(in.kernels.launches == 0);
  CHECK(host_values(model.layers[0]) == before);
}
