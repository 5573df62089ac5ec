// bench_phases: why the shared-memory path copies into its slots with streaming stores. Rank 0
// produces 1 MiB chunks in a shared-memory window and rank 1 reads each right after (as a peer
// reads a slot), once a second for N seconds:
//   dirty:     rank 0 writes with ordinary stores, so rank 1 reads lines still modified in rank
//              0's cache (cache-to-cache transfer);
//   cold-read: rank 1 reads 64 MiB nobody wrote recently (from memory);
//   streamed:  rank 0 writes with non-temporal stores, so rank 1 reads from memory.
// On a virtual machine whose vCPUs the host moves between cache domains, "dirty" drops by up to
// 8x in some periods while the other two do not (docs/performance/where-the-time-goes.md, "Phases").
//
// Run: mpiexec -n 2 ./bench_phases [SECONDS]   (default 30; x86-64 only)
#include <emmintrin.h>
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include <unistd.h>

#include "lockstep_cli.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int seconds = 30;
  lockstep_cli::App app("bench_phases", "cache-to-cache reads against reads from memory, once a second (2 ranks, x86-64)");
  app.add_option("seconds", seconds, "how many one-second samples")->check(lockstep_cli::at_least(1));
  if (const auto rc = lockstep_cli::parse(app, argc, argv)) {
    MPI_Finalize();
    return *rc;
  }
  constexpr std::size_t kChunk = std::size_t{1} << 20;  // one slot
  constexpr std::size_t kChunks = 64;                   // per measurement
  constexpr std::size_t kCold = std::size_t{64} << 20;  // larger than the last-level cache

  // Rank 0's window holds two slots and the cold region; every rank maps it.
  char* base = nullptr;
  MPI_Win win;
  const MPI_Aint bytes = rank == 0 ? static_cast<MPI_Aint>(2 * kChunk + kCold + 4096) : 0;
  MPI_Win_allocate_shared(bytes, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
  MPI_Aint size = 0;
  int disp = 0;
  char* b0 = nullptr;
  MPI_Win_shared_query(win, 0, &size, &disp, &b0);
  char* slots = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(b0) + 63) & ~std::uintptr_t{63});
  char* cold = slots + 2 * kChunk;
  std::vector<char> src(kChunk, 1);
  if (rank == 0) std::memset(cold, 3, kCold);
  MPI_Barrier(MPI_COMM_WORLD);

  long long checksum = 0;  // keeps the reads
  auto read = [&](const char* p, std::size_t n, std::size_t stride_words) {
    long long acc = 0;
    const auto* w = reinterpret_cast<const long long*>(p);
    for (std::size_t i = 0; i < n / 8; i += stride_words) acc += w[i];  // one word per line
    checksum += acc;
  };
  for (int s = 0; s < seconds; ++s) {
    double gbs[3];
    for (int mode = 0; mode < 3; ++mode) {  // 0 dirty, 1 cold read, 2 streamed
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      if (mode == 1) {
        if (rank == 1) read(cold, kCold, 8);
      } else {
        for (std::size_t k = 0; k < kChunks; ++k) {
          char* d = slots + (k & 1) * kChunk;
          if (rank == 0) {
            if (mode == 0) {
              std::memcpy(d, src.data(), kChunk);
            } else {
              for (std::size_t i = 0; i < kChunk; i += 16)
                _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(src.data() + i)));
              _mm_sfence();
            }
          }
          MPI_Barrier(MPI_COMM_WORLD);
          if (rank == 1) read(d, kChunk, 8);
          MPI_Barrier(MPI_COMM_WORLD);
        }
      }
      double dt = MPI_Wtime() - t0, slowest = 0;
      MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      gbs[mode] = static_cast<double>(mode == 1 ? kCold : kChunks * kChunk) / slowest / 1e9;
    }
    if (rank == 0) {
      char when[16];
      const std::time_t now = std::time(nullptr);
      std::strftime(when, sizeof when, "%H:%M:%S", std::gmtime(&now));
      std::printf("%s  dirty %6.2f  cold-read %6.2f  streamed %6.2f  GB/s\n", when, gbs[0], gbs[1], gbs[2]);
      std::fflush(stdout);
    }
    sleep(1);
  }
  if (rank == 1 && checksum == 42) std::printf("(checksum)\n");
  MPI_Win_free(&win);
  MPI_Finalize();
  return 0;
}
