// The Backend front end (backend.hpp): the one place where the arguments of every collective are
// checked, for every backend, before the backend's hook runs; plus ReduceOp and Request.
#include "lockstep/comm/backend.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <tuple>
#include <vector>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <new>

#include "lockstep/core/device_runtime.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/reliability/call_site.hpp"
#include "comm/drain.hpp"
#include "core/keep_for_process.hpp"
#include "core/wire16.hpp"

namespace lockstep {

const char* name(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::prod: return "prod";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::avg: return "avg";
  }
  return "?";
}

void check_op_for_dtype(ReduceOp op, DType dtype) {
  LOCKSTEP_CHECK_ARG(static_cast<int>(op) <= static_cast<int>(ReduceOp::avg), "invalid ReduceOp value ",
                     static_cast<int>(op));
  LOCKSTEP_CHECK_ARG(op != ReduceOp::avg || is_floating(dtype), "ReduceOp::avg needs a floating dtype, got ",
                     name(dtype), " (use sum and divide yourself for integers)");
}

// ---------------------------------------------------------------------------------------------
// Request
// ---------------------------------------------------------------------------------------------
Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    if (impl_) {
      try {
        wait();
      } catch (const std::exception& e) {
        std::cerr << "lockstep: pending request failed while being replaced: " << e.what() << "\n";
      }
    }
    impl_ = std::move(other.impl_);
    kept_ = std::move(other.kept_);
    other.impl_.reset();
    other.kept_.clear();
  }
  return *this;
}

Request::~Request() {
  if (!impl_) return;
  try {
    wait();
  } catch (const std::exception& e) {
    std::cerr << "lockstep: request destroyed while pending and its wait failed: " << e.what() << "\n";
  }
}

Request& Request::keep(std::shared_ptr<void> owner) {
  if (impl_ && owner) kept_.push_back(std::move(owner));
  return *this;
}

void Request::abandon() noexcept {
  for (auto& owner : kept_) {
    try {
      detail::keep_for_process(std::move(owner));
    } catch (...) {  // out of memory: leak it rather than free it
      new std::shared_ptr<void>(std::move(owner));
    }
  }
  kept_.clear();
}

void Request::wait() {
  if (!impl_) return;
  auto impl = std::move(impl_);
  try {
    impl->wait();
  } catch (...) {
    abandon();
    throw;
  }
  kept_.clear();
}

bool Request::test() {
  if (!impl_) return true;
  try {
    if (!impl_->test()) return false;
  } catch (...) {
    impl_.reset();
    abandon();
    throw;
  }
  impl_.reset();
  kept_.clear();
  return true;
}

