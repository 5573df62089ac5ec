// NCCLBackend: the Backend interface over one NCCL communicator per rank, bootstrapped over MPI.
#include "lockstep/nccl.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/reliability/settings.hpp"
#include "comm/global_backend.hpp"  // the lifecycle of initialize<NCCLBackend>() (internal)

// cuda_bf16.h before nccl.h: older nccl.h headers declare ncclBfloat16 only when the bf16 types
// are already defined (__CUDA_BF16_TYPES_EXIST__).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>

// ncclAvg (2.10) and ncclGetLastError (2.12); CMake checks the same minimum (find_package(NCCL 2.12)).
#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 12, 0)
#error "Lockstep's NCCLBackend needs NCCL 2.12 or later (ncclAvg, ncclGetLastError)"
#endif

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::prod: return ncclProd;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::avg: return ncclAvg;  // NCCL >= 2.10 (the minimum is 2.12, checked above)
  }
  return ncclSum;
}

// The device this rank drives: an explicit choice, else LOCKSTEP_CUDA_DEVICE, else
// local_rank % device_count. Returns -1 with a reason when none is usable.
int choose_device(int requested, int local_rank, int count, std::string& why) {
  if (count <= 0) {
    why = "no CUDA device is visible to this process";
    return -1;
  }
  int d = requested;
  if (d < 0) {
    if (const char* env = std::getenv("LOCKSTEP_CUDA_DEVICE"); env != nullptr && *env != '\0') {
      char* end = nullptr;
      long v = std::strtol(env, &end, 10);
      if (end == env || *end != '\0' || v < 0) {
        why = detail::concat("LOCKSTEP_CUDA_DEVICE=\"", env, "\" is not a device index");
        return -1;
      }
      d = static_cast<int>(v);
    } else {
      d = local_rank % count;
    }
  }
  if (d >= count) {
    why = detail::concat("device ", d, " requested but only ", count, " visible");
    return -1;
  }
  return d;
}

}  // namespace

// NCCLBackend's state (its pimpl; declared in nccl.hpp, defined only here).
struct detail::NCCLBackendImpl {
  MPIBackend host;
  int device = 0;
  cuda::Stream stream;
  cuda::Event ready;  // marks the producer's work on the current stream
  ncclComm_t comm = nullptr;
  bool aborted = false;

  explicit NCCLBackendImpl(MPI_Comm c) : host(c) {}

  ~NCCLBackendImpl() {
    if (comm == nullptr) return;
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    cudaSetDevice(device);
    // Destroy waits for the communicator's work; after a failure only abort is safe (horovod).
    ncclResult_t r = aborted ? ncclSuccess : ncclCommDestroy(comm);
    if (r != ncclSuccess) {
      std::cerr << "lockstep: ncclCommDestroy failed: " << ncclGetErrorString(r) << "; aborting\n";
      ncclCommAbort(comm);
    }
    comm = nullptr;
    if (prev >= 0 && prev != device) cudaSetDevice(prev);
  }

  void do_abort() noexcept {
    if (comm != nullptr && !aborted) {
      aborted = true;
      ncclCommAbort(comm);
      comm = nullptr;
    }
    aborted = true;
  }

  /// Throws NcclError (after aborting the communicator) if `r` is not ncclSuccess.
  void check(ncclResult_t r, const char* call,
             const std::source_location& loc = std::source_location::current()) {
    if (r == ncclSuccess) return;
    std::string last = ncclGetLastError(comm);
    do_abort();
    throw NcclError(detail::concat(detail::where(loc), ": ", call, " failed: ", ncclGetErrorString(r),
                                   last.empty() ? "" : ": ", last, "; the communicator was aborted",
                                   detail::rank_suffix()),
                    static_cast<int>(r));
  }

  void check_usable(const char* what) const {
    if (aborted)
      throw Error(detail::concat(what, ": the NCCL communicator was aborted after an earlier failure",
                                 detail::rank_suffix()));
  }

  void check_device(const TensorView& v, const char* what) const {
    LOCKSTEP_CHECK_ARG(v.device.index == device, what, ": tensor on ", to_string(v.device),
                       " but this rank's NCCL communicator drives cuda:", device);
  }

