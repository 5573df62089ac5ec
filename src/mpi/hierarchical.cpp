// The collectives that know the topology (see hierarchical.hpp).
#include "mpi/hierarchical.hpp"

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/wire16.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/mpi/mpi_backend.hpp"
#include "mpi/keep_for_process.hpp"
#include "mpi/monitor.hpp"
#include "mpi/mpi_types.hpp"

namespace lockstep::detail {

namespace {
// The chunk of the pipeline (bytes of the caller's buffer per chunk, before the rounding to a
// multiple of the ranks per machine): large enough that a chunk's inter-host allreduce is
// bandwidth-bound, small enough that a 16 MiB gradient bucket is four chunks that overlap.
constexpr std::size_t kDefaultChunkBytes = std::size_t{4} << 20;
// Smaller calls go flat: below it the three stages' latencies (and the agreement's) cost more
// than the network time they save (docs/performance/across-hosts.md, "Hierarchical allreduce across machines",
// has the break-even).
constexpr std::size_t kHierarchyMinBytes = std::size_t{64} << 10;

// A slice of a pipelined call: elements [off, off + c) (of the buffer, or of every block), and
// its slot (0 or 1: the scratch and the requests it uses).
struct Slice {
  std::size_t off = 0, numel = 0;
  int slot = 0;
};

// The slice pipeline every hierarchical collective runs: the n elements in slices of `step`,
// slice k in slot k & 1; start(slice k) (its first stage, and the nonblocking requests that
// carry it across the machines) runs before finish(slice k - 1) (which waits for k - 1's requests
// and runs its last stage), so that slice k's network part overlaps slice k - 1's memory work
// and, when finish waits, slice k's own. At most two slices are in flight: a slot is free again
// when its slice is finished.
template <class Start, class Finish>
void pipeline(std::size_t total, std::size_t step, Start&& start, Finish&& finish) {
  Slice prev;
  bool have_prev = false;
  int index = 0;
  for (std::size_t off = 0; off < total; off += step, ++index) {
    const Slice slice{off, std::min(step, total - off), index & 1};
    start(slice);
    if (have_prev) finish(prev);
    prev = slice;
    have_prev = true;
  }
  if (have_prev) finish(prev);
}
}  // namespace

// Every buffer an MPI request of the object may read or write, and the requests themselves.
// Kept between calls (grown, never shrunk); see the invariant at HierarchicalCollectives::live_.
struct HierarchicalCollectives::InFlight {
  std::vector<char> gather, slot[2], wire[2], inbox[2], stage[2], padded;
  std::int64_t check[2 * CallRecord::kFields] = {};  // the agreement's exchange
  MPI_Request check_req = MPI_REQUEST_NULL;
  std::vector<MPI_Request> p2p[2];  // the inter-host sends and receives of post_exchange, per slot
  MPI_Request pending[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};  // stage 2 of the last two slices

