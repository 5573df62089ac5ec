// MPIBackend and DistributedOptimizer on cuda tensors, on a machine without a GPU.
//
// The DeviceRuntime installed here (GuardedHostRuntime) is the seam the CUDA extension fills,
// implemented with host memory that host code cannot touch: every "device" allocation is its
// own mmap region, kept PROT_NONE except while the runtime itself copies or zeroes it (as a
// GPU's memory is reachable only through the CUDA runtime). Any host code that reads or writes
// a device pointer (MPI on a path that should have been staged, the avg division, the f16/bf16
// operators, a memcpy) dies with SIGSEGV, which fails the test. The runtime counts what a CUDA
// runtime would do: allocations, copies, synchronisations. The optimizer kernels installed
// here stand in for the CUDA kernels only to count launches: each call is one launch on a GPU,
// and it computes with optim_math.hpp (what the kernels run) so that the results can be checked
// against the host rules.
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
#include <vector>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

namespace {

class GuardedHostRuntime final : public ls::DeviceRuntime {
 public:
  struct Counts {
    long allocations = 0, pinned_allocations = 0, copies = 0, zeroes = 0, syncs = 0;
  };

  void* allocate(std::size_t bytes, int) override {
    std::lock_guard lock(m_);
    const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t len = std::max<std::size_t>(page, (bytes + page - 1) / page * page);
    void* p = ::mmap(nullptr, len, all_open_ ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    regions_[static_cast<char*>(p)] = len;
    ++counts_.allocations;
    return p;
  }
  void deallocate(void* p, int) noexcept override {
    std::lock_guard lock(m_);
    auto it = regions_.find(static_cast<char*>(p));
    if (it == regions_.end()) return;
    ::munmap(it->first, it->second);
    regions_.erase(it);
  }
  void copy(void* dst, ls::Device dd, const void* src, ls::Device sd, std::size_t bytes) override {
    std::lock_guard lock(m_);
    ++counts_.copies;
    if (bytes == 0) return;
    Open a(*this, dd.is_cpu() ? nullptr : dst), b(*this, sd.is_cpu() ? nullptr : src);
    std::memmove(dst, src, bytes);
  }
  void zero(void* p, std::size_t bytes, int) override {
    std::lock_guard lock(m_);
    ++counts_.zeroes;
    if (bytes == 0) return;
    Open a(*this, p);
    std::memset(p, 0, bytes);
  }
  void synchronize(int) override {
    std::lock_guard lock(m_);
    ++counts_.syncs;
  }
  void* allocate_pinned(std::size_t bytes) override {
    std::lock_guard lock(m_);
    ++counts_.pinned_allocations;
    return std::aligned_alloc(64, std::max<std::size_t>(64, (bytes + 63) / 64 * 64));
  }
  void deallocate_pinned(void* p) noexcept override { std::free(p); }
  int device_count() override { return 1; }

  Counts counts() {
    std::lock_guard lock(m_);
    return counts_;
  }
  void reset_counts() {
    std::lock_guard lock(m_);
    counts_ = {};
  }
  /// Lets host code (MPI on the direct path of a CUDA-aware MPI, the kernel stand-ins) reach
  /// every device allocation until close_all().
  void open_all() {
    std::lock_guard lock(m_);
    for (auto& [p, len] : regions_) ::mprotect(p, len, PROT_READ | PROT_WRITE);
    all_open_ = true;
  }
  void close_all() {
    std::lock_guard lock(m_);
    for (auto& [p, len] : regions_) ::mprotect(p, len, PROT_NONE);
    all_open_ = false;
  }

 private:
  // Opens the region holding `p` for the scope (nothing for host pointers).
  struct Open {
    Open(GuardedHostRuntime& rt, const void* p) : rt_(rt) {
      if (p == nullptr || rt.all_open_) return;
      auto it = rt.regions_.upper_bound(static_cast<char*>(const_cast<void*>(p)));
      const bool inside = it != rt.regions_.begin() && static_cast<const char*>(p) < std::prev(it)->first + std::prev(it)->second;
      if (!inside) std::cerr << "GuardedHostRuntime: " << p << " is not device memory of this runtime\n";
      REQUIRE(inside);
      --it;
      base_ = it->first;
      len_ = it->second;
      ::mprotect(base_, len_, PROT_READ | PROT_WRITE);
    }
    ~Open() {
      if (base_ != nullptr) ::mprotect(base_, len_, PROT_NONE);
    }
    GuardedHostRuntime& rt_;
    char* base_ = nullptr;
    std::size_t len_ = 0;
  };

  std::mutex m_;
  std::map<char*, std::size_t> regions_;
  Counts counts_;
  bool all_open_ = false;
};

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
    auto c = ls::math::adam_coeffs<float>(r.lr, r.beta1, r.beta2, r.eps, r.weight_decay, r.decoupled_weight_decay,
                                          step);
    ls::math::adam_update(static_cast<float*>(p.data), static_cast<const float*>(g.data),
                          static_cast<float*>(m.data), static_cast<float*>(v.data), p.numel, c);
    rt_.close_all();
  }

 private:
  GuardedHostRuntime& rt_;
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
  long launches, copies, syncs, allocations, pinned_allocations;
};

template <class Grads>
StepCost run_steps(Installed& in, ls::MPIBackend& mpi, DevModel& model, Grads& grads, DevModel& ref,
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
    cost = {in.kernels.launches, c.copies, c.syncs, c.allocations, c.pinned_allocations};
    ls::update(ref_state, ref, ref_grads);
  }
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
              << ", synchronisations " << c.syncs << ", device allocations " << c.allocations
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
  // The counts of docs/gpu.md ("What one step costs"): update both together.
  const ls::DistributedOptions opts{};  // 1 MiB buckets: every gradient here fits in one bucket

  SECTION("separate gradient tensors: packed into a bucket and unpacked, one copy per tensor") {
    DevModel grads = ls::zeros_like(model);
    const StepCost c = run_steps(in, mpi, model, grads, ref, opts);
    report("separate gradients", c, mpi.rank(), size);
    CHECK(c.launches == kTensors);  // the rule path: one launch per tensor
    CHECK(c.allocations == 0);      // no device allocation in a steady-state step
    CHECK(c.pinned_allocations == 0);
    // pack + unpack per tensor, plus the staging of the one bucket (in and out); at one rank
    // too (the bucket is staged and reduced although one rank's sum is the data itself).
    CHECK(c.copies == 2 * kTensors + 2);
    CHECK(c.syncs == 1);  // one per collective: the staging waits for the whole device
  }
  SECTION("flat gradients (flat_zeros_like): reduced in place, no pack or unpack") {
    auto flat = ls::flat_zeros_like(model);
    const StepCost c = run_steps(in, mpi, model, flat.get(), ref, opts);
    report("flat gradients", c, mpi.rank(), size);
    CHECK(c.launches == kTensors);
    CHECK(c.allocations == 0);
    CHECK(c.pinned_allocations == 0);
    CHECK(c.copies == 2);  // the staging of the one bucket only
    CHECK(c.syncs == 1);
  }
}
