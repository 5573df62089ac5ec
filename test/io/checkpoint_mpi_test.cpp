// Rank-aware checkpoints under mpiexec: root saves, resume restores every rank; a failure on the
// root (missing, truncated or corrupted file, different model, unwritable directory) becomes the
// same CheckpointError on every rank, never a hang. Each check is made locally and the verdicts
// combined across ranks, so no rank leaves a collective early.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/io/checkpoint.hpp"
#include "lockstep/lockstep.hpp"
#include "test_support.hpp"

namespace ls = lockstep;
namespace fs = std::filesystem;

namespace cktest {
struct Layer {
  ls::Tensor w, b;
};
LOCKSTEP_FIELDS(Layer, w, b)

/// Layers and scalar leaves; `Small` is the type of the last leaf (Net's is 32-bit).
template <class Small>
struct NetOf {
  std::vector<Layer> layers;
  std::int64_t epoch = 0;
  double lr = 0;
  bool flag = false;
  std::uint64_t seed = 0;
  float scale = 0;
  Small small = 0;
};
LOCKSTEP_TEMPLATE_FIELDS((class Small), (NetOf<Small>), layers, epoch, lr, flag, seed, scale, small)
using Net = NetOf<std::int32_t>;

/// True if the layers of a and b are bitwise equal.
template <class N>
bool same_layers(const N& a, const N& b) {
  if (a.layers.size() != b.layers.size()) return false;
  for (std::size_t i = 0; i < a.layers.size(); ++i)
    if (!ls::bitwise_equal(a.layers[i].w, b.layers[i].w) || !ls::bitwise_equal(a.layers[i].b, b.layers[i].b))
      return false;
  return true;
}

/// A net of the given widths whose values depend on `salt` (so ranks differ before a resume).
Net make_net(const std::vector<std::int64_t>& widths, float salt) {
  Net n;
  for (std::size_t i = 0; i + 1 < widths.size(); ++i) {
    Layer l{ls::Tensor::empty({widths[i + 1], widths[i]}), ls::Tensor::empty({widths[i + 1]})};
    auto w = l.w.span<float>();
    for (std::size_t k = 0; k < w.size(); ++k) w[k] = salt * 0.5f + static_cast<float>(k) * 0.25f;
    auto b = l.b.span<float>();
    for (std::size_t k = 0; k < b.size(); ++k) b[k] = -salt - static_cast<float>(k);
    n.layers.push_back(std::move(l));
  }
  n.epoch = static_cast<std::int64_t>(salt) + 7;
  n.lr = 1e-3 * (1 + salt);
  n.flag = salt > 0.5f;
  n.seed = 0xFEDCBA9876543210ull + static_cast<std::uint64_t>(salt);
  n.scale = salt / 3.f;
  n.small = -static_cast<std::int32_t>(salt);
  return n;
}

bool same_net(const Net& a, const Net& b) {
  return same_layers(a, b) && a.epoch == b.epoch && a.lr == b.lr && a.flag == b.flag && a.seed == b.seed &&
         a.scale == b.scale && a.small == b.small;
}
}  // namespace cktest

namespace {

ls::Backend& backend() { return ls::get_distributed_backend<ls::MPIBackend>(); }

/// True on every rank iff `ok` is true on every rank.
bool all_ranks(bool ok) { return lstest::all_ranks(backend(), ok); }

/// A directory shared by all ranks (they run on one machine), named after rank 0's pid.
fs::path shared_dir() {
  std::int64_t pid = ::getpid();
  backend().broadcast(ls::view_of(std::span<std::int64_t>(&pid, 1)), 0);
  const fs::path d = fs::temp_directory_path() / ("lockstep-ckmpi-" + std::to_string(pid));
  if (backend().rank() == 0) fs::create_directories(d);
  backend().barrier();
  return d;
}

/// Runs f (a collective) on every rank; true on a rank if it threw CheckpointError whose
/// message contains `expect`.
template <class F>
bool throws_checkpoint_error(F&& f, const std::string& expect) {
  try {
    f();
  } catch (const ls::CheckpointError& e) {
    const bool ok = std::string(e.what()).find(expect) != std::string::npos;
    if (!ok) std::fprintf(stderr, "rank %d: unexpected message: %s\n", backend().rank(), e.what());
    return ok;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: wrong exception type: %s\n", backend().rank(), e.what());
    return false;
  }
  return false;
}

}  // namespace

