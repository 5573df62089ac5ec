// The seam between the core and the optional CUDA extension. The core never includes CUDA
// headers; lockstep::cuda registers an implementation of DeviceRuntime when it is linked and
// initialised (see <lockstep/cuda.hpp>). Without one, every use of a cuda device throws
// NotCompiled.
//
// Streams: "the current stream" of a device is the stream the runtime queues Lockstep's work on
// for that device in the calling thread (lockstep::cuda::current_stream: the legacy default
// stream unless a StreamGuard set another).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "lockstep/core/dtype.hpp"

namespace lockstep {

/// One device-to-device copy of copy_many().
struct DeviceCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
};

/// One conversion of convert_many(): `n` elements read from `src` and written to `dst`.
struct DeviceConvert {
  void* dst = nullptr;
  const void* src = nullptr;
  std::int64_t n = 0;
};

/// Device memory operations the core needs; implemented by the CUDA extension.
class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  /// Allocates `bytes` bytes on device `index`.
  virtual void* allocate(std::size_t bytes, int index) = 0;
  /// Frees memory from allocate(); never throws.
  virtual void deallocate(void* p, int index) noexcept = 0;
  /// Copies `bytes` bytes between any two devices (host or cuda), queued on the current stream
  /// of the cuda side, and waits for completion.
  virtual void copy(void* dst, Device dst_dev, const void* src, Device src_dev,
                    std::size_t bytes) = 0;
  /// Sets `bytes` bytes of device memory to zero and waits for completion.
  virtual void zero(void* p, std::size_t bytes, int index) = 0;
  /// Waits for all work queued on device `index`, on every stream (a device-wide
  /// synchronisation).
  virtual void synchronize(int index) = 0;
  /// Page-locked host memory for staging; `bytes` bytes.
  virtual void* allocate_pinned(std::size_t bytes) = 0;
  virtual void deallocate_pinned(void* p) noexcept = 0;
  /// Number of visible devices.
  virtual int device_count() = 0;

  // --- batched and stream-ordered operations (defaults in terms of the ones above) ----------

  /// Device-to-device copies on device `index` (regions of device memory that do not overlap),
  /// queued on the current stream in one launch and NOT waited for: work queued after it on
  /// that stream sees the copies done. The default makes one waited copy() per region.
  virtual void copy_many(std::span<const DeviceCopy> copies, int index);
  /// Waits for the work queued so far on the current stream of device `index` (not the whole
  /// device). The default is synchronize(index).
  virtual void synchronize_stream(int index);
  /// Conversions between f32 and a 16-bit float on device `index` (gradients on the wire,
  /// DistributedOptions::wire_dtype), regions that do not overlap, queued on the current stream
  /// in one launch and NOT waited for, as copy_many. `from` f32 and `to` bf16 or f16: each
  /// element rounded to nearest even (a NaN stays a NaN); `from` bf16 or f16 and `to` f32: each
  /// element widened and divided by `divisor` in f32 (1: no division), as the host's
  /// conversions do (src/core/wire16.hpp). The default stages each region through host memory
  /// (two waited copies per region); lockstep::cuda launches one kernel.
  virtual void convert_many(std::span<const DeviceConvert> items, DType from, DType to, float divisor,
                            int index);
};

/// Installs the runtime (called by the CUDA extension); nullptr uninstalls.
void set_device_runtime(DeviceRuntime* runtime) noexcept;
/// The installed runtime, or nullptr.
DeviceRuntime* find_device_runtime() noexcept;
/// The installed runtime; throws NotCompiled naming `what` if there is none.
DeviceRuntime& device_runtime(const char* what);

namespace detail {
/// While one lives in a thread, the device buffers that thread hands to collectives are known to
/// have been written on the current stream of their device (GradientReducer's buckets: packed
/// there, or gradients of the step, which DistributedOptimizer takes as produced on the current
/// stream, as PyTorch's DDP does). MPIBackend then relies on stream order (its staging copies
/// are queued on that stream) or waits for that stream alone (a CUDA-aware MPI reads the
/// memory itself), instead of synchronising the whole device. Nests.
class StreamOrderedScope {
 public:
  StreamOrderedScope() noexcept;
  ~StreamOrderedScope();
  StreamOrderedScope(const StreamOrderedScope&) = delete;
  StreamOrderedScope& operator=(const StreamOrderedScope&) = delete;
};
/// True inside a StreamOrderedScope of this thread.
bool stream_ordered() noexcept;
}  // namespace detail

}  // namespace lockstep
