// MPIBackend: every collective of the Backend interface over one duplicated MPI communicator.
#include "lockstep/mpi/mpi_backend.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <map>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <csignal>
#include <signal.h>
#include <exception>
#include <thread>
#include <iostream>
#include <mutex>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

// Open MPI's extensions (MPIX_CUDA_AWARE_SUPPORT, MPIX_Query_cuda_support), as its
// documentation includes them: every Open MPI has the header, other MPIs have neither.
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif

#include "lockstep/core/device_runtime.hpp"
#include "lockstep/mpi/world.hpp"
#include "core/env.hpp"
#include "mpi/finalize_hooks.hpp"
#include "mpi/monitor.hpp"  // reliability hooks (fingerprints, deadlines, fault injection)
#include "mpi/shm/shm_collectives.hpp"  // node-local allreduce and broadcast through shared memory
#include "mpi/hierarchical.hpp"  // allreduce across machines: shared memory within, MPI between
#include "core/wire16.hpp"

namespace lockstep {

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------
namespace detail {
void check_mpi(int code, const char* call, const std::source_location& loc) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(code, text, &len);
  int cls = code;
  MPI_Error_class(code, &cls);
  char cls_text[MPI_MAX_ERROR_STRING] = {};
  MPI_Error_string(cls, cls_text, &len);
  // MPI's text once (Open MPI's error string already starts with its class's).
  std::string what = text;
  if (what.find(cls_text) == std::string::npos) what = concat(cls_text, ": ", text);
  // What the user called and where (recorded by the Backend front end); the internal call only
  // when no collective is running.
  const std::string site = t_call_site.known ? describe_call_site() : concat(call, " at ", where(loc));
  throw MpiError(concat(site, " failed in MPI: ", what, rank_suffix()), code);
}
}  // namespace detail

namespace {

// ---------------------------------------------------------------------------------------------
// Datatypes and reduction operators, f16/bf16 through user-defined operators
// ---------------------------------------------------------------------------------------------
MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16: return MPI_UINT16_T;
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u8: return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

template <class Storage, ReduceOp Op>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const Storage*>(in);
  auto* b = static_cast<Storage*>(inout);
  if constexpr (Op == ReduceOp::sum) {
    // The sum (what compressed gradients use), in blocks converted with the vector loops of
    // wire16.hpp: several times faster than a conversion call per element.
    constexpr DType w = std::is_same_v<Storage, half> ? DType::f16 : DType::bf16;
    constexpr int kBlock = 512;
    float x[kBlock], y[kBlock];
    for (int i0 = 0; i0 < *len; i0 += kBlock) {
      const int m = std::min(kBlock, *len - i0);
      detail::from_wire16(w, a + i0, x, m, 1.0f);
      detail::from_wire16(w, b + i0, y, m, 1.0f);
      for (int i = 0; i < m; ++i) x[i] += y[i];
      detail::to_wire16(w, x, b + i0, m);
    }
    return;
  }
  for (int i = 0; i < *len; ++i) {
    float x = to_float(a[i]), y = to_float(b[i]), r;
    if constexpr (Op == ReduceOp::sum) r = x + y;
    else if constexpr (Op == ReduceOp::prod) r = x * y;
    else if constexpr (Op == ReduceOp::min) r = std::min(x, y);
    else r = std::max(x, y);
    if constexpr (std::is_same_v<Storage, half>) b[i] = to_half(r);
    else b[i] = to_bfloat16(r);
  }
}

// The user-defined operators live as long as MPI does: created on first use, freed by
// finalize_global(). A mutex rather than std::once_flag, because when the user owns MPI the
// global backend can be finalised and initialised again, and the operators must come back.
struct HalfOps {
  std::array<MPI_Op, 4> f16{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  std::array<MPI_Op, 4> bf16{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  std::mutex mutex;
  bool created = false;

  MPI_Op get(DType t, int idx) {
    std::lock_guard lock(mutex);
    if (!created) {
      MPI_User_function* fns16[4] = {half_op<half, ReduceOp::sum>, half_op<half, ReduceOp::prod>,
                                     half_op<half, ReduceOp::min>, half_op<half, ReduceOp::max>};
      MPI_User_function* fnsbf[4] = {half_op<bfloat16, ReduceOp::sum>, half_op<bfloat16, ReduceOp::prod>,
                                     half_op<bfloat16, ReduceOp::min>, half_op<bfloat16, ReduceOp::max>};
      for (int i = 0; i < 4; ++i) {
        LOCKSTEP_MPI_CHECK(MPI_Op_create(fns16[i], 1, &f16[i]));
        LOCKSTEP_MPI_CHECK(MPI_Op_create(fnsbf[i], 1, &bf16[i]));
      }
      created = true;
    }
    return t == DType::f16 ? f16[idx] : bf16[idx];
  }
  void free_all() noexcept {
    std::lock_guard lock(mutex);
    for (auto* ops : {&f16, &bf16})
      for (auto& op : *ops)
        if (op != MPI_OP_NULL) MPI_Op_free(&op);
    created = false;
  }
};
HalfOps g_half_ops;

MPI_Op mpi_op(ReduceOp op, DType t) {
  int idx = op == ReduceOp::avg ? 0 : static_cast<int>(op);
  if (t == DType::f16 || t == DType::bf16) return g_half_ops.get(t, idx);
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;
    case ReduceOp::prod: return MPI_PROD;
    case ReduceOp::min: return MPI_MIN;
    case ReduceOp::max: return MPI_MAX;
  }
  return MPI_OP_NULL;
}

// At one rank the mean is the sum, which is the data itself: no pass over the buffer, no staging.
ReduceOp one_rank_op(ReduceOp op, int size) noexcept {
  return op == ReduceOp::avg && size == 1 ? ReduceOp::sum : op;
}

// Divides every element by n (host memory), for avg.
void scale_host(TensorView v, int n) {
  switch (v.dtype) {
    case DType::f32: {
      // avg equals sum / n exactly: a multiplication by 1/n only when n is a power of two (then
      // it is exact, and several times cheaper), a division otherwise.
      float* p = static_cast<float*>(v.data);
      if ((n & (n - 1)) == 0)
        for (std::int64_t i = 0; i < v.numel; ++i) p[i] *= 1.0f / static_cast<float>(n);
      else
        for (std::int64_t i = 0; i < v.numel; ++i) p[i] /= static_cast<float>(n);
      break;
    }
    case DType::f64: {
      double* p = static_cast<double*>(v.data);
      if ((n & (n - 1)) == 0)
        for (std::int64_t i = 0; i < v.numel; ++i) p[i] *= 1.0 / static_cast<double>(n);
      else
        for (std::int64_t i = 0; i < v.numel; ++i) p[i] /= static_cast<double>(n);
      break;
    }
    case DType::f16: {
      half* p = static_cast<half*>(v.data);
      for (std::int64_t i = 0; i < v.numel; ++i) p[i] = to_half(to_float(p[i]) / static_cast<float>(n));
      break;
    }
    case DType::bf16: {
      bfloat16* p = static_cast<bfloat16*>(v.data);
      for (std::int64_t i = 0; i < v.numel; ++i)
        p[i] = to_bfloat16(to_float(p[i]) / static_cast<float>(n));
      break;
    }
    default: break;  // rejected earlier by check_op_for_dtype
  }
}

// Whether MPI reduces this dtype itself (f16 and bf16 go through user-defined operators that
// run on the host, so their device buffers are staged even with CUDA-aware MPI).
bool is_mpi_native(DType t) { return t != DType::f16 && t != DType::bf16; }

// Largest element count handed to one MPI call (MPI counts are int).
constexpr std::int64_t kMaxChunk = std::int64_t{1} << 30;

// ---------------------------------------------------------------------------------------------
// Device memory: handed to MPI directly when MPI is CUDA-aware, else staged through pinned host
// buffers from one pool. The producing stream is synchronised first either way.
// ---------------------------------------------------------------------------------------------
// What MPI says about itself; LOCKSTEP_CUDA_AWARE_MPI overrides it (read with the settings).
bool detect_cuda_aware() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

// Pinned host buffers that stage device memory, reused across calls: cudaMallocHost
// costs far more than most collectives it would stage. Power-of-two size classes. Shared by the
// backend and its pending requests (a request may outlive the backend).
class PinnedPool {
 public:
  PinnedPool() = default;
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  ~PinnedPool() {
    DeviceRuntime* rt = find_device_runtime();
    for (auto& [cls, list] : free_)
      for (void* p : list)
        if (rt != nullptr) rt->deallocate_pinned(p);
  }
  /// A buffer of at least `bytes` bytes; `cls` receives its size class for give().
  void* take(std::size_t bytes, std::size_t& cls) {
    cls = std::bit_ceil(std::max<std::size_t>(bytes, 4096));
    {
      std::lock_guard lock(mutex_);
      auto& list = free_[cls];
      if (!list.empty()) {
        void* p = list.back();
        list.pop_back();
        return p;
      }
    }
    return device_runtime("MPIBackend with a cuda tensor").allocate_pinned(cls);
  }
  /// Returns a buffer from take() for reuse.
  void give(void* p, std::size_t cls) noexcept {
    try {
      std::lock_guard lock(mutex_);
      free_[cls].push_back(p);
    } catch (...) {
      if (auto* rt = find_device_runtime()) rt->deallocate_pinned(p);
    }
  }

