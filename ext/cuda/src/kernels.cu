// CUDA kernels: fused optimizer updates over many tensors in one launch, scaling for averages,
// and the pack/unpack copies of gradient buckets.
//
// Many tensors, one launch: the host builds a table of the tensors (pointers, length) and of
// fixed-size chunks (which tensor, where in it), copies it to the device with the launch (from
// pinned memory into a reused device buffer, see DeviceTable), and block b works on chunk b. A model with hundreds of small tensors thus costs one launch and one
// small copy, not hundreds of launches. Inside a chunk, 16-byte vector loads and stores are used
// when every pointer of the tensor is 16-byte aligned (cudaMalloc memory always is).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "lockstep/cuda.hpp"
#include "lockstep/core/device_runtime.hpp"

namespace lockstep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kChunk = 16384;        // elements per block in the optimizer kernels
constexpr std::int64_t kChunkBytes = 65536;   // bytes per block in the copy kernels

// --- the chunk table --------------------------------------------------------------------------
struct Entry {
  void* ptr[4];
  std::int64_t n;  // elements (bytes for the copy kernels)
};
struct Chunk {
  std::int64_t start;
  int entry;
};

bool pools_supported(int device) {
  static thread_local std::vector<int> cache;  // 0 unknown, 1 yes, 2 no
  if (static_cast<std::size_t>(device) >= cache.size()) cache.resize(device + 1, 0);
  if (cache[device] == 0) {
    int v = 0;
    LOCKSTEP_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMemoryPoolsSupported, device));
    if (v) {
      // The default pool's release threshold is 0: every synchronisation hands its free memory
      // back to the driver, and the next cudaMallocAsync asks the driver again. Keep it, as
      // PyTorch's caching allocator keeps its memory. (Lockstep's chunk tables do not come
      // from the pool, see DeviceTable; stream-ordered allocations of the program still do.)
      cudaMemPool_t pool = nullptr;
      LOCKSTEP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
      std::uint64_t keep = UINT64_MAX;
      LOCKSTEP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    }
    cache[device] = v ? 1 : 2;
  }
  return cache[device] == 1;
}

// The tables are uploaded from pinned host memory into device memory that is kept and reused
// (before: a cudaMallocAsync, a copy from pageable memory and a cudaFreeAsync per launch). Per
// device, a ring of kSlots slots, each a pinned host buffer, a device buffer and an event
// recorded after the launch that reads it. A slot is reused once its event has completed (the
// host waits only if kSlots launches on that device are still queued), and grown, rarely, when
// a table does not fit (freed and allocated again at twice the size needed). The ring's lock is
// held from the upload to the event, so threads launching on one device take turns.
constexpr int kSlots = 8;
struct TableSlot {
  void* host = nullptr;
  void* dev = nullptr;
  std::size_t cap = 0;
  cudaEvent_t done = nullptr;
  bool in_use = false;  // `done` was recorded after the last launch that read this slot
};
struct TableRing {
  std::mutex mutex;
  TableSlot slots[kSlots];
  int next = 0;
};

TableRing& ring_for(int device) {
  static std::mutex m;
  // Never destroyed, as the runtime: launches during static destruction may still need it.
  static auto* rings = new std::vector<std::unique_ptr<TableRing>>();
  std::lock_guard lock(m);
  if (static_cast<std::size_t>(device) >= rings->size()) rings->resize(static_cast<std::size_t>(device) + 1);
  auto& r = (*rings)[static_cast<std::size_t>(device)];
  if (!r) {
    (void)pools_supported(device);  // raises the default pool's release threshold, once
    r = std::make_unique<TableRing>();
  }
  return *r;
}

