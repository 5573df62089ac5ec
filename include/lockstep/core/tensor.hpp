// Tensor (owning, contiguous) and TensorView (non-owning).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/errors.hpp"

namespace lockstep {

using Shape = std::vector<std::int64_t>;

/// "[2, 3]".
std::string to_string(const Shape& s);
/// Product of the extents; throws InvalidArgument on a negative extent or a product that an
/// int64 cannot hold. A zero extent anywhere gives 0, whatever the other extents.
[[nodiscard]] std::int64_t numel_of(const Shape& s);
/// numel * size_of(dtype) in bytes; throws InvalidArgument if numel is negative or the size is
/// more than a pointer difference can hold (PTRDIFF_MAX), so byte sizes and offsets computed
/// from it never wrap.
[[nodiscard]] std::size_t nbytes_of(std::int64_t numel, DType dtype);

/// Non-owning view of contiguous memory: data, element count, dtype, device.
struct TensorView {
  void* data = nullptr;
  std::int64_t numel = 0;
  DType dtype = DType::f32;
  Device device = Device::cpu();

  /// Size in bytes.
  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(numel) * size_of(dtype); }

  /// Typed pointer; throws InvalidArgument if T does not match dtype.
  template <class T>
  T* as() const {
    check_dtype(dtype_of_v<T>);
    return static_cast<T*>(data);
  }
  /// Elements [offset, offset + count) of this view; throws InvalidArgument unless
  /// 0 <= offset <= numel and 0 <= count <= numel - offset (checked without overflow).
  [[nodiscard]] TensorView slice(std::int64_t offset, std::int64_t count) const;

  void check_dtype(DType expected) const;
};

/// True if a and b lie on the same device and share at least one byte of memory.
[[nodiscard]] bool memory_overlaps(const TensorView& a, const TensorView& b) noexcept;

/// A view of a typed span on the host.
template <class T>
TensorView view_of(std::span<T> s) {
  return TensorView{const_cast<std::remove_const_t<T>*>(s.data()),
                    static_cast<std::int64_t>(s.size()), dtype_of_v<T>, Device::cpu()};
}

/// Owning, contiguous tensor. Host memory is 64-byte aligned. Copying is explicit (clone());
/// moves are cheap. A moved-from tensor is empty, exactly like Tensor(): shape {0}, f32, cpu,
/// no memory; every operation on it is a no-op or an InvalidArgument. Self-move keeps it as is.
class Tensor {
 public:
  /// Empty tensor: shape {0}, f32, cpu, no memory (raw_data() is null).
  Tensor();
  /// Uninitialised tensor of the given shape (contents unspecified). Throws InvalidArgument for
  /// a bad shape or one too large to address, lockstep::Error naming the size if the memory
  /// cannot be allocated.
  Tensor(Shape shape, DType dtype = DType::f32, Device device = Device::cpu());

  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor() = default;

  [[nodiscard]] static Tensor empty(Shape shape, DType dtype = DType::f32, Device device = Device::cpu());
  [[nodiscard]] static Tensor zeros(Shape shape, DType dtype = DType::f32, Device device = Device::cpu());
  [[nodiscard]] static Tensor ones(Shape shape, DType dtype = DType::f32, Device device = Device::cpu());
  /// Every element set to `value` (converted to dtype).
  [[nodiscard]] static Tensor full(Shape shape, double value, DType dtype = DType::f32,
                     Device device = Device::cpu());
  /// Copy of `count` elements of host data; numel_of(shape) must equal data.size().
  template <class T>
  [[nodiscard]] static Tensor from(std::span<const T> data, Shape shape, Device device = Device::cpu()) {
    return from_bytes(data.data(), static_cast<std::int64_t>(data.size()), dtype_of_v<T>,
                      std::move(shape), device);
  }
  template <class T>
  [[nodiscard]] static Tensor from(const std::vector<T>& data, Shape shape) {
    return from(std::span<const T>(data), std::move(shape));
  }
  template <class T>
  [[nodiscard]] static Tensor from(const std::vector<T>& data) {
    return from(std::span<const T>(data), Shape{static_cast<std::int64_t>(data.size())});
  }
  /// Copy of `count` host elements of type dtype at `src`.
  [[nodiscard]] static Tensor from_bytes(const void* src, std::int64_t count, DType dtype, Shape shape,
                           Device device = Device::cpu());
  /// A tensor that borrows `data` (not freed by the tensor); the caller keeps it alive.
  [[nodiscard]] static Tensor borrow(void* data, Shape shape, DType dtype, Device device = Device::cpu());
  /// A tensor over `data` whose memory `owner` keeps alive: the tensor and every view of it
  /// share `owner`, whose deleter runs when the last of them is released (for memory with its
  /// own release path, e.g. a pool of buffers). `data` must hold the tensor's bytes.
  [[nodiscard]] static Tensor adopt(void* data, std::shared_ptr<void> owner, Shape shape, DType dtype,
                      Device device = Device::cpu());