  // Orders NCCL's stream after the work queued so far on the current stream of the device, so
  // that NCCL never reads a buffer a kernel is still writing.
  void begin(const char* what) {
    check_usable(what);
    ready.record(cuda::current_stream(device));
    ready.wait_on(stream.get());
  }

  // Waits for `query` (a stream or an event) while polling NCCL for asynchronous errors, so a
  // peer's failure surfaces as NcclError rather than a hang. The wait is bounded by the
  // collective deadline (lockstep::timeout(), LOCKSTEP_TIMEOUT, 600 s by default; 0: none): a
  // peer that died or never called the collective produces no asynchronous error, so past the
  // deadline the communicator is aborted and TimeoutError thrown. The other ranks in the
  // collective then see an asynchronous error from the abort, or reach their own deadline:
  // each of them throws too, none waits forever.
  template <class Query>
  void wait_polling(Query&& query, const char* what = "an NCCL operation") {
    const double limit = lockstep::timeout();
    const auto start = std::chrono::steady_clock::now();
    double waited = 0;  // seconds, updated every 1024 polls
    for (std::uint64_t spins = 0;; ++spins) {
      check_usable("waiting for an NCCL operation");
      cudaError_t e = query();
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) cuda::detail::check_cuda(e, "waiting for an NCCL operation");
      ncclResult_t async = ncclSuccess;
      check(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError");
      check(async, "an NCCL operation (asynchronous error)");
      if ((spins & 1023) == 0)
        waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (limit > 0 && waited > limit) {
        do_abort();
        throw TimeoutError(detail::concat(
            "NCCLBackend: ", what, " did not complete within ", limit,
            " s (lockstep::timeout(), LOCKSTEP_TIMEOUT); a peer may have died or not called it. "
            "The NCCL communicator was aborted",
            detail::rank_suffix()));
      }
      // Spin (yielding) for the first 10 ms, which keeps short collectives fast; after that a
      // long wait sleeps between polls instead of taking a core.
      if (waited > 0.01) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else std::this_thread::yield();
    }
  }

  void finish_blocking() {
    cudaStream_t s = stream.get();
    wait_polling([s] { return cudaStreamQuery(s); });
  }
};

#define LOCKSTEP_NCCL_CHECK(impl, call) (impl).check((call), #call)

namespace {

class NcclRequest final : public detail::RequestImpl {
 public:
  NcclRequest(std::shared_ptr<detail::NCCLBackendImpl> impl, cuda::Event done)
      : impl_(std::move(impl)), done_(std::move(done)) {}
  void wait() override {
    if (finished_) return;
    cudaEvent_t e = done_.get();
    impl_->wait_polling([e] { return cudaEventQuery(e); }, "a nonblocking NCCL operation");
    finished_ = true;
  }
  bool test() override {
    if (finished_) return true;
    cudaError_t e = cudaEventQuery(done_.get());
    if (e == cudaErrorNotReady) {
      ncclResult_t async = ncclSuccess;
      impl_->check(ncclCommGetAsyncError(impl_->comm, &async), "ncclCommGetAsyncError");
      impl_->check(async, "an NCCL operation (asynchronous error)");
      return false;
    }
    cuda::detail::check_cuda(e, "cudaEventQuery");
    finished_ = true;
    return true;
  }

