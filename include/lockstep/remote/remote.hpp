// Remote calls after TorchOpt's driver/worker model (torchopt.distributed): one rank (the
// driver, rank 0) runs the training loop and sends work to the others.
//
//   float loss_on(const Model& m, const ls::Tensor& batch);
//   LOCKSTEP_REMOTE(loss_on)                          // namespace scope: callable remotely
//   ls::run_driver(backend, [&] {                     // rank 0 runs this, the others serve
//     ls::Future<float> f = ls::remote_async_call(backend, 2, loss_on, model, batch);
//     float l = f.wait();
//     float m = ls::remote_sync_call(backend, ls::batch_partitioner, ls::mean_reducer,
//                                    loss_on, model, batch);     // split, call, combine
//   });
//
// Calls travel over their own duplicate of the backend's communicator (never mixed with the
// collectives of training), served by a progress thread per rank (this needs
// MPI_THREAD_MULTIPLE, which initialize<MPIBackend>() asks for). Who runs a call on the rank it
// is sent to: the thread inside run_driver/serve, any thread of that rank waiting on a future,
// and, in a RemoteSession with RemoteOptions::background, a background executor thread at any
// time (so a rank busy in its own SPMD code still answers). See docs/remote.md.
#pragma once

#include <cstddef>
#include <exception>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/mpi/mpi_backend.hpp"
#include "lockstep/mpi/world.hpp"
#include "lockstep/remote/detail/calls.hpp"
#include "lockstep/remote/detail/codec.hpp"
#include "lockstep/remote/detail/registry.hpp"
#include "lockstep/remote/future.hpp"
#include "lockstep/remote/options.hpp"
#include "lockstep/train/data.hpp"

#define LOCKSTEP_DETAIL_CAT2(a, b) a##b
#define LOCKSTEP_DETAIL_CAT(a, b) LOCKSTEP_DETAIL_CAT2(a, b)

