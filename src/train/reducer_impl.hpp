// GradientReducer::Impl, the state of a gradient reducer, shared by the files that implement it
// (internal: not installed). Each member function is defined in the file of its job:
//   gradient_reducer.cpp     the public class: setup, bind, ready reports, accumulate, reduce
//   bucket_plan.cpp          plan(): the buckets, from the last gradient backwards
//   shard_layout.cpp         the flat index space and each rank's shard of it (piece, ranges_of)
//   shard_gather.cpp         gather(): the sharded update's all-gather of the parameters
//   bucket_staging.cpp       packing a bucket before its reduction, unpacking it after, the accumulator
//   bucket_collectives.cpp   the collectives of a bucket (communicate, launch)
//   micro_steps.cpp          the ranks' agreement on the micro-step count, carried by one call a step
//   reducer_thread.cpp       the communication thread (DistributedOptions::comm_thread)
//   reducer_checkpoint.cpp   gathering and scattering a sharded state's fields for checkpoints
//   reducer_options.cpp      the options' checks and the ranks' setup signature
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/core/device_runtime.hpp"
#include "lockstep/core/tensor.hpp"
#include "lockstep/reliability/call_site.hpp"
#include "lockstep/train/gradient_reducer.hpp"
#include "train/exact_sum.hpp"

namespace lockstep {

namespace detail {
/// Across machines, a host bucket's tensors of at least this size are reduced where they lie,
/// one call each, and only its smaller tensors are packed (bucket_plan.cpp). 1 MiB: on one
/// machine the default buckets are 1 MiB, so every tensor this large is already a bucket of its
/// own there and is reduced in place.
inline constexpr std::size_t kInPlaceTensorBytes = std::size_t{1} << 20;

/// Copies n bytes between host or device memory (a device copy is waited for).
void copy_grad_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t n);
}  // namespace detail

struct GradientReducer::Impl {
  struct Bucket {
    std::size_t first = 0, last = 0;  // leaf indices [first, last), forward order
    DType dtype = DType::f32;
    Device device = Device::cpu();
    std::int64_t numel = 0;
    std::vector<std::int64_t> offsets;  // element offset of each leaf inside the bucket
    Tensor work;                        // staging / accumulator, allocated on first need
    Tensor wire;                        // device buckets with a wire dtype: the 16-bit copy
    // Across machines only (see split_across_hosts in bucket_plan.cpp): a host bucket of two or
    // more tensors, at least one of kInPlaceTensorBytes or more, is reduced in parts. `large`
    // lists its tensors of kInPlaceTensorBytes or more (leaf indices, forward order), each
    // reduced where it lies (or in the accumulator) with calls of its own; `small` lists the
    // others, packed together into `pack` (small_numel elements) and reduced with one call. Both
    // follow from the tensors' sizes alone, so every rank makes the same calls. `large` empty:
    // the bucket is reduced whole, as always on one machine.
    std::vector<std::size_t> large, small;
    std::int64_t small_numel = 0;
    Tensor pack;  // the small tensors, packed (allocated on first need)
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
    // What this step reduces, in order, each in slices of `slice` elements (host buckets, set by
    // launch): the bucket's one view, or a split bucket's parts (the packed small tensors, then
    // each large tensor in place). The communication thread reduces these.
    std::vector<TensorView> parts;
    std::int64_t slice = 0;
  };

  Backend* backend;
  DistributedOptions options;
  std::vector<detail::GradLeaf> leaves;
  std::vector<std::string> paths;
  std::vector<Bucket> buckets;  // bucket 0 holds the last leaves
  std::vector<std::size_t> bucket_of;

  // The flat index space of the leaves (forward order) and this rank's shard of it: piece
  // `my_rank` of every bucket (see piece()).
  std::vector<std::int64_t> leaf_off;
  std::int64_t total = 0, my_numel = 0;
  std::vector<FlatRange> my_ranges;
  bool sharded = false;
  bool across_hosts = false;  // the ranks span machines (local_size() < size()), set by plan()
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
  // Deterministic mode (exact_sum.hpp): the exact sum of the micro-batches' gradients, every
  // trainable tensor back to back (tensor j from exact_at[j]); the flat result on the host and
  // the reduced gradients it gives (views of it; the reducer's own tensors on a device), made
  // when first needed (exact_flat_result); a step's reduced gradients (exact_in_place: the bound
  // host gradients themselves, reduced in place, or exact_ptrs').
  detail::ExactSum exact;
  std::vector<std::int64_t> exact_at;
  Tensor exact_flat;
  std::vector<Tensor> exact_out;
  std::vector<Tensor*> exact_ptrs;
  std::vector<Tensor*> exact_in_place;
  void setup_exact();                          // at construction, in deterministic mode
  void exact_flat_result();                    // exact_flat, exact_out, exact_ptrs, once
  std::vector<detail::ExactSum::Part> exact_parts();  // the bound gradients, checked, on the host
  void exact_add();                                   // the bound gradients, as one micro-batch
  // Collective; last: the step's last micro-batch on this rank (exact_parts()), or none.
  const std::vector<Tensor*>& exact_reduce(const std::vector<detail::ExactSum::Part>& last);
  bool owns_grads = false;  // made from gradients (the public constructor): grad_ready binds them

