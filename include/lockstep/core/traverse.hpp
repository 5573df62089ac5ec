// Traversal of nested structures of tensors and scalars (the role Functors' @functor plays in
// Flux). One traversal serves synchronize, the optimizer and checkpoints.
//
// Traversable types:
//   - leaves: lockstep::Tensor and arithmetic scalars (bool, integers, float, double, ...);
//   - std::vector<T>, std::array<T, N>, std::tuple<T...> (tuples of references too, as made by
//     std::tie), std::pair<A, B>, std::map<std::string, T>, std::optional<T>, of traversable T;
//   - a user struct made traversable with LOCKSTEP_FIELDS(Type, field1, field2, ...), written at
//     namespace scope in the namespace of Type (it is found by argument-dependent lookup);
//   - any nesting of the above.
// Anything else is a compile-time error that says what to do.
//
// For a class template, write the function LOCKSTEP_FIELDS would generate, once for all
// instantiations (found by argument-dependent lookup), e.g.
//   template <class T, class V> void lockstep_visit_fields(Layer<T>& x, V&& v) { v("w", x.w); }
//   template <class T, class V> void lockstep_visit_fields(const Layer<T>& x, V&& v) { v("w", x.w); }
//
// Leaf paths name a leaf for error messages and checkpoints: "w1", "layers[2].w",
// "heads.cls.b", "[0]" (a tuple's first element). A lone leaf at the root has path "".
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/tensor.hpp"

// ---- LOCKSTEP_FIELDS: a for-each over the macro arguments (C++20 __VA_OPT__ recursion) ----
#define LOCKSTEP_DETAIL_PARENS ()
#define LOCKSTEP_DETAIL_EXPAND(...) \
  LOCKSTEP_DETAIL_EXPAND3(LOCKSTEP_DETAIL_EXPAND3(LOCKSTEP_DETAIL_EXPAND3(LOCKSTEP_DETAIL_EXPAND3(__VA_ARGS__))))
#define LOCKSTEP_DETAIL_EXPAND3(...) \
  LOCKSTEP_DETAIL_EXPAND2(LOCKSTEP_DETAIL_EXPAND2(LOCKSTEP_DETAIL_EXPAND2(LOCKSTEP_DETAIL_EXPAND2(__VA_ARGS__))))
#define LOCKSTEP_DETAIL_EXPAND2(...) \
  LOCKSTEP_DETAIL_EXPAND1(LOCKSTEP_DETAIL_EXPAND1(LOCKSTEP_DETAIL_EXPAND1(LOCKSTEP_DETAIL_EXPAND1(__VA_ARGS__))))
#define LOCKSTEP_DETAIL_EXPAND1(...) __VA_ARGS__
#define LOCKSTEP_DETAIL_FOR_EACH(macro, ...) \
  __VA_OPT__(LOCKSTEP_DETAIL_EXPAND(LOCKSTEP_DETAIL_FOR_EACH_HELPER(macro, __VA_ARGS__)))
#define LOCKSTEP_DETAIL_FOR_EACH_HELPER(macro, a1, ...) \
  macro(a1) __VA_OPT__(LOCKSTEP_DETAIL_FOR_EACH_AGAIN LOCKSTEP_DETAIL_PARENS(macro, __VA_ARGS__))
#define LOCKSTEP_DETAIL_FOR_EACH_AGAIN() LOCKSTEP_DETAIL_FOR_EACH_HELPER
#define LOCKSTEP_DETAIL_VISIT_FIELD(f) lockstep_v(#f, lockstep_x.f);

/// Makes `Type` traversable by Lockstep (synchronize, optimizers, checkpoints), visiting the
/// listed members in order. Write it at namespace scope, in the namespace of `Type`:
///   struct Model { ls::Tensor w1, b1; std::vector<Layer> layers; };
///   LOCKSTEP_FIELDS(Model, w1, b1, layers)
/// Up to 256 fields.
#define LOCKSTEP_FIELDS(Type, ...)                                                      \
  template <class LockstepVisitor>                                                      \
  [[maybe_unused]] inline void lockstep_visit_fields(Type& lockstep_x,                  \
                                                     LockstepVisitor&& lockstep_v) {    \
    (void)lockstep_x;                                                                   \
    (void)lockstep_v;                                                                   \
    LOCKSTEP_DETAIL_FOR_EACH(LOCKSTEP_DETAIL_VISIT_FIELD, __VA_ARGS__)                  \
  }                                                                                     \
  template <class LockstepVisitor>                                                      \
  [[maybe_unused]] inline void lockstep_visit_fields(const Type& lockstep_x,            \
                                                     LockstepVisitor&& lockstep_v) {    \
    (void)lockstep_x;                                                                   \
    (void)lockstep_v;                                                                   \
    LOCKSTEP_DETAIL_FOR_EACH(LOCKSTEP_DETAIL_VISIT_FIELD, __VA_ARGS__)                  \
  }

