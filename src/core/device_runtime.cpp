#include "lockstep/core/device_runtime.hpp"

#include <atomic>
#include <vector>

#include "core/wire16.hpp"
#include "lockstep/core/errors.hpp"

namespace lockstep {
namespace {
std::atomic<DeviceRuntime*> g_runtime{nullptr};
thread_local int t_stream_ordered = 0;
}

void DeviceRuntime::copy_many(std::span<const DeviceCopy> copies, int index) {
  for (const DeviceCopy& c : copies)
    if (c.bytes > 0) copy(c.dst, Device::cuda(index), c.src, Device::cuda(index), c.bytes);
}

void DeviceRuntime::synchronize_stream(int index) { synchronize(index); }

void DeviceRuntime::convert_many(std::span<const DeviceConvert> items, DType from, DType to, float divisor,
                                 int index) {
  const bool to_wire = from == DType::f32 && (to == DType::bf16 || to == DType::f16);
  const bool from_wire = to == DType::f32 && (from == DType::bf16 || from == DType::f16);
  LOCKSTEP_CHECK_ARG(to_wire || from_wire, "DeviceRuntime::convert_many: converts f32 to bf16 or f16 and back, got ",
                     name(from), " to ", name(to));
  const Device dev = Device::cuda(index);
  std::vector<float> f;
  std::vector<std::uint16_t> h;
  for (const DeviceConvert& c : items) {
    if (c.n <= 0) continue;
    const auto n = static_cast<std::size_t>(c.n);
    f.resize(n);
    h.resize(n);
    if (to_wire) {
      copy(f.data(), Device::cpu(), c.src, dev, n * 4);
      detail::to_wire16(to, f.data(), h.data(), c.n);
      copy(c.dst, dev, h.data(), Device::cpu(), n * 2);
    } else {
      copy(h.data(), Device::cpu(), c.src, dev, n * 2);
      detail::from_wire16(from, h.data(), f.data(), c.n, divisor);
      copy(c.dst, dev, f.data(), Device::cpu(), n * 4);
    }
  }
}

void set_device_runtime(DeviceRuntime* runtime) noexcept { g_runtime.store(runtime); }
DeviceRuntime* find_device_runtime() noexcept { return g_runtime.load(); }

DeviceRuntime& device_runtime(const char* what) {
  if (auto* r = g_runtime.load()) return *r;
  throw NotCompiled(detail::concat(
      what, ": a cuda device needs the CUDA extension: build Lockstep with -DLOCKSTEP_WITH_CUDA=ON, "
            "link lockstep::cuda and include <lockstep/cuda.hpp>",
      detail::rank_suffix()));
}

namespace detail {
StreamOrderedScope::StreamOrderedScope() noexcept { ++t_stream_ordered; }
StreamOrderedScope::~StreamOrderedScope() { --t_stream_ordered; }
bool stream_ordered() noexcept { return t_stream_ordered > 0; }
}  // namespace detail

}  // namespace lockstep
