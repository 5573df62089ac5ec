// GradientReducer's buckets before and after their collectives: packing the gradients into a
// bucket's buffer (or taking them in place when they lie back to back), the device wire's 16-bit
// copies, the accumulator of micro-steps, and unpacking the reduced values.
#include "train/reducer_impl.hpp"

#include <algorithm>
#include <cstring>
#include <tuple>

#include "lockstep/core/errors.hpp"

namespace lockstep {

using detail::concat;

namespace {
template <class T>
void add_grad_into(T* __restrict__ dst, const T* __restrict__ src, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
}
template <class T>
void divide_grad(T* p, std::int64_t n, T k) {
  for (std::int64_t i = 0; i < n; ++i) p[i] /= k;
}
}  // namespace

void detail::copy_grad_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t n) {
  if (n == 0) return;
  if (dst_dev.is_cpu() && src_dev.is_cpu())
    std::memcpy(dst, src, n);
  else
    device_runtime("DistributedOptimizer").copy(dst, dst_dev, src, src_dev, n);
}

void GradientReducer::Impl::ensure_work(Bucket& b) {
  if (b.work.numel() != b.numel) b.work = Tensor::zeros({b.numel}, b.dtype, b.device);
}

std::byte* GradientReducer::Impl::leaf_in_work(Bucket& b, std::size_t j) {
  return static_cast<std::byte*>(b.work.raw_data()) +
         static_cast<std::size_t>(b.offsets[j - b.first]) * size_of(b.dtype);
}

bool GradientReducer::Impl::contiguous(const Bucket& b) const {
  for (std::size_t j = b.first + 1; j < b.last; ++j) {
    const auto* prev = static_cast<const std::byte*>(bound[j - 1]->raw_data());
    if (static_cast<const std::byte*>(bound[j]->raw_data()) != prev + bound[j - 1]->nbytes())
      return false;
  }
  return true;
}

// Adds the bound gradients of bucket b into its accumulator.
void GradientReducer::Impl::add_bucket(Bucket& b) {
  LOCKSTEP_CHECK_ARG(b.device.is_cpu(), "DistributedOptimizer: gradient accumulation of device "
                                        "tensors is not supported by the core");
  for (std::size_t j = b.first; j < b.last; ++j) {
    const std::int64_t n = leaves[j].numel;
    if (b.dtype == DType::f32)
      add_grad_into(reinterpret_cast<float*>(leaf_in_work(b, j)), bound[j]->data<float>(), n);
    else if (b.dtype == DType::f64)
      add_grad_into(reinterpret_cast<double*>(leaf_in_work(b, j)), bound[j]->data<double>(), n);
    else
      throw InvalidArgument(concat("DistributedOptimizer: gradient accumulation supports f32 "
                                   "and f64 gradients, got ", name(b.dtype), " at '", paths[j], "'"));
  }
}

// Makes bucket bi ready to be reduced and returns the view to reduce (packed into the
// bucket's buffer unless its gradients lie back to back); an empty view when there is nothing
// to communicate: an empty bucket, or a device bucket at one rank (the sum and the mean of one
// rank are its gradients; accumulation and the wire dtype are host-only). With a wire dtype
// the view is f32 as without: the 16-bit collectives round it themselves.
TensorView GradientReducer::Impl::prepare(std::size_t bi) {
  Bucket& b = buckets[bi];
  b.launched = true;
  if (b.numel == 0) return {};
  if (!b.device.is_cpu() && nranks == 1) {
    if (contiguous(b)) ++zero_copy;  // in place, trivially
    return {};
  }
  const bool accumulating = accumulated > 0;
  if (wire && !b.device.is_cpu()) return prepare_device_wire(b);
  if (accumulating) {
    add_bucket(b);
    b.staged = true;  // result stays in the accumulator; nothing to unpack
    return b.work.view();
  }
  if (contiguous(b)) {
    ++zero_copy;
    return TensorView{bound[b.first]->raw_data(), b.numel, b.dtype, b.device};
  }
  ensure_work(b);
  if (b.device.is_cpu()) {
    for (std::size_t j = b.first; j < b.last; ++j)
      detail::copy_grad_bytes(leaf_in_work(b, j), b.device, bound[j]->raw_data(), bound[j]->device(), bound[j]->nbytes());
  } else {
    copy_device(b, /*to_work=*/true);  // one launch, ordered on the current stream
  }
  b.staged = true;
  return b.work.view();
}

