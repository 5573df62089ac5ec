// A LibTorch module's parameters and buffers by name, as Lockstep tensors, and their synchronize.
#include "internal.hpp"

#include <torch/torch.h>

#include <unordered_set>

#include "lockstep/core/errors.hpp"
#include "lockstep/train/synchronize.hpp"

namespace lockstep::torch {

using detail::concat;
using namespace internal;

namespace internal {

// Every parameter and buffer of m, by name (a tied one once), as borrowed Lockstep tensors. Throws
// InvalidArgument naming the first one that has no flat view; call it inside an agreement.
void add_module(TensorMap& out, const ::torch::nn::Module& m) {
  // A tensor registered under several names (a tied weight: the embedding and the output head)
  // is one tensor: listed once, under the first name the module gives it, so that it is
  // broadcast, saved and loaded once.
  std::unordered_set<const void*> seen;
  auto add = [&](const std::string& name, const at::Tensor& t, const char* kind) {
    if (!t.defined()) return;  // an unset optional parameter or buffer
    if (!seen.insert(t.unsafeGetTensorImpl()).second) return;
    try {
      out.emplace(name, borrow(t));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(concat("module ", kind, " '", name, "': ", e.what()));
    }
  };
  for (const auto& p : m.named_parameters(/*recurse=*/true)) add(p.key(), p.value(), "parameter");
  for (const auto& b : m.named_buffers(/*recurse=*/true)) add(b.key(), b.value(), "buffer");
}

}  // namespace internal

void synchronize(Backend& backend, ::torch::nn::Module& module, int root, std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::synchronize");
  TensorMap tensors;
  agreed(backend, "lockstep::torch::synchronize", root, [&] { add_module(tensors, module); },
         "no rank's module was changed");
  // The core's synchronize checks names, dtypes, shapes and devices across ranks first
  // (MismatchError naming the first difference), then broadcasts in place.
  ::torch::NoGradGuard no_grad;
  lockstep::synchronize(backend, tensors, root);
}

}  // namespace lockstep::torch
