// lockstep::torch checkpoints: a module and its optimizer's state (replicated, or sharded by a
// DistributedOptimizer) in one Lockstep checkpoint file, which does not depend on the number of
// ranks; and their load.
#include "internal.hpp"

#include <torch/torch.h>

#include <optional>

#include "lockstep/core/errors.hpp"
#include "lockstep/io/checkpoint.hpp"
#include "lockstep/train/synchronize.hpp"

namespace lockstep::torch {

using detail::concat;
using namespace internal;

namespace {

constexpr const char* kOptPrefix = "optimizer.";

void check_no_optimizer_names(const TensorMap& module_tensors) {
  for (const auto& [name, t] : module_tensors)
    LOCKSTEP_CHECK_ARG(name.rfind(kOptPrefix, 0) != 0, "lockstep::torch checkpoint: the module's tensor '",
                       name, "' starts with 'optimizer.', which names the optimizer's state in the file");
}

void save_impl(Backend& backend, const std::filesystem::path& path, ::torch::nn::Module& module,
               ::torch::optim::Optimizer* optimizer, const std::map<std::string, std::string>& user_meta) {
  TensorMap all;
  std::optional<PreparedState> prepared;
  agreed(backend, "lockstep::torch::save_checkpoint", 0, [&] {
    add_module(all, module);
    check_no_optimizer_names(all);
  }, "nothing was written");
  agreed(backend, "lockstep::torch::save_checkpoint", 0, [&] {
    for (const auto& [k, v] : user_meta)
      LOCKSTEP_CHECK_ARG(k.rfind("lockstep.", 0) != 0, "lockstep::torch::save_checkpoint: metadata key '", k,
                         "' starts with 'lockstep.', which Lockstep reserves");
  }, "nothing was written");
  std::map<std::string, std::string> meta = user_meta;
  meta["lockstep.torch.module"] = "1";
  if (optimizer != nullptr) {
    check_same_optimizer(backend, *optimizer, &module, 0, "lockstep::torch::save_checkpoint");
    auto ps = optimizer_params(*optimizer, &module);
    std::vector<std::uint8_t> archive;
    if (backend.rank() == 0 && kind_of(*optimizer) == Kind::other) archive = archive_bytes(*optimizer);
    // Root writes what a replicated state holds: each parameter's state as the rank that has it
    // holds it. Sharded (now, or by a DistributedOptimizer since destroyed: the state stays
    // split), that is its owner; replicated, root itself. Every rank learns every rank's layout
    // (one string broadcast per rank); each parameter's state comes from root if root has it,
    // else from the lowest rank that has it.
    const bool known = kind_of(*optimizer) != Kind::other;
    std::string layout = state_layout(*optimizer, ps);
    std::vector<std::vector<std::string>> lines;  // every rank's layout, line by line
    std::vector<int> source(ps.size(), 0);
    bool gather = false;
    if (known) {
      for (int r = 0; r < backend.size(); ++r)
        lines.push_back(split_lines(detail::broadcast_string(backend, layout, r)));
      auto has = [&](int r, std::size_t i) {
        const auto& l = lines[static_cast<std::size_t>(r)];
        return i < l.size() && !l[i].empty() && l[i] != "-";
      };
      std::string merged;
      for (std::size_t i = 0; i < ps.size(); ++i) {
        for (int r = 0; r < backend.size(); ++r)
          if (has(r, i)) {
            source[i] = r;
            break;
          }
        gather = gather || source[i] != 0;
        const auto& l = lines[static_cast<std::size_t>(source[i])];
        merged += (i < l.size() ? l[i] : std::string("-")) + "\n";
      }
      if (backend.rank() == 0) layout = std::move(merged);
    }
    agreed(backend, "lockstep::torch::save_checkpoint", 0, [&] {
      prepared.emplace(*optimizer, ps, layout, archive.size());
    }, "nothing was written");
    if (gather) {  // the same on every rank: computed from the same layouts
      // Each other rank sends root the state root lacks, packed (one broadcast of its size and
      // one of its bytes per rank): root's prepared tensors are new ones for them.
      std::string transfer_error;  // root's, agreed after the transfers
      for (int r = 1; r < backend.size(); ++r) {
        std::vector<Tensor*> mine;
        const auto& l = lines[static_cast<std::size_t>(r)];
        if (backend.rank() == r || backend.rank() == 0) {
          for (std::size_t i = 0; i < ps.size(); ++i) {
            if (source[i] != r) continue;
            const std::string prefix = concat("optimizer.state.", ps[i].name, ".");
            auto& tm = prepared->tensors();
            if (has_step(kind_of(*optimizer))) mine.push_back(&tm.at(prefix + "step"));
            std::istringstream words(l[i]);
            std::string w;
            while (words >> w)
              if (w != "+") mine.push_back(&tm.at(prefix + w));
          }
        }
        std::int64_t bytes = 0;
        for (Tensor* t : mine) bytes += static_cast<std::int64_t>(t->nbytes());
        backend.broadcast(TensorView{&bytes, 1, DType::i64, Device::cpu()}, r);
        if (bytes == 0) continue;
        std::vector<std::uint8_t> blob(static_cast<std::size_t>(bytes));
        if (backend.rank() == r) {
          std::size_t off = 0;
          for (Tensor* t : mine) {
            if (t->nbytes() > 0) std::memcpy(blob.data() + off, t->raw_data(), t->nbytes());
            off += t->nbytes();
          }
        }
        backend.broadcast(TensorView{blob.data(), bytes, DType::u8, Device::cpu()}, r);
        if (backend.rank() == 0) {
          std::int64_t expect = 0;
          for (Tensor* t : mine) expect += static_cast<std::int64_t>(t->nbytes());
          if (expect != bytes) {  // not expected: the state's tensors are shaped like their parameters
            if (transfer_error.empty())
              transfer_error = concat("lockstep::torch::save_checkpoint: rank ", r, " sent ", bytes,
                                      " bytes of optimizer state where root expected ", expect,
                                      " (a state tensor not shaped like its parameter?)");
            continue;
          }
          std::size_t off = 0;
          for (Tensor* t : mine) {
            if (t->nbytes() > 0) std::memcpy(t->raw_data(), blob.data() + off, t->nbytes());
            off += t->nbytes();
          }
        }
      }
      agreed(backend, "lockstep::torch::save_checkpoint", 0, [&] {
        if (!transfer_error.empty()) throw Error(transfer_error);
      }, "nothing was written");
    }
    if (!archive.empty())
      std::copy(archive.begin(), archive.end(),
                prepared->tensors().at("optimizer.torch_archive").data<std::uint8_t>());
    for (auto& [name, t] : prepared->tensors()) all.emplace(name, t.reshape_view(t.shape()));
    meta["lockstep.torch.optimizer"] = kind_name(kind_of(*optimizer));
  }
  lockstep::save_checkpoint(backend, path, all, meta, 0);
}

std::map<std::string, std::string> load_impl(Backend& backend, const std::filesystem::path& path,
                                             ::torch::nn::Module& module, ::torch::optim::Optimizer* optimizer) {
  TensorMap all;
  agreed(backend, "lockstep::torch::load_checkpoint", 0, [&] {
    add_module(all, module);
    check_no_optimizer_names(all);
  }, "nothing was restored on any rank");
  std::optional<PreparedState> prepared;
  if (optimizer != nullptr) {
    check_same_optimizer(backend, *optimizer, &module, 0, "lockstep::torch::load_checkpoint");
    auto ps = optimizer_params(*optimizer, &module);
    // Which state the file holds decides what is prepared: root reads the file's names (and
    // sends its error instead if it cannot).
    std::string layout;
    if (backend.rank() == 0) {
      try {
        const Checkpoint ck = lockstep::load_checkpoint(path);
        std::unordered_map<std::string, std::int64_t> numel;
        for (const auto& [name, t] : ck.tensors) numel.emplace(name, t.numel());
        const Kind k = kind_of(*optimizer);
        std::string lines;
        for (const auto& p : ps) {
          const std::string prefix = concat("optimizer.state.", p.name, ".");
          std::string line;
          for (const char* f : tensor_fields(k))
            if (numel.count(prefix + f)) (line += f) += ' ';
          const bool any = !line.empty() || (has_step(k) && numel.count(prefix + "step"));
          lines += any ? line + "+\n" : "-\n";
        }
        auto a = numel.find("optimizer.torch_archive");
        layout = concat("C", a == numel.end() ? 0 : a->second, "\n", lines);
      } catch (...) {
        layout = "E" + detail::current_error_message();
      }
    }
    layout = detail::broadcast_string(backend, layout, 0);
    if (layout.empty() || layout[0] != 'C') detail::throw_root_error(backend, layout.substr(1), 0);
    const auto nl = layout.find('\n');
    const std::size_t archive_size = std::stoull(layout.substr(1, nl - 1));
    agreed(backend, "lockstep::torch::load_checkpoint", 0, [&] {
      prepared.emplace(*optimizer, ps, layout.substr(nl + 1), archive_size);
    }, "nothing was restored on any rank");
    for (auto& [name, t] : prepared->tensors()) all.emplace(name, t.reshape_view(t.shape()));
  }
  std::map<std::string, std::string> meta;
  {
    ::torch::NoGradGuard no_grad;
    // All or nothing on every rank: checked against the file before anything is written.
    meta = lockstep::load_checkpoint(backend, path, all, 0);
  }
  if (prepared) {
    prepared->install();
    // A sharded optimizer keeps the state of its own parameters only.
    if (const auto info = shard_info(*optimizer))
      drop_unowned_state(*optimizer, optimizer_params(*optimizer, &module), *info, backend.rank());
  }
  for (auto it = meta.begin(); it != meta.end();) it = it->first.rfind("lockstep.", 0) == 0 ? meta.erase(it) : std::next(it);
  return meta;
}

}  // namespace

void save_checkpoint(Backend& backend, const std::filesystem::path& path, ::torch::nn::Module& module,
                     const std::map<std::string, std::string>& metadata, std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::save_checkpoint");
  save_impl(backend, path, module, nullptr, metadata);
}
void save_checkpoint(Backend& backend, const std::filesystem::path& path, ::torch::nn::Module& module,
                     ::torch::optim::Optimizer& optimizer, const std::map<std::string, std::string>& metadata,
                     std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::save_checkpoint");
  save_impl(backend, path, module, &optimizer, metadata);
}
std::map<std::string, std::string> load_checkpoint(Backend& backend, const std::filesystem::path& path,
                                                   ::torch::nn::Module& module, std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::load_checkpoint");
  return load_impl(backend, path, module, nullptr);
}
std::map<std::string, std::string> load_checkpoint(Backend& backend, const std::filesystem::path& path,
                                                   ::torch::nn::Module& module, ::torch::optim::Optimizer& optimizer,
                                                   std::source_location loc) {
  detail::CallSiteScope site(loc, "lockstep::torch::load_checkpoint");
  return load_impl(backend, path, module, &optimizer);
}

}  // namespace lockstep::torch
