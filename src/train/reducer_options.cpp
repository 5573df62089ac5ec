// The options of a gradient reducer and what the ranks compare at setup: the host bucket size
// each path gives, the checks of the options against the gradients, and the setup signature with
// the entries that explain a mismatch.
#include "lockstep/train/gradient_reducer.hpp"

#include "lockstep/core/errors.hpp"

namespace lockstep {

using detail::concat;
using detail::GradLeaf;

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
  if (o.deterministic) {
    if (o.shard_optimizer_state)
      return "deterministic mode does not take shard_optimizer_state (each rank would reduce its shard "
             "in its own order); turn one of them off";
    if (o.wire_dtype)
      return concat("deterministic mode does not take wire_dtype ", name(*o.wire_dtype),
                    " (the exact sum needs the gradients' f32 bits); turn one of them off");
    for (std::size_t j = 0; j < leaves.size(); ++j) {
      if (leaves[j].dtype != DType::f32)
        return concat("deterministic mode sums f32 gradients exactly; '", path(j), "' is ", name(leaves[j].dtype));
    }
  }
  if (o.rescue_buddy && !o.shard_optimizer_state)
    return "rescue_buddy keeps a copy of another rank's shard of the optimizer state: it needs "
           "shard_optimizer_state (a replicated state is whole on every rank already)";
  if (o.shard_optimizer_state) {
    for (std::size_t j = 0; j < leaves.size(); ++j) {
      if (leaves[j].dtype != DType::f32 && leaves[j].dtype != DType::f64)
        return concat("shard_optimizer_state needs f32 or f64 trainable tensors; '", path(j), "' is ",
                      name(leaves[j].dtype));
      if (leaves[j].dtype != leaves[0].dtype)
        return concat("shard_optimizer_state needs every trainable tensor of one dtype; '", path(0), "' is ",
                      name(leaves[0].dtype), " and '", path(j), "' is ", name(leaves[j].dtype));
      if (o.rescue_buddy && !leaves[j].device.is_cpu())
        return concat("rescue_buddy copies host shards; '", path(j), "' is on ", to_string(leaves[j].device));
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
                         " shard_optimizer_state=", o.shard_optimizer_state, " rescue_buddy=", o.rescue_buddy,
                         " wire_dtype=", o.wire_dtype ? name(*o.wire_dtype) : "none",
                         " deterministic=", o.deterministic, ";");
  // Names carry their length, so that no two lists of names make the same text.
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const std::string& n = i < names.size() ? names[i] : std::string();
    s += concat(n.size(), ":", n, "=", describe_leaf(leaves[i]), ":", leaves[i].numel, ";");
  }
  return s;
}

}  // namespace detail

}  // namespace lockstep
