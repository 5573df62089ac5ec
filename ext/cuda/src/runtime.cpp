// The CUDA DeviceRuntime (cudaMalloc, copies, pinned memory), errors, device and stream helpers.
#include <cuda_runtime_api.h>

#include <iostream>
#include <span>
#include <vector>

#include "lockstep/cuda.hpp"
#include "lockstep/core/device_runtime.hpp"

namespace lockstep::cuda {

namespace detail {
void register_optimizer_kernels();  // optimizer_kernels.cpp
// kernels.cu: the copies in one multi_copy launch (the kernel of cuda::pack/unpack), on `stream`.
void copy_regions(std::span<const DeviceCopy> copies, int device, cudaStream_t stream);
// kernels.cu: f32 <-> bf16/f16 conversions in one multi_convert launch, on `stream`.
void convert_regions(std::span<const DeviceConvert> items, DType from, DType to, float divisor, int device,
                     cudaStream_t stream);

void check_cuda(cudaError_t code, const char* call, const std::source_location& loc) {
  if (code == cudaSuccess) return;
  cudaGetLastError();  // clear the sticky-free error state so later calls are not blamed
  throw CudaError(lockstep::detail::concat(lockstep::detail::where(loc), ": ", call, " failed: ",
                                           cudaGetErrorName(code), ": ", cudaGetErrorString(code),
                                           lockstep::detail::rank_suffix()),
                  static_cast<int>(code));
}
}  // namespace detail

namespace {

// Reports an error from a function that must not throw (destructors, deallocation).
void report(cudaError_t code, const char* what) noexcept {
  if (code == cudaSuccess || code == cudaErrorCudartUnloading) return;
  std::cerr << "lockstep: " << what << " failed: " << cudaGetErrorString(code) << "\n";
}

// Per thread and device: the stream a StreamGuard set (nullptr: the legacy default stream).
thread_local std::vector<cudaStream_t> t_streams;

cudaStream_t& stream_slot(int device) {
  if (device < 0) throw InvalidArgument(lockstep::detail::concat("invalid cuda device index ", device));
  if (static_cast<std::size_t>(device) >= t_streams.size()) t_streams.resize(device + 1, nullptr);
  return t_streams[device];
}

class CudaRuntime final : public DeviceRuntime {
 public:
  void* allocate(std::size_t bytes, int index) override {
    DeviceGuard g(index);
    void* p = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaMalloc(&p, bytes));
    return p;
  }

  void deallocate(void* p, int index) noexcept override {
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    if (prev != index) cudaSetDevice(index);
    report(cudaFree(p), "cudaFree");
    if (prev >= 0 && prev != index) cudaSetDevice(prev);
  }

  void copy(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t bytes) override {
    if (bytes == 0) return;
    // Queued on the device's current stream, so the copy follows the kernels that produced the
    // source, then waited for: the caller may use the destination on return.
    const int dev = dst_dev.is_cuda() ? dst_dev.index : src_dev.index;
    DeviceGuard g(dev);
    cudaStream_t s = current_stream(dev);
    LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(s));
  }

  void zero(void* p, std::size_t bytes, int index) override {
    if (bytes == 0) return;
    DeviceGuard g(index);
    cudaStream_t s = current_stream(index);
    LOCKSTEP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, s));
    LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(s));
  }

  void synchronize(int index) override {
    // The whole device, not only Lockstep's stream: whatever stream produced a buffer (the
    // user's own, cuBLAS's) must be finished before MPI reads it (Flux issue #2591).
    DeviceGuard g(index);
    LOCKSTEP_CUDA_CHECK(cudaDeviceSynchronize());
  }

  void synchronize_stream(int index) override {
    DeviceGuard g(index);
    LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(current_stream(index)));
  }

  void copy_many(std::span<const DeviceCopy> copies, int index) override {
    // One launch of the pack/unpack kernel on the current stream, not waited for: the
    // collective or kernel queued next on that stream sees the copies done.
    if (copies.empty()) return;
    DeviceGuard g(index);
    detail::copy_regions(copies, index, current_stream(index));
  }

  void convert_many(std::span<const DeviceConvert> items, DType from, DType to, float divisor,
                    int index) override {
    // One launch of the conversion kernel on the current stream, not waited for.
    if (items.empty()) return;
    DeviceGuard g(index);
    detail::convert_regions(items, from, to, divisor, index, current_stream(index));
  }

  void* allocate_pinned(std::size_t bytes) override {
    void* p = nullptr;
    LOCKSTEP_CUDA_CHECK(cudaMallocHost(&p, bytes == 0 ? 1 : bytes));
    return p;
  }

  void deallocate_pinned(void* p) noexcept override {
    if (p != nullptr) report(cudaFreeHost(p), "cudaFreeHost");
  }

  int device_count() override { return cuda::device_count(); }
};

}  // namespace