 private:
  std::shared_ptr<detail::NCCLBackendImpl> impl_;
  cuda::Event done_;
  bool finished_ = false;
};

// Records completion of the work queued on NCCL's stream in a fresh event owned by the request.
Request make_request(const std::shared_ptr<detail::NCCLBackendImpl>& impl) {
  cuda::Event done = cuda::Event::create(impl->device);
  done.record(impl->stream.get());
  return Request(std::make_unique<NcclRequest>(impl, std::move(done)));
}

enum class Wait { blocking, nonblocking };

// Issues one collective over cuda tensors (the front end of Backend has checked the arguments):
// `v` must be on this rank's device; unless `numel` is 0, makes that device current, orders
// NCCL's stream after the work queued so far on the current stream, and issues
// `call(comm, stream)` (`name`: the NCCL function, for the error). Blocking: waits for it
// (polling NCCL's asynchronous errors and the deadline) and returns an empty Request;
// nonblocking: returns a Request tied to an event recorded after it.
template <class Call>
Request issue(const std::shared_ptr<detail::NCCLBackendImpl>& impl, const char* what, const TensorView& v,
              std::int64_t numel, Wait wait, const char* name, Call&& call,
              const std::source_location& loc = std::source_location::current()) {
  detail::NCCLBackendImpl& im = *impl;
  im.check_device(v, what);
  if (numel == 0) return Request();
  cuda::DeviceGuard g(im.device);
  im.begin(what);
  im.check(call(im.comm, im.stream.get()), name, loc);
  if (wait == Wait::nonblocking) return make_request(impl);
  im.finish_blocking();
  return Request();
}

std::size_t count(const TensorView& v) { return static_cast<std::size_t>(v.numel); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Construction: the unique id travels over MPI
// ---------------------------------------------------------------------------------------------
NCCLBackend::NCCLBackend(MPI_Comm comm, Options options) : impl_(std::make_shared<detail::NCCLBackendImpl>(comm)) {
  cuda::init();
  detail::NCCLBackendImpl& im = *impl_;
  MPI_Comm mc = im.host.comm();
  std::string why;
  const int count = cuda::device_count();
  im.device = choose_device(options.device, im.host.local_rank(), count, why);

  // Every rank learns whether every rank has a device before anyone enters NCCL, so that a
  // rank without one does not leave the others waiting in ncclCommInitRank.
  int ok = im.device >= 0 ? 1 : 0, all_ok = 0;
  LOCKSTEP_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, mc));
  if (!all_ok)
    throw Error(detail::concat("NCCLBackend: ",
                               ok ? "another rank has no usable CUDA device" : why.c_str(),
                               detail::rank_suffix()));

  // This rank's device becomes its current device and stays so (as in PyTorch and Horovod):
  // restoring the previous one would leave every rank's later work, and a CUDA context, on
  // device 0.
  cuda::set_device(im.device);
  im.stream = cuda::Stream::create(im.device, /*non_blocking=*/true);
  im.ready = cuda::Event::create(im.device);

  struct {
    int ok;
    ncclUniqueId id;
  } boot{};
  if (im.host.rank() == 0) {
    ncclResult_t r = ncclGetUniqueId(&boot.id);
    boot.ok = r == ncclSuccess ? 1 : 0;
    if (r != ncclSuccess) why = detail::concat("ncclGetUniqueId failed: ", ncclGetErrorString(r));
  }
  LOCKSTEP_MPI_CHECK(MPI_Bcast(&boot, static_cast<int>(sizeof boot), MPI_BYTE, 0, mc));
  if (!boot.ok)
    throw NcclError(detail::concat("NCCLBackend: ", im.host.rank() == 0 ? why : "rank 0 could not create the NCCL id",
                                   detail::rank_suffix()),
                    static_cast<int>(ncclSystemError));

  ncclResult_t r = ncclCommInitRank(&im.comm, im.host.size(), boot.id, im.host.rank());
  std::string init_error;
  if (r != ncclSuccess) {
    init_error = detail::concat("ncclCommInitRank failed: ", ncclGetErrorString(r), ": ",
                                ncclGetLastError(nullptr));
    im.comm = nullptr;
  }
  ok = r == ncclSuccess ? 1 : 0;
  LOCKSTEP_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, mc));
  if (!all_ok) {
    im.do_abort();
    throw NcclError(detail::concat("NCCLBackend: ", ok ? "another rank failed to join the communicator" : init_error,
                                   detail::rank_suffix()),
                    static_cast<int>(r == ncclSuccess ? ncclSystemError : r));
  }
}

NCCLBackend::~NCCLBackend() = default;
NCCLBackend::NCCLBackend(NCCLBackend&&) noexcept = default;
NCCLBackend& NCCLBackend::operator=(NCCLBackend&&) noexcept = default;

