// Rotating checkpoints (CheckpointRotation, latest_checkpoint): the stem of a path, keep-k, the
// pointer always naming a complete file (also when the writer is SIGKILLed at any moment), the
// errors for a pointer that is broken or names a removed file, and committed checkpoints newer
// than a commit set aside (or removed on request), said on stderr. No MPI: one process.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "lockstep/io/checkpoint.hpp"

namespace ls = lockstep;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("lockstep-rotation-" + std::to_string(::getpid()) + "-" +
                                        std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

ls::Checkpoint make(std::int64_t step, std::int64_t elements = 16) {
  ls::Checkpoint ck;
  ck.add("w", ls::Tensor::full({elements}, static_cast<double>(step)));
  ck.metadata["step"] = std::to_string(step);
  return ck;
}

/// Writes the file of `step` and commits it, as CheckpointRotation::save does on the root.
void save(const ls::CheckpointRotation& rot, std::int64_t step, std::int64_t elements = 16) {
  ls::save_checkpoint(rot.path_for(step), make(step, elements));
  rot.commit(step);
}

std::vector<std::int64_t> steps_on_disk(const ls::CheckpointRotation& rot) {
  std::vector<std::int64_t> v;
  for (const auto& [s, p] : rot.files()) v.push_back(s);
  return v;
}

/// The step a checkpoint file holds, after checking it is complete (checksum, every element).
std::int64_t verified_step(const fs::path& p) {
  const ls::Checkpoint ck = ls::load_checkpoint(p);
  const std::int64_t step = std::stoll(ck.metadata.at("step"));
  for (float v : ck.at("w").span<float>()) REQUIRE(v == static_cast<float>(step));
  return step;
}

}  // namespace

TEST_CASE("rotation_stem: a .safetensors path, a bare stem, a directory", "[checkpoint][rotation]") {
  TempDir d;
  CHECK(ls::rotation_stem("run/ck.safetensors") == fs::path("run/ck"));
  CHECK(ls::rotation_stem("run/ck") == fs::path("run/ck"));
  CHECK(ls::rotation_stem("run/") == fs::path("run/ck"));
  CHECK(ls::rotation_stem(d.path) == d.path / "ck");
  CHECK_THROWS_AS(ls::rotation_stem(""), ls::InvalidArgument);
  const ls::CheckpointRotation rot(d.path / "ck.safetensors", 2);
  CHECK(rot.path_for(50) == d.path / "ck-000050.safetensors");
  CHECK(rot.path_for(1234567) == d.path / "ck-1234567.safetensors");
  CHECK(rot.pointer_path() == d.path / "ck.latest");
  CHECK_THROWS_AS(rot.path_for(-1), ls::InvalidArgument);
  CHECK_THROWS_AS(ls::CheckpointRotation(d.path / "ck", 0), ls::InvalidArgument);
}

TEST_CASE("no pointer is a fresh start; each commit moves it; the newest k stay", "[checkpoint][rotation]") {
  TempDir d;
  const ls::CheckpointRotation rot(d.path / "ck.safetensors", 3);
  CHECK_FALSE(ls::latest_checkpoint(d.path / "ck.safetensors").has_value());
  for (std::int64_t step = 5; step <= 50; step += 5) {
    save(rot, step);
    const auto latest = ls::latest_checkpoint(d.path / "ck.safetensors");
    REQUIRE(latest.has_value());
    CHECK(*latest == rot.path_for(step));
    CHECK(verified_step(*latest) == step);
    CHECK(steps_on_disk(rot).size() == static_cast<std::size_t>(std::min<std::int64_t>(3, step / 5)));
  }
  CHECK(steps_on_disk(rot) == std::vector<std::int64_t>{40, 45, 50});
  // The stem given three ways finds the same pointer.
  CHECK(*ls::latest_checkpoint(d.path / "ck") == rot.path_for(50));
  CHECK(*ls::latest_checkpoint(d.path) == rot.path_for(50));
  // Files of another stem in the same directory are not touched.
  ls::save_checkpoint(d.path / "other-000001.safetensors", make(1));
  save(rot, 55);
  CHECK(fs::exists(d.path / "other-000001.safetensors"));
  CHECK(steps_on_disk(rot) == std::vector<std::int64_t>{45, 50, 55});
}