void init() {
  // Never destroyed: tensors and backends freed during static destruction or atexit may still
  // need it, in whatever order those run.
  static CudaRuntime* runtime = new CudaRuntime();
  set_device_runtime(runtime);
  detail::register_optimizer_kernels();
}

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return n;
}

int current_device() {
  int d = 0;
  LOCKSTEP_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void set_device(int index) { LOCKSTEP_CUDA_CHECK(cudaSetDevice(index)); }

DeviceGuard::DeviceGuard(int index) {
  int cur = 0;
  LOCKSTEP_CUDA_CHECK(cudaGetDevice(&cur));
  if (cur != index) {
    LOCKSTEP_CUDA_CHECK(cudaSetDevice(index));
    previous_ = cur;
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) report(cudaSetDevice(previous_), "cudaSetDevice (restoring)");
}

// --- Stream ---------------------------------------------------------------------------------
Stream Stream::create(int device, bool non_blocking, int priority) {
  DeviceGuard g(device);
  Stream s;
  LOCKSTEP_CUDA_CHECK(cudaStreamCreateWithPriority(
      &s.stream_, non_blocking ? cudaStreamNonBlocking : cudaStreamDefault, priority));
  s.device_ = device;
  s.owned_ = true;
  return s;
}

Stream Stream::borrow(cudaStream_t stream, int device) noexcept {
  Stream s;
  s.stream_ = stream;
  s.device_ = device;
  s.owned_ = false;
  return s;
}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    reset();
    stream_ = std::exchange(other.stream_, nullptr);
    device_ = other.device_;
    owned_ = std::exchange(other.owned_, false);
  }
  return *this;
}

Stream::~Stream() { reset(); }

void Stream::reset() noexcept {
  if (owned_ && stream_ != nullptr) report(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  stream_ = nullptr;
  owned_ = false;
}

void Stream::synchronize() const { LOCKSTEP_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

bool Stream::query() const {
  cudaError_t e = cudaStreamQuery(stream_);
  if (e == cudaErrorNotReady) return false;
  LOCKSTEP_CUDA_CHECK(e);
  return true;
}

// --- Event ----------------------------------------------------------------------------------
Event Event::create(int device, bool timing) {
  DeviceGuard g(device);
  Event e;
  LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&e.event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  e.device_ = device;
  return e;
}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    reset();
    event_ = std::exchange(other.event_, nullptr);
    device_ = other.device_;
  }
  return *this;
}

Event::~Event() { reset(); }

void Event::reset() noexcept {
  if (event_ != nullptr) report(cudaEventDestroy(event_), "cudaEventDestroy");
  event_ = nullptr;
}

void Event::record(cudaStream_t stream) { LOCKSTEP_CUDA_CHECK(cudaEventRecord(event_, stream)); }
void Event::wait_on(cudaStream_t stream) const {
  LOCKSTEP_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}
void Event::synchronize() const { LOCKSTEP_CUDA_CHECK(cudaEventSynchronize(event_)); }
bool Event::query() const {
  cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) return false;
  LOCKSTEP_CUDA_CHECK(e);
  return true;
}
float Event::elapsed_ms_since(const Event& start) const {
  float ms = 0;
  LOCKSTEP_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

// --- Current stream -------------------------------------------------------------------------
cudaStream_t current_stream(int device) {
  cudaStream_t s = stream_slot(device);
  return s != nullptr ? s : cudaStreamLegacy;
}

StreamGuard::StreamGuard(cudaStream_t stream, int device)
    : device_(device), previous_(stream_slot(device)) {
  stream_slot(device) = stream;
}

StreamGuard::~StreamGuard() { t_streams[device_] = previous_; }

}  // namespace lockstep::cuda