// Where gradient j of bucket b is reduced: in the accumulator when micro-steps were
// accumulated, else where the bound gradient lies.
std::byte* GradientReducer::Impl::leaf_to_reduce(Bucket& b, std::size_t j) {
  return accumulated > 0 ? leaf_in_work(b, j) : static_cast<std::byte*>(bound[j]->raw_data());
}

// Fills the parts of host bucket bi (b.parts), what launch reduces, in order: the bucket's one view
// (prepare), or, for a bucket split across machines (b.large not empty, bucket_plan.cpp), its
// small tensors packed together into b.pack, then each large tensor where it lies (in the
// accumulator with accumulation). The parts are the same on every rank whatever the memory
// layout: a split bucket whose gradients lie back to back still packs its small tensors.
void GradientReducer::Impl::prepare_parts(std::size_t bi) {
  Bucket& b = buckets[bi];
  b.parts.clear();
  if (b.large.empty()) {
    const TensorView t = prepare(bi);
    if (t.numel > 0) b.parts.push_back(t);
    return;
  }
  b.launched = true;
  if (accumulated > 0) add_bucket(b);  // this micro-step into the accumulator, reduced there
  const std::size_t es = size_of(b.dtype);
  if (b.small_numel > 0) {
    if (b.pack.numel() != b.small_numel) b.pack = Tensor::zeros({b.small_numel}, b.dtype, b.device);
    auto* p = static_cast<std::byte*>(b.pack.raw_data());
    for (std::size_t j : b.small) {
      const std::size_t n = static_cast<std::size_t>(leaves[j].numel) * es;
      detail::copy_grad_bytes(p, b.device, leaf_to_reduce(b, j), b.device, n);
      p += n;
    }
    b.parts.push_back(b.pack.view());
  } else if (accumulated == 0) {
    ++zero_copy;  // every tensor of the bucket reduced where it lies
  }
  for (std::size_t j : b.large)
    b.parts.push_back(TensorView{leaf_to_reduce(b, j), leaves[j].numel, b.dtype, b.device});
}

// A split bucket after its reduction: the packed small tensors back where they were taken from
// (the gradients, or the accumulator). The large ones were reduced where they lie.
void GradientReducer::Impl::unpack_small(Bucket& b) {
  if (b.small_numel == 0) return;
  const std::size_t es = size_of(b.dtype);
  const auto* p = static_cast<const std::byte*>(b.pack.raw_data());
  for (std::size_t j : b.small) {
    const std::size_t n = static_cast<std::size_t>(leaves[j].numel) * es;
    detail::copy_grad_bytes(leaf_to_reduce(b, j), b.device, p, b.device, n);
    p += n;
  }
}

// Device gradients on the wire: rounded into the bucket's wire buffer (kept across steps) with
// one conversion launch on the current stream (DeviceRuntime::convert_many), not waited for.
// The whole bucket, sharded or not (the reduce-scatter reads all of it).
TensorView GradientReducer::Impl::prepare_device_wire(Bucket& b) {
  if (b.wire.numel() != b.numel) b.wire = Tensor::zeros({b.numel}, *wire, b.device);
  if (accumulated > 0) add_bucket(b);  // refuses device tensors, as without a wire dtype
  convs.clear();
  for (std::size_t j = b.first; j < b.last; ++j)
    if (leaves[j].numel > 0)
      convs.push_back({static_cast<std::byte*>(b.wire.raw_data()) + 2 * static_cast<std::size_t>(b.offsets[j - b.first]),
                       bound[j]->raw_data(), leaves[j].numel});
  device_runtime("DistributedOptimizer").convert_many(convs, DType::f32, *wire, 1.0f, b.device.index);
  b.staged = true;
  return b.wire.view();
}

