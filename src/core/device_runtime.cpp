#include "lockstep/core/device_runtime.hpp"

#include <atomic>

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
