// Remote calls, for the tests only (test/remote/): the conditions they need, made on purpose,
// and what the receive cache did. Never installed; a test includes it by its path in src/.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "lockstep/comm/backend.hpp"

namespace lockstep::detail::remote {

/// What the session's receive cache (RemoteOptions::receive_cache_bytes) did on this rank.
struct ReceiveCacheStats {
  std::uint64_t hits = 0;     ///< tensors received into a kept buffer
  std::uint64_t misses = 0;   ///< tensors of the cached sizes received into new memory
  std::size_t kept_bytes = 0; ///< memory kept for reuse now
  std::size_t kept_buffers = 0;
};
/// The receive cache of b's session; InvalidArgument when b has no session.
ReceiveCacheStats receive_cache_stats(const Backend& b);

/// Test hooks (test/remote/): the conditions the tests need, made on purpose. Not for programs.
struct TestHooks {
  /// Sessions created from now on use at most this many data tags (0: all that MPI_TAG_UB
  /// allows), so that the tags of calls wrap after a few calls. Every rank must set the same.
  std::atomic<int> tag_span{0};
  /// Sessions created from now on wait this long for the tensor messages of a header they
  /// received (< 0: the session's timeout).
  std::atomic<double> data_timeout{-1.0};
  /// The next this many tensors this rank receives find no memory (as if the allocation failed).
  std::atomic<int> fail_allocations{0};
  /// Messages whose non-tensor part is over this many bytes are refused before they are sent,
  /// as those over 2 GiB are (0: 2 GiB).
  std::atomic<std::size_t> max_message_bytes{0};
  /// The next this many replies this rank sends without tensors go out malformed: the lengths
  /// in their header do not add up (as from a sender of another version), so that the caller
  /// drops them.
  std::atomic<int> malformed_replies{0};
};
TestHooks& test_hooks();
/// Called by a remote function: the tensor messages of its reply are sent `seconds` after the
/// reply's header (on the thread that runs it, for this call only).
void delay_reply_tensors_for_test(double seconds);
}  // namespace lockstep::detail::remote
