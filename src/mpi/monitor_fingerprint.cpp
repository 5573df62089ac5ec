// CommMonitor (monitor_impl.hpp): the fingerprint exchange and the report of a mismatch.
#include "mpi/monitor_impl.hpp"

#include <array>
#include <iterator>
#include <string>

#include "mpi/agreement.hpp"

namespace lockstep {
namespace detail {

void CommMonitor::compare_fingerprints(const Fingerprint& fp, const CallSite& site) {
  // One small allreduce of every field and of its complement (agreement_encode).
  // On the heap: the request must never target a stack frame a throwing wait leaves.
  auto owner = std::make_shared<std::array<std::int64_t, 2 * kFields>>();
  std::int64_t* buf = owner->data();
  fill_check_buffer(fp, buf);
  run(MPI_IN_PLACE, buf, 2 * kFields, MPI_INT64_T, MPI_MAX, "fingerprint MPI_Allreduce", owner);
  if (!agree(buf)) report_mismatch(fp, site);
}

// The agreement's encoding (agreement.hpp), the one the shared-memory and hierarchical paths use.
void CommMonitor::fill_check_buffer(const Fingerprint& fp, std::int64_t* buf) {
  agreement_encode(fp.v, kFields, buf);
}

bool CommMonitor::agree(const std::int64_t* buf) { return agreement_holds(buf, kFields); }

void CommMonitor::finish_deferred(DeferredCheck& d) {
  if (d.req == MPI_REQUEST_NULL) return;
  {
    std::lock_guard lock(mutex_);
    record_entered(d.fp, d.site, /*checking=*/true, /*waiting=*/true);
  }
  check_mpi(wait(&d.req), "fingerprint MPI_Iallreduce");
  {
    std::lock_guard lock(mutex_);
    in_collective_ = waiting_request_ = checking_ = false;
  }
  if (agree(d.buf)) return;
  try {
    report_mismatch(d.fp, d.site, false);
  } catch (const MismatchError& e) {
    mark_unusable(std::string("lockstep: this communicator is unusable after a mismatched nonblocking "
                              "collective: ") + e.what(), true, false);
    throw;
  }
}

void CommMonitor::start_deferred(const Fingerprint& fp, const CallSite& site) {
  // A check whose operation failed to be issued (it threw after entering) was never taken by
  // a request: complete it before its buffer goes.
  if (deferred_ && deferred_->req != MPI_REQUEST_NULL) MPI_Wait(&deferred_->req, MPI_STATUS_IGNORE);
  auto d = std::make_unique<DeferredCheck>();
  d->fp = fp;
  d->site = site;
  fill_check_buffer(fp, d->buf);
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, d->buf, 2 * kFields, MPI_INT64_T, MPI_MAX, check_, &d->req),
            "fingerprint MPI_Iallreduce");
  deferred_ = std::move(d);
}

namespace {
// Field `i` of a fingerprint in words (Disagreement::show; the order of kFieldNames).
std::string show_fingerprint_field(int i, std::int64_t v) {
  switch (i) {
    case 0: return v >= 0 && v <= static_cast<std::int64_t>(Coll::ibroadcast) ? name_of(static_cast<Coll>(v)) : "?";
    case 1: return v >= 0 && v <= static_cast<std::int64_t>(DType::u8) ? name(static_cast<DType>(v)) : "none";
    case 3: return v < 0 ? "none" : std::to_string(v);
    case 4: return v >= 0 && v <= static_cast<std::int64_t>(ReduceOp::avg) ? name(static_cast<ReduceOp>(v)) : "none";
    case 6: return v ? "accepted" : "refused";
    default: return std::to_string(v);
  }
}
}  // namespace

[[noreturn]] void CommMonitor::report_mismatch(const Fingerprint& fp, const CallSite& site, bool nothing_moved) {
  // Slow path, only on a mismatch: gather every rank's fingerprint and description.
  // What the request reads and writes, on the heap and kept if the wait throws (wait_keeping).
  struct Exchange {
    MismatchMsg mine;
    std::vector<MismatchMsg> all;
  };
  auto ex = std::make_shared<Exchange>();
  MismatchMsg& mine = ex->mine;
  mine.fp = fp;
  copy_text(mine.text, fp.v[6] == 0 ? concat(describe(fp, site), "; its arguments were refused: ", refusal_)
                                    : describe(fp, site));
  ex->all.resize(static_cast<std::size_t>(size_));
  const std::vector<MismatchMsg>& all = ex->all;
  MPI_Request req;
  check_mpi(MPI_Iallgather(&mine, sizeof mine, MPI_BYTE, ex->all.data(), sizeof mine, MPI_BYTE, check_, &req),
            "MPI_Iallgather(fingerprints)");
  check_mpi(wait_keeping(&req, ex, [this](MPI_Request* q) { return wait(q); }), "MPI_Iallgather(fingerprints)");

  Disagreement d;
  d.head = concat("lockstep: collective mismatch on a ", size_, "-rank communicator");
  d.field_names.assign(std::begin(kFieldNames), std::end(kFieldNames));
  d.show = show_fingerprint_field;
  for (const MismatchMsg& m : all) {
    d.values.emplace_back(m.fp.v, m.fp.v + kFields);
    d.called.emplace_back(m.text);
  }
  d.tail = concat(nothing_moved ? "No data was exchanged."
                                : "The nonblocking operation was already issued; this backend is unusable now.",
                  " [reported by rank ", rank_, "/", size_, "]");
  {
    std::lock_guard lock(mutex_);
    in_collective_ = false;
  }
  throw_mismatch(d);
}

}  // namespace detail
}  // namespace lockstep