// ---------------------------------------------------------------------------------------------
// Argument checks, written once for every backend
// ---------------------------------------------------------------------------------------------
namespace {

void check_view(const TensorView& v, const char* what, const char* which, bool runtime = true) {
  LOCKSTEP_CHECK_ARG(static_cast<int>(v.dtype) <= static_cast<int>(DType::u8), what, ": ", which,
                     " has an invalid dtype value ", static_cast<int>(v.dtype));
  LOCKSTEP_CHECK_ARG(v.numel >= 0, what, ": ", which, " has a negative element count ", v.numel);
  LOCKSTEP_CHECK_ARG(v.data != nullptr || v.numel == 0, what, ": ", which, " has a null data pointer for ",
                     v.numel, " elements");
  LOCKSTEP_CHECK_ARG(static_cast<std::uint64_t>(v.numel) <= (std::uint64_t{1} << 62) / size_of(v.dtype), what,
                     ": ", which, " has ", v.numel, " elements, more than any buffer can hold");
  if (runtime && v.device.is_cuda() && v.numel > 0) (void)device_runtime(what);  // NotCompiled without lockstep::cuda
}

bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  auto a0 = reinterpret_cast<std::uintptr_t>(a.data), b0 = reinterpret_cast<std::uintptr_t>(b.data);
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

bool same_buffer(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.numel == b.numel && a.dtype == b.dtype && a.device == b.device;
}

// Block r (of `n` elements) of v.
TensorView block_of(const TensorView& v, int r, std::int64_t n) {
  if (v.data == nullptr) return TensorView{nullptr, n, v.dtype, v.device};
  return TensorView{static_cast<char*>(v.data) + static_cast<std::size_t>(r) * static_cast<std::size_t>(n) * size_of(v.dtype),
                    n, v.dtype, v.device};
}

void check_pair(const TensorView& send, const TensorView& recv, const char* what) {
  check_view(send, what, "send", false);
  check_view(recv, what, "recv", false);
  LOCKSTEP_CHECK_ARG(send.dtype == recv.dtype, what, ": send dtype ", name(send.dtype),
                     " differs from recv dtype ", name(recv.dtype));
  LOCKSTEP_CHECK_ARG(send.device == recv.device, what, ": send is on ", to_string(send.device),
                     " but recv is on ", to_string(recv.device));
  LOCKSTEP_CHECK_ARG(!overlaps(send, recv), what,
                     ": send and recv overlap in memory; use the in-place form instead");
  if (send.device.is_cuda() && (send.numel > 0 || recv.numel > 0)) (void)device_runtime(what);
}

void check_root(int root, int size, const char* what) {
  LOCKSTEP_CHECK_ARG(root >= 0 && root < size, what, ": root ", root, " is out of range [0, ", size, ")");
}

std::int64_t times(std::int64_t a, int b) {
  // send.numel * size() without overflow (numel is at most 2^62 / element size here).
  if (b > 0 && a > INT64_MAX / b) return -1;
  return a * b;
}

}  // namespace

void Backend::abandon(const CallInfo&, const std::exception&) {}

bool Backend::do_exact_sum(const detail::ExactSumCall&) { return false; }

// Runs the checks; a rank whose arguments fail tells the backend (abandon) before throwing.
namespace {
// The drains of every backend (see detail::register_drain). g_drain_count lets the front end
// skip the lock when no reducer has a communication thread.
std::mutex g_drains_mutex;
std::vector<std::tuple<const Backend*, const void*, std::function<void()>>> g_drains;
std::atomic<int> g_drain_count{0};
}  // namespace

thread_local bool detail::t_on_comm_thread = false;

void detail::register_drain(const Backend* backend, const void* key, std::function<void()> drain) {
  std::lock_guard lock(g_drains_mutex);
  g_drains.emplace_back(backend, key, std::move(drain));
  g_drain_count.store(static_cast<int>(g_drains.size()));
}

void detail::unregister_drain(const void* key) noexcept {
  std::lock_guard lock(g_drains_mutex);
  std::erase_if(g_drains, [&](const auto& d) { return std::get<1>(d) == key; });
  g_drain_count.store(static_cast<int>(g_drains.size()));
}

void detail::drain_pending(const Backend* backend) {
  if (g_drain_count.load(std::memory_order_acquire) == 0 || t_on_comm_thread) return;
  // Called under the lock, with no copy per collective: a drain waits for its communication
  // thread, which never takes this lock.
  std::lock_guard lock(g_drains_mutex);
  for (const auto& d : g_drains)
    if (std::get<0>(d) == backend) std::get<2>(d)();
}

#define LOCKSTEP_FRONT_CHECKS(info, ...)    \
  do {                                      \
    detail::drain_pending(this);            \
    check_usable();                         \
    try {                                   \
      __VA_ARGS__;                          \
    } catch (const Error& lockstep_e_) {    \
      abandon(info, lockstep_e_);           \
      throw;                                \
    }                                       \
  } while (0)

void Backend::broadcast(TensorView buf, int root, Loc loc) {
  detail::CallSiteScope site(loc, "broadcast");
  const CallInfo info{"broadcast", buf.numel, static_cast<int>(buf.dtype), -1, root};
  LOCKSTEP_FRONT_CHECKS(info, check_view(buf, "broadcast", "buf"); check_root(root, size(), "broadcast"));
  do_broadcast(buf, root);
}

