// Remote calls (remote.hpp): the registry, the wire format, and the engine of a session (a
// duplicated communicator and a progress thread per rank).
//
// Messages on the session's communicator: a header message (tag 1 requests and the end of a
// driver's run, which so comes after every request the driver sent before it; 2 replies; 3
// control: heartbeats and the notices of ranks closing the session) holding [fixed head][payload][name][tensor table],
// then one message per tensor (chunks of 1 GiB), sent from the tensor's memory and received
// into the new tensor, with a tag derived from the sender's call id (requests even, replies
// odd), so that the tensors of concurrent calls never mix.
//
// Who receives: one thread at a time looks at the incoming messages (a "pass", under poll_mu).
// A thread that waits for something MPI brings (its call's reply, the sending of a message, the
// next call while serving) takes the passes itself, and runs what it receives without a hand-off
// to another thread; the progress thread rests while such a thread waits, and takes the passes
// when nobody else does (while the rank's own code runs). So at most one thread per rank polls
// MPI, which matters where ranks share cores.
//
// Data tags repeat once the call ids wrap around the tag space (MPI_TAG_UB, at least 32767), so
// a tensor message must never be left unreceived: it would be taken by a later message's
// receive with the same tag. Every tensor message a header announces is therefore received by a
// receive posted for that header: one given up at its deadline stays posted (into memory kept
// until it completes), and the tensors of a message that found no memory are remembered as
// owed, and received (into memory then dropped) before any later receive of the same source and
// tag is posted. (Receives of 0 bytes would not do: Open MPI's shared-memory and self transports
// write a message whole, whatever the receive's size.) Senders never cancel.
#include "lockstep/remote/remote.hpp"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "lockstep/mpi/mpi_backend.hpp"
#include "lockstep/reliability/settings.hpp"
#include "mpi/finalize_hooks.hpp"

namespace lockstep::detail::remote {

using Clock = std::chrono::steady_clock;

namespace {

constexpr int kTagReq = 1, kTagRep = 2, kTagCtrl = 3, kDataBase = 16;
constexpr std::uint32_t kMagic = 0x4C535243;  // "LSRC"
constexpr std::size_t kChunk = std::size_t{1} << 30;

// k_closing: the sender is closing the session and serves until every rank has closed it (the
// receiver sends it heartbeats meanwhile); k_left: the sender closed it without waiting for the
// calls still owed (after it took another rank for silent).
enum Kind : std::uint8_t { k_req = 1, k_rep_ok, k_rep_err, k_stop_ok, k_stop_err, k_heartbeat, k_closing, k_left };

constexpr bool is_reply(Kind k) { return k == k_rep_ok || k == k_rep_err; }

struct Head {
  std::uint32_t magic;
  std::uint8_t kind;
  std::uint8_t pad[3];
  std::uint64_t id;
  std::uint64_t run;
  std::uint64_t payload_len;
  std::uint32_t name_len;
  std::uint32_t nseg;
  std::uint64_t table_len;
};
constexpr std::size_t kHead = sizeof(Head);

/// The heartbeat message: static, so that a send of it still pending when its session ends
/// reads valid memory.
const Head& heartbeat_head() {
  static const Head h = [] {
    Head x{};
    x.magic = kMagic;
    x.kind = k_heartbeat;
    return x;
  }();
  return h;
}

// ---- registry ----
struct Registry {
  std::mutex mu;
  std::map<std::string, FnInfo> by_name;
  std::map<const void*, std::string> by_fn;
};
Registry& registry() {
  static Registry r;
  return r;
}

std::optional<FnInfo> find_by_name(const std::string& name) {
  auto& r = registry();
  std::lock_guard lk(r.mu);
  auto it = r.by_name.find(name);
  if (it == r.by_name.end()) return std::nullopt;
  return it->second;
}

}  // namespace

void register_fn(const std::string& name, std::string sig, const void* fn, Invoke invoke) {
  auto& r = registry();
  std::lock_guard lk(r.mu);
  auto it = r.by_name.find(name);
  if (it != r.by_name.end()) {
    if (it->second.fn == fn) return;
    throw InvalidArgument(concat("register_remote: the name '", name,
                                 "' is already registered for another function"));
  }
  r.by_name[name] = FnInfo{name, std::move(sig), fn, invoke};
  r.by_fn[fn] = name;
}

bool unregister_fn(const std::string& name) {
  auto& r = registry();
  std::lock_guard lk(r.mu);
  auto it = r.by_name.find(name);
  if (it == r.by_name.end()) return false;
  r.by_fn.erase(it->second.fn);
  r.by_name.erase(it);
  return true;
}

std::optional<FnInfo> find_fn(const void* fn) {
  auto& r = registry();
  std::lock_guard lk(r.mu);
  auto it = r.by_fn.find(fn);
  if (it == r.by_fn.end()) return std::nullopt;
  return r.by_name.at(it->second);
}

// ---- test hooks ----
namespace {
thread_local double t_reply_tensor_delay = 0;
/// Remote functions this thread is running (nested): while a rank closes its session, only they
/// may start calls.
thread_local int t_running_calls = 0;
}
TestHooks& test_hooks() {
  static TestHooks h;
  return h;
}
void delay_reply_tensors_for_test(double seconds) { t_reply_tensor_delay = seconds; }

// ---- encoder / decoder ----
Encoder::Encoder() { bytes_.resize(kHead); }

void Encoder::tensor(const Tensor& t) {
  u32(static_cast<std::uint32_t>(tensors_.size()));
  if (t.device().is_cpu())
    tensors_.push_back(t.slice_view(0, t.shape()));  // shares (and keeps alive) t's memory
  else
    tensors_.push_back(t.to(Device::cpu()));  // device tensors are staged once
}

void Decoder::fail(const std::string& what) const {
  throw DecodeError(concat("expected ", what, " at byte ", pos_, " of ", n_));
}

void Decoder::get(void* out, std::size_t n) {
  if (n > n_ - pos_) fail(concat(n, " more bytes (the message is shorter)"));
  if (n > 0) std::memcpy(out, p_ + pos_, n);
  pos_ += n;
}

void Decoder::expect(std::uint8_t want, const char* what) {
  if (pos_ >= n_) fail(concat(what, " (the message ended)"));
  const auto got = static_cast<std::uint8_t>(p_[pos_]);
  if (got != want) fail(concat(what, " (wire tag 0x", std::hex, int(want), ", found 0x", int(got), std::dec, ")"));
  ++pos_;
}

std::uint64_t Decoder::count(std::size_t min_each) {
  const auto n = u64();
  if (n > (n_ - pos_) / std::max<std::size_t>(min_each, 1)) fail(concat("a count that fits the message (got ", n, ")"));
  return n;
}

Tensor Decoder::tensor() {
  const auto i = u32();
  if (tensors_ == nullptr || i != next_tensor_ || i >= tensors_->size()) fail("the next tensor of the message");
  ++next_tensor_;
  return std::move((*tensors_)[i]);
}

void Decoder::finish() {
  if (pos_ != n_) fail(concat("the end of the message (", n_ - pos_, " bytes left over)"));
  if (tensors_ != nullptr && next_tensor_ != tensors_->size()) fail("no more tensors");
}

// ---- the engine ----
namespace {

struct Incoming {
  int source = -1;
  Kind kind = k_req;
  std::uint64_t id = 0, run = 0;
  std::string name, sig;
  std::vector<std::byte> buf;
  std::size_t poff = kHead, plen = 0;
  std::vector<Tensor> segs;
  std::string failed;  // its tensors could not be received: answered with this error
  std::uint8_t fail_kind = 0;
};

double resolve_timeout(double t) { return t < 0 ? lockstep::timeout() : t; }

Clock::time_point deadline_after(double seconds) {
  if (seconds <= 0) return Clock::time_point::max();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

void backoff(Clock::time_point since_active) {
  const auto idle = Clock::now() - since_active;
  if (idle < std::chrono::milliseconds(2)) std::this_thread::yield();
  else if (idle < std::chrono::milliseconds(200)) std::this_thread::sleep_for(std::chrono::microseconds(50));
  else std::this_thread::sleep_for(std::chrono::microseconds(500));
}

/// Polls the requests until they complete or the deadline passes (returns false then). With
/// `statuses`, fills one status per request. Between two polls it calls `meanwhile()`, which
/// returns true when it did something (then the backoff starts again).
template <class Meanwhile>
bool wait_requests(std::vector<MPI_Request>& reqs, Clock::time_point deadline, std::vector<MPI_Status>* statuses,
                   Meanwhile&& meanwhile) {
  auto active = Clock::now();
  if (statuses != nullptr) statuses->resize(reqs.size());
  while (true) {
    int flag = 0;
    LOCKSTEP_MPI_CHECK(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag,
                                   statuses != nullptr ? statuses->data() : MPI_STATUSES_IGNORE));
    if (flag) return true;
    if (Clock::now() >= deadline) return false;
    if (meanwhile()) active = Clock::now();
    else backoff(active);
  }
}

bool wait_requests(std::vector<MPI_Request>& reqs, Clock::time_point deadline,
                   std::vector<MPI_Status>* statuses = nullptr) {
  return wait_requests(reqs, deadline, statuses, [] { return false; });
}

// ---- the receive cache ----
// Received tensors of kCacheMin bytes or more live in buffers of the session. The deleter of a
// buffer's storage (it runs when the last Tensor over the buffer is released, on any thread)
// gives the buffer back; the cache keeps it, within its byte limit, and hands it out again for
// a message of about the same size. Without it every large received tensor is new memory, which
// glibc maps afresh (allocations over its mmap threshold, at most 32 MiB), so that the page
// faults of first touch cost more than the transfer itself. A buffer is handed out only after
// its deleter ran: nothing received can alias a tensor still held.
constexpr std::size_t kCacheMin = std::size_t{64} << 10;
constexpr std::size_t kCacheMaxBuffers = 64;
constexpr std::size_t kAlign = 64;

class RecvCache : public std::enable_shared_from_this<RecvCache> {
 public:
  explicit RecvCache(std::size_t limit) : limit_(limit) {}
  ~RecvCache() {
    for (auto& b : kept_) std::free(b.p);
  }
  RecvCache(const RecvCache&) = delete;
  RecvCache& operator=(const RecvCache&) = delete;

