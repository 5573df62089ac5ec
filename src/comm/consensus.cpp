// Consensus helpers (consensus.hpp): a string from the root, and one verdict that every rank
// agrees on before a collective operation changes anything.
#include "lockstep/comm/consensus.hpp"

#include <exception>
#include <span>
#include <string>
#include <vector>

#include "comm/rank_list.hpp"
#include "lockstep/core/errors.hpp"

namespace lockstep::detail {

std::string broadcast_string(Backend& backend, const std::string& s, int root) {
  std::int64_t n = static_cast<std::int64_t>(s.size());
  backend.broadcast(view_of(std::span<std::int64_t>(&n, 1)), root);
  std::string out = backend.rank() == root ? s : std::string(static_cast<std::size_t>(n), '\0');
  if (n > 0)
    backend.broadcast(TensorView{out.data(), n, DType::u8, Device::cpu()}, root);
  return out;
}

std::string broadcast_status(Backend& backend, std::string error, int root) {
  return broadcast_string(backend, error, root);
}

std::string current_error_message() {
  try {
    throw;
  } catch (const std::exception& e) {
    const std::string w = e.what();
    return w.empty() ? std::string("unknown error") : w;
  } catch (...) {
    return "unknown non-standard exception";
  }
}

Verdict current_verdict() {
  Verdict v;
  v.message = current_error_message();
  v.kind = text_kind(error_record(std::current_exception()).kind);
  return v;
}

bool agree(Backend& backend, const char* what, int root, const Verdict& mine, std::uint64_t signature,
           const char* consequence) {
  // One allgather of (root, verdict kind, message length, signature) per rank: every rank then
  // sees the same table and takes the same branch.
  const int n = backend.size();
  std::int64_t me[4] = {root, static_cast<std::int64_t>(mine.kind),
                        mine.kind == Verdict::Kind::none ? 0 : static_cast<std::int64_t>(mine.message.size()),
                        static_cast<std::int64_t>(signature)};
  std::vector<std::int64_t> all(4 * static_cast<std::size_t>(n));
  backend.allgather(TensorView{me, 4, DType::i64, Device::cpu()},
                    TensorView{all.data(), 4 * static_cast<std::int64_t>(n), DType::i64, Device::cpu()});
  auto at = [&](int r, int k) { return all[4 * static_cast<std::size_t>(r) + static_cast<std::size_t>(k)]; };
  bool same_root = true;
  for (int r = 1; r < n; ++r) same_root = same_root && at(r, 0) == at(0, 0);
  if (!same_root) {
    std::vector<std::int64_t> roots;
    for (int r = 0; r < n; ++r) roots.push_back(at(r, 0));
    const std::string msg = std::string(what) + ": the ranks passed different roots (" + rank_values(roots) +
                            "); every rank must pass the same root; " + std::string(consequence);
    throw InvalidArgument(msg);
  }
  if (at(0, 0) < 0 || at(0, 0) >= n)
    throw InvalidArgument(std::string(what) + ": root " + std::to_string(at(0, 0)) +
                          " is not a rank of this backend (size " + std::to_string(n) + "); " + consequence);
  std::vector<int> failed;
  for (int r = 0; r < n; ++r)
    if (at(r, 1) != 0) failed.push_back(r);
  if (failed.empty()) {
    bool same = true;
    for (int r = 0; r < n; ++r) same = same && at(r, 3) == at(root, 3);
    return same;
  }
  // The lowest failing rank's error, broadcast from it, is every rank's error.
  const int k = failed.front();
  const auto len = at(k, 2);
  std::string text = backend.rank() == k ? mine.message : std::string(static_cast<std::size_t>(len), '\0');
  if (len > 0) backend.broadcast(TensorView{text.data(), len, DType::u8, Device::cpu()}, k);
  std::string msg = text + " [on " + rank_list({k}) + " of " + std::to_string(n);
  if (failed.size() > 1) msg += "; refused on " + rank_list(failed);
  msg += "; " + std::string(consequence) + "]";
  ErrorRecord failure;
  failure.kind = static_cast<ErrorKind>(at(k, 1));
  failure.what = msg;
  throw_error(failure);
}

}  // namespace lockstep::detail