void Backend::allreduce(TensorView buf, ReduceOp op, Loc loc) {
  detail::CallSiteScope site(loc, "allreduce");
  const CallInfo info{"allreduce", buf.numel, static_cast<int>(buf.dtype), static_cast<int>(op), -1};
  LOCKSTEP_FRONT_CHECKS(info, check_view(buf, "allreduce", "buf"); check_op_for_dtype(op, buf.dtype));
  do_allreduce(buf, op);
}

void Backend::allreduce(TensorView send, TensorView recv, ReduceOp op, Loc loc) {
  detail::CallSiteScope site(loc, "allreduce");
  const CallInfo info{"allreduce", send.numel, static_cast<int>(send.dtype), static_cast<int>(op), -1};
  if (same_buffer(send, recv)) {
    LOCKSTEP_FRONT_CHECKS(info, check_view(recv, "allreduce", "buf"); check_op_for_dtype(op, recv.dtype));
    return do_allreduce(recv, op);
  }
  LOCKSTEP_FRONT_CHECKS(info, check_pair(send, recv, "allreduce");
                        LOCKSTEP_CHECK_ARG(send.numel == recv.numel, "allreduce: send has ", send.numel,
                                           " elements but recv has ", recv.numel);
                        check_op_for_dtype(op, send.dtype));
  do_allreduce(send, recv, op);
}

void Backend::reduce(TensorView buf, ReduceOp op, int root, Loc loc) {
  detail::CallSiteScope site(loc, "reduce");
  const CallInfo info{"reduce", buf.numel, static_cast<int>(buf.dtype), static_cast<int>(op), root};
  LOCKSTEP_FRONT_CHECKS(info, check_view(buf, "reduce", "buf"); check_op_for_dtype(op, buf.dtype);
                        check_root(root, size(), "reduce"));
  // The same collectives as the out-of-place form below (whose root broadcasts its verdict on
  // its recv first): a rank may call either form, whatever root calls (a non-root's recv is
  // ignored), so both must issue the same calls, or an in-place rank's reduce would meet the
  // out-of-place root's verdict broadcast (and a later broadcast would receive the verdict).
  // Root's buf passed the checks above, so its verdict here is always empty.
  char verdict[256] = {};
  do_broadcast(TensorView{verdict, static_cast<std::int64_t>(sizeof verdict), DType::u8, Device::cpu()}, root);
  if (verdict[0] != '\0')
    throw InvalidArgument(detail::concat("reduce: the root (rank ", root, ") refused its recv, so no rank reduced: ",
                                         verdict, detail::rank_suffix()));
  do_reduce(buf, op, root);
}

void Backend::reduce(TensorView send, TensorView recv, ReduceOp op, int root, Loc loc) {
  detail::CallSiteScope site(loc, "reduce");
  const CallInfo info{"reduce", send.numel, static_cast<int>(send.dtype), static_cast<int>(op), root};
  LOCKSTEP_FRONT_CHECKS(info, check_view(send, "reduce", "send"); check_op_for_dtype(op, send.dtype);
                        check_root(root, size(), "reduce"));
  const bool is_root = rank() == root;
  // Only root's recv matters, and only root can check it: its verdict goes to every rank before
  // any contribution moves, so a bad recv is the same error everywhere and nothing is left in
  // flight for a later reduce to pick up. Other ranks' recv is ignored. (The same buffer as
  // send and recv on root is the in-place form; for the other ranks the two forms are the same
  // call.)
  const bool in_place = is_root && same_buffer(send, recv);
  char verdict[256] = {};
  if (is_root && !in_place) {
    try {
      check_pair(send, recv, "reduce");
      LOCKSTEP_CHECK_ARG(send.numel == recv.numel, "reduce: send has ", send.numel, " elements but recv has ",
                         recv.numel);
    } catch (const Error& e) {
      std::strncpy(verdict, e.what(), sizeof verdict - 1);
    }
  }
  do_broadcast(TensorView{verdict, static_cast<std::int64_t>(sizeof verdict), DType::u8, Device::cpu()}, root);
  if (verdict[0] != '\0') {
    if (is_root) throw InvalidArgument(verdict);
    throw InvalidArgument(detail::concat("reduce: the root (rank ", root, ") refused its recv, so no rank reduced: ",
                                         verdict, detail::rank_suffix()));
  }
  if (in_place) return do_reduce(send, op, root);
  do_reduce(send, is_root ? recv : TensorView{nullptr, 0, send.dtype, send.device}, op, root);
}