  /// A host tensor of `shape` to receive into (contents unspecified: the receive fills it).
  Tensor take(Shape shape, DType dt) {
    const std::size_t n = nbytes_of(numel_of(shape), dt);
    if (n < kCacheMin || limit_ == 0) return Tensor(std::move(shape), dt);
    void* p = nullptr;
    std::size_t cap = 0;
    {
      std::lock_guard lk(mu_);
      // The smallest kept buffer that holds n bytes and wastes at most a quarter of n; of
      // those, the one given back last, whose memory is likeliest still in the CPU's caches (a
      // rank that calls with one size over and over then keeps reusing one buffer, not turning
      // through several).
      std::size_t best = kept_.size();
      for (std::size_t i = 0; i < kept_.size(); ++i) {
        const Kept& k = kept_[i];
        if (k.cap < n || k.cap - n > n / 4) continue;
        if (best == kept_.size() || k.cap < kept_[best].cap ||
            (k.cap == kept_[best].cap && k.stamp > kept_[best].stamp))
          best = i;
      }
      if (best != kept_.size()) {
        p = kept_[best].p;
        cap = kept_[best].cap;
        kept_bytes_ -= cap;
        kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(best));
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (p == nullptr) {
      cap = (n + kAlign - 1) / kAlign * kAlign;
      p = std::aligned_alloc(kAlign, cap);
      if (p == nullptr)
        throw Error(concat("remote: out of memory: cannot allocate ", n, " bytes for a received ", name(dt),
                           " tensor of shape ", lockstep::to_string(shape), rank_suffix()));
    }
    std::shared_ptr<void> owner;
    try {
      owner = std::shared_ptr<void>(p, [self = shared_from_this(), cap](void* q) { self->give(q, cap); });
    } catch (...) {
      std::free(p);
      throw;
    }
    return Tensor::adopt(p, std::move(owner), std::move(shape), dt);
  }

  /// Frees what is kept; buffers given back later are freed at once.
  void close() {
    std::lock_guard lk(mu_);
    closed_ = true;
    for (auto& b : kept_) std::free(b.p);
    kept_.clear();
    kept_bytes_ = 0;
  }

  ReceiveCacheStats stats() {
    std::lock_guard lk(mu_);
    return ReceiveCacheStats{hits_, misses_, kept_bytes_, kept_.size()};
  }

 private:
  struct Kept {
    std::size_t cap;
    void* p;
    std::uint64_t stamp;
  };

  void give(void* p, std::size_t cap) noexcept {
    std::lock_guard lk(mu_);
    if (closed_ || cap > limit_) {
      std::free(p);
      return;
    }
    // Make room: the least recently given back go first.
    while (!kept_.empty() && (kept_bytes_ + cap > limit_ || kept_.size() >= kCacheMaxBuffers)) {
      auto oldest = std::min_element(kept_.begin(), kept_.end(),
                                     [](const Kept& a, const Kept& b) { return a.stamp < b.stamp; });
      std::free(oldest->p);
      kept_bytes_ -= oldest->cap;
      kept_.erase(oldest);
    }
    try {
      kept_.push_back(Kept{cap, p, ++clock_});
      kept_bytes_ += cap;
    } catch (...) {
      std::free(p);
    }
  }

  std::mutex mu_;
  std::vector<Kept> kept_;
  std::size_t limit_, kept_bytes_ = 0;
  std::uint64_t clock_ = 0, hits_ = 0, misses_ = 0;
  bool closed_ = false;
};

}  // namespace

struct Engine;

struct Call {
  std::shared_ptr<Engine> e;
  std::uint64_t id = 0;
  int rank = 0;
  std::string fn;
  double timeout = 0;
  Clock::time_point deadline;
  bool done = false, abandoned = false;
  Kind kind = k_rep_ok;
  std::vector<std::byte> buf;
  std::size_t poff = kHead, plen = 0;
  std::vector<Tensor> segs;
  // Set when the call failed on this rank (the session ended first, its reply's tensors did
  // not arrive or could not be received, its reply arrived malformed): thrown by call_result
  // (f_remote: as a RemoteError whose message is `failed`).
  enum Failure : std::uint8_t { f_none, f_error, f_timeout, f_remote } failure = f_none;
  std::string failed;
};

/// When the progress thread last looked for messages of one tag and found none, three times in
/// a row: through() is the first of those looks' start, by which every message of the tag that
/// had arrived has been received (a single probe may miss one that MPI has yet to take in: Open
/// MPI progresses after looking). Written by the progress thread, read by any.
class LookWatch {
 public:
  void saw(bool empty, Clock::time_point pass) {
    if (!empty) {
      n_ = 0;
      return;
    }
    at_[n_++ % 3] = pass;
    if (n_ >= 3) through_.store(at_[n_ % 3].time_since_epoch().count(), std::memory_order_release);
  }
  Clock::time_point through() const {
    return Clock::time_point(Clock::duration(through_.load(std::memory_order_acquire)));
  }

 private:
  Clock::time_point at_[3]{};
  std::uint64_t n_ = 0;
  std::atomic<Clock::rep> through_{Clock::now().time_since_epoch().count()};
};

struct Engine {
  Backend* backend = nullptr;
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  int tag_span = 1 << 15;
  RemoteOptions opts;
  double timeout = 0;
  double data_timeout = 0;  // how long the tensors of a received header may take

  std::mutex mu;
  std::mutex send_mu;  // held while a message is posted (not while it is waited for)
  std::mutex poll_mu;  // held for a pass over the incoming messages (one thread at a time)
  std::atomic<int> waiters{0};  // threads that wait and take the passes themselves
  bool passes_over = false;     // the session is closing: no more passes (under poll_mu)
  std::condition_variable cv;
  std::deque<Incoming> queue;
  std::map<std::uint64_t, std::shared_ptr<Call>> pending;
  std::map<std::uint64_t, Incoming> stops;  // run -> the driver's end-of-run message
  std::atomic<std::uint64_t> next_id{1};
  std::uint64_t run_counter = 0;
  std::vector<Clock::time_point> last_heard;  // per rank: when a message of it last came (under mu)
  // Requests this rank started (counted before they are posted) and requests answered here: a
  // reply received (or one the called rank could not post, counted there), or a request never
  // posted. Summed over the ranks when the session closes (close_rounds).
  std::atomic<std::uint64_t> reqs_sent{0}, reqs_done{0};
  // Requests from rank 0 queued here and run here: a serving rank's run ends only when every
  // request the driver sent before its end of run has run (under mu).
  std::uint64_t driver_reqs_queued = 0, driver_reqs_done = 0;
  // The progress thread's looks for control messages: a serving rank takes the driver for
  // silent only when the looks show no heartbeat since the session's timeout after the driver's
  // last message (so a rank that was itself stopped, and has just resumed, reads the heartbeats
  // that came meanwhile first).
  LookWatch ctrl_looks;
  bool closing = false;
  // This rank has begun to close the session: only remote functions running here may start
  // calls (under mu).
  bool close_begun = false;

  std::shared_ptr<RecvCache> cache;
  std::thread progress, executor;
  std::thread::id executor_id;
  std::atomic<bool> stop_progress{false};
  std::atomic<bool> driving{false};
  std::vector<MPI_Request> hb_reqs;
  Clock::time_point next_hb = Clock::now();
  // Ranks closing the session, which this rank sends heartbeats to (so that they can tell a rank
  // still busy from a silent one), and ranks that closed it without waiting. Under poll_mu.
  std::vector<char> closing_ranks, left_ranks;
  bool hb_over = false;  // the session is closed everywhere: no more heartbeats (under poll_mu)
  std::atomic<bool> a_rank_left{false};  // some left_ranks entry is set
  // Ranks that left the session (k_left: they finalised with it open, or closed it without
  // waiting): calls to them fail at once, as do those still pending (under mu).
  std::vector<char> gone;
  std::atomic<bool> driver_left{false};  // rank 0 left (a serving rank stops waiting for it)
  std::atomic<bool> ended{false};        // close_engine ran (once per session)

  /// Requests given up on (a send past its deadline, a receive past its deadline: both stay
  /// posted), kept with the memory they use until MPI has completed them.
  struct Orphan {
    std::vector<MPI_Request> reqs;
    Encoder keep;
    std::vector<Tensor> segs;
    bool receives = false;
  };
  std::vector<Orphan> orphans;
  /// Tensor messages owed: announced by a header whose tensors found no memory, not received yet.
  /// They are received (and dropped) before any later receive with their source and tag.
  struct Owed {
    int source, tag;
    std::vector<std::size_t> chunks;  // bytes of each message, in order
  };
  std::vector<Owed> owed;
  Clock::time_point next_owed_try{};
  /// Messages whose header has come and whose tensors are being received, in header order (a
  /// request without tensors waits here too while an earlier one from its rank does). Under
  /// poll_mu.
  struct Arrival {
    Incoming in;
    std::vector<MPI_Request> reqs;
    std::vector<int> sizes;  // bytes announced for each request
    std::vector<MPI_Status> sts;  // filled when they complete
    Clock::time_point deadline;
    // Failed (its tensors did not come, or could not be received; or malformed), and waiting
    // behind an earlier message from the same rank to be failed in its turn (fail_or_park).
    std::string failed;
    Call::Failure fail_kind = Call::f_error;
    bool malformed = false;
  };
  std::deque<Arrival> arriving;

  Engine() = default;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  /// A session is ended by close_engine (by its owner, or by finalize: end_sessions_at_finalize).
  /// Should one still have its threads here (MPI ended by the program itself, the process
  /// exiting without finalize), they are stopped and joined: a joinable std::thread destroyed
  /// ends the process in std::terminate.
  ~Engine() {
    if (!progress.joinable() && !executor.joinable()) return;
    {
      std::lock_guard lk(mu);
      closing = true;
    }
    cv.notify_all();
    stop_progress = true;
    if (executor.joinable() && executor.get_id() != std::this_thread::get_id()) executor.join();
    if (progress.joinable() && progress.get_id() != std::this_thread::get_id()) progress.join();
    if (executor.joinable()) executor.detach();
    if (progress.joinable()) progress.detach();
  }

  int data_tag(std::uint64_t id, bool reply) const {
    return kDataBase + static_cast<int>((2 * id + (reply ? 1 : 0)) % static_cast<std::uint64_t>(tag_span));
  }

