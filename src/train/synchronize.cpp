// synchronize: the structure check (one allgather of a hash; a detailed, hang-free explanation
// only on mismatch) and the broadcast of the leaves' bytes in few large messages.
#include "lockstep/train/synchronize.hpp"

#include <algorithm>
#include <cstring>
#include <span>

#include "lockstep/core/device_runtime.hpp"
#include "lockstep/core/errors.hpp"

namespace lockstep::detail {

namespace {
// Host tensor runs at least this large are broadcast in place rather than packed: below it the
// copy is cheaper than another collective.
constexpr std::size_t kInPlaceMinBytes = 64 * 1024;
// Each rank's explanation of its mismatch travels in a fixed-size slot of one allgather.
constexpr std::size_t kMessageSlot = 512;

std::string shown(const std::string& path) { return path.empty() ? "<root>" : path; }

// Each field as its length, a colon, then its bytes: a name may hold any byte (a NUL too), and no
// field can run into the next.
std::string serialize(const std::vector<StructureEntry>& entries) {
  std::string out;
  for (const auto& e : entries) {
    for (const std::string* f : {&e.path, &e.desc}) {
      out += std::to_string(f->size());
      out += ':';
      out += *f;
    }
  }
  return out;
}

// The inverse of serialize; a blob it did not write (it never is) ends the list where it stops
// making sense, never reads outside it.
std::vector<StructureEntry> deserialize(const std::string& blob) {
  std::vector<StructureEntry> out;
  std::size_t pos = 0;
  auto field = [&](std::string& f) {
    const std::size_t colon = blob.find(':', pos);
    if (colon == std::string::npos || colon == pos || colon - pos > 19) return false;
    std::size_t len = 0;
    for (std::size_t i = pos; i < colon; ++i) {
      if (blob[i] < '0' || blob[i] > '9') return false;
      len = len * 10 + static_cast<std::size_t>(blob[i] - '0');
    }
    if (len > blob.size() - colon - 1) return false;
    f = blob.substr(colon + 1, len);
    pos = colon + 1 + len;
    return true;
  };
  while (pos < blob.size()) {
    StructureEntry e;
    if (!field(e.path) || !field(e.desc)) break;
    out.push_back(std::move(e));
  }
  return out;
}

// How this rank's entries differ from root's, or "" if they do not.
std::string explain(const std::vector<StructureEntry>& mine, const std::vector<StructureEntry>& root,
                    int root_rank) {
  const std::size_t n = std::min(mine.size(), root.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (mine[i].path == root[i].path && mine[i].desc == root[i].desc) continue;
    if (mine[i].path == root[i].path)
      return concat("'", shown(mine[i].path), "' is ", mine[i].desc, " where rank ", root_rank,
                    " has ", root[i].desc);
    return concat("entry #", i, " is '", shown(mine[i].path), "' (", mine[i].desc, ") where rank ",
                  root_rank, " has '", shown(root[i].path), "' (", root[i].desc, ")");
  }
  if (mine.size() < root.size())
    return concat("ends after ", mine.size(), " entries where rank ", root_rank, " continues with '",
                  shown(root[n].path), "' (", root[n].desc, ")");
  if (mine.size() > root.size())
    return concat("has '", shown(mine[n].path), "' (", mine[n].desc, ") after rank ", root_rank,
                  "'s last entry");
  return "";
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t n) {
  if (n == 0) return;
  if (dst_dev.is_cpu() && src_dev.is_cpu()) {
    std::memcpy(dst, src, n);
  } else {
    device_runtime("synchronize").copy(dst, dst_dev, src, src_dev, n);
  }
}

TensorView bytes_view(void* data, std::size_t n, Device dev) {
  return TensorView{data, static_cast<std::int64_t>(n), DType::u8, dev};
}

struct Run {
  std::size_t first = 0, last = 0;  // leaf indices [first, last)
  std::size_t bytes = 0;
  bool in_place = false;
};

// Groups the tensor leaves into runs of back-to-back memory on one device.
std::vector<Run> runs_of(const std::vector<SyncLeaf>& leaves, bool use_runs) {
  std::vector<Run> runs;
  const std::byte* end = nullptr;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const auto& l = leaves[i];
    if (!l.is_tensor || l.bytes == 0) continue;
    const auto* begin = static_cast<const std::byte*>(l.data);
    const bool extend = use_runs && !runs.empty() && begin == end &&
                        leaves[runs.back().first].device == l.device;
    if (extend) {
      runs.back().last = i + 1;
      runs.back().bytes += l.bytes;
    } else {
      runs.push_back(Run{i, i + 1, l.bytes, false});
    }
    end = begin + l.bytes;
  }
  for (auto& r : runs) {
    const bool device = !leaves[r.first].device.is_cpu();
    r.in_place = device || (use_runs && r.bytes >= kInPlaceMinBytes);
  }
  return runs;
}
}  // namespace

void StructureWriter::add(const std::string& path, const std::string& desc) {
  sig_ += desc;
  sig_ += '|';
  if (with_entries_) entries_.push_back({path, desc});
}

void StructureWriter::leaf(const std::string& path, const Tensor& t) {
  add(path, concat("tensor ", name(t.dtype()), " ", to_string(t.shape()), " ", to_string(t.device())));
}

void StructureWriter::node(const std::string& path, const char* kind, std::size_t n) {
  if (std::strcmp(kind, "optional") == 0)
    add(path, n != 0 ? "optional (set)" : "optional (empty)");
  else
    add(path, concat(kind, " of ", n));
}

void StructureWriter::key(const std::string& path, const std::string& k) {
  // The key is part of the description (hence of the signature), not only of the path.
  add(path.empty() ? k : concat(path, ".", k), concat("key \"", k, "\""));
}

