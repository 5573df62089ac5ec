// bench_checkpoint: save and load of a model of --mib MiB (default 1024; GPT-2 small's parameter
// shapes, repeated until the size is reached, as f32) against `cp` of the same file, measured in
// the same run, interleaved, in alternating order. One process (run it without mpiexec, or at
// one rank).
//
//   save       ls::save_checkpoint(path, ck), ck holding views of the model's tensors: header,
//              data straight from the tensors with the streaming CRC-32C, fsync, rename, fsync
//              of the directory
//   cp+fsync   /bin/cp of the saved file to a new file, then fsync of the copy: what save
//              guarantees (the data on disk), done by the standard tool
//   cp         /bin/cp alone (the copy may still be in the page cache only)
//   load       ls::load_checkpoint(path): header, data straight into new tensors, checksum
//   restore    ls::restore_from_checkpoint(loaded, model): the copy into the model that the
//              collective load adds after verifying (verify-then-copy, docs/architecture/checkpoint-io.md)
//   buffered   the way through one buffer of the whole file: serialize_checkpoint then
//              write_file_atomically for a save, reading the file into a buffer then
//              parse_checkpoint for a load (what 0.1 did, with one copy less on each side)
//
//   cp over old  /bin/cp onto the existing copy: it truncates the old file, and ext4 then starts
//              writing the new data back when cp closes it (its auto_da_alloc heuristic for
//              files replaced by truncation), so this is about cp+fsync on ext4
//
// A save replaces the file of the previous save (rename), as a checkpoint does; "cp" and
// "cp+fsync" write a new file (the old copy removed before the clock starts).
//
// The file is in the page cache for every load and cp (it was just written): the figures are
// the cost of the code and of the page cache, not of the disk's read speed. Between timed blocks
// sync(2) runs, untimed, so that one block's dirty pages are not written back during the next.
//
// Run: ./bench_checkpoint [--mib 1024] [--dir DIR] [--reps 3] [--json out.json] [--quick]
#include <lockstep/io/checkpoint.hpp>

#include <fcntl.h>
#include <spawn.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>

#include "../src/io/crc32c.hpp"
#include "bench_common.hpp"

extern char** environ;

namespace ls = lockstep;
namespace fs = std::filesystem;

namespace {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      return colon == std::string::npos ? line : line.substr(colon + 2);
    }
  return "unknown CPU";
}

std::string fs_type(const fs::path& dir) {
  struct statfs s {};
  if (::statfs(dir.c_str(), &s) != 0) return "unknown";
  switch (static_cast<unsigned long>(s.f_type)) {
    case 0xEF53: return "ext4";
    case 0x01021994: return "tmpfs";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x794C7630: return "overlayfs";
    default: return "other";
  }
}

/// Runs /bin/cp src dst and waits for it; throws if it fails.
void run_cp(const fs::path& src, const fs::path& dst) {
  std::string a0 = "cp", a1 = src.string(), a2 = dst.string();
  char* argv[] = {a0.data(), a1.data(), a2.data(), nullptr};
  pid_t pid = 0;
  if (::posix_spawn(&pid, "/bin/cp", nullptr, nullptr, argv, environ) != 0)
    throw std::runtime_error("cannot start /bin/cp");
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("cp " + a1 + " " + a2 + " failed");
}

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) throw std::runtime_error("cannot fsync " + p.string());
  ::close(fd);
}

std::vector<std::byte> read_whole(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + p.string());
  std::vector<std::byte> out(fs::file_size(p));
  std::size_t got = 0;
  while (got < out.size()) {
    const ssize_t r = ::read(fd, out.data() + got, out.size() - got);
    if (r <= 0) throw std::runtime_error("cannot read " + p.string());
    got += static_cast<std::size_t>(r);
  }
  ::close(fd);
  return out;
}