TEST_CASE("structures by leaf path: round trip and mismatches", "[checkpoint]") {
  const cktest::Net a = cktest::make_net({1, 4, 1}, 3.f);
  ls::Checkpoint ck;
  ls::add_to_checkpoint(ck, a, "net");
  CHECK(ck.find("net.layers[0].w") != nullptr);
  CHECK(ck.find("net.epoch") != nullptr);
  CHECK(ck.at("net.seed").dtype() == ls::DType::i64);
  CHECK(ck.at("net.flag").dtype() == ls::DType::u8);
  CHECK(ck.at("net.small").dtype() == ls::DType::i32);
  // Through the bytes, as a file would go.
  const ls::Checkpoint back = ls::parse_checkpoint(ls::serialize_checkpoint(ck));
  cktest::Net b = cktest::make_net({1, 4, 1}, 0.f);
  ls::restore_from_checkpoint(back, b, "net");
  CHECK(same_net(a, b));

  cktest::Net wide = cktest::make_net({1, 5, 1}, 0.f);
  CHECK_THROWS_WITH(ls::restore_from_checkpoint(back, wide, "net"), Catch::Contains("has shape [4, 1] but the structure expects [5, 1]"));
  cktest::Net deep = cktest::make_net({1, 4, 1, 1}, 0.f);
  CHECK_THROWS_WITH(ls::restore_from_checkpoint(back, deep, "net"),
                    Catch::Contains("has no tensor \"net.layers[2].w\""));
  cktest::Net shallow = cktest::make_net({1, 4}, 1.f);
  const cktest::Net shallow_before = cktest::make_net({1, 4}, 1.f);
  CHECK_THROWS_WITH(ls::restore_from_checkpoint(back, shallow, "net"),
                    Catch::Contains("has tensor \"net.layers[1].w\" that the structure"));
  CHECK(same_net(shallow, shallow_before));  // all or nothing: untouched after a refusal
  // A dtype mismatch: the same names, f64 weights.
  cktest::Net f64 = cktest::make_net({1, 4, 1}, 0.f);
  f64.layers[0].w = ls::Tensor::zeros({4, 1}, ls::DType::f64);
  CHECK_THROWS_WITH(ls::restore_from_checkpoint(back, f64, "net"), Catch::Contains("has dtype F32"));
  // A different prefix: nothing there.
  CHECK_THROWS_WITH(ls::restore_from_checkpoint(back, b, "model"), Catch::Contains("has no tensor"));
}

TEST_CASE("root saves, every rank resumes bitwise", "[checkpoint][mpi]") {
  const fs::path dir = shared_dir();
  const fs::path p = dir / "net.safetensors";
  const int r = backend().rank();
  cktest::Net mine = cktest::make_net({1, 8, 3}, static_cast<float>(r));  // rank 0's is the truth
  ls::save_checkpoint(backend(), p, mine, {{"epoch", "5"}, {"note", "hello"}});
  cktest::Net resumed = cktest::make_net({1, 8, 3}, 10.f + r);  // every rank differs
  const auto meta = ls::load_checkpoint(backend(), p, resumed);
  const cktest::Net truth = cktest::make_net({1, 8, 3}, 0.f);
  const bool ok = same_net(resumed, truth) && meta.at("epoch") == "5" && meta.at("note") == "hello" &&
                  meta.count(std::string(ls::kChecksumKey)) == 1;
  CHECK(all_ranks(ok));
  if (r == 0) fs::remove_all(dir);
}