 private:
  std::mutex mutex_;
  std::map<std::size_t, std::vector<void*>> free_;
};

}  // namespace

// MPIBackend's state (its pimpl; declared in mpi_backend.hpp, defined only here).
struct detail::MPIBackendImpl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  bool cuda_aware = false;

  // Pinned host buffers that stage device memory (blocking and nonblocking operations alike).
  std::shared_ptr<PinnedPool> pinned_pool = std::make_shared<PinnedPool>();

  // Reliability hook: sequence numbers, fingerprints, deadlines (src/mpi/monitor.cpp).
  detail::CommMonitorPtr monitor;

  // Large host allreduce and broadcast when every rank is on this machine (null otherwise).
  std::unique_ptr<detail::ShmCollectives> shm;
  // Host allreduce when the ranks span machines with the same number (>= 2) on each (null
  // otherwise, and whenever shm is set).
  std::unique_ptr<detail::HierarchicalAllreduce> hier;

  ~MPIBackendImpl() {
    // Reliability hook: after a stall or with requests still pending, MPI may still progress
    // operations on comm (MPI_Finalize does), so it is leaked rather than freed under them.
    const bool keep_comm = monitor && !detail::safe_to_free(*monitor);
    if (keep_comm)
      std::cerr << "lockstep: MPIBackend destroyed after a stall or with " << detail::pending_requests(*monitor)
                << " nonblocking request(s) pending; its communicator is left allocated\n";
    monitor.reset();  // stops its watchdog thread before the communicators go
    int fin = 0;
    MPI_Finalized(&fin);
    if (comm != MPI_COMM_NULL && !fin && !keep_comm) MPI_Comm_free(&comm);
  }
};

namespace {

// Before a device buffer is read by MPI (`direct`: a CUDA-aware MPI reads the device memory
// itself) or by a staging copy, the producer's writes must be complete. In general the whole
// device is synchronised, whatever stream produced the buffer (Flux.jl issue #2591: wrong
// averages without it). Inside a detail::StreamOrderedScope (GradientReducer's buckets) the
// buffer was written on the current stream: a staging copy, queued on that stream, follows it
// without any wait, and a direct read waits for that stream alone.
void wait_for_producer(DeviceRuntime& rt, int index, bool direct) {
  if (!detail::stream_ordered()) rt.synchronize(index);
  else if (direct) rt.synchronize_stream(index);
}

// A host-side stand-in for a view during one blocking collective. For host views it is the
// view itself; for device views it is either the device pointer (CUDA-aware MPI) or a pinned
// host buffer from the backend's pool, copied in before and out after, and given back to the
// pool at the end of the call.
class Staged {
 public:
  /// `host_work`: the call does work of its own on the buffer on the host (the avg division,
  /// the f16/bf16 operators, a local copy), so device memory is staged even with CUDA-aware MPI.
  Staged(detail::MPIBackendImpl& impl, TensorView v, bool copy_in, bool host_work = false)
      : pool_(impl.pinned_pool), orig_(v), host_(v) {
    if (v.device.is_cpu()) return;
    DeviceRuntime& rt = device_runtime("MPIBackend with a cuda tensor");
    const bool direct = impl.cuda_aware && !host_work;
    wait_for_producer(rt, v.device.index, direct);
    if (direct) return;
    host_.device = Device::cpu();
    host_.data = pool_->take(v.nbytes(), cls_);
    staged_ = true;
    if (copy_in) rt.copy(host_.data, Device::cpu(), v.data, v.device, v.nbytes());
  }
  ~Staged() {
    if (staged_) pool_->give(host_.data, cls_);
  }
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  /// The view MPI works on.
  TensorView host() const { return host_; }
  void copy_out() {
    if (staged_)
      device_runtime("MPIBackend with a cuda tensor")
          .copy(orig_.data, orig_.device, host_.data, Device::cpu(), orig_.nbytes());
  }

