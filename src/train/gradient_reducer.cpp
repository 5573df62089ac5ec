// GradientReducer, the gradient reduction behind DistributedOptimizer: bucket plan, ready
// reports, nonblocking bucket allreduces overlapped with packing and unpacking, accumulation.
#include "lockstep/train/gradient_reducer.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "lockstep/core/device_runtime.hpp"
#include "lockstep/comm/consensus.hpp"
#include "lockstep/core/errors.hpp"
#include "lockstep/train/distributed_optimizer.hpp"
#include "lockstep/reliability/call_site.hpp"
#include "comm/drain.hpp"

namespace lockstep {

using detail::concat;
using detail::GradLeaf;

namespace {
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t n) {
  if (n == 0) return;
  if (dst_dev.is_cpu() && src_dev.is_cpu())
    std::memcpy(dst, src, n);
  else
    device_runtime("DistributedOptimizer").copy(dst, dst_dev, src, src_dev, n);
}

template <class T>
void add_into(T* __restrict__ dst, const T* __restrict__ src, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
}
template <class T>
void divide(T* p, std::int64_t n, T k) {
  for (std::int64_t i = 0; i < n; ++i) p[i] /= k;
}
}  // namespace

struct GradientReducer::Impl {
  struct Bucket {
    std::size_t first = 0, last = 0;  // leaf indices [first, last), forward order
    DType dtype = DType::f32;
    Device device = Device::cpu();
    std::int64_t numel = 0;
    std::vector<std::int64_t> offsets;  // element offset of each leaf inside the bucket
    Tensor work;                        // staging / accumulator, allocated on first need
    Tensor wire;                        // device buckets with a wire dtype: the 16-bit copy
    // per step
    int remaining = 0;  // leaves not yet reported ready
    bool launched = false;
    bool staged = false;  // reduced in `work` and unpacked afterwards
    bool finished = false;  // reduced, and unpacked or scaled
    // One per slice (host, see launch); a device bucket that reduce_bound sent
    // with others in one iallreduce_many: the first of them holds the group's request.
    std::vector<Request> requests;
    // on the communication thread
    bool threaded = false;  // handed to the thread this step
    bool done = false;      // the thread has reduced it (guarded by Impl::wm)
    TensorView target;      // what the thread reduces, in slices of `slice` elements
    std::int64_t slice = 0;
  };

  Backend* backend;
  DistributedOptions options;
  std::vector<GradLeaf> leaves;
  std::vector<std::string> paths;
  std::vector<Bucket> buckets;  // bucket 0 holds the last leaves
  std::vector<std::size_t> bucket_of;

  // The flat index space of the leaves (forward order) and this rank's shard of it: piece
  // `my_rank` of every bucket (see piece()).
  std::vector<std::int64_t> leaf_off;
  std::int64_t total = 0, my_numel = 0;
  std::vector<FlatRange> my_ranges;
  bool sharded = false;
  int nranks = 1, my_rank = 0;
  std::optional<DType> wire;
  Tensor gather_buf;  // the parameter gather of buckets whose parameters are not back to back

  // per step
  std::vector<Tensor*> bound;
  std::unordered_map<const Tensor*, std::size_t> index_of;
  std::vector<char> ready;
  bool is_bound = false;
  std::size_t next_launch = 0;
  std::size_t zero_copy = 0;
  std::vector<DeviceCopy> copies;  // scratch of copy_device
  std::vector<DeviceConvert> convs;  // scratch of the device wire conversions

  // accumulation
  int accumulated = 0;
  std::vector<Tensor> accum_views;  // borrow from the buckets' work buffers
  std::vector<Tensor*> accum_ptrs;
  std::vector<Tensor*> result;

  // The communication thread (DistributedOptions::comm_thread): reduces the host buckets that
  // ready reports launch, in launch order, with blocking collectives. Started at its first use.
  bool use_thread = false;
  bool has_host_bucket = false;  // a bucket of host gradients (set with use_thread)
  std::thread worker;
  std::mutex wm;
  std::condition_variable wcv;
  std::deque<std::pair<std::size_t, detail::CallSite>> wqueue;
  std::size_t wpending = 0;  // buckets queued or being reduced
  bool wstop = false;
  std::exception_ptr werror;  // the first failure of the thread's collectives, until reported

  ~Impl() {
    if (!use_thread) return;
    detail::unregister_drain(this);
    {
      std::unique_lock lk(wm);
      wcv.wait(lk, [&] { return wpending == 0; });  // the buckets' memory must outlive the work
      wstop = true;
    }
    wcv.notify_all();
    if (worker.joinable()) worker.join();
  }

  void wait_idle() {
    std::unique_lock lk(wm);
    wcv.wait(lk, [&] { return wpending == 0; });
  }

  void worker_loop() {
    detail::t_on_comm_thread = true;
    std::unique_lock lk(wm);
    for (;;) {
      wcv.wait(lk, [&] { return wstop || !wqueue.empty(); });
      if (wqueue.empty()) return;
      auto [bi, site] = wqueue.front();
      wqueue.pop_front();
      const bool failed = static_cast<bool>(werror);
      lk.unlock();
      std::exception_ptr err;
      if (!failed) {
        try {
          detail::t_call_site = site;  // the collectives name the call that launched them
          Bucket& b = buckets[bi];
          communicate(b, b.target, b.slice);
        } catch (...) {
          err = std::current_exception();
        }
      }
      lk.lock();
      if (err && !werror) werror = err;
      buckets[bi].done = true;
      --wpending;
      wcv.notify_all();
    }
  }

  void enqueue(std::size_t bi) {
    std::lock_guard lk(wm);
    if (!worker.joinable()) worker = std::thread([this] { worker_loop(); });
    buckets[bi].threaded = true;
    buckets[bi].done = false;
    ++wpending;
    wqueue.emplace_back(bi, detail::t_call_site);
    wcv.notify_all();
  }

  // Sharded: rank r's piece [lo, hi) of a bucket of n elements (bucket-relative). The bucket is
  // cut into nranks contiguous pieces of n / nranks elements; the last rank's piece also takes
  // the n % nranks left over (the tail), so a bucket smaller than nranks elements is the last
  // rank's alone.
  std::pair<std::int64_t, std::int64_t> piece(std::int64_t n, int r) const {
    const std::int64_t q = n / nranks;
    return {r * q, r == nranks - 1 ? n : (r + 1) * q};
  }