/// LOCKSTEP_FIELDS for a class template: the template's parameters and the type, each in
/// parentheses (they may hold commas), then the fields:
///   template <class T, int N> struct Layer { T w; std::array<T, N> b; };
///   LOCKSTEP_TEMPLATE_FIELDS((class T, int N), (Layer<T, N>), w, b)
#define LOCKSTEP_DETAIL_UNPAREN(...) __VA_ARGS__
#define LOCKSTEP_TEMPLATE_FIELDS(Params, Type, ...)                                           \
  template <LOCKSTEP_DETAIL_UNPAREN Params, class LockstepVisitor>                            \
  [[maybe_unused]] inline void lockstep_visit_fields(LOCKSTEP_DETAIL_UNPAREN Type& lockstep_x, \
                                                     LockstepVisitor&& lockstep_v) {          \
    (void)lockstep_x;                                                                         \
    (void)lockstep_v;                                                                         \
    LOCKSTEP_DETAIL_FOR_EACH(LOCKSTEP_DETAIL_VISIT_FIELD, __VA_ARGS__)                        \
  }                                                                                           \
  template <LOCKSTEP_DETAIL_UNPAREN Params, class LockstepVisitor>                            \
  [[maybe_unused]] inline void lockstep_visit_fields(const LOCKSTEP_DETAIL_UNPAREN Type& lockstep_x, \
                                                     LockstepVisitor&& lockstep_v) {          \
    (void)lockstep_x;                                                                         \
    (void)lockstep_v;                                                                         \
    LOCKSTEP_DETAIL_FOR_EACH(LOCKSTEP_DETAIL_VISIT_FIELD, __VA_ARGS__)                        \
  }

namespace lockstep {

template <class X>
class Flat;

namespace detail {

template <class T>
inline constexpr bool always_false_v = false;

template <class T> struct is_flat : std::false_type {};
template <class X> struct is_flat<Flat<X>> : std::true_type {};

template <class T> struct is_std_vector : std::false_type {};
template <class T, class A> struct is_std_vector<std::vector<T, A>> : std::true_type {};
template <class T> struct is_std_array : std::false_type {};
template <class T, std::size_t N> struct is_std_array<std::array<T, N>> : std::true_type {};
template <class T> struct is_std_tuple : std::false_type {};
template <class... T> struct is_std_tuple<std::tuple<T...>> : std::true_type {};
template <class A, class B> struct is_std_tuple<std::pair<A, B>> : std::true_type {};
template <class T> struct is_std_map : std::false_type {};
template <class K, class V, class C, class A> struct is_std_map<std::map<K, V, C, A>> : std::true_type {};
template <class T> struct is_std_optional : std::false_type {};
template <class T> struct is_std_optional<std::optional<T>> : std::true_type {};

/// Accepts any field (used only to detect LOCKSTEP_FIELDS).
struct AnyFieldVisitor {
  template <class F>
  void operator()(const char*, F&&) const {}
};

template <class T>
concept HasLockstepFields = requires(T& x) { lockstep_visit_fields(x, AnyFieldVisitor{}); };

/// The path being built during a walk; appended to and truncated, so a walk allocates little.
class PathBuilder {
 public:
  const std::string& str() const noexcept { return s_; }
  std::size_t mark() const noexcept { return s_.size(); }
  void reset(std::size_t m) { s_.resize(m); }
  void field(const char* name) {
    if (!s_.empty()) s_ += '.';
    s_ += name;
  }
  void index(std::size_t i) {
    s_ += '[';
    s_ += std::to_string(i);
    s_ += ']';
  }
  // A map's key is a path segment like a field name ("heads.cls.w"), as Python's state_dict
  // and safetensors users index them.
  void key(const std::string& k) { field(k.c_str()); }

