// Remote calls with cuda tensors, on a machine without a GPU (issue 15, item 1): device tensors
// as arguments and results are staged to the host once, by the rank that sends them, and
// arrive as host tensors. The DeviceRuntime installed on every rank (guarded_device_runtime.hpp)
// keeps its "device" memory PROT_NONE except inside its own copies, so host code that touched a
// device tensor's memory (the encoder sending from it, a partitioner slicing it on the host)
// would crash the test; its copy counts show where the staging happened.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "guarded_device_runtime.hpp"
#include "lockstep/lockstep.hpp"
#include "remote/remote_test_support.hpp"

namespace ls = lockstep;

namespace {

using namespace remote_test;

const ls::Device kDev = ls::Device::cuda(0);

// This rank's runtime, for the remote functions below (set by the test case on every rank).
lstest::GuardedHostRuntime* g_rt = nullptr;

// The values of an f32 tensor (a device one through a copy of the runtime).
std::vector<float> host_values(const ls::Tensor& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  if (t.device().is_cpu()) {
    if (!v.empty()) std::memcpy(v.data(), t.raw_data(), v.size() * sizeof(float));
  } else {
    const ls::Tensor h = t.to(ls::Device::cpu());
    if (!v.empty()) std::memcpy(v.data(), h.raw_data(), v.size() * sizeof(float));
  }
  return v;
}

// n f32 values (i % 13) + base, on the device.
ls::Tensor device_ramp(std::int64_t n, float base) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(i % 13) + base;
  return ls::Tensor::from(v, {n}).to(kDev);
}

long bad_ramp(const ls::Tensor& t, float scale, float base) {
  long bad = 0;
  const auto v = host_values(t);
  for (std::size_t i = 0; i < v.size(); ++i) bad += v[i] != scale * (static_cast<float>(i % 13) + base);
  return bad;
}

// k * t, computed on the host from the (host) tensor received, returned on the device: the reply
// stages it back to the host.
ls::Tensor scaled_on_device(const ls::Tensor& t, float k) {
  if (!t.device().is_cpu()) throw std::runtime_error("the argument arrived on " + ls::to_string(t.device()));
  std::vector<float> v = host_values(t);
  for (auto& x : v) x *= k;
  return ls::Tensor::from(v, t.shape()).to(kDev);
}
double sum_of(const ls::Tensor& t) {
  if (!t.device().is_cpu()) throw std::runtime_error("the argument arrived on " + ls::to_string(t.device()));
  double s = 0;
  for (float x : host_values(t)) s += x;
  return s;
}
long copies_here() { return g_rt->counts().copies; }
void reset_counts_here() { g_rt->reset_counts(); }

}  // namespace

namespace rdev {
struct Layers {
  ls::Tensor w;
  std::vector<ls::Tensor> more;
  float lr = 0;
};
LOCKSTEP_FIELDS(Layers, w, more, lr)

// Every tensor of the structure doubled, back on the device.
Layers doubled(const Layers& l) {
  Layers out;
  out.w = scaled_on_device(l.w, 2.0f);
  for (const auto& t : l.more) out.more.push_back(scaled_on_device(t, 2.0f));
  out.lr = l.lr * 2;
  return out;
}
}  // namespace rdev

LOCKSTEP_REMOTE(scaled_on_device)
LOCKSTEP_REMOTE(sum_of)
LOCKSTEP_REMOTE(copies_here)
LOCKSTEP_REMOTE(reset_counts_here)
LOCKSTEP_REMOTE(rdev::doubled)