  // The reduction of one bucket, blocking, in slices of `step` elements: an allreduce of each
  // slice. Sharded: one in-place reduce-scatter of the bucket's first nranks * q elements (rank r
  // receives the sum of its piece; every rank reduces 1/nranks of the bucket, all at once), and
  // an allreduce of the tail (n % nranks elements, fewer than nranks), of which only the last
  // rank uses the result: the tail has a collective of its own because the bucket is often the
  // user's memory (zero copy), which cannot be padded to a multiple of nranks, and padding a
  // copy would cost a copy of the whole bucket where the tail costs one small call (an
  // allreduce rather than a reduce onto the last rank, whose front end first broadcasts the
  // root's verdict on its buffer: two calls). With a wire dtype the same calls in their 16-bit
  // form (Backend::allreduce_wire16, reduce_scatter_wire16) on the f32 target: the backend
  // rounds, sums and widens (MPIBackend's shared-memory path in one pass). A device bucket
  // with a wire dtype arrives already rounded (its 16-bit copy): summed as it is, and widened
  // and divided by finish_device_wire.
  void communicate(const Bucket& /*b*/, TensorView target, std::int64_t step) {
    const bool wire16 = wire && target.dtype == DType::f32 && target.device.is_cpu();
    const ReduceOp op = wire && !wire16 ? ReduceOp::sum : options.op;
    auto allreduce = [&](TensorView v) {
      if (wire16) backend->allreduce_wire16(v, *wire, op);
      else backend->allreduce(v, op);
    };
    if (!sharded) {
      for (std::int64_t off = 0; off < target.numel; off += step)
        allreduce(target.slice(off, std::min(step, target.numel - off)));
      return;
    }
    // Each call is whole: MPIBackend's shared-memory path slices it itself (each slice holds a
    // part of every rank's piece, so every rank reduces in every slice).
    const std::int64_t q = target.numel / nranks, t = target.numel - q * nranks;
    if (q > 0) {
      if (wire16) backend->reduce_scatter_wire16(target.slice(0, q * nranks), target.slice(my_rank * q, q), *wire, op);
      else backend->reduce_scatter(target.slice(0, q * nranks), target.slice(my_rank * q, q), op);
    }
    if (t > 0) allreduce(target.slice(q * nranks, t));
  }

  // Rank r's ranges of the flat space, in flat order (the last bucket holds the first leaves).
  std::vector<FlatRange> ranges_of(int r) const {
    std::vector<FlatRange> out;
    if (!sharded) {
      if (total > 0) out.push_back({0, total});
      return out;
    }
    for (std::size_t k = buckets.size(); k-- > 0;) {
      const Bucket& b = buckets[k];
      const auto [lo, hi] = piece(b.numel, r);
      if (hi > lo) out.push_back({leaf_off[b.first] + lo, leaf_off[b.first] + hi});
    }
    return out;
  }

