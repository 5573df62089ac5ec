// A checkpoint write killed (SIGKILL) at any point leaves the previous checkpoint intact: a
// child process saves checkpoints in a loop and is killed after a different delay each round;
// after each kill the file must load, pass its checksum, and hold one complete checkpoint (every
// element equal to its "epoch" metadata), never a mix or a torn file. No MPI: single process.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

#include "lockstep/io/checkpoint.hpp"

namespace fs = std::filesystem;
namespace ls = lockstep;

namespace {

constexpr std::int64_t kElements = 1 << 20;  // 4 MiB of f32: several writes per round, each long enough to be hit

ls::Checkpoint make(long epoch) {
  ls::Checkpoint ck;
  ck.add("w", ls::Tensor::full({kElements}, static_cast<double>(epoch)));
  ck.add("b", ls::Tensor::full({3}, static_cast<double>(epoch)));
  ck.metadata["epoch"] = std::to_string(epoch);
  return ck;
}

// Empty if the file holds one complete checkpoint, else what is wrong.
std::string verify(const fs::path& p, long& epoch) {
  try {
    ls::Checkpoint ck = ls::load_checkpoint(p);
    epoch = std::stol(ck.metadata.at("epoch"));
    for (const char* name : {"w", "b"})
      for (float v : ck.at(name).span<float>())
        if (v != static_cast<float>(epoch)) return std::string("tensor ") + name + " is not all " + std::to_string(epoch);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace

int main() {
  const fs::path dir = fs::temp_directory_path() / ("lockstep-killed-writer-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path p = dir / "ck.safetensors";
  ls::save_checkpoint(p, make(0));
  int failures = 0, rounds = 24;
  long last = 0;
  for (int round = 0; round < rounds; ++round) {
    pid_t child = ::fork();
    if (child < 0) {
      std::perror("fork");
      return 1;
    }
    if (child == 0) {
      for (long e = 1;; ++e) ls::save_checkpoint(p, make(1000L * (round + 1) + e));
    }
    // Delays spread over a write's duration and beyond, different each round.
    std::this_thread::sleep_for(std::chrono::microseconds(2000 + (round * 7919) % 300000));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    long epoch = -1;
    const std::string problem = verify(p, epoch);
    if (!problem.empty()) {
      std::fprintf(stderr, "round %d: the checkpoint is not intact after the kill: %s\n", round, problem.c_str());
      ++failures;
    } else if (epoch != last && epoch / 1000 != round + 1) {
      std::fprintf(stderr, "round %d: epoch %ld is neither the previous one (%ld) nor this round's\n", round,
                   epoch, last);
      ++failures;
    } else {
      std::printf("round %d: killed after %s; checkpoint intact (epoch %ld)\n", round,
                  WIFSIGNALED(status) ? "SIGKILL" : "exit", epoch);
      last = epoch;
    }
  }
  // A killed writer may leave its temporary file behind (it cannot clean up after SIGKILL);
  // the checkpoint itself is never affected, and the next successful save removes them.
  auto count_leftovers = [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir)) n += e.path() != p ? 1 : 0;
    return n;
  };
  const int leftovers = count_leftovers();
  ls::save_checkpoint(p, make(999999));
  const int after_save = count_leftovers();
  std::printf("%d rounds, %d failures, %d temporary files left by killed writers, %d after the next save\n",
              rounds, failures, leftovers, after_save);
  if (after_save != 0) {
    std::fprintf(stderr, "the next successful save left %d stale temporary files behind\n", after_save);
    ++failures;
  }
  fs::remove_all(dir);
  return failures == 0 ? 0 : 1;
}
