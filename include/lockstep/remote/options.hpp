// Remote calls: the settings of a session and of one call (remote.hpp).
#pragma once

#include <cstddef>

namespace lockstep {

/// Settings of a remote session (same on every rank; checked when the session is created).
struct RemoteOptions {
  /// Also run incoming calls on a background thread, at any time (not only while this rank is in
  /// run_driver/serve or waiting on a future). Remote functions then run concurrently with this
  /// rank's own code: they must not touch what that code uses unguarded.
  bool background = false;
  /// Default deadline of a call, in seconds (< 0: lockstep::timeout(), i.e. LOCKSTEP_TIMEOUT,
  /// default 600 s; 0: none). Also bounds the session's own collectives and how long a serving
  /// rank waits without hearing from the driver.
  double timeout = -1.0;
  /// Bytes of received-tensor memory this rank keeps for reuse (0: none). A tensor of 64 KiB or
  /// more that a call or reply brings is received into a buffer of the session; once the last
  /// Tensor over it is released, the buffer is kept (up to this many bytes, the least recently
  /// returned given up first) and a later message of about its size is received into it, which
  /// saves the page faults of fresh memory. A buffer is reused only when nothing refers to it.
  /// Local to each rank (need not agree); the kept memory is freed when the session ends.
  std::size_t receive_cache_bytes = std::size_t{512} << 20;
};

/// Options of one call.
struct CallOptions {
  double timeout = -1.0;  ///< seconds; < 0: the session's default; 0: none
};

}  // namespace lockstep
