#include "lockstep/tensor.hpp"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "lockstep/device_runtime.hpp"

namespace lockstep {
namespace {

constexpr std::size_t kHostAlignment = 64;

std::shared_ptr<void> allocate(std::size_t bytes, Device device) {
  if (device.is_cuda()) {
    DeviceRuntime& rt = device_runtime("Tensor on a cuda device");
    void* p = bytes == 0 ? nullptr : rt.allocate(bytes, device.index);
    int index = device.index;
    return std::shared_ptr<void>(p, [&rt, index](void* q) {
      if (q != nullptr) rt.deallocate(q, index);
    });
  }
  // Round up so aligned_alloc's size requirement holds; never pass 0.
  std::size_t padded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
  if (padded == 0) padded = kHostAlignment;
  void* p = std::aligned_alloc(kHostAlignment, padded);
  if (p == nullptr) throw std::bad_alloc();
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

template <class T>
void fill_host(void* p, std::int64_t n, T value) {
  T* t = static_cast<T*>(p);
  for (std::int64_t i = 0; i < n; ++i) t[i] = value;
}

void fill_bytes(void* p, std::int64_t n, DType dtype, double v) {
  switch (dtype) {
    case DType::f16: fill_host(p, n, to_half(static_cast<float>(v))); break;
    case DType::bf16: fill_host(p, n, to_bfloat16(static_cast<float>(v))); break;
    case DType::f32: fill_host(p, n, static_cast<float>(v)); break;
    case DType::f64: fill_host(p, n, v); break;
    case DType::i32: fill_host(p, n, static_cast<std::int32_t>(v)); break;
    case DType::i64: fill_host(p, n, static_cast<std::int64_t>(v)); break;
    case DType::u8: fill_host(p, n, static_cast<std::uint8_t>(v)); break;
  }
}

void copy_bytes(void* dst, Device dd, const void* src, Device sd, std::size_t bytes) {
  if (bytes == 0) return;
  if (dd.is_cpu() && sd.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  device_runtime("copy involving a cuda device").copy(dst, dd, src, sd, bytes);
}

}  // namespace

std::string to_string(const Shape& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

std::int64_t numel_of(const Shape& s) {
  std::int64_t n = 1;
  for (auto e : s) {
    LOCKSTEP_CHECK_ARG(e >= 0, "shape ", to_string(s), " has a negative extent");
    LOCKSTEP_CHECK_ARG(e == 0 || n <= std::numeric_limits<std::int64_t>::max() / e, "shape ",
                       to_string(s), " has more elements than an int64 can count");
    n *= e;
  }
  return n;
}

void TensorView::check_dtype(DType expected) const {
  LOCKSTEP_CHECK_ARG(expected == dtype, "tensor has dtype ", name(dtype),
                     " but was accessed as ", name(expected));
}

TensorView TensorView::slice(std::int64_t offset, std::int64_t count) const {
  LOCKSTEP_CHECK_ARG(offset >= 0 && count >= 0 && offset + count <= numel, "slice [", offset, ", ",
                     offset + count, ") out of range for a view of ", numel, " elements");
  return {static_cast<char*>(data) + static_cast<std::size_t>(offset) * size_of(dtype), count, dtype,
          device};
}

Tensor::Tensor() = default;

Tensor::Tensor(Shape shape, DType dtype, Device device)
    : shape_(std::move(shape)), numel_(numel_of(shape_)), dtype_(dtype), device_(device) {
  LOCKSTEP_CHECK_ARG(device.index >= 0, "device index must be >= 0, got ", device.index);
  storage_ = allocate(nbytes(), device_);
  data_ = storage_.get();
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  return Tensor(std::move(shape), dtype, device);
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t(std::move(shape), dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::ones(Shape shape, DType dtype, Device device) {
  return full(std::move(shape), 1.0, dtype, device);
}

Tensor Tensor::full(Shape shape, double value, DType dtype, Device device) {
  if (device.is_cuda()) {
    device_runtime("Tensor::full on a cuda device");
    Tensor host = full(shape, value, dtype, Device::cpu());
    return host.to(device);
  }
  Tensor t(std::move(shape), dtype, device);
  fill_bytes(t.data_, t.numel_, dtype, value);
  return t;
}

Tensor Tensor::from_bytes(const void* src, std::int64_t count, DType dtype, Shape shape,
                          Device device) {
  LOCKSTEP_CHECK_ARG(numel_of(shape) == count, "Tensor::from: shape ", to_string(shape), " holds ",
                     numel_of(shape), " elements but ", count, " were given");
  Tensor t(std::move(shape), dtype, device);
  copy_bytes(t.data_, device, src, Device::cpu(), t.nbytes());
  return t;
}

Tensor Tensor::borrow(void* data, Shape shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.numel_ = numel_of(t.shape_);
  t.dtype_ = dtype;
  t.device_ = device;
  LOCKSTEP_CHECK_ARG(data != nullptr || t.numel_ == 0, "Tensor::borrow: null data for ",
                     t.numel_, " elements");
  t.storage_.reset();
  t.data_ = data;
  return t;
}

Tensor Tensor::clone() const { return to(device_); }

Tensor Tensor::to(Device device) const {
  Tensor t(shape_, dtype_, device);
  copy_bytes(t.data_, device, data_, device_, nbytes());
  return t;
}

void Tensor::zero_() {
  if (nbytes() == 0) return;
  if (device_.is_cuda()) {
    device_runtime("Tensor::zero_ on a cuda device").zero(data_, nbytes(), device_.index);
  } else {
    std::memset(data_, 0, nbytes());
  }
}

void Tensor::copy_from(const TensorView& src) {
  LOCKSTEP_CHECK_ARG(src.dtype == dtype_ && src.numel == numel_, "copy_from: source is ",
                     src.numel, " x ", name(src.dtype), ", destination is ", numel_, " x ",
                     name(dtype_));
  copy_bytes(data_, device_, src.data, src.device, nbytes());
}

Tensor Tensor::reshape_view(Shape shape) const {
  LOCKSTEP_CHECK_ARG(numel_of(shape) == numel_, "reshape_view: ", to_string(shape_), " to ",
                     to_string(shape), " changes the number of elements");
  Tensor t;
  t.shape_ = std::move(shape);
  t.numel_ = numel_;
  t.dtype_ = dtype_;
  t.device_ = device_;
  t.storage_ = storage_;
  t.data_ = data_;
  return t;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  if (a.device().is_cpu() && b.device().is_cpu())
    return a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
  Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return bitwise_equal(ha, hb);
}

}  // namespace lockstep
