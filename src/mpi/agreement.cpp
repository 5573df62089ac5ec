// The call agreement's record and report (see agreement.hpp).
#include "mpi/agreement.hpp"

#include <algorithm>
#include <iterator>
#include <type_traits>

#include "comm/rank_list.hpp"
#include "lockstep/core/errors.hpp"

namespace lockstep::detail {

static_assert(std::is_trivially_copyable_v<CallRecord> && sizeof(CallRecord) == 40,
              "CallRecord travels as bytes and fits a slice header");

namespace {
const char* const kCallFieldNames[CallRecord::kFields] = {"call number", "collective", "element count", "dtype",
                                                      "op",          "root",       "memory"};

const char* kind_name(std::uint32_t kind) {
  switch (static_cast<CallKind>(kind)) {
    case CallKind::allreduce: return "allreduce";
    case CallKind::broadcast: return "broadcast";
    case CallKind::reduce: return "reduce";
    case CallKind::allgather: return "allgather";
    case CallKind::reduce_scatter: return "reduce_scatter";
    case CallKind::allreduce_wire16: return "allreduce_wire16";
    case CallKind::reduce_scatter_wire16: return "reduce_scatter_wire16";
    case CallKind::barrier: return "barrier";
    case CallKind::exact_sum: return "exact_sum";
  }
  return "an unknown collective";
}

std::string dtype_name(std::int64_t v) { return v >= 0 && v < 64 ? name(static_cast<DType>(v)) : std::to_string(v); }
std::string op_name(std::int64_t v) { return v < 0 ? "none" : name(static_cast<ReduceOp>(v)); }

// Field `i` of a record in words (Disagreement::show).
std::string show_field(int i, std::int64_t v) {
  switch (i) {
    case 1: return kind_name(static_cast<std::uint32_t>(v));
    case 3: return dtype_name(v);
    case 4: return op_name(v);
    case 5: return v < 0 ? "none" : std::to_string(v);
    case 6: return v ? "host" : "device";
    default: return std::to_string(v);
  }
}

// Groups the ranks by a key of their record: "ranks 0, 1: A; rank 2: B", the values in the order
// of the first rank holding each.
template <class Item, class Key, class Show>
std::string ranks_by(const std::vector<Item>& by_rank, Key&& key, Show&& show) {
  using Value = decltype(key(by_rank[0]));
  std::vector<Value> values;
  std::vector<std::vector<int>> holders;
  for (std::size_t r = 0; r < by_rank.size(); ++r) {
    const Value v = key(by_rank[r]);
    auto at = std::find(values.begin(), values.end(), v);
    if (at == values.end()) {
      values.push_back(v);
      holders.emplace_back();
      at = values.end() - 1;
    }
    holders[static_cast<std::size_t>(at - values.begin())].push_back(static_cast<int>(r));
  }
  std::string text;
  for (std::size_t k = 0; k < values.size(); ++k)
    text += concat(k ? "; " : "", rank_list(holders[k]), ": ", show(values[k]));
  return text;
}
}  // namespace

std::int64_t CallRecord::field(int i) const noexcept {
  switch (i) {
    case 0: return static_cast<std::int64_t>(call);
    case 1: return kind;
    case 2: return numel;
    case 3: return dtype;
    case 4: return op;
    case 5: return root;
    default: return host;
  }
}

bool CallRecord::same_call(const CallRecord& other) const noexcept {
  for (int i = 0; i < kFields; ++i)
    if (field(i) != other.field(i)) return false;
  return true;
}

CallRecord call_record(std::uint64_t call, CallKind kind, std::int64_t numel, DType dtype, int op, int root,
                       bool host) noexcept {
  CallRecord r;
  r.call = call;
  r.numel = numel;
  r.kind = static_cast<std::uint32_t>(kind);
  r.dtype = static_cast<std::uint32_t>(dtype);
  r.op = op;
  r.root = root;
  r.host = host ? 1 : 0;
  return r;
}

std::string describe(const CallRecord& r) {
  const auto kind = static_cast<CallKind>(r.kind);
  std::string text = kind_name(r.kind);
  if (kind == CallKind::barrier) return text;
  if (kind == CallKind::allreduce_wire16 || kind == CallKind::reduce_scatter_wire16)
    text += concat(" of ", r.numel, " f32 elements sent as ", dtype_name(r.dtype));
  else
    text += concat(" of ", r.numel, " ", dtype_name(r.dtype), " elements");
  if (r.op >= 0) text += concat(" with op ", op_name(r.op));
  if (r.root >= 0) text += concat(kind == CallKind::reduce ? " onto root " : " from root ", r.root);
  if (!r.host) text += " in device memory";
  return text;
}

void agreement_encode(const std::int64_t* fields, int n, std::int64_t* buf) noexcept {
  for (int i = 0; i < n; ++i) {
    buf[i] = fields[i];
    buf[n + i] = ~fields[i];
  }
}

bool agreement_holds(const std::int64_t* buf, int n) noexcept {
  bool same = true;
  for (int i = 0; i < n; ++i) same = same && buf[i] == ~buf[n + i];
  return same;
}

void agreement_encode(const CallRecord& r, std::int64_t* buf) noexcept {
  std::int64_t fields[CallRecord::kFields];
  for (int i = 0; i < CallRecord::kFields; ++i) fields[i] = r.field(i);
  agreement_encode(fields, CallRecord::kFields, buf);
}

void throw_mismatch(const Disagreement& d) {
  const std::size_t ranks = d.values.size();
  const int fields = static_cast<int>(d.field_names.size());
  // The fields that differ, each with the ranks holding each value.
  std::vector<std::string> differ;
  for (int i = 0; i < fields; ++i) {
    const auto field = [i](const std::vector<std::int64_t>& v) { return v[static_cast<std::size_t>(i)]; };
    bool same = true;
    for (const auto& v : d.values) same = same && field(v) == field(d.values[0]);
    if (!same)
      differ.push_back(concat(d.field_names[static_cast<std::size_t>(i)], " (",
                              ranks_by(d.values, field, [&](std::int64_t v) { return d.show(i, v); }), ")"));
  }
  // A strict majority of ranks that made one call tells which ranks are the odd ones out.
  std::vector<int> odd;
  for (std::size_t r = 0; r < ranks; ++r) {
    const auto holders = std::count(d.values.begin(), d.values.end(), d.values[r]);
    if (2 * static_cast<std::size_t>(holders) <= ranks) continue;
    for (std::size_t q = 0; q < ranks; ++q)
      if (d.values[q] != d.values[r]) odd.push_back(static_cast<int>(q));
    break;
  }
  std::string text = concat(d.head, ": the ranks disagree on the ");
  for (std::size_t i = 0; i < differ.size(); ++i)
    text += concat(i == 0 ? "" : i + 1 == differ.size() ? " and the " : ", the ", differ[i]);
  text += ". What each rank called:";
  for (std::size_t r = 0; r < ranks; ++r) {
    const bool is_odd = std::find(odd.begin(), odd.end(), static_cast<int>(r)) != odd.end();
    text += concat("\n  rank ", r, ": ", d.called[r], is_odd ? "   <-- differs from the majority" : "");
  }
  if (!odd.empty()) text += concat("\nOdd one(s) out: ", rank_list(odd), ".");
  throw MismatchError(concat(text, "\n", d.tail));
}

void throw_call_mismatch(const char* what, const std::vector<CallRecord>& by_rank, int rank, const char* found_by) {
  Disagreement d;
  // The head is the same on every rank (what this rank called goes in the tail, as its rank does).
  d.head = concat("lockstep: collective mismatch on a ", by_rank.size(), "-rank communicator");
  d.field_names.assign(std::begin(kCallFieldNames), std::end(kCallFieldNames));
  d.show = show_field;
  for (const CallRecord& r : by_rank) {
    std::vector<std::int64_t> fields(CallRecord::kFields);
    for (int i = 0; i < CallRecord::kFields; ++i) fields[static_cast<std::size_t>(i)] = r.field(i);
    d.values.push_back(std::move(fields));
    d.called.push_back(describe(r));
  }
  d.tail = concat("Found by ", found_by, " at call number ", by_rank[static_cast<std::size_t>(rank)].call,
                  " on this communicator, in this rank's ", what,
                  ", before any data moved or any path was chosen.", rank_suffix());
  throw_mismatch(d);
}

}  // namespace lockstep::detail
