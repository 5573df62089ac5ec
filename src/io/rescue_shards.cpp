// Shard rescue files (rescue.hpp, DistributedOptions::rescue_buddy): what a survivor writes of a
// sharded state (its shard and its buddy copy, in whole-state names and shapes) and how the
// ranks of the next run assemble the whole state from every survivor's file.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

#include "lockstep/comm/consensus.hpp"
#include "lockstep/io/rescue.hpp"
#include "lockstep/train/distributed_optimizer.hpp"

namespace lockstep {

namespace {
constexpr const char* kWorld = "lockstep.shard.world";    // ranks of the run that wrote it
constexpr const char* kOwners = "lockstep.shard.owners";  // "A,B": the shards it holds
constexpr const char* kLayout = "lockstep.shard.layout";  // per trainable tensor: "param\tfield..."
constexpr const char* kRuleStep = "lockstep.shard.rule_step";  // the optimizer's steps in the copy
std::string ranges_key(int owner) { return "lockstep.shard.ranges." + std::to_string(owner); }

std::string encode_ranges(const std::vector<FlatRange>& rs) {
  std::string s;
  for (const auto& r : rs) {
    if (!s.empty()) s += ',';
    s += std::to_string(r.begin);
    s += ':';
    s += std::to_string(r.end);
  }
  return s;
}
std::vector<FlatRange> decode_ranges(const std::string& s) {
  std::vector<FlatRange> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    const auto colon = part.find(':');
    LOCKSTEP_CHECK_ARG(colon != std::string::npos, "shard rescue file: bad range '", part, "'");
    out.push_back({std::stoll(part.substr(0, colon)), std::stoll(part.substr(colon + 1))});
  }
  return out;
}
std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, sep)) out.push_back(part);
  return out;
}
Tensor* find_tensor(Checkpoint& ck, const std::string& name) {
  for (auto& [n, t] : ck.tensors)
    if (n == name) return &t;
  throw InvalidArgument(detail::concat("shard rescue file: no tensor '", name, "' (the state's layout names it)"));
}

// The whole-state tensors of a shard rescue file: the trainable ones and each field's, in flat
// order, with the flat offset of each trainable tensor.
struct ShardTensors {
  std::vector<Tensor*> params;
  std::vector<std::vector<Tensor*>> fields;
  std::vector<std::int64_t> offsets;
  std::size_t per_element = 0;
};
ShardTensors tensors_of(Checkpoint& ck, const std::vector<std::vector<std::string>>& layout) {
  ShardTensors t;
  std::int64_t at = 0;
  const std::size_t nf = layout.empty() ? 0 : layout[0].size() - 1;
  t.fields.resize(nf);
  for (const auto& row : layout) {
    LOCKSTEP_CHECK_ARG(row.size() == nf + 1, "shard rescue file: the layout's rows differ in length");
    t.params.push_back(find_tensor(ck, row[0]));
    t.offsets.push_back(at);
    at += t.params.back()->numel();
    for (std::size_t f = 0; f < nf; ++f) {
      t.fields[f].push_back(find_tensor(ck, row[f + 1]));
      LOCKSTEP_CHECK_ARG(t.fields[f].back()->numel() == t.params.back()->numel(), "shard rescue file: '", row[f + 1],
                         "' has ", t.fields[f].back()->numel(), " elements, '", row[0], "' ", t.params.back()->numel());
    }
  }
  if (!t.params.empty()) t.per_element += size_of(t.params[0]->dtype());
  for (const auto& f : t.fields)
    if (!f.empty()) t.per_element += size_of(f[0]->dtype());
  return t;
}
std::int64_t count_of(const std::vector<FlatRange>& rs) {
  std::int64_t n = 0;
  for (const auto& r : rs) n += r.end - r.begin;
  return n;
}
// Moves a shard between the whole-state tensors and its packed form (the parameters over the
// ranges, then each field over the same ranges): the buddy copy's layout.
void move_shard(const ShardTensors& t, const std::vector<FlatRange>& ranges, std::byte* blob, bool to_blob) {
  auto one = [&](const std::vector<Tensor*>& ts) {
    if (ts.empty()) return;
    const std::size_t es = size_of(ts[0]->dtype());
    for (const auto& r : ranges) {
      detail::copy_flat_range(ts, t.offsets, r.begin, r.end - r.begin, blob, to_blob);
      blob += static_cast<std::size_t>(r.end - r.begin) * es;
    }
  };
  one(t.params);
  for (const auto& f : t.fields) one(f);
}
std::vector<std::vector<std::string>> shard_layout_of(const std::map<std::string, std::string>& meta) {
  const auto it = meta.find(kLayout);
  LOCKSTEP_CHECK_ARG(it != meta.end(), "shard rescue file: no ", kLayout);
  std::vector<std::vector<std::string>> rows;
  for (const auto& line : split(it->second, '\n')) rows.push_back(split(line, '\t'));
  return rows;
}
std::int64_t int_of(const std::map<std::string, std::string>& meta, const std::string& key) {
  const auto it = meta.find(key);
  LOCKSTEP_CHECK_ARG(it != meta.end(), "shard rescue file: no ", key);
  return std::stoll(it->second);
}
}  // namespace

