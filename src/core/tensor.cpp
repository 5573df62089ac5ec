#include "lockstep/core/tensor.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "lockstep/core/device_runtime.hpp"

namespace lockstep {
namespace {

constexpr std::size_t kHostAlignment = 64;

// Largest byte size of a tensor or view: what a pointer difference can hold, so that no byte
// count, offset or end pointer computed from a valid size wraps (and the host allocation's
// rounding up to kHostAlignment cannot wrap either).
constexpr std::size_t kMaxBytes = static_cast<std::size_t>(std::numeric_limits<std::ptrdiff_t>::max());

// `bytes` (at most kMaxBytes) for a tensor of `shape`: a failed host allocation is a
// lockstep::Error naming the size, the shape and the dtype, rather than a bare std::bad_alloc.
std::shared_ptr<void> allocate(std::size_t bytes, Device device, const Shape& shape, DType dtype) {
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
  if (p == nullptr)
    throw Error(detail::concat("Tensor: out of memory: cannot allocate ", bytes, " bytes for a ",
                               name(dtype), " tensor of shape ", to_string(shape), " on ",
                               to_string(device), detail::rank_suffix()));
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

template <class T>
void fill_host(void* p, std::int64_t n, T value) {
  T* t = static_cast<T*>(p);
  for (std::int64_t i = 0; i < n; ++i) t[i] = value;
}

// Throws InvalidArgument if `v` cannot be converted to an integer dtype: converting a NaN, an
// infinity or a value outside the type's range from double is undefined behaviour. Values in
// range are truncated toward zero, as static_cast does.
void check_fill_value(DType dtype, double v) {
  double lo = 0, hi = 0;  // the open interval of doubles that truncate into the type
  switch (dtype) {
    case DType::i32: lo = -2147483649.0; hi = 2147483648.0; break;
    // -2^63 - 2048 is the double just below -2^63.
    case DType::i64: lo = -9223372036854777856.0; hi = 9223372036854775808.0; break;
    case DType::u8: lo = -1.0; hi = 256.0; break;
    default: return;  // floating dtypes: NaN and infinities are values
  }
  LOCKSTEP_CHECK_ARG(v > lo && v < hi, "Tensor::full: value ", v, " cannot be represented in ",
                     name(dtype));
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

// Throws InvalidArgument for a value outside the enumeration (size_of gives 0 for it).
void check_dtype_value(const char* what, DType dtype) {
  LOCKSTEP_CHECK_ARG(size_of(dtype) != 0, what, ": invalid DType value ",
                     static_cast<int>(dtype));
}

// True if numel (>= 0) elements of dtype (a valid one) fit in kMaxBytes.
bool fits(std::int64_t numel, DType dtype) {
  return static_cast<std::size_t>(numel) <= kMaxBytes / size_of(dtype);
}

// The byte size of a tensor about to be made; InvalidArgument naming the shape if too large.
std::size_t tensor_bytes(const char* what, const Shape& shape, std::int64_t numel, DType dtype) {
  check_dtype_value(what, dtype);
  LOCKSTEP_CHECK_ARG(fits(numel, dtype), what, ": shape ", to_string(shape), " of ", name(dtype),
                     " needs ", numel, " x ", size_of(dtype),
                     " bytes, more than memory can address (at most ", kMaxBytes, " bytes)");
  return static_cast<std::size_t>(numel) * size_of(dtype);
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
  // Every extent is checked first, so that the result does not depend on where a zero is.
  bool zero = false;
  for (auto e : s) {
    LOCKSTEP_CHECK_ARG(e >= 0, "shape ", to_string(s), " has a negative extent");
    zero = zero || e == 0;
  }
  if (zero) return 0;
  std::int64_t n = 1;
  for (auto e : s) {
    LOCKSTEP_CHECK_ARG(n <= std::numeric_limits<std::int64_t>::max() / e, "shape ", to_string(s),
                       " has more elements than an int64 can count");
    n *= e;
  }
  return n;
}

std::size_t nbytes_of(std::int64_t numel, DType dtype) {
  check_dtype_value("nbytes_of", dtype);
  LOCKSTEP_CHECK_ARG(numel >= 0, "negative element count ", numel);
  LOCKSTEP_CHECK_ARG(fits(numel, dtype), numel, " elements of ", name(dtype),
                     " need more bytes than memory can address (at most ", kMaxBytes, " bytes)");
  return static_cast<std::size_t>(numel) * size_of(dtype);
}

bool memory_overlaps(const TensorView& a, const TensorView& b) noexcept {
  if (a.device != b.device || a.data == nullptr || b.data == nullptr || a.numel <= 0 || b.numel <= 0)
    return false;
  // Compared as addresses, by distance from the lower start: no pointer arithmetic outside
  // either view, and no sum that could wrap.
  const auto pa = reinterpret_cast<std::uintptr_t>(a.data);
  const auto pb = reinterpret_cast<std::uintptr_t>(b.data);
  return pa <= pb ? pb - pa < a.nbytes() : pa - pb < b.nbytes();
}

void TensorView::check_dtype(DType expected) const {
  LOCKSTEP_CHECK_ARG(expected == dtype, "tensor has dtype ", name(dtype), " but was accessed as ",
                     name(expected),
                     data == nullptr && numel == 0
                         ? " (it is an empty tensor: default-constructed or moved from)"
                         : "");
}

TensorView TensorView::slice(std::int64_t offset, std::int64_t count) const {
  // A view that cannot describe real memory is refused rather than sliced.
  check_dtype_value("slice", dtype);
  LOCKSTEP_CHECK_ARG(numel >= 0 && fits(numel, dtype) && (data != nullptr || numel == 0),
                     "slice of a view of ", numel, " ", name(dtype), " elements at ", data,
                     ", which cannot exist");
  // Compared without adding, so that no sum can overflow.
  LOCKSTEP_CHECK_ARG(offset >= 0 && count >= 0 && offset <= numel && count <= numel - offset,
                     "slice at offset ", offset, " with count ", count,
                     " out of range for a view of ", numel, " elements");
  if (count == 0 && data == nullptr) return {nullptr, 0, dtype, device};
  return {static_cast<std::byte*>(data) + static_cast<std::size_t>(offset) * size_of(dtype), count,
          dtype, device};
}

Tensor::Tensor() = default;

Tensor::Tensor(Shape shape, DType dtype, Device device)
    : shape_(std::move(shape)), numel_(numel_of(shape_)), dtype_(dtype), device_(device) {
  LOCKSTEP_CHECK_ARG(device.index >= 0, "device index must be >= 0, got ", device.index);
  const std::size_t bytes = tensor_bytes("Tensor", shape_, numel_, dtype_);
  storage_ = allocate(bytes, device_, shape_, dtype_);
  data_ = storage_.get();
}

Tensor::Tensor(Tensor&& other) noexcept
    : shape_(std::move(other.shape_)),
      numel_(other.numel_),
      dtype_(other.dtype_),
      device_(other.device_),
      storage_(std::move(other.storage_)),
      data_(other.data_) {
  other.reset_to_empty();
}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this == &other) return *this;
  shape_.swap(other.shape_);  // other gets this tensor's old shape vector to reset (no allocation)
  numel_ = other.numel_;
  dtype_ = other.dtype_;
  device_ = other.device_;
  storage_ = std::move(other.storage_);  // releases this tensor's old memory (if it held any)
  data_ = other.data_;
  other.reset_to_empty();
  return *this;
}

void Tensor::reset_to_empty() noexcept {
  // The state of Tensor(). The one-element shape may need an allocation of 8 bytes (when the
  // shape's vector was moved away); if even that fails, the program ends (noexcept) rather
  // than leaving an inconsistent tensor.
  shape_.assign(1, 0);
  numel_ = 0;
  dtype_ = DType::f32;
  device_ = Device::cpu();
  storage_.reset();
  data_ = nullptr;
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
  check_fill_value(dtype, value);
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
  LOCKSTEP_CHECK_ARG(src != nullptr || count == 0, "Tensor::from: null data for ", count,
                     " elements");
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
  LOCKSTEP_CHECK_ARG(device.index >= 0, "device index must be >= 0, got ", device.index);
  (void)tensor_bytes("Tensor::borrow", t.shape_, t.numel_, dtype);
  LOCKSTEP_CHECK_ARG(data != nullptr || t.numel_ == 0, "Tensor::borrow: null data for ",
                     t.numel_, " elements");
  t.storage_.reset();
  t.data_ = data;
  return t;
}

Tensor Tensor::adopt(void* data, std::shared_ptr<void> owner, Shape shape, DType dtype, Device device) {
  Tensor t = borrow(data, std::move(shape), dtype, device);
  t.storage_ = std::move(owner);
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
  LOCKSTEP_CHECK_ARG(src.data != nullptr || src.numel == 0, "copy_from: the source has null data for ",
                     src.numel, " elements");
  const std::size_t bytes = nbytes();
  if (bytes == 0 || src.data == data_) return;  // nothing to copy, or a copy onto itself
  if (memory_overlaps(view(), src)) {
    LOCKSTEP_CHECK_ARG(device_.is_cpu(), "copy_from: source and destination overlap in memory on ",
                       to_string(device_));
    std::memmove(data_, src.data, bytes);
    return;
  }
  copy_bytes(data_, device_, src.data, src.device, bytes);
}

Tensor Tensor::reshape_view(Shape shape) const {
  LOCKSTEP_CHECK_ARG(numel_of(shape) == numel_, "reshape_view: ", to_string(shape_), " to ",
                     to_string(shape), " changes the number of elements");
  return slice_view(0, std::move(shape));
}

Tensor Tensor::slice_view(std::int64_t offset, Shape shape) const {
  const std::int64_t n = numel_of(shape);
  // Compared without adding, so that no sum can overflow.
  LOCKSTEP_CHECK_ARG(offset >= 0 && offset <= numel_ && n <= numel_ - offset, "slice_view: ",
                     n, " elements (shape ", to_string(shape), ") at offset ", offset,
                     " out of range for a tensor of ", numel_, " elements");
  Tensor t;
  t.shape_ = std::move(shape);
  t.numel_ = n;
  t.dtype_ = dtype_;
  t.device_ = device_;
  t.storage_ = storage_;
  t.data_ = data_ == nullptr ? nullptr
                             : static_cast<std::byte*>(data_) +
                                   static_cast<std::size_t>(offset) * size_of(dtype_);
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
