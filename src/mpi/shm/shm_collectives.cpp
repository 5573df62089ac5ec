// Node-local collectives through a shared-memory segment (see shm_collectives.hpp).
#include "mpi/shm/shm_collectives.hpp"
#include "core/wire16.hpp"

#include <fcntl.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <sched.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <cstring>
#include <new>
#include <string>

#include "comm/drain.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/mpi/mpi_backend.hpp"
#include "mpi/monitor.hpp"


namespace lockstep::detail {

namespace {

constexpr std::size_t kPage = 4096;  // each rank's region starts on its own page
constexpr std::size_t kLine = 64;
// Defaults chosen from bench_collectives / bench_gradsync sweeps (docs/performance.md).
constexpr std::size_t kDefaultSliceBytes = std::size_t{1} << 20;
// Every size: a call that goes to MPI instead must first agree on it with the other ranks (one
// more rendezvous), which costs more than the shared-memory path saves MPI (docs/performance/rounds.md).
constexpr std::size_t kShmMinBytes = 0;
// From here up an in-place allreduce of a registered buffer reads the peers' buffers in place:
// below it the second rendezvous costs more than the copies it saves.
constexpr std::size_t kInPlaceMinBytes = std::size_t{64} << 10;

#if defined(__SSE2__)
// Streams whole 64-byte blocks of src from offset i to dst (16-byte aligned at d + i) with
// non-temporal stores; returns the offset where the blocks end (the caller copies the rest).
std::size_t stream_blocks(char* d, const char* s, std::size_t i, std::size_t bytes) {
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  return i;
}
#endif

// Copies into a slot with non-temporal (streaming) stores: the lines go to memory instead of
// staying modified in this core's cache. The peers then read them from memory at full speed,
// rather than snooping them out of this core's cache, which on some virtual machines is fast
// only while the two vCPUs share a last-level cache (docs/performance/where-the-time-goes.md, "Phases", has the
// figures). Ends with a store fence, so the data is visible before the flag that publishes it.
void copy_to_slot(void* dst, const void* src, std::size_t bytes) {
#if defined(__SSE2__)
  // Small copies stay in cache: there the fence and the trip to memory cost more than they save.
  if (bytes < (std::size_t{32} << 10)) {
    std::memcpy(dst, src, bytes);
    return;
  }
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  std::size_t i = 0;
  if ((reinterpret_cast<std::uintptr_t>(d) & 15) == 0) i = stream_blocks(d, s, 0, bytes);
  if (i < bytes) std::memcpy(d + i, s + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

// Streams `bytes` from src (in cache) to dst (a slot) with non-temporal stores, whatever dst's
// alignment; no fence (the caller fences once, before it publishes the slot).
void stream_bytes(void* dst, const void* src, std::size_t bytes) {
#if defined(__SSE2__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const std::size_t head = std::min(bytes, (16 - (reinterpret_cast<std::uintptr_t>(d) & 15)) & 15);
  std::memcpy(d, s, head);
  const std::size_t i = stream_blocks(d, s, head, bytes);
  if (i < bytes) std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

// dst[i] = src[i] rounded to `wire`, for a slot: converted in blocks in L1 and streamed out, as
// copy_to_slot streams a copy (small amounts are converted in place, in cache). Fences only
// when it streamed: the caller's release store then publishes the slot.
void round_to_slot(DType wire, const float* src, std::uint16_t* dst, std::size_t m) {
  constexpr std::size_t kBlock = 2048;  // 4 KiB of 16-bit values
  if (m * 2 < (std::size_t{32} << 10)) {
    to_wire16(wire, src, dst, static_cast<std::int64_t>(m));
    return;
  }
  alignas(64) std::uint16_t tmp[kBlock];
  for (std::size_t i0 = 0; i0 < m; i0 += kBlock) {
    const std::size_t len = std::min(kBlock, m - i0);
    to_wire16(wire, src + i0, tmp, static_cast<std::int64_t>(len));
    stream_bytes(dst + i0, tmp, len * 2);
  }
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// The reduction of the fused 16-bit collectives: out[i] = widen(round(sum over p of widen(s_p[i])))
// (/ n for avg), p in rank order, where s_p is rank p's slot and this rank's own values (`me`)
// are rounded again from `own` (the same bits as its slot, read from cache instead of memory).
// Every input element of a block is read before the block of out is written, so out may be own.
// The same additions in the same order as reduce16 and the same conversions as the reducer's
// three passes (from_wire16 with the division), so the bits are theirs.
void sum_wire16(DType w, ReduceOp op, int n, int me, const std::uint16_t* const* s, const float* own, float* out,
                std::size_t m) {
  constexpr std::size_t kBlock = 512;
  alignas(64) float acc[kBlock];
  alignas(64) float tmp[kBlock];
  alignas(64) std::uint16_t mine[kBlock];
  const std::uint16_t* local[ShmCollectives::kMaxRanks];
  const float div = op == ReduceOp::avg ? static_cast<float>(n) : 1.0f;
#if defined(__SSE2__)
  if (w == DType::bf16 && exact_reciprocal(div)) {
    // bf16 in registers, 4 elements at a time: own values rounded, every rank's widened (a
    // 16-bit value shifted into the top half is its f32), added in rank order, the sum rounded
    // and widened, times 1 / div (the same bits as / div). One pass instead of six over a block.
    const __m128 k = _mm_set1_ps(1.0f / div);
    const __m128i zero = _mm_setzero_si128();
    std::size_t i = 0;
    for (; i + 4 <= m; i += 4) {
      const __m128i mine4 = _mm_slli_epi32(bf16_round4(_mm_castps_si128(_mm_loadu_ps(own + i))), 16);
      auto widened = [&](int p) {
        if (p == me) return _mm_castsi128_ps(mine4);
        return _mm_castsi128_ps(_mm_unpacklo_epi16(zero, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s[p] + i))));
      };
      __m128 acc = widened(0);
      for (int p = 1; p < n; ++p) acc = _mm_add_ps(acc, widened(p));
      const __m128i sum16 = _mm_slli_epi32(bf16_round4(_mm_castps_si128(acc)), 16);
      _mm_storeu_ps(out + i, _mm_mul_ps(_mm_castsi128_ps(sum16), k));
    }
    if (i == m) return;
    // The last elements (fewer than 4) through the general loop below.
    own += i;
    out += i;
    m -= i;
    for (int p = 0; p < n; ++p) local[p] = s[p] + i;
    s = local;
  }
#endif
  for (std::size_t i0 = 0; i0 < m; i0 += kBlock) {
    const std::size_t len = std::min(kBlock, m - i0);
    const auto ln = static_cast<std::int64_t>(len);
    to_wire16(w, own + i0, mine, ln);
    auto src = [&](int p) { return p == me ? mine : s[p] + i0; };
    if (w == DType::bf16) {
      const std::uint16_t* a = src(0);
      for (std::size_t i = 0; i < len; ++i) acc[i] = bf16_value(a[i]);
      for (int p = 1; p < n; ++p) {
        const std::uint16_t* b = src(p);
        for (std::size_t i = 0; i < len; ++i) acc[i] += bf16_value(b[i]);
      }
    } else {
      from_wire16(w, src(0), acc, ln, 1.0f);
      for (int p = 1; p < n; ++p) {
        from_wire16(w, src(p), tmp, ln, 1.0f);
        for (std::size_t i = 0; i < len; ++i) acc[i] += tmp[i];
      }
    }
    to_wire16(w, acc, mine, ln);  // the sum, rounded once
    from_wire16(w, mine, out + i0, ln, div);
  }
}

// out[i] = (((s[0][i] op s[1][i]) op s[2][i]) ...), then / n for avg. The same order on every
// rank, so every rank gets the same bits.
template <class T, ReduceOp Op>
void reduce_slots(T* out, const T* const* s, int n, std::size_t m) {
  auto combine = [](T a, T b) {
    if constexpr (Op == ReduceOp::sum || Op == ReduceOp::avg) return static_cast<T>(a + b);
    else if constexpr (Op == ReduceOp::prod) return static_cast<T>(a * b);
    else if constexpr (Op == ReduceOp::min) return std::min(a, b);
    else return std::max(a, b);
  };
  if (n == 2) {
    const T* a = s[0];
    const T* b = s[1];
    if constexpr (Op == ReduceOp::avg) {
      // x * 0.5 is x / 2 exactly (a power of two), and a multiplication is several times
      // cheaper than a division: at 1 MiB slices the division alone took as long as the copy.
      for (std::size_t i = 0; i < m; ++i) out[i] = (a[i] + b[i]) * T(0.5);
    } else {
      for (std::size_t i = 0; i < m; ++i) out[i] = combine(a[i], b[i]);
    }
    return;
  }
  {
    const T* a = s[0];
    const T* b = s[1];
    for (std::size_t i = 0; i < m; ++i) out[i] = combine(a[i], b[i]);
  }
  for (int p = 2; p < n; ++p) {
    const T* b = s[p];
    for (std::size_t i = 0; i < m; ++i) out[i] = combine(out[i], b[i]);
  }
  if constexpr (Op == ReduceOp::avg) {
    if ((n & (n - 1)) == 0) {  // a power of two: multiplying by 1/n is exact, the same bits as / n
      const T inv = T(1) / static_cast<T>(n);
      for (std::size_t i = 0; i < m; ++i) out[i] *= inv;
    } else {
      const T d = static_cast<T>(n);
      for (std::size_t i = 0; i < m; ++i) out[i] /= d;
    }
  }
}

template <class T>
void reduce_dispatch(ReduceOp op, T* out, const T* const* s, int n, std::size_t m) {
  switch (op) {
    case ReduceOp::sum: return reduce_slots<T, ReduceOp::sum>(out, s, n, m);
    case ReduceOp::prod: return reduce_slots<T, ReduceOp::prod>(out, s, n, m);
    case ReduceOp::min: return reduce_slots<T, ReduceOp::min>(out, s, n, m);
    case ReduceOp::max: return reduce_slots<T, ReduceOp::max>(out, s, n, m);
    case ReduceOp::avg:
      if constexpr (std::is_floating_point_v<T>) return reduce_slots<T, ReduceOp::avg>(out, s, n, m);
      else return;  // rejected before (avg needs a floating dtype)
  }
}

// 16-bit floats (bf16, f16), sum and avg: each element's sum is accumulated in f32, in rank
// order, and rounded once (Open MPI's operators round every partial sum); avg divides in f32
// before that rounding. A block is read from every slot before it is written, so `out` may be
// one of the inputs.
void reduce16(DType w, ReduceOp op, std::uint16_t* out, const std::uint16_t* const* s, int n, std::size_t m) {
  constexpr std::size_t kBlock = 512;
  float acc[kBlock];
  const bool pow2 = (n & (n - 1)) == 0;
  const float inv = 1.0f / static_cast<float>(n), d = static_cast<float>(n);
  for (std::size_t i0 = 0; i0 < m; i0 += kBlock) {
    const std::size_t len = std::min(kBlock, m - i0);
    if (w == DType::bf16) {
      for (std::size_t i = 0; i < len; ++i) acc[i] = bf16_value(s[0][i0 + i]);
      for (int p = 1; p < n; ++p)
        for (std::size_t i = 0; i < len; ++i) acc[i] += bf16_value(s[p][i0 + i]);
    } else {
      from_wire16(w, s[0] + i0, acc, static_cast<std::int64_t>(len), 1.0f);
      float tmp[kBlock];
      for (int p = 1; p < n; ++p) {
        from_wire16(w, s[p] + i0, tmp, static_cast<std::int64_t>(len), 1.0f);
        for (std::size_t i = 0; i < len; ++i) acc[i] += tmp[i];
      }
    }
    if (op == ReduceOp::avg) {
      if (pow2)
        for (std::size_t i = 0; i < len; ++i) acc[i] *= inv;
      else
        for (std::size_t i = 0; i < len; ++i) acc[i] /= d;
    }
    to_wire16(w, acc, out + i0, static_cast<std::int64_t>(len));
  }
}

// out = op over the n slots of m elements of `dtype` (a dtype handles_allreduce() accepted).
void reduce_any(DType dtype, ReduceOp op, char* out, const void* const* slots, int n, std::size_t m) {
  switch (dtype) {
    case DType::f32:
      return reduce_dispatch(op, reinterpret_cast<float*>(out), reinterpret_cast<const float* const*>(slots), n, m);
    case DType::f64:
      return reduce_dispatch(op, reinterpret_cast<double*>(out), reinterpret_cast<const double* const*>(slots), n, m);
    case DType::i32:
      return reduce_dispatch(op, reinterpret_cast<std::int32_t*>(out), reinterpret_cast<const std::int32_t* const*>(slots),
                             n, m);
    case DType::i64:
      return reduce_dispatch(op, reinterpret_cast<std::int64_t*>(out), reinterpret_cast<const std::int64_t* const*>(slots),
                             n, m);
    case DType::bf16:
    case DType::f16:
      return reduce16(dtype, op, reinterpret_cast<std::uint16_t*>(out), reinterpret_cast<const std::uint16_t* const*>(slots),
                      n, m);
    default: return;  // handles_allreduce() said no
  }
}

}  // namespace

// Per-rank flags, each on its own cache line: slices this rank has written into its slot, and
// slices this rank has finished reading (from every slot).
void shm_copy_to_slot(void* dst, const void* src, std::size_t bytes) { copy_to_slot(dst, src, bytes); }

struct ShmCollectives::Control {
  alignas(kLine) std::atomic<std::uint64_t> written{0};
  alignas(kLine) std::atomic<std::uint64_t> done{0};
};

// What a rank was asked to do, stored with each slice so the peers can compare.
struct ShmCollectives::SliceHeader {
  CallRecord call;  // what the agreement compares (agreement.hpp); host 0: device memory for MPI
  // An in-place allreduce of a buffer in a registered region: its id and the buffer's offset
  // in it (-1: none). Not compared: ranks whose buffers differ here take the slots instead.
  std::int64_t region = -1;
  std::uint64_t offset = 0;
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "shared-memory flags need lock-free 64-bit atomics");

namespace {
constexpr std::size_t kControlBytes = 2 * kLine;
constexpr std::size_t kHeaderBytes = kLine;
}  // namespace

std::unique_ptr<ShmCollectives> ShmCollectives::create(MPI_Comm comm, int node_size) {
  int size = 1, rank = 0;
  LOCKSTEP_MPI_CHECK(MPI_Comm_size(comm, &size));
  LOCKSTEP_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  if (size == 1) return nullptr;
  static_assert(sizeof(SliceHeader) <= kHeaderBytes, "a slice header fits in its cache line");

  // Every rank must agree: on one machine, within the rank limit, enabled everywhere; the slice
  // size and threshold are rank 0's.
  // The settings were parsed strictly and agreed by every rank (agree_on_settings, in the
  // MPIBackend constructor); the placement is checked here.
  int ok = (node_size == size && size <= kMaxRanks && settings_shm().value_or(true)) ? 1 : 0;
  LOCKSTEP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm));
  if (!ok) return nullptr;
  const std::size_t slice = settings_shm_slice_bytes().value_or(kDefaultSliceBytes);
  const std::size_t min_bytes = settings_shm_min_bytes().value_or(kShmMinBytes);