  // The micro-step count's carrier (micro_steps.cpp): the one call of each step that reduces the
  // trailer telling every rank whether the ranks' counts agree. Chosen by plan_carrier from the
  // sizes alone; `used` false where no count can differ.
  struct Carrier {
    static constexpr std::int64_t kTrailer = 64;  // two elements per bit of the count
    bool used = false;
    std::size_t bucket = 0, part = 0;  // the call: the last slice of that part (or its tail)
    bool rs = false;                   // sharded: the part's reduce-scatter (no bucket has a tail)
    std::int64_t count = 0;            // this rank's count, set when the bucket is launched
    std::int64_t size = 0;             // elements of the carried call, with the trailer
    DType dtype = DType::f32;
    Tensor buf;                        // what the call reduces, its elements and the trailer: a
                                       // reduce buffer of the call's size, allocated at setup
    TensorView home;                   // where its elements go back (empty once settled)
    std::int64_t at = 0;               // offset in buf of this rank's reduced elements
    bool settled = false, differ = false;  // the verdict of this step
  } carrier;

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

  // --- the communication thread (reducer_thread.cpp) -------------------------------------------
  ~Impl();
  void wait_idle();
  void worker_loop();
  void enqueue(std::size_t bi);
  void start_thread_if_used();

  // --- the plan and the shards (bucket_plan.cpp, shard_layout.cpp, shard_gather.cpp) ----------
  void plan();
  void split_across_hosts(Bucket& b) const;
  void layout();
  std::pair<std::int64_t, std::int64_t> piece(std::int64_t n, int r) const;
  std::vector<FlatRange> ranges_of(int r) const;
  void gather(const std::vector<Tensor*>& params);

  // --- packing and unpacking (bucket_staging.cpp) ----------------------------------------------
  void ensure_work(Bucket& b);
  std::byte* leaf_in_work(Bucket& b, std::size_t j);
  bool contiguous(const Bucket& b) const;
  void add_bucket(Bucket& b);
  TensorView prepare(std::size_t bi);
  void prepare_parts(std::size_t bi);
  std::byte* leaf_to_reduce(Bucket& b, std::size_t j);
  void unpack_small(Bucket& b);
  TensorView prepare_device_wire(Bucket& b);
  void finish_device_wire(Bucket& b);
  void copy_device(Bucket& b, bool to_work, std::int64_t lo = 0, std::int64_t hi = INT64_MAX);
  void finish(Bucket& b);
  void make_accum_views();

  // --- the collectives (bucket_collectives.cpp) ------------------------------------------------
  void communicate(const Bucket& b, TensorView target, std::int64_t step, bool carried = false);
  std::int64_t slice_elements(const Bucket& b) const;
  void launch(std::size_t bi, bool blocking = false);
  // A nonblocking collective of bucket b, keeping what it may write into: the bucket's buffers
  // and its gradients (reduced where they lie when the bucket is one tensor or split across
  // machines), for the life of the process if its wait fails (Request::keep).
  Request keeping(Request r, const Bucket& b) const;
  void poke();
  void launch_ready();

  // --- the micro-step count's carrier (micro_steps.cpp) -----------------------------------------
  static std::int64_t last_slice(std::int64_t n, std::int64_t step);
  std::vector<std::int64_t> part_sizes(const Bucket& b) const;
  void plan_carrier();
  void ensure_carrier_buf();
  bool carries(std::size_t bi, std::size_t part) const;
  TensorView carry(TensorView home);
  TensorView carry_blocks(TensorView whole, std::int64_t q);
  void settle_carrier();
  void check_micro_steps();

  // --- the step (gradient_reducer.cpp) ---------------------------------------------------------
  void verify_bound(const Bucket& b) const;
  void reset_step();
};

}  // namespace lockstep
