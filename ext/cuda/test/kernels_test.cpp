// lockstep::cuda on one GPU: cuda tensors and copies both ways, streams and events, and the
// kernels against the CPU arithmetic of optim_math.hpp. The kernels are compiled without FMA
// contraction (--fmad=false), so every comparison with the CPU here is bitwise.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "gpu_test_util.hpp"
#include "lockstep/cuda.hpp"
#include "lockstep/lockstep.hpp"

namespace ls = lockstep;
using ls::gpu_test::get;

namespace {

const ls::Device kDev = ls::Device::cuda(0);

// Sizes that cross the kernels' internal boundaries: empty, single, below one 16-byte vector,
// a prime, one past a 16384-element chunk, several chunks.
const std::vector<std::int64_t> kSizes = {0, 1, 3, 5, 17, 1031, 16385, 3 * 16384 + 7};

template <class T>
ls::Tensor random_host(std::int64_t n, std::uint32_t seed, double lo, double hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  ls::Tensor t = ls::Tensor::empty({n}, ls::dtype_of_v<T>);
  T* p = t.data<T>();
  for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(dist(gen));
  return t;
}

bool same_bytes(const ls::Tensor& device_or_host, const ls::Tensor& host) {
  ls::Tensor a = device_or_host.to(ls::Device::cpu());
  return a.nbytes() == host.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw_data(), host.raw_data(), a.nbytes()) == 0);
}

}  // namespace

TEST_CASE("cuda tensors: allocation, copies both ways, zero and full", "[cuda]") {
  for (ls::DType dt : {ls::DType::f32, ls::DType::f64, ls::DType::f16, ls::DType::bf16, ls::DType::i32,
                       ls::DType::u8}) {
    for (std::int64_t n : kSizes) {
      ls::Tensor h = ls::gpu_test::make_host(dt, n, [](std::int64_t i) { return static_cast<double>(i % 97); });
      ls::Tensor d = h.to(kDev);
      CHECK(d.device() == kDev);
      CHECK(d.numel() == n);
      ls::Tensor d2 = d.clone();  // device to device
      CHECK(same_bytes(d2, h));
      ls::Tensor back = d.to(ls::Device::cpu());
      CHECK(std::memcmp(back.raw_data(), h.raw_data(), h.nbytes()) == 0);
      ls::Tensor z = ls::Tensor::zeros({n}, dt, kDev);
      CHECK(same_bytes(z, ls::Tensor::zeros({n}, dt)));
      ls::Tensor f = ls::Tensor::full({n}, 3.0, dt, kDev);
      CHECK(same_bytes(f, ls::Tensor::full({n}, 3.0, dt)));
      d.zero_();
      CHECK(same_bytes(d, ls::Tensor::zeros({n}, dt)));
    }
  }
  CHECK(ls::cuda::device_count() >= 1);
}

TEST_CASE("cuda: sgd_update over many spans equals math::sgd_update bitwise", "[cuda][optim]") {
  struct Case {
    float momentum, dampening, weight_decay;
    bool nesterov;
  };
  for (Case k : {Case{0, 0, 0, false}, Case{0, 0, 0.01f, false}, Case{0.9f, 0, 0, false},
                 Case{0.9f, 0.1f, 0.001f, false}, Case{0.9f, 0, 0.01f, true}}) {
    std::vector<ls::Tensor> hp, hg, hb, dp, dg, db;
    for (std::size_t i = 0; i < kSizes.size(); ++i) {
      const std::int64_t n = kSizes[i];
      hp.push_back(random_host<float>(n, 10 + i, -1, 1));
      hg.push_back(random_host<float>(n, 20 + i, -1, 1));
      hb.push_back(ls::Tensor::zeros({k.momentum != 0 ? n : 0}));
      dp.push_back(hp.back().to(kDev));
      dg.push_back(hg.back().to(kDev));
      db.push_back(hb.back().to(kDev));
    }
    for (std::int64_t step = 1; step <= 3; ++step) {
      auto c = ls::math::sgd_coeffs<float>(0.05, k.momentum, k.dampening, k.weight_decay, k.nesterov, step);
      std::vector<ls::cuda::SgdSpan> spans;
      for (std::size_t i = 0; i < hp.size(); ++i) {
        ls::math::sgd_update(hp[i].data<float>(), hg[i].data<float>(),
                             k.momentum != 0 ? hb[i].data<float>() : nullptr, hp[i].numel(), c);
        spans.push_back({dp[i].view(), dg[i].view(), db[i].view()});
      }
      ls::cuda::sgd_update(spans, c);  // one launch for all spans
    }
    for (std::size_t i = 0; i < hp.size(); ++i) {
      INFO("size " << kSizes[i] << " momentum " << k.momentum << " nesterov " << k.nesterov);
      CHECK(same_bytes(dp[i], hp[i]));
      if (k.momentum != 0) CHECK(same_bytes(db[i], hb[i]));
    }
  }
}