  std::unique_ptr<ShmCollectives> self(new ShmCollectives());
  self->rank_ = rank;
  self->size_ = size;
  self->slice_bytes_ = slice;
  self->min_bytes_ = min_bytes;

  // One POSIX shared-memory object for all ranks, created by rank 0 and removed from the name
  // space as soon as every rank has mapped it: nothing is left behind if the job dies, and
  // tearing down is a local munmap (no collective call in a destructor that may run on one rank
  // only, while an exception unwinds).
  const std::size_t region = (kControlBytes + 2 * (kHeaderBytes + slice) + kPage - 1) / kPage * kPage;
  const std::size_t total = region * static_cast<std::size_t>(size);
  char shm_name[64] = {};
  int ok_local = 1;
  int fd = -1;
  if (rank == 0) {
    static std::atomic<unsigned> counter{0};
    std::snprintf(shm_name, sizeof shm_name, "/lockstep-%ld-%u-%lx", static_cast<long>(getpid()),
                  counter.fetch_add(1), static_cast<unsigned long>(std::random_device{}()));
    fd = shm_open(shm_name, O_CREAT | O_EXCL | O_RDWR, 0600);
    ok_local = fd >= 0 && posix_fallocate(fd, 0, static_cast<off_t>(total)) == 0 ? 1 : 0;
  }
  LOCKSTEP_MPI_CHECK(MPI_Bcast(shm_name, sizeof shm_name, MPI_CHAR, 0, comm));
  LOCKSTEP_MPI_CHECK(MPI_Bcast(&ok_local, 1, MPI_INT, 0, comm));
  if (rank != 0 && ok_local) {
    fd = shm_open(shm_name, O_RDWR, 0600);
    ok_local = fd >= 0 ? 1 : 0;
  }
  void* map = MAP_FAILED;
  if (ok_local) {
    map = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ok_local = map != MAP_FAILED ? 1 : 0;
  }
  if (fd >= 0) close(fd);
  int ok_all = ok_local;
  // Also the barrier after which no rank needs the name any more.
  const int rc = MPI_Allreduce(MPI_IN_PLACE, &ok_all, 1, MPI_INT, MPI_MIN, comm);
  if (rank == 0 && shm_name[0] != '\0') shm_unlink(shm_name);
  LOCKSTEP_MPI_CHECK(rc);
  if (!ok_all) {
    if (map != MAP_FAILED) munmap(map, total);
    return nullptr;
  }
  self->map_ = map;
  self->map_bytes_ = total;
  for (int p = 0; p < size; ++p) self->base_[p] = static_cast<char*>(map) + region * static_cast<std::size_t>(p);
  new (self->base_[rank]) Control();
  // Every rank's control block is constructed before anyone reads it.
  LOCKSTEP_MPI_CHECK(MPI_Barrier(comm));
  return self;
}

ShmCollectives::~ShmCollectives() {
  if (map_ != nullptr) munmap(map_, map_bytes_);
}

bool ShmCollectives::handles_allreduce(std::int64_t numel, DType dtype, ReduceOp op, bool host) const noexcept {
  if (!host) return false;
  const bool half16 = (dtype == DType::bf16 || dtype == DType::f16) && (op == ReduceOp::sum || op == ReduceOp::avg);
  if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::i32 && dtype != DType::i64 && !half16) return false;
  return numel > 0 && static_cast<std::size_t>(numel) * size_of(dtype) >= min_bytes_;
}

