// parallelize's results combined across ranks: the reducers' arithmetic (mean weighted by the
// partitions' sizes, sum), the ranks' agreement on each result's layout, and the gather of
// concatenated results.
#include "lockstep/train/data.hpp"

#include <algorithm>
#include <cstring>
#include <exception>

#include "lockstep/core/device_runtime.hpp"
#include "lockstep/train/synchronize.hpp"

namespace lockstep {

using detail::concat;

namespace detail {

namespace {
template <class T>
void add_scaled_typed(T* dst, const T* src, std::int64_t n, double w) {
  const T tw = static_cast<T>(w);
  for (std::int64_t i = 0; i < n; ++i) dst[i] += tw * src[i];
}
template <class T>
void add_typed(T* dst, const T* src, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
}
}  // namespace

std::string mean_reducer_refusal(const char* what, const std::string& leaf, const std::string& kind) {
  return concat(what, ": mean_reducer needs floating-point results (use sum_reducer): ",
                leaf.empty() ? std::string("the result") : concat("'", leaf, "'"), " is ", kind, rank_suffix());
}

void add_scaled(Tensor& dst, const Tensor& src, double weight) {
  LOCKSTEP_CHECK_ARG(dst.numel() == src.numel() && dst.dtype() == src.dtype(),
                     "parallelize: results of different partitions differ: ", name(dst.dtype()), " ",
                     to_string(dst.shape()), " vs ", name(src.dtype()), " ", to_string(src.shape()));
  LOCKSTEP_CHECK_ARG(dst.device().is_cpu() && src.device().is_cpu(),
                     "parallelize: results must be host tensors");
  const auto n = dst.numel();
  switch (dst.dtype()) {
    case DType::f32: add_scaled_typed(dst.data<float>(), src.data<float>(), n, weight); break;
    case DType::f64: add_scaled_typed(dst.data<double>(), src.data<double>(), n, weight); break;
    case DType::i32: add_typed(dst.data<std::int32_t>(), src.data<std::int32_t>(), n); break;
    case DType::i64: add_typed(dst.data<std::int64_t>(), src.data<std::int64_t>(), n); break;
    default:
      throw InvalidArgument(concat("parallelize: results of dtype ", name(dst.dtype()),
                                   " are not supported (f32, f64, i32, i64)"));
  }
}

void reduce_results(Backend& b, std::vector<Tensor*>& tensors, std::vector<double*>& fscalars,
                    std::vector<std::int64_t*>& iscalars, double weight, bool mean) {
  // Floating leaves (and the weight) in one double buffer, integer leaves in one int64 buffer.
  std::vector<double> fb;
  std::vector<std::int64_t> ib;
  bool has_int = !iscalars.empty();
  for (auto* t : tensors) {
    LOCKSTEP_CHECK_ARG(t->device().is_cpu(), "parallelize: results must be host tensors");
    switch (t->dtype()) {
      case DType::f32: for (float v : t->span<float>()) fb.push_back(v); break;
      case DType::f64: for (double v : t->span<double>()) fb.push_back(v); break;
      case DType::i32: has_int = true; for (auto v : t->span<std::int32_t>()) ib.push_back(v); break;
      case DType::i64: has_int = true; for (auto v : t->span<std::int64_t>()) ib.push_back(v); break;
      default:
        throw InvalidArgument(concat("parallelize: results of dtype ", name(t->dtype()),
                                     " are not supported (f32, f64, i32, i64)"));
    }
  }
  if (mean && has_int)
    throw InvalidArgument(mean_reducer_refusal("parallelize", "a result", "an integer tensor or scalar"));
  for (auto* f : fscalars) fb.push_back(*f);
  for (auto* i : iscalars) ib.push_back(*i);
  fb.push_back(weight);
  b.allreduce(TensorView{fb.data(), static_cast<std::int64_t>(fb.size()), DType::f64, Device::cpu()},
              ReduceOp::sum);
  if (!ib.empty())
    b.allreduce(TensorView{ib.data(), static_cast<std::int64_t>(ib.size()), DType::i64, Device::cpu()},
                ReduceOp::sum);
  const double total = fb.back();
  const double scale = mean ? 1.0 / total : 1.0;
  std::size_t fi = 0, ii = 0;
  for (auto* t : tensors) {
    switch (t->dtype()) {
      case DType::f32: for (float& v : t->span<float>()) v = static_cast<float>(fb[fi++] * scale); break;
      case DType::f64: for (double& v : t->span<double>()) v = fb[fi++] * scale; break;
      case DType::i32: for (auto& v : t->span<std::int32_t>()) v = static_cast<std::int32_t>(ib[ii++]); break;
      case DType::i64: for (auto& v : t->span<std::int64_t>()) v = ib[ii++]; break;
      default: break;
    }
  }
  for (auto* f : fscalars) *f = fb[fi++] * scale;
  for (auto* i : iscalars) *i = ib[ii++];
}

void share_result_layout(Backend& b, std::vector<Tensor*>& tensors, bool have_result, int root) {
  // Root's layout: count, then per tensor dtype, ndim, extents.
  std::vector<std::int64_t> layout;
  if (b.rank() == root) {
    layout.push_back(static_cast<std::int64_t>(tensors.size()));
    for (auto* t : tensors) {
      layout.push_back(static_cast<std::int64_t>(t->dtype()));
      layout.push_back(static_cast<std::int64_t>(t->ndim()));
      for (auto e : t->shape()) layout.push_back(e);
    }
  }
  std::int64_t len = static_cast<std::int64_t>(layout.size());
  b.broadcast(TensorView{&len, 1, DType::i64, Device::cpu()}, root);
  layout.resize(static_cast<std::size_t>(len));
  b.broadcast(TensorView{layout.data(), len, DType::i64, Device::cpu()}, root);
  std::int64_t failed = 0;
  if (!have_result) {
    if (layout.empty() || layout[0] != static_cast<std::int64_t>(tensors.size())) {
      failed = 1;
    } else {
      std::size_t pos = 1;
      for (auto* t : tensors) {
        const auto dt = static_cast<DType>(layout[pos++]);
        const auto nd = static_cast<std::size_t>(layout[pos++]);
        Shape s(layout.begin() + static_cast<std::ptrdiff_t>(pos),
                layout.begin() + static_cast<std::ptrdiff_t>(pos + nd));
        pos += nd;
        *t = Tensor::zeros(s, dt);
      }
    }
  }
  // Every rank learns whether a rank could not shape its empty result (no rank may leave the
  // others waiting in the reduction).
  b.allreduce(TensorView{&failed, 1, DType::i64, Device::cpu()}, ReduceOp::max);
  if (failed != 0)
    throw InvalidArgument(concat("parallelize: some rank ran no partition (fewer samples than "
                                 "ranks) and its result type has a variable structure (a vector, "
                                 "map or optional of tensors); use a result with fixed structure",
                                 rank_suffix()));
}

namespace {
constexpr std::size_t kMaxText = 1500;  // per rank, in the messages of a failed agreement
constexpr int kMaxListed = 8;          // ranks named in one message

TensorView u8_view(void* data, std::size_t n) {
  return TensorView{data, static_cast<std::int64_t>(n), DType::u8, Device::cpu()};
}

// Every rank's string, in rank order (lengths first, then one padded allgather).
std::vector<std::string> allgather_strings(Backend& b, std::string mine) {
  if (mine.size() > kMaxText) {
    mine.resize(kMaxText - 3);
    mine += "...";
  }
  const int n = b.size();
  std::int64_t len = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> lens(static_cast<std::size_t>(n));
  b.allgather(TensorView{&len, 1, DType::i64, Device::cpu()},
              TensorView{lens.data(), n, DType::i64, Device::cpu()});
  const auto longest = static_cast<std::size_t>(*std::max_element(lens.begin(), lens.end()));
  std::vector<char> send(longest, '\0'), recv(longest * static_cast<std::size_t>(n));
  std::memcpy(send.data(), mine.data(), mine.size());
  b.allgather(u8_view(send.data(), send.size()), u8_view(recv.data(), recv.size()));
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r)
    out.emplace_back(recv.data() + longest * static_cast<std::size_t>(r),
                     static_cast<std::size_t>(lens[static_cast<std::size_t>(r)]));
  return out;
}

// " rank 0: a; rank 1: b" for the ranks `pick` selects, at most kMaxListed of them.
template <class Pick>
std::string list_ranks(const std::vector<std::string>& texts, Pick pick) {
  std::string out;
  int shown = 0, more = 0;
  for (std::size_t r = 0; r < texts.size(); ++r) {
    if (!pick(static_cast<int>(r))) continue;
    if (shown == kMaxListed) {
      ++more;
      continue;
    }
    out += concat(shown == 0 ? " " : "; ", "rank ", r, ": ", texts[r]);
    ++shown;
  }
  if (more > 0) out += concat(" (and ", more, " more rank", more == 1 ? "" : "s", ")");
  return out;
}

std::string hint(ReducerKind k, int dim) {
  if (k == ReducerKind::concat)
    return concat("concat_reducer needs results that agree on everything but dimension ", dim,
                  ": structure, dtypes and the other extents");
  return concat(reducer_name(k), " combines results of one shape; a result with a value per sample "
                "(shaped by its partition) needs concat_reducer");
}

std::string describe_partitioner(const DimPartitioner& p) {
  return concat("partitioned along dimension ", p.dim, p.exclusive ? " (exclusive" : " (contiguous",
                p.keepdim ? ")" : ", dimension removed)");
}
}  // namespace

const char* reducer_name(ReducerKind k) noexcept {
  switch (k) {
    case ReducerKind::mean: return "mean_reducer";
    case ReducerKind::sum: return "sum_reducer";
    case ReducerKind::concat: return "concat_reducer";
  }
  return "?";
}

void ResultDescriber::add_text(const std::string& path, const std::string& desc) {
  if (text_full_) return;
  if (text.size() > 400) {
    text += ", ...";
    text_full_ = true;
    return;
  }
  if (!text.empty()) text += ", ";
  text += path.empty() ? desc : concat(path, ": ", desc);
}

void ResultDescriber::leaf(const std::string& path, const Tensor& t) {
  ++tensors;
  const bool wildcard = for_concat_ && keepdim_;
  sig += concat("T ", name(t.dtype()), " [");
  for (std::size_t d = 0; d < t.ndim(); ++d) {
    if (d > 0) sig += ',';
    sig += wildcard && static_cast<int>(d) == dim_ ? std::string("*") : std::to_string(t.dim(d));
  }
  sig += "]|";
  const std::string shape = to_string(t.shape());
  add_text(path, concat(name(t.dtype()), " ", shape));
  if (for_concat_ && concat_problem.empty()) {
    const std::string what = path.empty() ? std::string("the result") : concat("'", path, "'");
    const auto nd = static_cast<std::int64_t>(t.ndim());
    if (keepdim_ && nd <= dim_)
      concat_problem = concat(what, " has shape ", shape, ", which has no dimension ", dim_,
                              " to concatenate along");
    else if (!keepdim_ && nd < dim_)
      concat_problem = concat(what, " has shape ", shape, ", which cannot be stacked along a new "
                              "dimension ", dim_);
  }
}

void ResultDescriber::scalar(const std::string& path, bool floating, bool is_signed, std::size_t bytes) {
  ++(floating ? fscalars : iscalars);
  const std::string desc = floating ? concat("float", bytes * 8) : concat(is_signed ? "int" : "uint", bytes * 8);
  sig += concat("S ", desc, "|");
  add_text(path, concat("scalar ", desc));
  if (for_concat_ && concat_problem.empty())
    concat_problem = concat(path.empty() ? std::string("the result") : concat("'", path, "'"),
                            " is a scalar (return a tensor, e.g. of shape [1])");
}

void ResultDescriber::node(const std::string& /*path*/, const char* kind, std::size_t n) {
  if (std::strcmp(kind, "optional") == 0)
    sig += n != 0 ? "optional set|" : "optional empty|";
  else
    sig += concat(kind, " of ", n, "|");
}

void ResultDescriber::key(const std::string& /*path*/, const std::string& k) {
  sig += concat("key ", k.size(), ":", k, "|");
}

void ParallelCall::fail(std::exception_ptr e) {
  error = e;
  const ErrorRecord r = error_record(e);
  error_kind = text_kind(r.kind);
  error_text = r.kind == ErrorKind::std_exception ? concat("f threw: ", r.what)
               : r.kind == ErrorKind::unknown     ? std::string("f threw an exception that is not a std::exception")
                                                  : r.what;
}

void ParallelCall::describe_arg(const Tensor* t) {
  if (!args.empty()) args += ", ";
  args += t != nullptr ? concat(name(t->dtype()), " ", to_string(t->shape())) : std::string("(not a tensor)");
}

void ParallelCall::add_result(const ResultDescriber& d, std::size_t index,
                              const std::vector<Partition>& parts) {
  auto part_name = [&](std::size_t i) {
    return concat("partition ", i, " (samples [", parts[i].start, ", ", parts[i].start + parts[i].count, "))");
  };
  if (kind == ReducerKind::concat && !d.concat_problem.empty())
    throw InvalidArgument(concat("parallelize: concat_reducer cannot combine the result of ",
                                 part_name(index), ": ", d.concat_problem, rank_suffix()));
  if (!have) {
    result_sig = d.sig;
    result_text = d.text;
    first_index = index;
    return;
  }
  if (d.sig != result_sig)
    throw MismatchError(concat("parallelize: the results of ", part_name(first_index), " and ",
                               part_name(index), " differ: ", result_text.empty() ? "(no leaves)" : result_text,
                               " vs ", d.text.empty() ? "(no leaves)" : d.text, " (",
                               hint(kind, partitioner.dim), ")", rank_suffix()));
}

void ParallelCall::pack(const Tensor& t) {
  LOCKSTEP_CHECK_ARG(t.device().is_cpu(), "parallelize: concat_reducer needs host tensors, got one on ",
                     to_string(t.device()));
  extents.push_back(partitioner.keepdim ? t.dim(static_cast<std::size_t>(partitioner.dim)) : 1);
  if (t.nbytes() == 0) return;
  const auto* p = static_cast<const std::byte*>(t.raw_data());
  bytes.insert(bytes.end(), p, p + t.nbytes());
}

std::vector<std::int64_t> agree_on_call(Backend& b, const ParallelCall& c) {
  const int n = b.size();
  const std::string args = concat(c.args.empty() ? std::string("(no arguments)") : c.args, "; ",
                                  describe_partitioner(c.partitioner), "; ", reducer_name(c.kind));
  constexpr std::size_t K = 8;
  enum { kError, kArgs, kHave, kResult, kTensors, kFloats, kInts, kPayload };
  const std::int64_t mine[K] = {
      static_cast<std::int64_t>(c.error_kind),
      static_cast<std::int64_t>(hash_bytes(args.data(), args.size())),
      c.have ? 1 : 0,
      static_cast<std::int64_t>(hash_bytes(c.result_sig.data(), c.result_sig.size())),
      c.tensors,
      c.fscalars,
      c.iscalars,
      static_cast<std::int64_t>(c.extents.size() * sizeof(std::int64_t) + c.bytes.size())};
  std::vector<std::int64_t> all(K * static_cast<std::size_t>(n));
  b.allgather(TensorView{const_cast<std::int64_t*>(mine), static_cast<std::int64_t>(K), DType::i64, Device::cpu()},
              TensorView{all.data(), static_cast<std::int64_t>(all.size()), DType::i64, Device::cpu()});
  auto at = [&](int r, int k) { return all[static_cast<std::size_t>(r) * K + static_cast<std::size_t>(k)]; };

  // Every rank sees the same table, so every rank takes the same branch below.
  // 1. A rank threw (f, or a check of its own): every rank throws, of the kind of the first
  // rank that threw a Lockstep error (Error when none did).
  int first_failed = -1;
  ErrorRecord failure;
  for (int r = 0; r < n; ++r) {
    const auto k = static_cast<ErrorKind>(at(r, kError));
    if (k == ErrorKind::none) continue;
    if (first_failed < 0) first_failed = r;
    if (failure.kind == ErrorKind::none && !foreign_kind(k)) failure.kind = k;
  }
  if (first_failed >= 0) {
    const auto texts = allgather_strings(b, c.error_text);
    if (foreign_kind(c.error_kind)) std::rethrow_exception(c.error);  // the user's own exception, as it was
    failure.what =
        concat("parallelize: the call failed before the results were combined, so it fails on every rank:",
               list_ranks(texts, [&](int r) { return at(r, kError) != 0; }), rank_suffix());
    throw_error(failure);
  }
  // 2. Different arguments (batch size, feature shapes, dtypes), partitioner or reducer.
  bool same_args = true;
  for (int r = 0; r < n; ++r) same_args = same_args && at(r, kArgs) == at(0, kArgs);
  if (!same_args) {
    const auto texts = allgather_strings(b, args);
    throw MismatchError(concat("parallelize: the ranks called it with different arguments (every rank "
                               "must pass the same whole batch, partitioner and reducer):",
                               list_ranks(texts, [](int) { return true; }), rank_suffix()));
  }
  // 3. Results of different structures or shapes on the ranks that ran a partition.
  int first_have = -1;
  bool same_results = true;
  for (int r = 0; r < n; ++r) {
    if (at(r, kHave) == 0) continue;
    if (first_have < 0) first_have = r;
    same_results = same_results && at(r, kResult) == at(first_have, kResult);
  }
  if (!same_results) {
    const auto texts = allgather_strings(
        b, c.have ? (c.result_text.empty() ? std::string("(no leaves)") : c.result_text)
                  : std::string("(no partition)"));
    throw MismatchError(concat("parallelize: the ranks' results differ, so ", reducer_name(c.kind),
                               " cannot combine them (", hint(c.kind, c.partitioner.dim), "):",
                               list_ranks(texts, [&](int r) { return at(r, kHave) != 0; }), rank_suffix()));
  }
  // 4. A rank without a partition must be able to hold the result (the same leaves).
  if (first_have < 0) throw Error(concat("parallelize: no rank ran a partition", rank_suffix()));
  for (int r = 0; r < n; ++r) {
    if (at(r, kHave) != 0) continue;
    for (int k : {kTensors, kFloats, kInts})
      if (at(r, k) != at(first_have, k))
        throw InvalidArgument(concat("parallelize: some rank ran no partition (fewer samples than "
                                     "ranks) and its result type has a variable structure (a vector, "
                                     "map or optional of tensors); use a result with fixed structure",
                                     rank_suffix()));
  }
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) sizes[static_cast<std::size_t>(r)] = at(r, kPayload);
  return sizes;
}