TEST_CASE("cuda: adam_update (Adam and AdamW, f32 and f64) equals math::adam_update bitwise",
          "[cuda][optim]") {
  for (bool decoupled : {false, true}) {
    for (float wd : {0.0f, 0.01f}) {
      // f32 over many spans
      std::vector<ls::Tensor> hp, hg, hm, hv, dp, dg, dm, dv;
      for (std::size_t i = 0; i < kSizes.size(); ++i) {
        const std::int64_t n = kSizes[i];
        hp.push_back(random_host<float>(n, 30 + i, -1, 1));
        hg.push_back(random_host<float>(n, 40 + i, -1, 1));
        hm.push_back(ls::Tensor::zeros({n}));
        hv.push_back(ls::Tensor::zeros({n}));
        dp.push_back(hp.back().to(kDev));
        dg.push_back(hg.back().to(kDev));
        dm.push_back(hm.back().to(kDev));
        dv.push_back(hv.back().to(kDev));
      }
      for (std::int64_t step = 1; step <= 5; ++step) {
        auto c = ls::math::adam_coeffs<float>(1e-3, 0.9, 0.999, 1e-8, wd, decoupled, step);
        std::vector<ls::cuda::AdamSpan> spans;
        for (std::size_t i = 0; i < hp.size(); ++i) {
          ls::math::adam_update(hp[i].data<float>(), hg[i].data<float>(), hm[i].data<float>(),
                                hv[i].data<float>(), hp[i].numel(), c);
          spans.push_back({dp[i].view(), dg[i].view(), dm[i].view(), dv[i].view()});
        }
        ls::cuda::adam_update(spans, c);
      }
      for (std::size_t i = 0; i < hp.size(); ++i) {
        INFO("f32 size " << kSizes[i] << " decoupled " << decoupled << " wd " << wd);
        CHECK(same_bytes(dp[i], hp[i]));
        CHECK(same_bytes(dm[i], hm[i]));
        CHECK(same_bytes(dv[i], hv[i]));
      }
      // f64, one contiguous span
      const std::int64_t n = 40001;
      ls::Tensor p = random_host<double>(n, 50, -1, 1), g = random_host<double>(n, 51, -1, 1);
      ls::Tensor m = ls::Tensor::zeros({n}, ls::DType::f64), v = ls::Tensor::zeros({n}, ls::DType::f64);
      ls::Tensor P = p.to(kDev), G = g.to(kDev), M = m.to(kDev), V = v.to(kDev);
      for (std::int64_t step = 1; step <= 3; ++step) {
        auto c = ls::math::adam_coeffs<double>(1e-3, 0.9, 0.999, 1e-8, wd, decoupled, step);
        ls::math::adam_update(p.data<double>(), g.data<double>(), m.data<double>(), v.data<double>(), n, c);
        const ls::cuda::AdamSpan span{P.view(), G.view(), M.view(), V.view()};
        ls::cuda::adam_update({&span, 1}, c);
      }
      CHECK(same_bytes(P, p));
      CHECK(same_bytes(V, v));
    }
  }
}

TEST_CASE("cuda: misaligned spans take the scalar path and still match", "[cuda][optim]") {
  // Views starting one element into a buffer are 4-byte but not 16-byte aligned.
  const std::int64_t n = 5000;
  ls::Tensor hp = random_host<float>(n + 1, 60, -1, 1), hg = random_host<float>(n + 1, 61, -1, 1);
  ls::Tensor hm = ls::Tensor::zeros({n + 1}), hv = ls::Tensor::zeros({n + 1});
  ls::Tensor dp = hp.to(kDev), dg = hg.to(kDev), dm = hm.to(kDev), dv = hv.to(kDev);
  auto c = ls::math::adam_coeffs<float>(1e-2, 0.9, 0.99, 1e-8, 0.0, false, 1);
  ls::math::adam_update(hp.data<float>() + 1, hg.data<float>() + 1, hm.data<float>() + 1,
                        hv.data<float>() + 1, n, c);
  const ls::cuda::AdamSpan span{dp.view().slice(1, n), dg.view().slice(1, n), dm.view().slice(1, n),
                                dv.view().slice(1, n)};
  ls::cuda::adam_update({&span, 1}, c);
  CHECK(same_bytes(dp, hp));
  CHECK(same_bytes(dv, hv));
}