bool ShmCollectives::handles_broadcast(std::int64_t numel, DType dtype, bool host) const noexcept {
  if (!host || numel <= 0) return false;
  const std::size_t bytes = static_cast<std::size_t>(numel) * size_of(dtype);
  // Small: the ranks meet in a slot anyway to agree on the call, so the data travels with the
  // header instead of in an MPI broadcast after it (one rendezvous instead of a rendezvous and a
  // broadcast: bench_collectives, broadcast up to a few KiB). From one slice up: pipelined slices.
  // In between, two copies (root into its slot, the others out of it) lose to MPI's single copy
  // (bench_shm; several times slower than MPI under CPU contention with 64 KiB pieces).
  return bytes <= kSmallBroadcastBytes || bytes >= std::max(min_bytes_, slice_bytes_);
}

ShmCollectives::SliceHeader* ShmCollectives::header(int peer, std::uint64_t k) const {
  return reinterpret_cast<SliceHeader*>(base_[peer] + kControlBytes + (k & 1) * (kHeaderBytes + slice_bytes_));
}

char* ShmCollectives::slot(int peer, std::uint64_t k) const {
  return reinterpret_cast<char*>(header(peer, k)) + kHeaderBytes;
}

void ShmCollectives::spin_until(const std::atomic<std::uint64_t>& a, std::uint64_t v) {
  // Poll (the peer is usually a few microseconds away), then yield the core: with more ranks
  // than cores the peer may need this one to make progress. No PAUSE instruction in the loop:
  // in a virtual machine a PAUSE loop makes the hypervisor deschedule the waiting vCPU
  // (pause-loop exiting), which costs far more than the wait; Open MPI's polling does not pause
  // either. At every yield the hook runs (stall notices, the deadline): it may throw, so no wait
  // here outlives a stall, a dead peer past the deadline, or a refused collective elsewhere.
  // On a communication thread (GradientReducer's, reducing buckets while backward runs) a long
  // wait means a peer still computing, and this thread's polling takes a core from this rank's
  // own backward wherever ranks and threads outnumber the cores: after about 30 us of polling it
  // sleeps instead, 20 us at first, doubling up to 160 us (a wake-up costs the bucket at most
  // about 200 us, against a quarter of a core for the whole wait). The caller's thread keeps
  // polling: it has nothing else to do, and its latency is the collective's. A hook that
  // progresses MPI requests (the hierarchical path's) is called as often as ever: no sleep.
  const bool background = detail::t_on_comm_thread && (wait_hook_ == nullptr || !wait_hook_->drives_progress());
  int polls = 0, rounds = 0;
  long sleep_ns = 20'000;
  while (a.load(std::memory_order_acquire) < v) {
    if (++polls == 4096) {
      if (wait_hook_ != nullptr) wait_hook_->at_wait();
      if (background && ++rounds > 8) {
        const timespec pause{0, sleep_ns};
        nanosleep(&pause, nullptr);
        sleep_ns = std::min(2 * sleep_ns, 160'000L);
      } else {
        sched_yield();
      }
      polls = 0;
    }
  }
}

void ShmCollectives::wait_written(int peer, std::uint64_t k) {
  spin_until(reinterpret_cast<Control*>(base_[peer])->written, k + 1);
}

void ShmCollectives::wait_done_all(std::uint64_t k) {
  // Slot k & 1 was last used by slice k - 2; every rank must have finished reading it.
  if (k < 2) return;
  for (int p = 0; p < size_; ++p) spin_until(reinterpret_cast<Control*>(base_[p])->done, k - 1);
}

std::vector<CallRecord> ShmCollectives::records(const SliceHeader& mine) const {
  std::vector<CallRecord> by_rank(static_cast<std::size_t>(size_));
  for (int p = 0; p < size_; ++p)
    by_rank[static_cast<std::size_t>(p)] = p == rank_ ? mine.call : header(p, next_)->call;
  return by_rank;
}

// One call, slice by slice: write this rank's header (and data, through `fill`) into its slot,
// publish it, wait for every peer's slot of the same slice, compare the headers, then `use` the
// slots. A disagreement is seen by every rank at the same slice; all of them mark the slice done
// and throw, so the slice counters stay equal and the next call starts in step.
template <class Fill, class Use>
void ShmCollectives::run(const SliceHeader& mine, std::size_t total, std::size_t per, const char* what,
                         Fill&& fill, Use&& use) {
  auto* me = reinterpret_cast<Control*>(base_[rank_]);
  for (std::size_t off = 0; off < total; off += per, ++next_) {
    const std::size_t m = std::min(per, total - off);
    wait_done_all(next_);
    *header(rank_, next_) = mine;
    fill(slot(rank_, next_), off, m);
    me->written.store(next_ + 1, std::memory_order_release);
    bool same = true;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      wait_written(p, next_);
      same = same && header(p, next_)->call.same_call(mine.call);
    }
    if (!same) {
      // Every rank reads the same headers: the same report everywhere.
      const std::vector<CallRecord> by_rank = records(mine);
      me->done.store(next_ + 1, std::memory_order_release);
      ++next_;
      throw_call_mismatch(what, by_rank, rank_, "the shared-memory path's agreement");
    }
    use(off, m);
    me->done.store(next_ + 1, std::memory_order_release);
  }
}