void concat_results(Backend& b, const ParallelCall& c, const std::vector<std::int64_t>& sizes,
                    std::vector<Tensor*>& tensors, const std::vector<Partition>& parts) {
  const int n = b.size();
  const std::size_t nt = tensors.size();
  const int dim = c.partitioner.dim;
  const bool keepdim = c.partitioner.keepdim;
  const auto longest = static_cast<std::size_t>(*std::max_element(sizes.begin(), sizes.end()));
  // One padded allgather of every rank's pieces: [extents (int64)][bytes].
  std::vector<std::byte> send(longest), recv(longest * static_cast<std::size_t>(n));
  const std::size_t meta = c.extents.size() * sizeof(std::int64_t);
  if (meta > 0) std::memcpy(send.data(), c.extents.data(), meta);
  if (!c.bytes.empty()) std::memcpy(send.data() + meta, c.bytes.data(), c.bytes.size());
  b.allgather(u8_view(send.data(), send.size()), u8_view(recv.data(), recv.size()));

  // Which partitions each rank ran, in order, and where each partition is in its rank's list.
  std::vector<std::size_t> local_count(static_cast<std::size_t>(n), 0), local_index(parts.size());
  for (std::size_t p = 0; p < parts.size(); ++p)
    local_index[p] = local_count[static_cast<std::size_t>(parts[p].rank)]++;
  // Per leaf: the layout of one piece (outer x extent x inner elements) from the template.
  std::vector<std::int64_t> outer(nt, 1), inner(nt, 1);
  std::vector<std::size_t> esize(nt);
  for (std::size_t l = 0; l < nt; ++l) {
    const Shape& s = tensors[l]->shape();
    for (std::size_t d = 0; d < s.size(); ++d) {
      if (static_cast<int>(d) < dim) outer[l] *= s[d];
      else if (static_cast<int>(d) > dim || (!keepdim && static_cast<int>(d) == dim)) inner[l] *= s[d];
    }
    esize[l] = size_of(tensors[l]->dtype());
  }
  // Per rank: the extents of its pieces and where each piece starts in its payload.
  auto extent = [&](int r, std::size_t k, std::size_t l) {
    std::int64_t e = 0;
    std::memcpy(&e, recv.data() + longest * static_cast<std::size_t>(r) + (k * nt + l) * sizeof e, sizeof e);
    return e;
  };
  auto piece_bytes = [&](std::int64_t e, std::size_t l) {
    return static_cast<std::size_t>(outer[l] * e * inner[l]) * esize[l];
  };
  std::vector<std::vector<std::size_t>> offset(static_cast<std::size_t>(n));
  std::vector<std::int64_t> total(nt, 0);
  for (int r = 0; r < n; ++r) {
    const std::size_t k_count = local_count[static_cast<std::size_t>(r)];
    std::size_t pos = k_count * nt * sizeof(std::int64_t);
    auto& off = offset[static_cast<std::size_t>(r)];
    off.resize(k_count * nt);
    for (std::size_t k = 0; k < k_count; ++k)
      for (std::size_t l = 0; l < nt; ++l) {
        const std::int64_t e = extent(r, k, l);
        if (e < 0) throw Error(concat("parallelize: corrupt concat payload of rank ", r, rank_suffix()));
        off[k * nt + l] = pos;
        pos += piece_bytes(e, l);
        total[l] += e;
      }
    if (static_cast<std::int64_t>(pos) != sizes[static_cast<std::size_t>(r)])
      throw Error(concat("parallelize: the concat payload of rank ", r, " has ", sizes[static_cast<std::size_t>(r)],
                         " bytes, expected ", pos, rank_suffix()));
  }
  // Assemble every leaf in partition order.
  for (std::size_t l = 0; l < nt; ++l) {
    Shape shape = tensors[l]->shape();
    if (keepdim)
      shape[static_cast<std::size_t>(dim)] = total[l];
    else
      shape.insert(shape.begin() + dim, total[l]);
    Tensor out(shape, tensors[l]->dtype());
    auto* dst = static_cast<std::byte*>(out.raw_data());
    const std::size_t out_row = static_cast<std::size_t>(total[l] * inner[l]) * esize[l];
    std::int64_t at_extent = 0;
    for (std::size_t p = 0; p < parts.size(); ++p) {
      const int r = parts[p].rank;
      const std::size_t k = local_index[p];
      const std::int64_t e = extent(r, k, l);
      const std::size_t row = static_cast<std::size_t>(e * inner[l]) * esize[l];
      const std::byte* src = recv.data() + longest * static_cast<std::size_t>(r) +
                             offset[static_cast<std::size_t>(r)][k * nt + l];
      const std::size_t at_bytes = static_cast<std::size_t>(at_extent * inner[l]) * esize[l];
      if (row > 0)
        for (std::int64_t o = 0; o < outer[l]; ++o)
          std::memcpy(dst + static_cast<std::size_t>(o) * out_row + at_bytes,
                      src + static_cast<std::size_t>(o) * row, row);
      at_extent += e;
    }
    *tensors[l] = std::move(out);
  }
}

}  // namespace detail
}  // namespace lockstep
