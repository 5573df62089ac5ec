// Call sites: where the collective a thread is about to start was called (the front end of
// backend.hpp records it; fingerprints, blame reports and error messages name it), and the hash
// that fingerprints and structure checks compare. Part of the reliability layer, below comm.
#pragma once

#include <cstddef>
#include <cstdint>
#include <source_location>
#include <string>

namespace lockstep::detail {

/// Where the collective the calling thread is about to start was called: `loc` is the call of
/// the Backend collective itself (recorded by the front end in backend.hpp, so a collective
/// issued inside the library names the library's line), `outer` the user's call of the library
/// function that issued it (synchronize, update, a checkpoint), when there is one. `op` names
/// the collective ("allreduce", ...). Read by the backend when it records the collective.
struct CallSite {
  std::source_location loc;
  std::source_location outer;
  const char* op = nullptr;
  bool known = false;
  bool has_outer = false;
};
inline thread_local CallSite t_call_site;

/// Records a call site for the duration of one call, restoring the previous one after. Nested
/// scopes keep the outermost site as `outer` and the innermost as `loc`.
class CallSiteScope {
 public:
  explicit CallSiteScope(const std::source_location& loc, const char* op = nullptr) noexcept
      : saved_(t_call_site) {
    CallSite s;
    s.loc = loc;
    s.known = true;
    s.op = op != nullptr ? op : saved_.op;
    if (saved_.has_outer) {
      s.outer = saved_.outer;
      s.has_outer = true;
    } else if (saved_.known) {
      s.outer = saved_.loc;
      s.has_outer = true;
    }
    t_call_site = s;
  }
  ~CallSiteScope() { t_call_site = saved_; }
  CallSiteScope(const CallSiteScope&) = delete;
  CallSiteScope& operator=(const CallSiteScope&) = delete;

 private:
  CallSite saved_;
};

/// "allreduce called at train.cpp:40 (inside the call at main.cpp:12)" for the current call
/// site of this thread; "a collective" when none is recorded.
std::string describe_call_site();

/// 64-bit hash of `bytes` bytes (not cryptographic; equal inputs give equal hashes on every rank):
/// Lockstep's one hash (fingerprints, replicas, structure signatures, file names). `seed` chains
/// hashes: hash_bytes(b, nb, hash_bytes(a, na)) hashes a then b.
std::uint64_t hash_bytes(const void* data, std::size_t bytes, std::uint64_t seed = 0) noexcept;

}  // namespace lockstep::detail