class DeviceTable {
 public:
  DeviceTable(const std::vector<Entry>& entries, const std::vector<Chunk>& chunks, int device,
              cudaStream_t stream)
      : ring_(ring_for(device)), lock_(ring_.mutex), stream_(stream) {
    const std::size_t eb = entries.size() * sizeof(Entry);  // a multiple of alignof(Chunk)
    const std::size_t cb = chunks.size() * sizeof(Chunk);
    const std::size_t bytes = eb + cb;
    slot_ = &ring_.slots[ring_.next];
    ring_.next = (ring_.next + 1) % kSlots;
    if (slot_->done == nullptr)
      LOCKSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&slot_->done, cudaEventDisableTiming));
    if (slot_->in_use) LOCKSTEP_CUDA_CHECK(cudaEventSynchronize(slot_->done));  // done long ago, as a rule
    slot_->in_use = false;
    if (slot_->cap < bytes) {
      if (slot_->host != nullptr) LOCKSTEP_CUDA_CHECK(cudaFreeHost(slot_->host));
      if (slot_->dev != nullptr) LOCKSTEP_CUDA_CHECK(cudaFree(slot_->dev));
      slot_->host = slot_->dev = nullptr;
      slot_->cap = 0;
      const std::size_t cap = std::max<std::size_t>(4096, std::bit_ceil(bytes) * 2);
      LOCKSTEP_CUDA_CHECK(cudaMallocHost(&slot_->host, cap));
      LOCKSTEP_CUDA_CHECK(cudaMalloc(&slot_->dev, cap));
      slot_->cap = cap;
    }
    std::memcpy(slot_->host, entries.data(), eb);
    std::memcpy(static_cast<unsigned char*>(slot_->host) + eb, chunks.data(), cb);
    // From pinned memory: a true asynchronous copy, ordered before the launch on `stream`; the
    // host buffer is not written again before the event after the launch has completed.
    LOCKSTEP_CUDA_CHECK(cudaMemcpyAsync(slot_->dev, slot_->host, bytes, cudaMemcpyHostToDevice, stream));
    slot_->in_use = true;  // the destructor records `done` after the launch
    uploaded_ = true;
    entries_ = static_cast<const Entry*>(slot_->dev);
    chunks_ = reinterpret_cast<const Chunk*>(static_cast<unsigned char*>(slot_->dev) + eb);
  }
  ~DeviceTable() {
    if (!uploaded_) return;
    // After the launch: the slot is busy until everything queued so far on the stream is done.
    if (cudaEventRecord(slot_->done, stream_) != cudaSuccess) {
      cudaGetLastError();
      cudaStreamSynchronize(stream_);  // no event: wait here instead
      slot_->in_use = false;
    }
  }
  DeviceTable(const DeviceTable&) = delete;
  DeviceTable& operator=(const DeviceTable&) = delete;
  const Entry* entries() const { return entries_; }
  const Chunk* chunks() const { return chunks_; }

 private:
  TableRing& ring_;
  std::unique_lock<std::mutex> lock_;
  cudaStream_t stream_;
  TableSlot* slot_ = nullptr;
  bool uploaded_ = false;
  const Entry* entries_ = nullptr;
  const Chunk* chunks_ = nullptr;
};

std::vector<Chunk> make_chunks(const std::vector<Entry>& entries, std::int64_t chunk) {
  std::vector<Chunk> chunks;
  for (std::size_t e = 0; e < entries.size(); ++e)
    for (std::int64_t s = 0; s < entries[e].n; s += chunk) chunks.push_back({s, static_cast<int>(e)});
  return chunks;
}

// --- elementwise over many tensors --------------------------------------------------------------
template <class T>
struct alignas(16) Vec {
  static constexpr int kWidth = 16 / sizeof(T);
  T v[kWidth];
};