  bool busy() const noexcept {
    bool any = check_req != MPI_REQUEST_NULL || pending[0] != MPI_REQUEST_NULL || pending[1] != MPI_REQUEST_NULL;
    for (const auto& slot_reqs : p2p)
      for (MPI_Request r : slot_reqs) any = any || r != MPI_REQUEST_NULL;
    return any;
  }
};

template <class Stages>
void HierarchicalCollectives::guarded(Stages&& stages) {
  try {
    stages();
  } catch (...) {
    abandon();
    throw;
  }
}

void HierarchicalCollectives::abandon() noexcept {
  if (!live_->busy()) return;  // every request completed: nothing can arrive late
  failed_ = true;
  try {
    keep_for_process(std::move(live_));
    live_ = std::make_shared<InFlight>();
  } catch (...) {  // out of memory: leak it rather than free it
    new std::shared_ptr<InFlight>(std::move(live_));
  }
}

std::unique_ptr<HierarchicalCollectives> HierarchicalCollectives::create(MPI_Comm comm, MPI_Comm node, bool enabled,
                                                                         CommMonitor* monitor, std::size_t chunk_bytes,
                                                                         std::int64_t min_bytes) {
  int size = 1, rank = 0, local_size = 1, local_rank = 0;
  LOCKSTEP_MPI_CHECK(MPI_Comm_size(comm, &size));
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  LOCKSTEP_MPI_CHECK(MPI_Comm_size(node, &local_size));
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(node, &local_rank));
  auto drop = [&] {
    MPI_Comm_free(&node);
    return std::unique_ptr<HierarchicalCollectives>();
  };
  // Every machine the same number of ranks (at least two), at least two machines, enabled on
  // every rank: the same verdict everywhere (one MPI allreduce over comm).
  int verdict[3] = {local_size, -local_size, enabled ? 1 : 0};
  LOCKSTEP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, verdict, 3, MPI_INT, MPI_MIN, comm));
  const bool uniform = verdict[0] == -verdict[1];
  if (!(verdict[2] == 1 && uniform && local_size >= 2 && size / local_size >= 2)) return drop();
  // The shared-memory segment of every machine (a collective over node): on every rank, or none.
  std::unique_ptr<ShmCollectives> shm = ShmCollectives::create(node, local_size);
  int ok = shm ? 1 : 0;
  LOCKSTEP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm));
  if (!ok) {
    shm.reset();
    return drop();
  }
  std::unique_ptr<HierarchicalCollectives> self(new HierarchicalCollectives());
  self->live_ = std::make_shared<InFlight>();
  self->comm_ = comm;
  self->node_ = node;
  self->rank_ = rank;
  self->size_ = size;
  self->local_rank_ = local_rank;
  self->local_size_ = local_size;
  self->hosts_ = size / local_size;
  self->monitor_ = monitor;
  self->chunk_bytes_ = chunk_bytes > 0 ? chunk_bytes : kDefaultChunkBytes;
  self->min_bytes_ = min_bytes >= 0 ? static_cast<std::size_t>(min_bytes) : kHierarchyMinBytes;
  // The ranks with this local rank, one per machine, in the order of comm.
  LOCKSTEP_MPI_CHECK(MPI_Comm_split(comm, local_rank, rank, &self->cross_));
  LOCKSTEP_MPI_CHECK(MPI_Comm_set_errhandler(self->cross_, MPI_ERRORS_RETURN));
  // Where every rank is (for a broadcast's root): its local rank, and its machine's place in cross_.
  int cross_rank = 0;
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(self->cross_, &cross_rank));
  const int where[2] = {local_rank, cross_rank};
  std::vector<int> all(2 * static_cast<std::size_t>(size));
  LOCKSTEP_MPI_CHECK(MPI_Allgather(where, 2, MPI_INT, all.data(), 2, MPI_INT, comm));
  self->rank_at_.assign(static_cast<std::size_t>(size), -1);
  for (int r = 0; r < size; ++r) {
    self->local_of_.push_back(all[2 * static_cast<std::size_t>(r)]);
    self->host_of_.push_back(all[2 * static_cast<std::size_t>(r) + 1]);
    self->rank_at_[static_cast<std::size_t>(self->host_of_.back()) * static_cast<std::size_t>(local_size) +
                   static_cast<std::size_t>(self->local_of_.back())] = r;
  }
  LOCKSTEP_MPI_CHECK(MPI_Comm_set_errhandler(self->node_, MPI_ERRORS_RETURN));
  self->shm_ = std::move(shm);
  self->shm_->set_wait_hook(self.get());
  return self;
}

HierarchicalCollectives::~HierarchicalCollectives() {
  shm_.reset();
  int fin = 0;
  MPI_Finalized(&fin);
  // After a wait that threw (a deadline, a stall elsewhere) a request may still be in flight on
  // the communicators: they are left allocated then, as the backend leaves its own, and so is
  // the memory the request targets.
  const bool busy = failed_ || (live_ && live_->busy());
  if (busy && live_) keep_for_process(std::move(live_));
  if (fin || busy) return;
  if (cross_ != MPI_COMM_NULL) MPI_Comm_free(&cross_);
  if (node_ != MPI_COMM_NULL) MPI_Comm_free(&node_);
}

void HierarchicalCollectives::at_wait() {
  wait_point(monitor_);
  progress();
}