  /// Sends message m to every rank of dests (returns when sent); TimeoutError past the deadline
  /// (`seconds` after the start, for the message). `tensor_delay` (a test hook) holds the tensor
  /// messages back for that long after the header.
  void send(const std::vector<int>& dests, int tag, Kind kind, std::uint64_t id, std::uint64_t run,
            const std::string& name, Encoder& m, Clock::time_point deadline, double seconds, const std::string& what,
            double tensor_delay = 0, bool* header_posted = nullptr) {
    auto& bytes = m.bytes();
    auto& tensors = m.tensors();
    Head h{};
    h.magic = kMagic;
    h.kind = kind;
    h.id = id;
    h.run = run;
    h.payload_len = bytes.size() - kHead;
    h.name_len = static_cast<std::uint32_t>(name.size());
    h.nseg = static_cast<std::uint32_t>(tensors.size());
    m.put(name.data(), name.size());
    const auto table_start = bytes.size();
    for (const auto& t : tensors) {
      m.u8(static_cast<std::uint8_t>(t.dtype()));
      m.u8(static_cast<std::uint8_t>(t.ndim()));
      for (auto d : t.shape()) m.u64(static_cast<std::uint64_t>(d));
    }
    h.table_len = bytes.size() - table_start;
    if (is_reply(kind) && tensors.empty() && test_hooks().malformed_replies.load() > 0 &&
        test_hooks().malformed_replies.fetch_sub(1) > 0)
      h.payload_len += 1;  // a test hook: lengths that do not add up
    std::memcpy(bytes.data(), &h, kHead);
    const std::size_t hook_max = test_hooks().max_message_bytes.load();
    const std::size_t max_bytes = hook_max > 0 ? hook_max : static_cast<std::size_t>(INT32_MAX);
    LOCKSTEP_CHECK_ARG(bytes.size() <= max_bytes, "remote call: the non-tensor part of a message is over ",
                       hook_max > 0 ? concat(max_bytes, " bytes (a test hook)") : std::string("2 GiB"),
                       " (send large arrays as Tensors)");
    const bool reply = is_reply(kind);
    std::vector<MPI_Request> reqs;
    // One message's header and tensors are posted together, never interleaved with another
    // message's: a receiver posts its tensor receives in the order of the headers, so that when
    // the data tags have wrapped, two messages of the same tag still match in order.
    std::unique_lock post(send_mu);
    for (int dest : dests) {
      reqs.emplace_back();
      LOCKSTEP_MPI_CHECK(MPI_Isend(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, dest, tag, comm, &reqs.back()));
      if (header_posted != nullptr) *header_posted = true;
      if (tensor_delay > 0 && !tensors.empty())
        std::this_thread::sleep_for(std::chrono::duration<double>(tensor_delay));
      for (auto& t : tensors) {
        auto* p = static_cast<char*>(t.raw_data());
        for (std::size_t off = 0; off < t.nbytes(); off += kChunk) {
          const auto n = std::min(kChunk, t.nbytes() - off);
          reqs.emplace_back();
          LOCKSTEP_MPI_CHECK(MPI_Isend(p + off, static_cast<int>(n), MPI_BYTE, dest, data_tag(id, reply), comm, &reqs.back()));
        }
      }
    }
    post.unlock();
    // Once sent, the message's tensors are let go before this thread receives anything more:
    // a received tensor of the same size then reuses their buffer (a worker that echoes a
    // tensor keeps one buffer, where it would otherwise take a second for the next request,
    // which can arrive in the very pass that sees this send complete).
    bool released = false;
    const std::function<void()> before_receive = [&] {
      if (released || tensors.empty()) return;
      int flag = 0;
      MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE);
      if (flag) {
        tensors.clear();
        released = true;
      }
    };
    if (!wait_polling(reqs, deadline, &before_receive)) {
      std::lock_guard lk(mu);
      orphans.push_back(Orphan{std::move(reqs), std::move(m), {}, false});
      std::string who = "rank";
      if (dests.size() > 1) {
        who = "one of ranks";
        for (std::size_t i = 0; i < dests.size() && i < 8; ++i) who += concat(i ? ", " : " ", dests[i]);
        if (dests.size() > 8) who += ", ...";
      } else {
        who += concat(" ", dests[0]);
      }
      throw TimeoutError(concat(what, ": ", who, " did not take the message within ", seconds, " s", rank_suffix()));
    }
  }

  // ---- progress thread ----
  /// Remembers the tensor messages of a header whose tensors found no memory.
  void owe(int source, int tag, const std::vector<std::size_t>& bytes) {
    Owed o{source, tag, {}};
    for (std::size_t nb : bytes)
      for (std::size_t off = 0; off < nb; off += kChunk) o.chunks.push_back(std::min(kChunk, nb - off));
    if (!o.chunks.empty()) owed.push_back(std::move(o));
  }

  /// Posts receives for what is owed from (source, tag) (every source and tag when source < 0),
  /// into memory that is dropped once they complete. False when some found no memory again:
  /// then nothing more may be posted for that source and tag. Called with mu held.
  bool take_owed(int source = -1, int tag = -1) {
    bool all = true;
    std::vector<std::pair<int, int>> blocked;  // an earlier one found no memory: keep the order
    for (auto it = owed.begin(); it != owed.end();) {
      const std::pair<int, int> key{it->source, it->tag};
      if ((source >= 0 && (it->source != source || it->tag != tag)) ||
          std::find(blocked.begin(), blocked.end(), key) != blocked.end()) {
        ++it;
        continue;
      }
      Orphan o;
      o.receives = true;
      try {
        for (std::size_t nb : it->chunks) o.segs.push_back(Tensor({static_cast<std::int64_t>(nb)}, DType::u8));
      } catch (const std::exception&) {
        all = false;
        blocked.push_back(key);
        ++it;
        continue;
      }
      for (std::size_t i = 0; i < it->chunks.size(); ++i) {
        o.reqs.emplace_back();
        MPI_Irecv(o.segs[i].raw_data(), static_cast<int>(it->chunks[i]), MPI_BYTE, it->source, it->tag, comm,
                  &o.reqs.back());
      }
      orphans.push_back(std::move(o));
      it = owed.erase(it);
    }
    return all;
  }

  /// A message whose tensors cannot be received here ("tensors " + why): a reply fails its call
  /// now (unless abandoned), a request is answered with the error, the driver's end of a run
  /// is an error on this rank. Called with mu held.
  /// `malformed`: the whole message was dropped as malformed (`why` says how); a reply then
  /// fails its call with a RemoteError.
  void fail_incoming(Incoming&& in, Call::Failure kind, const std::string& why, bool malformed = false) {
    in.segs.clear();
    if (is_reply(in.kind)) {
      reqs_done.fetch_add(1);  // answered, though its tensors could not be received
      auto it = pending.find(in.id);
      if (it == pending.end()) return;
      auto c = it->second;
      pending.erase(it);
      if (c->abandoned) return;
      c->failure = malformed ? Call::f_remote : kind;
      c->failed = malformed ? concat("its reply arrived malformed on rank ", rank, " and was dropped (", why, ")")
                            : concat("remote call of '", c->fn, "' on rank ", c->rank, ": the reply's tensors ", why);
      c->done = true;
    } else if (in.kind == k_req) {
      in.failed = malformed ? concat("the call arrived malformed on rank ", rank, " and was dropped (", why, ")")
                            : "the call's tensors " + why;
      enqueue(std::move(in));
    } else if (in.kind == k_stop_ok || in.kind == k_stop_err) {
      in.failed = malformed ? concat("the driver's end of run arrived malformed on rank ", rank, " (", why, ")")
                            : "the tensors of the driver's result " + why;
      in.fail_kind = kind;
      stops[in.run] = std::move(in);
    }
    cv.notify_all();
  }

  /// A message that failed on this rank (fail_incoming), or, for a request or the driver's end
  /// of a run while an earlier one from the same rank is still arriving, parked behind it in
  /// `arriving` with its failure, to be failed in its turn (advance_arrivals): one rank's
  /// calls start in the order it sent them, failed or not (a failed request, or an end of run,
  /// used to overtake a request still arriving). Called with poll_mu held.
  void fail_or_park(Incoming&& in, Call::Failure kind, const std::string& why, bool malformed = false) {
    if (!may_deliver(in.source, in.kind)) {
      Arrival a;
      a.in = std::move(in);
      a.failed = why;
      a.fail_kind = kind;
      a.malformed = malformed;
      a.deadline = Clock::time_point::max();
      arriving.push_back(std::move(a));
      return;
    }
    std::lock_guard lk(mu);
    fail_incoming(std::move(in), kind, why, malformed);
  }

  /// A message from a Lockstep sender (its magic is right) dropped as malformed: what its head
  /// says it was is answered as such (fail_incoming). Called with poll_mu held.
  void drop_malformed(Incoming&& in, const Head& h, const std::string& why) {
    in.kind = static_cast<Kind>(h.kind);
    in.id = h.id;
    in.run = h.run;
    if (!is_reply(in.kind) && in.kind != k_req && in.kind != k_stop_ok && in.kind != k_stop_err) return;
    if (in.source < 0 || in.source >= size) return;
    in.buf.clear();
    in.plen = 0;
    fail_or_park(std::move(in), Call::f_error, why, /*malformed=*/true);
  }