  // Sharded update, last part: piece r of every bucket of `params` (the tensors the reducer was
  // set up for, updated on their owner) is all-gathered into every rank's params. A bucket whose
  // parameters lie back to back (any one-tensor bucket) is gathered in place; otherwise this
  // rank's piece is packed into a buffer of the bucket's size, gathered there, and unpacked.
  // Device tensors (all on one device: check_options): the packing and unpacking are one
  // copy_many launch each, queued on the current stream, and the collectives run in a
  // StreamOrderedScope, since the rule's kernels wrote the parameters on that stream.
  void gather(const std::vector<Tensor*>& params) {
    if (!sharded || nranks == 1 || params.empty()) return;
    const bool on_device = !buckets.empty() && !buckets[0].device.is_cpu();
    std::optional<detail::StreamOrderedScope> ordered;
    if (on_device) ordered.emplace();
    copies.clear();  // (copy_device's scratch too)
    // Host: memcpy at once; device: collected into `copies` and sent with flush().
    auto move_bytes = [&](void* dst, const void* src, std::size_t n) {
      if (n == 0) return;
      if (on_device) copies.push_back({dst, src, n});
      else std::memcpy(dst, src, n);
    };
    auto flush = [&] {
      if (on_device && !copies.empty())
        device_runtime("DistributedOptimizer").copy_many(copies, buckets[0].device.index);
      copies.clear();
    };
    // Which buckets' parameters lie back to back; the buffer is made once, for the largest of
    // the others (at most bucket_bytes: a bucket of several tensors is no larger).
    std::vector<char> apart(buckets.size(), 0);
    std::int64_t need = 0;
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      const Bucket& b = buckets[k];
      for (std::size_t j = b.first + 1; j < b.last && !apart[k]; ++j)
        apart[k] = static_cast<const std::byte*>(params[j]->raw_data()) !=
                   static_cast<const std::byte*>(params[j - 1]->raw_data()) + params[j - 1]->nbytes();
      if (apart[k]) need = std::max(need, b.numel);
    }
    if (need > gather_buf.numel()) gather_buf = Tensor::zeros({need}, buckets[0].dtype, buckets[0].device);
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      const Bucket& b = buckets[k];
      if (b.numel == 0) continue;
      const std::size_t es = size_of(b.dtype);
      const bool together = !apart[k];
      const auto [lo, hi] = piece(b.numel, my_rank);
      TensorView whole;
      if (together) {
        whole = TensorView{params[b.first]->raw_data(), b.numel, b.dtype, b.device};
      } else {
        whole = gather_buf.view().slice(0, b.numel);
        for (std::size_t j = b.first; j < b.last; ++j) {
          const std::int64_t o = b.offsets[j - b.first];
          const std::int64_t a = std::max(lo, o), e = std::min(hi, o + leaves[j].numel);
          if (e > a)
            move_bytes(static_cast<std::byte*>(whole.data) + static_cast<std::size_t>(a) * es,
                       static_cast<const std::byte*>(params[j]->raw_data()) + static_cast<std::size_t>(a - o) * es,
                       static_cast<std::size_t>(e - a) * es);
        }
        flush();
      }
      const std::int64_t q = b.numel / nranks, t = b.numel - q * nranks;
      if (q > 0) backend->allgather(whole.slice(my_rank * q, q), whole.slice(0, q * nranks));
      if (t > 0) backend->broadcast(whole.slice(q * nranks, t), nranks - 1);
      if (together) continue;
      for (std::size_t j = b.first; j < b.last; ++j)
        move_bytes(params[j]->raw_data(),
                   static_cast<const std::byte*>(whole.data) + static_cast<std::size_t>(b.offsets[j - b.first]) * es,
                   params[j]->nbytes());
      flush();
    }
  }

  // The flat layout and this rank's shard (after plan()).
  void layout() {
    leaf_off.assign(leaves.size(), 0);
    total = 0;
    for (std::size_t j = 0; j < leaves.size(); ++j) {
      leaf_off[j] = total;
      total += leaves[j].numel;
    }
    nranks = backend->size();
    my_rank = backend->rank();
    wire = options.wire_dtype;
    sharded = options.shard_optimizer_state;
    my_ranges = ranges_of(my_rank);
    my_numel = 0;
    for (const auto& r : my_ranges) my_numel += r.end - r.begin;
  }

  void plan() {
    // Unset, the size follows the path (host_bucket_bytes); a size set is kept as given.
    options.bucket_bytes = host_bucket_bytes(options, *backend);
    bucket_of.assign(leaves.size(), 0);
    // Walk backwards: the last leaves (produced first by backward) go into bucket 0.
    std::size_t i = leaves.size();
    while (i > 0) {
      const std::size_t last = i;
      std::size_t first = i - 1;
      // Host and device buckets have their own size (a bucket never mixes devices).
      const std::size_t cap = leaves[first].device.is_cpu() ? *options.bucket_bytes : options.device_bucket_bytes;
      std::size_t bytes = static_cast<std::size_t>(leaves[first].numel) * size_of(leaves[first].dtype);
      while (first > 0) {
        const auto& prev = leaves[first - 1];
        const std::size_t pb = static_cast<std::size_t>(prev.numel) * size_of(prev.dtype);
        // bytes + pb > cap, without the sum (it could wrap with a bucket_bytes near SIZE_MAX).
        if (prev.dtype != leaves[first].dtype || prev.device != leaves[first].device ||
            bytes > cap || pb > cap - bytes)
          break;
        bytes += pb;
        --first;
      }
      Bucket b;
      b.first = first;
      b.last = last;
      b.dtype = leaves[first].dtype;
      b.device = leaves[first].device;
      for (std::size_t j = first; j < last; ++j) {
        b.offsets.push_back(b.numel);
        b.numel += leaves[j].numel;
        bucket_of[j] = buckets.size();
      }
      buckets.push_back(std::move(b));
      i = first;
    }
  }

  // Whether host buckets go to the communication thread; registers the drain that makes every
  // other collective on the backend wait for the thread's queue.
  void start_thread_if_used() {
    has_host_bucket = std::any_of(buckets.begin(), buckets.end(), [](const Bucket& b) { return b.device.is_cpu(); });
    use_thread = options.comm_thread && backend->concurrent_collectives() &&
                 std::any_of(buckets.begin(), buckets.end(), [](const Bucket& b) { return b.device.is_cpu(); });
    if (use_thread) detail::register_drain(backend, this, [this] { wait_idle(); });
  }

  void ensure_work(Bucket& b) {
    if (b.work.numel() != b.numel) b.work = Tensor::zeros({b.numel}, b.dtype, b.device);
  }

  std::byte* leaf_in_work(Bucket& b, std::size_t j) {
    return static_cast<std::byte*>(b.work.raw_data()) +
           static_cast<std::size_t>(b.offsets[j - b.first]) * size_of(b.dtype);
  }

  bool contiguous(const Bucket& b) const {
    for (std::size_t j = b.first + 1; j < b.last; ++j) {
      const auto* prev = static_cast<const std::byte*>(bound[j - 1]->raw_data());
      if (static_cast<const std::byte*>(bound[j]->raw_data()) != prev + bound[j - 1]->nbytes())
        return false;
    }
    return true;
  }

  // Throws InvalidArgument if a bound gradient of bucket b is no longer what bind() checked:
  // moved from, or reassigned with another size, dtype or device, since it was bound. Called
  // before the bucket is read or reduced, so nothing has been sent when it throws.
  void verify_bound(const Bucket& b) const {
    for (std::size_t j = b.first; j < b.last; ++j) {
      const Tensor& g = *bound[j];
      const GradLeaf& l = leaves[j];
      LOCKSTEP_CHECK_ARG(g.numel() == l.numel && g.dtype() == l.dtype && g.device() == l.device &&
                             (g.raw_data() != nullptr || l.numel == 0),
                         "DistributedOptimizer: gradient '", paths[j], "' changed after it was bound ",
                         "by begin_step/update: it is now ", name(g.dtype()), " ", to_string(g.shape()),
                         " on ", to_string(g.device()), g.raw_data() == nullptr ? " with no memory" : "",
                         ", expected ", name(l.dtype), " of ", l.numel, " elements on ",
                         to_string(l.device), " (was it moved from or reassigned?)");
    }
  }

  void reset_step() {
    is_bound = false;
    bound.clear();
    index_of.clear();
    next_launch = 0;
    for (auto& b : buckets) {
      b.remaining = static_cast<int>(b.last - b.first);
      b.launched = false;
      b.staged = false;
      b.finished = false;
      b.threaded = false;
    }
  }

  // Adds the bound gradients of bucket b into its accumulator.
  void add_bucket(Bucket& b) {
    LOCKSTEP_CHECK_ARG(b.device.is_cpu(), "DistributedOptimizer: gradient accumulation of device "
                                          "tensors is not supported by the core");
    for (std::size_t j = b.first; j < b.last; ++j) {
      const std::int64_t n = leaves[j].numel;
      if (b.dtype == DType::f32)
        add_into(reinterpret_cast<float*>(leaf_in_work(b, j)), bound[j]->data<float>(), n);
      else if (b.dtype == DType::f64)
        add_into(reinterpret_cast<double*>(leaf_in_work(b, j)), bound[j]->data<double>(), n);
      else
        throw InvalidArgument(concat("DistributedOptimizer: gradient accumulation supports f32 "
                                     "and f64 gradients, got ", name(b.dtype), " at '", paths[j], "'"));
    }
  }

  // Makes bucket bi ready to be reduced and returns the view to reduce (packed into the
  // bucket's buffer unless its gradients lie back to back); an empty view when there is nothing
  // to communicate: an empty bucket, or a device bucket at one rank (the sum and the mean of one
  // rank are its gradients; accumulation and the wire dtype are host-only). With a wire dtype
  // the view is f32 as without: the 16-bit collectives round it themselves.
  TensorView prepare(std::size_t bi) {
    Bucket& b = buckets[bi];
    b.launched = true;
    if (b.numel == 0) return {};
    if (!b.device.is_cpu() && nranks == 1) {
      if (contiguous(b)) ++zero_copy;  // in place, trivially
      return {};
    }
    const bool accumulating = accumulated > 0;
    if (wire && !b.device.is_cpu()) return prepare_device_wire(b);
    if (accumulating) {
      add_bucket(b);
      b.staged = true;  // result stays in the accumulator; nothing to unpack
      return b.work.view();
    }
    if (contiguous(b)) {
      ++zero_copy;
      return TensorView{bound[b.first]->raw_data(), b.numel, b.dtype, b.device};
    }
    ensure_work(b);
    if (b.device.is_cpu()) {
      for (std::size_t j = b.first; j < b.last; ++j)
        copy_bytes(leaf_in_work(b, j), b.device, bound[j]->raw_data(), bound[j]->device(), bound[j]->nbytes());
    } else {
      copy_device(b, /*to_work=*/true);  // one launch, ordered on the current stream
    }
    b.staged = true;
    return b.work.view();
  }

  // Device gradients on the wire: rounded into the bucket's wire buffer (kept across steps) with
  // one conversion launch on the current stream (DeviceRuntime::convert_many), not waited for.
  // The whole bucket, sharded or not (the reduce-scatter reads all of it).
  TensorView prepare_device_wire(Bucket& b) {
    if (b.wire.numel() != b.numel) b.wire = Tensor::zeros({b.numel}, *wire, b.device);
    if (accumulated > 0) add_bucket(b);  // refuses device tensors, as without a wire dtype
    convs.clear();
    for (std::size_t j = b.first; j < b.last; ++j)
      if (leaves[j].numel > 0)
        convs.push_back({static_cast<std::byte*>(b.wire.raw_data()) + 2 * static_cast<std::size_t>(b.offsets[j - b.first]),
                         bound[j]->raw_data(), leaves[j].numel});
    device_runtime("DistributedOptimizer").convert_many(convs, DType::f32, *wire, 1.0f, b.device.index);
    b.staged = true;
    return b.wire.view();
  }

  // Device gradients on the wire, after the sum: back to f32 into the gradients, divided by the
  // ranks for avg, in one conversion launch on the current stream. Sharded: this rank's piece.
  void finish_device_wire(Bucket& b) {
    const float div = options.op == ReduceOp::avg ? static_cast<float>(nranks) : 1.0f;
    std::int64_t lo = 0, hi = b.numel;
    if (sharded) std::tie(lo, hi) = piece(b.numel, my_rank);
    convs.clear();
    for (std::size_t j = b.first; j < b.last; ++j) {
      const std::int64_t o = b.offsets[j - b.first];
      const std::int64_t a = std::max(lo, o), e = std::min(hi, o + leaves[j].numel);
      if (e > a)
        convs.push_back({static_cast<float*>(bound[j]->raw_data()) + (a - o),
                         static_cast<const std::byte*>(b.wire.raw_data()) + 2 * static_cast<std::size_t>(a), e - a});
    }
    device_runtime("DistributedOptimizer").convert_many(convs, *wire, DType::f32, div, b.device.index);
  }

  // Packs (to_work) or unpacks the gradients of device bucket b with one copy launch, queued on
  // the current stream of its device and not waited for; only the elements [lo, hi) of the
  // bucket (sharded: this rank's piece, the only part the reduce-scatter reduced).
  void copy_device(Bucket& b, bool to_work, std::int64_t lo = 0, std::int64_t hi = INT64_MAX) {
    copies.clear();
    const std::size_t es = size_of(b.dtype);
    for (std::size_t j = b.first; j < b.last; ++j) {
      const std::int64_t o = b.offsets[j - b.first];
      const std::int64_t a = std::max(lo, o), e = std::min(hi, o + leaves[j].numel);
      if (e <= a) continue;
      std::byte* g = static_cast<std::byte*>(bound[j]->raw_data()) + static_cast<std::size_t>(a - o) * es;
      std::byte* w = leaf_in_work(b, j) + static_cast<std::size_t>(a - o) * es;
      const std::size_t n = static_cast<std::size_t>(e - a) * es;
      if (to_work) copies.push_back({w, g, n});
      else copies.push_back({g, w, n});
    }
    if (!copies.empty()) device_runtime("DistributedOptimizer").copy_many(copies, b.device.index);
  }

  // Starts reducing bucket bi. Nonblocking (one request per slice) when backward reported it,
  // so that the reduction overlaps the rest of backward; blocking, slice after slice, when
  // update() reduces it itself and the bucket is in host memory: nothing is left to overlap
  // then, and MPIBackend's blocking allreduce is the faster one (its shared-memory path on one
  // machine; Open MPI's blocking algorithms elsewhere). Every rank takes the same branch for the
  // same bucket as long as every rank reports the same gradients (the same model code does).
  // Device buckets are never sliced (the slices exist for the host's caches) and always go
  // nonblocking; reduce_bound sends its device buckets together (iallreduce_many) instead.
  void launch(std::size_t bi, bool blocking = false) {
    Bucket& b = buckets[bi];
    b.requests.clear();
    const TensorView target = prepare(bi);
    if (target.numel == 0) return;
    const ReduceOp op = options.op;
    if (!b.device.is_cpu()) {
      detail::StreamOrderedScope ordered;  // packed, or the step's gradients: on the current stream
      if (sharded) {
        // Reduce-scatter (and the tail), blocking: the Backend has no nonblocking form of it.
        communicate(b, target, target.numel);
        return;
      }
      // With a wire dtype the target is the 16-bit copy: summed, and divided when widened.
      b.requests.push_back(backend->iallreduce(target, wire ? ReduceOp::sum : op));
      return;
    }
    // A bucket larger than bucket_bytes (one large tensor) is reduced in slices of bucket_bytes:
    // each slice's reduction then works in cache, which one large reduction does not. Never in
    // slices below kMinSliceBytes: the number of collectives would grow with the tensor over a
    // tiny bucket_bytes (12 bytes: a 4 MiB tensor in 349,526 allreduces a step, each a round
    // trip between the ranks), which looks like a hang over MPI, and smaller slices gain no
    // cache. bucket_bytes == 0 (one bucket per tensor) keeps each tensor whole.
    const std::int64_t step =
        *options.bucket_bytes == 0
            ? target.numel
            : static_cast<std::int64_t>(std::max(*options.bucket_bytes, kMinSliceBytes) / size_of(b.dtype));
    if (!blocking && use_thread) {
      b.target = target;
      b.slice = step;
      enqueue(bi);
      return;
    }
    if (blocking || sharded || wire) {
      // Sharded, or a wire dtype: these collectives have no nonblocking form, so without the
      // thread they run here.
      communicate(b, target, step);
      return;
    }
    for (std::int64_t off = 0; off < target.numel; off += step)
      b.requests.push_back(
          backend->iallreduce(target.slice(off, std::min(step, target.numel - off)), op));
  }

  // Gives MPI a chance to progress the requests in flight (no progress thread in Open MPI).
  void poke() {
    for (std::size_t i = 0; i < next_launch; ++i) {
      for (auto& r : buckets[i].requests) {
        if (r.pending()) {
          r.test();
          return;
        }
      }
    }
  }

  void launch_ready() {
    while (next_launch < buckets.size() && buckets[next_launch].remaining == 0) {
      verify_bound(buckets[next_launch]);
      launch(next_launch++);
    }
  }

  // With accumulation, every rank must have summed the same number of micro-steps: each divides
  // by its own count, so a rank that reduces a cycle cut short (reduce_bound before
  // accumulation_steps micro-steps) would leave the replicas different without a word. One
  // allgather of the counts per optimizer step (only with accumulation_steps > 1; its options
  // are agreed at setup, so every rank makes it), after the step's buckets: a difference throws
  // MismatchError on every rank, naming each rank's count.
  void agree_on_micro_steps() {
    const int n = backend->size();
    std::int64_t mine = accumulated + 1;
    std::vector<std::int64_t> all(static_cast<std::size_t>(n));
    backend->allgather(TensorView{&mine, 1, DType::i64, Device::cpu()},
                       TensorView{all.data(), n, DType::i64, Device::cpu()});
    if (std::all_of(all.begin(), all.end(), [&](std::int64_t c) { return c == all[0]; })) return;
    std::string counts;
    for (int r = 0; r < n; ++r) counts += concat(r == 0 ? "" : ", ", "rank ", r, ": ", all[static_cast<std::size_t>(r)]);
    accumulated = 0;
    reset_step();
    throw MismatchError(concat("GradientReducer: the ranks reduced different numbers of micro-steps (", counts,
                               "; accumulation_steps = ", options.accumulation_steps,
                               "); every rank must reduce the same number, or the replicas would differ. "
                               "The accumulated gradients were dropped",
                               detail::rank_suffix()));
  }

  void finish(Bucket& b) {
    if (b.finished) return;
    if (b.threaded) {
      std::unique_lock lk(wm);
      wcv.wait(lk, [&] { return b.done; });
      if (werror) return;  // reduce_bound reports it once every bucket is done
    }
    for (auto& r : b.requests) r.wait();
    b.finished = true;
    if (b.numel == 0) return;
    if (wire && !b.device.is_cpu()) {
      if (b.staged) finish_device_wire(b);  // (not staged: one rank, nothing was sent)
      return;
    }
    if (accumulated > 0) {
      if (options.op == ReduceOp::avg) {
        const int k = accumulated + 1;
        if (b.dtype == DType::f32)
          divide(b.work.data<float>(), b.numel, static_cast<float>(k));
        else
          divide(b.work.data<double>(), b.numel, static_cast<double>(k));
      }
      return;
    }
    if (!b.staged) return;
    if (!b.device.is_cpu()) {
      // One launch; later work on the stream sees it done. Sharded: this rank's piece only.
      if (sharded) {
        const auto [lo, hi] = piece(b.numel, my_rank);
        copy_device(b, /*to_work=*/false, lo, hi);
      } else {
        copy_device(b, /*to_work=*/false);
      }
      return;
    }
    for (std::size_t j = b.first; j < b.last; ++j)
      copy_bytes(bound[j]->raw_data(), bound[j]->device(), leaf_in_work(b, j), b.device,
                 bound[j]->nbytes());
  }

  void make_accum_views() {
    accum_views.clear();
    accum_ptrs.clear();
    accum_views.reserve(leaves.size());
    for (std::size_t j = 0; j < leaves.size(); ++j) {
      Bucket& b = buckets[bucket_of[j]];
      accum_views.push_back(Tensor::borrow(leaf_in_work(b, j), {leaves[j].numel}, b.dtype, b.device));
    }
    for (auto& t : accum_views) accum_ptrs.push_back(&t);
  }
};

