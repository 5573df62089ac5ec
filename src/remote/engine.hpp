// Remote calls, internal: the state of a session on one rank (the Engine) and what its files
// share. Never installed. Who does what:
//   send.cpp       posting a message (header and tensors) to other ranks
//   receive.cpp    receiving headers, the tensors they announce, and the tensors owed
//   delivery.cpp   handing a received message to its call, the queue or the run; failing it
//   progress.cpp   passes over the incoming messages, heartbeats, the progress thread, waits
//   executor.cpp   running a received call and replying; the background executor
//   session.cpp    creating sessions, the table of them, finalize; close.cpp closing them
//   calls.cpp      a call's start and result; driver_run.cpp run_driver and serve
//
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
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/remote/remote.hpp"
#include "remote/receive_cache.hpp"
#include "remote/wire.hpp"

namespace lockstep::detail::remote {

/// The delay test hook of the reply being sent on this thread (delay_reply_tensors_for_test).
extern thread_local double t_reply_tensor_delay;
/// Remote functions this thread is running (nested): while a rank closes its session, only they
/// may start calls.
extern thread_local int t_running_calls;

/// A message received (its header, and the tensors it announced once they are in).
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
  // How long the progress thread's last drain may take once stopped (close_engine sets it
  // before it stops the thread: a second after a close that completed, none after one that
  // failed, whose communicator is never used again).
  std::atomic<double> drain_seconds{1.0};
  std::atomic<bool> driving{false};
  // Per rank: the heartbeat last sent to it, MPI_REQUEST_NULL once taken (under poll_mu). A
  // rank gets its next one only when it took the last.
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
  std::vector<std::string> hosts;  // every rank's host name (MPI_Get_processor_name), agreed at creation
  // Liveness, so that a wait for a rank that is lost ends once, not once per wait (a remote
  // call's deadline, then the end of run_driver, then each step of the close). watch_since[r]:
  // since when r sends this rank something at least every heartbeat period (max(): not
  // watched): the driver watches the serving ranks from the start of a run (they send it
  // heartbeats while they serve, hb_driver), a closing rank every rank from its close on.
  // said_silent[r]: the rank that found r silent (this one, or one whose notice of leaving
  // named r), -1 if none. Under mu.
  std::vector<Clock::time_point> watch_since;
  std::vector<int> said_silent;
  std::atomic<bool> hb_driver{false};  // a serving rank: send heartbeats to the driver (rank 0)
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
  ~Engine();

  int data_tag(std::uint64_t id, bool reply) const {
    return kDataBase + static_cast<int>((2 * id + (reply ? 1 : 0)) % static_cast<std::uint64_t>(tag_span));
  }

  // ---- send.cpp ----
  /// Sends message m to every rank of dests (returns when sent); TimeoutError past the deadline
  /// (`seconds` after the start, for the message). `tensor_delay` (a test hook) holds the tensor
  /// messages back for that long after the header. `spare_silent` (the end of a run, the notices
  /// of a close): the wait also ends, in a TimeoutError naming them, once every rank that has
  /// not taken the message yet is known silent (silent()): the deadline of the wait that found
  /// them so is not waited for again.
  void send(const std::vector<int>& dests, int tag, Kind kind, std::uint64_t id, std::uint64_t run,
            const std::string& name, Encoder& m, Clock::time_point deadline, double seconds, const std::string& what,
            double tensor_delay = 0, bool* header_posted = nullptr, bool spare_silent = false);

  // ---- receive.cpp ----
  void receive(MPI_Message& msg, MPI_Status& st);
  /// Remembers the tensor messages of a header whose tensors found no memory.
  void owe(int source, int tag, const std::vector<std::size_t>& bytes);
  /// Posts receives for what is owed from (source, tag) (every source and tag when source < 0),
  /// into memory that is dropped once they complete. False when some found no memory again:
  /// then nothing more may be posted for that source and tag. Called with mu held.
  bool take_owed(int source = -1, int tag = -1);
  /// Finishes the messages whose tensors are arriving: each is failed when its tensors did not
  /// all come within the data deadline, and delivered once they are in, a reply at once (it is
  /// matched by its call), a request or the end of a run only after every earlier one from the
  /// same rank (one rank's calls start in the order it sent them). True when one was finished.
  /// Called with poll_mu held.
  bool advance_arrivals();
  /// Whether a message from `source` of kind `kind`, its tensors in, may be delivered now: a
  /// reply always, a request or the end of a run when no earlier one from that rank is arriving.
  bool may_deliver(int source, Kind kind) const;
  /// A message from a Lockstep sender (its magic is right) dropped as malformed: what its head
  /// says it was is answered as such (fail_incoming). Called with poll_mu held.
  void drop_malformed(Incoming&& in, const Head& h, const std::string& why);