TEST_CASE("remote: cuda tensor arguments and results are staged once, no host access to device memory",
          "[device]") {
  lstest::InstalledRuntime in;
  g_rt = &in.rt;
  auto& b = backend();
  const std::int64_t n = 100003;  // over the receive cache's lower bound (64 KiB): into a cached buffer
  ls::run_driver(b, [&] {
    for (int r = 0; r < world(); ++r) {
      const ls::Tensor x = device_ramp(n, static_cast<float>(r));
      ls::remote_sync_call(b, r, reset_counts_here);
      in.rt.reset_counts();
      const ls::Tensor y = ls::remote_sync_call(b, r, scaled_on_device, x, 3.0f);
      CHECK(y.device().is_cpu());  // a device result arrives as a host tensor
      REQUIRE(y.numel() == n);
      CHECK(bad_ramp(y, 3.0f, static_cast<float>(r)) == 0);
      // The copies a CUDA runtime would make: the argument staged here, once; there, the result
      // made on the device and staged once for the reply. At one rank all three are here.
      const long here = in.rt.counts().copies;
      const long there = ls::remote_sync_call(b, r, copies_here);
      if (r == 0) {
        CHECK(here == 3);
      } else {
        CHECK(here == 1);
        CHECK(there == 2);
      }
      CHECK(bad_ramp(x, 1.0f, static_cast<float>(r)) == 0);  // the argument is unchanged
    }
    // A structure with device tensors in it, both ways; a host tensor beside them.
    rdev::Layers l;
    l.w = device_ramp(5000, 1.0f);
    l.more.push_back(device_ramp(70000, 2.0f));
    l.more.push_back(ls::Tensor::full({3}, 4.0));
    l.more.push_back(device_ramp(1, 5.0f));
    l.lr = 0.25f;
    const rdev::Layers d = ls::remote_sync_call(b, world() - 1, rdev::doubled, l);
    CHECK(d.w.device().is_cpu());
    CHECK(bad_ramp(d.w, 2.0f, 1.0f) == 0);
    REQUIRE(d.more.size() == 3);
    CHECK(bad_ramp(d.more[0], 2.0f, 2.0f) == 0);
    CHECK(host_values(d.more[1]) == std::vector<float>{8.0f, 8.0f, 8.0f});
    CHECK(bad_ramp(d.more[2], 2.0f, 5.0f) == 0);
    CHECK(d.lr == 0.5f);
    // The partitioned forms: a device batch sliced into views (no host access), each slice
    // staged by itself; mean_reducer and sum_reducer over the results.
    const std::int64_t rows = 7, cols = 1000;
    const ls::Tensor batch = device_ramp(rows * cols, 0.0f);
    const ls::Tensor batch2d = ls::Tensor::from(host_values(batch), {rows, cols}).to(kDev);
    double want = 0;
    for (float v : host_values(batch)) want += v;
    CHECK(ls::remote_sync_call(b, ls::batch_partitioner, ls::sum_reducer, sum_of, batch2d) == Approx(want));
    // One call per row (the row a view of the device batch), the device results summed.
    const ls::Tensor doubled_sum =
        ls::remote_sync_call(b, ls::exclusive_batch_partitioner, ls::sum_reducer, scaled_on_device, batch2d, 2.0f);
    CHECK(doubled_sum.device().is_cpu());
    REQUIRE(doubled_sum.numel() == cols);
    const auto all = host_values(batch), got = host_values(doubled_sum);
    long bad = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      float col = 0;
      for (std::int64_t r = 0; r < rows; ++r) col += 2.0f * all[static_cast<std::size_t>(r * cols + c)];
      bad += std::abs(got[static_cast<std::size_t>(c)] - col) > 1e-4f * std::max(1.0f, col);
    }
    CHECK(bad == 0);
    auto f = ls::remote_async_call(b, ls::exclusive_batch_partitioner, ls::mean_reducer, sum_of, batch2d);
    CHECK(f.wait() == Approx(want / static_cast<double>(rows)));
  });
  // run_driver's result on the device: staged once by the driver, a host tensor on the others.
  const ls::Tensor r = ls::run_driver(b, [&] { return device_ramp(1000, 7.0f); });
  CHECK(r.device() == (me() == 0 ? kDev : ls::Device::cpu()));
  CHECK(bad_ramp(r, 1.0f, 7.0f) == 0);
  g_rt = nullptr;
}