GradientReducer::GradientReducer(Backend& backend, const DistributedOptions& options,
                         std::vector<GradLeaf> leaves, std::vector<std::string> paths)
    : impl_(std::make_unique<Impl>()) {
  impl_->backend = &backend;
  impl_->options = options;
  impl_->leaves = std::move(leaves);
  impl_->paths = std::move(paths);
  impl_->plan();
  impl_->layout();
  impl_->reset_step();
  impl_->start_thread_if_used();
}

GradientReducer::~GradientReducer() = default;

void GradientReducer::bind(const std::vector<Tensor*>& grads) {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(!m.is_bound || m.next_launch == 0,
                     "DistributedOptimizer: buckets of the gradients passed to begin_step are "
                     "in flight; update (or begin_step) must get those same gradient tensors");
  LOCKSTEP_CHECK_ARG(grads.size() == m.leaves.size(), "DistributedOptimizer: got ", grads.size(),
                     " trainable gradients, the optimizer was set up for ", m.leaves.size());
  for (std::size_t j = 0; j < grads.size(); ++j) {
    const auto& l = m.leaves[j];
    const Tensor& g = *grads[j];
    LOCKSTEP_CHECK_ARG(g.numel() == l.numel && g.dtype() == l.dtype && g.device() == l.device,
                       "DistributedOptimizer: gradient '", m.paths[j], "' is ", name(g.dtype()), " ",
                       to_string(g.shape()), " on ", to_string(g.device()), ", expected ",
                       name(l.dtype), " of ", l.numel, " elements on ", to_string(l.device));
  }
  m.reset_step();
  m.bound = grads;
  m.is_bound = true;
  m.index_of.reserve(grads.size());
  for (std::size_t j = 0; j < grads.size(); ++j) m.index_of[grads[j]] = j;
  m.ready.assign(grads.size(), 0);
  m.zero_copy = 0;
  if (m.accumulated > 0) {
    for (auto& b : m.buckets) m.ensure_work(b);
  }
}

