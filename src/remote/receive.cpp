// Remote calls: receiving a message's header (MPI_Mrecv), posting the receives of the tensors it
// announces straight into their memory, finishing those arrivals in order, and the tensor
// messages owed (announced, but no memory was found for them).
#include "remote/engine.hpp"

#include <algorithm>
#include <cstring>
#include <iostream>

#include "remote/polling.hpp"
#include "remote/test_hooks.hpp"

namespace lockstep::detail::remote {

void Engine::owe(int source, int tag, const std::vector<std::size_t>& bytes) {
  Owed o{source, tag, {}};
  for (std::size_t nb : bytes)
    for (std::size_t off = 0; off < nb; off += kChunk) o.chunks.push_back(std::min(kChunk, nb - off));
  if (!o.chunks.empty()) owed.push_back(std::move(o));
}

bool Engine::take_owed(int source, int tag) {
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

void Engine::drop_malformed(Incoming&& in, const Head& h, const std::string& why) {
  in.kind = static_cast<Kind>(h.kind);
  in.id = h.id;
  in.run = h.run;
  if (!is_reply(in.kind) && in.kind != k_req && in.kind != k_stop_ok && in.kind != k_stop_err) return;
  if (in.source < 0 || in.source >= size) return;
  in.buf.clear();
  in.plen = 0;
  fail_or_park(std::move(in), Call::f_error, why, /*malformed=*/true);
}

void Engine::receive(MPI_Message& msg, MPI_Status& st) {
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
    // is known, and it is answered as such (a reply dropped uncounted would leave its
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
        // The ranks the sender found silent, if it left because of them ([u32 n][i32 rank]...
        // after the head; nothing from a rank that left for another reason): this rank's close
        // and its notices wait for them no more (Engine::silent).
        std::uint32_t n = 0;
        if (h.payload_len >= 4) std::memcpy(&n, in.buf.data() + kHead, 4);
        if (n > 0 && h.payload_len >= 4 + 4 * std::uint64_t{n}) {
          std::lock_guard lk(mu);
          for (std::uint32_t k = 0; k < n; ++k) {
            std::int32_t r = -1;
            std::memcpy(&r, in.buf.data() + kHead + 4 + 4 * std::size_t{k}, 4);
            if (r >= 0 && r < size && said_silent[static_cast<std::size_t>(r)] < 0)
              said_silent[static_cast<std::size_t>(r)] = in.source;
          }
        }
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
  a.deadline = deadline_or_none(data_timeout);
  arriving.push_back(std::move(a));
}

bool Engine::advance_arrivals() {
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

bool Engine::may_deliver(int source, Kind kind) const {
  if (is_reply(kind)) return true;
  return std::none_of(arriving.begin(), arriving.end(),
                      [&](const Arrival& a) { return a.in.source == source && !is_reply(a.in.kind); });
}

}  // namespace lockstep::detail::remote