void HierarchicalCollectives::progress() noexcept {
  for (MPI_Request& r : live_->pending) {
    if (r == MPI_REQUEST_NULL) continue;
    int flag = 0;
    const int rc = MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS && error_ == MPI_SUCCESS) error_ = rc;
  }
  for (auto& slot_reqs : live_->p2p)
    for (MPI_Request& r : slot_reqs) {
      if (r == MPI_REQUEST_NULL) continue;
      int flag = 0;
      const int rc = MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS && error_ == MPI_SUCCESS) error_ = rc;
    }
}

void HierarchicalCollectives::wait(MPI_Request* req) {
  int polls = 0;
  while (*req != MPI_REQUEST_NULL) {
    int flag = 0;
    const int rc = MPI_Test(req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS && error_ == MPI_SUCCESS) error_ = rc;
    if (rc != MPI_SUCCESS || flag) break;
    if (++polls == 4096) {
      wait_point(monitor_);  // may throw: the deadline, a stall or refused call elsewhere
      sched_yield();
      polls = 0;
    }
  }
  if (error_ != MPI_SUCCESS) {
    const int rc = error_;
    error_ = MPI_SUCCESS;
    LOCKSTEP_MPI_CHECK(rc);
  }
}

bool HierarchicalCollectives::handles(std::int64_t numel, DType dtype, ReduceOp op, bool host) const noexcept {
  if (!host || numel <= 0) return false;
  const bool half16 = (dtype == DType::bf16 || dtype == DType::f16) && (op == ReduceOp::sum || op == ReduceOp::avg);
  if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::i32 && dtype != DType::i64 && !half16) return false;
  return static_cast<std::size_t>(numel) * size_of(dtype) >= min_bytes_;
}


void HierarchicalCollectives::agree(const CallRecord& mine, const char* what) {
  // First among the ranks of this local rank (over the network), then among the ranks of this
  // machine (shared memory): every rank ends with the max over all ranks of every field and of
  // its complement, and so with the same verdict (agreement.hpp). The exchange's buffer and
  // request live in *live_: a wait that throws leaves them to MPI.
  constexpr int kWords = 2 * CallRecord::kFields;
  std::int64_t* const buf = live_->check;
  guarded([&] {
    agreement_encode(mine, buf);
    LOCKSTEP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, kWords, MPI_INT64_T, MPI_MAX, cross_, &live_->check_req));
    wait(&live_->check_req);
    if (!shm_->allreduce(buf, buf, kWords, DType::i64, ReduceOp::max, true))
      LOCKSTEP_MPI_CHECK(guarded_allreduce(MPI_IN_PLACE, buf, kWords, MPI_INT64_T, MPI_MAX, node_));
  });
  if (agreement_holds(buf, CallRecord::kFields)) return;
  // Every rank has the same verdict: every rank gathers every rank's call to name who differs.
  std::vector<CallRecord> by_rank(static_cast<std::size_t>(size_));
  LOCKSTEP_MPI_CHECK(guarded_allgather(&mine, static_cast<int>(sizeof mine), MPI_BYTE, by_rank.data(),
                                       static_cast<int>(sizeof mine), MPI_BYTE, comm_));
  throw_call_mismatch(what, by_rank, rank_, "the hierarchical path's agreement");
}

bool HierarchicalCollectives::allreduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op,
                                      bool host) {
  // Agreed first, then the path chosen from the agreed fields: the same on every rank.
  agree(call_record(calls_++, CallKind::allreduce, numel, dtype, static_cast<int>(op), -1, host), "allreduce");
  if (!handles(numel, dtype, op, host)) return false;
  guarded([&] {
    run(static_cast<const char*>(send), static_cast<char*>(recv), static_cast<std::size_t>(numel), dtype, op,
        DType::f32);
  });
  return true;
}