bool GradientReducer::bound_to(const std::vector<Tensor*>& grads) const noexcept {
  return impl_->is_bound && impl_->bound == grads;
}

void GradientReducer::mark_ready(const Tensor& grad) {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(m.is_bound, "grad_ready: call begin_step(grads) before reporting gradients");
  auto it = m.index_of.find(&grad);
  LOCKSTEP_CHECK_ARG(it != m.index_of.end(),
                     "grad_ready: the tensor is not one of the trainable gradients passed to "
                     "begin_step");
  const std::size_t j = it->second;
  LOCKSTEP_CHECK_ARG(!m.ready[j], "grad_ready: gradient '", m.paths[j], "' reported twice");
  m.ready[j] = 1;
  if (!final_micro_step()) return;  // accumulate-only micro-step: nothing to launch
  // Without the communication thread, host buckets are launched by reduce_bound, with the
  // blocking collective, on every rank. Launched here they would be nonblocking, so the form of a
  // bucket's collective would depend on which gradients this rank reported (a branch that did
  // not run, a cycle cut short), and MPI does not match a blocking collective with a
  // nonblocking one: the ranks would wait for each other until the deadline.
  if (!m.use_thread && m.has_host_bucket) return;
  auto& b = m.buckets[m.bucket_of[j]];
  --b.remaining;
  if (b.remaining == 0) m.launch_ready();
  m.poke();
}