 private:
  std::string s_;
};

/// Walks x. `v` must have leaf(path, leaf&) and may have node(path, kind, size) which is called
/// for vectors ("vector"), maps ("map", with keys reported through key(path, key)), and
/// optionals ("optional", size 0 or 1) before their elements. Paths are built only when
/// kPaths is true (otherwise path is an empty string).
template <bool kPaths, class X, class V>
void walk(X& x, V& v, PathBuilder& path);

template <bool kPaths, class X, class V>
void walk_child_index(X& x, V& v, PathBuilder& path, std::size_t i) {
  if constexpr (kPaths) {
    const auto m = path.mark();
    path.index(i);
    walk<kPaths>(x, v, path);
    path.reset(m);
  } else {
    walk<kPaths>(x, v, path);
  }
}

template <bool kPaths, class V>
void report_node(V& v, const PathBuilder& path, const char* kind, std::size_t n) {
  if constexpr (requires { v.node(path.str(), kind, n); }) v.node(path.str(), kind, n);
}

template <bool kPaths, class X, class V>
void walk(X& x, V& v, PathBuilder& path) {
  using T = std::remove_cv_t<X>;
  if constexpr (std::is_same_v<T, Tensor> || std::is_arithmetic_v<T>) {
    v.leaf(path.str(), x);
  } else if constexpr (is_std_vector<T>::value) {
    report_node<kPaths>(v, path, "vector", x.size());
    for (std::size_t i = 0; i < x.size(); ++i) walk_child_index<kPaths>(x[i], v, path, i);
  } else if constexpr (is_std_array<T>::value) {
    for (std::size_t i = 0; i < x.size(); ++i) walk_child_index<kPaths>(x[i], v, path, i);
  } else if constexpr (is_std_tuple<T>::value) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (walk_child_index<kPaths>(std::get<I>(x), v, path, I), ...);
    }(std::make_index_sequence<std::tuple_size_v<T>>{});
  } else if constexpr (is_std_map<T>::value) {
    static_assert(std::is_same_v<typename T::key_type, std::string>,
                  "lockstep: only std::map<std::string, T> is traversable (keys name the leaves)");
    report_node<kPaths>(v, path, "map", x.size());
    for (auto& [k, val] : x) {
      // A requires parameter, not k: clang before 16 cannot name a structured binding there.
      if constexpr (requires(const std::string& key) { v.key(path.str(), key); }) v.key(path.str(), k);
      if constexpr (kPaths) {
        const auto m = path.mark();
        path.key(k);
        walk<kPaths>(val, v, path);
        path.reset(m);
      } else {
        walk<kPaths>(val, v, path);
      }
    }
  } else if constexpr (is_std_optional<T>::value) {
    report_node<kPaths>(v, path, "optional", x.has_value() ? 1 : 0);
    if (x.has_value()) walk<kPaths>(*x, v, path);
  } else if constexpr (is_flat<T>::value) {
    walk<kPaths>(x.get(), v, path);  // a Flat is walked as the structure it holds
  } else if constexpr (HasLockstepFields<T>) {
    if constexpr (requires { v.object(x); }) v.object(x);
    lockstep_visit_fields(x, [&](const char* name, auto& field) {
      if constexpr (kPaths) {
        const auto m = path.mark();
        path.field(name);
        walk<kPaths>(field, v, path);
        path.reset(m);
      } else {
        walk<kPaths>(field, v, path);
      }
    });
  } else {
    static_assert(always_false_v<T>,
                  "lockstep: this type is not traversable. Add LOCKSTEP_FIELDS(Type, field1, "
                  "field2, ...) after its definition, in its namespace; built in are Tensor, "
                  "arithmetic scalars, std::vector, std::array, std::tuple, std::pair, "
                  "std::map<std::string, T> and std::optional (see lockstep/traverse.hpp).");
  }
}

/// What a checkpoint is doing, told to the objects it walks (see checkpoint_phase).
enum class CheckpointPhase { before_save, before_load, after_load_ok, after };

