// lockstep::cuda: cuda tensors, streams and events, and the CUDA kernels of the optimizer rules,
// averaging and gradient buckets. Link the target lockstep::cuda and include this header.
//
// Including this header registers the CUDA DeviceRuntime with the core (an inline registrar
// below), so Tensor::zeros({n}, DType::f32, Device::cuda()) and Tensor::to() work. Code that
// cannot include it (or wants to be explicit) calls lockstep::cuda::init(); initialize<NCCLBackend>()
// does so too.
//
// Streams: every kernel here is queued on a stream, asynchronously. Without an explicit stream
// the functions use current_stream(device), which is the legacy default stream unless a
// StreamGuard set another, so that Lockstep's work is ordered with the user's default-stream
// work (cuBLAS calls without a stream, for example).
#pragma once

#include "lockstep/config.hpp"

#if !LOCKSTEP_HAS_CUDA
#error "<lockstep/cuda.hpp> needs the CUDA extension: configure Lockstep with -DLOCKSTEP_WITH_CUDA=ON and link lockstep::cuda"
#endif

#include <cuda_runtime_api.h>

#include <cstdint>
#include <source_location>
#include <span>
#include <utility>

#include "lockstep/core/errors.hpp"
#include "lockstep/train/optim_math.hpp"
#include "lockstep/core/tensor.hpp"

namespace lockstep::cuda {

/// Registers the CUDA DeviceRuntime with the core; idempotent, makes no CUDA call.
void init();
/// Number of visible CUDA devices; 0 when there is no device or no driver (never throws).
int device_count() noexcept;
/// True when at least one CUDA device is visible.
inline bool is_available() noexcept { return device_count() > 0; }
/// The calling thread's current device (cudaGetDevice).
int current_device();
/// Makes `index` the calling thread's current device (cudaSetDevice).
void set_device(int index);

namespace detail {
/// Throws CudaError naming the call, file:line and rank if `code` is not cudaSuccess.
void check_cuda(cudaError_t code, const char* call,
                const std::source_location& loc = std::source_location::current());
/// Makes sure the runtime is registered before any namespace-scope object of the including
/// translation unit uses a cuda tensor; one copy per program (an inline variable), so a static
/// library's registration is not dead-stripped away when only this header is used.
inline const bool registered = (init(), true);
}  // namespace detail

/// Sets a device as current for a scope and restores the previous one (never throws at exit).
class DeviceGuard {
 public:
  /// Switches to `index` if it is not already current.
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

/// A CUDA stream, owned (created here, destroyed by the destructor) or borrowed (the caller's,
/// never destroyed here). Move-only.
class Stream {
 public:
  /// A null Stream (the legacy default stream of device 0, borrowed).
  Stream() = default;
  /// Creates a stream on `device`; non_blocking streams do not synchronise with the legacy
  /// default stream.
  static Stream create(int device, bool non_blocking = true, int priority = 0);
  /// Wraps a stream the caller created and keeps alive; it is not destroyed here.
  static Stream borrow(cudaStream_t stream, int device) noexcept;
  Stream(Stream&& other) noexcept
      : stream_(std::exchange(other.stream_, nullptr)), device_(other.device_),
        owned_(std::exchange(other.owned_, false)) {}
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();

  cudaStream_t get() const noexcept { return stream_; }
  int device() const noexcept { return device_; }
  bool owned() const noexcept { return owned_; }
  /// Blocks until all work queued on the stream completed.
  void synchronize() const;
  /// True if all queued work completed; never blocks.
  bool query() const;

 private:
  void reset() noexcept;
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  bool owned_ = false;
};

/// A CUDA event (timing disabled unless asked for), owned. Move-only.
class Event {
 public:
  /// An empty event; create() makes a usable one.
  Event() = default;
  /// Creates an event on `device`.
  static Event create(int device, bool timing = false);
  Event(Event&& other) noexcept
      : event_(std::exchange(other.event_, nullptr)), device_(other.device_) {}
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event();

