// Helpers of the training tests: a small two-layer perceptron with a hand-written backward, a
// deterministic synthetic batch, cross-rank agreement checks, and comparison helpers.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lockstep/lockstep.hpp"
#include "test_support.hpp"  // all_ranks, ForwardingBackend

namespace lstest {

namespace ls = lockstep;

/// y = tanh(x w1 + b1) w2 + b2; x [n, in], w1 [in, hidden], w2 [hidden, out].
struct Mlp {
  ls::Tensor w1, b1, w2, b2;
};
LOCKSTEP_FIELDS(Mlp, w1, b1, w2, b2)

inline constexpr int kIn = 5, kHidden = 7, kOut = 3;

/// A value in [-1, 1) from a few integers (the same on every rank and platform).
inline double noise(std::uint64_t a, std::uint64_t b, std::uint64_t c = 0) {
  std::uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
                    (c + 17) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  z *= 0xD6E8FEB86659FD93ull;
  z ^= z >> 32;
  return static_cast<double>(z >> 11) / static_cast<double>(1ull << 52) - 1.0;
}

/// Parameters from a seed (scaled like a common initialisation).
inline Mlp make_mlp(std::uint64_t seed) {
  Mlp m;
  m.w1 = ls::Tensor::zeros({kIn, kHidden});
  m.b1 = ls::Tensor::zeros({kHidden});
  m.w2 = ls::Tensor::zeros({kHidden, kOut});
  m.b2 = ls::Tensor::zeros({kOut});
  std::uint64_t k = 0;
  for (auto* t : {&m.w1, &m.b1, &m.w2, &m.b2}) {
    ++k;
    for (auto& v : t->span<float>()) v = static_cast<float>(0.5 * noise(seed, k, &v - t->data<float>()));
  }
  return m;
}

/// The global batch of a step: inputs x [n, kIn] and targets t [n, kOut].
struct Batch {
  std::vector<float> x, t;
  int n = 0;
};
inline Batch make_batch(int step, int n) {
  Batch b;
  b.n = n;
  b.x.resize(static_cast<std::size_t>(n) * kIn);
  b.t.resize(static_cast<std::size_t>(n) * kOut);
  for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] = static_cast<float>(noise(1000 + step, i, 1));
  for (std::size_t i = 0; i < b.t.size(); ++i) b.t[i] = static_cast<float>(noise(2000 + step, i, 2));
  return b;
}

/// Adds scale * dL/dparams to g, L = 0.5 * sum over rows [first, first + count) of ||y - t||^2.
/// Calls ready(tensor) for each gradient as soon as it is final, in backward order (b2, w2, b1,
/// w1), as an autograd engine would. Returns L (unscaled) over those rows.
inline double backward(const Mlp& m, const Batch& b, int first, int count, Mlp& g, double scale,
                       const std::function<void(ls::Tensor&)>& ready = {}) {
  const float* w1 = m.w1.data<float>();
  const float* b1 = m.b1.data<float>();
  const float* w2 = m.w2.data<float>();
  const float* b2 = m.b2.data<float>();
  std::vector<double> h(static_cast<std::size_t>(count) * kHidden);
  std::vector<double> dy(static_cast<std::size_t>(count) * kOut);
  double loss = 0;
  for (int r = 0; r < count; ++r) {
    const float* x = &b.x[static_cast<std::size_t>(first + r) * kIn];
    const float* t = &b.t[static_cast<std::size_t>(first + r) * kOut];
    for (int j = 0; j < kHidden; ++j) {
      double a = b1[j];
      for (int i = 0; i < kIn; ++i) a += static_cast<double>(x[i]) * w1[i * kHidden + j];
      h[static_cast<std::size_t>(r) * kHidden + j] = std::tanh(a);
    }
    for (int o = 0; o < kOut; ++o) {
      double y = b2[o];
      for (int j = 0; j < kHidden; ++j) y += h[static_cast<std::size_t>(r) * kHidden + j] * w2[j * kOut + o];
      const double d = y - t[o];
      loss += 0.5 * d * d;
      dy[static_cast<std::size_t>(r) * kOut + o] = d;
    }
  }
  float* gb2 = g.b2.data<float>();
  float* gw2 = g.w2.data<float>();
  float* gb1 = g.b1.data<float>();
  float* gw1 = g.w1.data<float>();
  for (int o = 0; o < kOut; ++o) {
    double s = 0;
    for (int r = 0; r < count; ++r) s += dy[static_cast<std::size_t>(r) * kOut + o];
    gb2[o] += static_cast<float>(scale * s);
  }
  if (ready) ready(g.b2);
  for (int j = 0; j < kHidden; ++j)
    for (int o = 0; o < kOut; ++o) {
      double s = 0;
      for (int r = 0; r < count; ++r)
        s += h[static_cast<std::size_t>(r) * kHidden + j] * dy[static_cast<std::size_t>(r) * kOut + o];
      gw2[j * kOut + o] += static_cast<float>(scale * s);
    }
  if (ready) ready(g.w2);
  std::vector<double> da(static_cast<std::size_t>(count) * kHidden);
  for (int r = 0; r < count; ++r)
    for (int j = 0; j < kHidden; ++j) {
      double s = 0;
      for (int o = 0; o < kOut; ++o) s += dy[static_cast<std::size_t>(r) * kOut + o] * w2[j * kOut + o];
      const double hv = h[static_cast<std::size_t>(r) * kHidden + j];
      da[static_cast<std::size_t>(r) * kHidden + j] = s * (1 - hv * hv);
    }
  for (int j = 0; j < kHidden; ++j) {
    double s = 0;
    for (int r = 0; r < count; ++r) s += da[static_cast<std::size_t>(r) * kHidden + j];
    gb1[j] += static_cast<float>(scale * s);
  }
  if (ready) ready(g.b1);
  for (int i = 0; i < kIn; ++i)
    for (int j = 0; j < kHidden; ++j) {
      double s = 0;
      for (int r = 0; r < count; ++r)
        s += static_cast<double>(b.x[static_cast<std::size_t>(first + r) * kIn + i]) *
             da[static_cast<std::size_t>(r) * kHidden + j];
      gw1[i * kHidden + j] += static_cast<float>(scale * s);
    }
  if (ready) ready(g.w1);
  return loss;
}

