// Two processes saving the same checkpoint path at the same time, 40 times each: every save must
// succeed (neither may delete the other's temporary file as a stale leftover), and the file must
// end up as one complete checkpoint of one of the two, with no temporary file left behind. No
// MPI: two forked writers, like two jobs sharing a directory.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "lockstep/io/checkpoint.hpp"

namespace fs = std::filesystem;
namespace ls = lockstep;

namespace {

constexpr int kSaves = 40;
constexpr std::int64_t kElements = 1 << 16;  // 256 KiB: each save takes long enough to overlap

ls::Checkpoint make(int writer) {
  ls::Checkpoint ck;
  ck.add("w", ls::Tensor::full({kElements}, static_cast<double>(writer)));
  ck.metadata["writer"] = std::to_string(writer);
  return ck;
}

// In a child: kSaves saves; the exit code is the number that failed.
[[noreturn]] void writer(const fs::path& p, int id, int start_fd) {
  char go = 0;
  if (::read(start_fd, &go, 1) != 1) std::_Exit(100);  // both start together
  const ls::Checkpoint ck = make(id);
  int failed = 0;
  for (int i = 0; i < kSaves; ++i) {
    try {
      ls::save_checkpoint(p, ck);
    } catch (const std::exception& e) {
      if (failed++ == 0) std::fprintf(stderr, "writer %d, save %d: %s\n", id, i, e.what());
    }
  }
  std::_Exit(failed);
}

}  // namespace

int main() {
  const fs::path dir = fs::temp_directory_path() / ("lockstep-concurrent-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path p = dir / "ck.safetensors";
  int start[2];
  if (::pipe(start) != 0) return 2;
  pid_t kids[2];
  for (int id = 0; id < 2; ++id) {
    kids[id] = ::fork();
    if (kids[id] < 0) return 2;
    if (kids[id] == 0) {
      ::close(start[1]);
      writer(p, id + 1, start[0]);
    }
  }
  ::close(start[0]);
  if (::write(start[1], "gg", 2) != 2) return 2;
  ::close(start[1]);
  int problems = 0;
  for (int id = 0; id < 2; ++id) {
    int status = 0;
    ::waitpid(kids[id], &status, 0);
    const int failed = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::printf("writer %d: %d of %d saves failed\n", id + 1, failed, kSaves);
    if (failed != 0) ++problems;
  }
  try {
    const ls::Checkpoint got = ls::load_checkpoint(p);
    const int w = std::stoi(got.metadata.at("writer"));
    if (w != 1 && w != 2) throw std::runtime_error("unknown writer " + std::to_string(w));
    if (!ls::bitwise_equal(got.at("w"), make(w).at("w"))) throw std::runtime_error("data is not writer's");
    std::printf("the file is writer %d's checkpoint, complete\n", w);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "the final file is not a valid checkpoint of either writer: %s\n", e.what());
    ++problems;
  }
  int leftovers = 0;
  for (const auto& e : fs::directory_iterator(dir)) leftovers += e.path() != p ? 1 : 0;
  if (leftovers != 0) {
    std::fprintf(stderr, "%d temporary files left behind\n", leftovers);
    ++problems;
  }
  fs::remove_all(dir);
  return problems == 0 ? 0 : 1;
}