// Op: a functor with `static constexpr unsigned kWrites` (bit k: pointer k is written back) and
// `__device__ void operator()(T& a0, T& a1, T& a2, T& a3) const`. Null pointers are neither read
// nor written (their register holds zero).
template <class T, class Op>
__global__ void __launch_bounds__(kThreads) multi_apply(const Entry* entries, const Chunk* chunks, Op op) {
  const Chunk ch = chunks[blockIdx.x];
  const Entry e = entries[ch.entry];
  T* p[4];
  bool aligned = true;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    p[k] = static_cast<T*>(e.ptr[k]);
    aligned = aligned && (reinterpret_cast<std::uintptr_t>(p[k]) % 16 == 0);
  }
  const std::int64_t begin = ch.start;
  const std::int64_t end = begin + kChunk < e.n ? begin + kChunk : e.n;
  std::int64_t scalar_from = begin;
  if (aligned) {
    constexpr int W = Vec<T>::kWidth;
    const std::int64_t vec_end = begin + (end - begin) / W * W;
    for (std::int64_t i = begin + static_cast<std::int64_t>(threadIdx.x) * W; i < vec_end;
         i += static_cast<std::int64_t>(blockDim.x) * W) {
      Vec<T> r[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (p[k] != nullptr) {
          r[k] = *reinterpret_cast<const Vec<T>*>(p[k] + i);
        } else {
#pragma unroll
          for (int j = 0; j < W; ++j) r[k].v[j] = T(0);
        }
      }
#pragma unroll
      for (int j = 0; j < W; ++j) op(r[0].v[j], r[1].v[j], r[2].v[j], r[3].v[j]);
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (((Op::kWrites >> k) & 1u) && p[k] != nullptr) *reinterpret_cast<Vec<T>*>(p[k] + i) = r[k];
    }
    scalar_from = vec_end;
  }
  for (std::int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) {
    T r[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) r[k] = p[k] != nullptr ? p[k][i] : T(0);
    op(r[0], r[1], r[2], r[3]);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (((Op::kWrites >> k) & 1u) && p[k] != nullptr) p[k][i] = r[k];
  }
}

template <class T>
struct SgdOp {
  static constexpr unsigned kWrites = 0b0101;  // param, momentum buffer
  math::SGDCoeffs<T> c;
  __device__ void operator()(T& p, T& g, T& buf, T&) const { math::sgd_element(p, g, buf, c); }
};

template <class T>
struct AdamOp {
  static constexpr unsigned kWrites = 0b1101;  // param, exp_avg, exp_avg_sq
  math::AdamCoeffs<T> c;
  __device__ void operator()(T& p, T& g, T& m, T& v) const { math::adam_element(p, g, m, v, c); }
};

template <class T, class Op>
void launch_multi(std::vector<Entry> entries, int device, cudaStream_t stream, const Op& op) {
  auto chunks = make_chunks(entries, kChunk);
  if (chunks.empty()) return;
  DeviceGuard g(device);
  DeviceTable table(entries, chunks, device, stream);
  multi_apply<T, Op><<<static_cast<unsigned>(chunks.size()), kThreads, 0, stream>>>(
      table.entries(), table.chunks(), op);
  LOCKSTEP_CUDA_CHECK(cudaGetLastError());
}

// Checks that `v` may take part in a kernel on `device` with dtype `t` and `n` elements.
void check_member(const TensorView& v, DType t, std::int64_t n, int device, const char* what,
                  const char* role, std::size_t index) {
  LOCKSTEP_CHECK_ARG(v.device.is_cuda(), what, ": ", role, " of span ", index, " is on ",
                     to_string(v.device), ", not on a cuda device");
  LOCKSTEP_CHECK_ARG(v.device.index == device, what, ": ", role, " of span ", index, " is on ",
                     to_string(v.device), " but span 0 is on cuda:", device);
  LOCKSTEP_CHECK_ARG(v.dtype == t, what, ": ", role, " of span ", index, " has dtype ", name(v.dtype),
                     ", expected ", name(t));
  LOCKSTEP_CHECK_ARG(v.numel == n, what, ": ", role, " of span ", index, " has ", v.numel,
                     " elements, the parameter ", n);
  LOCKSTEP_CHECK_ARG(v.data != nullptr || n == 0, what, ": ", role, " of span ", index, " has no data");
}

template <class T>
constexpr DType dtype_for() {
  return std::is_same_v<T, float> ? DType::f32 : DType::f64;
}

