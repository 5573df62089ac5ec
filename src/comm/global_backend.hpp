// Internal (not installed): the process-wide backend of one type behind initialize<B>(),
// initialized<B>(), get_distributed_backend<B>() and finalize<B>() (lockstep/mpi/world.hpp), one
// template for every backend that has one (MPIBackend: src/mpi/mpi_backend_global.cpp;
// NCCLBackend: ext/nccl/src/nccl_backend.cpp, which sees this folder through a private include
// path). What differs between backends stays theirs: what comes before the backend's creation
// (MPI_Init, the terminate handler) and what ends with it (MPI_Finalize).
#pragma once

#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <mutex>
#include <utility>

#include "lockstep/core/errors.hpp"

namespace lockstep::detail {

/// The global backend of type B: one object per backend type, at namespace scope in B's source
/// file (constant-initialised, so usable from any static initialiser), to which B's static hooks
/// initialize_global, initialized_global, global and finalize_global forward.
template <class B>
class GlobalBackend {
 public:
  /// `type`: the class's name in messages ("MPIBackend"); `label`: the backend's ("MPI").
  constexpr GlobalBackend(const char* type, const char* label) noexcept : type_(type), label_(label) {}
  GlobalBackend(const GlobalBackend&) = delete;
  GlobalBackend& operator=(const GlobalBackend&) = delete;

  /// initialize<B>(), idempotent: unless the backend exists, `create()` returns it as a
  /// std::unique_ptr<B>. create() runs under the lock (a second thread's initialize waits for
  /// it), so it may also do what must precede the backend (MPI_Init). Once a backend was created,
  /// finalize<B>() (B::finalize_global) runs at exit, registered once per process. An exception
  /// of create() goes to the caller, with no backend.
  template <class Create>
  void initialize(Create&& create) {
    std::lock_guard lock(mutex_);
    if (backend_) return;
    backend_ = std::forward<Create>(create)();
    if (!at_exit_registered_) {
      std::atexit(&GlobalBackend::finalize_at_exit);
      at_exit_registered_ = true;
    }
  }

  /// initialized<B>(): whether the backend exists.
  bool initialized() const noexcept {
    std::lock_guard lock(mutex_);
    return static_cast<bool>(backend_);
  }

  /// get_distributed_backend<B>(): the backend; lockstep::Error naming initialize<B>() if none.
  B& get() const {
    std::lock_guard lock(mutex_);
    if (!backend_)
      throw Error(concat("get_distributed_backend<", type_, ">: the ", label_,
                         " backend is not initialised; call lockstep::initialize<lockstep::", type_, ">() first"));
    return *backend_;
  }

  /// The backend, or nullptr: for what must end before it goes (finalize hooks).
  B* current() const noexcept {
    std::lock_guard lock(mutex_);
    return backend_.get();
  }

  /// finalize<B>(): `teardown(slot)` under the lock, given the backend's std::unique_ptr<B>&,
  /// which it resets; what ends with the backend (MPI_Finalize) may follow there.
  template <class Teardown>
  void finalize(Teardown&& teardown) {
    std::lock_guard lock(mutex_);
    std::forward<Teardown>(teardown)(backend_);
  }
  /// finalize<B>() for a backend that takes nothing with it: destroys it.
  void finalize() {
    finalize([](std::unique_ptr<B>& backend) { backend.reset(); });
  }

 private:
  // Registered with std::atexit by the first initialize that created a backend. An error at
  // exit is printed, not thrown (there is no caller left to catch it).
  static void finalize_at_exit() {
    try {
      B::finalize_global();
    } catch (const std::exception& e) {
      std::cerr << "lockstep: at exit: " << e.what() << "\n";
    }
  }

  mutable std::mutex mutex_;
  std::unique_ptr<B> backend_;
  bool at_exit_registered_ = false;
  const char* type_;
  const char* label_;
};

}  // namespace lockstep::detail