void HierarchicalCollectives::run(const char* in, char* out, std::size_t total, DType dtype, ReduceOp op, DType wire) {
  const bool w16 = wire == DType::bf16 || wire == DType::f16;
  const std::size_t elem_bytes = size_of(dtype);
  const auto per_host = static_cast<std::size_t>(local_size_), hosts = static_cast<std::size_t>(hosts_);
  // Chunks of a multiple of `unit` elements: L blocks, and on the 16-bit wire each block H pieces.
  // Only the last chunk may be shorter, and if it is not a multiple of `unit` it goes through a
  // scratch buffer padded with zeros (whose results are dropped).
  const std::size_t unit = w16 ? per_host * hosts : per_host;
  const std::size_t chunk = std::max<std::size_t>(unit, chunk_bytes_ / elem_bytes / unit * unit);
  const ReduceOp sum_op = op == ReduceOp::avg ? ReduceOp::sum : op;
  const MPI_Datatype mpi_dtype = mpib::mpi_type(dtype);
  const MPI_Op mpi_reduce = mpib::mpi_op(sum_op, dtype);
  // The 16-bit wire: what the pieces are summed with between the machines (the backend's
  // operator, as reduce_scatter_wire16's), and the bytes of a value on the network.
  const MPI_Datatype wire_mpi_dtype = w16 ? mpib::mpi_type(wire) : mpi_dtype;
  const MPI_Op wire_mpi_reduce = w16 ? mpib::mpi_op(ReduceOp::sum, wire) : mpi_reduce;
  const std::size_t wire_bytes = w16 ? size_of(wire) : elem_bytes;
  InFlight& flight = *live_;

  struct Place {
    char* work = nullptr;     // the chunk's L blocks (out, or the padded scratch)
    std::size_t block_numel = 0;  // the length of each of the chunk's blocks
    char* copy_to = nullptr;  // where the chunk's elements go at the end (padded chunk), else null
  };
  Place place[2];
  auto start = [&](const Slice& slice) {
    Place& at = place[slice.slot];
    const char* src = in + slice.off * elem_bytes;
    at.copy_to = nullptr;
    if (slice.numel % unit == 0) {
      at.block_numel = slice.numel / per_host;
      at.work = out + slice.off * elem_bytes;
    } else {
      at.block_numel = (slice.numel + unit - 1) / unit * unit / per_host;
      flight.padded.assign(at.block_numel * per_host * elem_bytes, 0);
      std::memcpy(flight.padded.data(), src, slice.numel * elem_bytes);
      src = flight.padded.data();
      at.work = flight.padded.data();
      at.copy_to = out + slice.off * elem_bytes;
    }
    // Stage 1: this machine's sum of block lr of the chunk, into the slot's stage buffer (the
    // object's own memory: stage 2's request never targets the caller's buffer). In f32 on the
    // 16-bit wire too: the ranks of one machine never round.
    char* block = scratch(flight.stage[slice.slot], at.block_numel * elem_bytes);
    if (!shm_->reduce_scatter(src, block, static_cast<std::int64_t>(at.block_numel), dtype, sum_op, true))
      LOCKSTEP_MPI_CHECK(
          guarded_reduce_scatter_block(src, block, static_cast<int>(at.block_numel), mpi_dtype, mpi_reduce, node_));
    // Stage 2, nonblocking: the block among the machines. It runs while the previous chunk's
    // all-gather and the next chunk's reduce-scatter do (their waits test it).
    if (!w16) {
      LOCKSTEP_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, block, static_cast<int>(at.block_numel), mpi_dtype, mpi_reduce,
                                        cross_, &flight.pending[slice.slot]));
      return;
    }
    // The 16-bit wire: the machine's sum rounded once, then the first half of an allreduce among
    // the machines (a reduce-scatter, point to point: piece h of the block to machine h).
    char* wbuf = scratch(flight.wire[slice.slot], at.block_numel * wire_bytes);
    detail::to_wire16(wire, reinterpret_cast<const float*>(block), wbuf, static_cast<std::int64_t>(at.block_numel));
    post_exchange(wbuf, at.block_numel / hosts, wire_bytes, slice.slot);
  };
  auto finish = [&](const Slice& slice) {
    const Place& at = place[slice.slot];
    char* block = flight.stage[slice.slot].data();
    if (w16) {
      // This machine's piece of the block summed over the machines (16-bit), then every
      // machine's piece to every machine (the second half), and the block widened.
      const std::size_t piece = at.block_numel / hosts;
      char* wbuf = flight.wire[slice.slot].data();
      char* mine = fold_exchange(wbuf, piece, wire_bytes, slice.slot, wire_mpi_dtype, wire_mpi_reduce,
                                 nullptr);  // in the slot's inbox
      const int bytes = static_cast<int>(piece * wire_bytes);
      LOCKSTEP_MPI_CHECK(
          MPI_Iallgather(mine, bytes, MPI_BYTE, wbuf, bytes, MPI_BYTE, cross_, &flight.pending[slice.slot]));
      wait(&flight.pending[slice.slot]);
      detail::from_wire16(wire, wbuf, reinterpret_cast<float*>(block), static_cast<std::int64_t>(at.block_numel),
                          op == ReduceOp::avg ? static_cast<float>(size_) : 1.0f);
    } else {
      exchange_point(monitor_);  // a test's freeze_exchange fault
      wait(&flight.pending[slice.slot]);
      if (op == ReduceOp::avg)
        mpib::scale_host(TensorView{block, static_cast<std::int64_t>(at.block_numel), dtype, Device::cpu()}, size_);
    }
    // Stage 3: every rank's finished block to every rank of this machine.
    if (!shm_->allgather(block, at.work, static_cast<std::int64_t>(at.block_numel), dtype, true))
      LOCKSTEP_MPI_CHECK(guarded_allgather(block, static_cast<int>(at.block_numel), mpi_dtype, at.work,
                                           static_cast<int>(at.block_numel), mpi_dtype, node_));
    if (at.copy_to != nullptr) std::memcpy(at.copy_to, at.work, slice.numel * elem_bytes);
  };
  pipeline(total, chunk, start, finish);
}