cudaStream_t resolve(cudaStream_t s, int device) { return s != nullptr ? s : current_stream(device); }

template <class T>
void sgd_impl(std::span<const SgdSpan> spans, const math::SGDCoeffs<T>& c, cudaStream_t stream) {
  if (spans.empty()) return;
  const int dev = spans[0].param.device.index;
  const bool momentum = c.momentum != T(0);
  std::vector<Entry> entries;
  entries.reserve(spans.size());
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const SgdSpan& s = spans[i];
    const std::int64_t n = s.param.numel;
    check_member(s.param, dtype_for<T>(), n, dev, "cuda::sgd_update", "param", i);
    check_member(s.grad, dtype_for<T>(), n, dev, "cuda::sgd_update", "grad", i);
    if (momentum) check_member(s.momentum_buffer, dtype_for<T>(), n, dev, "cuda::sgd_update", "momentum_buffer", i);
    if (n == 0) continue;
    entries.push_back({{s.param.data, s.grad.data, momentum ? s.momentum_buffer.data : nullptr, nullptr}, n});
  }
  launch_multi<T>(std::move(entries), dev, resolve(stream, dev), SgdOp<T>{c});
}

template <class T>
void adam_impl(std::span<const AdamSpan> spans, const math::AdamCoeffs<T>& c, cudaStream_t stream) {
  if (spans.empty()) return;
  const int dev = spans[0].param.device.index;
  std::vector<Entry> entries;
  entries.reserve(spans.size());
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const AdamSpan& s = spans[i];
    const std::int64_t n = s.param.numel;
    check_member(s.param, dtype_for<T>(), n, dev, "cuda::adam_update", "param", i);
    check_member(s.grad, dtype_for<T>(), n, dev, "cuda::adam_update", "grad", i);
    check_member(s.exp_avg, dtype_for<T>(), n, dev, "cuda::adam_update", "exp_avg", i);
    check_member(s.exp_avg_sq, dtype_for<T>(), n, dev, "cuda::adam_update", "exp_avg_sq", i);
    if (n == 0) continue;
    entries.push_back({{s.param.data, s.grad.data, s.exp_avg.data, s.exp_avg_sq.data}, n});
  }
  launch_multi<T>(std::move(entries), dev, resolve(stream, dev), AdamOp<T>{c});
}

// --- scaling --------------------------------------------------------------------------------
// 16-bit storage is converted to float, scaled and rounded back to nearest even, as the core's
// host code does.
struct F16Tag {};
struct BF16Tag {};

template <class Tag>
struct Half16;
template <>
struct Half16<F16Tag> {
  __device__ static float load(std::uint16_t b) { return __half2float(__ushort_as_half(b)); }
  __device__ static std::uint16_t store(float x) { return __half_as_ushort(__float2half_rn(x)); }
};
template <>
struct Half16<BF16Tag> {
  __device__ static float load(std::uint16_t b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  __device__ static std::uint16_t store(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};

template <class T, bool Divide>
__global__ void scale_kernel(T* p, std::int64_t n, T factor) {
  constexpr int W = Vec<T>::kWidth;
  const std::int64_t nvec = reinterpret_cast<std::uintptr_t>(p) % 16 == 0 ? n / W : 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::int64_t i = tid; i < nvec; i += stride) {
    Vec<T> r = reinterpret_cast<const Vec<T>*>(p)[i];
#pragma unroll
    for (int j = 0; j < W; ++j) r.v[j] = Divide ? r.v[j] / factor : r.v[j] * factor;
    reinterpret_cast<Vec<T>*>(p)[i] = r;
  }
  for (std::int64_t i = nvec * W + tid; i < n; i += stride) p[i] = Divide ? p[i] / factor : p[i] * factor;
}

template <class Tag, bool Divide>
__global__ void scale16_kernel(std::uint16_t* p, std::int64_t n, float factor) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float x = Half16<Tag>::load(p[i]);
    p[i] = Half16<Tag>::store(Divide ? x / factor : x * factor);
  }
}