 private:
  std::shared_ptr<PinnedPool> pool_;
  TensorView orig_, host_;
  std::size_t cls_ = 0;
  bool staged_ = false;
};


void chunked_allreduce(MPI_Comm comm, const void* send, void* recv, std::int64_t n, DType t, ReduceOp op) {
  MPI_Datatype dt = mpi_type(t);
  MPI_Op mop = mpi_op(op, t);
  const std::size_t es = size_of(t);
  for (std::int64_t off = 0; off < n; off += kMaxChunk) {
    int c = static_cast<int>(std::min(kMaxChunk, n - off));
    void* r = static_cast<char*>(recv) + off * es;
    const void* s = send == MPI_IN_PLACE ? MPI_IN_PLACE : static_cast<const char*>(send) + off * es;
    LOCKSTEP_MPI_CHECK(detail::guarded_allreduce(s, r, c, dt, mop, comm));
  }
}

void chunked_bcast(MPI_Comm comm, void* buf, std::int64_t n, DType t, int root) {
  const std::size_t es = size_of(t);
  for (std::int64_t off = 0; off < n; off += kMaxChunk) {
    int c = static_cast<int>(std::min(kMaxChunk, n - off));
    LOCKSTEP_MPI_CHECK(detail::guarded_bcast(static_cast<char*>(buf) + off * es, c, mpi_type(t), root, comm));
  }
}

void chunked_reduce(MPI_Comm comm, const void* send, void* recv, std::int64_t n, DType t, ReduceOp op,
               int root, int rank) {
  MPI_Datatype dt = mpi_type(t);
  MPI_Op mop = mpi_op(op, t);
  const std::size_t es = size_of(t);
  for (std::int64_t off = 0; off < n; off += kMaxChunk) {
    int c = static_cast<int>(std::min(kMaxChunk, n - off));
    const void* s;
    if (send == MPI_IN_PLACE) {
      // In place: root passes MPI_IN_PLACE, the others their buffer as send.
      s = rank == root ? MPI_IN_PLACE : static_cast<const char*>(recv) + off * es;
    } else {
      s = static_cast<const char*>(send) + off * es;
    }
    void* r = recv == nullptr ? nullptr : static_cast<char*>(recv) + off * es;
    LOCKSTEP_MPI_CHECK(detail::guarded_reduce(s, r, c, dt, mop, root, comm));
  }
}

// A setting of the hierarchical path, read here (not among the reliability settings): parsed on
// each rank, then agreed over comm, so that a malformed value, a value this build refuses, or
// values that differ between ranks are the same InvalidArgument on every rank. `parse` returns
// the value or nullopt when unset, and may throw InvalidArgument.
template <class Parse>
std::int64_t agreed_setting(MPI_Comm comm, const char* name, std::int64_t fallback, Parse&& parse) {
  std::int64_t v = fallback;
  std::string error;
  try {
    if (auto x = parse()) v = static_cast<std::int64_t>(*x);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::int64_t buf[3] = {v, -v, error.empty() ? 0 : 1};
  LOCKSTEP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf, 3, MPI_INT64_T, MPI_MAX, comm));
  if (buf[2] != 0)
    throw InvalidArgument(error.empty() ? detail::concat(name, ": refused on another rank (malformed, or not "
                                                               "available in this build)")
                                        : error);
  if (buf[0] != -buf[1])
    throw InvalidArgument(detail::concat(name, ": the ranks differ (from ", -buf[1], " to ", buf[0],
                                         "); set it alike on every rank"));
  return v;
}

MPI_Datatype mpi_type_fn(DType t) { return mpi_type(t); }
MPI_Op mpi_op_fn(ReduceOp op, DType t) { return mpi_op(op, t); }
void scale_host_fn(TensorView v, int n) { scale_host(v, n); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// MPIBackend
// ---------------------------------------------------------------------------------------------
MPIBackend::MPIBackend(MPI_Comm comm) : impl_(std::make_unique<detail::MPIBackendImpl>()) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin)
    throw Error("MPIBackend: MPI is not initialised; call lockstep::initialize<lockstep::MPIBackend>() first");
  LOCKSTEP_CHECK_ARG(comm != MPI_COMM_NULL, "MPIBackend: communicator is MPI_COMM_NULL");
  LOCKSTEP_MPI_CHECK(MPI_Comm_dup(comm, &impl_->comm));
  LOCKSTEP_MPI_CHECK(MPI_Comm_set_errhandler(impl_->comm, MPI_ERRORS_RETURN));
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(impl_->comm, &impl_->rank));
  LOCKSTEP_MPI_CHECK(MPI_Comm_size(impl_->comm, &impl_->size));
  // Every LOCKSTEP_* setting, parsed on each rank and then agreed: a value that is malformed or
  // differs on any rank is the same InvalidArgument on every rank (no rank is left waiting).
  detail::agree_on_settings(impl_->comm);
  // The hierarchical allreduce (docs/architecture.md): LOCKSTEP_HIERARCHICAL=0 turns it off.
  const bool hier_on = agreed_setting(impl_->comm, "LOCKSTEP_HIERARCHICAL", 1, [] {
    auto b = detail::env::get_bool("LOCKSTEP_HIERARCHICAL");
    return b ? std::optional<int>(*b ? 1 : 0) : std::nullopt;
  }) != 0;
  // Test settings, honoured only in builds with fault injection (refused on every rank
  // elsewhere): LOCKSTEP_TEST_HOST_SIZE=k treats ranks [0,k), [k,2k), ... as separate machines,
  // so that the hierarchical path runs on one; LOCKSTEP_TEST_HIER_CHUNK_BYTES and
  // LOCKSTEP_TEST_HIER_MIN_BYTES set its chunk and threshold.
  auto test_only = [](const char* name, std::uint64_t lo, std::uint64_t hi) {
    return [name, lo, hi]() -> std::optional<std::uint64_t> {
      auto v = detail::env::get(name);
      if (!v) return std::nullopt;
      if (!LOCKSTEP_FAULT_INJECTION)
        throw InvalidArgument(detail::concat(name, "=\"", *v, "\": a test setting, honoured only in builds with "
                                             "LOCKSTEP_FAULT_INJECTION=ON; unset it"));
      return detail::env::parse_bytes(name, *v, lo, hi);
    };
  };
  const std::int64_t test_host_size =
      agreed_setting(impl_->comm, "LOCKSTEP_TEST_HOST_SIZE", 0, test_only("LOCKSTEP_TEST_HOST_SIZE", 1, 1 << 20));
  const std::int64_t hier_chunk = agreed_setting(impl_->comm, "LOCKSTEP_TEST_HIER_CHUNK_BYTES", 0,
                                                 test_only("LOCKSTEP_TEST_HIER_CHUNK_BYTES", 1, std::uint64_t{1} << 30));
  const std::int64_t hier_min = agreed_setting(impl_->comm, "LOCKSTEP_TEST_HIER_MIN_BYTES", -1,
                                               test_only("LOCKSTEP_TEST_HIER_MIN_BYTES", 0, std::uint64_t{1} << 40));
  MPI_Comm node = MPI_COMM_NULL;
  if (test_host_size > 0)
    LOCKSTEP_MPI_CHECK(MPI_Comm_split(impl_->comm, static_cast<int>(impl_->rank / test_host_size), impl_->rank, &node));
  else
    LOCKSTEP_MPI_CHECK(
        MPI_Comm_split_type(impl_->comm, MPI_COMM_TYPE_SHARED, impl_->rank, MPI_INFO_NULL, &node));
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(node, &impl_->local_rank));
  LOCKSTEP_MPI_CHECK(MPI_Comm_size(node, &impl_->local_size));
  impl_->cuda_aware = detail::settings_cuda_aware_mpi().value_or(detect_cuda_aware());
  impl_->monitor = detail::make_comm_monitor(impl_->comm);  // reliability hook
  impl_->shm = detail::ShmCollectives::create(impl_->comm, impl_->local_size);
  if (impl_->shm) {
    // Every wait of the shared-memory path is bounded: it polls the reliability hook (stall
    // notices from other ranks, this collective's deadline).
    impl_->shm->set_wait_hook(&detail::wait_point, impl_->monitor.get());
    LOCKSTEP_MPI_CHECK(MPI_Comm_free(&node));
  } else {
    // Not all on one machine (the same verdict on every rank): the hierarchical allreduce where
    // the placement allows it. It takes over `node`, and frees it when it says no.
    impl_->hier = detail::HierarchicalAllreduce::create(
        impl_->comm, node, hier_on, {&mpi_type_fn, &mpi_op_fn, &scale_host_fn}, impl_->monitor.get(),
        static_cast<std::size_t>(hier_chunk), hier_min);
  }
}