/// Makes the function `fn` callable on other ranks, under the name written ("loss_on",
/// "ns::loss_on"). At namespace scope; `fn` must name one function (not an overload set), whose
/// parameters and result are serializable (see remote.hpp). Every rank that should run it must
/// register it (a program built from the same code does).
#define LOCKSTEP_REMOTE(fn)                                                             \
  [[maybe_unused]] static const bool LOCKSTEP_DETAIL_CAT(lockstep_remote_registered_,  \
                                                         __COUNTER__) =                 \
      ::lockstep::detail::remote::register_static(#fn, &fn);

namespace lockstep {
/// Registers fn under `name` at run time (what LOCKSTEP_REMOTE does at start-up).
template <class R, class... A>
void register_remote(const std::string& name, R (*fn)(A...)) {
  detail::remote::register_fn(name, detail::remote::signature_of<R, A...>(),
                              reinterpret_cast<const void*>(fn), &detail::remote::invoke_fn<R, A...>);
}
/// Removes a registration on this rank (calls of it from other ranks then fail with
/// RemoteError). Returns whether the name was registered.
inline bool unregister_remote(const std::string& name) { return detail::remote::unregister_fn(name); }
/// A remote session on a backend: the duplicated communicator and the progress thread. Collective
/// to create and to close (the destructor closes it if close() was not called). run_driver
/// creates one for its duration when none exists; create one yourself for background serving
/// or to keep the session across several run_driver calls. Needs MPI_THREAD_MULTIPLE.
class RemoteSession {
 public:
  explicit RemoteSession(Backend& b, RemoteOptions options = {});
  ~RemoteSession();
  RemoteSession(const RemoteSession&) = delete;
  RemoteSession& operator=(const RemoteSession&) = delete;
  /// Collective, graceful: this rank serves calls (on this thread, or the background one) until
  /// every rank has closed the session and every call made on it has been answered, then frees
  /// it. A rank that hears nothing from another for the session's timeout meanwhile (stopped,
  /// hung, or never closing) throws TimeoutError naming it.
  void close();

 private:
  Backend* backend_ = nullptr;
};

// ---- calls ----

/// Calls fn(args...) on `rank` and returns a Future of its result (void functions: ls::Done).
/// The arguments are serialized and sent before this returns (they may be changed then); the
/// call runs on `rank` (see remote.hpp for which thread). Calls to this rank itself work.
template <class Fn, class... Args>
  requires detail::remote::FnOfArity<Fn, sizeof...(Args)>
auto remote_async_call(Backend& b, int rank, Fn fn, const Args&... args) {
  return detail::remote::async_one(b, CallOptions{}, rank, fn, args...);
}
template <class Fn, class... Args>
  requires detail::remote::FnOfArity<Fn, sizeof...(Args)>
auto remote_async_call(Backend& b, const CallOptions& o, int rank, Fn fn, const Args&... args) {
  return detail::remote::async_one(b, o, rank, fn, args...);
}
/// The partitioned form (TorchOpt's remote_async_call with partitioner and reducer): the
/// partitioner (dim_partitioner(d), batch_partitioner, exclusive_batch_partitioner, a
/// std::vector<int> of ranks, one rank, or a callable returning a vector of (rank, tuple of
/// arguments)) makes the calls; the reducer (mean_reducer, weighted by partition size,
/// sum_reducer, or a callable taking std::vector<R>) combines their results.
template <class P, class Red, class Fn, class... Args>
  requires(detail::remote::FnOfArity<Fn, sizeof...(Args)> && !detail::remote::FnPtr<Red> &&
           !std::is_same_v<std::decay_t<P>, CallOptions>)
auto remote_async_call(Backend& b, const P& p, Red red, Fn fn, const Args&... args) {
  return detail::remote::async_parts(b, CallOptions{}, p, std::move(red), fn, args...);
}
template <class P, class Red, class Fn, class... Args>
  requires(detail::remote::FnOfArity<Fn, sizeof...(Args)> && !detail::remote::FnPtr<Red>)
auto remote_async_call(Backend& b, const CallOptions& o, const P& p, Red red, Fn fn, const Args&... args) {
  return detail::remote::async_parts(b, o, p, std::move(red), fn, args...);
}
/// remote_async_call(...).wait().
template <class... T>
auto remote_sync_call(Backend& b, T&&... t) {
  return remote_async_call(b, std::forward<T>(t)...).wait();
}

// The driver's parallelize (TorchOpt's parallelize_async / parallelize_sync, where
// `parallelize` is the sync one) is remote_parallelize_*: a remote call per partition, made by
// the rank that calls it while the others serve. ls::parallelize (data.hpp) is the SPMD form:
// every rank calls it with the same batch and runs its own partition; no remote call.

/// A callable (args...) -> Future of the reduced result: remote_async_call(b, o, partitioner,
/// reducer, fn, args...) for each call.
template <class P, class Red, class Fn>
  requires detail::remote::FnPtr<Fn>
[[nodiscard]] auto remote_parallelize_async(Backend& b, P partitioner, Red reducer, Fn fn, CallOptions o = {}) {
  return [&b, partitioner, reducer, fn, o](const auto&... args) {
    return remote_async_call(b, o, partitioner, reducer, fn, args...);
  };
}
/// The same, waiting for the result: a callable (args...) -> the reduced result.
template <class P, class Red, class Fn>
  requires detail::remote::FnPtr<Fn>
[[nodiscard]] auto remote_parallelize_sync(Backend& b, P partitioner, Red reducer, Fn fn, CallOptions o = {}) {
  return [&b, partitioner, reducer, fn, o](const auto&... args) {
    return remote_async_call(b, o, partitioner, reducer, fn, args...).wait();
  };
}
/// 0.2 name of remote_parallelize_async; goes in 0.4.
template <class P, class Red, class Fn>
  requires detail::remote::FnPtr<Fn>
[[deprecated("use lockstep::remote_parallelize_async (ls::parallelize is the SPMD form)")]] [[nodiscard]] auto
parallelize_async(Backend& b, P partitioner, Red reducer, Fn fn, CallOptions o = {}) {
  return remote_parallelize_async(b, std::move(partitioner), std::move(reducer), fn, std::move(o));
}
/// 0.2 name of remote_parallelize_sync; goes in 0.4.
template <class P, class Red, class Fn>
  requires detail::remote::FnPtr<Fn>
[[deprecated("use lockstep::remote_parallelize_sync (ls::parallelize is the SPMD form)")]] [[nodiscard]] auto
parallelize_sync(Backend& b, P partitioner, Red reducer, Fn fn, CallOptions o = {}) {
  return remote_parallelize_sync(b, std::move(partitioner), std::move(reducer), fn, std::move(o));
}

/// Collective. Rank 0 (the driver) runs f; every other rank serves calls until f returns. Every
/// rank returns f's result (sent to the others; it must be serializable), or throws f's error
/// (the driver its own exception, the others the same type and message). A rank that hears
/// nothing from the driver for the session's timeout throws TimeoutError.
template <class F>
auto run_driver(Backend& b, F&& f) {
  using R0 = std::invoke_result_t<F&>;
  using R = std::conditional_t<std::is_void_v<R0>, Done, std::decay_t<R0>>;
  detail::remote::DriverRun run(b, false, typeid(R).name());
  if (run.is_driver()) {
    try {
      if constexpr (std::is_void_v<R0>) {
        f();
        detail::remote::Encoder e;
        detail::remote::encode(e, Done{});
        run.finish_ok(std::move(e));
        return;
      } else {
        R r = f();
        detail::remote::Encoder e;
        detail::remote::encode(e, r);
        run.finish_ok(std::move(e));
        return r;
      }
    } catch (...) {
      run.finish_error(std::current_exception());
      throw;
    }
  } else {
    auto d = run.serve_until_done();
    if constexpr (std::is_void_v<R0>) {
      return;
    } else {
      R r{};
      detail::remote::decode(d, r);
      return r;
    }
  }
}

/// Collective with run_driver on rank 0: a rank other than 0 serves calls until the driver's
/// run_driver returns (then returns, or throws the driver's error). InvalidArgument-like
/// MismatchError on every rank if rank 0 calls serve.
void serve(Backend& b);


/// TorchOpt's auto_init_rpc: `auto_init_rpc(worker_init, options)(func)` is func wrapped so that
/// calling it, on every rank, initialises MPIBackend (when not yet), opens a RemoteSession on it,
/// runs worker_init() (if given), waits until every rank has (when it threw on some rank, every
/// rank throws: that rank its exception, the others an Error naming it), runs func(args...), and
/// closes the session gracefully: a rank whose func returned serves the calls of the others until every
/// rank's func has returned and every call is answered (TorchOpt's graceful rpc.shutdown). Each
/// rank returns its own func's result. Typical: func drives on rank 0 (`ls::rank_zero_only`) and
/// returns at once on the others, which then serve. An exception in func closes the session the
/// same way (serving) and goes on. Collective; the remote calls inside func name the backend
/// `ls::get_distributed_backend<ls::MPIBackend>()`.
template <class Init = std::nullptr_t>
auto auto_init_rpc(Init worker_init = nullptr, RemoteOptions options = {}) {
  static_assert(std::is_null_pointer_v<Init> || std::is_invocable_v<Init&>,
                "auto_init_rpc: worker_init must be callable with no arguments");
  return [worker_init = std::move(worker_init), options](auto func) {
    return [worker_init, options, func = std::move(func)](auto&&... args) mutable -> decltype(auto) {
      initialize<MPIBackend>();
      auto& b = get_distributed_backend<MPIBackend>();
      RemoteSession session(b, options);
      std::exception_ptr init_error;
      if constexpr (!std::is_null_pointer_v<Init>) {
        try {
          worker_init();
        } catch (...) {
          init_error = std::current_exception();
        }
      }
      // The ranks agree before any func starts: a worker_init that threw on one rank ends
      // auto_init_rpc on every rank, each closing the session in step.
      const auto failed = detail::remote::session_agree_failed(b, init_error != nullptr, "auto_init_rpc (after worker_init)");
      if (init_error) std::rethrow_exception(init_error);
      if (!failed.empty()) {
        std::string ranks;
        for (std::size_t i = 0; i < failed.size() && i < 8; ++i) ranks += (i ? ", " : "") + std::to_string(failed[i]);
        if (failed.size() > 8) ranks += ", ...";
        throw Error("auto_init_rpc: worker_init threw on rank" + std::string(failed.size() > 1 ? "s " : " ") + ranks +
                    " (its error is reported there); func did not run on any rank");
      }
      using R = decltype(func(std::forward<decltype(args)>(args)...));
      if constexpr (std::is_void_v<R>) {
        func(std::forward<decltype(args)>(args)...);
        session.close();
      } else {
        R r = func(std::forward<decltype(args)>(args)...);
        session.close();
        return r;
      }
    };
  };
}

}  // namespace lockstep