/// Calls x.lockstep_checkpoint_phase(backend, root, phase) on every object with
/// LOCKSTEP_FIELDS reachable from x that has one (a sharded DistributedState gathers or
/// scatters its shards there), in traversal order.
template <class B>
struct CheckpointPhaseVisitor {
  B& backend;
  int root;
  CheckpointPhase phase;
  template <class L>
  void leaf(const std::string&, L&) {}
  template <class T>
  void object(T& o) {
    if constexpr (requires { o.lockstep_checkpoint_phase(backend, root, phase); })
      o.lockstep_checkpoint_phase(backend, root, phase);
  }
};
template <class B, class X>
void checkpoint_phase(B& backend, X& x, int root, CheckpointPhase phase) {
  CheckpointPhaseVisitor<B> v{backend, root, phase};
  PathBuilder path;
  walk<false>(x, v, path);
}

template <class F>
struct LeafVisitor {
  F& f;
  template <class L>
  void leaf(const std::string& path, L& l) {
    f(path, l);
  }
};

template <class F>
struct LeafVisitorNoPath {
  F& f;
  template <class L>
  void leaf(const std::string&, L& l) {
    f(l);
  }
};

}  // namespace detail

/// True if T is traversable (a leaf, a supported standard container of traversable types, or a
/// type with LOCKSTEP_FIELDS). A shallow check: container element types are checked when walked.
template <class T>
concept Traversable =
    std::is_same_v<std::remove_cvref_t<T>, Tensor> || std::is_arithmetic_v<std::remove_cvref_t<T>> ||
    detail::is_std_vector<std::remove_cvref_t<T>>::value ||
    detail::is_std_array<std::remove_cvref_t<T>>::value ||
    detail::is_std_tuple<std::remove_cvref_t<T>>::value ||
    detail::is_std_map<std::remove_cvref_t<T>>::value ||
    detail::is_std_optional<std::remove_cvref_t<T>>::value ||
    detail::is_flat<std::remove_cvref_t<T>>::value ||
    detail::HasLockstepFields<std::remove_cvref_t<T>>;

/// Calls f(path, leaf) for every leaf reachable from x, in traversal order; leaf is a Tensor& or
/// a reference to an arithmetic scalar (const if x is const). path is e.g. "layers[2].w".
/// This is what a checkpoint writer uses: f(const std::string& path, auto& leaf).
template <class X, class F>
void for_each_leaf_with_path(X&& x, F&& f) {
  detail::PathBuilder path;
  detail::LeafVisitor<std::remove_reference_t<F>> v{f};
  auto& ref = x;
  detail::walk<true>(ref, v, path);
}

/// Calls f(leaf) for every leaf reachable from x, in traversal order (no paths are built).
template <class X, class F>
void for_each_leaf(X&& x, F&& f) {
  detail::PathBuilder path;
  detail::LeafVisitorNoPath<std::remove_reference_t<F>> v{f};
  auto& ref = x;
  detail::walk<false>(ref, v, path);
}

/// Calls f(tensor) for every Tensor reachable from x (scalars are skipped).
template <class X, class F>
void for_each_tensor(X&& x, F&& f) {
  for_each_leaf(std::forward<X>(x), [&](auto& leaf) {
    if constexpr (std::is_same_v<std::remove_cv_t<std::remove_reference_t<decltype(leaf)>>, Tensor>)
      f(leaf);
  });
}

/// Pointers to every Tensor reachable from x, in traversal order.
template <class X>
[[nodiscard]] std::vector<Tensor*> tensor_leaves(X& x) {
  std::vector<Tensor*> out;
  for_each_tensor(x, [&](Tensor& t) { out.push_back(&t); });
  return out;
}
template <class X>
[[nodiscard]] std::vector<const Tensor*> tensor_leaves(const X& x) {
  std::vector<const Tensor*> out;
  for_each_tensor(x, [&](const Tensor& t) { out.push_back(&t); });
  return out;
}

/// Paths of every Tensor reachable from x, in the order of tensor_leaves.
template <class X>
[[nodiscard]] std::vector<std::string> tensor_paths(const X& x) {
  std::vector<std::string> out;
  for_each_leaf_with_path(x, [&](const std::string& p, auto& leaf) {
    if constexpr (std::is_same_v<std::remove_cv_t<std::remove_reference_t<decltype(leaf)>>, Tensor>)
      out.push_back(p);
  });
  return out;
}