MPIBackend::~MPIBackend() = default;
// A moved-from backend holds no Impl: usable() is false and every collective throws.
MPIBackend::MPIBackend(MPIBackend&& other) noexcept : impl_(std::move(other.impl_)) {}
MPIBackend& MPIBackend::operator=(MPIBackend&& other) noexcept {
  if (this != &other) impl_ = std::move(other.impl_);
  return *this;
}

MPI_Comm MPIBackend::comm() const noexcept { return impl_ ? impl_->comm : MPI_COMM_NULL; }
int MPIBackend::rank() const { return impl_ ? impl_->rank : 0; }
int MPIBackend::size() const { return impl_ ? impl_->size : 0; }
int MPIBackend::local_rank() const { return impl_ ? impl_->local_rank : 0; }
int MPIBackend::local_size() const { return impl_ ? impl_->local_size : 0; }
bool MPIBackend::concurrent_collectives() const {
  int init = 0, fin = 0, provided = MPI_THREAD_SINGLE;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!impl_ || !init || fin) return false;
  MPI_Query_thread(&provided);
  return provided == MPI_THREAD_MULTIPLE;
}
bool MPIBackend::cuda_aware() const noexcept { return impl_ && impl_->cuda_aware; }
void MPIBackend::set_cuda_aware(bool on) noexcept {
  if (impl_) impl_->cuda_aware = on;
}
bool MPIBackend::shared_memory() const noexcept { return impl_ && impl_->shm != nullptr; }
bool MPIBackend::hierarchical() const noexcept { return impl_ && impl_->hier != nullptr; }
bool MPIBackend::usable() const noexcept { return impl_ && detail::monitor_usable(*impl_->monitor); }

void MPIBackend::check_usable() const {
  if (!impl_)
    throw InvalidArgument(detail::concat(detail::describe_call_site(),
                                         ": this MPIBackend was moved from; use the backend it was moved into"));
}

namespace {
// Every collective of MPIBackend is a function-try-block that hands an MpiError to this before
// it goes on: an MPI error on one rank is told to the others (monitor.hpp, report_mpi_error),
// which would otherwise wait in the same collective for the default deadline.
void report_mpi_error(detail::MPIBackendImpl* impl, const MpiError& e) noexcept {
  if (impl != nullptr) detail::report_mpi_error(impl->monitor.get(), e.what(), e.code());
}
}  // namespace

void MPIBackend::abandon(const CallInfo& call, const std::exception& error) {
  if (impl_) detail::abandon_collective(impl_->monitor.get(), call.op, call.count, call.dtype, call.reduce_op,
                                        call.root, error.what());
}