  // ---- delivery.cpp ----
  /// A message whose tensors cannot be received here ("tensors " + why): a reply fails its call
  /// now (unless abandoned), a request is answered with the error, the driver's end of a run
  /// is an error on this rank. Called with mu held.
  /// `malformed`: the whole message was dropped as malformed (`why` says how); a reply then
  /// fails its call with a RemoteError.
  void fail_incoming(Incoming&& in, Call::Failure kind, const std::string& why, bool malformed = false);
  /// A message that failed on this rank (fail_incoming), or, for a request or the driver's end
  /// of a run while an earlier one from the same rank is still arriving, parked behind it in
  /// `arriving` with its failure, to be failed in its turn (advance_arrivals): one rank's
  /// calls start in the order it sent them, failed or not (a failed request, or an end of run,
  /// never overtakes a request still arriving). Called with poll_mu held.
  void fail_or_park(Incoming&& in, Call::Failure kind, const std::string& why, bool malformed = false);
  /// Rank `r` left the session: it answers nothing more. Its calls still pending here fail now
  /// with a TimeoutError naming it (not at their deadline, 600 s by default), later
  /// calls to it fail at once (start_call), and a serving rank whose driver left stops serving.
  void on_rank_left(int r);
  std::string left_text(int r, const std::string& fn) const;
  /// Whether r (another rank) is known silent: named so (said_silent), or watched and not heard
  /// from in the passes' looks (LookWatch) since the session's timeout after the later of its
  /// last message and the start of the watch. Called with mu held.
  bool silent(int r) const;
  /// The other ranks known silent, in order. Called with mu held.
  std::vector<int> silent_ranks() const;
  /// "rank r (host h) sent nothing for T s" ("ranks 2, 3 (host h) ..." for several), and who
  /// found them so when another rank did. Called with mu held.
  std::string silent_text(const std::vector<int>& rs) const;
  /// "rank R (host H)": a rank with its host, as every error naming a peer says it, so that a
  /// launcher (and a reader) can tell which machine was lost.
  std::string rank_text(int r) const;
  /// Queues a request to run. Called with mu held.
  void enqueue(Incoming&& in);
  /// Hands a message whose tensors have all arrived to whoever waits for it. Called with mu
  /// held.
  void deliver(Incoming&& in);

  // ---- progress.cpp ----
  /// One look at each tag (one message each at most). `ctrl_empty`: no control message (the
  /// driver's heartbeats and end of run) was waiting.
  /// `before_receive` (when given) runs before each message found is received.
  bool poll_once(bool* ctrl_empty = nullptr, const std::function<void()>* before_receive = nullptr);
  void housekeeping();
  /// One pass over the incoming messages and the housekeeping. Called with poll_mu held.
  bool pass(const std::function<void()>* before_receive = nullptr);
  /// A pass, if no other thread is in one: 1 when it received something, 0 when not, -1 when
  /// another thread was in a pass. An error is reported and taken for activity.
  int try_pass(const std::function<void()>* before_receive = nullptr);

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
                    const std::function<void()>* before_receive = nullptr);
  /// One step of a thread that waits, with mu held (by lk), for what a message brings: runs a
  /// queued call when `may_run`; otherwise takes a pass itself or, when another thread is
  /// in one, waits on cv (which every received message notifies) until `until` at most.
  /// `active`: when this thread last saw something happen (for the backoff). The caller holds
  /// a Waiting for the whole wait.
  void wait_step(std::unique_lock<std::mutex>& lk, Clock::time_point& active, Clock::time_point until,
                 bool may_run);
  void progress_loop();
  /// The receives of messages still arriving become orphans (settle_orphans cancels them), with
  /// the memory they write into. Called with poll_mu held, when no more passes follow.
  void orphan_arrivals();

  // ---- executor.cpp ----
  void execute(Incoming& in);
  bool can_help() const { return !opts.background || std::this_thread::get_id() == executor_id; }
  void executor_loop();
};

}  // namespace lockstep::detail::remote