  void receive(MPI_Message& msg, MPI_Status& st) {
    int n = 0;
    MPI_Get_count(&st, MPI_BYTE, &n);
    Incoming in;
    in.source = st.MPI_SOURCE;
    in.buf.resize(static_cast<std::size_t>(n));
    MPI_Mrecv(in.buf.data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
    Head h{};
    if (static_cast<std::size_t>(n) < kHead) {
      std::cerr << "lockstep remote: dropped a short message from rank " << in.source << rank_suffix() << "\n";
      return;
    }
    std::memcpy(&h, in.buf.data(), kHead);
    if (h.magic != kMagic) {
      std::cerr << "lockstep remote: dropped a malformed message from rank " << in.source << rank_suffix() << "\n";
      return;
    }
    if (kHead + h.payload_len + h.name_len + h.table_len != static_cast<std::size_t>(n)) {
      // Lockstep's header, lengths that do not add up: the message is dropped, but what it was
      // is known, and it is answered as such (a reply dropped uncounted used to leave its
      // caller waiting for its deadline, and the closing rounds, which wait until every call
      // is answered, for ever).
      std::cerr << "lockstep remote: dropped a malformed message from rank " << in.source << rank_suffix() << "\n";
      drop_malformed(std::move(in), h, concat(n, " bytes where its header announces ",
                                              kHead + h.payload_len + h.name_len + h.table_len));
      return;
    }
    {
      std::lock_guard lk(mu);
      if (in.source >= 0 && in.source < size) last_heard[static_cast<std::size_t>(in.source)] = Clock::now();
    }
    in.kind = static_cast<Kind>(h.kind);
    if (in.kind == k_heartbeat) return;
    if (in.kind == k_closing || in.kind == k_left) {
      if (in.source >= 0 && in.source < size) {
        auto& v = in.kind == k_closing ? closing_ranks : left_ranks;
        v[static_cast<std::size_t>(in.source)] = 1;
        if (in.kind == k_left) {
          a_rank_left = true;
          on_rank_left(in.source);
        }
        next_hb = Clock::now();  // a first heartbeat now
      }
      cv.notify_all();
      return;
    }
    in.id = h.id;
    in.run = h.run;
    in.plen = h.payload_len;
    std::string name(reinterpret_cast<const char*>(in.buf.data() + kHead + h.payload_len), h.name_len);
    if (auto z = name.find('\0'); z != std::string::npos) {
      in.sig = name.substr(z + 1);
      name.resize(z);
    }
    in.name = std::move(name);
    const bool reply = is_reply(in.kind);
    const int dtag = data_tag(in.id, reply);
    // The tensor table.
    std::vector<std::pair<Shape, DType>> table;
    std::vector<std::size_t> seg_bytes;
    {
      const std::byte* t = in.buf.data() + kHead + h.payload_len + h.name_len;
      const std::byte* tend = t + h.table_len;
      for (std::uint32_t i = 0; i < h.nseg; ++i) {
        const bool fits = tend - t >= 2;
        const auto dt = fits ? static_cast<std::uint8_t>(t[0]) : 0;
        const auto nd = fits ? static_cast<std::uint8_t>(t[1]) : 0;
        if (!fits || dt > static_cast<std::uint8_t>(DType::u8) || tend - t - 2 < 8 * nd) {
          // Not from a Lockstep sender of this version: its tensor messages (if any) cannot be
          // counted, and stay unreceived.
          std::cerr << "lockstep remote: dropped a message with a bad tensor table from rank " << in.source
                    << rank_suffix() << "\n";
          drop_malformed(std::move(in), h, "a bad tensor table");
          return;
        }
        t += 2;
        Shape shape(nd);
        std::memcpy(shape.data(), t, 8 * nd);
        t += 8 * nd;
        seg_bytes.push_back(nbytes_of(numel_of(shape), static_cast<DType>(dt)));
        table.emplace_back(std::move(shape), static_cast<DType>(dt));
      }
    }
    // What is owed on this source and tag is received first (its receives posted before this
    // message's, so that it matches them).
    std::string no_memory;
    if (!table.empty()) {
      std::lock_guard lk(mu);
      if (!owed.empty() && !take_owed(in.source, dtag))
        no_memory = "memory for the earlier tensors of that rank owed on the same tag";
    }
    // The tensors' memory (the receive cache's buffers for large ones).
    for (auto& [shape, dt] : table) {
      if (!no_memory.empty()) break;
      try {
        if (test_hooks().fail_allocations.load() > 0 && test_hooks().fail_allocations.fetch_sub(1) > 0)
          throw Error(concat("remote: out of memory (refused by a test hook) for a received ", lockstep::name(dt),
                             " tensor of shape ", lockstep::to_string(shape)));
        in.segs.push_back(cache->take(shape, dt));
      } catch (const std::exception& x) {
        no_memory = x.what();
        break;
      }
    }
    if (!no_memory.empty()) {
      in.segs.clear();
      std::cerr << "lockstep remote: cannot receive the tensors of a message from rank " << in.source << ": "
                << no_memory << rank_suffix() << "\n";
      {
        std::lock_guard lk(mu);
        owe(in.source, dtag, seg_bytes);
      }
      fail_or_park(std::move(in), Call::f_error, concat("cannot be received on rank ", rank, ": ", no_memory));
      return;
    }
    // The tensors themselves, straight into their memory. The receives are posted and the
    // pass goes on: later passes finish them (advance_arrivals), so that a thread in a pass
    // never waits for another message's tensors.
    Arrival a;
    for (auto& seg : in.segs) {
      auto* p = static_cast<char*>(seg.raw_data());
      for (std::size_t off = 0; off < seg.nbytes(); off += kChunk) {
        const auto c = std::min(kChunk, seg.nbytes() - off);
        a.reqs.emplace_back();
        a.sizes.push_back(static_cast<int>(c));
        MPI_Irecv(p + off, static_cast<int>(c), MPI_BYTE, in.source, dtag, comm, &a.reqs.back());
      }
    }
    if (a.reqs.empty() && may_deliver(in.source, in.kind)) {  // nothing to wait for
      std::lock_guard lk(mu);
      deliver(std::move(in));
      return;
    }
    a.in = std::move(in);
    a.sts.resize(a.reqs.size());
    a.deadline = deadline_after(data_timeout);
    arriving.push_back(std::move(a));
  }

  /// Rank `r` left the session: it answers nothing more. Its calls still pending here fail now
  /// with a TimeoutError naming it (they used to wait for their deadline, 600 s by default), later
  /// calls to it fail at once (start_call), and a serving rank whose driver left stops serving.
  void on_rank_left(int r) {
    {
      std::lock_guard lk(mu);
      gone[static_cast<std::size_t>(r)] = 1;
      for (auto it = pending.begin(); it != pending.end();) {
        auto c = it->second;
        if (c->rank != r) {
          ++it;
          continue;
        }
        it = pending.erase(it);  // a late reply is dropped (deliver finds no call)
        if (c->abandoned) continue;
        c->failure = Call::f_timeout;
        c->failed = left_text(r, c->fn);
        c->done = true;
      }
    }
    if (r == 0 && rank != 0) driver_left = true;
    cv.notify_all();
  }

  static std::string left_text(int r, const std::string& fn) {
    return concat("remote call of '", fn, "' on rank ", r, ": rank ", r,
                  " left the remote session before answering (it finalised Lockstep, or returned from main, with the "
                  "session open, or closed it without waiting)");
  }

  /// Queues a request to run. Called with mu held.
  void enqueue(Incoming&& in) {
    if (in.source == 0) ++driver_reqs_queued;
    queue.push_back(std::move(in));
  }

  /// Hands a message whose tensors have all arrived to whoever waits for it. Called with mu
  /// held.
  void deliver(Incoming&& in) {
    if (in.kind == k_req) {
      enqueue(std::move(in));
    } else if (is_reply(in.kind)) {
      reqs_done.fetch_add(1);  // its call is answered (close_rounds)
      auto it = pending.find(in.id);
      if (it == pending.end()) return;  // not ours (cannot happen) or already closed
      auto c = it->second;
      pending.erase(it);
      if (c->abandoned) return;  // timed out or dropped: discard
      c->kind = in.kind;
      c->buf = std::move(in.buf);
      c->poff = kHead;
      c->plen = in.plen;
      c->segs = std::move(in.segs);
      c->done = true;
    } else if (in.kind == k_stop_ok || in.kind == k_stop_err) {
      stops[in.run] = std::move(in);
    }
    cv.notify_all();
  }

  /// Finishes the messages whose tensors are arriving: each is failed when its tensors did not
  /// all come within the data deadline, and delivered once they are in, a reply at once (it is
  /// matched by its call), a request or the end of a run only after every earlier one from the
  /// same rank (one rank's calls start in the order it sent them). True when one was finished.
  /// Called with poll_mu held.
  bool advance_arrivals() {
    bool did = false;
    std::vector<int> held;  // ranks with an earlier request or end of run still arriving
    for (auto it = arriving.begin(); it != arriving.end();) {
      Arrival& a = *it;
      Incoming& in = a.in;
      const bool ordered = !is_reply(in.kind);
      if (!a.reqs.empty()) {
        auto& sts = a.sts;
        int flag = 0;
        LOCKSTEP_MPI_CHECK(MPI_Testall(static_cast<int>(a.reqs.size()), a.reqs.data(), &flag, sts.data()));
        std::string failed;
        Call::Failure kind = Call::f_error;
        if (flag) {
          for (std::size_t i = 0; i < sts.size() && failed.empty(); ++i) {
            int got = 0;
            MPI_Get_count(&sts[i], MPI_BYTE, &got);
            if (got == a.sizes[i]) continue;  // every byte of a received tensor comes from the sender
            std::cerr << "lockstep remote: dropped a message from rank " << in.source << " whose tensor data was "
                      << got << " bytes where " << a.sizes[i] << " were announced" << rank_suffix() << "\n";
            failed = concat("arrived on rank ", rank, " with ", got, " bytes where ", a.sizes[i], " were announced");
          }
          a.reqs.clear();
        } else if (Clock::now() >= a.deadline) {
          std::cerr << "lockstep remote: the tensors of a message from rank " << in.source
                    << " did not arrive within " << data_timeout << " s" << rank_suffix() << "\n";
          kind = Call::f_timeout;
          failed = concat("did not arrive on rank ", rank, " within ", data_timeout, " s");
        } else {
          if (ordered) held.push_back(in.source);
          ++it;
          continue;
        }
        if (!failed.empty()) {
          std::lock_guard lk(mu);
          // Receives given up on stay posted, their memory with them, until the late data
          // arrives: a tensor message left unreceived would be taken by a later receive with the
          // same tag.
          if (!a.reqs.empty()) orphans.push_back(Orphan{std::move(a.reqs), Encoder(), std::move(in.segs), true});
          a.reqs.clear();
          in.segs.clear();
          a.failed = failed;
          a.fail_kind = kind;
          did = true;
        }
      }
      // Failed or complete, a request or an end of run waits for the earlier ones from its
      // rank (the held check comes before the failure is handed on: a failure must not
      // overtake either).
      if (ordered && std::find(held.begin(), held.end(), in.source) != held.end()) {
        ++it;
        continue;
      }
      {
        std::lock_guard lk(mu);
        if (!a.failed.empty()) fail_incoming(std::move(in), a.fail_kind, a.failed, a.malformed);
        else deliver(std::move(in));
      }
      it = arriving.erase(it);
      did = true;
    }
    return did;
  }

  /// Whether a message from `source` of kind `kind`, its tensors in, may be delivered now: a
  /// reply always, a request or the end of a run when no earlier one from that rank is arriving.
  bool may_deliver(int source, Kind kind) const {
    if (is_reply(kind)) return true;
    return std::none_of(arriving.begin(), arriving.end(),
                        [&](const Arrival& a) { return a.in.source == source && !is_reply(a.in.kind); });
  }

  /// One look at each tag (one message each at most). `ctrl_empty`: no control message (the
  /// driver's heartbeats and end of run) was waiting.
  /// `before_receive` (when given) runs before each message found is received.
  bool poll_once(bool* ctrl_empty = nullptr, const std::function<void()>* before_receive = nullptr) {
    bool did = false;
    for (int tag : {kTagReq, kTagRep, kTagCtrl}) {
      int flag = 0;
      MPI_Message msg;
      MPI_Status st;
      MPI_Improbe(MPI_ANY_SOURCE, tag, comm, &flag, &msg, &st);
      if (flag) {
        if (before_receive != nullptr) (*before_receive)();
        receive(msg, st);
        did = true;
      }
      if (tag == kTagCtrl && ctrl_empty != nullptr) *ctrl_empty = !flag;
    }
    return did;
  }

  void housekeeping() {
    if (!hb_reqs.empty()) {
      int flag = 0;
      MPI_Testall(static_cast<int>(hb_reqs.size()), hb_reqs.data(), &flag, MPI_STATUSES_IGNORE);
      if (flag) hb_reqs.clear();
    }
    // Heartbeats: from the driver to every rank while it drives, and from every rank to the
    // ranks closing the session (they wait for the others while serving).
    if (!hb_over && hb_reqs.empty() && Clock::now() >= next_hb) {
      const bool drive = driving.load();
      for (int r = 0; r < size; ++r) {
        const auto i = static_cast<std::size_t>(r);
        if (r == rank || left_ranks[i] || !((drive && r != 0) || closing_ranks[i])) continue;
        hb_reqs.emplace_back();
        MPI_Isend(&heartbeat_head(), static_cast<int>(kHead), MPI_BYTE, r, kTagCtrl, comm, &hb_reqs.back());
      }
      const double every = timeout > 0 ? std::clamp(timeout / 5, 0.02, 1.0) : 1.0;
      next_hb = deadline_after(every);
    }
    std::lock_guard lk(mu);
    for (auto it = orphans.begin(); it != orphans.end();) {
      int flag = 0;
      MPI_Testall(static_cast<int>(it->reqs.size()), it->reqs.data(), &flag, MPI_STATUSES_IGNORE);
      it = flag ? orphans.erase(it) : it + 1;
    }
    if (!owed.empty() && Clock::now() >= next_owed_try) {
      (void)take_owed();
      next_owed_try = Clock::now() + std::chrono::milliseconds(100);
    }
  }

  /// One pass over the incoming messages and the housekeeping. Called with poll_mu held.
  bool pass(const std::function<void()>* before_receive = nullptr) {
    const auto start = Clock::now();
    bool ctrl_empty = false;
    bool did = poll_once(&ctrl_empty, before_receive);
    ctrl_looks.saw(ctrl_empty, start);
    did = advance_arrivals() || did;
    housekeeping();
    return did;
  }

  /// A pass, if no other thread is in one: 1 when it received something, 0 when not, -1 when
  /// another thread was in a pass. An error is reported and taken for activity.
  int try_pass(const std::function<void()>* before_receive = nullptr) {
    std::unique_lock pl(poll_mu, std::try_to_lock);
    if (!pl.owns_lock() || passes_over) return -1;
    try {
      return pass(before_receive) ? 1 : 0;
    } catch (const std::exception& x) {
      std::cerr << "lockstep remote: receiving: " << x.what() << "\n";
      return 1;
    }
  }

  /// Adds `by` to the waiters for its scope: +1 marks this thread as one that waits and takes
  /// the passes itself (the progress thread rests), -1 a waiting thread that runs a call.
  struct Waiting {
    Engine& e;
    int by;
    explicit Waiting(Engine& en, int b = 1) : e(en), by(b) { e.waiters.fetch_add(by); }
    ~Waiting() { e.waiters.fetch_sub(by); }
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;
  };

  /// wait_requests, taking the passes meanwhile: a message this rank sends to itself, or whose
  /// receiver waits for this rank's reply first, still completes.
  bool wait_polling(std::vector<MPI_Request>& reqs, Clock::time_point deadline,
                    const std::function<void()>* before_receive = nullptr) {
    Waiting w(*this);
    return wait_requests(reqs, deadline, nullptr, [&] { return try_pass(before_receive) == 1; });
  }

  /// One step of a thread that waits, with mu held (by lk), for what a message brings: runs a
  /// queued call when `may_run`; otherwise takes a pass itself or, when another thread is
  /// in one, waits on cv (which every received message notifies) until `until` at most.
  /// `active`: when this thread last saw something happen (for the backoff). The caller holds
  /// a Waiting for the whole wait.
  void wait_step(std::unique_lock<std::mutex>& lk, Clock::time_point& active, Clock::time_point until,
                 bool may_run) {
    if (may_run && !queue.empty()) {
      Incoming in = std::move(queue.front());
      queue.pop_front();
      lk.unlock();
      {
        Waiting running(*this, -1);  // the rank's code runs: the progress thread takes the passes
        execute(in);
      }
      lk.lock();
      active = Clock::now();
      return;
    }
    lk.unlock();
    const int r = try_pass();
    if (r == 1) active = Clock::now();
    else if (r == 0) backoff(active);
    lk.lock();
    if (r < 0) cv.wait_until(lk, std::min(until, Clock::now() + std::chrono::milliseconds(1)));
  }

  void progress_loop() {
    auto active = Clock::now();
    while (!stop_progress.load()) {
      if (waiters.load() > 0) {
        // A waiting thread takes the passes. A long nap: each wake-up of this thread takes a
        // core from the polling one where the rank's threads share cores (at 100 µs naps, the
        // round trip of a 64 KiB call varied 2x between runs).
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        active = Clock::now() - std::chrono::milliseconds(2);  // then no busy yielding
        continue;
      }
      if (try_pass() == 1) active = Clock::now();
      else backoff(active);
    }
    // Whatever arrived meanwhile (late replies of abandoned calls) is received and dropped;
    // tensors still arriving get at most a second more (then their receives are left to
    // settle_orphans, which cancels them). Not once MPI is finalised (see ~Engine).
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return;
    std::lock_guard pl(poll_mu);
    for (int i = 0; i < 3; ++i)
      while (poll_once()) {}
    const auto until = Clock::now() + std::chrono::seconds(1);
    while (!arriving.empty() && Clock::now() < until)
      if (!advance_arrivals()) std::this_thread::yield();
    orphan_arrivals();
  }

  /// The receives of messages still arriving become orphans (settle_orphans cancels them), with
  /// the memory they write into. Called with poll_mu held, when no more passes follow.
  void orphan_arrivals() {
    std::lock_guard lk(mu);
    for (auto& a : arriving)
      if (!a.reqs.empty()) orphans.push_back(Orphan{std::move(a.reqs), Encoder(), std::move(a.in.segs), true});
    arriving.clear();
  }

  // ---- running calls ----
  void execute(Incoming& in) {
    Encoder out;
    Kind k = k_rep_ok;
    auto fail = [&](std::uint8_t code, const std::string& msg) {
      out = Encoder();
      out.u8(code);
      encode(out, msg);
      k = k_rep_err;
    };
    auto info = find_by_name(in.name);
    t_reply_tensor_delay = 0;
    if (!in.failed.empty()) {
      fail(5, in.failed);
    } else if (!info) {
      fail(2, concat("'", in.name, "' is not registered on rank ", rank,
                     " (that rank runs other code, or did not register it)"));
    } else if (info->sig != in.sig) {
      fail(3, concat("'", in.name, "' is registered on rank ", rank, " with another signature (",
                     info->sig, " there, ", in.sig, " at the caller)"));
    } else {
      try {
        Decoder d(in.buf.data() + in.poff, in.plen, &in.segs);
        struct Running {
          Running() { ++t_running_calls; }
          ~Running() { --t_running_calls; }
        } running;
        info->invoke(info->fn, d, out);
      } catch (const DecodeError& x) {
        fail(4, concat("the arguments do not decode on rank ", rank, ": ", x.what()));
      } catch (const std::exception& x) {
        fail(1, x.what());
      } catch (...) {
        fail(1, "an exception that is not a std::exception");
      }
    }
    in.segs.clear();  // what the function did not take is let go before the reply is sent
    const double delay = t_reply_tensor_delay;
    t_reply_tensor_delay = 0;
    bool posted = false;
    try {
      send({in.source}, kTagRep, k, in.id, 0, std::string(), out, deadline_after(timeout), timeout,
           concat("the reply to rank ", in.source), delay, &posted);
    } catch (const std::exception& x) {
      std::cerr << "lockstep remote: the reply to rank " << in.source << " was not sent: " << x.what() << "\n";
      if (!posted) {
        // The caller gets the reason instead of waiting for its deadline.
        Encoder err;
        err.u8(1);
        encode(err, concat("the reply could not be sent from rank ", rank, ": ", x.what()));
        try {
          send({in.source}, kTagRep, k_rep_err, in.id, 0, std::string(), err, deadline_after(timeout), timeout,
               concat("the error reply to rank ", in.source), 0, &posted);
        } catch (const std::exception&) {
        }
      }
    }
    if (in.kind == k_req) {
      // A reply posted is counted as answered where it is received; one that could not be
      // posted is counted here (no reply will come).
      if (!posted) reqs_done.fetch_add(1);
      if (in.source == 0) {
        std::lock_guard lk(mu);
        ++driver_reqs_done;
      }
    }
  }

  bool can_help() const { return !opts.background || std::this_thread::get_id() == executor_id; }

  void executor_loop() {
    std::unique_lock lk(mu);
    executor_id = std::this_thread::get_id();  // read under mu (can_help)
    while (true) {
      cv.wait_for(lk, std::chrono::milliseconds(100), [&] { return closing || !queue.empty(); });
      if (closing) break;
      if (queue.empty()) continue;
      Incoming in = std::move(queue.front());
      queue.pop_front();
      lk.unlock();
      execute(in);
      lk.lock();
    }
  }
};

namespace {

std::mutex g_mu;
std::map<const Backend*, std::shared_ptr<Engine>> g_engines;

std::shared_ptr<Engine> find_engine(const Backend& b) {
  std::lock_guard lk(g_mu);
  auto it = g_engines.find(&b);
  return it == g_engines.end() ? nullptr : it->second;
}

std::shared_ptr<Engine> engine_of(const Backend& b) {
  auto e = find_engine(b);
  LOCKSTEP_CHECK_ARG(e != nullptr,
                     "remote call without a remote session on this backend: call it inside "
                     "ls::run_driver (or ls::serve), or create an ls::RemoteSession");
  return e;
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "an unknown thread level";
  }
}

/// Memory that a collective given up on may still use (MPI may write into it when the late
/// ranks arrive): kept, reachable, for the life of the process.
std::mutex g_kept_mu;
std::vector<std::shared_ptr<void>>* g_kept = nullptr;
void keep_for_ever(std::shared_ptr<void> p) {
  std::lock_guard lk(g_kept_mu);
  if (g_kept == nullptr) g_kept = new std::vector<std::shared_ptr<void>>();
  g_kept->push_back(std::move(p));
}

/// Iallgather of n bytes per rank over comm, within the deadline; `meanwhile` as in
/// wait_requests. The buffers are the heap's, and kept for ever when the deadline passes.
template <class Meanwhile>
std::vector<std::byte> agree(MPI_Comm comm, int size, const void* mine, int n, double timeout, const char* what,
                             Meanwhile&& meanwhile) {
  const auto un = static_cast<std::size_t>(n);
  auto buf = std::make_shared<std::vector<std::byte>>(un * (static_cast<std::size_t>(size) + 1));
  std::memcpy(buf->data(), mine, un);
  MPI_Request r;
  LOCKSTEP_MPI_CHECK(MPI_Iallgather(buf->data(), n, MPI_BYTE, buf->data() + un, n, MPI_BYTE, comm, &r));
  std::vector<MPI_Request> reqs{r};
  if (!wait_requests(reqs, deadline_after(timeout), nullptr, meanwhile)) {
    keep_for_ever(buf);
    throw TimeoutError(concat(what, ": not every rank joined within ", timeout, " s", rank_suffix()));
  }
  return std::vector<std::byte>(buf->begin() + static_cast<std::ptrdiff_t>(un), buf->end());
}
std::vector<std::byte> agree(MPI_Comm comm, int size, const void* mine, int n, double timeout, const char* what) {
  return agree(comm, size, mine, n, timeout, what, [] { return false; });
}

void close_engine(const std::shared_ptr<Engine>& e, bool quiet, double wait = -1);

/// finalize<MPIBackend>() with sessions still open (on the backend that goes, or on any backend
/// when MPI ends with it): each is left as a rank that took another for silent leaves it, that
/// is, the others are told (k_left: their calls to this rank, and a serving rank's wait for its
/// driver, end in a TimeoutError at once), the first closing round is waited for at most a
/// second, the progress and background threads stop, and this rank's calls still pending fail.
/// Before, the session's progress thread went on calling MPI through MPI_Finalize, heartbeats
/// kept the others from ever taking this rank for silent, and the process ended in
/// std::terminate (a joinable thread in the static table of sessions) and MPI_Abort.
void end_sessions_at_finalize(const Backend* going, bool mpi_ends) {
  std::vector<std::shared_ptr<Engine>> open;
  {
    std::lock_guard lk(g_mu);
    for (auto& [b, e] : g_engines)
      if (mpi_ends || b == going) open.push_back(e);
  }
  for (auto& e : open) {
    std::cerr << "lockstep remote: finalize with a remote session still open: this rank leaves it (the other ranks' "
                 "calls to it end in a TimeoutError)"
              << rank_suffix() << "\n";
    try {
      close_engine(e, /*quiet=*/true, e->timeout > 0 ? std::min(e->timeout, 1.0) : 1.0);
    } catch (const std::exception& x) {
      std::cerr << "lockstep remote: leaving the session at finalize: " << x.what() << "\n";
    }
  }
}

std::shared_ptr<Engine> create_engine(Backend& b, const RemoteOptions& o) {
  lockstep::detail::at_finalize(&g_engines, end_sessions_at_finalize);
  int init = 0;
  MPI_Initialized(&init);
  if (!init) throw Error("remote calls need MPI: call lockstep::initialize<MPIBackend>() first");
  // The thread level is checked after the ranks have agreed on it (below), so that a rank whose
  // MPI was started with another level than the others' cannot leave them waiting: until the
  // progress thread starts, this thread alone calls MPI, which every level allows.
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  LOCKSTEP_CHECK_ARG(find_engine(b) == nullptr, "this backend already has a remote session");
  MPI_Comm base = MPI_COMM_WORLD;
  if (auto* m = dynamic_cast<MPIBackend*>(&b)) {
    base = m->comm();
  } else {
    int wr = 0, ws = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    MPI_Comm_size(MPI_COMM_WORLD, &ws);
    LOCKSTEP_CHECK_ARG(wr == b.rank() && ws == b.size(),
                       "remote calls over a backend that is not an MPIBackend need its ranks to be "
                       "those of MPI_COMM_WORLD");
  }
  auto e = std::make_shared<Engine>();
  e->backend = &b;
  e->opts = o;
  e->timeout = resolve_timeout(o.timeout);
  MPI_Request r;
  LOCKSTEP_MPI_CHECK(MPI_Comm_idup(base, &e->comm, &r));
  std::vector<MPI_Request> reqs{r};
  if (!wait_requests(reqs, deadline_after(e->timeout))) {
    keep_for_ever(e);  // MPI may still write the new communicator into it
    throw TimeoutError(concat("RemoteSession: not every rank created the session within ", e->timeout, " s", rank_suffix()));
  }
  MPI_Comm_set_errhandler(e->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(e->comm, &e->rank);
  MPI_Comm_size(e->comm, &e->size);
  void* ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(e->comm, MPI_TAG_UB, &ub, &flag);
  if (flag && ub != nullptr) e->tag_span = *static_cast<int*>(ub) - kDataBase;
  if (const int hook = test_hooks().tag_span.load(); hook > 0) e->tag_span = std::min(e->tag_span, std::max(hook, 2));
  const double dt_hook = test_hooks().data_timeout.load();
  e->data_timeout = dt_hook >= 0 ? dt_hook : e->timeout;
  // The settings must agree (and the data tags: every rank computes the tags of the others).
  struct Mine {
    double timeout;
    std::int32_t background;
    std::int32_t level;
    std::int32_t tag_span;
    std::int32_t pad;
  } mine{e->timeout, o.background ? 1 : 0, level, e->tag_span, 0};
  std::vector<std::byte> all;
  try {
    all = agree(e->comm, e->size, &mine, sizeof mine, e->timeout, "RemoteSession");
  } catch (...) {
    MPI_Comm_free(&e->comm);
    throw;
  }
  std::vector<Mine> ms(static_cast<std::size_t>(e->size));
  std::memcpy(ms.data(), all.data(), all.size());
  // Every rank needs MPI_THREAD_MULTIPLE: the progress thread receives while the rank's own
  // threads run (and, with background serving, while its own code is inside MPI). The same
  // error on every rank, naming the ranks that lack it.
  std::map<int, std::vector<int>> short_of;  // level -> ranks
  for (int i = 0; i < e->size; ++i)
    if (ms[i].level != MPI_THREAD_MULTIPLE) short_of[ms[i].level].push_back(i);
  if (!short_of.empty()) {
    std::string where;
    for (const auto& [lv, ranks] : short_of) {
      where += concat(where.empty() ? "" : ", ", thread_level_name(lv), " on rank", ranks.size() > 1 ? "s" : "");
      for (std::size_t i = 0; i < ranks.size() && i < 8; ++i) where += concat(i ? ", " : " ", ranks[i]);
      if (ranks.size() > 8) where += concat(", ... (", ranks.size(), " ranks)");
    }
    MPI_Comm_free(&e->comm);
    throw Error(concat(
        o.background ? "background serving (RemoteOptions::background: calls run on a thread of their own while this "
                       "rank's code, collectives included, goes on)"
                     : "remote calls (a RemoteSession, run_driver, serve)",
        o.background ? " needs" : " need", " MPI_THREAD_MULTIPLE on every rank, and MPI was started with ", where,
        ": no remote-call mode works without it (a session's progress thread calls MPI beside the rank's own "
        "threads). Let lockstep::initialize<MPIBackend>() start MPI, or start it with "
        "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)",
        rank_suffix()));
  }
  const Mine& first = ms[0];
  std::string diff;
  bool same = true;
  for (int i = 0; i < e->size; ++i) {
    const Mine& m = ms[static_cast<std::size_t>(i)];
    diff += concat(i ? ", " : "", "rank ", i, ": timeout ", m.timeout, " s, background ", m.background ? "on" : "off");
    if (m.tag_span != first.tag_span) diff += concat(", ", m.tag_span, " data tags");
    if (m.timeout != first.timeout || m.background != first.background || m.tag_span != first.tag_span) {
      same = false;
      diff += " (differs)";
    }
  }
  if (!same) {
    MPI_Comm_free(&e->comm);
    throw MismatchError(concat("RemoteSession: the ranks' options differ (", diff, ")"));
  }
  e->cache = std::make_shared<RecvCache>(o.receive_cache_bytes);
  e->last_heard.assign(static_cast<std::size_t>(e->size), Clock::now());
  e->closing_ranks.assign(static_cast<std::size_t>(e->size), 0);
  e->left_ranks.assign(static_cast<std::size_t>(e->size), 0);
  e->gone.assign(static_cast<std::size_t>(e->size), 0);
  e->progress = std::thread([p = e.get()] { p->progress_loop(); });
  if (o.background) {
    e->executor = std::thread([p = e.get()] { p->executor_loop(); });
  }
  std::lock_guard lk(g_mu);
  g_engines[&b] = e;
  return e;
}

/// Requests still pending when their session ended: never completed, so their memory is never
/// freed (MPI may still write or read it).
std::mutex g_leaked_mu;
std::vector<Engine::Orphan>* g_leaked = nullptr;

/// After the progress thread ended: the receives given up on are cancelled (no later message
/// can be received on this communicator any more), then everything given up on is waited for
/// (for at most a second); what is still pending then keeps its memory for ever.
void settle_orphans(Engine& e) {
  std::lock_guard lk(e.mu);
  for (auto& o : e.orphans)
    if (o.receives)
      for (auto& r : o.reqs)
        if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
  const auto until = Clock::now() + std::chrono::seconds(1);
  while (true) {
    for (auto it = e.orphans.begin(); it != e.orphans.end();) {
      int flag = 0;
      MPI_Testall(static_cast<int>(it->reqs.size()), it->reqs.data(), &flag, MPI_STATUSES_IGNORE);
      it = flag ? e.orphans.erase(it) : it + 1;
    }
    if (e.orphans.empty() || Clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!e.orphans.empty()) {
    std::lock_guard lk2(g_leaked_mu);
    if (g_leaked == nullptr) g_leaked = new std::vector<Engine::Orphan>();
    for (auto& o : e.orphans) g_leaked->push_back(std::move(o));
    e.orphans.clear();
  }
  e.owed.clear();  // the communicator ends: nothing can take them any more
}

/// The rank (other than this one; ranks that left count too: their round-0 part may never come)
/// that this rank has heard nothing
/// from for the session's timeout since `since`, or -1. As for the driver's silence, the looks
/// of the passes decide, not the clock alone (see LookWatch). Called with e.mu held.
int silent_rank(const Engine& e, Clock::time_point since) {
  if (e.timeout <= 0) return -1;
  const auto span = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(e.timeout));
  const Clock::time_point looked = e.ctrl_looks.through();
  for (int r = 0; r < e.size; ++r)
    if (r != e.rank && looked >= std::max(e.last_heard[static_cast<std::size_t>(r)], since) + span) return r;
  return -1;
}

/// Tells every other rank, without waiting long, that this rank is closing (k_closing) or left
/// (k_left). Errors are printed, not thrown: a rank that cannot be told times out by itself.
void tell_others(Engine& e, Kind kind) {
  if (e.size < 2) return;
  std::vector<int> dests;
  for (int r = 0; r < e.size; ++r)
    if (r != e.rank) dests.push_back(r);
  Encoder m;
  const double wait = e.timeout > 0 ? std::min(e.timeout, 1.0) : 1.0;
  try {
    e.send(dests, kTagCtrl, kind, e.next_id.fetch_add(1), 0, std::string(), m, deadline_after(wait), wait,
           "closing the remote session");
  } catch (const std::exception& x) {
    std::cerr << "lockstep remote: " << x.what() << "\n";
  }
}

/// Buffers of a collective that may never complete (a rank gave up waiting for it): kept for
/// the life of the process, since MPI may still write into them.
void leak_wave(std::array<std::uint64_t, 6>* w) { keep_for_ever(std::shared_ptr<void>(w, [](void* p) { delete static_cast<std::array<std::uint64_t, 6>*>(p); })); }

/// How a session is closed, on every rank in rounds of one allreduce of [left, requests posted,
/// requests answered] over the session's communicator (a rank that leaves takes part in the
/// first only).
///
/// Graceful (leave = false): this rank serves calls (runs them, or lets the background thread
/// run them) while it waits, until every rank is closing and every request posted on the
/// session has been answered; so no call still owed is dropped, whichever rank closes first.
/// The rounds end when the requests posted in one equal those answered in the round before:
/// every request posted by then had been answered before, and none can follow (Mattern's
/// four-counter method). Meanwhile every rank sends heartbeats to the closing ones (k_closing),
/// so that a rank that hears nothing from another for the session's timeout gives up. When a
/// rank left (its 1 in the first round's sum), the rounds end after the first.
///
/// Leaving (leave = true, after this rank took the driver for silent): the first round only,
/// waited for at most `wait` seconds without serving.
///
/// Returns "" when the rounds completed (the communicator may be freed), else why not.
std::string close_rounds(Engine& e, bool leave, double wait) {
  const auto since = Clock::now();
  e.driving = false;
  {
    std::lock_guard lk(e.mu);
    e.close_begun = true;
  }
  tell_others(e, leave ? k_left : k_closing);
  auto* wave = new std::array<std::uint64_t, 6>{};  // [left, posted, answered] in, their sums out
  std::uint64_t prev_sent = ~std::uint64_t{0}, prev_done = ~std::uint64_t{0};
  const auto deadline = deadline_after(wait);
  std::optional<Engine::Waiting> w;
  if (!leave) w.emplace(e);  // this thread takes the passes
  std::unique_lock lk(e.mu);
  auto active = Clock::now();
  for (int round = 0;; ++round) {
    (*wave)[0] = leave ? 1 : 0;
    (*wave)[1] = e.reqs_sent.load();
    (*wave)[2] = e.reqs_done.load();
    MPI_Request r = MPI_REQUEST_NULL;
    const int rc = MPI_Iallreduce(wave->data(), wave->data() + 3, 3, MPI_UINT64_T, MPI_SUM, e.comm, &r);
    if (rc != MPI_SUCCESS) {
      delete wave;
      return concat("MPI error ", rc, " in its allreduce");
    }
    while (true) {
      int flag = 0;
      if (const int trc = MPI_Test(&r, &flag, MPI_STATUS_IGNORE); trc != MPI_SUCCESS) {
        // (Ranks whose collectives on the session do not match: one closing while another is
        // in another collective of the session.)
        leak_wave(wave);
        return concat("its allreduce failed (MPI error ", trc,
                      "): the ranks were not all closing the session (another collective of it on some rank)");
      }
      if (flag) break;
      std::string why;
      if (leave) {
        if (Clock::now() >= deadline) why = concat("not every rank closed it within ", wait, " s");
      } else if (const int s = silent_rank(e, since); s >= 0) {
        why = concat("rank ", s, " sent nothing for ", e.timeout, " s while this rank waited for every rank to ",
                     "close it (rank ", s, " is stopped, hung, or never closes it)");
      } else if (round > 0 && e.a_rank_left.load()) {
        why = "a rank left it without waiting for the calls still owed (it took another rank for silent)";
      }
      if (!why.empty()) {
        leak_wave(wave);
        return why;
      }
      if (leave) {
        lk.unlock();
        backoff(active);
        lk.lock();
      } else {
        e.wait_step(lk, active, Clock::now() + std::chrono::milliseconds(50), e.can_help());
      }
    }
    if (leave || (*wave)[3] > 0) break;  // a rank left: no more rounds
    const std::uint64_t sent = (*wave)[4], done = (*wave)[5];
    if (sent == prev_done) {
      // Done on every rank. The heartbeats stop, and a last barrier makes sure that no rank
      // frees the communicator while another may still send one to it.
      delete wave;
      lk.unlock();
      {
        std::lock_guard pl(e.poll_mu);
        e.hb_over = true;
      }
      MPI_Request b = MPI_REQUEST_NULL;
      LOCKSTEP_MPI_CHECK(MPI_Ibarrier(e.comm, &b));
      std::vector<MPI_Request> reqs{b};
      if (!wait_requests(reqs, deadline_after(e.timeout), nullptr, [&] { return e.try_pass() == 1; }))
        return concat("not every rank reached its last barrier within ", e.timeout, " s");
      return std::string();
    }
    const bool moved = sent != prev_sent || done != prev_done;
    prev_sent = sent;
    prev_done = done;
    if (!moved && round > 0) {
      // A call still runs somewhere: serve a little before the next round instead of spinning.
      const auto until = Clock::now() + std::chrono::milliseconds(2);
      while (Clock::now() < until) e.wait_step(lk, active, until, e.can_help());
    }
  }
  delete wave;
  return std::string();
}

/// Collective: ends the session of e (close_rounds). With wait < 0 (the normal close) it is
/// graceful: this rank serves the calls still owed until every rank has closed. With wait >= 0
/// (a rank that took the driver for silent) it leaves, waiting at most `wait` seconds for the
/// others. Throws TimeoutError when the ranks did not all close in time (then the communicator
/// is left allocated), or prints it if quiet.
void close_engine(const std::shared_ptr<Engine>& e, bool quiet, double wait) {
  // Once: a session that finalize ended (end_sessions_at_finalize) is still held by its
  // RemoteSession or run_driver, which close it again when they go.
  if (e->ended.exchange(true)) return;
  const bool leave = wait >= 0;
  std::string failed;
  try {
    failed = close_rounds(*e, leave, wait);
  } catch (const std::exception& x) {
    failed = x.what();
  }
  const bool ok = failed.empty();
  if (!ok && !leave) tell_others(*e, k_left);
  {
    std::lock_guard lk(g_mu);
    auto it = g_engines.find(e->backend);
    if (it != g_engines.end() && it->second == e) g_engines.erase(it);
  }
  {
    std::lock_guard lk(e->mu);
    e->closing = true;
  }
  e->cv.notify_all();
  if (e->executor.joinable()) e->executor.join();
  e->driving = false;
  {
    std::lock_guard pl(e->poll_mu);
    e->hb_over = true;
  }
  e->stop_progress = true;
  if (e->progress.joinable()) e->progress.join();
  {
    std::lock_guard pl(e->poll_mu);  // a thread still waiting takes no more passes
    e->passes_over = true;
    e->orphan_arrivals();  // what such a thread's last pass began to receive
  }
  settle_orphans(*e);
  {
    std::lock_guard lk(e->mu);
    for (auto& [id, c] : e->pending) {
      c->failure = Call::f_error;
      c->failed = concat("the remote session ended before rank ", c->rank, " answered the call of '", c->fn, "'");
      c->done = true;
    }
    e->pending.clear();
    e->queue.clear();
  }
  e->cache->close();
  e->cv.notify_all();
  if (ok) {
    if (!e->hb_reqs.empty()) wait_requests(e->hb_reqs, deadline_after(1.0));
    MPI_Comm_free(&e->comm);
    return;
  }
  const std::string what = concat("closing the remote session: ", failed, rank_suffix());
  if (quiet) std::cerr << "lockstep remote: " << what << "\n";
  else throw TimeoutError(what);
}

}  // namespace

ReceiveCacheStats receive_cache_stats(const Backend& b) { return engine_of(b)->cache->stats(); }

// ---- calls ----
std::shared_ptr<Call> start_call(Backend& b, int rank, const FnInfo& fn, Encoder&& args, const CallOptions& opts) {
  auto e = engine_of(b);
  LOCKSTEP_CHECK_ARG(rank >= 0 && rank < e->size, "remote call of '", fn.name, "' to rank ", rank,
                     ", which is outside the world of ", e->size, " ranks");
  auto c = std::make_shared<Call>();
  c->e = e;
  c->id = e->next_id.fetch_add(1);
  c->rank = rank;
  c->fn = fn.name;
  c->timeout = opts.timeout < 0 ? e->timeout : opts.timeout;
  c->deadline = deadline_after(c->timeout);
  {
    std::lock_guard lk(e->mu);
    LOCKSTEP_CHECK_ARG(!e->closing && (!e->close_begun || t_running_calls > 0), "remote call of '", fn.name,
                       "' on a remote session that this rank is closing (only remote functions running during "
                       "the close may still make calls)");
    if (e->gone[static_cast<std::size_t>(rank)]) throw TimeoutError(Engine::left_text(rank, fn.name) + rank_suffix());
    e->pending[c->id] = c;
    // Counted before it is posted, under mu: a close that has begun counts every call it let
    // start (close_rounds).
    e->reqs_sent.fetch_add(1);
  }
  bool posted = false;
  try {
    e->send({rank}, kTagReq, k_req, c->id, 0, fn.name + std::string(1, '\0') + fn.sig, args, c->deadline,
            c->timeout, concat("remote call of '", fn.name, "'"), 0, &posted);
  } catch (...) {
    std::lock_guard lk(e->mu);
    e->pending.erase(c->id);
    if (!posted) e->reqs_done.fetch_add(1);  // never sent: nobody will answer it
    throw;
  }
  return c;
}

bool call_ready(Call& c) {
  std::lock_guard lk(c.e->mu);
  return c.done;
}

Decoder call_result(Call& c) {
  Engine& e = *c.e;
  {
    Engine::Waiting w(e);
    std::unique_lock lk(e.mu);
    auto active = Clock::now();
    while (!c.done) {
      if (Clock::now() >= c.deadline) {
        c.abandoned = true;  // the late reply is received and dropped
        throw TimeoutError(concat("remote call of '", c.fn, "' on rank ", c.rank, " did not answer within ",
                                  c.timeout, " s", rank_suffix()));
      }
      e.wait_step(lk, active, c.deadline, e.can_help());
    }
  }
  if (c.failure == Call::f_remote) throw RemoteError(c.rank, c.fn, c.failed + rank_suffix());
  if (c.failure == Call::f_timeout) throw TimeoutError(c.failed + rank_suffix());
  if (c.failure != Call::f_none) throw Error(c.failed + rank_suffix());
  if (c.kind == k_rep_err) {
    Decoder d(c.buf.data() + c.poff, c.plen, nullptr);
    std::string msg;
    d.u8();
    decode(d, msg);
    throw RemoteError(c.rank, c.fn, msg);
  }
  return Decoder(c.buf.data() + c.poff, c.plen, &c.segs);
}

// ---- driver runs ----
namespace {
enum ErrCode : std::uint8_t {
  e_invalid = 1, e_mismatch, e_timeout, e_remote, e_not_compiled, e_mpi, e_error, e_std, e_other
};
}

struct DriverRun::Impl {
  std::shared_ptr<Engine> e;
  bool own = false, closed = false;
  bool stop_sent = false;  // the workers were told f's outcome (finish_error does not tell again)
  std::uint64_t run = 0;
  Incoming stop;

