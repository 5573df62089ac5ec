// Rescue states (io/rescue.hpp) under mpiexec: a rank writes the state alone, atomically, with
// its step; resume_freshest finds the newest verified state that any rank holds, in a
// directory only that rank reads, and every rank gets it from there; a file that does not
// verify is passed over; nothing anywhere is a fresh start; a sharded state writes nothing.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "lockstep/io/rescue.hpp"
#include "lockstep/lockstep.hpp"
#include "test_support.hpp"

namespace ls = lockstep;
namespace fs = std::filesystem;

namespace rescuetest {
struct Net {
  ls::Tensor w, b;
  std::int64_t epoch = 0;
};
LOCKSTEP_FIELDS(Net, w, b, epoch)

Net make(float salt) {
  Net n{ls::Tensor::empty({4, 3}), ls::Tensor::empty({4}), static_cast<std::int64_t>(salt)};
  auto w = n.w.span<float>();
  for (std::size_t k = 0; k < w.size(); ++k) w[k] = salt + 0.25f * static_cast<float>(k);
  auto b = n.b.span<float>();
  for (std::size_t k = 0; k < b.size(); ++k) b[k] = -salt - static_cast<float>(k);
  return n;
}
bool same(const Net& a, const Net& b) { return ls::model_hash(a) == ls::model_hash(b) && a.epoch == b.epoch; }
}  // namespace rescuetest

namespace {

ls::Backend& backend() { return ls::get_distributed_backend<ls::MPIBackend>(); }
bool all_ranks(bool ok) { return lstest::all_ranks(backend(), ok); }

/// A fresh directory per test, named after rank 0's pid; rank R's own folder is DIR/rR.
fs::path shared_dir(const char* name) {
  std::int64_t pid = ::getpid();
  backend().broadcast(ls::view_of(std::span<std::int64_t>(&pid, 1)), 0);
  const fs::path d = fs::temp_directory_path() / ("lockstep-rescue-" + std::to_string(pid) + "-" + name);
  if (backend().rank() == 0) {
    fs::remove_all(d);
    fs::create_directories(d);
  }
  backend().barrier();
  return d;
}
fs::path own(const fs::path& d) { return d / ("r" + std::to_string(backend().rank())); }

}  // namespace

TEST_CASE("write_rescue_state: one rank alone writes the whole state with its step", "[rescue]") {
  const fs::path d = shared_dir("write");
  const rescuetest::Net net = rescuetest::make(3.f);
  // No communication: only the last rank writes, the others do nothing.
  const bool last = backend().rank() == backend().size() - 1;
  std::optional<fs::path> p;
  if (last) p = ls::write_rescue_state(own(d), 42, backend().rank(), net, {{"epoch_note", "x"}});
  bool ok = true;
  if (last) {
    ok = p && *p == ls::rescue_path(own(d), 42, backend().rank()) && fs::exists(*p);
    if (ok) {
      const ls::Checkpoint ck = ls::load_checkpoint(*p);
      ok = ck.metadata.at(std::string(ls::kStepKey)) == "42" && ck.metadata.at("epoch_note") == "x" &&
           ck.metadata.at(std::string(ls::kRescueKey)).rfind("rank " + std::to_string(backend().rank()) + " on host ", 0) == 0;
      rescuetest::Net back = rescuetest::make(0.f);
      ls::restore_from_checkpoint(ck, back);
      ok = ok && rescuetest::same(back, net);
    }
    // Nothing but the file: no temporary left.
    std::size_t entries = 0;
    for (const auto& e : fs::directory_iterator(own(d))) entries += e.is_regular_file() ? 1 : 0;
    ok = ok && entries == 1;
    // Superseded states are pruned: at or below the step, not above.
    ls::write_rescue_state(own(d), 50, backend().rank(), net);
    ok = ok && ls::prune_rescue_states(own(d), 42) == 1 && fs::exists(ls::rescue_path(own(d), 50, backend().rank()));
  }
  CHECK(all_ranks(ok));
  CHECK(ls::rescue_path("x", 7, 3) == fs::path("x/rescue-000000007-r3.safetensors"));
  CHECK(ls::is_collective_failure(ls::TimeoutError("t")));
  CHECK(ls::is_collective_failure(ls::MpiError("m", 1)));
  CHECK(ls::is_collective_failure(ls::MismatchError("left")));
  CHECK_FALSE(ls::is_collective_failure(ls::InvalidArgument("a")));
  CHECK_FALSE(ls::is_collective_failure(std::runtime_error("r")));
  // An unwritable directory: nullopt and a line, never an exception.
  CHECK_FALSE(ls::write_rescue_state("/proc/lockstep-no-such-dir", 1, backend().rank(), net).has_value());
  backend().barrier();
  if (backend().rank() == 0) fs::remove_all(d);
}