unsigned blocks_for(std::int64_t n, int per_thread) {
  std::int64_t b = (n + static_cast<std::int64_t>(kThreads) * per_thread - 1) / (static_cast<std::int64_t>(kThreads) * per_thread);
  if (b < 1) b = 1;
  if (b > 65535) b = 65535;  // grid-stride loops cover the rest
  return static_cast<unsigned>(b);
}

template <bool Divide>
void scale_impl(TensorView buf, double factor, cudaStream_t stream, const char* what) {
  LOCKSTEP_CHECK_ARG(buf.device.is_cuda(), what, ": the view is on ", to_string(buf.device),
                     ", not on a cuda device");
  LOCKSTEP_CHECK_ARG(is_floating(buf.dtype), what, ": needs a floating dtype, got ", name(buf.dtype));
  LOCKSTEP_CHECK_ARG(buf.data != nullptr || buf.numel == 0, what, ": null data");
  if (buf.numel == 0) return;
  const int dev = buf.device.index;
  DeviceGuard g(dev);
  cudaStream_t s = resolve(stream, dev);
  const std::int64_t n = buf.numel;
  switch (buf.dtype) {
    case DType::f32:
      scale_kernel<float, Divide><<<blocks_for(n, 4), kThreads, 0, s>>>(static_cast<float*>(buf.data), n,
                                                                        static_cast<float>(factor));
      break;
    case DType::f64:
      scale_kernel<double, Divide><<<blocks_for(n, 2), kThreads, 0, s>>>(static_cast<double*>(buf.data), n, factor);
      break;
    case DType::f16:
      scale16_kernel<F16Tag, Divide><<<blocks_for(n, 1), kThreads, 0, s>>>(
          static_cast<std::uint16_t*>(buf.data), n, static_cast<float>(factor));
      break;
    case DType::bf16:
      scale16_kernel<BF16Tag, Divide><<<blocks_for(n, 1), kThreads, 0, s>>>(
          static_cast<std::uint16_t*>(buf.data), n, static_cast<float>(factor));
      break;
    default: break;
  }
  LOCKSTEP_CUDA_CHECK(cudaGetLastError());
}

// --- copies (pack, unpack, reference copy) ---------------------------------------------------
// Entry: ptr[0] = source, ptr[1] = destination, n = bytes. 16-byte words where both are aligned,
// else 4-byte words where possible, else bytes.
template <class Word>
__device__ void copy_words(const unsigned char* src, unsigned char* dst, std::int64_t begin, std::int64_t end) {
  constexpr int W = sizeof(Word);
  const std::int64_t wend = begin + (end - begin) / W * W;
  for (std::int64_t i = begin + static_cast<std::int64_t>(threadIdx.x) * W; i < wend;
       i += static_cast<std::int64_t>(blockDim.x) * W)
    *reinterpret_cast<Word*>(dst + i) = *reinterpret_cast<const Word*>(src + i);
  for (std::int64_t i = wend + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
}

__global__ void __launch_bounds__(kThreads) multi_copy(const Entry* entries, const Chunk* chunks) {
  const Chunk ch = chunks[blockIdx.x];
  const Entry e = entries[ch.entry];
  const auto* src = static_cast<const unsigned char*>(e.ptr[0]);
  auto* dst = static_cast<unsigned char*>(e.ptr[1]);
  const std::int64_t begin = ch.start;
  const std::int64_t end = begin + kChunkBytes < e.n ? begin + kChunkBytes : e.n;
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst);
  if (a % 16 == 0) {
    copy_words<uint4>(src, dst, begin, end);
  } else if (a % 4 == 0) {
    copy_words<std::uint32_t>(src, dst, begin, end);
  } else {
    copy_words<unsigned char>(src, dst, begin, end);
  }
}