/// Number of leaves (tensors and scalars) reachable from x.
template <class X>
[[nodiscard]] std::size_t leaf_count(const X& x) {
  std::size_t n = 0;
  for_each_leaf(x, [&](const auto&) { ++n; });
  return n;
}

namespace detail {
/// Builds dst with the structure of src: containers resized / keys inserted / optionals engaged,
/// and each tensor leaf of dst set to make(src_tensor); scalar leaves copied. Needs the
/// containers and structs to be default-constructible.
template <class X, class Make>
void build_like(const X& src, X& dst, Make& make) {
  using T = std::remove_cv_t<X>;
  if constexpr (std::is_same_v<T, Tensor>) {
    dst = make(src);
  } else if constexpr (std::is_arithmetic_v<T>) {
    dst = src;
  } else if constexpr (is_std_vector<T>::value) {
    dst.clear();
    dst.resize(src.size());
    for (std::size_t i = 0; i < src.size(); ++i) build_like(src[i], dst[i], make);
  } else if constexpr (is_std_array<T>::value) {
    for (std::size_t i = 0; i < src.size(); ++i) build_like(src[i], dst[i], make);
  } else if constexpr (is_std_tuple<T>::value) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (build_like(std::get<I>(src), std::get<I>(dst), make), ...);
    }(std::make_index_sequence<std::tuple_size_v<T>>{});
  } else if constexpr (is_std_map<T>::value) {
    dst.clear();
    for (auto& [k, val] : src) build_like(val, dst[k], make);
  } else if constexpr (is_std_optional<T>::value) {
    dst.reset();
    if (src.has_value()) {
      dst.emplace();
      build_like(*src, *dst, make);
    }
  } else if constexpr (HasLockstepFields<T>) {
    // Collect dst's field addresses, then visit src's fields in the same order.
    std::vector<void*> fields;
    lockstep_visit_fields(dst, [&](const char*, auto& f) { fields.push_back(&f); });
    std::size_t i = 0;
    lockstep_visit_fields(src, [&](const char*, const auto& f) {
      using F = std::remove_cvref_t<decltype(f)>;
      build_like(f, *static_cast<F*>(fields[i++]), make);
    });
  } else {
    static_assert(always_false_v<T>,
                  "lockstep: this type is not traversable. Add LOCKSTEP_FIELDS(Type, field1, "
                  "field2, ...) after its definition, in its namespace.");
  }
}
}  // namespace detail

/// A new structure like x whose tensors are zeros of the same shape, dtype and device (scalars
/// are copied). Each tensor is a separate allocation; see flat_zeros_like for one allocation.
template <class X>
[[nodiscard]] X zeros_like(const X& x) {
  static_assert(std::is_default_constructible_v<X>, "lockstep::zeros_like needs a default-constructible type");
  X out{};
  auto make = [](const Tensor& t) { return Tensor::zeros(t.shape(), t.dtype(), t.device()); };
  detail::build_like(x, out, make);
  return out;
}

/// A deep copy of x (tensors cloned, scalars copied).
template <class X>
[[nodiscard]] X clone_tree(const X& x) {
  static_assert(std::is_default_constructible_v<X>, "lockstep::clone_tree needs a default-constructible type");
  X out{};
  auto make = [](const Tensor& t) { return t.clone(); };
  detail::build_like(x, out, make);
  return out;
}

/// A structure of type X whose tensors all lie in a few flat allocations (one per dtype and
/// device, tensors back to back in traversal order). Such gradients are reduced by
/// DistributedOptimizer without any copy, and synchronize broadcasts them in place.
/// Each tensor of the structure shares its allocation and keeps it alive, so a tensor moved out
/// of a Flat stays valid after the Flat is gone. Movable (the allocations do not move); a
/// moved-from Flat holds no buffers and a moved-from X (whose tensors are empty); self-move
/// keeps it as it is. Not copyable. Traversable as the X it holds.
template <class X>
class Flat {
 public:
  Flat() = default;
  Flat(std::vector<Tensor> buffers, X value) : buffers_(std::move(buffers)), value_(std::move(value)) {}
  Flat(Flat&& other) noexcept : buffers_(std::move(other.buffers_)), value_(std::move(other.value_)) {
    other.buffers_.clear();
  }
  Flat& operator=(Flat&& other) noexcept {
    if (this != &other) {
      value_ = std::move(other.value_);  // the structure first, then the memory it lies in
      buffers_ = std::move(other.buffers_);
      other.buffers_.clear();
    }
    return *this;
  }
  Flat(const Flat&) = delete;
  Flat& operator=(const Flat&) = delete;