void MPIBackend::do_broadcast(TensorView buf, int root) try {
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::broadcast, &buf, buf.numel, -1, root);  // reliability hook
  if (guard.skipped()) return;
  if (impl_->size == 1) return;  // one rank: the data is already everywhere
  Staged s(*impl_, buf, impl_->rank == root);
  // On the shared-memory path every rank first agrees on the call (ShmCollectives::broadcast
  // returns false, on every rank alike, when the call goes to MPI instead).
  const bool host = s.host().device.is_cpu();
  if (!(impl_->shm && impl_->shm->broadcast(s.host().data, buf.numel, buf.dtype, root, host)) &&
      !(impl_->hier && impl_->hier->broadcast(s.host().data, buf.numel, buf.dtype, root, host)))
    chunked_bcast(impl_->comm, s.host().data, buf.numel, buf.dtype, root);
  if (impl_->rank != root) s.copy_out();  // root's device buffer already holds the data
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_allreduce(TensorView buf, ReduceOp op) try {
  op = one_rank_op(op, impl_ ? impl_->size : 0);
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::allreduce, &buf, buf.numel,
                                static_cast<int>(op), -1);  // reliability hook
  if (guard.skipped()) return;
  if (impl_->size == 1 && buf.device.is_cpu()) return;  // one rank: the result is the data itself
  // The hierarchical path works on the host: device memory is staged for it, CUDA-aware or not.
  Staged s(*impl_, buf, true, op == ReduceOp::avg || !is_mpi_native(buf.dtype) || impl_->hier);
  const bool host = s.host().device.is_cpu();
  if (impl_->shm && impl_->shm->allreduce(s.host().data, s.host().data, buf.numel, buf.dtype, op, host)) {
    // avg included
  } else if (impl_->hier && impl_->hier->allreduce(s.host().data, s.host().data, buf.numel, buf.dtype, op, host)) {
    // avg included
  } else {
    if (buf.numel <= kMaxChunk)  // one MPI call (every small message): no chunk loop
      LOCKSTEP_MPI_CHECK(detail::guarded_allreduce(MPI_IN_PLACE, s.host().data, static_cast<int>(buf.numel),
                                                   mpi_type(buf.dtype), mpi_op(op, buf.dtype), impl_->comm));
    else
      chunked_allreduce(impl_->comm, MPI_IN_PLACE, s.host().data, buf.numel, buf.dtype, op);
    if (op == ReduceOp::avg) scale_host(s.host(), impl_->size);
  }
  s.copy_out();
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_allreduce(TensorView send, TensorView recv, ReduceOp op) try {
  op = one_rank_op(op, impl_ ? impl_->size : 0);
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::allreduce, &send, send.numel,
                                static_cast<int>(op), -1);  // reliability hook
  if (guard.skipped()) return;
  if (impl_->size == 1 && send.device.is_cpu() && recv.device.is_cpu()) {  // one rank: a copy
    if (send.data != recv.data) std::memcpy(recv.data, send.data, send.nbytes());
    return;
  }
  const bool host_work = op == ReduceOp::avg || !is_mpi_native(send.dtype) || impl_->hier;
  Staged ss(*impl_, send, true, host_work);
  Staged rs(*impl_, recv, false, host_work);
  const bool host = rs.host().device.is_cpu();
  if (impl_->shm && impl_->shm->allreduce(ss.host().data, rs.host().data, send.numel, send.dtype, op, host)) {
    // avg included
  } else if (impl_->hier &&
             impl_->hier->allreduce(ss.host().data, rs.host().data, send.numel, send.dtype, op,
                                    host && ss.host().device.is_cpu())) {
    // avg included
  } else {
    if (send.numel <= kMaxChunk)  // one MPI call (every small message): no chunk loop
      LOCKSTEP_MPI_CHECK(detail::guarded_allreduce(ss.host().data, rs.host().data, static_cast<int>(send.numel),
                                                   mpi_type(send.dtype), mpi_op(op, send.dtype), impl_->comm));
    else
      chunked_allreduce(impl_->comm, ss.host().data, rs.host().data, send.numel, send.dtype, op);
    if (op == ReduceOp::avg) scale_host(rs.host(), impl_->size);
  }
  rs.copy_out();
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_reduce(TensorView buf, ReduceOp op, int root) try {
  op = one_rank_op(op, impl_ ? impl_->size : 0);
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::reduce, &buf, buf.numel,
                                static_cast<int>(op), root);  // reliability hook
  if (guard.skipped()) return;
  Staged s(*impl_, buf, true, op == ReduceOp::avg || !is_mpi_native(buf.dtype));
  const bool host = s.host().device.is_cpu();
  if (impl_->shm && impl_->shm->reduce(s.host().data, s.host().data, buf.numel, buf.dtype, op, root, host)) {
    if (impl_->rank == root) s.copy_out();  // avg included
    return;
  }
  chunked_reduce(impl_->comm, MPI_IN_PLACE, s.host().data, buf.numel, buf.dtype, op, root, impl_->rank);
  if (impl_->rank == root) {
    if (op == ReduceOp::avg) scale_host(s.host(), impl_->size);
    s.copy_out();
  }
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_reduce(TensorView send, TensorView recv, ReduceOp op, int root) try {
  op = one_rank_op(op, impl_ ? impl_->size : 0);
  const bool is_root = impl_->rank == root;
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::reduce, &send, send.numel,
                                static_cast<int>(op), root);  // reliability hook
  if (guard.skipped()) return;
  const bool host_work = op == ReduceOp::avg || !is_mpi_native(send.dtype);
  Staged ss(*impl_, send, true, host_work);
  const bool host = ss.host().device.is_cpu() && (is_root ? recv.device.is_cpu() : true);
  if (!is_root) {
    if (impl_->shm && impl_->shm->reduce(ss.host().data, nullptr, send.numel, send.dtype, op, root, host)) return;
    chunked_reduce(impl_->comm, ss.host().data, nullptr, send.numel, send.dtype, op, root, impl_->rank);
    return;
  }
  Staged rs(*impl_, recv, false, host_work);
  if (impl_->shm && impl_->shm->reduce(ss.host().data, rs.host().data, send.numel, send.dtype, op, root, host)) {
    rs.copy_out();  // avg included
    return;
  }
  chunked_reduce(impl_->comm, ss.host().data, rs.host().data, send.numel, send.dtype, op, root, impl_->rank);
  if (op == ReduceOp::avg) scale_host(rs.host(), impl_->size);
  rs.copy_out();
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_allgather(TensorView send, TensorView recv) try {
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::allgather, &send, send.numel, -1,
                                -1);  // reliability hook
  if (guard.skipped()) return;
  const std::int64_t n = send.numel;
  const std::size_t es = size_of(send.dtype);
  // In place (send is this rank's block of recv, which the front end allows): device memory is
  // staged (two host buffers, so nothing aliases there); host memory goes as MPI_IN_PLACE.
  const bool in_place = send.nbytes() > 0 && send.data == static_cast<const char*>(recv.data) + impl_->rank * n * es;
  // The large form copies on the host, and so does the hierarchical path.
  const bool host_work = n > kMaxChunk || (in_place && !send.device.is_cpu()) || impl_->hier;
  Staged ss(*impl_, send, true, host_work);
  Staged rs(*impl_, recv, false, host_work);
  const bool host_in_place = in_place && ss.host().data == static_cast<const char*>(rs.host().data) + impl_->rank * n * es;
  if (impl_->shm && impl_->shm->allgather(ss.host().data, rs.host().data, n, send.dtype,
                                          ss.host().device.is_cpu() && rs.host().device.is_cpu())) {
    rs.copy_out();
    return;
  }
  // Across machines of two or more ranks each: each rank's bytes cross to each machine once.
  if (impl_->hier && impl_->hier->allgather(ss.host().data, rs.host().data, n, send.dtype,
                                            ss.host().device.is_cpu() && rs.host().device.is_cpu())) {
    rs.copy_out();
    return;
  }
  if (n <= kMaxChunk) {
    LOCKSTEP_MPI_CHECK(detail::guarded_allgather(host_in_place ? MPI_IN_PLACE : ss.host().data, static_cast<int>(n),
                                                 mpi_type(send.dtype), rs.host().data, static_cast<int>(n),
                                                 mpi_type(send.dtype), impl_->comm));
  } else {
    // Above the int count limit: each rank's block is broadcast from its owner, in chunks.
    if (!host_in_place) std::memcpy(static_cast<char*>(rs.host().data) + impl_->rank * n * es, ss.host().data, n * es);
    for (int r = 0; r < impl_->size; ++r)
      chunked_bcast(impl_->comm, static_cast<char*>(rs.host().data) + r * n * es, n, send.dtype, r);
  }
  rs.copy_out();
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_reduce_scatter(TensorView send, TensorView recv, ReduceOp op) try {
  op = one_rank_op(op, impl_ ? impl_->size : 0);
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::reduce_scatter, &send, recv.numel,
                                static_cast<int>(op), -1);  // reliability hook
  if (guard.skipped()) return;
  const std::int64_t n = recv.numel;
  const std::size_t es = size_of(send.dtype);
  // In place (recv is this rank's block of send, which the front end allows): as in allgather.
  const bool in_place = recv.nbytes() > 0 && recv.data == static_cast<const char*>(send.data) + impl_->rank * n * es;
  const bool host_work =
      op == ReduceOp::avg || !is_mpi_native(send.dtype) || (in_place && !send.device.is_cpu()) || impl_->hier;
  Staged ss(*impl_, send, true, host_work);
  Staged rs(*impl_, recv, false, host_work);
  char* const sh = static_cast<char*>(ss.host().data);
  const bool host_in_place = in_place && rs.host().data == sh + impl_->rank * n * es;
  // The shared-memory path: each rank reduces only its block (avg included).
  if (impl_->shm && impl_->shm->reduce_scatter(ss.host().data, rs.host().data, n, send.dtype, op,
                                               ss.host().device.is_cpu() && rs.host().device.is_cpu())) {
    rs.copy_out();
    return;
  }
  // Across machines of two or more ranks each: node-local reduce-scatter, then among the
  // machines (avg included).
  if (impl_->hier && impl_->hier->reduce_scatter(ss.host().data, rs.host().data, n, send.dtype, op,
                                                 ss.host().device.is_cpu() && rs.host().device.is_cpu())) {
    rs.copy_out();
    return;
  }
  if (n <= kMaxChunk) {
    if (host_in_place) {
      // MPI_IN_PLACE takes the input from the receive buffer (all of send) and leaves the result
      // in its first block: moved to this rank's block.
      LOCKSTEP_MPI_CHECK(detail::guarded_reduce_scatter_block(MPI_IN_PLACE, sh, static_cast<int>(n),
                                                              mpi_type(send.dtype), mpi_op(op, send.dtype),
                                                              impl_->comm));
      if (impl_->rank != 0) std::memmove(rs.host().data, sh, static_cast<std::size_t>(n) * es);
    } else {
      LOCKSTEP_MPI_CHECK(detail::guarded_reduce_scatter_block(ss.host().data, rs.host().data, static_cast<int>(n),
                                                              mpi_type(send.dtype), mpi_op(op, send.dtype),
                                                              impl_->comm));
    }
  } else {
    // Above the int count limit: block r is reduced onto rank r, in chunks.
    for (int r = 0; r < impl_->size; ++r) {
      if (r == impl_->rank && host_in_place)
        chunked_reduce(impl_->comm, MPI_IN_PLACE, rs.host().data, n, send.dtype, op, r, impl_->rank);
      else
        chunked_reduce(impl_->comm, sh + r * n * es, r == impl_->rank ? rs.host().data : nullptr, n, send.dtype, op, r,
                       impl_->rank);
    }
  }
  if (op == ReduceOp::avg) scale_host(rs.host(), impl_->size);
  rs.copy_out();
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_allreduce_wire16(TensorView buf, DType wire, ReduceOp op) try {
  if (impl_->hier && impl_->hier->handles_allreduce_wire16(buf.numel)) {
    // Across machines of two or more ranks each: the node-local sums in f32, only the
    // inter-host part on the 16-bit wire (hierarchical.hpp). Fingerprinted as below.
    TensorView onwire{buf.data, buf.numel, wire, Device::cpu()};
    detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::allreduce, &onwire, onwire.numel,
                                  static_cast<int>(ReduceOp::sum), -1);  // reliability hook
    if (guard.skipped()) return;
    const DType w = onwire.dtype == DType::bf16 || onwire.dtype == DType::f16 ? onwire.dtype : wire;
    if (impl_->hier->allreduce_wire16(static_cast<float*>(buf.data), onwire.numel, w, op)) return;
    throw Error("allreduce_wire16: the hierarchical path declined a call it had taken (op must be sum or avg)");
  }
  // Not fused (no shared memory, one rank, no elements, below LOCKSTEP_SHM_MIN_BYTES; the same
  // on every rank for the same call): the three passes, whose allreduce has its own checks.
  if (!impl_->shm || impl_->size == 1 || !impl_->shm->handles_wire16(buf.numel))
    return Backend::do_allreduce_wire16(buf, wire, op);
  // Fingerprinted as what goes between the ranks, a 16-bit allreduce with sum (the same record
  // as the three passes' allreduce over MPI); the shared-memory header tells the fused call apart.
  TensorView onwire{buf.data, buf.numel, wire, Device::cpu()};
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::allreduce, &onwire, onwire.numel,
                                static_cast<int>(ReduceOp::sum), -1);  // reliability hook
  if (guard.skipped()) return;
  // An injected fault may have changed the count or the dtype: the header carries them, so the
  // ranks see the disagreement. A dtype that is not a wire dtype any more goes to the header only.
  const DType w = onwire.dtype == DType::bf16 || onwire.dtype == DType::f16 ? onwire.dtype : wire;
  (void)impl_->shm->allreduce_wire16(static_cast<float*>(buf.data), onwire.numel, w, op);
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_reduce_scatter_wire16(TensorView send, TensorView recv, DType wire, ReduceOp op) try {
  if (impl_->hier && impl_->hier->handles_wire16(recv.numel)) {
    // Across machines of two or more ranks each: the node-local sums in f32, only the
    // inter-host part on the 16-bit wire (hierarchical.hpp).
    TensorView onwire{send.data, send.numel, wire, Device::cpu()};
    detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::reduce_scatter, &onwire, recv.numel,
                                  static_cast<int>(ReduceOp::sum), -1);  // reliability hook
    if (guard.skipped()) return;
    const DType w = onwire.dtype == DType::bf16 || onwire.dtype == DType::f16 ? onwire.dtype : wire;
    if (impl_->hier->reduce_scatter_wire16(static_cast<const float*>(send.data), static_cast<float*>(recv.data),
                                           recv.numel, w, op))
      return;
    throw Error("reduce_scatter_wire16: the hierarchical path declined a call it had taken (op must be sum or avg)");
  }
  if (!impl_->shm || impl_->size == 1 || !impl_->shm->handles_wire16(recv.numel))
    return Backend::do_reduce_scatter_wire16(send, recv, wire, op);
  TensorView onwire{send.data, send.numel, wire, Device::cpu()};
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::reduce_scatter, &onwire, recv.numel,
                                static_cast<int>(ReduceOp::sum), -1);  // reliability hook
  if (guard.skipped()) return;
  const DType w = onwire.dtype == DType::bf16 || onwire.dtype == DType::f16 ? onwire.dtype : wire;
  (void)impl_->shm->reduce_scatter_wire16(static_cast<const float*>(send.data), static_cast<float*>(recv.data),
                                          recv.numel, w, op);
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