int NCCLBackend::rank() const { return impl_->host.rank(); }
int NCCLBackend::size() const { return impl_->host.size(); }
int NCCLBackend::local_rank() const { return impl_->host.local_rank(); }
int NCCLBackend::local_size() const { return impl_->host.local_size(); }
int NCCLBackend::device() const noexcept { return impl_->device; }
cudaStream_t NCCLBackend::stream() const noexcept { return impl_->stream.get(); }
MPIBackend& NCCLBackend::host_backend() noexcept { return impl_->host; }
bool NCCLBackend::aborted() const noexcept { return impl_->aborted; }
void NCCLBackend::abort() noexcept { impl_->do_abort(); }

// ---------------------------------------------------------------------------------------------
// Collectives: cpu tensors go to the host backend, cuda tensors to NCCL. The front end of
// Backend has checked roots, counts, dtypes, devices and overlap; what is left here is whether
// a cuda tensor is on this rank's device.
// ---------------------------------------------------------------------------------------------
void NCCLBackend::do_broadcast(TensorView buf, int root) {
  if (buf.device.is_cpu()) return impl_->host.broadcast(buf, root);
  (void)issue(impl_, "broadcast", buf, buf.numel, Wait::blocking, "ncclBroadcast", [&](ncclComm_t c, cudaStream_t s) {
    return ncclBroadcast(buf.data, buf.data, count(buf), nccl_type(buf.dtype), root, c, s);
  });
}

void NCCLBackend::do_allreduce(TensorView buf, ReduceOp op) {
  if (buf.device.is_cpu()) return impl_->host.allreduce(buf, op);
  (void)issue(impl_, "allreduce", buf, buf.numel, Wait::blocking, "ncclAllReduce", [&](ncclComm_t c, cudaStream_t s) {
    return ncclAllReduce(buf.data, buf.data, count(buf), nccl_type(buf.dtype), nccl_op(op), c, s);
  });
}

void NCCLBackend::do_allreduce(TensorView send, TensorView recv, ReduceOp op) {
  if (send.device.is_cpu()) return impl_->host.allreduce(send, recv, op);
  (void)issue(impl_, "allreduce", send, send.numel, Wait::blocking, "ncclAllReduce", [&](ncclComm_t c, cudaStream_t s) {
    return ncclAllReduce(send.data, recv.data, count(send), nccl_type(send.dtype), nccl_op(op), c, s);
  });
}

void NCCLBackend::do_reduce(TensorView buf, ReduceOp op, int root) {
  if (buf.device.is_cpu()) return impl_->host.reduce(buf, op, root);
  // In place on the root; NCCL does not write recvbuff on the other ranks.
  (void)issue(impl_, "reduce", buf, buf.numel, Wait::blocking, "ncclReduce", [&](ncclComm_t c, cudaStream_t s) {
    return ncclReduce(buf.data, buf.data, count(buf), nccl_type(buf.dtype), nccl_op(op), root, c, s);
  });
}

void NCCLBackend::do_reduce(TensorView send, TensorView recv, ReduceOp op, int root) {
  // recv is empty (null) on the ranks other than root.
  if (send.device.is_cpu()) return impl_->host.reduce(send, recv, op, root);
  (void)issue(impl_, "reduce", send, send.numel, Wait::blocking, "ncclReduce", [&](ncclComm_t c, cudaStream_t s) {
    return ncclReduce(send.data, rank() == root ? recv.data : nullptr, count(send), nccl_type(send.dtype),
                      nccl_op(op), root, c, s);
  });
}

void NCCLBackend::do_allgather(TensorView send, TensorView recv) {
  if (send.device.is_cpu()) return impl_->host.allgather(send, recv);
  // In place (send is this rank's block of recv) is NCCL's own in-place form.
  (void)issue(impl_, "allgather", send, send.numel, Wait::blocking, "ncclAllGather", [&](ncclComm_t c, cudaStream_t s) {
    return ncclAllGather(send.data, recv.data, count(send), nccl_type(send.dtype), c, s);
  });
}

void NCCLBackend::do_reduce_scatter(TensorView send, TensorView recv, ReduceOp op) {
  if (send.device.is_cpu()) return impl_->host.reduce_scatter(send, recv, op);
  // In place (recv is this rank's block of send) is NCCL's own in-place form.
  (void)issue(impl_, "reduce_scatter", send, recv.numel, Wait::blocking, "ncclReduceScatter",
        [&](ncclComm_t c, cudaStream_t s) {
          return ncclReduceScatter(send.data, recv.data, count(recv), nccl_type(send.dtype), nccl_op(op), c, s);
        });
}