  X& get() noexcept { return value_; }
  const X& get() const noexcept { return value_; }
  X& operator*() noexcept { return value_; }
  const X& operator*() const noexcept { return value_; }
  X* operator->() noexcept { return &value_; }
  const X* operator->() const noexcept { return &value_; }
  /// The flat allocations (one per dtype/device), each a 1-D tensor.
  const std::vector<Tensor>& buffers() const noexcept { return buffers_; }
  std::vector<Tensor>& buffers() noexcept { return buffers_; }

 private:
  std::vector<Tensor> buffers_;
  X value_{};
};

namespace detail {
/// Plans one flat allocation per (dtype, device) for the tensors of x; returns the buffers and a
/// maker that hands out consecutive borrowed tensors.
struct FlatPlanner {
  struct Group {
    DType dtype;
    Device device;
    std::int64_t numel = 0;
    std::int64_t cursor = 0;
    std::size_t buffer = 0;
  };
  std::vector<Group> groups;
  std::vector<Tensor> buffers;

  Group& group_of(DType dt, Device dev) {
    for (auto& g : groups)
      if (g.dtype == dt && g.device == dev) return g;
    groups.push_back(Group{dt, dev});
    return groups.back();
  }
  void count(const Tensor& t) {
    auto& g = group_of(t.dtype(), t.device());
    // Each tensor's count is valid; their sum must be too (borrowed tensors can claim any size).
    LOCKSTEP_CHECK_ARG(t.numel() <= std::numeric_limits<std::int64_t>::max() - g.numel,
                       "flat allocation: the ", name(t.dtype()), " tensors on ", to_string(t.device()),
                       " hold more elements than an int64 can count");
    g.numel += t.numel();
  }
  void allocate() {
    allocate([](const Group& g) { return Tensor::zeros({g.numel}, g.dtype, g.device); });
  }
  /// Each group's buffer from `make(group)`: a zeroed 1-D tensor of group.numel elements.
  template <class Make>
  void allocate(Make&& make) {
    for (auto& g : groups) {
      g.buffer = buffers.size();
      buffers.push_back(make(static_cast<const Group&>(g)));
    }
  }
  /// The next t.numel() elements of t's buffer, shaped like t; shares (and keeps alive) the buffer.
  Tensor take(const Tensor& t) {
    auto& g = group_of(t.dtype(), t.device());
    Tensor view = buffers[g.buffer].slice_view(g.cursor, t.shape());
    g.cursor += t.numel();
    return view;
  }
};
}  // namespace detail

/// Like zeros_like(x), but all tensors lie back to back in one zeroed allocation per dtype and
/// device: the layout for gradients that DistributedOptimizer reduces without copying.
template <class X>
[[nodiscard]] Flat<X> flat_zeros_like(const X& x) {
  detail::FlatPlanner plan;
  for_each_tensor(x, [&](const Tensor& t) { plan.count(t); });
  plan.allocate();
  X out{};
  auto make = [&](const Tensor& t) { return plan.take(t); };
  detail::build_like(x, out, make);
  return Flat<X>(std::move(plan.buffers), std::move(out));
}

/// Like flat_zeros_like(x), but the tensors hold copies of x's values: parameters in one flat
/// allocation per dtype and device.
template <class X>
[[nodiscard]] Flat<X> flat_copy(const X& x) {
  detail::FlatPlanner plan;
  for_each_tensor(x, [&](const Tensor& t) { plan.count(t); });
  plan.allocate();
  X out{};
  auto make = [&](const Tensor& t) {
    Tensor b = plan.take(t);
    b.copy_from(t.view());
    return b;
  };
  detail::build_like(x, out, make);
  return Flat<X>(std::move(plan.buffers), std::move(out));
}

}  // namespace lockstep