  cudaEvent_t get() const noexcept { return event_; }
  /// Records the event on `stream` (the work queued there so far).
  void record(cudaStream_t stream);
  /// Makes `stream` wait for the recorded work (no host blocking).
  void wait_on(cudaStream_t stream) const;
  /// Blocks the host until the recorded work completed.
  void synchronize() const;
  /// True if the recorded work completed; never blocks.
  bool query() const;
  /// Milliseconds between `start` and this event (both created with timing = true).
  float elapsed_ms_since(const Event& start) const;

 private:
  void reset() noexcept;
  cudaEvent_t event_ = nullptr;
  int device_ = 0;
};

/// The stream Lockstep queues its work on for `device` in this thread: the one a StreamGuard
/// set, else the legacy default stream.
cudaStream_t current_stream(int device);

/// Makes `stream` the current stream of its device for this thread, for a scope. Borrowed.
class StreamGuard {
 public:
  /// Borrows `stream` (of device `device`) as the current stream until the guard ends.
  StreamGuard(cudaStream_t stream, int device);
  explicit StreamGuard(const Stream& stream) : StreamGuard(stream.get(), stream.device()) {}
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  int device_;
  cudaStream_t previous_;
};

// ---------------------------------------------------------------------------------------------
// Kernels. All are asynchronous on `stream` (current_stream of the views' device when null).
// Views must be on the same cuda device; element counts are in elements of the views' dtype.
// ---------------------------------------------------------------------------------------------

/// The buffers of one parameter tensor in an SGD step: parameter, gradient and momentum buffer
/// (the buffer may be empty when momentum is 0). Same dtype (f32 or f64) and numel.
struct SgdSpan {
  TensorView param, grad, momentum_buffer;
};
/// The buffers of one parameter tensor in an Adam/AdamW step. Same dtype (f32 or f64) and numel.
struct AdamSpan {
  TensorView param, grad, exp_avg, exp_avg_sq;
};

/// SGD step over every span in ONE kernel launch (a chunk table spreads the spans over the
/// blocks); the arithmetic is math::sgd_element, bitwise equal to math::sgd_update on the CPU.
void sgd_update(std::span<const SgdSpan> spans, const math::SGDCoeffs<float>& coeffs,
                cudaStream_t stream = nullptr);
/// SGD step for f64 spans.
void sgd_update(std::span<const SgdSpan> spans, const math::SGDCoeffs<double>& coeffs,
                cudaStream_t stream = nullptr);
/// Adam/AdamW step over every span in ONE kernel launch; math::adam_element per element.
void adam_update(std::span<const AdamSpan> spans, const math::AdamCoeffs<float>& coeffs,
                 cudaStream_t stream = nullptr);
/// Adam/AdamW step for f64 spans.
void adam_update(std::span<const AdamSpan> spans, const math::AdamCoeffs<double>& coeffs,
                 cudaStream_t stream = nullptr);

/// buf[i] = buf[i] * factor (f16, bf16, f32, f64).
void scale(TensorView buf, double factor, cudaStream_t stream = nullptr);
/// buf[i] = buf[i] / divisor, as MPIBackend's host avg divides (f16, bf16, f32, f64).
void divide(TensorView buf, double divisor, cudaStream_t stream = nullptr);
/// Copies each source, in order, into consecutive elements of `bucket` starting at element
/// `offset`, in one launch; sources share the bucket's dtype and device.
void pack(std::span<const TensorView> sources, TensorView bucket, std::int64_t offset = 0,
          cudaStream_t stream = nullptr);
/// The inverse of pack: consecutive elements of `bucket` from `offset` go to each destination.
void unpack(TensorView bucket, std::span<const TensorView> destinations, std::int64_t offset = 0,
            cudaStream_t stream = nullptr);
/// Device-to-device copy of `bytes` bytes with a plain kernel (the benchmark's reference for
/// memory bandwidth).
void copy_kernel(void* dst, const void* src, std::size_t bytes, cudaStream_t stream = nullptr);

}  // namespace lockstep::cuda

/// Checks a CUDA runtime call: LOCKSTEP_CUDA_CHECK(cudaMemcpy(...));
#define LOCKSTEP_CUDA_CHECK(call) ::lockstep::cuda::detail::check_cuda((call), #call)