TEST_CASE("cuda: scale and divide equal the host arithmetic", "[cuda]") {
  for (std::int64_t n : kSizes) {
    ls::Tensor h = random_host<float>(n, 70, -100, 100);
    ls::Tensor d = h.to(kDev);
    ls::cuda::divide(d.view(), 3.0);
    ls::cuda::scale(d.view(), 0.5);
    for (std::int64_t i = 0; i < n; ++i) h.data<float>()[i] = h.data<float>()[i] / 3.0f * 0.5f;
    CHECK(same_bytes(d, h));

    for (ls::DType dt : {ls::DType::f16, ls::DType::bf16, ls::DType::f64}) {
      ls::Tensor h16 = ls::gpu_test::make_host(dt, n, [](std::int64_t i) { return (i % 41) - 20.0; });
      ls::Tensor d16 = h16.to(kDev);
      ls::cuda::divide(d16.view(), 3.0);
      for (std::int64_t i = 0; i < n; ++i) {
        if (dt == ls::DType::f64)
          ls::gpu_test::set(h16, i, get(h16, i) / 3.0);
        else  // float arithmetic, rounded back to nearest even, as the host's avg does
          ls::gpu_test::set(h16, i, static_cast<float>(get(h16, i)) / 3.0f);
      }
      INFO(ls::name(dt) << " n " << n);
      CHECK(same_bytes(d16, h16));
    }
  }
  ls::Tensor host = ls::Tensor::zeros({4});
  CHECK_THROWS_AS(ls::cuda::scale(host.view(), 2.0), ls::InvalidArgument);
  ls::Tensor ints = ls::Tensor::zeros({4}, ls::DType::i32, kDev);
  CHECK_THROWS_AS(ls::cuda::scale(ints.view(), 2.0), ls::InvalidArgument);
}

TEST_CASE("cuda: convert_many rounds f32 to bf16 and f16 and back bitwise as the host", "[cuda][wire]") {
  // DeviceRuntime::convert_many (the multi_convert kernel), two regions per call, against
  // lockstep::to_bfloat16 / to_half (round to nearest even) and the division in f32.
  ls::DeviceRuntime& rt = ls::device_runtime("kernels_test");
  for (ls::DType dt : {ls::DType::bf16, ls::DType::f16}) {
    for (std::int64_t n : kSizes) {
      ls::Tensor h = random_host<float>(n, 90, -1000, 1000);
      ls::Tensor d = h.to(kDev), w = ls::Tensor::zeros({n}, dt, kDev), back = ls::Tensor::zeros({n}, ls::DType::f32, kDev);
      const std::int64_t half_n = n / 2;
      auto* dw = static_cast<std::uint16_t*>(w.raw_data());
      auto* db = static_cast<float*>(back.raw_data());
      const auto* dd = static_cast<const float*>(d.raw_data());
      const ls::DeviceConvert to[2] = {{dw, dd, half_n}, {dw + half_n, dd + half_n, n - half_n}};
      const ls::DeviceConvert from[2] = {{db, dw, half_n}, {db + half_n, dw + half_n, n - half_n}};
      rt.convert_many(to, ls::DType::f32, dt, 1.0f, 0);
      rt.convert_many(from, dt, ls::DType::f32, 3.0f, 0);
      ls::Tensor hw = ls::Tensor::zeros({n}, dt), hb = ls::Tensor::zeros({n});
      for (std::int64_t i = 0; i < n; ++i) {
        const float x = h.data<float>()[i];
        const std::uint16_t bits = dt == ls::DType::bf16 ? ls::to_bfloat16(x).bits : ls::to_half(x).bits;
        static_cast<std::uint16_t*>(hw.raw_data())[i] = bits;
        hb.data<float>()[i] =
            (dt == ls::DType::bf16 ? ls::to_float(ls::bfloat16{bits}) : ls::to_float(ls::half{bits})) / 3.0f;
      }
      INFO(ls::name(dt) << " n " << n);
      CHECK(same_bytes(w, hw));
      CHECK(same_bytes(back, hb));
    }
  }
}

