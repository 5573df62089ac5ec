// MPIBackend's nonblocking collectives (iallreduce, ibroadcast): MPI requests issued in chunks,
// device memory staged through pinned memory the request owns, and the Request that waits for
// them with the deadline and finishes the call (avg's division, the copy back to the device).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mpi/keep_for_process.hpp"
#include "mpi/mpi_backend_impl.hpp"

namespace lockstep {

namespace {
// Host memory that a nonblocking device operation stages through; held by the request (the
// backend's shared staging buffer may be reused before the request completes) and returned to
// the backend's pool when the request ends.
class OwnedPinned {
 public:
  OwnedPinned(std::shared_ptr<mpib::PinnedPool> pool, std::size_t bytes) : pool_(std::move(pool)) {
    p_ = pool_->take(bytes, cls_);
  }
  ~OwnedPinned() { pool_->give(p_, cls_); }
  OwnedPinned(const OwnedPinned&) = delete;
  OwnedPinned& operator=(const OwnedPinned&) = delete;
  void* get() const { return p_; }

 private:
  std::shared_ptr<mpib::PinnedPool> pool_;
  void* p_ = nullptr;
  std::size_t cls_ = 0;
};

// One nonblocking operation: its MPI requests (several above the int count limit) and what to
// do once they complete (avg scaling, copying a staged buffer back to the device).
class MpiRequest final : public detail::RequestImpl {
 public:
  MpiRequest(std::vector<MPI_Request> reqs, TensorView host, TensorView device, int avg_divisor,
             std::unique_ptr<OwnedPinned> staging, detail::RequestWatch watch)
      : reqs_(std::move(reqs)), host_(host), device_(device), avg_divisor_(avg_divisor),
        staging_(std::move(staging)), watch_(std::move(watch)) {}
  // A request whose wait threw (a deadline, a stall elsewhere) may still be written by MPI: its
  // staging memory is then kept for the life of the process, never handed back to the pool for
  // another request. (The caller's own tensor is the caller's: docs/reliability.md.)
  ~MpiRequest() override {
    if (!done_ && staging_) detail::keep_for_process(std::shared_ptr<OwnedPinned>(std::move(staging_)));
  }

  void wait() override {
    if (done_) return;
    const int rc = watch_.wait_all(reqs_);  // reliability hook: MPI_Waitall with the deadline
    if (rc != MPI_SUCCESS) {
      // What failed is the user's collective (its call site is not current in wait()).
      std::string what;
      try {
        detail::check_mpi(rc, "MPI_Waitall");
      } catch (const MpiError& e) {
        what = e.what();
      }
      const auto at = what.find(" failed in MPI: ");
      MpiError error(detail::concat("the wait for ", watch_.describe(),
                                    at == std::string::npos ? what : what.substr(at)),
                     rc);
      watch_.report(error.what(), rc);  // reliability hook: the other ranks are told
      throw error;
    }
    finish();
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    try {
      LOCKSTEP_MPI_CHECK(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE));
    } catch (const MpiError& e) {
      watch_.report(e.what(), e.code());
      throw;
    }
    if (flag) finish();
    return flag != 0;
  }

 private:
  void finish() {
    done_ = true;
    if (avg_divisor_ > 0) mpib::scale_host(host_, avg_divisor_);
    if (device_.data != nullptr && host_.data != device_.data)
      device_runtime("MPIBackend with a cuda tensor")
          .copy(device_.data, device_.device, host_.data, Device::cpu(), device_.nbytes());
  }
  std::vector<MPI_Request> reqs_;
  TensorView host_, device_;
  int avg_divisor_;
  std::unique_ptr<OwnedPinned> staging_;
  detail::RequestWatch watch_;  // reliability hook: deadline, pending count
  bool done_ = false;
};

// Issues nonblocking MPI calls over `host` in chunks of at most kMaxChunk elements (one call
// for an empty buffer, so that every rank issues the same number of calls).
template <class Issue>
std::vector<MPI_Request> issue_chunks(TensorView host, Issue&& issue) {
  std::vector<MPI_Request> reqs;
  const std::size_t es = size_of(host.dtype);
  std::int64_t off = 0;
  do {
    int c = static_cast<int>(std::min(mpib::kMaxChunk, host.numel - off));
    MPI_Request r;
    issue(static_cast<char*>(host.data) + off * es, c, &r);
    reqs.push_back(r);
    off += mpib::kMaxChunk;
  } while (off < host.numel);
  return reqs;
}

// For a device buffer: synchronises its device, and unless MPI is CUDA-aware returns a pinned
// copy of it (with its contents when copy_in) that the request owns.
std::unique_ptr<OwnedPinned> stage_nonblocking(detail::MPIBackendImpl& impl, TensorView buf, bool copy_in,
                                               TensorView& host) {
  host = buf;
  if (buf.device.is_cpu()) return nullptr;
  DeviceRuntime& rt = device_runtime("MPIBackend with a cuda tensor");
  mpib::wait_for_producer(rt, buf.device.index, /*direct=*/false);  // see Staged
  // Always staged, CUDA-aware MPI or not: Open MPI's CUDA support covers only some blocking
  // calls, and the request's finish (the avg division) runs on the host.
  (void)impl.cuda_aware;
  auto pinned = std::make_unique<OwnedPinned>(impl.pinned_pool, buf.nbytes());
  host.data = pinned->get();
  host.device = Device::cpu();
  if (copy_in) rt.copy(host.data, Device::cpu(), buf.data, buf.device, buf.nbytes());
  return pinned;
}

}  // namespace

Request MPIBackend::do_iallreduce(TensorView buf, ReduceOp op) try {
  op = mpib::one_rank_op(op, impl_ ? impl_->size : 0);
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::iallreduce, &buf, buf.numel,
                                static_cast<int>(op), -1);  // reliability hook
  if (guard.skipped()) return Request();
  TensorView host;
  auto staging = stage_nonblocking(*impl_, buf, true, host);
  MPI_Datatype dt = mpib::mpi_type(buf.dtype);
  MPI_Op mop = mpib::mpi_op(op, buf.dtype);
  MPI_Comm comm = impl_->comm;
  auto reqs = issue_chunks(host, [&](void* p, int c, MPI_Request* r) {
    LOCKSTEP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, p, c, dt, mop, comm, r));
  });
  return Request(std::make_unique<MpiRequest>(std::move(reqs), host, staging ? buf : TensorView{},
                                              op == ReduceOp::avg ? impl_->size : 0, std::move(staging),
                                              detail::watch_request(impl_->monitor)));
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

Request MPIBackend::do_ibroadcast(TensorView buf, int root) try {
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::ibroadcast, &buf, buf.numel, -1,
                                root);  // reliability hook
  if (guard.skipped()) return Request();
  TensorView host;
  auto staging = stage_nonblocking(*impl_, buf, impl_->rank == root, host);
  MPI_Datatype dt = mpib::mpi_type(buf.dtype);
  MPI_Comm comm = impl_->comm;
  auto reqs = issue_chunks(host, [&](void* p, int c, MPI_Request* r) {
    LOCKSTEP_MPI_CHECK(MPI_Ibcast(p, c, dt, root, comm, r));
  });
  return Request(std::make_unique<MpiRequest>(std::move(reqs), host, staging ? buf : TensorView{}, 0,
                                              std::move(staging), detail::watch_request(impl_->monitor)));
} catch (const MpiError& e) {
  mpib::report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

}  // namespace lockstep