void MPIBackend::do_barrier() try {
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::barrier, nullptr, 0, -1, -1);  // reliability hook
  if (guard.skipped()) return;
  LOCKSTEP_MPI_CHECK(detail::guarded_barrier(impl_->comm));
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

namespace {
// Host memory that a nonblocking device operation stages through; held by the request (the
// backend's shared staging buffer may be reused before the request completes) and returned to
// the backend's pool when the request ends.
class OwnedPinned {
 public:
  OwnedPinned(std::shared_ptr<PinnedPool> pool, std::size_t bytes) : pool_(std::move(pool)) {
    p_ = pool_->take(bytes, cls_);
  }
  ~OwnedPinned() { pool_->give(p_, cls_); }
  OwnedPinned(const OwnedPinned&) = delete;
  OwnedPinned& operator=(const OwnedPinned&) = delete;
  void* get() const { return p_; }

 private:
  std::shared_ptr<PinnedPool> pool_;
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
  ~MpiRequest() override = default;

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
    if (avg_divisor_ > 0) scale_host(host_, avg_divisor_);
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
    int c = static_cast<int>(std::min(kMaxChunk, host.numel - off));
    MPI_Request r;
    issue(static_cast<char*>(host.data) + off * es, c, &r);
    reqs.push_back(r);
    off += kMaxChunk;
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
  wait_for_producer(rt, buf.device.index, /*direct=*/false);  // see Staged
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
  op = one_rank_op(op, impl_ ? impl_->size : 0);
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::iallreduce, &buf, buf.numel,
                                static_cast<int>(op), -1);  // reliability hook
  if (guard.skipped()) return Request();
  TensorView host;
  auto staging = stage_nonblocking(*impl_, buf, true, host);
  MPI_Datatype dt = mpi_type(buf.dtype);
  MPI_Op mop = mpi_op(op, buf.dtype);
  MPI_Comm comm = impl_->comm;
  auto reqs = issue_chunks(host, [&](void* p, int c, MPI_Request* r) {
    LOCKSTEP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, p, c, dt, mop, comm, r));
  });
  return Request(std::make_unique<MpiRequest>(std::move(reqs), host, staging ? buf : TensorView{},
                                              op == ReduceOp::avg ? impl_->size : 0, std::move(staging),
                                              detail::watch_request(impl_->monitor)));
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