void launch_copies(std::vector<Entry> entries, int device, cudaStream_t stream) {
  auto chunks = make_chunks(entries, kChunkBytes);
  if (chunks.empty()) return;
  DeviceGuard g(device);
  DeviceTable table(entries, chunks, device, stream);
  multi_copy<<<static_cast<unsigned>(chunks.size()), kThreads, 0, stream>>>(table.entries(), table.chunks());
  LOCKSTEP_CUDA_CHECK(cudaGetLastError());
}

void pack_or_unpack(std::span<const TensorView> tensors, TensorView bucket, std::int64_t offset,
                    cudaStream_t stream, bool to_bucket) {
  const char* what = to_bucket ? "cuda::pack" : "cuda::unpack";
  LOCKSTEP_CHECK_ARG(bucket.device.is_cuda(), what, ": the bucket is on ", to_string(bucket.device),
                     ", not on a cuda device");
  std::int64_t total = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& t = tensors[i];
    LOCKSTEP_CHECK_ARG(t.device == bucket.device, what, ": tensor ", i, " is on ", to_string(t.device),
                       " but the bucket on ", to_string(bucket.device));
    LOCKSTEP_CHECK_ARG(t.dtype == bucket.dtype, what, ": tensor ", i, " has dtype ", name(t.dtype),
                       " but the bucket ", name(bucket.dtype));
    LOCKSTEP_CHECK_ARG(t.numel >= 0 && (t.data != nullptr || t.numel == 0), what, ": tensor ", i,
                       " is not a valid view");
    total += t.numel;
  }
  LOCKSTEP_CHECK_ARG(offset >= 0 && offset + total <= bucket.numel, what, ": ", total,
                     " elements from offset ", offset, " do not fit a bucket of ", bucket.numel);
  const std::size_t es = size_of(bucket.dtype);
  std::vector<Entry> entries;
  entries.reserve(tensors.size());
  std::int64_t at = offset;
  for (const TensorView& t : tensors) {
    if (t.numel == 0) continue;
    void* in_bucket = static_cast<unsigned char*>(bucket.data) + static_cast<std::size_t>(at) * es;
    void* src = to_bucket ? t.data : in_bucket;
    void* dst = to_bucket ? in_bucket : t.data;
    entries.push_back({{src, dst, nullptr, nullptr}, static_cast<std::int64_t>(t.nbytes())});
    at += t.numel;
  }
  const int dev = bucket.device.index;
  launch_copies(std::move(entries), dev, resolve(stream, dev));
}

// --- f32 <-> 16-bit conversions (gradients on the wire) ------------------------------------------
// Entry: ptr[0] = source, ptr[1] = destination, n = elements. To the wire: round to nearest even
// (__float2bfloat16_rn / __float2half_rn, as the host's wire16.hpp); back: widened, then divided
// by `divisor` in f32 (an IEEE division: no fast-math here), as the host's from_wire16.
template <class Tag, bool ToWire>
__global__ void __launch_bounds__(kThreads) multi_convert(const Entry* entries, const Chunk* chunks, float divisor) {
  const Chunk ch = chunks[blockIdx.x];
  const Entry e = entries[ch.entry];
  const std::int64_t begin = ch.start;
  const std::int64_t end = begin + kChunk < e.n ? begin + kChunk : e.n;
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    if constexpr (ToWire) {
      static_cast<std::uint16_t*>(e.ptr[1])[i] = Half16<Tag>::store(static_cast<const float*>(e.ptr[0])[i]);
    } else {
      const float x = Half16<Tag>::load(static_cast<const std::uint16_t*>(e.ptr[0])[i]);
      static_cast<float*>(e.ptr[1])[i] = divisor == 1.0f ? x : x / divisor;
    }
  }
}

}  // namespace

void sgd_update(std::span<const SgdSpan> spans, const math::SGDCoeffs<float>& c, cudaStream_t s) {
  sgd_impl<float>(spans, c, s);
}
void sgd_update(std::span<const SgdSpan> spans, const math::SGDCoeffs<double>& c, cudaStream_t s) {
  sgd_impl<double>(spans, c, s);
}
void adam_update(std::span<const AdamSpan> spans, const math::AdamCoeffs<float>& c, cudaStream_t s) {
  adam_impl<float>(spans, c, s);
}
void adam_update(std::span<const AdamSpan> spans, const math::AdamCoeffs<double>& c, cudaStream_t s) {
  adam_impl<double>(spans, c, s);
}