std::filesystem::path shard_rescue_path(const std::filesystem::path& dir, std::int64_t step, int rank) {
  LOCKSTEP_CHECK_ARG(step >= 0, "shard_rescue_path: step must be >= 0, got ", step);
  char name[64];
  std::snprintf(name, sizeof name, "shard-%09lld-r%d.safetensors", static_cast<long long>(step), rank);
  return dir / name;
}

namespace detail {

void fill_shard_rescue(Checkpoint& ck, const BuddyCopy& copy, const ShardNames& names) {
  LOCKSTEP_CHECK_ARG(names.params.size() == copy.leaf_numel.size(), "x holds ", names.params.size(),
                     " floating tensors besides the optimizer state's slots, the optimizer ", copy.leaf_numel.size(),
                     " trainable ones: pass the model and its optimizer state (other floating tensors in x "
                     "cannot be told apart from the model's)");
  LOCKSTEP_CHECK_ARG(!names.step.empty(), "the sharded optimizer state's step count was not found in x");
  std::string layout;
  for (std::size_t i = 0; i < names.params.size(); ++i) {
    if (i > 0) layout += '\n';
    layout += names.params[i];
    for (const auto& f : names.fields) layout += "\t" + f[i];
  }
  ck.metadata[kLayout] = layout;
  ck.metadata[kWorld] = std::to_string(copy.world);
  ck.metadata[kRuleStep] = std::to_string(copy.rule_step);
  ck.metadata[kOwners] = std::to_string(copy.owner[0]) + "," + std::to_string(copy.owner[1]);
  for (int k = 0; k < 2; ++k) ck.metadata[ranges_key(copy.owner[k])] = encode_ranges(copy.ranges[k]);
  // The live parameters may be mid-update (the failed step): the file gets copies, filled in
  // from the buddy copy where it holds them.
  for (const auto& n : names.params) {
    Tensor* t = find_tensor(ck, n);
    *t = t->clone();
  }
  const ShardTensors t = tensors_of(ck, shard_layout_of(ck.metadata));
  for (std::size_t i = 0; i < t.params.size(); ++i)
    LOCKSTEP_CHECK_ARG(t.params[i]->numel() == copy.leaf_numel[i], "'", names.params[i], "' has ", t.params[i]->numel(),
                       " elements, the optimizer's trainable tensor #", i, " ", copy.leaf_numel[i]);
  LOCKSTEP_CHECK_ARG(t.per_element == copy.param_bytes + [&] {
    std::size_t s = 0;
    for (const auto b : copy.field_bytes) s += b;
    return s;
  }(), "the state's tensors do not match the buddy copy's element sizes");
  for (int k = 0; k < 2; ++k) {
    if (k == 1 && copy.owner[1] == copy.owner[0]) break;
    move_shard(t, copy.ranges[k], static_cast<std::byte*>(const_cast<void*>(copy.blob[k].raw_data())), false);
  }
  Tensor* step = find_tensor(ck, names.step);
  if (step->dtype() == DType::i64) *step->data<std::int64_t>() = copy.rule_step;
  else if (step->dtype() == DType::i32) *step->data<std::int32_t>() = static_cast<std::int32_t>(copy.rule_step);
  else throw InvalidArgument(concat("the optimizer's step count '", names.step, "' is stored as ", name(step->dtype())));
}

void assemble_shard_rescue(Backend& backend, const std::filesystem::path& dir) {
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::min() / 4;
  // This rank's shard files of the newest step among those that verify (ranks of one host may
  // share the directory: each reads every file of it).
  // What each file says of itself, read and checked before any collective: a file that lacks
  // it or says nonsense is skipped here like one that does not verify, on its own rank only,
  // and every rank then makes the same calls below.
  struct ShardFile {
    std::int64_t world = 0, rule_step = 0;
    int owner[2] = {0, 0};
  };
  std::vector<Checkpoint> cks;
  std::vector<ShardFile> metas;
  std::int64_t step = kNone;
  {
    std::vector<std::pair<std::int64_t, std::filesystem::path>> files;
    std::error_code ec;
    if (!dir.empty())
      for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
        const std::int64_t s = step_of_state_file(it->path().filename().string(), "shard");
        if (s >= 0) files.emplace_back(s, it->path());
      }
    std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    for (const auto& [s, p] : files) {
      if (step != kNone && s != step) break;
      try {
        Checkpoint ck = load_checkpoint(p);
        const std::int64_t st = int_of(ck.metadata, std::string(kStepKey));
        ShardFile m;
        m.world = int_of(ck.metadata, kWorld);
        m.rule_step = int_of(ck.metadata, kRuleStep);
        LOCKSTEP_CHECK_ARG(m.world > 0 && m.world <= (1 << 24), "shard rescue file: ", kWorld, " is ", m.world);
        const auto owners = split(ck.metadata.count(kOwners) ? ck.metadata.at(kOwners) : std::string(), ',');
        LOCKSTEP_CHECK_ARG(owners.size() == 2, "shard rescue file: ", kOwners, " does not name two shards");
        for (int k = 0; k < 2; ++k) {
          const std::int64_t o = std::stoll(owners[static_cast<std::size_t>(k)]);
          LOCKSTEP_CHECK_ARG(o >= 0 && o < m.world, "shard rescue file: shard ", o, " of a run of ", m.world, " ranks");
          m.owner[k] = static_cast<int>(o);
        }
        if (step != kNone && st != step) continue;
        step = st;
        cks.push_back(std::move(ck));
        metas.push_back(m);
      } catch (...) {
        std::fprintf(stderr, "lockstep: skipping %s, which does not verify: %s\n", p.c_str(),
                     current_error_message().c_str());
      }
    }
  }
  // The newest step anywhere, and the size of the run that wrote it.
  std::int64_t a[1] = {step};
  backend.allreduce(TensorView{a, 1, DType::i64, Device::cpu()}, ReduceOp::max);
  if (a[0] == kNone) return;
  const std::int64_t newest = a[0];
  if (step != newest) {
    cks.clear();
    metas.clear();
  }
  // The run's size and the optimizer step the copies hold, the same in every file (max and
  // max of the negation): files of one label can hold two steps when a buddy exchange ended on
  // some ranks only, and such shards are never put together.
  std::int64_t w[4] = {0, kNone, kNone, kNone};
  for (const auto& m : metas) {
    w[0] = std::max(w[0], m.world);
    w[1] = std::max(w[1], -m.world);
    w[2] = std::max(w[2], m.rule_step);
    w[3] = std::max(w[3], -m.rule_step);
  }
  backend.allreduce(TensorView{w, 4, DType::i64, Device::cpu()}, ReduceOp::max);
  if (w[0] > 0 && w[0] == -w[1] && w[2] != -w[3]) {
    if (backend.rank() == 0)
      std::fprintf(stderr, "lockstep: the shard rescue files of step %lld hold copies of two optimizer steps (%lld "
                   "and %lld: a buddy exchange ended on some ranks only); not assembling them\n",
                   static_cast<long long>(newest), static_cast<long long>(-w[3]), static_cast<long long>(w[2]));
    return;
  }
  if (w[0] != -w[1] || w[0] <= 0) {
    if (backend.rank() == 0)
      std::fprintf(stderr, "lockstep: the shard rescue files of step %lld come from runs of different sizes (%lld "
                   "and %lld ranks); not assembling them\n", static_cast<long long>(newest),
                   static_cast<long long>(-w[1]), static_cast<long long>(w[0]));
    return;
  }
  const int world = static_cast<int>(w[0]);
  // For each shard, the lowest rank holding it (as -rank, so that max finds it), and which of
  // this rank's files holds it.
  std::vector<std::int64_t> holder(static_cast<std::size_t>(world), kNone);
  std::map<int, std::size_t> file_of;
  for (std::size_t k = 0; k < cks.size(); ++k)
    for (const int owner : metas[k].owner) {
      if (owner < 0 || owner >= world || file_of.count(owner) != 0) continue;
      file_of[owner] = k;
      holder[static_cast<std::size_t>(owner)] = -static_cast<std::int64_t>(backend.rank());
    }
  backend.allreduce(TensorView{holder.data(), static_cast<std::int64_t>(world), DType::i64, Device::cpu()},
                    ReduceOp::max);
  std::string missing;
  for (int o = 0; o < world; ++o)
    if (holder[static_cast<std::size_t>(o)] == kNone) {
      if (!missing.empty()) missing += ", ";
      missing += std::to_string(o);
    }
  if (!missing.empty()) {
    if (backend.rank() == 0)
      std::fprintf(stderr,
                   "lockstep: the shard rescue files of step %lld miss the shards of rank(s) %s of %d (their host and "
                   "their buddy's were both lost, or their files are elsewhere): resuming from the newest full "
                   "state instead\n",
                   static_cast<long long>(newest), missing.c_str(), world);
    return;
  }
  // The base: the holder of shard 0, into whose file of it every other shard goes.
  const int base = static_cast<int>(-holder[0]);
  const bool i_base = backend.rank() == base;
  std::vector<std::optional<ShardTensors>> ts(cks.size());
  std::string err;
  for (std::size_t k = 0; k < cks.size(); ++k) {
    try {
      ts[k] = tensors_of(cks[k], shard_layout_of(cks[k].metadata));
    } catch (...) {
      if (err.empty()) err = current_error_message();
    }
  }
  auto pack = [&](int o) {
    const std::size_t k = file_of.at(o);
    if (!ts[k]) throw InvalidArgument(err);
    const auto rs = decode_ranges(cks[k].metadata.at(ranges_key(o)));
    std::string blob(static_cast<std::size_t>(count_of(rs)) * ts[k]->per_element, '\0');
    move_shard(*ts[k], rs, reinterpret_cast<std::byte*>(blob.data()), true);
    return "D" + encode_ranges(rs) + "\n" + blob;
  };
  const std::size_t bk = i_base ? file_of.at(0) : 0;
  auto unpack = [&](int o, int h, std::string& msg) {
    if (!ts[bk]) throw InvalidArgument(err);
    const std::size_t nl = msg.find('\n');
    const auto rs = decode_ranges(msg.substr(1, nl - 1));
    LOCKSTEP_CHECK_ARG(msg.size() - nl - 1 == static_cast<std::size_t>(count_of(rs)) * ts[bk]->per_element,
                       "the shard of rank ", o, " from rank ", h, " has ", msg.size() - nl - 1, " bytes");
    move_shard(*ts[bk], rs, reinterpret_cast<std::byte*>(msg.data() + nl + 1), false);
  };
  for (int o = 0; o < world; ++o) {
    const int h = static_cast<int>(-holder[static_cast<std::size_t>(o)]);
    if (h == base) {
      // The base holds it: in its base file already, or in another of its files.
      if (!i_base || file_of.at(o) == bk) continue;
      try {
        std::string msg = pack(o);
        unpack(o, h, msg);
      } catch (...) {
        if (err.empty()) err = current_error_message();
      }
      continue;
    }
    std::string msg;
    if (backend.rank() == h) {
      try {
        msg = pack(o);
      } catch (...) {
        msg = "E" + current_error_message();
      }
    }
    msg = broadcast_string(backend, msg, h);
    if (msg.empty() || msg[0] != 'D')
      throw CheckpointError(concat("resume: rank ", h, " could not give the shard of rank ", o, " from its shard "
                                   "rescue file: ", msg.empty() ? std::string("(nothing)") : msg.substr(1)));
    if (!i_base) continue;
    try {
      unpack(o, h, msg);
    } catch (...) {
      if (err.empty()) err = current_error_message();
    }
  }
  // The base writes the whole state as a rescue state of its own; the ranks agree it did.
  if (i_base) {
    try {
      if (!err.empty()) throw InvalidArgument(err);
      Checkpoint& ck = cks[bk];
      std::string holders;
      for (int o = 0; o < world; ++o) {
        if (o > 0) holders += ',';
        holders += std::to_string(-holder[static_cast<std::size_t>(o)]);
      }
      for (const char* k : {kWorld, kOwners, kLayout, kRuleStep}) ck.metadata.erase(k);
      for (int o = 0; o < world; ++o) ck.metadata.erase(ranges_key(o));
      ck.metadata[std::string(kRescueKey)] =
          concat(rescue_origin(backend.rank()), ", assembled from the shard rescue files of ", world,
                 " shards (held by ranks ", holders, ")");
      const auto path = rescue_path(dir, newest, backend.rank());
      save_checkpoint(path, ck);
      std::fprintf(stderr, "lockstep: the %d shards of step %lld assembled from the shard rescue files into %s\n",
                   world, static_cast<long long>(newest), path.c_str());
      std::fflush(stderr);
    } catch (...) {
      err = current_error_message();
      if (err.empty()) err = "unknown error";
    }
  }
  err = broadcast_status(backend, i_base ? err : std::string(), base);
  if (!err.empty()) throw CheckpointError(concat("resume: assembling the shard rescue files of step ", newest,
                                                 " on rank ", base, " failed: ", err));
}

}  // namespace detail

}  // namespace lockstep
