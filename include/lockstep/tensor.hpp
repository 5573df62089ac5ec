// Tensor (owning, contiguous) and TensorView (non-owning).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "lockstep/dtype.hpp"
#include "lockstep/errors.hpp"

namespace lockstep {

using Shape = std::vector<std::int64_t>;

/// "[2, 3]".
std::string to_string(const Shape& s);
/// Product of the extents; throws InvalidArgument on a negative extent.
std::int64_t numel_of(const Shape& s);

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
  /// Elements [offset, offset + count) of this view.
  TensorView slice(std::int64_t offset, std::int64_t count) const;

  void check_dtype(DType expected) const;
};

/// A view of a typed span on the host.
template <class T>
TensorView view_of(std::span<T> s) {
  return TensorView{const_cast<std::remove_const_t<T>*>(s.data()),
                    static_cast<std::int64_t>(s.size()), dtype_of_v<T>, Device::cpu()};
}

/// Owning, contiguous tensor. Host memory is 64-byte aligned. Copying is explicit (clone());
/// moves are cheap.
class Tensor {
 public:
  /// Empty tensor: shape {0}, f32, cpu.
  Tensor();
  /// Uninitialised tensor of the given shape (contents unspecified).
  Tensor(Shape shape, DType dtype = DType::f32, Device device = Device::cpu());

  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor() = default;

  static Tensor empty(Shape shape, DType dtype = DType::f32, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype = DType::f32, Device device = Device::cpu());
  static Tensor ones(Shape shape, DType dtype = DType::f32, Device device = Device::cpu());
  /// Every element set to `value` (converted to dtype).
  static Tensor full(Shape shape, double value, DType dtype = DType::f32,
                     Device device = Device::cpu());
  /// Copy of `count` elements of host data; numel_of(shape) must equal data.size().
  template <class T>
  static Tensor from(std::span<const T> data, Shape shape, Device device = Device::cpu()) {
    return from_bytes(data.data(), static_cast<std::int64_t>(data.size()), dtype_of_v<T>,
                      std::move(shape), device);
  }
  template <class T>
  static Tensor from(const std::vector<T>& data, Shape shape) {
    return from(std::span<const T>(data), std::move(shape));
  }
  template <class T>
  static Tensor from(const std::vector<T>& data) {
    return from(std::span<const T>(data), Shape{static_cast<std::int64_t>(data.size())});
  }
  /// Copy of `count` host elements of type dtype at `src`.
  static Tensor from_bytes(const void* src, std::int64_t count, DType dtype, Shape shape,
                           Device device = Device::cpu());
  /// A tensor that borrows `data` (not freed by the tensor); the caller keeps it alive.
  static Tensor borrow(void* data, Shape shape, DType dtype, Device device = Device::cpu());

  const Shape& shape() const noexcept { return shape_; }
  std::int64_t dim(std::size_t i) const { return shape_.at(i); }
  std::size_t ndim() const noexcept { return shape_.size(); }
  std::int64_t numel() const noexcept { return numel_; }
  DType dtype() const noexcept { return dtype_; }
  Device device() const noexcept { return device_; }
  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(numel_) * size_of(dtype_); }
  bool owns_memory() const noexcept { return static_cast<bool>(storage_); }

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
  Tensor clone() const;
  /// Copy on another device (a no-op copy when already there).
  Tensor to(Device device) const;
  /// Sets every element to zero.
  void zero_();
  /// Copies the contents of `src` (same dtype and numel) into this tensor.
  void copy_from(const TensorView& src);
  /// Same memory, new shape with the same numel.
  Tensor reshape_view(Shape shape) const;

 private:
  Shape shape_{0};
  std::int64_t numel_ = 0;
  DType dtype_ = DType::f32;
  Device device_ = Device::cpu();
  std::shared_ptr<void> storage_;  // shared so reshape_view can alias; Tensor itself is move-only
  void* data_ = nullptr;
};

/// Bitwise equality of contents (dtype, shape and bytes).
bool bitwise_equal(const Tensor& a, const Tensor& b);

}  // namespace lockstep