void Backend::allgather(TensorView send, TensorView recv, Loc loc) {
  detail::CallSiteScope site(loc, "allgather");
  const CallInfo info{"allgather", send.numel, static_cast<int>(send.dtype), -1, -1};
  // In place: send is this rank's block of recv (MPI_IN_PLACE, NCCL's in-place form).
  const bool in_place = recv.numel == times(send.numel, size()) &&
                        same_buffer(send, block_of(recv, rank(), send.numel));
  LOCKSTEP_FRONT_CHECKS(info, in_place ? check_view(recv, "allgather", "recv") : check_pair(send, recv, "allgather");
                        LOCKSTEP_CHECK_ARG(recv.numel == times(send.numel, size()),
                                           "allgather: recv must hold size() x send = ", size(), " x ",
                                           send.numel, " elements, but holds ", recv.numel));
  do_allgather(send, recv);
}

void Backend::reduce_scatter(TensorView send, TensorView recv, ReduceOp op, Loc loc) {
  detail::CallSiteScope site(loc, "reduce_scatter");
  const CallInfo info{"reduce_scatter", recv.numel, static_cast<int>(send.dtype), static_cast<int>(op), -1};
  // In place: recv is this rank's block of send.
  const bool in_place = send.numel == times(recv.numel, size()) &&
                        same_buffer(recv, block_of(send, rank(), recv.numel));
  LOCKSTEP_FRONT_CHECKS(info, in_place ? check_view(send, "reduce_scatter", "send") : check_pair(send, recv, "reduce_scatter");
                        check_op_for_dtype(op, send.dtype);
                        LOCKSTEP_CHECK_ARG(send.numel == times(recv.numel, size()),
                                           "reduce_scatter: send must hold size() x recv = ", size(), " x ",
                                           recv.numel, " elements, but holds ", send.numel));
  do_reduce_scatter(send, recv, op);
}

namespace {
// What allreduce_wire16 and reduce_scatter_wire16 accept, beyond check_view's checks.
void check_wire16(const TensorView& v, DType wire, ReduceOp op, const char* what, const char* which) {
  LOCKSTEP_CHECK_ARG(wire == DType::bf16 || wire == DType::f16, what, ": the wire dtype must be bf16 or f16, got ",
                     name(wire));
  LOCKSTEP_CHECK_ARG(op == ReduceOp::sum || op == ReduceOp::avg, what, ": op must be sum or avg, got ", name(op));
  LOCKSTEP_CHECK_ARG(v.dtype == DType::f32, what, ": ", which, " must be f32 (the dtype compressed to ", name(wire),
                     "), got ", name(v.dtype));
  LOCKSTEP_CHECK_ARG(v.device.is_cpu(), what, ": ", which, " must be in host memory, got ", to_string(v.device));
}
}  // namespace

void Backend::allreduce_wire16(TensorView buf, DType wire, ReduceOp op, Loc loc) {
  detail::CallSiteScope site(loc, "allreduce_wire16");
  // What goes on the wire: a 16-bit allreduce with sum (the division by size() is local).
  const CallInfo info{"allreduce", buf.numel, static_cast<int>(wire), static_cast<int>(ReduceOp::sum), -1};
  LOCKSTEP_FRONT_CHECKS(info, check_view(buf, "allreduce_wire16", "buf", false);
                        check_wire16(buf, wire, op, "allreduce_wire16", "buf"));
  do_allreduce_wire16(buf, wire, op);
}