TEST_CASE("a file written but not committed leaves the old pointer; the next commit removes it",
          "[checkpoint][rotation]") {
  TempDir d;
  const ls::CheckpointRotation rot(d.path / "ck", 2);
  save(rot, 10);
  save(rot, 20);
  // A writer killed between its file and the pointer: the file exists, the pointer did not move.
  ls::save_checkpoint(rot.path_for(30), make(30));
  CHECK(*ls::latest_checkpoint(d.path / "ck") == rot.path_for(20));
  // The restarted run resumes from 20 and commits 25 next: 30 (of the lost timeline) goes.
  save(rot, 25);
  CHECK(steps_on_disk(rot) == std::vector<std::int64_t>{20, 25});
  CHECK(*ls::latest_checkpoint(d.path / "ck") == rot.path_for(25));
  // Committing a file that does not exist is refused, and the pointer stays.
  CHECK_THROWS_AS(rot.commit(99), ls::CheckpointError);
  CHECK(*ls::latest_checkpoint(d.path / "ck") == rot.path_for(25));
}

TEST_CASE("a pointer that is malformed or names a removed file is an error, not a fresh start",
          "[checkpoint][rotation]") {
  TempDir d;
  const ls::CheckpointRotation rot(d.path / "ck", 2);
  save(rot, 7);
  fs::remove(rot.path_for(7));
  CHECK_THROWS_WITH(ls::latest_checkpoint(d.path / "ck"), Catch::Contains("which is missing"));
  std::ofstream(rot.pointer_path()) << "../elsewhere/ck-000007.safetensors\n";
  CHECK_THROWS_WITH(ls::latest_checkpoint(d.path / "ck"), Catch::Contains("does not name a checkpoint"));
  std::ofstream(rot.pointer_path()) << "garbage";
  CHECK_THROWS_AS(ls::latest_checkpoint(d.path / "ck"), ls::CheckpointError);
}

TEST_CASE("a writer SIGKILLed at any moment leaves a pointer naming a complete checkpoint",
          "[checkpoint][rotation]") {
  TempDir d;
  const fs::path stem = d.path / "ck";
  constexpr int kKeep = 2;
  std::int64_t last_seen = -1;
  for (int round = 0; round < 24; ++round) {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      // Resume from the pointer (as a restart does) and keep committing 1 MiB checkpoints.
      try {
        const ls::CheckpointRotation rot(stem, kKeep);
        const auto latest = ls::latest_checkpoint(stem);
        std::int64_t step = latest ? std::stoll(ls::load_checkpoint(*latest).metadata.at("step")) : 0;
        for (;;) save(rot, ++step, 1 << 18);
      } catch (...) {
        ::_exit(3);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + 13 * round));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));
    const auto latest = ls::latest_checkpoint(stem);
    if (!latest) continue;  // killed before its first commit
    const std::int64_t step = verified_step(*latest);
    CHECK(*latest == ls::CheckpointRotation(stem, kKeep).path_for(step));
    CHECK(step >= last_seen);  // the pointer never moves back
    last_seen = step;
    // At most keep committed files, plus one written but not committed, plus one being pruned.
    CHECK(ls::CheckpointRotation(stem, kKeep).files().size() <= kKeep + 2);
  }
  CHECK(last_seen > 0);
}

