// Remote calls, internal: the receive cache of a session (RemoteOptions::receive_cache_bytes).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "lockstep/core/errors.hpp"
#include "lockstep/core/tensor.hpp"
#include "remote/test_hooks.hpp"

namespace lockstep::detail::remote {

// ---- the receive cache ----
// Received tensors of kCacheMin bytes or more live in buffers of the session. The deleter of a
// buffer's storage (it runs when the last Tensor over the buffer is released, on any thread)
// gives the buffer back; the cache keeps it, within its byte limit, and hands it out again for
// a message of about the same size. Without it every large received tensor is new memory, which
// glibc maps afresh (allocations over its mmap threshold, at most 32 MiB), so that the page
// faults of first touch cost more than the transfer itself. A buffer is handed out only after
// its deleter ran: nothing received can alias a tensor still held.
constexpr std::size_t kCacheMin = std::size_t{64} << 10;
constexpr std::size_t kCacheMaxBuffers = 64;
constexpr std::size_t kAlign = 64;

class RecvCache : public std::enable_shared_from_this<RecvCache> {
 public:
  explicit RecvCache(std::size_t limit) : limit_(limit) {}
  ~RecvCache() {
    for (auto& b : kept_) std::free(b.p);
  }
  RecvCache(const RecvCache&) = delete;
  RecvCache& operator=(const RecvCache&) = delete;

  /// A host tensor of `shape` to receive into (contents unspecified: the receive fills it).
  Tensor take(Shape shape, DType dt) {
    const std::size_t n = nbytes_of(numel_of(shape), dt);
    if (n < kCacheMin || limit_ == 0) return Tensor(std::move(shape), dt);
    void* p = nullptr;
    std::size_t cap = 0;
    {
      std::lock_guard lk(mu_);
      // The smallest kept buffer that holds n bytes and wastes at most a quarter of n; of
      // those, the one given back last, whose memory is likeliest still in the CPU's caches (a
      // rank that calls with one size over and over then keeps reusing one buffer, not turning
      // through several).
      std::size_t best = kept_.size();
      for (std::size_t i = 0; i < kept_.size(); ++i) {
        const Kept& k = kept_[i];
        if (k.cap < n || k.cap - n > n / 4) continue;
        if (best == kept_.size() || k.cap < kept_[best].cap ||
            (k.cap == kept_[best].cap && k.stamp > kept_[best].stamp))
          best = i;
      }
      if (best != kept_.size()) {
        p = kept_[best].p;
        cap = kept_[best].cap;
        kept_bytes_ -= cap;
        kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(best));
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (p == nullptr) {
      cap = (n + kAlign - 1) / kAlign * kAlign;
      p = std::aligned_alloc(kAlign, cap);
      if (p == nullptr)
        throw Error(concat("remote: out of memory: cannot allocate ", n, " bytes for a received ", name(dt),
                           " tensor of shape ", lockstep::to_string(shape), rank_suffix()));
    }
    std::shared_ptr<void> owner;
    try {
      owner = std::shared_ptr<void>(p, [self = shared_from_this(), cap](void* q) { self->give(q, cap); });
    } catch (...) {
      std::free(p);
      throw;
    }
    return Tensor::adopt(p, std::move(owner), std::move(shape), dt);
  }

  /// Frees what is kept; buffers given back later are freed at once.
  void close() {
    std::lock_guard lk(mu_);
    closed_ = true;
    for (auto& b : kept_) std::free(b.p);
    kept_.clear();
    kept_bytes_ = 0;
  }

  ReceiveCacheStats stats() {
    std::lock_guard lk(mu_);
    return ReceiveCacheStats{hits_, misses_, kept_bytes_, kept_.size()};
  }

 private:
  struct Kept {
    std::size_t cap;
    void* p;
    std::uint64_t stamp;
  };

  void give(void* p, std::size_t cap) noexcept {
    std::lock_guard lk(mu_);
    if (closed_ || cap > limit_) {
      std::free(p);
      return;
    }
    // Make room: the least recently given back go first.
    while (!kept_.empty() && (kept_bytes_ + cap > limit_ || kept_.size() >= kCacheMaxBuffers)) {
      auto oldest = std::min_element(kept_.begin(), kept_.end(),
                                     [](const Kept& a, const Kept& b) { return a.stamp < b.stamp; });
      std::free(oldest->p);
      kept_bytes_ -= oldest->cap;
      kept_.erase(oldest);
    }
    try {
      kept_.push_back(Kept{cap, p, ++clock_});
      kept_bytes_ += cap;
    } catch (...) {
      std::free(p);
    }
  }

  std::mutex mu_;
  std::vector<Kept> kept_;
  std::size_t limit_, kept_bytes_ = 0;
  std::uint64_t clock_ = 0, hits_ = 0, misses_ = 0;
  bool closed_ = false;
};

}  // namespace lockstep::detail::remote