std::string StructureWriter::scalar_desc(std::size_t bytes, bool floating, bool is_signed) {
  if (floating) return concat("scalar float", bytes * 8);
  return concat("scalar ", is_signed ? "int" : "uint", bytes * 8);
}

void check_root(const Backend& b, int root, const char* what) {
  LOCKSTEP_CHECK_ARG(root >= 0 && root < b.size(), what, ": root ", root,
                     " is not a rank of this backend (size ", b.size(), ")");
}

bool check_same_structure(Backend& b, const std::string& signature, std::uint64_t layout, int root,
                          const char* what,
                          const std::function<std::vector<StructureEntry>()>& entries) {
  const int n = b.size();
  std::uint64_t mine[2] = {hash_bytes(signature.data(), signature.size()), layout};
  std::vector<std::uint64_t> all(2 * static_cast<std::size_t>(n));
  b.allgather(TensorView{mine, 2, DType::i64, Device::cpu()},
              TensorView{all.data(), 2 * n, DType::i64, Device::cpu()});
  bool same = true, same_layout = true;
  for (int r = 0; r < n; ++r) {
    same = same && all[2 * r] == all[2 * root];
    same_layout = same_layout && all[2 * r + 1] == all[2 * root + 1];
  }
  if (same) return same_layout;

  // Mismatch: every rank takes this path (all saw the same hashes). Root's description is
  // broadcast (length first), each rank explains its own difference, and the explanations are
  // allgathered so that every rank throws the same message.
  const auto my_entries = entries();
  std::string blob = b.rank() == root ? serialize(my_entries) : std::string();
  std::int64_t len = static_cast<std::int64_t>(blob.size());
  b.broadcast(TensorView{&len, 1, DType::i64, Device::cpu()}, root);
  blob.resize(static_cast<std::size_t>(len));
  b.broadcast(bytes_view(blob.data(), blob.size(), Device::cpu()), root);
  std::string mine_text;
  if (all[2 * b.rank()] != all[2 * root]) {
    mine_text = explain(my_entries, deserialize(blob), root);
    if (mine_text.empty()) mine_text = "differs (hash only)";
  }
  std::vector<char> slot(kMessageSlot, '\0');
  std::memcpy(slot.data(), mine_text.data(), std::min(mine_text.size(), kMessageSlot - 1));
  std::vector<char> texts(kMessageSlot * static_cast<std::size_t>(n));
  b.allgather(bytes_view(slot.data(), slot.size(), Device::cpu()),
              bytes_view(texts.data(), texts.size(), Device::cpu()));
  std::string msg = concat(what, ": the ranks hold different structures:");
  int shown_ranks = 0;
  for (int r = 0; r < n; ++r) {
    const char* t = texts.data() + kMessageSlot * static_cast<std::size_t>(r);
    if (t[0] == '\0') continue;
    if (shown_ranks++ == 4) {
      msg += " (more ranks differ)";
      break;
    }
    msg += concat(" rank ", r, ": ", t, ";");
  }
  if (!msg.empty() && msg.back() == ';') msg.pop_back();
  throw MismatchError(msg + rank_suffix());
}

std::uint64_t layout_of(const std::vector<SyncLeaf>& leaves) {
  std::uint64_t h = hash_bytes("layout", 6);
  for (const auto& r : runs_of(leaves, true)) {
    std::uint64_t v[3] = {r.first, r.last, r.in_place ? 1u : 0u};
    h = hash_bytes(v, sizeof v, h);
  }
  return h;
}

void broadcast_leaves(Backend& b, const std::vector<SyncLeaf>& leaves, int root, bool use_runs) {
  const auto runs = runs_of(leaves, use_runs);
  const bool is_root = b.rank() == root;

  // Everything not broadcast in place goes through one packed host buffer.
  std::size_t packed = 0;
  for (const auto& r : runs)
    if (!r.in_place) packed += r.bytes;
  for (const auto& l : leaves)
    if (!l.is_tensor) packed += l.bytes;

  std::vector<std::byte> pack(packed);
  auto for_each_packed = [&](auto&& f) {
    std::size_t off = 0;
    for (const auto& r : runs) {
      if (r.in_place) continue;
      for (std::size_t i = r.first; i < r.last; ++i) {
        const auto& l = leaves[i];
        if (!l.is_tensor || l.bytes == 0) continue;
        f(l, off);
        off += l.bytes;
      }
    }
    for (const auto& l : leaves) {
      if (l.is_tensor) continue;
      f(l, off);
      off += l.bytes;
    }
  };
  if (is_root)
    for_each_packed([&](const SyncLeaf& l, std::size_t off) {
      copy_bytes(pack.data() + off, Device::cpu(), l.data, l.device, l.bytes);
    });

  // Host memory goes as blocking broadcasts, one after the other: nothing runs beside them, and
  // the blocking call is the faster one (MPIBackend's shared-memory path on one machine).
  // Device runs are started as nonblocking broadcasts (NCCL queues them on its stream) and
  // waited for at the end. Every rank issues the same sequence: the runs are the same on every
  // rank (the layouts were compared before).
  std::vector<Request> pending;
  if (packed > 0) b.broadcast(bytes_view(pack.data(), packed, Device::cpu()), root);
  for (const auto& r : runs) {
    if (!r.in_place) continue;
    const TensorView v = bytes_view(leaves[r.first].data, r.bytes, leaves[r.first].device);
    if (v.device.is_cpu()) b.broadcast(v, root);
    else pending.push_back(b.ibroadcast(v, root));
  }
  for (auto& p : pending) p.wait();

  if (!is_root)
    for_each_packed([&](const SyncLeaf& l, std::size_t off) {
      copy_bytes(l.data, l.device, pack.data() + off, Device::cpu(), l.bytes);
    });
}

}  // namespace lockstep::detail