  void close(bool quiet, double wait = -1) {
    if (own && !closed) {
      closed = true;
      close_engine(e, quiet, wait);
    }
  }
};

DriverRun::DriverRun(Backend& b, bool serve_only, const std::string& result_sig) : impl_(std::make_unique<Impl>()) {
  impl_->e = find_engine(b);
  if (!impl_->e) {
    impl_->e = create_engine(b, RemoteOptions{});
    impl_->own = true;
  }
  Engine& e = *impl_->e;
  impl_->run = ++e.run_counter;
  struct Mine {
    std::uint64_t run;
    std::uint64_t sig;
    std::int32_t role;  // 1 run_driver, 2 serve
    std::int32_t pad;
  } mine{impl_->run, serve_only ? 0 : lockstep::detail::hash_bytes(result_sig.data(), result_sig.size()),
         serve_only ? 2 : 1, 0};
  std::vector<std::byte> all;
  try {
    all = agree(e.comm, e.size, &mine, sizeof mine, e.timeout, "run_driver");
  } catch (...) {
    impl_->close(true);
    throw;
  }
  std::vector<Mine> ms(e.size);
  std::memcpy(ms.data(), all.data(), all.size());
  std::string problem;
  if (ms[0].role != 1) problem = "rank 0 (the driver) called serve, not run_driver";
  for (int i = 1; i < e.size && problem.empty(); ++i) {
    if (ms[i].run != ms[0].run) problem = concat("rank ", i, " is in its run ", ms[i].run, " of run_driver, rank 0 in its run ", ms[0].run);
    else if (ms[i].role == 1 && ms[i].sig != ms[0].sig) problem = concat("rank ", i, " expects another result type of f than rank 0");
  }
  if (!problem.empty()) {
    impl_->close(true);
    throw MismatchError(concat("run_driver: ", problem));
  }
  driver_ = e.rank == 0;
  {
    std::lock_guard lk(e.mu);
    e.last_heard[0] = Clock::now();
  }
  if (driver_) e.driving = true;
}

DriverRun::~DriverRun() {
  if (impl_) {
    impl_->e->driving = false;
    try {
      impl_->close(true);
    } catch (...) {
    }
  }
}

namespace {
std::vector<int> others(const Engine& e) {
  std::vector<int> v;
  for (int r = 1; r < e.size; ++r) v.push_back(r);
  return v;
}
}  // namespace

void DriverRun::finish_ok(Encoder&& result) {
  Engine& e = *impl_->e;
  e.driving = false;
  Encoder m = std::move(result);
  // The session was ended under the driver's function (it called finalize): the workers were
  // told that this rank left, and nothing can be sent on the session any more.
  if (e.ended.load())
    throw Error(concat("run_driver: the remote session was ended (finalize was called) while the driver's function "
                       "ran; the workers were told that the driver left",
                       rank_suffix()));
  impl_->stop_sent = true;
  if (e.size > 1)
    e.send(others(e), kTagReq, k_stop_ok, e.next_id.fetch_add(1), impl_->run, std::string(), m,
           deadline_after(e.timeout), e.timeout, "run_driver (telling the workers that f returned)");
  impl_->close(false);
}

void DriverRun::finish_error(std::exception_ptr ep) {
  Engine& e = *impl_->e;
  e.driving = false;
  Encoder m;
  std::uint8_t code = e_other;
  std::string what = "the driver's function threw an exception that is not a std::exception";
  std::int32_t rrank = -1, mpi_code = 0;
  std::string rfn, rmsg;
  try {
    std::rethrow_exception(ep);
  } catch (const RemoteError& x) {
    code = e_remote, what = x.what(), rrank = x.rank(), rfn = x.function(), rmsg = x.message();
  } catch (const InvalidArgument& x) {
    code = e_invalid, what = x.what();
  } catch (const MismatchError& x) {
    code = e_mismatch, what = x.what();
  } catch (const TimeoutError& x) {
    code = e_timeout, what = x.what();
  } catch (const NotCompiled& x) {
    code = e_not_compiled, what = x.what();
  } catch (const MpiError& x) {
    code = e_mpi, what = x.what(), mpi_code = x.code();
  } catch (const Error& x) {
    code = e_error, what = x.what();
  } catch (const std::exception& x) {
    code = e_std, what = x.what();
  } catch (...) {
  }
  m.u8(code);
  encode(m, what);
  encode(m, rrank);
  encode(m, rfn);
  encode(m, rmsg);
  encode(m, mpi_code);
  try {
    if (e.size > 1 && !e.ended.load() && !std::exchange(impl_->stop_sent, true))
      e.send(others(e), kTagReq, k_stop_err, e.next_id.fetch_add(1), impl_->run, std::string(), m,
             deadline_after(e.timeout), e.timeout, "run_driver (telling the workers that f threw)");
  } catch (const std::exception& x) {
    std::cerr << "lockstep remote: " << x.what() << "\n";
  }
  impl_->close(true);
}

Decoder DriverRun::serve_until_done() {
  Engine& e = *impl_->e;
  bool idle_timeout = false, driver_gone = false;
  {
    Engine::Waiting w(e);
    std::unique_lock lk(e.mu);
    auto active = Clock::now();
    while (true) {
      // The end of the run comes on the request tag, after every request the driver sent
      // before it (MPI keeps one sender's messages of one tag in order, and requests and ends of
      // runs are delivered in order per rank): those still queued or running here run first.
      if (auto it = e.stops.find(impl_->run); it != e.stops.end() && e.driver_reqs_done == e.driver_reqs_queued) {
        impl_->stop = std::move(it->second);
        e.stops.erase(it);
        break;
      }
      // Silent: nothing from the driver in a pass of the progress thread that began the
      // timeout after its last message (not merely the timeout by the clock: a rank that was
      // stopped itself, and has just resumed, has the driver's heartbeats still to read).
      const Clock::time_point looked = e.ctrl_looks.through();
      // (Not once the driver's end of run is here: it was alive then, and what is left, the
      // calls it sent before, is this rank's own work; the close after has its own bound.)
      if (e.timeout > 0 && e.stops.find(impl_->run) == e.stops.end() && looked >= e.last_heard[0] + std::chrono::duration_cast<Clock::duration>(
                                                               std::chrono::duration<double>(e.timeout))) {
        idle_timeout = true;
        break;
      }
      // The driver left the session (it finalised with it open): nothing more comes from it.
      if (e.driver_left.load() && e.stops.find(impl_->run) == e.stops.end()) {
        driver_gone = true;
        break;
      }
      e.wait_step(lk, active, Clock::now() + std::chrono::milliseconds(50), true);
    }
  }
  if (driver_gone) {
    impl_->close(true, std::min(e.timeout > 0 ? e.timeout : 1.0, 1.0));
    throw TimeoutError(concat("rank ", e.rank, ": the driver (rank 0) left the remote session (it finalised Lockstep, "
                              "or returned from main, with the session open) while this rank served in run_driver",
                              rank_suffix()));
  }
  if (idle_timeout) {
    // The driver is not expected at the closing barrier: a short wait only.
    impl_->close(true, std::min(e.timeout, 1.0));
    throw TimeoutError(concat("rank ", e.rank, " heard nothing from the driver (rank 0) for ", e.timeout,
                              " s while serving in run_driver", rank_suffix()));
  }
  impl_->close(false);
  auto& s = impl_->stop;
  if (!s.failed.empty()) {
    const std::string what = concat("run_driver on rank ", e.rank, ": ", s.failed, rank_suffix());
    if (s.fail_kind == Call::f_timeout) throw TimeoutError(what);
    throw Error(what);
  }
  if (s.kind == k_stop_err) {
    Decoder d(s.buf.data() + s.poff, s.plen, nullptr);
    const auto code = d.u8();
    std::string what, rfn, rmsg;
    std::int32_t rrank = 0, mpi_code = 0;
    decode(d, what);
    decode(d, rrank);
    decode(d, rfn);
    decode(d, rmsg);
    decode(d, mpi_code);
    switch (code) {
      case e_invalid: throw InvalidArgument(what);
      case e_mismatch: throw MismatchError(what);
      case e_timeout: throw TimeoutError(what);
      case e_remote: throw RemoteError(rrank, rfn, rmsg);
      case e_not_compiled: throw NotCompiled(what);
      case e_mpi: throw MpiError(what, mpi_code);
      default: throw Error(what);
    }
  }
  return Decoder(s.buf.data() + s.poff, s.plen, &s.segs);
}

}  // namespace lockstep::detail::remote

namespace lockstep {

RemoteSession::RemoteSession(Backend& b, RemoteOptions options) : backend_(&b) {
  detail::remote::create_engine(b, options);
}

RemoteSession::~RemoteSession() {
  try {
    if (backend_ != nullptr) {
      if (auto e = detail::remote::find_engine(*backend_)) detail::remote::close_engine(e, true);
    }
  } catch (...) {
  }
}

void RemoteSession::close() {
  if (backend_ == nullptr) return;
  auto e = detail::remote::find_engine(*backend_);
  backend_ = nullptr;
  if (e) detail::remote::close_engine(e, false);
}

namespace detail::remote {
std::vector<int> session_agree_failed(Backend& b, bool failed, const char* what) {
  auto e = engine_of(b);
  const std::int32_t mine = failed ? 1 : 0;
  Engine::Waiting w(*e);  // this thread takes the passes while it waits
  const auto all = agree(e->comm, e->size, &mine, sizeof mine, e->timeout, what, [&] { return e->try_pass() == 1; });
  std::vector<int> out;
  for (int i = 0; i < e->size; ++i) {
    std::int32_t f = 0;
    std::memcpy(&f, all.data() + sizeof f * static_cast<std::size_t>(i), sizeof f);
    if (f != 0) out.push_back(i);
  }
  return out;
}
}  // namespace detail::remote

void serve(Backend& b) {
  detail::remote::DriverRun run(b, true, std::string());
  (void)run.serve_until_done();
}

}  // namespace lockstep