// Device gradients on the wire, after the sum: back to f32 into the gradients, divided by the
// ranks for avg, in one conversion launch on the current stream. Sharded: this rank's piece.
void GradientReducer::Impl::finish_device_wire(Bucket& b) {
  const float div = options.op == ReduceOp::avg ? static_cast<float>(nranks) : 1.0f;
  std::int64_t lo = 0, hi = b.numel;
  if (sharded) std::tie(lo, hi) = piece(b.numel, my_rank);
  convs.clear();
  for (std::size_t j = b.first; j < b.last; ++j) {
    const std::int64_t o = b.offsets[j - b.first];
    const std::int64_t a = std::max(lo, o), e = std::min(hi, o + leaves[j].numel);
    if (e > a)
      convs.push_back({static_cast<float*>(bound[j]->raw_data()) + (a - o),
                       static_cast<const std::byte*>(b.wire.raw_data()) + 2 * static_cast<std::size_t>(a), e - a});
  }
  device_runtime("DistributedOptimizer").convert_many(convs, *wire, DType::f32, div, b.device.index);
}

// Packs (to_work) or unpacks the gradients of device bucket b with one copy launch, queued on
// the current stream of its device and not waited for; only the elements [lo, hi) of the
// bucket (sharded: this rank's piece, the only part the reduce-scatter reduced).
void GradientReducer::Impl::copy_device(Bucket& b, bool to_work, std::int64_t lo, std::int64_t hi) {
  copies.clear();
  const std::size_t es = size_of(b.dtype);
  for (std::size_t j = b.first; j < b.last; ++j) {
    const std::int64_t o = b.offsets[j - b.first];
    const std::int64_t a = std::max(lo, o), e = std::min(hi, o + leaves[j].numel);
    if (e <= a) continue;
    std::byte* g = static_cast<std::byte*>(bound[j]->raw_data()) + static_cast<std::size_t>(a - o) * es;
    std::byte* w = leaf_in_work(b, j) + static_cast<std::size_t>(a - o) * es;
    const std::size_t n = static_cast<std::size_t>(e - a) * es;
    if (to_work) copies.push_back({w, g, n});
    else copies.push_back({g, w, n});
  }
  if (!copies.empty()) device_runtime("DistributedOptimizer").copy_many(copies, b.device.index);
}

void GradientReducer::Impl::finish(Bucket& b) {
  if (b.finished) return;
  if (b.threaded) {
    std::unique_lock lk(wm);
    wcv.wait(lk, [&] { return b.done; });
    if (werror) return;  // reduce_bound reports it once every bucket is done
  }
  for (auto& r : b.requests) r.wait();
  b.finished = true;
  if (carrier.used && &b == &buckets[carrier.bucket]) settle_carrier();  // before unpacking and dividing
  if (b.numel == 0) return;
  if (wire && !b.device.is_cpu()) {
    if (b.staged) finish_device_wire(b);  // (not staged: one rank, nothing was sent)
    return;
  }
  // A split bucket (across machines): its small tensors back from the pack, first, so that the
  // accumulator's division below sees their reduced values.
  if (!b.large.empty()) unpack_small(b);
  if (accumulated > 0) {
    if (options.op == ReduceOp::avg) {
      const int k = accumulated + 1;
      if (b.dtype == DType::f32)
        divide_grad(b.work.data<float>(), b.numel, static_cast<float>(k));
      else
        divide_grad(b.work.data<double>(), b.numel, static_cast<double>(k));
    }
    return;
  }
  if (!b.large.empty() || !b.staged) return;
  if (!b.device.is_cpu()) {
    // One launch; later work on the stream sees it done. Sharded: this rank's piece only.
    if (sharded) {
      const auto [lo, hi] = piece(b.numel, my_rank);
      copy_device(b, /*to_work=*/false, lo, hi);
    } else {
      copy_device(b, /*to_work=*/false);
    }
    return;
  }
  for (std::size_t j = b.first; j < b.last; ++j)
    detail::copy_grad_bytes(bound[j]->raw_data(), bound[j]->device(), leaf_in_work(b, j), b.device,
               bound[j]->nbytes());
}

void GradientReducer::Impl::make_accum_views() {
  accum_views.clear();
  accum_ptrs.clear();
  accum_views.reserve(leaves.size());
  for (std::size_t j = 0; j < leaves.size(); ++j) {
    Bucket& b = buckets[bucket_of[j]];
    accum_views.push_back(Tensor::borrow(leaf_in_work(b, j), {leaves[j].numel}, b.dtype, b.device));
  }
  for (auto& t : accum_views) accum_ptrs.push_back(&t);
}

}  // namespace lockstep
