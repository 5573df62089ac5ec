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
#include <filesystem>
#include <iostream>
#include <iterator>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "guarded_device_runtime.hpp"
#include "test_support.hpp"

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
class CountingBackend final : public lstest::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  long groups = 0, group_buffers = 0;

  std::string name() const override { return "counting(mpi)"; }

 protected:
  ls::Request do_iallreduce_many(std::span<const ls::TensorView> bufs, ls::ReduceOp op) override {
    ++groups;
    group_buffers += static_cast<long>(bufs.size());
    return inner().iallreduce_many(bufs, op);
  }
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

// The largest |got - want| over the layers: got's on the device (read back), want's on the host.
template <class Got>
double worst_difference(const Got& got, const DevModel& want) {
  double worst = 0;
  for (int j = 0; j < kTensors; ++j) {
    const auto g = host_values(got.layers[static_cast<std::size_t>(j)]);
    const float* w = static_cast<const float*>(want.layers[static_cast<std::size_t>(j)].raw_data());
    for (std::size_t i = 0; i < g.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(g[i] - w[i])));
  }
  return worst;
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
    cost = {in.kernels.launches + c.copy_launches + c.convert_launches, c.copies, c.syncs, c.stream_syncs,
            c.allocations, c.pinned_allocations};
    ls::update(ref_state, ref, ref_grads);
  }
  // The gradients hold the mean over the ranks after update (unpacked, or reduced in place).
  CHECK(worst_difference(grads, ref_grads) < 1e-6);
  CHECK(worst_difference(model, ref) < 1e-5);
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
  CHECK(worst_difference(model, ref) < 1e-6);  // the same optim_math.hpp arithmetic
  // A bad slot anywhere is refused before any tensor changes.
  auto adam = ls::setup(ls::Adam{}, model);
  adam.slots.back().exp_avg = ls::Tensor::zeros({2}, ls::DType::f32, kDev);
  const auto before = host_values(model.layers[0]);
  in.kernels.launches = 0;
  CHECK_THROWS_AS(ls::update(adam, model, grads), ls::InvalidArgument);
  CHECK(in.kernels.launches == 0);
  CHECK(host_values(model.layers[0]) == before);
}

// ---- shard_optimizer_state on cuda tensors ------------------------------------------------------

