// Flux-style entry points (initialize, get_distributed_backend, rank, size) and the
// TorchOpt-style world vocabulary (world_info, rank_zero_only, on_rank, AutoInit).
#pragma once

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <optional>
#include <source_location>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "lockstep/comm/backend.hpp"
#include "lockstep/reliability/settings.hpp"  // call sites (and, as before, the settings)

namespace lockstep {

/// Initialises backend B (for MPIBackend: MPI_Init_thread with MPI_THREAD_MULTIPLE if MPI is not
/// yet initialised). Idempotent.
template <class B>
void initialize() {
  B::initialize_global();
}
/// True once initialize<B>() has run (and finalize<B>() has not).
template <class B>
[[nodiscard]] bool initialized() noexcept {
  return B::initialized_global();
}
/// The process-wide backend of type B; throws lockstep::Error if B is not initialised.
template <class B>
[[nodiscard]] B& get_distributed_backend() {
  return B::global();
}
/// Tears down the global backend B (and MPI, if Lockstep initialised it). Also happens at exit.
/// Remote sessions still open on it are left first (the other ranks are told). Never throws an
/// error already reported (after a refused initialize it finalises MPI, waiting at most 10 s for
/// the other ranks).
template <class B>
void finalize() {
  B::finalize_global();
}

// One vocabulary for place and count, the one of Backend and WorldInfo: rank, size,
// local_rank, local_size.
/// This process's rank in the backend's group.
[[nodiscard]] inline int rank(const Backend& b) { return b.rank(); }
/// Number of ranks in the backend's group.
[[nodiscard]] inline int size(const Backend& b) { return b.size(); }
/// Rank among the processes on this node.
[[nodiscard]] inline int local_rank(const Backend& b) { return b.local_rank(); }
/// Number of processes on this node.
[[nodiscard]] inline int local_size(const Backend& b) { return b.local_size(); }
/// 0.2 name of size(b) (Flux's); goes in 0.4.
[[deprecated("use lockstep::size(backend)")]] [[nodiscard]] inline int total_workers(const Backend& b) {
  return b.size();
}
/// 0.2 name of local_size(b); goes in 0.4.
[[deprecated("use lockstep::local_size(backend)")]] [[nodiscard]] inline int local_workers(const Backend& b) {
  return b.local_size();
}

/// Free-function forms of the collectives (backend first, as in Flux). Each passes on its call
/// site (the defaulted `loc`), which fingerprint mismatches, stall reports and MPI errors name.
inline void broadcast(Backend& b, TensorView buf, int root = 0,
                      std::source_location loc = std::source_location::current()) {
  b.broadcast(buf, root, loc);
}
/// In-place allreduce; see Backend::allreduce.
inline void allreduce(Backend& b, TensorView buf, ReduceOp op,
                      std::source_location loc = std::source_location::current()) {
  b.allreduce(buf, op, loc);
}
/// Out-of-place allreduce; see Backend::allreduce.
inline void allreduce(Backend& b, TensorView send, TensorView recv, ReduceOp op,
                      std::source_location loc = std::source_location::current()) {
  b.allreduce(send, recv, op, loc);
}
/// In-place reduce onto root; see Backend::reduce.
inline void reduce(Backend& b, TensorView buf, ReduceOp op, int root = 0,
                   std::source_location loc = std::source_location::current()) {
  b.reduce(buf, op, root, loc);
}
/// Out-of-place reduce onto root; see Backend::reduce.
inline void reduce(Backend& b, TensorView send, TensorView recv, ReduceOp op, int root = 0,
                   std::source_location loc = std::source_location::current()) {
  b.reduce(send, recv, op, root, loc);
}
/// See Backend::allgather.
inline void allgather(Backend& b, TensorView send, TensorView recv,
                      std::source_location loc = std::source_location::current()) {
  b.allgather(send, recv, loc);
}
/// See Backend::reduce_scatter.
inline void reduce_scatter(Backend& b, TensorView send, TensorView recv, ReduceOp op,
                           std::source_location loc = std::source_location::current()) {
  b.reduce_scatter(send, recv, op, loc);
}
/// See Backend::barrier.
inline void barrier(Backend& b, std::source_location loc = std::source_location::current()) {
  b.barrier(loc);
}

/// True when MPI is initialised, so that a distributed backend can be used.
[[nodiscard]] bool is_available() noexcept;

/// Where this process sits in the job.
struct WorldInfo {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
};
/// World info of MPI_COMM_WORLD; a single-process world {0, 1, 0, 1} when MPI is not initialised.
/// Local (not a collective) once initialize<MPIBackend>() ran; before that, with MPI initialised
/// by someone else, it is a collective over MPI_COMM_WORLD (MPI_Comm_split_type).
[[nodiscard]] WorldInfo world_info();

/// What on_rank & co. return for a void function on a rank that ran it.
using Done = std::monostate;

namespace detail {
template <class F>
using rank_result_t =
    std::conditional_t<std::is_void_v<std::invoke_result_t<F>>, Done, std::invoke_result_t<F>>;

template <class F>
std::optional<rank_result_t<F>> run_if(bool run, F&& f) {
  if (!run) return std::nullopt;
  if constexpr (std::is_void_v<std::invoke_result_t<F>>) {
    std::invoke(std::forward<F>(f));
    return Done{};
  } else {
    return std::invoke(std::forward<F>(f));
  }
}
inline bool contains(const std::vector<int>& ranks, int r) {
  return std::find(ranks.begin(), ranks.end(), r) != ranks.end();
}
/// Rank in MPI_COMM_WORLD (0 when MPI is not initialised); never a collective, so the rank
/// helpers below can be called on any subset of ranks.
int world_rank() noexcept;

/// Checks that every rank listed is a rank of b (InvalidArgument naming the first that is not;
/// a moved-from backend has none).
void check_ranks_of(const Backend& b, const std::vector<int>& ranks, const char* what);
}  // namespace detail

// The rank helpers run f where a rank matches and return std::optional of its result (Done for
// a void f), empty elsewhere. None is a collective: each reads the rank locally, so they may be
// called on any subset of ranks.
//
// The forms taking a backend test that backend's rank (Backend::rank(), the rank in its
// communicator), which is what a program on a sub-communicator, or on one that orders the ranks
// differently, means; a rank it does not have is an InvalidArgument. The forms without one test
// the rank of the global backend (initialize<B>()), which is the MPI_COMM_WORLD rank, also
// before initialisation and after finalisation; a rank the world does not have matches nobody.

/// Runs f on the ranks listed (ranks of b).
template <class F>
auto on_rank(const Backend& b, const std::vector<int>& ranks, F&& f) {
  detail::check_ranks_of(b, ranks, "on_rank");
  return detail::run_if(detail::contains(ranks, b.rank()), std::forward<F>(f));
}
template <class F>
auto on_rank(const Backend& b, std::initializer_list<int> ranks, F&& f) {
  return on_rank(b, std::vector<int>(ranks), std::forward<F>(f));
}
template <class F>
auto on_rank(const Backend& b, int r, F&& f) {
  return on_rank(b, std::vector<int>{r}, std::forward<F>(f));
}
/// Runs f on every rank of b except those listed.
template <class F>
auto not_on_rank(const Backend& b, const std::vector<int>& ranks, F&& f) {
  detail::check_ranks_of(b, ranks, "not_on_rank");
  return detail::run_if(!detail::contains(ranks, b.rank()), std::forward<F>(f));
}
template <class F>
auto not_on_rank(const Backend& b, std::initializer_list<int> ranks, F&& f) {
  return not_on_rank(b, std::vector<int>(ranks), std::forward<F>(f));
}
template <class F>
auto not_on_rank(const Backend& b, int r, F&& f) {
  return not_on_rank(b, std::vector<int>{r}, std::forward<F>(f));
}
/// Runs f on rank 0 of b only.
template <class F>
auto rank_zero_only(const Backend& b, F&& f) {
  return on_rank(b, std::vector<int>{0}, std::forward<F>(f));
}
/// Runs f on every rank of b but 0.
template <class F>
auto rank_non_zero_only(const Backend& b, F&& f) {
  return not_on_rank(b, std::vector<int>{0}, std::forward<F>(f));
}

/// Runs f on the ranks listed (ranks of the global backend: MPI_COMM_WORLD ranks).
template <class F>
auto on_rank(const std::vector<int>& ranks, F&& f) {
  return detail::run_if(detail::contains(ranks, detail::world_rank()), std::forward<F>(f));
}
template <class F>
auto on_rank(std::initializer_list<int> ranks, F&& f) {
  return on_rank(std::vector<int>(ranks), std::forward<F>(f));
}
template <class F>
auto on_rank(int r, F&& f) {
  return on_rank(std::vector<int>{r}, std::forward<F>(f));
}
/// Runs f on every rank except those listed (MPI_COMM_WORLD ranks).
template <class F>
auto not_on_rank(const std::vector<int>& ranks, F&& f) {
  return detail::run_if(!detail::contains(ranks, detail::world_rank()), std::forward<F>(f));
}
template <class F>
auto not_on_rank(std::initializer_list<int> ranks, F&& f) {
  return not_on_rank(std::vector<int>(ranks), std::forward<F>(f));
}
/// Runs f on MPI_COMM_WORLD rank 0 only.
template <class F>
auto rank_zero_only(F&& f) {
  return on_rank(std::vector<int>{0}, std::forward<F>(f));
}
/// Runs f on every MPI_COMM_WORLD rank but 0.
template <class F>
auto rank_non_zero_only(F&& f) {
  return not_on_rank(std::vector<int>{0}, std::forward<F>(f));
}

/// Ends the whole job now, on purpose, from any one rank: prints the message with this rank's
/// number and calls MPI_Abort, which ends every rank's process. For a rank-local error that the
/// other ranks cannot see (a missing file on one node): without it they would wait for this rank
/// until the deadline. initialize<MPIBackend>() also installs it as the std::terminate handler,
/// so an exception that escapes main on any rank ends the job with its message.
[[noreturn]] void abort_job(const std::string& message, int code = 1) noexcept;

/// RAII guard after TorchOpt's auto_init_rpc: initialises MPIBackend, runs worker_init (if any),
/// waits at a barrier, and on scope exit barriers again and finalises what it initialised. Left
/// by an exception, it does neither (the other ranks are not at that barrier): the exception
/// goes on, and if nothing catches it the job ends with its message.
class AutoInit {
 public:
  explicit AutoInit(std::function<void()> worker_init = {});
  ~AutoInit();
  AutoInit(const AutoInit&) = delete;
  AutoInit& operator=(const AutoInit&) = delete;

 private:
  bool owns_ = false;
  int uncaught_ = 0;
};

}  // namespace lockstep