  const Shape& shape() const noexcept { return shape_; }
  /// Extent of dimension i; throws InvalidArgument if i >= ndim().
  std::int64_t dim(std::size_t i) const {
    LOCKSTEP_CHECK_ARG(i < shape_.size(), "dim(", i, ") of a tensor of shape ", to_string(shape_));
    return shape_[i];
  }
  std::size_t ndim() const noexcept { return shape_.size(); }
  std::int64_t numel() const noexcept { return numel_; }
  DType dtype() const noexcept { return dtype_; }
  Device device() const noexcept { return device_; }
  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(numel_) * size_of(dtype_); }
  bool owns_memory() const noexcept { return static_cast<bool>(storage_); }
  /// What keeps this tensor's memory alive, shared with it (null for a tensor over memory it
  /// does not own). Holding it keeps the memory even after the tensor is gone (Request::keep).
  std::shared_ptr<void> owner() const noexcept { return storage_; }

  /// Typed host pointer; throws InvalidArgument if T does not match dtype().
  template <class T>
  T* data() {
    view().check_dtype(dtype_of_v<T>);
    return static_cast<T*>(data_);
  }
  template <class T>
  const T* data() const {
    view().check_dtype(dtype_of_v<T>);
    return static_cast<const T*>(data_);
  }
  /// Typed span over the elements (host tensors).
  template <class T>
  std::span<T> span() {
    return {data<T>(), static_cast<std::size_t>(numel_)};
  }
  template <class T>
  std::span<const T> span() const {
    return {data<T>(), static_cast<std::size_t>(numel_)};
  }
  void* raw_data() noexcept { return data_; }
  const void* raw_data() const noexcept { return data_; }

  TensorView view() const noexcept { return {data_, numel_, dtype_, device_}; }
  operator TensorView() const noexcept { return view(); }

  /// Deep copy on the same device.
  [[nodiscard]] Tensor clone() const;
  /// Copy on another device (a no-op copy when already there).
  [[nodiscard]] Tensor to(Device device) const;
  /// Sets every element to zero.
  void zero_();
  /// Copies the contents of `src` (same dtype and numel) into this tensor. Overlapping host
  /// memory is copied as if through a temporary (memmove); a null src with elements is refused.
  void copy_from(const TensorView& src);
  /// Same memory, new shape with the same numel; keeps the memory alive like this tensor does.
  [[nodiscard]] Tensor reshape_view(Shape shape) const;
  /// Elements [offset, offset + numel_of(shape)) of this tensor, as a tensor of `shape` sharing
  /// this tensor's memory and keeping it alive (a borrowed tensor gives a borrowed view).
  /// Throws InvalidArgument if the range is not inside the tensor (checked without overflow).
  [[nodiscard]] Tensor slice_view(std::int64_t offset, Shape shape) const;

 private:
  /// Leaves *this empty (the state of Tensor()); used by the moves.
  void reset_to_empty() noexcept;

  Shape shape_{0};
  std::int64_t numel_ = 0;
  DType dtype_ = DType::f32;
  Device device_ = Device::cpu();
  std::shared_ptr<void> storage_;  // shared so reshape_view can alias; Tensor itself is move-only
  void* data_ = nullptr;
};

/// Bitwise equality of contents (dtype, shape and bytes).
[[nodiscard]] bool bitwise_equal(const Tensor& a, const Tensor& b);

}  // namespace lockstep