template <class F>
double timed(F&& f) {
  ::sync();
  const double t0 = bench::now();
  f();
  return bench::now() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  bench::Options opt("bench_checkpoint", "save and load of a checkpoint against cp of the same file (one process)", 3);
  double mib = 1024;
  std::string dir_flag = fs::temp_directory_path().string();
  auto* mib_flag = opt.app.add_option("--mib", mib, "size of the model (64 with --quick)")->type_name("MIB")
                       ->check(lockstep_cli::positive());
  opt.app.add_option("--dir", dir_flag, "where the files are written (a folder of their own inside)")
      ->type_name("DIR");
  if (const auto rc = opt.parse(argc, argv)) {
    MPI_Finalize();
    return *rc;
  }
  opt.quick_default(mib, mib_flag, 64);
  opt.quick_default(opt.reps, opt.reps_flag, 2);
  int rc = 0;
  try {
    const int reps = opt.reps;
    const fs::path dir = fs::path(dir_flag) / ("lockstep-bench-ck-" + std::to_string(::getpid()));
    fs::create_directories(dir);

    // The model: GPT-2 small's shapes as f32, repeated (prefix r0., r1., ...) until it holds mib MiB.
    const auto shapes = bench::read_shapes(bench::shapes_dir() + "/gpt2_small.txt");
    const auto target = static_cast<std::int64_t>(mib * 1024 * 1024 / 4);
    std::vector<ls::Tensor> model;
    std::vector<std::string> names;
    std::int64_t total = 0;
    for (int r = 0; total < target; ++r)
      for (const auto& p : shapes) {
        if (total >= target) break;
        const std::int64_t n = std::min(p.numel, target - total);
        ls::Tensor t = ls::Tensor::empty({n}, ls::DType::f32);
        float* d = t.data<float>();
        for (std::int64_t i = 0; i < n; ++i) d[i] = static_cast<float>((i * 7 + r) % 1000) * 0.001f;
        model.push_back(std::move(t));
        names.push_back("r" + std::to_string(r) + "." + p.name);
        total += n;
      }
    const double bytes = static_cast<double>(total) * 4;
    ls::Checkpoint ck;
    for (std::size_t i = 0; i < model.size(); ++i) ck.add(names[i], model[i].reshape_view(model[i].shape()));
    ck.metadata["step"] = "1";

    const fs::path file = dir / "model.safetensors";
    const fs::path copy = dir / "copy.safetensors";
    const fs::path buffered = dir / "buffered.safetensors";
    std::map<std::string, std::vector<double>> t;
    bool ok = true;
    auto check_loaded = [&](const ls::Checkpoint& back) {
      ok = ok && back.tensors.size() == model.size() && back.metadata.at("step") == "1";
      for (std::size_t i = 0; ok && i < model.size(); i += 37)
        ok = std::memcmp(back.tensors[i].second.raw_data(), model[i].raw_data(), model[i].nbytes()) == 0;
    };
    // Warm-up: the files exist (each timed block replaces one) and the saved one is in the page cache.
    ls::save_checkpoint(file, ck);
    ls::save_checkpoint(buffered, ck);
    run_cp(file, copy);
    for (int rep = 0; rep < reps; ++rep) {
      std::vector<std::function<void()>> blocks = {
          [&] { t["save"].push_back(timed([&] { ls::save_checkpoint(file, ck); })); },
          [&] {
            fs::remove(copy);
            t["cp+fsync"].push_back(timed([&] {
              run_cp(file, copy);
              fsync_path(copy);
            }));
          },
          [&] {
            fs::remove(copy);
            t["cp"].push_back(timed([&] { run_cp(file, copy); }));
          },
          [&] { t["cp over old"].push_back(timed([&] { run_cp(file, copy); })); },
          [&] {
            std::optional<ls::Checkpoint> back;
            t["load"].push_back(timed([&] { back.emplace(ls::load_checkpoint(file)); }));
            check_loaded(*back);
            std::vector<ls::Tensor> into;
            for (const auto& m : model) into.push_back(ls::Tensor::zeros(m.shape(), m.dtype()));
            // What restore_from_checkpoint does for each leaf once the names are matched.
            t["restore"].push_back(timed([&] {
              for (std::size_t i = 0; i < into.size(); ++i) into[i].copy_from(back->tensors[i].second.view());
            }));
            ok = ok && std::memcmp(into.back().raw_data(), model.back().raw_data(), model.back().nbytes()) == 0;
          },
          [&] {
            t["buffered save"].push_back(timed([&] { ls::write_file_atomically(buffered, ls::serialize_checkpoint(ck)); }));
          },
          [&] {
            std::optional<ls::Checkpoint> back;
            t["buffered load"].push_back(timed([&] { back.emplace(ls::parse_checkpoint(read_whole(file))); }));
            check_loaded(*back);
          },
      };
      // Alternating order, so that drift in the machine's load hits every variant alike.
      if (rep % 2 == 1) std::reverse(blocks.begin(), blocks.end());
      for (auto& b : blocks) b();
    }
    fs::remove_all(dir);

    // CRC-32C alone, over 256 MiB in memory.
    std::vector<std::byte> buf(256u << 20, std::byte{0x5A});
    double crc_s = 1e9;
    for (int i = 0; i < 3; ++i) {
      const double t0 = bench::now();
      volatile std::uint32_t c = ls::crc32c(buf);
      (void)c;
      crc_s = std::min(crc_s, bench::now() - t0);
    }

    auto best = [&](const std::string& k) { return *std::min_element(t[k].begin(), t[k].end()); };
    auto median = [&](const std::string& k) { return bench::stats_of(t[k]).median; };
    std::printf("## Checkpoint save and load against cp (%s, %zu tensors, %s on %s)\n\n",
                bench::human_bytes(bytes).c_str(), model.size(), dir.parent_path().c_str(),
                fs_type(dir.parent_path()).c_str());
    std::printf("- CPU: %s; CRC-32C path: %s, %.1f GB/s\n- best and median of %d runs each, "
                "interleaved; the file in the page cache\n\n",
                cpu_model().c_str(), ls::detail::crc32c_implementation(), 0.25 * 1.073741824 / crc_s, reps);
    bench::Table table({"operation", "best s", "median s", "GB/s (best)", "vs cp+fsync", "vs cp"});
    for (const std::string k : {"save", "cp+fsync", "cp", "cp over old", "load", "restore", "buffered save", "buffered load"}) {
      table.add({k, bench::fmt(best(k), 3), bench::fmt(median(k), 3), bench::fmt(bytes / best(k) / 1e9, 2),
                 bench::fmt(best(k) / best("cp+fsync"), 2) + "x", bench::fmt(best(k) / best("cp"), 2) + "x"});
    }
    table.print();
    std::printf("save / (cp+fsync) = %.2f, load / cp = %.2f, (load + restore) / cp = %.2f  (target: 1.5 or less)\n",
                best("save") / best("cp+fsync"), best("load") / best("cp"),
                (best("load") + best("restore")) / best("cp"));
    if (!ok) std::printf("ERROR: a loaded checkpoint differs from the model\n");

    if (!opt.json.empty()) {
      bench::Json j = bench::run_info("checkpoint");
      j.set("bytes", bytes).set("tensors", static_cast<std::int64_t>(model.size()));
      j.set("cpu", cpu_model()).set("crc32c", std::string(ls::detail::crc32c_implementation()));
      j.set("dir_fs", fs_type(dir.parent_path())).set("crc32c_gbps", 0.25 * 1.073741824 / crc_s);
      bench::Json ops = bench::Json::object();
      for (const auto& [k, v] : t) ops.set(k, bench::Json::object().set("best_s", best(k)).set("median_s", median(k)));
      j.set("seconds", ops);
      j.set("save_vs_cp_fsync", best("save") / best("cp+fsync")).set("load_vs_cp", best("load") / best("cp"));
      std::ofstream(opt.json) << j.str() << "\n";
    }
    rc = ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_checkpoint: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