TEST_CASE("a failure on the root is an error on every rank", "[checkpoint][mpi]") {
  const fs::path dir = shared_dir();
  const fs::path p = dir / "net.safetensors";
  const int r = backend().rank();
  const cktest::Net saved = cktest::make_net({1, 8, 3}, 0.f);
  ls::save_checkpoint(backend(), p, saved);
  std::vector<char> good;
  {
    std::ifstream in(p, std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  backend().barrier();  // every rank has read the good file before rank 0 rewrites it
  auto write_variant = [&](const std::vector<char>& bytes) {
    if (r == 0) {
      std::ofstream out(p, std::ios::binary | std::ios::trunc);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    backend().barrier();
  };
  cktest::Net target = cktest::make_net({1, 8, 3}, 20.f + r);
  const cktest::Net before = cktest::make_net({1, 8, 3}, 20.f + r);

  // Truncated.
  write_variant(std::vector<char>(good.begin(), good.end() - 5));
  CHECK(all_ranks(throws_checkpoint_error([&] { ls::load_checkpoint(backend(), p, target); }, "truncated")));
  // One flipped bit in the data.
  auto flipped = good;
  flipped[flipped.size() - 10] ^= 0x04;
  write_variant(flipped);
  CHECK(all_ranks(throws_checkpoint_error([&] { ls::load_checkpoint(backend(), p, target); },
                                          "checksum mismatch")));
  // Garbage.
  write_variant(std::vector<char>(100, 'x'));
  CHECK(all_ranks(throws_checkpoint_error([&] { ls::load_checkpoint(backend(), p, target); }, "checkpoint")));
  // Missing file.
  CHECK(all_ranks(throws_checkpoint_error(
      [&] { ls::load_checkpoint(backend(), dir / "missing.safetensors", target); }, "cannot open")));
  CHECK(all_ranks(same_net(target, before)));  // every refusal left every rank untouched
  // A different model.
  write_variant(good);
  cktest::Net other = cktest::make_net({1, 16, 3}, 0.f);
  CHECK(all_ranks(throws_checkpoint_error([&] { ls::load_checkpoint(backend(), p, other); }, "has shape")));
  // The good file still loads after all that.
  ls::load_checkpoint(backend(), p, target);
  CHECK(all_ranks(same_net(target, saved)));
  // Saving into a directory that does not exist.
  CHECK(all_ranks(throws_checkpoint_error(
      [&] { ls::save_checkpoint(backend(), dir / "no" / "such" / "dir.safetensors", saved); },
      "cannot create a temporary file")));
  backend().barrier();
  if (r == 0) fs::remove_all(dir);
}

// ---- Defects found by adversarial testing (docs/reliability.md, checkpoint catalogue) ---------

namespace cktest {
/// Net with a 16-bit `small`: the same leaf names, dtypes and shapes in a checkpoint (both I32),
/// but a different structure for synchronize.
using Net16 = NetOf<std::int16_t>;

Net16 make_net16(const std::vector<std::int64_t>& widths, float salt) {
  Net n = make_net(widths, salt);
  return Net16{std::move(n.layers), n.epoch, n.lr, n.flag, n.seed, n.scale, static_cast<std::int16_t>(n.small)};
}
bool same_net16(const Net16& a, const Net16& b) {
  return same_layers(a, b) && a.epoch == b.epoch && a.lr == b.lr && a.small == b.small;
}

struct WithLongDouble {
  ls::Tensor w;
  std::optional<long double> extra;
};
LOCKSTEP_FIELDS(WithLongDouble, w, extra)

struct Scalars {
  long double v = 0;
  double d = 0;
};
LOCKSTEP_FIELDS(Scalars, v, d)
}  // namespace cktest

namespace {

/// Runs f (a collective); true on a rank if it threw E whose message contains every one of
/// `expect`.
template <class E, class F>
bool throws_with(F&& f, const std::vector<std::string>& expect) {
  try {
    f();
  } catch (const E& e) {
    bool ok = true;
    for (const auto& x : expect) ok = ok && std::string(e.what()).find(x) != std::string::npos;
    if (!ok) std::fprintf(stderr, "rank %d: unexpected message: %s\n", backend().rank(), e.what());
    return ok;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: wrong exception type: %s\n", backend().rank(), e.what());
    return false;
  }
  std::fprintf(stderr, "rank %d: no exception\n", backend().rank());
  return false;
}

}  // namespace

TEST_CASE("a rank whose structure does not fit the file leaves every rank's structure unchanged",
          "[checkpoint][mpi]") {
  const fs::path dir = shared_dir();
  const fs::path p = dir / "net.safetensors";
  const int r = backend().rank(), n = backend().size(), last = n - 1;
  ls::save_checkpoint(backend(), p, cktest::make_net({1, 8, 3}, 0.f));
  const std::string on_last = "[on rank " + std::to_string(last) + " of " + std::to_string(n);
  struct Case {
    std::vector<std::int64_t> widths;  // the last rank's structure
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{1, 8, 3, 2}, "has no tensor \"layers[2].w\""},              // an extra tensor
      {{1, 8}, "has tensor \"layers[1].w\" that the structure"},     // a missing tensor
      {{1, 9, 3}, "has shape [8, 1] but the structure expects [9, 1]"},  // another shape
  };
  bool ok = true;
  for (const auto& c : cases) {
    const auto widths = r == last ? c.widths : std::vector<std::int64_t>{1, 8, 3};
    cktest::Net target = cktest::make_net(widths, 20.f + r);
    const cktest::Net before = cktest::make_net(widths, 20.f + r);
    const bool threw = throws_with<ls::CheckpointError>([&] { ls::load_checkpoint(backend(), p, target); },
                                                        {c.expect, on_last, "nothing was restored on any rank"});
    const bool unchanged = cktest::same_net(target, before);  // root's too
    if (!threw || !unchanged)
      std::fprintf(stderr, "rank %d: case '%s': threw %d, unchanged %d\n", r, c.expect.c_str(), threw, unchanged);
    ok = ok && threw && unchanged;
  }
  // The same leaves in the file's eyes (both I32), but a 16-bit scalar where the others have a
  // 32-bit one: synchronize would refuse it after the root had restored; now nobody restores.
  {
    bool threw = false, unchanged = false;
    if (r == last) {
      cktest::Net16 target = cktest::make_net16({1, 8, 3}, 20.f + r);
      threw = throws_with<ls::CheckpointError>([&] { ls::load_checkpoint(backend(), p, target); },
                                               {"different structures", "small"});
      unchanged = cktest::same_net16(target, cktest::make_net16({1, 8, 3}, 20.f + r));
    } else {
      cktest::Net target = cktest::make_net({1, 8, 3}, 20.f + r);
      threw = throws_with<ls::CheckpointError>([&] { ls::load_checkpoint(backend(), p, target); },
                                               {"different structures", "small"});
      unchanged = cktest::same_net(target, cktest::make_net({1, 8, 3}, 20.f + r));
    }
    if (!threw || !unchanged) std::fprintf(stderr, "rank %d: int16 case: threw %d, unchanged %d\n", r, threw, unchanged);
    ok = ok && threw && unchanged;
  }
  // Root 1 and a mismatch on rank 0.
  {
    const auto widths = r == 0 ? std::vector<std::int64_t>{1, 8, 3, 2} : std::vector<std::int64_t>{1, 8, 3};
    cktest::Net target = cktest::make_net(widths, 30.f + r);
    const bool threw = throws_with<ls::CheckpointError>(
        [&] { ls::load_checkpoint(backend(), p, target, /*root=*/1); },
        {"has no tensor \"layers[2].w\"", "[on rank 0 of"});
    const bool unchanged = cktest::same_net(target, cktest::make_net(widths, 30.f + r));
    if (!threw || !unchanged) std::fprintf(stderr, "rank %d: root 1 case: threw %d, unchanged %d\n", r, threw, unchanged);
    ok = ok && threw && unchanged;
  }
  // And a structure that fits still resumes everywhere.
  cktest::Net target = cktest::make_net({1, 8, 3}, 40.f + r);
  ls::load_checkpoint(backend(), p, target);
  ok = ok && cktest::same_net(target, cktest::make_net({1, 8, 3}, 0.f));
  CHECK(all_ranks(ok));
  backend().barrier();
  if (r == 0) fs::remove_all(dir);
}

TEST_CASE("a FIFO at the path is refused on every rank without blocking the root", "[checkpoint][mpi]") {
  const fs::path dir = shared_dir();
  const fs::path fifo = dir / "ck.fifo";
  const int r = backend().rank();
  bool made = true;
  if (r == 0) made = ::mkfifo(fifo.c_str(), 0644) == 0;
  backend().barrier();
  // A rescue on the root: if the load is still blocked in open() after 5 s (the defect), a
  // writer end is opened and closed, which releases it, and the test fails on the message.
  std::atomic<bool> done{false}, rescued{false};
  std::thread rescue;
  if (r == 0)
    rescue = std::thread([&] {
      for (int i = 0; i < 50 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (done) return;
      rescued = true;
      const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (w >= 0) ::close(w);
    });
  cktest::Net target = cktest::make_net({1, 4, 2}, 1.f + r);
  const bool threw = throws_with<ls::CheckpointError>([&] { ls::load_checkpoint(backend(), fifo, target); },
                                                      {fifo.string(), "is not a regular file", "FIFO"});
  done = true;
  if (rescue.joinable()) rescue.join();
  const bool unchanged = cktest::same_net(target, cktest::make_net({1, 4, 2}, 1.f + r));
  CHECK(all_ranks(made && threw && unchanged && !rescued));
  backend().barrier();
  if (r == 0) fs::remove_all(dir);
}

TEST_CASE("ranks that pass different or invalid roots are refused on every rank", "[checkpoint][mpi]") {
  const fs::path dir = shared_dir();
  const fs::path p = dir / "net.safetensors";
  const int r = backend().rank(), n = backend().size();
  const cktest::Net net = cktest::make_net({1, 4, 2}, 0.f);
  bool ok = true;
  if (n > 1) {
    const int root = r == 0 ? 0 : 1;  // rank 0 thinks it is the root, the others that rank 1 is
    ok = ok && throws_with<ls::InvalidArgument>([&] { ls::save_checkpoint(backend(), p, net, {}, root); },
                                                {"save_checkpoint: the ranks passed different roots", "rank 0: 0",
                                                 "rank 1: 1", "nothing was written"});
    cktest::Net target = cktest::make_net({1, 4, 2}, 5.f);
    ok = ok && throws_with<ls::InvalidArgument>([&] { ls::load_checkpoint(backend(), p, target, root); },
                                                {"load_checkpoint: the ranks passed different roots"});
    ok = ok && cktest::same_net(target, cktest::make_net({1, 4, 2}, 5.f));
    // One rank with a root out of range is a disagreement too, never a hang.
    ok = ok && throws_with<ls::InvalidArgument>(
                   [&] { ls::save_checkpoint(backend(), p, net, {}, r == n - 1 ? n + 5 : 0); },
                   {"different roots"});
  }
  ok = ok && throws_with<ls::InvalidArgument>([&] { ls::save_checkpoint(backend(), p, net, {}, n); },
                                              {"root " + std::to_string(n) + " is not a rank of this backend"});
  ok = ok && !fs::exists(p);  // nothing was written by any of these
  CHECK(all_ranks(ok));
  backend().barrier();
  if (r == 0) fs::remove_all(dir);
}

TEST_CASE("long double leaves are refused by name at save and load, on every rank", "[checkpoint][mpi]") {
  const fs::path dir = shared_dir();
  const fs::path p = dir / "ld.safetensors";
  const int r = backend().rank(), last = backend().size() - 1;
  bool ok = true;
  // On every rank.
  cktest::WithLongDouble all{ls::Tensor::full({2}, 1.0), 0.1L};
  ok = ok && throws_with<ls::InvalidArgument>([&] { ls::save_checkpoint(backend(), p, all); },
                                              {"save_checkpoint: leaf 'extra' is a long double", "nothing was written"});
  // Only on the last rank (its optional is set): still every rank, and the root writes nothing.
  cktest::WithLongDouble some{ls::Tensor::full({2}, 1.0), std::nullopt};
  if (r == last) some.extra = 0.25L;
  ok = ok && throws_with<ls::InvalidArgument>(
                 [&] { ls::save_checkpoint(backend(), p, some); },
                 {"leaf 'extra' is a long double", "[on rank " + std::to_string(last) + " of"});
  ok = ok && !fs::exists(p);
  // Loading into one: refused before the file is even read.
  ok = ok && throws_with<ls::InvalidArgument>([&] { ls::load_checkpoint(backend(), p, all); },
                                              {"load_checkpoint: leaf 'extra' is a long double"});
  // A moved-from tensor is an empty tensor (Tensor()): loading a file in which it has 3 elements
  // into it, on one rank only, is refused on every rank, and nothing is restored anywhere.
  cktest::Layer two{ls::Tensor::full({2}, 1.0), ls::Tensor::full({3}, 2.0)};
  ls::save_checkpoint(backend(), p, two);
  ls::Tensor keep;
  if (r == last && last > 0) keep = std::move(two.b);
  if (last > 0)
    ok = ok && throws_with<ls::Error>([&] { ls::load_checkpoint(backend(), p, two); }, {"nothing was restored"});
  ok = ok && two.w.data<float>()[0] == 1.0f;
  CHECK(all_ranks(ok));
  backend().barrier();
  if (r == 0) fs::remove_all(dir);
}

TEST_CASE("check_replicas compares a long double's value, not its padding", "[checkpoint][mpi][replicas]") {
  const int r = backend().rank(), last = backend().size() - 1;
  constexpr std::size_t kValueBytes = std::numeric_limits<long double>::digits == 64 ? 10 : sizeof(long double);
  // Identical values, different garbage in the padding bytes on each rank.
  auto set = [&](cktest::Scalars& s, long double value) {
    unsigned char buf[sizeof(long double)];
    std::memset(buf, 0xA0 + r, sizeof buf);
    std::memcpy(buf, &value, kValueBytes);
    std::memcpy(&s.v, buf, sizeof buf);
  };
  cktest::Scalars s;
  s.d = 2.5;
  set(s, 0.1L);
  bool padding_differs = true;
  if (kValueBytes < sizeof(long double))
    padding_differs = reinterpret_cast<const unsigned char*>(&s.v)[kValueBytes] == 0xA0 + r;
  bool ok = padding_differs;
  try {
    ls::check_replicas(backend(), s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: identical replicas reported: %s\n", r, e.what());
    ok = false;
  }
  // A difference in the last bit of the value is still a difference, shown with every digit.
  const long double bumped = std::nextafter(0.1L, 1.0L);
  set(s, r == last ? bumped : 0.1L);
  ok = ok && throws_with<ls::MismatchError>([&] { ls::check_replicas(backend(), s); },
                                            {"leaf 'v'", "long double scalar = 0.100000000000000000001",
                                             "long double scalar = 0.100000000000000000008"});
  CHECK(all_ranks(ok));
}

TEST_CASE("rotating checkpoints: root saves and commits, every rank finds the newest, errors on every rank",
          "[checkpoint][mpi][rotation]") {
  const fs::path dir = shared_dir();
  const fs::path stem = dir / "sub" / "ck";  // the directory is created by the first save
  const int r = backend().rank();
  CHECK(all_ranks(!ls::latest_checkpoint(backend(), stem).has_value()));
  const ls::CheckpointRotation rot(stem, 2);
  for (int step = 1; step <= 4; ++step) {
    cktest::Net mine = cktest::make_net({1, 8, 3}, static_cast<float>(step * 10 + r));  // rank 0's is the truth
    const fs::path p = rot.save(backend(), step, mine, {{"step", std::to_string(step)}});
    CHECK(all_ranks(p == rot.path_for(step)));
  }
  const auto latest = ls::latest_checkpoint(backend(), stem);
  CHECK(all_ranks(latest.has_value() && *latest == rot.path_for(4)));
  cktest::Net resumed = cktest::make_net({1, 8, 3}, 99.f + r);
  const auto meta = ls::load_checkpoint(backend(), *latest, resumed);
  CHECK(all_ranks(same_net(resumed, cktest::make_net({1, 8, 3}, 40.f)) && meta.at("step") == "4"));
  if (r == 0) CHECK(rot.files().size() == 2u);
  // The pointer names a file someone removed: the same CheckpointError on every rank.
  if (r == 0) fs::remove(rot.path_for(4));
  backend().barrier();
  CHECK(all_ranks(throws_checkpoint_error([&] { (void)ls::latest_checkpoint(backend(), stem); }, "which is missing")));
  backend().barrier();
  if (r == 0) fs::remove_all(dir);
}

TEST_CASE("rotating checkpoints: a resume from an older checkpoint keeps the newer ones, also the one saved over",
          "[checkpoint][mpi][rotation]") {
  const fs::path dir = shared_dir();
  const fs::path stem = dir / "ck";
  const int r = backend().rank();
  const ls::CheckpointRotation rot(stem, 3);
  for (int step = 1; step <= 4; ++step)  // the first run: 2, 3 and 4 kept, the pointer at 4
    (void)rot.save(backend(), step, cktest::make_net({1, 8, 3}, static_cast<float>(step * 10)));
  // Resumed by hand from 2; its own step 3 differs from the first run's.
  cktest::Net net = cktest::make_net({1, 8, 3}, 0.f);
  (void)ls::load_checkpoint(backend(), rot.path_for(2), net);
  (void)rot.save(backend(), 3, cktest::make_net({1, 8, 3}, 31.f + r));  // rank 0's is written
  const fs::path aside = dir / "ck.set-aside-000003";
  // The first run's 3 and 4 are in the folder, whole; the new 3 is the rotation's newest.
  const auto holds = [&](const fs::path& p, float salt) {
    cktest::Net n = cktest::make_net({1, 8, 3}, -1.f);
    (void)ls::load_checkpoint(backend(), p, n);
    return same_net(n, cktest::make_net({1, 8, 3}, salt));
  };
  CHECK(all_ranks(holds(aside / "ck-000003.safetensors", 30.f)));
  CHECK(all_ranks(holds(aside / "ck-000004.safetensors", 40.f)));
  CHECK(all_ranks(holds(*ls::latest_checkpoint(backend(), stem), 31.f)));
  if (r == 0) CHECK(rot.files().size() == 2u);  // 2 and the new 3
  // Saving the same state again at the pointer's step sets nothing aside (byte-identical).
  (void)rot.save(backend(), 3, cktest::make_net({1, 8, 3}, 31.f));
  if (r == 0) {
    CHECK_FALSE(fs::exists(dir / "ck.set-aside-000003.2"));
    CHECK_FALSE(fs::exists(dir / "ck-000003.safetensors.staged"));
  }
  backend().barrier();
  if (r == 0) fs::remove_all(dir);
}