bool HierarchicalCollectives::allreduce_wire16(float* buf, std::int64_t numel, DType wire, ReduceOp op) {
  agree(call_record(calls_++, CallKind::allreduce_wire16, numel, wire, static_cast<int>(op), -1, true),
        "allreduce_wire16");
  // Agreed: the caller's other way, the same on every rank.
  if (op != ReduceOp::sum && op != ReduceOp::avg) return false;
  if (!handles(numel, DType::f32, ReduceOp::sum, true)) return false;
  guarded([&] {
    run(reinterpret_cast<const char*>(buf), reinterpret_cast<char*>(buf), static_cast<std::size_t>(numel), DType::f32,
        op, wire);
  });
  return true;
}

bool HierarchicalCollectives::broadcast(void* buf, std::int64_t numel, DType dtype, int root, bool host) {
  // A root out of range is the backend's InvalidArgument before this.
  agree(call_record(calls_++, CallKind::broadcast, numel, dtype, -1, root, host), "broadcast");
  if (!host || numel <= 0 || static_cast<std::size_t>(numel) * size_of(dtype) < min_bytes_) return false;
  guarded([&] { run_broadcast(static_cast<char*>(buf), static_cast<std::size_t>(numel), dtype, root); });
  return true;
}

void HierarchicalCollectives::run_broadcast(char* buf, std::size_t total, DType dtype, int root) {
  const std::size_t elem_bytes = size_of(dtype);
  const int local_root = local_of_[static_cast<std::size_t>(root)];
  const int host_root = host_of_[static_cast<std::size_t>(root)];
  const bool carrier = local_rank_ == local_root;  // takes part in the inter-host broadcast
  const std::size_t chunk = std::max<std::size_t>(1, chunk_bytes_ / elem_bytes);
  InFlight& flight = *live_;
  auto start = [&](const Slice& slice) {
    // Across the machines, nonblocking, through the slot's stage buffer (the object's own
    // memory): it runs while the previous chunk is spread (the shared-memory waits test it).
    if (!carrier) return;
    char* stage = scratch(flight.stage[slice.slot], slice.numel * elem_bytes);
    if (rank_ == root) std::memcpy(stage, buf + slice.off * elem_bytes, slice.numel * elem_bytes);
    LOCKSTEP_MPI_CHECK(MPI_Ibcast(stage, static_cast<int>(slice.numel * elem_bytes), MPI_BYTE, host_root, cross_,
                                  &flight.pending[slice.slot]));
  };
  auto finish = [&](const Slice& slice) {
    if (carrier) {
      wait(&flight.pending[slice.slot]);
      if (rank_ != root)
        std::memcpy(buf + slice.off * elem_bytes, flight.stage[slice.slot].data(), slice.numel * elem_bytes);
    }
    // Within the machine, from the carrier (the root itself on the root's machine).
    char* part = buf + slice.off * elem_bytes;
    if (!shm_->broadcast(part, static_cast<std::int64_t>(slice.numel), dtype, local_root, true))
      LOCKSTEP_MPI_CHECK(guarded_bcast(part, static_cast<int>(slice.numel * elem_bytes), MPI_BYTE, local_root, node_));
  };
  pipeline(total, chunk, start, finish);
}