TEST_CASE("cuda: pack and unpack gradient buckets", "[cuda][bucket]") {
  for (ls::DType dt : {ls::DType::f32, ls::DType::f16, ls::DType::u8, ls::DType::f64}) {
    std::vector<ls::Tensor> host, dev;
    std::int64_t total = 0;
    for (std::int64_t n : kSizes) {
      host.push_back(ls::gpu_test::make_host(dt, n, [n](std::int64_t i) { return static_cast<double>((i + n) % 101); }));
      dev.push_back(host.back().to(kDev));
      total += n;
    }
    const std::int64_t offset = 3;  // an odd offset makes the copies unaligned
    ls::Tensor bucket = ls::Tensor::zeros({total + offset + 2}, dt, kDev);
    std::vector<ls::TensorView> views;
    for (auto& t : dev) views.push_back(t.view());
    ls::cuda::pack(views, bucket.view(), offset);
    ls::Tensor hb = bucket.to(ls::Device::cpu());
    bool packed_ok = true;
    std::int64_t at = offset;
    for (auto& h : host) {
      packed_ok = packed_ok && std::memcmp(static_cast<char*>(hb.raw_data()) + at * ls::size_of(dt),
                                           h.raw_data(), h.nbytes()) == 0;
      at += h.numel();
    }
    INFO(ls::name(dt));
    CHECK(packed_ok);
    for (auto& t : dev) t.zero_();
    ls::cuda::unpack(bucket.view(), views, offset);
    for (std::size_t i = 0; i < dev.size(); ++i) CHECK(same_bytes(dev[i], host[i]));
  }
  ls::Tensor small = ls::Tensor::zeros({4}, ls::DType::f32, kDev);
  ls::Tensor big = ls::Tensor::zeros({8}, ls::DType::f32, kDev);
  std::vector<ls::TensorView> too_much = {big.view()};
  CHECK_THROWS_AS(ls::cuda::pack(too_much, small.view()), ls::InvalidArgument);
  ls::Tensor other = ls::Tensor::zeros({2}, ls::DType::f64, kDev);
  std::vector<ls::TensorView> wrong_dtype = {other.view()};
  CHECK_THROWS_AS(ls::cuda::pack(wrong_dtype, big.view()), ls::InvalidArgument);
}

TEST_CASE("cuda: streams, events and StreamGuard order the work", "[cuda][stream]") {
  ls::cuda::Stream s = ls::cuda::Stream::create(0);
  CHECK(s.owned());
  const std::int64_t n = 1 << 20;
  ls::Tensor h = random_host<float>(n, 80, -1, 1);
  ls::Tensor d = h.to(kDev);
  ls::cuda::Event start = ls::cuda::Event::create(0, true), stop = ls::cuda::Event::create(0, true);
  {
    ls::cuda::StreamGuard guard(s);
    CHECK(ls::cuda::current_stream(0) == s.get());
    start.record(s.get());
    ls::cuda::scale(d.view(), 2.0);  // on s, through the guard
    ls::cuda::scale(d.view(), 0.25, s.get());
    stop.record(s.get());
    ls::Tensor back = d.to(ls::Device::cpu());  // the copy runs on s too, after the kernels
    for (std::int64_t i = 0; i < n; ++i) h.data<float>()[i] = h.data<float>()[i] * 2.0f * 0.25f;
    CHECK(std::memcmp(back.raw_data(), h.raw_data(), h.nbytes()) == 0);
  }
  CHECK(ls::cuda::current_stream(0) == cudaStreamLegacy);
  stop.synchronize();
  CHECK(stop.query());
  CHECK(stop.elapsed_ms_since(start) >= 0.0f);
  ls::cuda::Stream moved = std::move(s);
  CHECK(moved.owned());
  CHECK_FALSE(s.owned());  // NOLINT: moved-from is empty and frees nothing
  ls::cuda::Stream borrowed = ls::cuda::Stream::borrow(moved.get(), 0);
  CHECK_FALSE(borrowed.owned());
}


TEST_CASE("cuda: the SGD and Adam rules run on cuda parameters, bitwise as on the host",
          "[cuda][optim]") {
  const std::int64_t n = 20000;
  for (int which = 0; which < 3; ++which) {
    ls::Tensor hp = random_host<float>(n, 90, -1, 1), hg = random_host<float>(n, 91, -1, 1);
    ls::Tensor dp = hp.to(kDev), dg = hg.to(kDev);
    auto run = [&](const auto& rule) {
      auto hs = rule.init(hp);
      auto ds = rule.init(dp);
      for (std::int64_t step = 1; step <= 4; ++step) {
        rule.apply(hs, hp, hg, step);
        rule.apply(ds, dp, dg, step);
      }
    };
    if (which == 0) run(ls::SGD{.lr = 0.1f, .momentum = 0.9f, .nesterov = true});
    if (which == 1) run(ls::Adam{.lr = 1e-2f});
    if (which == 2) run(ls::AdamW(1e-2f, 0.1f));
    INFO("rule " << which);
    CHECK(same_bytes(dp, hp));
  }
}
