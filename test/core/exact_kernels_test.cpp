// Unit tests of deterministic mode's fused exact-sum kernel (src/core/exact_sum_kernels.hpp):
// every instruction-set form this CPU has (baseline, AVX2, AVX-512) gives, bit for bit, what the
// int64 path's separate passes give (fold each value into an int64 at its block's window, sum the
// words, convert once), on values chosen to reach every branch: zeros of both signs, subnormals,
// values 2^40 below their block's top (truncated), NaN and infinity, whole and partial blocks,
// 1 to 32 sources, power-of-two divisors and others. One process, no MPI.
// Usage: test_exact_kernels baseline|avx2|avx512   (exit 0 passed, 1 failed, 77 skipped: this
// CPU lacks the instruction set; CTest runs one test per form)
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <random>
#include <string>
#include <vector>

#include "core/exact_sum_kernels.hpp"

namespace ex = lockstep::detail::exact;

namespace {

// The int64 path's result for n elements of `sources` sources (u[p][k]): the reference.
std::vector<float> int64_reference(const std::vector<const std::uint32_t*>& u, std::int64_t n,
                                   const std::uint8_t* block_top, double divisor) {
  std::vector<float> out(static_cast<std::size_t>(n));
  std::vector<std::int64_t> fold(static_cast<std::size_t>(ex::kBlock)), sum(static_cast<std::size_t>(ex::kBlock));
  for (std::int64_t at = 0; at < n; at += ex::kBlock) {
    const std::int64_t len = std::min(ex::kBlock, n - at);
    std::uint8_t bt = 0;
    if (block_top != nullptr) {
      bt = block_top[at / ex::kBlock];
    } else {
      std::uint32_t mx = 0;
      for (const std::uint32_t* src : u) mx = std::max(mx, ex::max_magnitude(src + at, len));
      bt = ex::top_of_magnitude(mx);
    }
    if (bt == 0 || bt == 255) {
      std::fill(out.begin() + at, out.begin() + at + len, bt == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    const int low = ((bt - 1) - ex::kBins + 1) * ex::kBinBits;
    std::fill(sum.begin(), sum.end(), 0);
    for (const std::uint32_t* src : u) {
      ex::fold_values(src + at, len, low, fold.data());
      for (std::int64_t k = 0; k < len; ++k) sum[static_cast<std::size_t>(k)] += fold[static_cast<std::size_t>(k)];
    }
    ex::to_f32(sum.data(), len, std::ldexp(1.0, low - 149), divisor, out.data() + at);
  }
  return out;
}

// Values of every kind, a block at a time: each block draws a top exponent and spreads its
// values below it (some far below: truncated), with zeros, subnormals and the odd non-finite.
std::vector<float> values(std::mt19937& gen, std::int64_t n, bool non_finite) {
  std::uniform_int_distribution<int> top_exp(-149, 127), below(0, 60), kind(0, 99), sign(0, 1);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::vector<float> x(static_cast<std::size_t>(n));
  int top = 0;
  for (std::int64_t k = 0; k < n; ++k) {
    if (k % ex::kBlock == 0) top = top_exp(gen);
    const int c = kind(gen);
    float v;
    if (c < 5) v = 0.0f;
    else if (c < 8) v = -0.0f;
    else if (c < 12) v = std::bit_cast<float>(static_cast<std::uint32_t>(gen() & 0x7fffffu));  // subnormal
    else if (non_finite && c == 12) v = std::numeric_limits<float>::infinity();
    else if (non_finite && c == 13) v = std::numeric_limits<float>::quiet_NaN();
    else v = std::ldexp(mant(gen), std::max(-149, top - below(gen)));
    x[static_cast<std::size_t>(k)] = sign(gen) != 0 ? -v : v;
  }
  return x;
}

std::string isa_name(ex::FusedIsa isa) {
  switch (isa) {
    case ex::FusedIsa::baseline: return "baseline";
    case ex::FusedIsa::avx2: return "AVX2";
    case ex::FusedIsa::avx512: return "AVX-512";
  }
  return "?";
}

}  // namespace

int main(int argc, char** argv) {
  const std::string want_isa = argc == 2 ? argv[1] : "";
  ex::FusedIsa isa;
  if (want_isa == "baseline") isa = ex::FusedIsa::baseline;
  else if (want_isa == "avx2") isa = ex::FusedIsa::avx2;
  else if (want_isa == "avx512") isa = ex::FusedIsa::avx512;
  else {
    std::cerr << "usage: test_exact_kernels baseline|avx2|avx512\n";
    return 2;
  }
  int failures = 0;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) {
      ++failures;
      std::cerr << "FAILED: " << what << "\n";
    }
  };
  // Refusals: a count of sources out of range; a form the CPU lacks.
  {
    float x[4] = {1, 2, 3, 4}, out[4];
    const std::uint32_t* u[1] = {reinterpret_cast<const std::uint32_t*>(x)};
    auto throws = [&](ex::FusedIsa i, int sources) {
      try {
        ex::fold_sum_to_f32_on(i, u, sources, 4, nullptr, 1.0, out);
      } catch (const std::invalid_argument&) {
        return true;
      }
      return false;
    };
    check(throws(ex::FusedIsa::baseline, 0), "0 sources refused");
    check(throws(ex::FusedIsa::baseline, ex::kMaxFusedSources + 1), "33 sources refused");
    if (!ex::fused_isa_available(isa)) {
      check(throws(isa, 1), isa_name(isa) + " refused where the CPU lacks it");
      if (failures != 0) return 1;
      std::cout << "skipped: this CPU has no " << isa_name(isa) << "\n";
      return 77;
    }
  }
  std::mt19937 gen(20261205);
  int checked = 0;
  for (const int sources : {1, 2, 3, 4, 5, 7, 8, 9, 16, 32}) {
    for (const std::int64_t n : {std::int64_t{1}, std::int64_t{63}, std::int64_t{64}, std::int64_t{65},
                                 std::int64_t{64 * 37 + 21}}) {
      for (const double divisor : {1.0, 2.0, 3.0, 8.0, 6.0, static_cast<double>(sources)}) {
        for (const bool given_tops : {false, true}) {
          const bool non_finite = (checked % 3) == 0;
          std::vector<std::vector<float>> data;
          std::vector<const std::uint32_t*> u;
          for (int p = 0; p < sources; ++p) data.push_back(values(gen, n, non_finite));
          for (const auto& d : data) u.push_back(reinterpret_cast<const std::uint32_t*>(d.data()));
          // Given tops: each block's max over the sources, raised by one bin now and then (a
          // window above the block's own values, as when other ranks' values were larger).
          std::vector<std::uint8_t> tops;
          if (given_tops) {
            for (std::int64_t at = 0; at < n; at += ex::kBlock) {
              std::uint32_t mx = 0;
              for (const std::uint32_t* src : u)
                mx = std::max(mx, ex::max_magnitude(src + at, std::min(ex::kBlock, n - at)));
              std::uint8_t t = ex::top_of_magnitude(mx);
              if (t != 0 && t < 24 && gen() % 4 == 0) ++t;
              tops.push_back(t);
            }
          }
          const std::uint8_t* tp = given_tops ? tops.data() : nullptr;
          const std::vector<float> want = int64_reference(u, n, tp, divisor);
          std::vector<float> got(static_cast<std::size_t>(n), 42.0f);
          ex::fold_sum_to_f32_on(isa, u.data(), sources, n, tp, divisor, got.data());
          for (std::int64_t k = 0; k < n; ++k) {
            const auto w = std::bit_cast<std::uint32_t>(want[static_cast<std::size_t>(k)]);
            const auto g = std::bit_cast<std::uint32_t>(got[static_cast<std::size_t>(k)]);
            if (w != g) {
              char msg[200];
              std::snprintf(msg, sizeof msg, "%s: element %lld of %lld, %d sources, divisor %g%s: bits 0x%08x, int64 path 0x%08x",
                            isa_name(isa).c_str(), static_cast<long long>(k), static_cast<long long>(n), sources, divisor,
                            given_tops ? ", given tops" : "", g, w);
              check(false, msg);
              break;
            }
          }
          ++checked;
        }
      }
    }
  }
  check(checked == 10 * 5 * 6 * 2, "every case ran");
  std::cout << isa_name(isa) << ": " << checked << " cases against the int64 path, " << failures << " failed\n";
  return failures == 0 ? 0 : 1;
}