void Backend::reduce_scatter_wire16(TensorView send, TensorView recv, DType wire, ReduceOp op, Loc loc) {
  detail::CallSiteScope site(loc, "reduce_scatter_wire16");
  const CallInfo info{"reduce_scatter", recv.numel, static_cast<int>(wire), static_cast<int>(ReduceOp::sum), -1};
  const bool in_place = send.numel == times(recv.numel, size()) &&
                        same_buffer(recv, block_of(send, rank(), recv.numel));
  LOCKSTEP_FRONT_CHECKS(info, in_place ? check_view(send, "reduce_scatter_wire16", "send", false)
                                       : check_pair(send, recv, "reduce_scatter_wire16");
                        check_wire16(send, wire, op, "reduce_scatter_wire16", "send");
                        check_wire16(recv, wire, op, "reduce_scatter_wire16", "recv");
                        LOCKSTEP_CHECK_ARG(send.numel == times(recv.numel, size()),
                                           "reduce_scatter_wire16: send must hold size() x recv = ", size(), " x ",
                                           recv.numel, " elements, but holds ", send.numel));
  do_reduce_scatter_wire16(send, recv, wire, op);
}

namespace {
// The 16-bit buffer of the default three passes: one per thread, grown to the largest call
// (GradientReducer calls in slices of bucket_bytes), so that no call pays for fresh pages.
std::uint16_t* wire_scratch(std::int64_t n) {
  thread_local std::vector<std::uint16_t> buf;
  if (buf.size() < static_cast<std::size_t>(n)) buf.resize(static_cast<std::size_t>(n));
  return buf.data();
}
}  // namespace

void Backend::do_allreduce_wire16(TensorView buf, DType wire, ReduceOp op) {
  std::uint16_t* w = wire_scratch(std::max<std::int64_t>(buf.numel, 1));
  auto* f = static_cast<float*>(buf.data);
  detail::to_wire16(wire, f, w, buf.numel);
  do_allreduce(TensorView{w, buf.numel, wire, Device::cpu()}, ReduceOp::sum);
  detail::from_wire16(wire, w, f, buf.numel, op == ReduceOp::avg ? static_cast<float>(size()) : 1.0f);
}

void Backend::do_reduce_scatter_wire16(TensorView send, TensorView recv, DType wire, ReduceOp op) {
  const std::int64_t n = recv.numel;
  std::uint16_t* w = wire_scratch(std::max<std::int64_t>(send.numel, 1));
  detail::to_wire16(wire, static_cast<const float*>(send.data), w, send.numel);
  std::uint16_t* mine = w + static_cast<std::size_t>(rank()) * static_cast<std::size_t>(n);
  do_reduce_scatter(TensorView{w, send.numel, wire, Device::cpu()}, TensorView{mine, n, wire, Device::cpu()},
                    ReduceOp::sum);
  detail::from_wire16(wire, mine, static_cast<float*>(recv.data), n,
                      op == ReduceOp::avg ? static_cast<float>(size()) : 1.0f);
}

std::shared_ptr<void> Backend::allocate_reduce_buffer(std::size_t bytes, Loc loc) {
  detail::CallSiteScope site(loc, "allocate_reduce_buffer");
  check_usable();
  // Every rank learns the smallest and the largest size asked for, and whether any rank asked
  // for more than an allocation can hold (more than an i64 holds: such a size would turn
  // negative in the exchange), before anything is made, so each is the same error everywhere.
  constexpr auto kMaxBytes = static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max());
  const bool huge = bytes > kMaxBytes;
  const std::int64_t asked = huge ? 0 : static_cast<std::int64_t>(bytes);
  std::int64_t range[3] = {asked, -asked, huge ? 1 : 0};
  if (size() > 1) allreduce(TensorView{range, 3, DType::i64, Device::cpu()}, ReduceOp::max);
  LOCKSTEP_CHECK_ARG(range[2] == 0, "allocate_reduce_buffer: ", huge ? "this rank" : "another rank",
                     " asked for more than ", kMaxBytes, " bytes (this rank: ", bytes, ")");
  LOCKSTEP_CHECK_ARG(range[0] == -range[1], "allocate_reduce_buffer: the ranks asked for different sizes (from ",
                     -range[1], " to ", range[0], " bytes); every rank must ask for the same");
  if (bytes == 0) return nullptr;
  return do_allocate_reduce_buffer(bytes);
}

