#include "lockstep/core/device_runtime.hpp"

#include <atomic>

#include "lockstep/core/errors.hpp"

namespace lockstep {
namespace {
std::atomic<DeviceRuntime*> g_runtime{nullptr};
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

}  // namespace lockstep