namespace {
constexpr std::int64_t kTotal = 256 + 16 + 4096 + 64 + 1031 + 7 + 20000 + 1;

// Every value of a model, on the host, back to back.
std::vector<float> all_values(const DevModel& m) {
  std::vector<float> out;
  for (const auto& t : m.layers) {
    const auto v = host_values(t);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// True on every rank if v is bitwise rank 0's v.
bool same_as_rank0(std::vector<float> v) {
  std::vector<float> r0 = v;
  MPI_Bcast(r0.data(), static_cast<int>(r0.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  int same = std::memcmp(r0.data(), v.data(), v.size() * sizeof(float)) == 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return same == 1;
}

// `steps` steps of update() from step `first` on; returns what the last one cost.
template <class State>
StepCost step_device(Installed& in, State& st, DevModel& model, DevModel& grads, int rank, int first, int steps) {
  StepCost cost{};
  for (int s = first; s < first + steps; ++s) {
    set_grads(grads, rank, s);
    in.rt.reset_counts();
    in.kernels.launches = 0;
    ls::update(st, model, grads);  // device memory closed: host code touching it would crash
    const auto c = in.rt.counts();
    cost = {in.kernels.launches + c.copy_launches + c.convert_launches, c.copies, c.syncs, c.stream_syncs,
            c.allocations, c.pinned_allocations};
  }
  return cost;
}

// Trains a sharded and a replicated DistributedOptimizer(rule) side by side on cuda tensors (the
// same gradients) and checks: the parameters equal bitwise (at 1 and 2 ranks the sum has one
// order: a + b, divided by 2 exactly), every rank holds the same parameters, the sharded state
// holds shard_numel() elements' worth of rule state and the shards tile the flat space. Returns
// the sharded step's cost.
template <class Rule>
StepCost sharded_vs_replicated(Installed& in, ls::Backend& be, const Rule& rule, bool flat_params, bool flat_grads,
                               ls::DistributedOptions shd) {
  const int rank = be.rank();
  shd.shard_optimizer_state = true;
  ls::DistributedOptions rep = shd;
  rep.shard_optimizer_state = false;
  const DevModel base = make_model(kDev);
  auto fs = ls::flat_copy(base), fr = ls::flat_copy(base);
  DevModel ms = make_model(kDev), mr = make_model(kDev);
  DevModel& s_model = flat_params ? fs.get() : ms;
  DevModel& r_model = flat_params ? fr.get() : mr;
  auto fgs = ls::flat_zeros_like(base), fgr = ls::flat_zeros_like(base);
  DevModel gs_sep = ls::zeros_like(base), gr_sep = ls::zeros_like(base);
  DevModel& gs = flat_grads ? fgs.get() : gs_sep;
  DevModel& gr = flat_grads ? fgr.get() : gr_sep;

  auto so = ls::DistributedOptimizer(be, rule, shd);
  auto ro = ls::DistributedOptimizer(be, rule, rep);
  auto ss = ls::setup(so, s_model);
  auto rs = ls::setup(ro, r_model);
  CHECK(ss.sharded());
  // Rule state for the shard only: its elements times the rule's bytes per element.
  const std::size_t per_elem = rs.local_state_bytes() / static_cast<std::size_t>(kTotal);
  CHECK(per_elem * static_cast<std::size_t>(kTotal) == rs.local_state_bytes());
  CHECK(ss.local_state_bytes() == static_cast<std::size_t>(ss.reducer().shard_numel()) * per_elem);
  long long mine = ss.reducer().shard_numel(), sum = 0;
  MPI_Allreduce(&mine, &sum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  CHECK(sum == kTotal);

  const StepCost c = step_device(in, ss, s_model, gs, rank, 1, 3);
  step_device(in, rs, r_model, gr, rank, 1, 3);
  const auto s_values = all_values(s_model), r_values = all_values(r_model);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < s_values.size(); ++i) differ += std::memcmp(&s_values[i], &r_values[i], 4) != 0;
  INFO("parameters differing from the replicated run: " << differ << " of " << s_values.size());
  CHECK(differ == 0);
  CHECK(s_values != all_values(base));  // the steps did change the parameters
  CHECK(same_as_rank0(s_values));       // replicas bitwise equal
  CHECK(ss.inner.step == 3);
  return c;
}
}  // namespace

TEST_CASE("sharded SGD and Adam on cuda tensors equal the replicated optimizer, keep 1/N of the state, "
          "and cost this per step", "[device][sharded]") {
  Installed in;
  ls::MPIBackend mpi(MPI_COMM_WORLD);
  mpi.set_cuda_aware(false);  // the staged path
  const int rank = mpi.rank(), size = mpi.size();
  const ls::SGD sgd{.lr = 0.05f, .momentum = 0.9f, .nesterov = true};
  const ls::Adam adamw = ls::AdamW(1e-2f, 0.05f);
  const ls::DistributedOptions one_bucket{};  // 25 MiB device buckets: the 25,471 elements are one bucket

  // Per steady-state step at 2 ranks, one bucket of 25,471 elements (piece 12,735, tail 1):
  // waited copies: the reduce-scatter stages the bucket in and the piece out (2), the tail's
  // allreduce in and out (2), the all-gather the piece in and the bucket out (2), the tail's
  // broadcast in on its root or out elsewhere (1): 7. No synchronisation: the collectives run
  // stream-ordered (the staging copies follow the current stream).
  auto common = [&](const StepCost& c) {
    CHECK(c.allocations == 0);
    CHECK(c.pinned_allocations == 0);
    CHECK(c.syncs == 0);
    CHECK(c.stream_syncs == 0);
    CHECK(c.copies == (size == 1 ? 0 : 7));
  };
  SECTION("separate parameters and gradients") {
    for (int r = 0; r < 2; ++r) {
      const StepCost c = r == 0 ? sharded_vs_replicated(in, mpi, sgd, false, false, one_bucket)
                                : sharded_vs_replicated(in, mpi, adamw, false, false, one_bucket);
      report(r == 0 ? "sharded SGD, separate" : "sharded AdamW, separate", c, rank, size);
      common(c);
      // The rule once over the shard's pieces; at 2 ranks also the pack, the unpack of this
      // rank's piece, and the all-gather's pack of the piece and unpack of the bucket.
      CHECK(c.launches == (size == 1 ? 1 : 5));
    }
  }
  SECTION("flat gradients: reduced in place") {
    const StepCost c = sharded_vs_replicated(in, mpi, adamw, false, true, one_bucket);
    report("sharded AdamW, flat gradients", c, rank, size);
    common(c);
    CHECK(c.launches == (size == 1 ? 1 : 3));
  }
  SECTION("flat parameters and gradients: reduce-scattered and all-gathered in place") {
    const StepCost c = sharded_vs_replicated(in, mpi, sgd, true, true, one_bucket);
    report("sharded SGD, flat parameters and gradients", c, rank, size);
    common(c);
    CHECK(c.launches == 1);
  }
  SECTION("three device buckets, one of them smaller than N elements") {
    ls::DistributedOptions small{};
    small.device_bucket_bytes = 32 << 10;  // buckets [1], [20000], [the six first: 5470]
    const StepCost c = sharded_vs_replicated(in, mpi, adamw, false, false, small);
    report("sharded AdamW, 3 buckets", c, rank, size);
    CHECK(c.allocations == 0);
    CHECK(c.pinned_allocations == 0);
    CHECK(c.syncs == 0);
    CHECK(c.stream_syncs == 0);
    // At 2 ranks: the 1-element bucket is a tail only (allreduce 2, broadcast 1), the others a
    // reduce-scatter and an all-gather each (2 + 2); only the packed bucket launches copies.
    CHECK(c.copies == (size == 1 ? 0 : 11));
    CHECK(c.launches == (size == 1 ? 1 : 5));
  }
}

TEST_CASE("a checkpoint of a sharded state on cuda tensors loads on the host, at one rank, and sharded again",
          "[device][sharded][checkpoint]") {
  Installed in;
  ls::MPIBackend mpi(MPI_COMM_WORLD), self(MPI_COMM_SELF);
  mpi.set_cuda_aware(false);
  self.set_cuda_aware(false);
  const int rank = mpi.rank();
  long pid = rank == 0 ? static_cast<long>(::getpid()) : 0;
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("lockstep_device_seam_" + std::to_string(pid) + ".safetensors");
  const ls::Adam rule = ls::AdamW(1e-2f, 0.05f);
  const ls::DistributedOptions shd{.shard_optimizer_state = true};

  DevModel m = make_model(kDev), g = ls::zeros_like(m);
  auto so = ls::DistributedOptimizer(mpi, rule, shd);
  auto ss = ls::setup(so, m);
  step_device(in, ss, m, g, rank, 1, 3);
  const std::size_t bytes = ss.local_state_bytes();
  ls::save_checkpoint(mpi, path, std::tie(m, ss));
  CHECK(ss.local_state_bytes() == bytes);  // back to the shard after the save

  // On the host, replicated, at one rank (every rank reads the file alone): the same values.
  DevModel hm = make_model(ls::Device::cpu());
  auto ho = ls::DistributedOptimizer(self, rule);
  auto hs = ls::setup(ho, hm);
  { auto x = std::tie(hm, hs); ls::load_checkpoint(self, path, x); }
  CHECK(hs.inner.step == 3);
  CHECK(all_values(hm) == all_values(m));
  auto host_piece = [](const ls::Tensor& full, std::int64_t lo, std::int64_t hi) {
    const float* p = static_cast<const float*>(full.raw_data());
    return std::vector<float>(p + lo, p + hi);
  };
  const auto& pieces = ss.shard_pieces();
  REQUIRE(pieces.size() == ss.inner.slots.size());
  int bad = 0;
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const auto& p = pieces[k];
    bad += host_values(ss.inner.slots[k].exp_avg) != host_piece(hs.inner.slots[p.leaf].exp_avg, p.lo, p.hi);
    bad += host_values(ss.inner.slots[k].exp_avg_sq) != host_piece(hs.inner.slots[p.leaf].exp_avg_sq, p.lo, p.hi);
  }
  CHECK(bad == 0);

  // Sharded on cuda tensors at one rank (its shard is everything): the host state's slots.
  DevModel m1 = ls::zeros_like(m);
  auto s1o = ls::DistributedOptimizer(self, rule, shd);
  auto s1 = ls::setup(s1o, m1);
  { auto x = std::tie(m1, s1); ls::load_checkpoint(self, path, x); }
  CHECK(s1.inner.step == 3);
  CHECK(all_values(m1) == all_values(hm));
  bad = 0;
  for (std::size_t k = 0; k < s1.shard_pieces().size(); ++k) {
    const auto& p = s1.shard_pieces()[k];
    bad += host_values(s1.inner.slots[k].exp_avg) != host_piece(hs.inner.slots[p.leaf].exp_avg, p.lo, p.hi);
    bad += host_values(s1.inner.slots[k].exp_avg_sq) != host_piece(hs.inner.slots[p.leaf].exp_avg_sq, p.lo, p.hi);
  }
  CHECK(bad == 0);

  // Sharded again at this N: it goes on exactly as the uninterrupted run.
  DevModel m2 = ls::zeros_like(m), g2 = ls::zeros_like(m);
  auto s2 = ls::setup(so, m2);
  { auto x = std::tie(m2, s2); ls::load_checkpoint(mpi, path, x); }
  step_device(in, ss, m, g, rank, 4, 2);
  step_device(in, s2, m2, g2, rank, 4, 2);
  CHECK(s2.inner.step == 5);
  CHECK(all_values(m2) == all_values(m));
  CHECK(same_as_rank0(all_values(m2)));
  mpi.barrier();
  if (rank == 0) std::filesystem::remove(path);
}

TEST_CASE("sharding refuses trainable tensors on two devices, on every rank", "[device][sharded][errors]") {
  Installed in;
  ls::MPIBackend mpi(MPI_COMM_WORLD);
  DevModel m = make_model(kDev);
  m.layers[3] = ls::Tensor::zeros({64});  // one host tensor among the cuda ones
  auto so = ls::DistributedOptimizer(mpi, ls::Adam{}, ls::DistributedOptions{.shard_optimizer_state = true});
  try {
    (void)ls::setup(so, m);
    FAIL("setup accepted tensors on two devices");
  } catch (const ls::InvalidArgument& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("one device") != std::string::npos);
    CHECK(what.find("cpu") != std::string::npos);
  }
}

// ---- wire_dtype on cuda gradients ---------------------------------------------------------------

namespace {
// The elements of model `m` that hold reduced gradients after update(): this rank's shard when
// the state is sharded, everything otherwise; as host values, back to back.
template <class State>
std::vector<float> reduced_part(const State& st, const DevModel& m) {
  std::vector<float> out;
  if (!st.sharded()) return all_values(m);
  for (const auto& p : st.shard_pieces()) {
    const auto v = host_values(m.layers[p.leaf]);
    out.insert(out.end(), v.begin() + p.lo, v.begin() + p.hi);
  }
  return out;
}
}  // namespace

TEST_CASE("wire_dtype on cuda gradients: converted on the device, equal to the host path", "[device][wire]") {
  Installed in;
  ls::MPIBackend mpi(MPI_COMM_WORLD);
  mpi.set_cuda_aware(false);
  const int rank = mpi.rank(), size = mpi.size();
  const ls::Adam rule{.lr = 1e-2f};
  for (const ls::DType dt : {ls::DType::bf16, ls::DType::f16}) {
    for (const bool shard : {false, true}) {
      INFO(ls::name(dt) << (shard ? ", sharded" : ", replicated"));
      ls::DistributedOptions o{};
      o.wire_dtype = dt;
      o.shard_optimizer_state = shard;
      DevModel md = make_model(kDev), gd = ls::zeros_like(md);
      DevModel mh = make_model(ls::Device::cpu()), gh = ls::zeros_like(mh);
      auto od = ls::DistributedOptimizer(mpi, rule, o);
      auto oh = ls::DistributedOptimizer(mpi, rule, o);
      auto sd = ls::setup(od, md);
      auto sh = ls::setup(oh, mh);
      const StepCost c = step_device(in, sd, md, gd, rank, 1, 3);
      step_device(in, sh, mh, gh, rank, 1, 3);
      report(shard ? "wire, sharded" : "wire", c, rank, size);
      CHECK(c.allocations == 0);
      CHECK(c.pinned_allocations == 0);
      CHECK(c.syncs == 0);
      CHECK(c.stream_syncs == 0);
      if (size == 1) {
        // Nothing goes on a wire at one rank: the gradients are not rounded (the host path
        // rounds them through the wire dtype even there).
        CHECK(c.launches == 1);
        CHECK(c.copies == 0);
        DevModel want = ls::zeros_like(mh);
        set_grads(want, 0, 3);
        CHECK(all_values(gd) == all_values(want));
      } else {
        // The reduced gradients (this rank's shard, sharded) are the host path's, bitwise: one
        // rounding into the wire dtype, the same sum (a + b), the same f32 division.
        CHECK(reduced_part(sd, gd) == reduced_part(sh, gh));
        // Replicated: convert in, convert out, the rule; the 16-bit bucket staged in and out.
        // Sharded: also the all-gather's pack and unpack; the copies of the sharded step.
        CHECK(c.launches == (shard ? 5 : 3));
        CHECK(c.copies == (shard ? 7 : 2));
        double worst = 0;
        const auto a = all_values(md), b = all_values(mh);
        for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(a[i] - b[i])));
        CHECK(worst < 1e-6);  // the rule saw the same f32 gradients
        CHECK(same_as_rank0(a));
      }
    }
  }
}

// Deterministic mode on cuda gradients: copied to the host for the exact sum and the result
// back; the parameters equal the host path's bit for bit, the same on every rank.
TEST_CASE("deterministic mode on cuda tensors: the host path's bits, every rank alike", "[device][deterministic]") {
  Installed in;
  ls::MPIBackend mpi(MPI_COMM_WORLD);
  mpi.set_cuda_aware(false);
  const int rank = mpi.rank();
  const ls::Adam rule{.lr = 1e-2f};
  ls::DistributedOptions o{};
  o.deterministic = true;
  DevModel md = make_model(kDev), gd = ls::zeros_like(md);
  DevModel mh = make_model(ls::Device::cpu()), gh = ls::zeros_like(mh);
  auto od = ls::DistributedOptimizer(mpi, rule, o);
  auto oh = ls::DistributedOptimizer(mpi, rule, o);
  auto sd = ls::setup(od, md);
  auto sh = ls::setup(oh, mh);
  step_device(in, sd, md, gd, rank, 1, 3);
  step_device(in, sh, mh, gh, rank, 1, 3);
  const auto a = all_values(md), b = all_values(mh);
  CHECK(a == b);
  CHECK(same_as_rank0(a));
}