namespace {

/// Runs f() with this process's stderr going to a file; returns what was written there.
template <class F>
std::string stderr_of(F&& f) {
  const fs::path file = fs::temp_directory_path() / ("lockstep-rotation-stderr-" + std::to_string(::getpid()));
  std::fflush(stderr);
  const int saved = ::dup(2);
  FILE* out = std::fopen(file.c_str(), "w");
  REQUIRE(out != nullptr);
  ::dup2(::fileno(out), 2);
  try {
    f();
  } catch (...) {
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    std::fclose(out);
    throw;
  }
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::fclose(out);
  std::ifstream in(file);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  fs::remove(file);
  return text;
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("a commit below committed checkpoints (a resume from an older one) sets them aside, never deletes them",
          "[checkpoint][rotation]") {
  TempDir d;
  const ls::CheckpointRotation rot(d.path / "ck", 2);
  save(rot, 10);
  save(rot, 20);
  save(rot, 30);
  save(rot, 40);
  // A writer killed between its file and the pointer: 50 was never committed.
  ls::save_checkpoint(rot.path_for(50), make(50));
  REQUIRE(steps_on_disk(rot) == std::vector<std::int64_t>{30, 40, 50});
  // Resumed by hand from 30: the next commit is 35, below the committed 40.
  const std::string said = stderr_of([&] { save(rot, 35); });
  CHECK(*ls::latest_checkpoint(d.path / "ck") == rot.path_for(35));
  CHECK(steps_on_disk(rot) == std::vector<std::int64_t>{30, 35});  // 50 (never committed) removed
  const fs::path aside = d.path / "ck.set-aside-000035";
  REQUIRE(fs::is_directory(aside));
  CHECK(names_in(aside) == std::vector<std::string>{"ck-000040.safetensors"});
  CHECK(verified_step(aside / "ck-000040.safetensors") == 40);
  CHECK(said.find("set aside, not deleted: ck-000040.safetensors in " + aside.string()) != std::string::npos);
  CHECK(std::count(said.begin(), said.end(), '\n') == 1);
  // Going on from there is an ordinary rotation: nothing more is set aside or said.
  CHECK(stderr_of([&] {
          save(rot, 36);
          save(rot, 37);
        }).empty());
  CHECK(steps_on_disk(rot) == std::vector<std::int64_t>{36, 37});
  // A second resume from an older checkpoint gets a folder of its own.
  ls::save_checkpoint(rot.path_for(12), make(12));
  const std::string again = stderr_of([&] { rot.commit(12); });
  CHECK(names_in(d.path / "ck.set-aside-000012") ==
        std::vector<std::string>{"ck-000036.safetensors", "ck-000037.safetensors"});
  CHECK(again.find("ck-000036.safetensors, ck-000037.safetensors") != std::string::npos);
  CHECK(steps_on_disk(rot) == std::vector<std::int64_t>{12});
  ls::save_checkpoint(rot.path_for(11), make(11));
  (void)stderr_of([&] { rot.commit(11); });
  CHECK(names_in(d.path / "ck.set-aside-000011") == std::vector<std::string>{"ck-000012.safetensors"});
  ls::save_checkpoint(rot.path_for(10), make(10));
  (void)stderr_of([&] { rot.commit(10); });
  save(rot, 11);  // 11 again: ck.set-aside-000011 exists
  ls::save_checkpoint(rot.path_for(10), make(10));
  (void)stderr_of([&] { rot.commit(10); });
  CHECK(fs::is_directory(d.path / "ck.set-aside-000010.2"));
}

TEST_CASE("with no pointer (removed to start afresh) every numbered file counts as committed and is set aside",
          "[checkpoint][rotation]") {
  TempDir d;
  const ls::CheckpointRotation rot(d.path / "ck", 3);
  save(rot, 7);
  save(rot, 8);
  fs::remove(rot.pointer_path());
  const std::string said = stderr_of([&] { save(rot, 1); });
  CHECK(steps_on_disk(rot) == std::vector<std::int64_t>{1});
  CHECK(names_in(d.path / "ck.set-aside-000001") ==
        std::vector<std::string>{"ck-000007.safetensors", "ck-000008.safetensors"});
  CHECK(said.find("set aside") != std::string::npos);
}

TEST_CASE("Newer::remove deletes committed checkpoints newer than a commit, and says so", "[checkpoint][rotation]") {
  TempDir d;
  const ls::CheckpointRotation rot(d.path / "ck", 3, ls::CheckpointRotation::Newer::remove);
  CHECK(rot.newer() == ls::CheckpointRotation::Newer::remove);
  save(rot, 10);
  save(rot, 20);
  save(rot, 30);
  const std::string said = stderr_of([&] { save(rot, 15); });
  CHECK(steps_on_disk(rot) == std::vector<std::int64_t>{10, 15});
  CHECK(names_in(d.path) == std::vector<std::string>{"ck-000010.safetensors", "ck-000015.safetensors", "ck.latest"});
  CHECK(said.find("deleted (CheckpointRotation::Newer::remove): ck-000020.safetensors, ck-000030.safetensors") !=
        std::string::npos);
}