// ---------------------------------------------------------------------------------------------
// Reduce-scatter and all-gather (the sharded optimizer's two collectives)
// ---------------------------------------------------------------------------------------------

bool HierarchicalCollectives::reduce_scatter(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op,
                                           bool host) {
  agree(call_record(calls_++, CallKind::reduce_scatter, numel, dtype, static_cast<int>(op), -1, host),
        "reduce_scatter");
  if (numel <= 0 || !handles(numel * size_, dtype, op, host)) return false;
  guarded([&] {
    run_reduce_scatter(static_cast<const char*>(send), static_cast<char*>(recv), static_cast<std::size_t>(numel),
                       dtype, op, DType::f32);
  });
  return true;
}

bool HierarchicalCollectives::reduce_scatter_wire16(const float* send, float* recv, std::int64_t numel, DType wire,
                                                  ReduceOp op) {
  agree(call_record(calls_++, CallKind::reduce_scatter_wire16, numel, wire, static_cast<int>(op), -1, true),
        "reduce_scatter_wire16");
  if (op != ReduceOp::sum && op != ReduceOp::avg) return false;  // agreed: the same on every rank
  if (numel <= 0 || !handles(numel * size_, DType::f32, ReduceOp::sum, true)) return false;
  guarded([&] {
    run_reduce_scatter(reinterpret_cast<const char*>(send), reinterpret_cast<char*>(recv),
                       static_cast<std::size_t>(numel), DType::f32, op, wire);
  });
  return true;
}

bool HierarchicalCollectives::allgather(const void* send, void* recv, std::int64_t numel, DType dtype, bool host) {
  agree(call_record(calls_++, CallKind::allgather, numel, dtype, -1, -1, host), "allgather");
  if (!host || numel <= 0 || static_cast<std::size_t>(numel) * size_of(dtype) * static_cast<std::size_t>(size_) < min_bytes_)
    return false;
  guarded([&] {
    run_allgather(static_cast<const char*>(send), static_cast<char*>(recv), static_cast<std::size_t>(numel), dtype);
  });
  return true;
}

bool HierarchicalCollectives::reduce(const void*, void*, std::int64_t numel, DType dtype, ReduceOp op, int root,
                                     bool) {
  agree(call_record(calls_++, CallKind::reduce, numel, dtype, static_cast<int>(op), root, true), "reduce");
  return false;
}

void HierarchicalCollectives::barrier() {
  agree(call_record(calls_++, CallKind::barrier, 0, DType::u8, -1, -1, true), "barrier");
}

void HierarchicalCollectives::post_exchange(const char* pieces, std::size_t piece_numel, std::size_t elem_bytes,
                                            int slot) {
  const auto hosts = static_cast<std::size_t>(hosts_);
  const auto this_host = static_cast<std::size_t>(host_of_[static_cast<std::size_t>(rank_)]);  // rank in cross_
  char* inbox = scratch(live_->inbox[slot], hosts * piece_numel * elem_bytes);
  std::vector<MPI_Request>& reqs = live_->p2p[slot];
  reqs.assign(2 * (hosts - 1), MPI_REQUEST_NULL);
  const int bytes = static_cast<int>(piece_numel * elem_bytes);
  for (std::size_t distance = 1; distance < hosts; ++distance) {
    const std::size_t from = (this_host + hosts - distance) % hosts, to = (this_host + distance) % hosts;
    LOCKSTEP_MPI_CHECK(MPI_Irecv(inbox + from * piece_numel * elem_bytes, bytes, MPI_BYTE, static_cast<int>(from), slot,
                                 cross_, &reqs[2 * (distance - 1)]));
    LOCKSTEP_MPI_CHECK(MPI_Isend(pieces + to * piece_numel * elem_bytes, bytes, MPI_BYTE, static_cast<int>(to), slot,
                                 cross_, &reqs[2 * (distance - 1) + 1]));
  }
}