bool GradientReducer::final_micro_step() const noexcept {
  return impl_->accumulated + 1 >= impl_->options.accumulation_steps;
}

void GradientReducer::accumulate() {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(m.is_bound && m.next_launch == 0,
                     "accumulate: no gradients bound, or buckets already in flight");
  for (const auto& b : m.buckets) m.verify_bound(b);
  for (auto& b : m.buckets) {
    m.ensure_work(b);
    if (m.accumulated == 0) b.work.zero_();
    m.add_bucket(b);
  }
  ++m.accumulated;
  m.reset_step();
}

const std::vector<Tensor*>& GradientReducer::reduce_bound() {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(m.is_bound, "DistributedOptimizer: reduce without bound gradients");
  // Reduce what backward did not report, in bucket order, each host bucket with blocking calls
  // and unpacked right after, while it is still in cache. Consecutive device buckets are packed
  // (one launch each) and sent together in one iallreduce_many (one NCCL group); the group's
  // request sits in its first bucket, which finish() reaches before the others.
  std::vector<std::size_t> group;
  std::vector<TensorView> views;
  auto send_group = [&] {
    if (!views.empty()) {
      detail::StreamOrderedScope ordered;  // packed, or the step's gradients: on the current stream
      m.buckets[group.front()].requests.push_back(
          m.backend->iallreduce_many(views, m.wire ? ReduceOp::sum : m.options.op));
    }
    group.clear();
    views.clear();
  };
  while (m.next_launch < m.buckets.size()) {
    m.verify_bound(m.buckets[m.next_launch]);
    const std::size_t bi = m.next_launch++;
    auto& b = m.buckets[bi];
    if (!b.device.is_cpu() && !m.sharded) {
      b.requests.clear();
      const TensorView t = m.prepare(bi);
      if (t.numel > 0) {
        group.push_back(bi);
        views.push_back(t);
      }
      continue;
    }
    send_group();
    m.launch(bi, /*blocking=*/true);
    if (b.requests.empty()) m.finish(b);
    else m.poke();
  }
  send_group();
  for (auto& b : m.buckets) m.finish(b);
  if (m.use_thread) {
    std::exception_ptr err;
    {
      std::lock_guard lk(m.wm);
      std::swap(err, m.werror);
    }
    if (err) {
      m.reset_step();
      std::rethrow_exception(err);
    }
  }
  if (m.options.accumulation_steps > 1) m.agree_on_micro_steps();
  if (m.accumulated > 0) {
    m.make_accum_views();
    m.result = m.accum_ptrs;
    m.accumulated = 0;
  } else {
    m.result = m.bound;
  }
  m.reset_step();
  return m.result;
}

std::vector<FlatRange> GradientReducer::shard_ranges(int rank) const {
  LOCKSTEP_CHECK_ARG(rank >= 0 && rank < impl_->nranks, "GradientReducer::shard_ranges: rank ", rank,
                     " is out of range [0, ", impl_->nranks, ")");
  return impl_->ranges_of(rank);
}
const std::vector<FlatRange>& GradientReducer::shard_ranges() const noexcept { return impl_->my_ranges; }
std::int64_t GradientReducer::shard_numel() const noexcept { return impl_->my_numel; }
void GradientReducer::gather_shards(const std::vector<Tensor*>& params) { impl_->gather(params); }
std::int64_t GradientReducer::total_numel() const noexcept { return impl_->total; }
const std::vector<std::int64_t>& GradientReducer::leaf_offsets() const noexcept { return impl_->leaf_off; }

std::size_t GradientReducer::bucket_count() const noexcept { return impl_->buckets.size(); }
std::size_t GradientReducer::zero_copy_buckets() const noexcept { return impl_->zero_copy; }
int GradientReducer::accumulated() const noexcept { return impl_->accumulated; }
Backend& GradientReducer::backend() const noexcept { return *impl_->backend; }

const std::vector<std::string>& GradientReducer::names() const noexcept { return impl_->paths; }

