// The seam between the core and the optional CUDA extension. The core never includes CUDA
// headers; lockstep::cuda registers an implementation of DeviceRuntime when it is linked and
// initialised (see <lockstep/cuda.hpp>). Without one, every use of a cuda device throws
// NotCompiled.
#pragma once

#include <cstddef>

#include "lockstep/core/dtype.hpp"

namespace lockstep {

/// Device memory operations the core needs; implemented by the CUDA extension.
class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  /// Allocates `bytes` bytes on device `index`.
  virtual void* allocate(std::size_t bytes, int index) = 0;
  /// Frees memory from allocate(); never throws.
  virtual void deallocate(void* p, int index) noexcept = 0;
  /// Copies `bytes` bytes between any two devices (host or cuda) and waits for completion.
  virtual void copy(void* dst, Device dst_dev, const void* src, Device src_dev,
                    std::size_t bytes) = 0;
  /// Sets `bytes` bytes of device memory to zero and waits for completion.
  virtual void zero(void* p, std::size_t bytes, int index) = 0;
  /// Waits for all work queued on the streams Lockstep uses for device `index`.
  virtual void synchronize(int index) = 0;
  /// Page-locked host memory for staging; `bytes` bytes.
  virtual void* allocate_pinned(std::size_t bytes) = 0;
  virtual void deallocate_pinned(void* p) noexcept = 0;
  /// Number of visible devices.
  virtual int device_count() = 0;
};

/// Installs the runtime (called by the CUDA extension); nullptr uninstalls.
void set_device_runtime(DeviceRuntime* runtime) noexcept;
/// The installed runtime, or nullptr.
DeviceRuntime* find_device_runtime() noexcept;
/// The installed runtime; throws NotCompiled naming `what` if there is none.
DeviceRuntime& device_runtime(const char* what);

}  // namespace lockstep
