// What the remote tests (test/remote/) share: the backend and the rank, a clock, the tensor
// patterns that show a tensor arrived whole and unmixed, an exception described by its kind, a
// session's close timed, the engine's test hooks (src/remote/test_hooks.hpp, not installed), and
// the failure count of the programs that run without Catch.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <iostream>
#include <string>
#include <thread>

#include "../../src/remote/test_hooks.hpp"
#include "lockstep/lockstep.hpp"

namespace remote_test {

namespace ls = lockstep;
using Clock = std::chrono::steady_clock;

inline ls::Backend& backend() { return ls::get_distributed_backend<ls::MPIBackend>(); }
inline int me() { return ls::world_info().rank; }
inline int world() { return ls::world_info().size; }
inline double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
inline void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

// The pattern of one call's tensor: distinct for every seed (a shift of one sequence modulo a
// prime), exact in f32 (below 2^20, so that adding a small integer stays exact).
constexpr std::uint64_t kMod = 999983;
inline float pat(std::uint64_t seed, std::int64_t i) {
  return static_cast<float>((seed * 7919u + static_cast<std::uint64_t>(i)) % kMod);
}
inline ls::Tensor make(std::int64_t numel, std::uint64_t seed) {
  ls::Tensor t({numel});
  float* p = t.data<float>();
  for (std::int64_t i = 0; i < numel; ++i) p[i] = pat(seed, i);
  return t;
}
// The elements of t that are not pat(seed, i) + k (every one when t is not numel f32 elements).
inline long bad_elems(const ls::Tensor& t, std::int64_t numel, std::uint64_t seed, float k) {
  if (t.numel() != numel || t.dtype() != ls::DType::f32 || t.ndim() != 1) return numel > 0 ? static_cast<long>(numel) : 1;
  const float* p = t.data<float>();
  long bad = 0;
  for (std::int64_t i = 0; i < numel; ++i) bad += p[i] != pat(seed, i) + k;
  return bad;
}

// "TimeoutError: <what>", "RemoteError: ...", "InvalidArgument: ...", "Error: ...",
// "std::exception: ..." or "unknown exception".
inline std::string describe(const std::exception_ptr& ep) {
  try {
    std::rethrow_exception(ep);
  } catch (const ls::TimeoutError& e) {
    return std::string("TimeoutError: ") + e.what();
  } catch (const ls::RemoteError& e) {
    return std::string("RemoteError: ") + e.what();
  } catch (const ls::InvalidArgument& e) {
    return std::string("InvalidArgument: ") + e.what();
  } catch (const ls::Error& e) {
    return std::string("Error: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("std::exception: ") + e.what();
  } catch (...) {
    return "unknown exception";
  }
}

/// Closes the session: what it threw (described, empty when nothing) and how long it took.
struct Closed {
  std::string error;
  double seconds;
};
inline Closed close_session(ls::RemoteSession& s) {
  const auto t0 = Clock::now();
  std::string error;
  try {
    s.close();
  } catch (...) {
    error = describe(std::current_exception());
  }
  return Closed{error, since(t0)};
}

/// For the remote programs that run without Catch (remote_stall.cpp, remote_thread_level.cpp):
/// each failure counted and printed with this rank, main's verdict from the count.
namespace program {
inline int g_rank = 0;
inline int g_failures = 0;
inline void check(bool ok, const std::string& what) {
  if (!ok) {
    ++g_failures;
    std::cerr << "[rank " << g_rank << "] FAIL: " << what << std::endl;
  }
}
inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace program

}  // namespace remote_test