char* HierarchicalCollectives::fold_exchange(const char* pieces, std::size_t piece_numel, std::size_t elem_bytes,
                                             int slot, MPI_Datatype mpi_dtype, MPI_Op mpi_reduce, char* acc) {
  for (MPI_Request& r : live_->p2p[slot]) wait(&r);
  const auto hosts = static_cast<std::size_t>(hosts_);
  const auto this_host = static_cast<std::size_t>(host_of_[static_cast<std::size_t>(rank_)]);
  char* inbox = live_->inbox[slot].data();
  if (acc == nullptr) acc = inbox + this_host * piece_numel * elem_bytes;  // inbox's own place is free
  auto piece = [&](std::size_t host) -> const char* {
    return host == this_host ? pieces + this_host * piece_numel * elem_bytes : inbox + host * piece_numel * elem_bytes;
  };
  // acc = piece 0, then acc = piece h op acc (MPI_Reduce_local, the backend's operators: the
  // 16-bit ones on the wire).
  std::memcpy(acc, piece(0), piece_numel * elem_bytes);
  for (std::size_t host = 1; host < hosts; ++host)
    LOCKSTEP_MPI_CHECK(MPI_Reduce_local(piece(host), acc, static_cast<int>(piece_numel), mpi_dtype, mpi_reduce));
  return acc;
}

void HierarchicalCollectives::run_reduce_scatter(const char* send, char* recv, std::size_t block_numel, DType dtype,
                                                 ReduceOp op, DType wire) {
  const bool w16 = wire == DType::bf16 || wire == DType::f16;
  const std::size_t elem_bytes = size_of(dtype), wire_bytes = w16 ? size_of(wire) : elem_bytes;
  const auto per_host = static_cast<std::size_t>(local_size_), hosts = static_cast<std::size_t>(hosts_);
  const auto ranks = static_cast<std::size_t>(size_);
  // s elements of every block per slice: about chunk_bytes_ of send in all.
  const std::size_t per_slice = std::max<std::size_t>(1, chunk_bytes_ / elem_bytes / ranks);
  const ReduceOp sum_op = op == ReduceOp::avg ? ReduceOp::sum : op;
  const MPI_Datatype mpi_dtype = mpib::mpi_type(w16 ? wire : dtype);
  const MPI_Op mpi_reduce = mpib::mpi_op(sum_op, w16 ? wire : dtype);
  InFlight& flight = *live_;
  char* const in = scratch(flight.gather, ranks * per_slice * elem_bytes);
  auto start = [&](const Slice& slice) {
    const std::size_t count = slice.numel;
    // Stage 1: the slice of every block, ordered by its owner's local rank, then its machine;
    // local rank j ends with this machine's sums of the H blocks' slices owned by local rank j.
    // (Open MPI has no progress thread: the previous slice's requests are tested between copies.)
    for (std::size_t local = 0; local < per_host; ++local)
      for (std::size_t host = 0; host < hosts; ++host) {
        std::memcpy(
            in + (local * hosts + host) * count * elem_bytes,
            send + (static_cast<std::size_t>(rank_at_[host * per_host + local]) * block_numel + slice.off) * elem_bytes,
            count * elem_bytes);
        progress();
      }
    char* part = scratch(flight.slot[slice.slot], hosts * count * elem_bytes);
    if (!shm_->reduce_scatter(in, part, static_cast<std::int64_t>(hosts * count), dtype, sum_op, true))
      LOCKSTEP_MPI_CHECK(guarded_reduce_scatter_block(in, part, static_cast<int>(hosts * count), mpib::mpi_type(dtype),
                                                      mpib::mpi_op(sum_op, dtype), node_));
    // Stage 2, nonblocking: piece h (the slices of the blocks of machine h's rank of this local
    // rank) goes to that rank, point to point, and this rank receives its piece from every
    // other machine: each machine sends (H-1)/H of the slice once. (Open MPI's nonblocking
    // reduce-scatter reduces onto one rank and scatters from it: on two machines one direction
    // carries twice the bytes.) It runs while the next slice runs stage 1 (its copies and the
    // shared-memory waits test it); finish sums the pieces.
    const char* pieces = part;
    if (w16) {
      char* wbuf = scratch(flight.wire[slice.slot], hosts * count * wire_bytes);
      detail::to_wire16(wire, reinterpret_cast<const float*>(part), wbuf, static_cast<std::int64_t>(hosts * count));
      pieces = wbuf;
    }
    post_exchange(pieces, count, wire_bytes, slice.slot);
  };
  auto finish = [&](const Slice& slice) {
    const std::size_t count = slice.numel;
    const char* pieces = w16 ? flight.wire[slice.slot].data() : flight.slot[slice.slot].data();
    char* out = recv + slice.off * elem_bytes;
    // The total of this rank's piece from every machine, in machine order: straight into recv
    // (f32), or in 16-bit into the inbox's own place and then widened (and divided for avg).
    char* acc = fold_exchange(pieces, count, wire_bytes, slice.slot, mpi_dtype, mpi_reduce, w16 ? nullptr : out);
    if (w16) {
      detail::from_wire16(wire, acc, reinterpret_cast<float*>(out), static_cast<std::int64_t>(count),
                          op == ReduceOp::avg ? static_cast<float>(size_) : 1.0f);
    } else if (op == ReduceOp::avg) {
      mpib::scale_host(TensorView{out, static_cast<std::int64_t>(count), dtype, Device::cpu()}, size_);
    }
  };
  pipeline(block_numel, per_slice, start, finish);
}