void ShmCollectives::run_call(const CallRecord& record, std::size_t total, std::size_t per, const char* what,
                              const SliceFill& fill, const SliceUse& use) {
  run(SliceHeader{record}, total, per, what, fill, use);
}

// A call that goes to MPI: its header alone is exchanged (one slice with no data), so that every
// rank knows every other rank made the same call, and so takes MPI too.
void ShmCollectives::agree(const SliceHeader& mine, const char* what) {
  run(mine, 1, 1, what, [](char*, std::size_t, std::size_t) {}, [](std::size_t, std::size_t) {});
}

void ShmCollectives::barrier() {
  agree(SliceHeader{call_record(calls_++, CallKind::barrier, 0, DType::u8, -1, -1, true)}, "barrier");
}

bool ShmCollectives::allreduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op,
                               bool host) {
  const std::size_t es = size_of(dtype);
  SliceHeader mine{call_record(calls_++, CallKind::allreduce, numel, dtype, static_cast<int>(op), -1, host)};
  if (!handles_allreduce(numel, dtype, op, host)) {
    agree(mine, "allreduce");
    return false;
  }
  // In place on a buffer of a registered region: the first slice's header says where, and
  // carries no data. Once every rank's header is there, every rank knows whether all of them
  // hold the buffer at the same offset of the same region (then each reduces its share of the
  // elements straight from the peers' buffers into every buffer, no slot copy), or not (then
  // the call runs through the slots from its first slice, like any other).
  std::shared_ptr<Region> region;
  if (send == recv && static_cast<std::size_t>(numel) * es >= kInPlaceMinBytes) {
    std::size_t offset = 0;
    region = find_region(recv, static_cast<std::size_t>(numel) * es, &offset);
    if (region) {
      mine.region = static_cast<std::int64_t>(region->id);
      mine.offset = offset;
    }
  }
  const std::size_t per = slice_bytes_ / es;
  const std::size_t first = std::min(per, static_cast<std::size_t>(numel));
  enum class Mode { slots, in_place, slots_again } mode = Mode::slots;
  auto fill = [&](char* dst, std::size_t off, std::size_t m) {
    if (off == 0 && mine.region >= 0) return;  // the probe carries no data
    copy_to_slot(dst, static_cast<const char*>(send) + off * es, m * es);
  };
  auto use = [&](std::size_t off, std::size_t m) {
    const void* slots[kMaxRanks];
    // This rank's own contribution is read from its send buffer, still in cache from the copy
    // (the slot copy went to memory); the same bits, so the order of the sum is unchanged. In
    // place, out is that very buffer, which the first pass (ranks 0 and 1) reads element by
    // element before writing it, but which later passes find already overwritten: ranks from 2
    // up then read their own slot.
    for (int p = 0; p < size_; ++p) slots[p] = slot(p, next_);
    if (rank_ < 2 || send != recv) slots[rank_] = static_cast<const char*>(send) + off * es;
    reduce_any(dtype, op, static_cast<char*>(recv) + off * es, slots, size_, m);
  };
  // The first slice decides: every header is there when `use` runs.
  run(mine, first, per, "allreduce", fill, [&](std::size_t off, std::size_t m) {
    bool all = true, any = false;
    for (int p = 0; p < size_; ++p) {
      const SliceHeader& h = p == rank_ ? mine : *header(p, next_);
      any = any || h.region >= 0;
      all = all && h.region >= 0 && h.region == mine.region && h.offset == mine.offset;
    }
    if (all) mode = Mode::in_place;
    else if (any) mode = Mode::slots_again;
    else use(off, m);
  });
  if (mode == Mode::in_place) {
    reduce_in_place_share(*region, mine.offset, numel, dtype, op);
    // Every rank's share is written (into every buffer) when every rank has passed this.
    agree(mine, "allreduce");
    in_place_calls_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  std::size_t from = first;
  if (mode == Mode::slots_again) {
    mine.region = -1;  // the slices that follow carry data
    from = 0;
  }
  if (from < static_cast<std::size_t>(numel))
    run(mine, static_cast<std::size_t>(numel) - from, per, "allreduce",
        [&](char* dst, std::size_t off, std::size_t m) { fill(dst, off + from, m); },
        [&](std::size_t off, std::size_t m) { use(off + from, m); });
  return true;
}

// This rank's share of an in-place allreduce over a registered region: elements
// [rank * q, (rank + 1) * q) (q rounded up to a cache line of elements), block by block: the
// block is reduced from every rank's buffer, in rank order, into rank 0's buffer (which the
// first pass reads element by element before writing it, and later passes only read as the sum
// so far: the same bits as the slots' reduction), then copied into the other ranks' buffers
// while it is in cache.
void ShmCollectives::reduce_in_place_share(const Region& r, std::size_t offset, std::int64_t numel, DType dtype,
                                           ReduceOp op) {
  const std::size_t es = size_of(dtype);
  const std::size_t n = static_cast<std::size_t>(numel);
  const std::size_t line = kLine / es;
  const std::size_t q = ((n + static_cast<std::size_t>(size_) - 1) / static_cast<std::size_t>(size_) + line - 1) /
                        line * line;
  const std::size_t begin = std::min(n, q * static_cast<std::size_t>(rank_));
  const std::size_t end = std::min(n, begin + q);
  const std::size_t block = std::max<std::size_t>(line, (std::size_t{64} << 10) / es);
  for (std::size_t b = begin; b < end; b += block) {
    const std::size_t m = std::min(block, end - b);
    const void* in[kMaxRanks];
    for (int p = 0; p < size_; ++p) in[p] = r.base[p] + offset + b * es;
    char* out = r.base[0] + offset + b * es;
    reduce_any(dtype, op, out, in, size_, m);
    for (int p = 1; p < size_; ++p) std::memcpy(r.base[p] + offset + b * es, out, m * es);
  }
}

bool ShmCollectives::reduce(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op, int root,
                            bool host) {
  const std::size_t es = size_of(dtype);
  const SliceHeader mine{call_record(calls_++, CallKind::reduce, numel, dtype, static_cast<int>(op), root, host)};
  if (!handles_allreduce(numel, dtype, op, host)) {
    agree(mine, "reduce");
    return false;
  }
  const bool is_root = rank_ == root;
  auto fill = [&](char* dst, std::size_t off, std::size_t m) {
    if (!is_root) copy_to_slot(dst, static_cast<const char*>(send) + off * es, m * es);
  };
  auto use = [&](std::size_t off, std::size_t m) {
    if (!is_root) return;  // only root reads: every rank's slice into root's recv
    const void* slots[kMaxRanks];
    for (int p = 0; p < size_; ++p) slots[p] = slot(p, next_);
    // Root's own slice is read from its buffer (it wrote no slot). In place, the first pass
    // (ranks 0 and 1) reads each element before writing it; a root from rank 2 up would read
    // its own overwritten values in later passes, so it copies its slice into its slot first.
    if (rank_ < 2 || send != recv) {
      slots[rank_] = static_cast<const char*>(send) + off * es;
    } else {
      std::memcpy(slot(rank_, next_), static_cast<const char*>(send) + off * es, m * es);
    }
    reduce_any(dtype, op, static_cast<char*>(recv) + off * es, slots, size_, m);
  };
  run(mine, static_cast<std::size_t>(numel), slice_bytes_ / es, "reduce", fill, use);
  return true;
}

bool ShmCollectives::reduce_scatter(const void* send, void* recv, std::int64_t numel, DType dtype, ReduceOp op,
                                    bool host) {
  const std::size_t es = size_of(dtype);
  const SliceHeader mine{
      call_record(calls_++, CallKind::reduce_scatter, numel, dtype, static_cast<int>(op), -1, host)};
  if (!handles_allreduce(numel, dtype, op, host)) {
    agree(mine, "reduce_scatter");
    return false;
  }
  const std::size_t n = static_cast<std::size_t>(numel), ranks = static_cast<std::size_t>(size_);
  const char* in = static_cast<const char*>(send);
  const char* own = in + static_cast<std::size_t>(rank_) * n * es;  // this rank's block of send
  // In place (recv is this rank's block of send), the first pass of the sum (ranks 0 and 1)
  // reads each element before it writes it, but later passes would find a rank from 2 up's own
  // values overwritten: such a rank copies its own block into its slot too and reads it there.
  const bool own_in_slot = rank_ >= 2 && recv == own;
  // Slice k holds, for every rank p, elements [k * per, k * per + m) of block p, back to back.
  const std::size_t per = std::max<std::size_t>(1, slice_bytes_ / es / ranks);
  auto fill = [&](char* dst, std::size_t off, std::size_t m) {
    for (std::size_t p = 0; p < ranks; ++p)
      if (p != static_cast<std::size_t>(rank_) || own_in_slot)
        copy_to_slot(dst + p * m * es, in + (p * n + off) * es, m * es);
  };
  auto use = [&](std::size_t off, std::size_t m) {
    const void* slots[kMaxRanks];
    for (int p = 0; p < size_; ++p) slots[p] = slot(p, next_) + static_cast<std::size_t>(rank_) * m * es;
    if (!own_in_slot) slots[rank_] = own + off * es;
    reduce_any(dtype, op, static_cast<char*>(recv) + off * es, slots, size_, m);
  };
  run(mine, n, per, "reduce_scatter", fill, use);
  return true;
}

bool ShmCollectives::allgather(const void* send, void* recv, std::int64_t numel, DType dtype, bool host) {
  const std::size_t es = size_of(dtype);
  const SliceHeader mine{call_record(calls_++, CallKind::allgather, numel, dtype, -1, -1, host)};
  if (!(host && numel > 0 && static_cast<std::size_t>(numel) * es * static_cast<std::size_t>(size_) >= min_bytes_)) {
    agree(mine, "allgather");
    return false;
  }
  auto fill = [&](char* dst, std::size_t off, std::size_t m) {
    copy_to_slot(dst, static_cast<const char*>(send) + off * es, m * es);
  };
  auto use = [&](std::size_t off, std::size_t m) {
    for (int p = 0; p < size_; ++p) {
      char* out = static_cast<char*>(recv) + (static_cast<std::size_t>(p) * static_cast<std::size_t>(numel) + off) * es;
      const void* from = p == rank_ ? static_cast<const char*>(send) + off * es : slot(p, next_);
      if (from != out) std::memcpy(out, from, m * es);
    }
  };
  run(mine, static_cast<std::size_t>(numel), slice_bytes_ / es, "allgather", fill, use);
  return true;
}

bool ShmCollectives::broadcast(void* buf, std::int64_t numel, DType dtype, int root, bool host) {
  const std::size_t es = size_of(dtype);
  const SliceHeader mine{call_record(calls_++, CallKind::broadcast, numel, dtype, -1, root, host)};
  if (!handles_broadcast(numel, dtype, host)) {
    agree(mine, "broadcast");
    return false;
  }
  const bool is_root = rank_ == root;
  auto fill = [&](char* dst, std::size_t off, std::size_t m) {
    if (is_root) copy_to_slot(dst, static_cast<const char*>(buf) + off * es, m * es);
  };
  auto use = [&](std::size_t off, std::size_t m) {
    if (!is_root) std::memcpy(static_cast<char*>(buf) + off * es, slot(root, next_), m * es);
  };
  run(mine, static_cast<std::size_t>(numel), slice_bytes_ / es, "broadcast", fill, use);
  return true;
}

bool ShmCollectives::allreduce_wire16(float* buf, std::int64_t numel, DType wire, ReduceOp op) {
  const SliceHeader mine{
      call_record(calls_++, CallKind::allreduce_wire16, numel, wire, static_cast<int>(op), -1, true)};
  if (!handles_wire16(numel)) {
    agree(mine, "allreduce_wire16");
    return false;
  }
  auto fill = [&](char* dst, std::size_t off, std::size_t m) {
    round_to_slot(wire, buf + off, reinterpret_cast<std::uint16_t*>(dst), m);
  };
  auto use = [&](std::size_t off, std::size_t m) {
    const std::uint16_t* slots[kMaxRanks];
    for (int p = 0; p < size_; ++p) slots[p] = reinterpret_cast<const std::uint16_t*>(slot(p, next_));
    sum_wire16(wire, op, size_, rank_, slots, buf + off, buf + off, m);
  };
  // Slices of slice_bytes() of f32 (as the f32 allreduce takes them, so that a slice's f32 side
  // stays in cache between the rounding and the sum); the slots are then half full.
  run(mine, static_cast<std::size_t>(numel), std::max<std::size_t>(1, slice_bytes_ / sizeof(float)),
      "allreduce_wire16", fill, use);
  return true;
}

bool ShmCollectives::reduce_scatter_wire16(const float* send, float* recv, std::int64_t numel, DType wire,
                                           ReduceOp op) {
  const SliceHeader mine{
      call_record(calls_++, CallKind::reduce_scatter_wire16, numel, wire, static_cast<int>(op), -1, true)};
  if (!handles_wire16(numel)) {
    agree(mine, "reduce_scatter_wire16");
    return false;
  }
  const std::size_t n = static_cast<std::size_t>(numel), ranks = static_cast<std::size_t>(size_);
  const float* own = send + static_cast<std::size_t>(rank_) * n;  // this rank's block of send
  // Slice k holds, for every other rank p, elements [k * per, k * per + m) of block p, rounded,
  // at sub-block p (this rank's own sub-block is left unused: it rounds its block from send).
  const std::size_t per = std::max<std::size_t>(1, slice_bytes_ / sizeof(float) / ranks);
  auto fill = [&](char* dst, std::size_t off, std::size_t m) {
    auto* d = reinterpret_cast<std::uint16_t*>(dst);
    for (std::size_t p = 0; p < ranks; ++p)
      if (p != static_cast<std::size_t>(rank_)) round_to_slot(wire, send + p * n + off, d + p * m, m);
  };
  auto use = [&](std::size_t off, std::size_t m) {
    const std::uint16_t* slots[kMaxRanks];
    for (int p = 0; p < size_; ++p)
      slots[p] = reinterpret_cast<const std::uint16_t*>(slot(p, next_)) + static_cast<std::size_t>(rank_) * m;
    sum_wire16(wire, op, size_, rank_, slots, own + off, recv + off, m);
  };
  run(mine, n, per, "reduce_scatter_wire16", fill, use);
  return true;
}

}  // namespace lockstep::detail
