// MPIBackend and device memory: handed to MPI directly when MPI is CUDA-aware, else staged
// through pinned host buffers from one pool (PinnedPool, Staged). The producing stream is
// synchronised first either way (wait_for_producer).
#include <algorithm>
#include <bit>
#include <cstddef>
#include <mutex>

// Open MPI's extensions (MPIX_CUDA_AWARE_SUPPORT, MPIX_Query_cuda_support), as its
// documentation includes them: every Open MPI has the header, other MPIs have neither.
#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif

#include "mpi/mpi_backend_impl.hpp"

namespace lockstep::detail::mpib {

bool detect_cuda_aware() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

PinnedPool::~PinnedPool() {
  DeviceRuntime* rt = find_device_runtime();
  for (auto& [cls, list] : free_)
    for (void* p : list)
      if (rt != nullptr) rt->deallocate_pinned(p);
}

void* PinnedPool::take(std::size_t bytes, std::size_t& cls) {
  cls = std::bit_ceil(std::max<std::size_t>(bytes, 4096));
  {
    std::lock_guard lock(mutex_);
    auto& list = free_[cls];
    if (!list.empty()) {
      void* p = list.back();
      list.pop_back();
      return p;
    }
  }
  return device_runtime("MPIBackend with a cuda tensor").allocate_pinned(cls);
}

void PinnedPool::give(void* p, std::size_t cls) noexcept {
  try {
    std::lock_guard lock(mutex_);
    free_[cls].push_back(p);
  } catch (...) {
    if (auto* rt = find_device_runtime()) rt->deallocate_pinned(p);
  }
}

// In general the whole device is synchronised, whatever stream produced the buffer (Flux.jl
// issue #2591: wrong averages without it). Inside a detail::StreamOrderedScope
// (GradientReducer's buckets) the buffer was written on the current stream: a staging copy,
// queued on that stream, follows it without any wait, and a direct read waits for that stream
// alone.
void wait_for_producer(DeviceRuntime& rt, int index, bool direct) {
  if (!detail::stream_ordered()) rt.synchronize(index);
  else if (direct) rt.synchronize_stream(index);
}

void Staged::stage(MPIBackendImpl& impl, bool copy_in, bool host_work) {
  const TensorView v = orig_;
  DeviceRuntime& rt = device_runtime("MPIBackend with a cuda tensor");
  const bool direct = impl.cuda_aware && !host_work;
  wait_for_producer(rt, v.device.index, direct);
  if (direct) return;
  pool_ = impl.pinned_pool;
  host_.device = Device::cpu();
  host_.data = pool_->take(v.nbytes(), cls_);
  staged_ = true;
  if (copy_in) rt.copy(host_.data, Device::cpu(), v.data, v.device, v.nbytes());
}

void Staged::release() noexcept { pool_->give(host_.data, cls_); }

void Staged::copy_back() {
  device_runtime("MPIBackend with a cuda tensor").copy(orig_.data, orig_.device, host_.data, Device::cpu(), orig_.nbytes());
}

}  // namespace lockstep::detail::mpib