GradientReducer::GradientReducer(Backend& backend, std::vector<Tensor*> grads,
                                 std::vector<std::string> names, DistributedOptions options,
                                 std::source_location loc)
    : impl_(std::make_unique<Impl>()) {
  detail::CallSiteScope site(loc, "GradientReducer");
  // Arguments are checked on every rank and the ranks agree on the verdict before anything
  // else: a rank that refuses its own arguments makes every rank throw the same error.
  std::vector<GradLeaf> leaves;
  const detail::Verdict mine = detail::verdict_of([&] {
    LOCKSTEP_CHECK_ARG(options.op == ReduceOp::avg || options.op == ReduceOp::sum,
                       "GradientReducer: op must be avg or sum, got ", name(options.op));
    LOCKSTEP_CHECK_ARG(options.accumulation_steps >= 1,
                       "GradientReducer: accumulation_steps must be >= 1, got ", options.accumulation_steps);
    LOCKSTEP_CHECK_ARG(names.size() == grads.size(), "GradientReducer: ", grads.size(),
                       " gradients and ", names.size(), " names");
    leaves.reserve(grads.size());
    std::unordered_map<const Tensor*, std::size_t> seen;
    for (std::size_t j = 0; j < grads.size(); ++j) {
      LOCKSTEP_CHECK_ARG(grads[j] != nullptr, "GradientReducer: gradient '", names[j], "' is a null pointer");
      const Tensor& g = *grads[j];
      LOCKSTEP_CHECK_ARG(g.raw_data() != nullptr || g.numel() == 0, "GradientReducer: gradient '",
                         names[j], "' has no memory (moved from?)");
      LOCKSTEP_CHECK_ARG(is_floating(g.dtype()), "GradientReducer: gradient '", names[j], "' is ",
                         name(g.dtype()), "; gradients are floating-point tensors");
      auto [it, fresh] = seen.emplace(grads[j], j);
      LOCKSTEP_CHECK_ARG(fresh, "GradientReducer: gradients '", names[it->second], "' and '", names[j],
                         "' are the same tensor");
      leaves.push_back({g.numel(), g.dtype(), g.device(), g.shape()});
    }
    LOCKSTEP_CHECK_ARG(!options.shard_optimizer_state,
                       "GradientReducer: shard_optimizer_state needs an optimizer that updates only its "
                       "shard (DistributedOptimizer); a reducer alone would leave most gradients unreduced");
    const std::string bad = detail::check_options(options, leaves, names);
    LOCKSTEP_CHECK_ARG(bad.empty(), "GradientReducer: ", bad);
  });
  detail::agree(backend, "GradientReducer", 0, mine, 0, "no reducer was made");
  // The ranks compare the size each will use: an explicit 1 MiB and the unset default on one
  // machine are the same buckets.
  options = detail::resolved_options(options, backend);
  const std::string sig = detail::reducer_signature(options, leaves, names);
  detail::check_same_structure(backend, sig, 0, 0, "GradientReducer", [&] {
    return detail::reducer_entries(options, leaves, names);
  });
  impl_->backend = &backend;
  impl_->options = options;
  impl_->leaves = std::move(leaves);
  impl_->paths = std::move(names);
  impl_->plan();
  impl_->layout();
  impl_->reset_step();
  impl_->start_thread_if_used();
  own_ = std::move(grads);
}

void GradientReducer::ready(const Tensor& g) {
  LOCKSTEP_CHECK_ARG(!own_.empty() || impl_->leaves.empty(),
                     "GradientReducer::ready: this reducer was made without gradients (it is "
                     "bound step by step by its optimizer)");
  if (!impl_->is_bound) bind(own_);
  mark_ready(g);
}

bool GradientReducer::reduce() {
  auto& m = *impl_;
  LOCKSTEP_CHECK_ARG(!own_.empty() || m.leaves.empty(),
                     "GradientReducer::reduce: this reducer was made without gradients (it is "
                     "bound step by step by its optimizer)");
  if (!m.is_bound) bind(own_);
  if (!final_micro_step()) {
    accumulate();
    return false;
  }
  const auto& out = reduce_bound();
  if (out != own_) {
    // The accumulated sum lives in the reducer's buffers: copied into the gradients.
    for (std::size_t j = 0; j < own_.size(); ++j)
      copy_bytes(own_[j]->raw_data(), own_[j]->device(), out[j]->raw_data(), out[j]->device(),
                 own_[j]->nbytes());
  }
  return true;
}

std::size_t host_bucket_bytes(const DistributedOptions& o, const Backend& backend) {
  if (o.bucket_bytes) return *o.bucket_bytes;
  // The default suits shared memory; across machines, the network's (gradient_reducer.hpp).
  return backend.local_size() < backend.size() ? kDefaultNetworkBucketBytes : kDefaultBucketBytes;
}

namespace detail {

DistributedOptions resolved_options(const DistributedOptions& o, const Backend& backend) {
  DistributedOptions r = o;
  r.bucket_bytes = host_bucket_bytes(o, backend);
  return r;
}
std::vector<ShardPiece> shard_pieces(const GradientReducer& red) {
  // Each range of this rank's shard lies in one bucket, and each leaf in one bucket: every leaf
  // has at most one piece. Both lists are in flat order.
  std::vector<ShardPiece> out;
  const auto& off = red.leaf_offsets();
  const std::size_t L = off.size();
  auto end_of = [&](std::size_t j) { return j + 1 < L ? off[j + 1] : red.total_numel(); };
  std::size_t j = 0;
  for (const FlatRange& r : red.shard_ranges()) {
    while (j < L && end_of(j) <= r.begin) ++j;
    for (std::size_t k = j; k < L && off[k] < r.end; ++k) {
      const std::int64_t lo = std::max(r.begin, off[k]), hi = std::min(r.end, end_of(k));
      if (hi > lo) out.push_back({k, lo - off[k], hi - off[k]});
    }
  }
  return out;
}

void copy_flat_range(const std::vector<Tensor*>& ts, const std::vector<std::int64_t>& offsets,
                     std::int64_t begin, std::int64_t n, std::byte* buf, bool to_buf) {
  if (n <= 0 || ts.empty()) return;
  const std::size_t es = size_of(ts[0]->dtype());
  // The first tensor that holds `begin`.
  std::size_t j = static_cast<std::size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin());
  j = j == 0 ? 0 : j - 1;
  std::int64_t done = 0;
  for (; j < ts.size() && done < n; ++j) {
    const std::int64_t at = begin + done - offsets[j];
    const std::int64_t len = std::min(ts[j]->numel() - at, n - done);
    if (len <= 0) continue;
    std::byte* t = static_cast<std::byte*>(ts[j]->raw_data()) + static_cast<std::size_t>(at) * es;
    std::byte* bb = buf + static_cast<std::size_t>(done) * es;
    if (to_buf) std::memcpy(bb, t, static_cast<std::size_t>(len) * es);
    else std::memcpy(t, bb, static_cast<std::size_t>(len) * es);
    done += len;
  }
}

void gather_shards(GradientReducer& red, const std::vector<Tensor*>& params) { red.gather_shards(params); }