Request MPIBackend::do_ibroadcast(TensorView buf, int root) try {
  detail::CollectiveScope guard(impl_->monitor.get(), detail::Coll::ibroadcast, &buf, buf.numel, -1,
                                root);  // reliability hook
  if (guard.skipped()) return Request();
  TensorView host;
  auto staging = stage_nonblocking(*impl_, buf, impl_->rank == root, host);
  MPI_Datatype dt = mpi_type(buf.dtype);
  MPI_Comm comm = impl_->comm;
  auto reqs = issue_chunks(host, [&](void* p, int c, MPI_Request* r) {
    LOCKSTEP_MPI_CHECK(MPI_Ibcast(p, c, dt, root, comm, r));
  });
  return Request(std::make_unique<MpiRequest>(std::move(reqs), host, staging ? buf : TensorView{}, 0,
                                              std::move(staging), detail::watch_request(impl_->monitor)));
} catch (const MpiError& e) {
  report_mpi_error(impl_.get(), e);  // reliability hook: the other ranks are told
  throw;
}

// ---------------------------------------------------------------------------------------------
// The global backend behind initialize<MPIBackend>()
// ---------------------------------------------------------------------------------------------
namespace {
std::mutex g_mutex;
std::unique_ptr<MPIBackend> g_backend;

std::string rank_suffix_noexcept() noexcept {
  try {
    return detail::rank_suffix();
  } catch (...) {
    return "";
  }
}

// An exception that escapes main (or any thread) on one rank would leave the others waiting in
// their next collective: instead the whole job ends, with the rank and the message.
// At exit after a failed initialize (see there): the ranks meet in a barrier, polled for at
// most 10 s so that a rank that failed alone cannot make the others wait, then MPI_Finalize.
bool g_failed_init_atexit = false;
constexpr double kFailedInitBarrierSeconds = 10;
void finalize_after_failed_init() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin || MPIBackend::initialized_global()) return;  // finalised, or initialised again
  MPI_Request req = MPI_REQUEST_NULL;
  int done = 0;
  if (MPI_Ibarrier(MPI_COMM_WORLD, &req) == MPI_SUCCESS) {
    const auto start = std::chrono::steady_clock::now();
    while (MPI_Test(&req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done &&
           std::chrono::steady_clock::now() - start < std::chrono::duration<double>(kFailedInitBarrierSeconds))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (done) MPI_Finalize();
}

std::terminate_handler g_previous_terminate = nullptr;
[[noreturn]] void terminate_job() noexcept {
  std::string what = "an unknown exception";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = ex.what();
    } catch (...) {
    }
  } else {
    what = "std::terminate was called without an exception";
  }
  abort_job(detail::concat("uncaught exception: ", what), 1);
}
bool g_we_initialised_mpi = false;
bool g_atexit_registered = false;

void finalize_at_exit() {
  try {
    MPIBackend::finalize_global();
  } catch (const std::exception& e) {
    std::cerr << "lockstep: at exit: " << e.what() << "\n";
  }
}
}  // namespace

void MPIBackend::initialize_global() {
  std::lock_guard lock(g_mutex);
  if (g_backend) return;
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (fin) throw Error("initialize<MPIBackend>: MPI was already finalised; it cannot be initialised again");
  // A peer process that dies (every process of its host killed) resets its TCP connections, and
  // Open MPI's next write to one raised SIGPIPE here: this rank, on a host that is fine, died of
  // the signal before mpiexec saw the lost host, and mpiexec named this rank as the failure.
  // Ignored, the write fails with EPIPE and the lost peer is reported as such (an MPI error, or
  // mpiexec's lost daemon). Only where SIGPIPE has its default action: a handler or disposition
  // the program set is left alone (docs/reliability.md).
  {
    struct sigaction old_pipe {};
    if (::sigaction(SIGPIPE, nullptr, &old_pipe) == 0 && !(old_pipe.sa_flags & SA_SIGINFO) &&
        old_pipe.sa_handler == SIG_DFL) {
      struct sigaction ign {};
      ign.sa_handler = SIG_IGN;
      sigemptyset(&ign.sa_mask);
      ::sigaction(SIGPIPE, &ign, nullptr);
    }
  }
  if (!init) {
    // DistributedOptimizer reduces its buckets with MPI_Iallreduce, and Open MPI's default
    // nonblocking allreduce algorithm is much slower than its ring one (docs/performance.md):
    // the ring is chosen, as a default only (a value the user set wins, other MPIs ignore the
    // variable, a program that starts MPI itself keeps its own settings). Documented in
    // docs/training.md; LOCKSTEP_OMPI_DEFAULTS=0 leaves Open MPI's environment alone. A malformed
    // value is read as the default here and refused on every rank by the settings check.
    bool ompi_defaults = true;
    try {
      ompi_defaults = detail::env::get_bool("LOCKSTEP_OMPI_DEFAULTS").value_or(true);
    } catch (const std::exception&) {
    }
    if (ompi_defaults) ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", /*overwrite=*/0);
    // Between machines Open MPI's TCP transport opens one connection per pair of processes, and
    // a rendezvous acknowledgement then queues behind the bulk data going the other way in that
    // connection: traffic both ways at once (every allreduce's) got about half the link's rate
    // per direction, on a shaped link as unshaped. Two connections per pair fill it (measured
    // across two simulated hosts at 500 Mbit/s: 0.24-0.32 -> 0.41-0.47 Gbit/s for a 64 MiB
    // allreduce; docs/performance.md, "Across hosts"). No effect within a machine (shared memory).
    if (ompi_defaults) ::setenv("OMPI_MCA_btl_tcp_links", "2", /*overwrite=*/0);
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) throw MpiError("initialize<MPIBackend>: MPI_Init_thread failed", rc);
    g_we_initialised_mpi = true;
  }
  // Errors of requests that MPI cannot attribute to a communicator (Open MPI raises those of
  // nonblocking collectives on MPI_COMM_WORLD) must come back as codes, so that they become an
  // MpiError instead of ending the job. Only when Lockstep started MPI: a program that owns MPI
  // keeps its own handlers (docs/reliability.md).
  if (g_we_initialised_mpi) {
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
  }
  if (g_previous_terminate == nullptr) g_previous_terminate = std::set_terminate(terminate_job);
  try {
    g_backend = std::make_unique<MPIBackend>(MPI_COMM_WORLD);
  } catch (...) {
    // The backend's creation failed (on every rank alike: its checks, the settings among them,
    // are agreed across ranks). MPI, which Lockstep started, stays usable for the program, and
    // is finalised when the process exits, so that each rank can report the error and exit
    // normally: a rank that exited without MPI_Finalize would make mpiexec end the others
    // before they printed it.
    if (g_we_initialised_mpi && !g_failed_init_atexit) {
      (void)detail::world_rank();  // remembered for messages after MPI_Finalize
      std::atexit(finalize_after_failed_init);
      g_failed_init_atexit = true;
    }
    throw;
  }
  if (!g_atexit_registered) {
    std::atexit(finalize_at_exit);
    g_atexit_registered = true;
  }
}