void NCCLBackend::do_barrier() {
  impl_->check_usable("barrier");
  impl_->host.barrier();
}

Request NCCLBackend::do_iallreduce(TensorView buf, ReduceOp op) {
  if (buf.device.is_cpu()) return impl_->host.iallreduce(buf, op);
  return issue(impl_, "iallreduce", buf, buf.numel, Wait::nonblocking, "ncclAllReduce",
               [&](ncclComm_t c, cudaStream_t s) {
                 return ncclAllReduce(buf.data, buf.data, count(buf), nccl_type(buf.dtype), nccl_op(op), c, s);
               });
}

Request NCCLBackend::do_ibroadcast(TensorView buf, int root) {
  if (buf.device.is_cpu()) return impl_->host.ibroadcast(buf, root);
  return issue(impl_, "ibroadcast", buf, buf.numel, Wait::nonblocking, "ncclBroadcast",
               [&](ncclComm_t c, cudaStream_t s) {
                 return ncclBroadcast(buf.data, buf.data, count(buf), nccl_type(buf.dtype), root, c, s);
               });
}

namespace {
// Host if every buffer is on the host, device if every one is on cuda; mixed is refused.
bool all_on_host(std::span<const TensorView> bufs, const char* what) {
  std::size_t host = 0;
  for (const auto& b : bufs) host += b.device.is_cpu() ? 1 : 0;
  LOCKSTEP_CHECK_ARG(host == 0 || host == bufs.size(), what,
                     ": buffers must be all on the host or all on the device; ", host, " of ", bufs.size(),
                     " are on the host");
  return !bufs.empty() && host == bufs.size();
}
}  // namespace

void NCCLBackend::allreduce_many(std::span<const TensorView> bufs, ReduceOp op) {
  Request r = iallreduce_many(bufs, op);
  r.wait();
}

Request NCCLBackend::do_iallreduce_many(std::span<const TensorView> bufs, ReduceOp op) {
  detail::NCCLBackendImpl& im = *impl_;
  // MPI has no group call; the host requests are issued together and completed together.
  if (all_on_host(bufs, "iallreduce_many")) return im.host.iallreduce_many(bufs, op);
  bool any = false;
  for (const auto& b : bufs) {
    im.check_device(b, "iallreduce_many");
    any = any || b.numel > 0;
  }
  if (!any) return Request();
  cuda::DeviceGuard g(im.device);
  im.begin("iallreduce_many");
  LOCKSTEP_NCCL_CHECK(im, ncclGroupStart());
  for (const auto& b : bufs) {
    if (b.numel == 0) continue;
    ncclResult_t r = ncclAllReduce(b.data, b.data, static_cast<std::size_t>(b.numel), nccl_type(b.dtype),
                                   nccl_op(op), im.comm, im.stream.get());
    if (r != ncclSuccess) {
      ncclGroupEnd();  // leave the group before aborting, so NCCL's group state is not left open
      LOCKSTEP_NCCL_CHECK(im, r);
    }
  }
  LOCKSTEP_NCCL_CHECK(im, ncclGroupEnd());
  return make_request(impl_);
}

// ---------------------------------------------------------------------------------------------
// The global backend behind initialize<NCCLBackend>()
// ---------------------------------------------------------------------------------------------
namespace {
constinit detail::GlobalBackend<NCCLBackend> g_global{"NCCLBackend", "NCCL"};
}  // namespace

void NCCLBackend::initialize_global() {
  // MPI first (outside our lock): its at-exit finalisation is then registered before ours, and
  // at exit ours runs first, destroying the NCCL communicator while MPI is still alive.
  MPIBackend::initialize_global();
  cuda::init();
  g_global.initialize([] { return std::make_unique<NCCLBackend>(MPI_COMM_WORLD); });
}

bool NCCLBackend::initialized_global() noexcept { return g_global.initialized(); }

NCCLBackend& NCCLBackend::global() { return g_global.get(); }

void NCCLBackend::finalize_global() { g_global.finalize(); }

}  // namespace lockstep