TEST_CASE("rescue_directory: LOCKSTEP_RESCUE_DIR, else the fallback, else TMPDIR", "[rescue]") {
  ::setenv("LOCKSTEP_RESCUE_DIR", "/some/where", 1);
  CHECK(ls::rescue_directory("run/ck.rescue") == fs::path("/some/where"));
  ::unsetenv("LOCKSTEP_RESCUE_DIR");
  CHECK(ls::rescue_directory("run/ck.rescue") == fs::path("run/ck.rescue"));
  const char* tmp = std::getenv("TMPDIR");
  const std::string saved = tmp ? tmp : "";
  ::setenv("TMPDIR", "/scratch", 1);
  CHECK(ls::rescue_directory() == fs::path("/scratch/lockstep-rescue"));
  if (tmp) ::setenv("TMPDIR", saved.c_str(), 1);
  else ::unsetenv("TMPDIR");
}

TEST_CASE("resume_freshest: the newest verified state, read by the one rank that holds it", "[rescue]") {
  const fs::path d = shared_dir("fresh");
  const int last = backend().size() - 1;
  const rescuetest::Net newest = rescuetest::make(7.f), older = rescuetest::make(5.f);
  // Rank 0 holds a regular checkpoint of step 5; the last rank, in a directory of its own, the
  // rescue state of step 7 (and an older one of step 3).
  const fs::path ck = d / "r0" / "ck.safetensors";
  if (backend().rank() == 0) {
    fs::create_directories(ck.parent_path());
    ls::Checkpoint c;
    c.metadata[std::string(ls::kStepKey)] = "5";
    ls::add_to_checkpoint(c, older);
    ls::save_checkpoint(ck, c);
  }
  if (backend().rank() == last) {
    ls::write_rescue_state(own(d), 3, last, rescuetest::make(1.f));
    ls::write_rescue_state(own(d), 7, last, newest);
  }
  backend().barrier();
  const std::vector<fs::path> mine = backend().rank() == 0 ? std::vector<fs::path>{ck} : std::vector<fs::path>{};

  rescuetest::Net x = rescuetest::make(100.f + static_cast<float>(backend().rank()));
  auto found = ls::resume_freshest(backend(), x, own(d), mine);
  CHECK(all_ranks(found && found->holder == last && found->step == 7 && found->rescue &&
                  found->path == ls::rescue_path(own(d).parent_path() / ("r" + std::to_string(last)), 7, last) &&
                  found->hash.rfind("crc32c:", 0) == 0 && found->hash.size() == 15 && rescuetest::same(x, newest) &&
                  found->metadata.at(std::string(ls::kStepKey)) == "7"));

  // The step-7 file damaged (one byte of its data flipped): passed over with a line; the
  // newest that verifies is rank 0's checkpoint of step 5 (newer than the step-3 rescue).
  if (backend().rank() == last) {
    const fs::path p = ls::rescue_path(own(d), 7, last);
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-3, std::ios::end);
    f.put(static_cast<char>(c ^ 0x10));
  }
  backend().barrier();
  x = rescuetest::make(200.f);
  found = ls::resume_freshest(backend(), x, own(d), mine);
  CHECK(all_ranks(found && found->holder == 0 && found->step == 5 && !found->rescue && rescuetest::same(x, older)));
  backend().barrier();
  if (backend().rank() == 0) fs::remove_all(d);
}

TEST_CASE("resume_freshest: nothing anywhere is a fresh start; only files that do not verify are an error", "[rescue]") {
  const fs::path d = shared_dir("none");
  rescuetest::Net x = rescuetest::make(9.f);
  const rescuetest::Net before = rescuetest::make(9.f);
  CHECK(all_ranks(!ls::resume_freshest(backend(), x, own(d), {d / "missing.safetensors"}).has_value() &&
                  rescuetest::same(x, before)));
  // Rank 0's only candidate is garbage: every rank throws, and no rank's x changed.
  if (backend().rank() == 0) {
    fs::create_directories(own(d));
    std::ofstream(ls::rescue_path(own(d), 4, 0)) << "not a checkpoint";
  }
  backend().barrier();
  bool threw = false;
  try {
    (void)ls::resume_freshest(backend(), x, own(d), {});
  } catch (const ls::CheckpointError& e) {
    threw = std::string(e.what()).find("does not") != std::string::npos;
  }
  CHECK(all_ranks(threw && rescuetest::same(x, before)));
  backend().barrier();
  if (backend().rank() == 0) fs::remove_all(d);
}

TEST_CASE("write_rescue_state: a sharded optimizer state is not whole on any rank: nothing written", "[rescue]") {
  const fs::path d = shared_dir("sharded");
  rescuetest::Net net = rescuetest::make(2.f);
  auto opt = ls::DistributedOptimizer(backend(), ls::Adam{.lr = 1e-3f}, ls::DistributedOptions{.shard_optimizer_state = true});
  auto state = ls::setup(opt, std::tie(net.w, net.b));
  CHECK(all_ranks(!ls::write_rescue_state(own(d), 1, backend().rank(), std::tie(net.w, net.b, state)).has_value() &&
                  !fs::exists(own(d))));
  // The replicated state is whole: written.
  auto opt2 = ls::DistributedOptimizer(backend(), ls::Adam{.lr = 1e-3f});
  auto state2 = ls::setup(opt2, std::tie(net.w, net.b));
  CHECK(all_ranks(ls::write_rescue_state(own(d), 1, backend().rank(), std::tie(net.w, net.b, state2)).has_value()));
  backend().barrier();
  if (backend().rank() == 0) fs::remove_all(d);
}
