// A DeviceRuntime over guarded host memory, for tests of device paths on a machine without a
// GPU (test/core/device_seam_test.cpp, test/remote/remote_device_test.cpp).
//
// Every "device" allocation is its own mmap region, kept PROT_NONE except while the runtime
// itself copies or zeroes it (as a GPU's memory is reachable only through the CUDA runtime).
// Any host code that reads or writes a device pointer (MPI on a path that should have been
// staged, a memcpy, an operator on the host) dies with SIGSEGV, which fails the test. The
// runtime counts what a CUDA runtime would do: allocations, copies, synchronisations; its
// batched copies (copy_many: one pack or unpack kernel on a GPU) count as launches.
// open_all()/close_all() let host code that stands in for a kernel or a CUDA-aware MPI reach the
// device memory for a while. Uses Catch2 (REQUIRE): include it from Catch2 test programs only.
#pragma once

#include <catch2/catch.hpp>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <span>

#include "lockstep/lockstep.hpp"

namespace lstest {

namespace ls = lockstep;

class GuardedHostRuntime final : public ls::DeviceRuntime {
 public:
  struct Counts {
    long allocations = 0, pinned_allocations = 0, copies = 0, zeroes = 0, syncs = 0;
    long copy_launches = 0;  // copy_many: one launch of the pack/unpack kernel each
    long convert_launches = 0;  // convert_many: one launch of the conversion kernel each
    long stream_syncs = 0;   // synchronize_stream: the current stream only
  };

  void* allocate(std::size_t bytes, int) override {
    std::lock_guard lock(m_);
    const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t len = std::max<std::size_t>(page, (bytes + page - 1) / page * page);
    void* p = ::mmap(nullptr, len, all_open_ ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    regions_[static_cast<char*>(p)] = len;
    ++counts_.allocations;
    return p;
  }
  void deallocate(void* p, int) noexcept override {
    std::lock_guard lock(m_);
    auto it = regions_.find(static_cast<char*>(p));
    if (it == regions_.end()) return;
    ::munmap(it->first, it->second);
    regions_.erase(it);
  }
  void copy(void* dst, ls::Device dd, const void* src, ls::Device sd, std::size_t bytes) override {
    std::lock_guard lock(m_);
    ++counts_.copies;
    if (bytes == 0) return;
    Open a(*this, dd.is_cpu() ? nullptr : dst), b(*this, sd.is_cpu() ? nullptr : src);
    std::memmove(dst, src, bytes);
  }
  void zero(void* p, std::size_t bytes, int) override {
    std::lock_guard lock(m_);
    ++counts_.zeroes;
    if (bytes == 0) return;
    Open a(*this, p);
    std::memset(p, 0, bytes);
  }
  void synchronize(int) override {
    std::lock_guard lock(m_);
    ++counts_.syncs;
  }
  void synchronize_stream(int) override {
    std::lock_guard lock(m_);
    ++counts_.stream_syncs;
  }
  void copy_many(std::span<const ls::DeviceCopy> copies, int) override {
    std::lock_guard lock(m_);
    ++counts_.copy_launches;
    for (const auto& c : copies) {
      if (c.bytes == 0) continue;
      Open a(*this, c.dst), b(*this, c.src);  // both must be device memory of this runtime
      std::memmove(c.dst, c.src, c.bytes);
    }
  }
  // f32 <-> bf16/f16 as the CUDA kernel does (round to nearest even; back: widened, divided).
  void convert_many(std::span<const ls::DeviceConvert> items, ls::DType from, ls::DType to, float divisor,
                    int) override {
    std::lock_guard lock(m_);
    ++counts_.convert_launches;
    for (const auto& c : items) {
      if (c.n == 0) continue;
      Open a(*this, c.dst), b(*this, c.src);  // both must be device memory of this runtime
      for (std::int64_t i = 0; i < c.n; ++i) {
        if (from == ls::DType::f32) {
          const float x = static_cast<const float*>(c.src)[i];
          static_cast<std::uint16_t*>(c.dst)[i] = to == ls::DType::bf16 ? ls::to_bfloat16(x).bits : ls::to_half(x).bits;
        } else {
          const std::uint16_t h = static_cast<const std::uint16_t*>(c.src)[i];
          const float x = from == ls::DType::bf16 ? ls::to_float(ls::bfloat16{h}) : ls::to_float(ls::half{h});
          static_cast<float*>(c.dst)[i] = divisor == 1.0f ? x : x / divisor;
        }
      }
    }
  }
  void* allocate_pinned(std::size_t bytes) override {
    std::lock_guard lock(m_);
    ++counts_.pinned_allocations;
    return std::aligned_alloc(64, std::max<std::size_t>(64, (bytes + 63) / 64 * 64));
  }
  void deallocate_pinned(void* p) noexcept override { std::free(p); }
  int device_count() override { return 1; }

  Counts counts() {
    std::lock_guard lock(m_);
    return counts_;
  }
  void reset_counts() {
    std::lock_guard lock(m_);
    counts_ = {};
  }
  /// Lets host code (MPI on the direct path of a CUDA-aware MPI, the kernel stand-ins) reach
  /// every device allocation until close_all().
  void open_all() {
    std::lock_guard lock(m_);
    for (auto& [p, len] : regions_) ::mprotect(p, len, PROT_READ | PROT_WRITE);
    all_open_ = true;
  }
  void close_all() {
    std::lock_guard lock(m_);
    for (auto& [p, len] : regions_) ::mprotect(p, len, PROT_NONE);
    all_open_ = false;
  }

 private:
  // Opens the region holding `p` for the scope (nothing for host pointers).
  struct Open {
    Open(GuardedHostRuntime& rt, const void* p) : rt_(rt) {
      if (p == nullptr || rt.all_open_) return;
      auto it = rt.regions_.upper_bound(static_cast<char*>(const_cast<void*>(p)));
      const bool inside = it != rt.regions_.begin() && static_cast<const char*>(p) < std::prev(it)->first + std::prev(it)->second;
      if (!inside) std::cerr << "GuardedHostRuntime: " << p << " is not device memory of this runtime\n";
      REQUIRE(inside);
      --it;
      base_ = it->first;
      len_ = it->second;
      ::mprotect(base_, len_, PROT_READ | PROT_WRITE);
    }
    ~Open() {
      if (base_ != nullptr) ::mprotect(base_, len_, PROT_NONE);
    }
    GuardedHostRuntime& rt_;
    char* base_ = nullptr;
    std::size_t len_ = 0;
  };

  std::mutex m_;
  std::map<char*, std::size_t> regions_;
  Counts counts_;
  bool all_open_ = false;
};

/// Installs a GuardedHostRuntime for a scope (and restores the runtime that was there).
struct InstalledRuntime {
  GuardedHostRuntime rt;
  ls::DeviceRuntime* prev = ls::find_device_runtime();
  InstalledRuntime() { ls::set_device_runtime(&rt); }
  ~InstalledRuntime() { ls::set_device_runtime(prev); }
  InstalledRuntime(const InstalledRuntime&) = delete;
  InstalledRuntime& operator=(const InstalledRuntime&) = delete;
};

}  // namespace lstest