void gather_field_to_root(GradientReducer& red, const std::vector<Tensor*>& mine_pieces,
                          const std::vector<Tensor*>& full, int root) {
  Backend& b = red.backend();
  const int n = b.size();
  const DType dt = !mine_pieces.empty() ? mine_pieces[0]->dtype() : !full.empty() ? full[0]->dtype() : DType::f32;
  const std::size_t es = size_of(dt);
  // Every rank's shard, as every rank computes it.
  std::vector<std::vector<FlatRange>> ranges(static_cast<std::size_t>(n));
  std::vector<std::int64_t> count(static_cast<std::size_t>(n), 0);
  std::int64_t most = 0;
  for (int r = 0; r < n; ++r) {
    ranges[static_cast<std::size_t>(r)] = red.shard_ranges(r);
    for (const auto& x : ranges[static_cast<std::size_t>(r)]) count[static_cast<std::size_t>(r)] += x.end - x.begin;
    most = std::max(most, count[static_cast<std::size_t>(r)]);
  }
  if (most == 0) return;
  // This rank's shard, packed (its pieces, in flat order, are its ranges cut at tensor ends).
  const std::int64_t mc = count[static_cast<std::size_t>(b.rank())];
  Tensor mine = Tensor::zeros({std::max<std::int64_t>(mc, 1)}, dt), other = Tensor::zeros({most}, dt);
  {
    std::int64_t at = 0;
    for (const Tensor* p : mine_pieces) {  // device pieces: one waited copy each (a checkpoint)
      copy_bytes(static_cast<std::byte*>(mine.raw_data()) + static_cast<std::size_t>(at) * es, Device::cpu(),
                 p->raw_data(), p->device(), p->nbytes());
      at += p->numel();
    }
  }
  const bool is_root = b.rank() == root;
  for (int r = 0; r < n; ++r) {
    const std::int64_t m = count[static_cast<std::size_t>(r)];
    if (m == 0) continue;  // every rank computes the same: no broadcast for an empty shard
    Tensor& buf = r == b.rank() ? mine : other;
    if (r != root) b.broadcast(buf.view().slice(0, m), r);
    if (!is_root) continue;
    std::int64_t at = 0;
    for (const auto& x : ranges[static_cast<std::size_t>(r)]) {
      copy_flat_range(full, red.leaf_offsets(), x.begin, x.end - x.begin,
                      static_cast<std::byte*>(buf.raw_data()) + static_cast<std::size_t>(at) * es, false);
      at += x.end - x.begin;
    }
  }
}

void scatter_field_from_full(const std::vector<ShardPiece>& pieces, const std::vector<Tensor*>& mine_pieces,
                             const std::vector<Tensor*>& full) {
  for (std::size_t k = 0; k < pieces.size() && k < mine_pieces.size(); ++k) {
    const auto& p = pieces[k];
    const Tensor* f = full[p.leaf];
    const std::size_t es = size_of(f->dtype());
    // `full` is on the host (the file's tensors); a device piece is one waited copy.
    copy_bytes(mine_pieces[k]->raw_data(), mine_pieces[k]->device(),
               static_cast<const std::byte*>(f->raw_data()) + static_cast<std::size_t>(p.lo) * es, f->device(),
               static_cast<std::size_t>(p.hi - p.lo) * es);
  }
}

std::string check_options(const DistributedOptions& o, const std::vector<GradLeaf>& leaves,
                          const std::vector<std::string>& paths) {
  auto path = [&](std::size_t j) { return j < paths.size() ? paths[j] : concat("#", j); };
  if (o.wire_dtype) {
    if (*o.wire_dtype != DType::bf16 && *o.wire_dtype != DType::f16)
      return concat("wire_dtype must be bf16 or f16 (a 16-bit float), got ", name(*o.wire_dtype));
    for (std::size_t j = 0; j < leaves.size(); ++j) {
      if (leaves[j].dtype != DType::f32)
        return concat("wire_dtype ", name(*o.wire_dtype), " compresses f32 gradients; '", path(j), "' is ",
                      name(leaves[j].dtype));
    }
  }
  if (o.shard_optimizer_state) {
    for (std::size_t j = 0; j < leaves.size(); ++j) {
      if (leaves[j].dtype != DType::f32 && leaves[j].dtype != DType::f64)
        return concat("shard_optimizer_state needs f32 or f64 trainable tensors; '", path(j), "' is ",
                      name(leaves[j].dtype));
      if (leaves[j].dtype != leaves[0].dtype)
        return concat("shard_optimizer_state needs every trainable tensor of one dtype; '", path(0), "' is ",
                      name(leaves[0].dtype), " and '", path(j), "' is ", name(leaves[j].dtype));
      if (leaves[j].device != leaves[0].device)
        return concat("shard_optimizer_state needs every trainable tensor on one device; '", path(0), "' is on ",
                      to_string(leaves[0].device), " and '", path(j), "' is on ", to_string(leaves[j].device));
    }
  }
  return {};
}

std::string describe_leaf(const GradLeaf& l) {
  return concat("tensor ", name(l.dtype), " ", l.shape.empty() && l.numel != 1 ? concat("of ", l.numel, " elements")
                                                                                 : to_string(l.shape),
                " on ", l.device.is_cpu() ? "cpu" : "cuda");
}

std::vector<StructureEntry> reducer_entries(const DistributedOptions& o, const std::vector<GradLeaf>& leaves,
                                            const std::vector<std::string>& names) {
  std::vector<StructureEntry> e;
  e.push_back({"options", reducer_signature(o, {}, {})});
  for (std::size_t i = 0; i < leaves.size(); ++i)
    e.push_back({i < names.size() ? names[i] : concat("#", i), describe_leaf(leaves[i])});
  return e;
}

std::string reducer_signature(const DistributedOptions& o, const std::vector<GradLeaf>& leaves,
                              const std::vector<std::string>& names) {
  std::string s = concat("bucket_bytes=", o.bucket_bytes ? concat(*o.bucket_bytes) : std::string("default"),
                         " device_bucket_bytes=", o.device_bucket_bytes,
                         " op=", name(o.op),
                         " accumulation_steps=", o.accumulation_steps,
                         " skip_non_finite=", o.skip_non_finite,
                         " check_replicas_every=", o.check_replicas_every, " comm_thread=", o.comm_thread,
                         " shard_optimizer_state=", o.shard_optimizer_state,
                         " wire_dtype=", o.wire_dtype ? name(*o.wire_dtype) : "none", ";");
  // Names carry their length, so that no two lists of names make the same text.
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const std::string& n = i < names.size() ? names[i] : std::string();
    s += concat(n.size(), ":", n, "=", describe_leaf(leaves[i]), ":", leaves[i].numel, ";");
  }
  return s;
}

}  // namespace detail

}  // namespace lockstep