void scale(TensorView buf, double factor, cudaStream_t stream) {
  scale_impl<false>(buf, factor, stream, "cuda::scale");
}
void divide(TensorView buf, double divisor, cudaStream_t stream) {
  LOCKSTEP_CHECK_ARG(divisor != 0.0, "cuda::divide: divisor is zero");
  scale_impl<true>(buf, divisor, stream, "cuda::divide");
}

void pack(std::span<const TensorView> sources, TensorView bucket, std::int64_t offset, cudaStream_t stream) {
  pack_or_unpack(sources, bucket, offset, stream, true);
}
void unpack(TensorView bucket, std::span<const TensorView> destinations, std::int64_t offset,
            cudaStream_t stream) {
  pack_or_unpack(destinations, bucket, offset, stream, false);
}

namespace detail {
void copy_regions(std::span<const DeviceCopy> copies, int device, cudaStream_t stream) {
  std::vector<Entry> entries;
  entries.reserve(copies.size());
  for (const DeviceCopy& c : copies)
    if (c.bytes > 0)
      entries.push_back({{const_cast<void*>(c.src), c.dst, nullptr, nullptr}, static_cast<std::int64_t>(c.bytes)});
  launch_copies(std::move(entries), device, stream);
}

void convert_regions(std::span<const DeviceConvert> items, DType from, DType to, float divisor, int device,
                     cudaStream_t stream) {
  const bool to_wire = from == DType::f32 && (to == DType::bf16 || to == DType::f16);
  const bool from_wire = to == DType::f32 && (from == DType::bf16 || from == DType::f16);
  LOCKSTEP_CHECK_ARG(to_wire || from_wire, "cuda: convert_many converts f32 to bf16 or f16 and back, got ",
                     name(from), " to ", name(to));
  std::vector<Entry> entries;
  entries.reserve(items.size());
  for (const DeviceConvert& c : items)
    if (c.n > 0) entries.push_back({{const_cast<void*>(c.src), c.dst, nullptr, nullptr}, c.n});
  auto chunks = make_chunks(entries, kChunk);
  if (chunks.empty()) return;
  DeviceGuard g(device);
  DeviceTable table(entries, chunks, device, stream);
  const unsigned blocks = static_cast<unsigned>(chunks.size());
  const bool bf = (to_wire ? to : from) == DType::bf16;
  if (to_wire && bf)
    multi_convert<BF16Tag, true><<<blocks, kThreads, 0, stream>>>(table.entries(), table.chunks(), divisor);
  else if (to_wire)
    multi_convert<F16Tag, true><<<blocks, kThreads, 0, stream>>>(table.entries(), table.chunks(), divisor);
  else if (bf)
    multi_convert<BF16Tag, false><<<blocks, kThreads, 0, stream>>>(table.entries(), table.chunks(), divisor);
  else
    multi_convert<F16Tag, false><<<blocks, kThreads, 0, stream>>>(table.entries(), table.chunks(), divisor);
  LOCKSTEP_CUDA_CHECK(cudaGetLastError());
}
}  // namespace detail

void copy_kernel(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  cudaPointerAttributes attr{};
  LOCKSTEP_CUDA_CHECK(cudaPointerGetAttributes(&attr, dst));
  LOCKSTEP_CHECK_ARG(attr.type == cudaMemoryTypeDevice, "cuda::copy_kernel: dst is not device memory");
  const int dev = attr.device;
  launch_copies({{{const_cast<void*>(src), dst, nullptr, nullptr}, static_cast<std::int64_t>(bytes)}}, dev,
                resolve(stream, dev));
}

}  // namespace lockstep::cuda