std::shared_ptr<void> Backend::do_allocate_reduce_buffer(std::size_t bytes) {
  constexpr std::align_val_t kAlign{64};
  void* p = ::operator new(bytes, kAlign);
  std::memset(p, 0, bytes);
  return std::shared_ptr<void>(p, [](void* q) { ::operator delete(q, kAlign); });
}

void Backend::barrier(Loc loc) {
  detail::CallSiteScope site(loc, "barrier");
  check_usable();
  do_barrier();
}

Request Backend::iallreduce(TensorView buf, ReduceOp op, Loc loc) {
  detail::CallSiteScope site(loc, "iallreduce");
  const CallInfo info{"iallreduce", buf.numel, static_cast<int>(buf.dtype), static_cast<int>(op), -1};
  LOCKSTEP_FRONT_CHECKS(info, check_view(buf, "iallreduce", "buf"); check_op_for_dtype(op, buf.dtype));
  return do_iallreduce(buf, op);
}

Request Backend::ibroadcast(TensorView buf, int root, Loc loc) {
  detail::CallSiteScope site(loc, "ibroadcast");
  const CallInfo info{"ibroadcast", buf.numel, static_cast<int>(buf.dtype), -1, root};
  LOCKSTEP_FRONT_CHECKS(info, check_view(buf, "ibroadcast", "buf"); check_root(root, size(), "ibroadcast"));
  return do_ibroadcast(buf, root);
}

Request Backend::iallreduce_many(std::span<const TensorView> bufs, ReduceOp op, Loc loc) {
  detail::CallSiteScope site(loc, "iallreduce_many");
  std::int64_t total = 0;
  for (const auto& b : bufs) total += b.numel;
  const CallInfo info{"iallreduce_many", total, bufs.empty() ? -1 : static_cast<int>(bufs[0].dtype),
                      static_cast<int>(op), -1};
  LOCKSTEP_FRONT_CHECKS(info, {
    for (std::size_t i = 0; i < bufs.size(); ++i) {
      check_view(bufs[i], "iallreduce_many", "a buffer");
      check_op_for_dtype(op, bufs[i].dtype);
    }
    // In-place reductions of overlapping buffers would read each other's results.
    std::vector<std::size_t> order(bufs.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return reinterpret_cast<std::uintptr_t>(bufs[a].data) < reinterpret_cast<std::uintptr_t>(bufs[b].data);
    });
    for (std::size_t k = 1; k < order.size(); ++k)
      LOCKSTEP_CHECK_ARG(!overlaps(bufs[order[k - 1]], bufs[order[k]]), "iallreduce_many: buffers ",
                         order[k - 1], " and ", order[k], " overlap in memory");
  });
  return do_iallreduce_many(bufs, op);
}

namespace {
// The default iallreduce_many: the requests of one iallreduce per buffer, completed together.
class ManyRequests final : public detail::RequestImpl {
 public:
  std::vector<Request> reqs;
  void wait() override {
    for (auto& r : reqs) r.wait();
  }
  bool test() override {
    bool all = true;
    for (auto& r : reqs) all = r.test() && all;
    return all;
  }
};
}  // namespace

Request Backend::do_iallreduce_many(std::span<const TensorView> bufs, ReduceOp op) {
  auto many = std::make_unique<ManyRequests>();
  many->reqs.reserve(bufs.size());
  for (const auto& b : bufs) many->reqs.push_back(do_iallreduce(b, op));
  return Request(std::move(many));
}

#undef LOCKSTEP_FRONT_CHECKS

}  // namespace lockstep
