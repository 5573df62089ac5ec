// Internal to the mpi layer: what the layer's own waits call while they poll (the shared-memory
// path's spins, the hierarchical path's MPI requests), so that no wait outlives a stall notice,
// a refused call elsewhere or the collective's deadline.
#pragma once

namespace lockstep::detail {

class WaitHook {
 public:
  /// Called every few thousand polls of a wait. May throw (TimeoutError, MismatchError,
  /// MpiError) to end the wait; the communicator is then unusable, which the hook's owner knows.
  virtual void at_wait() = 0;
  /// True when at_wait() also moves MPI requests forward (the hierarchical path's network part,
  /// which Open MPI progresses only inside MPI calls): a wait must then keep calling it often,
  /// never sleep between calls.
  virtual bool drives_progress() const noexcept { return false; }

 protected:
  WaitHook() = default;
  WaitHook(const WaitHook&) = default;
  WaitHook& operator=(const WaitHook&) = default;
  ~WaitHook() = default;  // never owned through this interface
};

}  // namespace lockstep::detail
