// GradientReducer in deterministic mode (DistributedOptions::deterministic): every micro-batch's
// gradients go into one exact sum over all trainable tensors back to back (exact_sum.hpp),
// reduced once per step across the ranks: two collectives a step, whatever the number of
// tensors. Device (cuda) gradients are copied to the host for it and the result copied back:
// the exact sum is integer work on the host, the same bits whichever device computed the
// gradients.
#include "lockstep/core/device_runtime.hpp"
#include "train/reducer_impl.hpp"

namespace lockstep {

void GradientReducer::Impl::setup_exact() {
  if (!options.deterministic) return;
  std::int64_t total = 0;
  exact_at.clear();
  bool any_device = false;
  for (const auto& leaf : leaves) {
    exact_at.push_back(total);
    total += leaf.numel;
    any_device = any_device || !leaf.device.is_cpu();
  }
  exact.reset(total);
  exact.set_chunk_bytes(host_bucket_bytes(options, *backend));
  exact_flat = Tensor();
  exact_out.clear();
  exact_ptrs.clear();
  if (any_device) exact_flat_result();  // the host copies of device gradients live in it
}

// The flat result on the host and the reduced gradients it gives (views of it; the reducer's
// own tensors on a device): made on first use, since a step whose gradients are bound on the
// host writes its result into them (in place) and needs neither.
void GradientReducer::Impl::exact_flat_result() {
  if (!exact_ptrs.empty()) return;
  exact_flat = Tensor::zeros({exact.numel()}, DType::f32);
  for (std::size_t j = 0; j < leaves.size(); ++j) {
    const Shape shape = leaves[j].shape.empty() ? Shape{leaves[j].numel} : leaves[j].shape;
    if (leaves[j].device.is_cpu())  // a view of the flat result
      exact_out.push_back(Tensor::borrow(exact_flat.data<float>() + exact_at[j], shape, DType::f32, Device::cpu()));
    else
      exact_out.push_back(Tensor::zeros(shape, DType::f32, leaves[j].device));
  }
  for (auto& t : exact_out) exact_ptrs.push_back(&t);
}

std::vector<detail::ExactSum::Part> GradientReducer::Impl::exact_parts() {
  std::vector<detail::ExactSum::Part> parts;
  parts.reserve(leaves.size());
  for (std::size_t j = 0; j < leaves.size(); ++j) {
    const Tensor& g = *bound[j];
    LOCKSTEP_CHECK_ARG(g.numel() == leaves[j].numel && g.dtype() == DType::f32 && g.device() == leaves[j].device,
                       "deterministic mode: gradient '", paths[j], "' is no longer f32 of ", leaves[j].numel,
                       " elements on ", to_string(leaves[j].device), " (was it moved from or reassigned?)");
    if (g.device().is_cpu()) {
      parts.push_back({g.data<float>(), exact_at[j], g.numel()});
      continue;
    }
    // On the host for the integer work (the device's pending work on it is waited for), at its
    // own place in the flat result: the exact sum reads it before it writes there.
    float* host = exact_flat.data<float>() + exact_at[j];
    device_runtime("deterministic mode with a cuda gradient")
        .copy(host, Device::cpu(), g.raw_data(), g.device(), g.nbytes());
    parts.push_back({host, exact_at[j], g.numel()});
  }
  return parts;
}

void GradientReducer::Impl::exact_add() {
  exact.add(exact_parts());
}

const std::vector<Tensor*>& GradientReducer::Impl::exact_reduce(const std::vector<detail::ExactSum::Part>& last) {
  // One exact reduction of every tensor at once, the same calls on every rank (the sizes were
  // agreed at setup); the mean divides by the total of micro-batches over the ranks. With bound
  // gradients (last given), the result goes into them where they are on the host (in place, as
  // the ordinary path leaves it; each element is read before it is written) and into the flat
  // result for device ones; with none bound (apply_accumulated), all into the flat result.
  std::vector<detail::ExactSum::Out> outs;
  outs.reserve(leaves.size());
  const bool in_place = !last.empty();
  if (!in_place || !exact_ptrs.empty()) exact_flat_result();
  exact_in_place.clear();
  for (std::size_t j = 0; j < leaves.size(); ++j) {
    if (in_place && leaves[j].device.is_cpu()) {
      outs.push_back({bound[j]->data<float>(), exact_at[j], leaves[j].numel});
      exact_in_place.push_back(bound[j]);
    } else {
      outs.push_back({exact_flat.data<float>() + exact_at[j], exact_at[j], leaves[j].numel});
      exact_in_place.push_back(exact_ptrs[j]);
    }
  }
  try {
    exact.reduce(*backend, last, outs, options.op == ReduceOp::avg);
  } catch (...) {
    exact.discard();  // a failed step starts the next one empty on every rank that survives it
    throw;
  }
  for (std::size_t j = 0; j < leaves.size(); ++j)
    if (!leaves[j].device.is_cpu())
      device_runtime("deterministic mode with a cuda gradient")
          .copy(exact_out[j].raw_data(), leaves[j].device, exact_flat.data<float>() + exact_at[j], Device::cpu(),
                exact_out[j].nbytes());
  return exact_in_place;
}

}  // namespace lockstep