bool MPIBackend::initialized_global() noexcept {
  std::lock_guard lock(g_mutex);
  return static_cast<bool>(g_backend);
}

MPIBackend& MPIBackend::global() {
  std::lock_guard lock(g_mutex);
  if (!g_backend)
    throw Error(
        "get_distributed_backend<MPIBackend>: the MPI backend is not initialised; call "
        "lockstep::initialize<lockstep::MPIBackend>() first");
  return *g_backend;
}

// How long a rank that leaves without MPI_Finalize after a stall waits first (see there).
constexpr int kStallExitGraceMs = 500;

namespace {
std::mutex g_hooks_mutex;
std::vector<std::pair<const void*, std::function<void(const Backend*, bool)>>>* g_finalize_hooks = nullptr;
}  // namespace

void detail::at_finalize(const void* key, std::function<void(const Backend*, bool)> hook) {
  std::lock_guard lock(g_hooks_mutex);
  if (g_finalize_hooks == nullptr) g_finalize_hooks = new std::vector<std::pair<const void*, std::function<void(const Backend*, bool)>>>();
  for (auto& [k, h] : *g_finalize_hooks)
    if (k == key) {
      h = std::move(hook);
      return;
    }
  g_finalize_hooks->emplace_back(key, std::move(hook));
}

void MPIBackend::finalize_global() {
  // What lives on the backend, or on MPI, ends first (remote sessions: their progress threads
  // call MPI), outside the lock (a hook may ask whether the backend is initialised).
  {
    const Backend* going = nullptr;
    {
      std::lock_guard lock(g_mutex);
      going = g_backend.get();
    }
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    std::vector<std::function<void(const Backend*, bool)>> hooks;
    {
      std::lock_guard lock(g_hooks_mutex);
      if (g_finalize_hooks != nullptr)
        for (auto& [k, h] : *g_finalize_hooks) hooks.push_back(h);
    }
    if (init && !fin)
      for (auto& h : hooks) {
        try {
          h(going, g_we_initialised_mpi);
        } catch (...) {
        }
      }
  }
  std::lock_guard lock(g_mutex);
  // Reliability hook: finalising under pending requests would crash inside MPI_Finalize.
  if (g_backend) detail::check_no_pending_requests(g_backend->impl_->monitor.get(), "finalize<MPIBackend>");
  // Only when MPI ends with it: a program that owns MPI may create another backend, and a
  // notice nobody received would then be read on a communicator it was not meant for.
  if (g_we_initialised_mpi && g_backend && g_backend->impl_ && g_backend->impl_->monitor)
    detail::announce_leaving(*g_backend->impl_->monitor);
  const bool had_backend = static_cast<bool>(g_backend);
  g_backend.reset();
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) {
    g_half_ops.free_all();
    if (g_we_initialised_mpi) {
      if (detail::any_stall()) {
        // MPI_Finalize synchronises with every rank, so it would wait for the stalled one
        // (forever, if it never comes back). The process ends without it; mpiexec then ends the
        // rest of the job.
        std::cerr << "lockstep: not calling MPI_Finalize after a stall or a refused collective (it would wait for "
                     "the other ranks); this process exits without it, which ends the job"
                  << rank_suffix_noexcept() << std::endl;
        // The other ranks that waited for the same collective reach their own deadline at about
        // the same time, or have just been told of this one's: a bounded pause lets them print
        // their error before this exit makes mpiexec end them (on a loaded machine a rank a few
        // milliseconds behind was ended before its report).
        std::this_thread::sleep_for(std::chrono::milliseconds(kStallExitGraceMs));
        return;
      }
      // MPI_Finalize synchronises with every rank and, in Open MPI, cannot be interrupted: a
      // rank inside it is not ended even by another rank's MPI_Abort. So the ranks first meet
      // in a barrier that this rank polls (a rank still inside a collective has been told that
      // this one left, and throws or ends the job), for at most the deadline.
      // Teardown never throws: the deadline is read without the settings' error, which was
      // reported when initialize was refused (it used to be thrown again here, after the
      // barrier below was issued, so that MPI was never finalised and mpiexec reported the job
      // as exiting improperly). After a refused initialize the wait is bounded as at exit
      // (finalize_after_failed_init): every rank was refused alike, but one that was refused
      // alone must not keep the others here.
      double limit = 1e18;
      try {
        if (timeout() > 0) limit = timeout();
      } catch (const std::exception&) {
        limit = kFailedInitBarrierSeconds;
      }
      if (!had_backend && g_failed_init_atexit) limit = std::min(limit, kFailedInitBarrierSeconds);
      MPI_Request req = MPI_REQUEST_NULL;
      if (MPI_Ibarrier(MPI_COMM_WORLD, &req) == MPI_SUCCESS) {
        const auto start = std::chrono::steady_clock::now();
        int done = 0;
        while (!done) {
          if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
          if (done) break;
          if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit) {
            std::cerr << "lockstep: the other ranks did not finalise within " << limit
                      << " s; this process exits without MPI_Finalize, which ends the job" << rank_suffix_noexcept()
                      << std::endl;
            return;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
      MPI_Finalize();
    }
  }
}

void abort_job(const std::string& message, int code) noexcept {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  std::cerr << "lockstep: ending the job" << rank_suffix_noexcept() << ": " << message << std::endl;
  if (init && !fin) MPI_Abort(MPI_COMM_WORLD, code == 0 ? 1 : code);
  std::_Exit(code == 0 ? 1 : code);
}

}  // namespace lockstep