void HierarchicalCollectives::run_allgather(const char* send, char* recv, std::size_t block_numel, DType dtype) {
  const std::size_t elem_bytes = size_of(dtype);
  const auto per_host = static_cast<std::size_t>(local_size_), hosts = static_cast<std::size_t>(hosts_);
  const auto ranks = static_cast<std::size_t>(size_);
  const std::size_t per_slice = std::max<std::size_t>(1, chunk_bytes_ / elem_bytes / ranks);
  // Stage 1 (over the network) sends the slice of send itself: when send lies in recv (in
  // place) the slices that stage 2 writes there are the same bytes, and a later slice's stage
  // 1 reads a part of send that no earlier stage 2 wrote.
  InFlight& flight = *live_;
  char* const all = scratch(flight.gather, ranks * per_slice * elem_bytes);
  auto start = [&](const Slice& slice) {
    char* mine = scratch(flight.slot[slice.slot], hosts * slice.numel * elem_bytes);
    // Stage 1, nonblocking: the slice of send (copied to the slot's stage buffer: the request
    // reads only the object's own memory) among the ranks of this local rank (one per machine),
    // in machine order, while the previous slice is spread on this machine.
    char* out = scratch(flight.stage[slice.slot], slice.numel * elem_bytes);
    std::memcpy(out, send + slice.off * elem_bytes, slice.numel * elem_bytes);
    LOCKSTEP_MPI_CHECK(MPI_Iallgather(out, static_cast<int>(slice.numel * elem_bytes), MPI_BYTE, mine,
                                      static_cast<int>(slice.numel * elem_bytes), MPI_BYTE, cross_,
                                      &flight.pending[slice.slot]));
  };
  auto finish = [&](const Slice& slice) {
    wait(&flight.pending[slice.slot]);
    const std::size_t count = slice.numel;
    const char* mine = flight.slot[slice.slot].data();  // the slice of every machine's block of this local rank
    // Stage 2: every local rank's H slices to every rank of this machine, then to their places.
    if (!shm_->allgather(mine, all, static_cast<std::int64_t>(hosts * count), dtype, true))
      LOCKSTEP_MPI_CHECK(guarded_allgather(mine, static_cast<int>(hosts * count * elem_bytes), MPI_BYTE, all,
                                          static_cast<int>(hosts * count * elem_bytes), MPI_BYTE, node_));
    for (std::size_t local = 0; local < per_host; ++local)
      for (std::size_t host = 0; host < hosts; ++host) {
        std::memcpy(
            recv + (static_cast<std::size_t>(rank_at_[host * per_host + local]) * block_numel + slice.off) * elem_bytes,
            all + (local * hosts + host) * count * elem_bytes, count * elem_bytes);
        progress();  // the next slice's request
      }
  };
  pipeline(block_numel, per_slice, start, finish);
}

}  // namespace lockstep::detail