/// Sets every tensor of x to zero.
template <class X>
void zero_grads(X& x) {
  ls::for_each_tensor(x, [](ls::Tensor& t) { t.zero_(); });
}

/// Largest |a - b| / max(|b|) over each pair of tensors (norm-wise relative difference).
template <class X>
double max_rel_diff(const X& a, const X& b) {
  std::vector<const ls::Tensor*> ta = ls::tensor_leaves(a);
  std::vector<const ls::Tensor*> tb = ls::tensor_leaves(b);
  double worst = 0;
  for (std::size_t k = 0; k < ta.size(); ++k) {
    double diff = 0, scale = 1e-30;
    for (std::int64_t i = 0; i < ta[k]->numel(); ++i) {
      const double x = ta[k]->data<float>()[i], y = tb[k]->data<float>()[i];
      diff = std::max(diff, std::abs(x - y));
      scale = std::max(scale, std::abs(y));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

/// Hash of the bytes of every leaf of x.
template <class X>
std::uint64_t content_hash(const X& x) {
  std::uint64_t h = 0;
  ls::for_each_leaf(x, [&](const auto& leaf) {
    using L = std::remove_cvref_t<decltype(leaf)>;
    if constexpr (std::is_same_v<L, ls::Tensor>)
      h = ls::detail::hash_bytes(leaf.raw_data(), leaf.nbytes(), h);
    else
      h = ls::detail::hash_bytes(&leaf, sizeof(L), h);
  });
  return h;
}

/// True on every rank if every rank has the same value v.
inline bool same_on_all_ranks(ls::Backend& b, std::uint64_t v) {
  std::vector<std::uint64_t> all(static_cast<std::size_t>(b.size()));
  b.allgather(ls::TensorView{&v, 1, ls::DType::i64, ls::Device::cpu()},
              ls::TensorView{all.data(), b.size(), ls::DType::i64, ls::Device::cpu()});
  for (auto x : all)
    if (x != all[0]) return false;
  return true;
}


}  // namespace lstest

namespace lstest {

/// A Backend that forwards to a real one and counts the collectives issued through it (to
/// check that synchronize and DistributedOptimizer use few large messages).
class CountingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  int broadcasts = 0, allreduces = 0, allgathers = 0, other = 0;
  std::int64_t largest_bytes = 0;
  void reset() { broadcasts = allreduces = allgathers = other = 0; largest_bytes = 0; }

 protected:
  void on_call(Call call, const ls::TensorView& result) override {
    switch (call) {
      case Call::broadcast:
      case Call::ibroadcast: note(broadcasts, result); break;
      case Call::allreduce:
      case Call::iallreduce: note(allreduces, result); break;
      case Call::allgather: note(allgathers, result); break;
      default: ++other; break;  // reduce, reduce_scatter, barrier
    }
  }
  void abandon(const CallInfo& call, const std::exception& e) override { forward_abandon(inner(), call, e); }

 private:
  void note(int& counter, const ls::TensorView& v) {
    ++counter;
    largest_bytes = std::max<std::int64_t>(largest_bytes, static_cast<std::int64_t>(v.nbytes()));
  }
};

}  // namespace lstest
