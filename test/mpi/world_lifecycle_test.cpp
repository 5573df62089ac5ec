// The life cycle of the global backend, which the shared test main cannot show because it
// initialises MPI itself. One program, one scenario per run (argv[1]):
//   owned     Lockstep initialises MPI: before/after states, idempotence, finalize<> ends MPI.
//   borrowed  the program initialises MPI itself: finalize<> leaves MPI alone, and the backend
//             (with its f16/bf16 operators) can be initialised again.
//   autoinit  AutoInit initialises, runs the worker init, and finalises on scope exit.
//   atexit    initialise and return from main: the exit handler finalises MPI (mpiexec fails
//             the run if a process exits without MPI_Finalize).
// Before finalisation the ranks agree on a verdict with MPI; afterwards each exits non-zero on
// its own failure, which mpiexec reports.
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "lockstep/lockstep.hpp"

namespace ls = lockstep;

namespace {

int g_failures = 0;

#define EXPECT(cond)                                                                  \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: expectation failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                   \
    }                                                                                 \
  } while (0)

bool mpi_initialized() {
  int i = 0;
  MPI_Initialized(&i);
  return i != 0;
}
bool mpi_finalized() {
  int f = 0;
  MPI_Finalized(&f);
  return f != 0;
}

// Everything that must hold before anything is initialised.
void expect_uninitialised_state() {
  EXPECT(!ls::initialized<ls::MPIBackend>());
  EXPECT(!ls::is_available());
  const ls::WorldInfo w = ls::world_info();
  EXPECT(w.rank == 0 && w.size == 1 && w.local_rank == 0 && w.local_size == 1);
  bool threw = false;
  try {
    (void)ls::get_distributed_backend<ls::MPIBackend>();
  } catch (const ls::Error& e) {
    threw = std::strstr(e.what(), "initialize") != nullptr;
  }
  EXPECT(threw);
  // Without MPI every process is a world of one, so it is rank 0.
  EXPECT(ls::rank_zero_only([] { return 1; }).has_value());
}

// Collective: every rank's failure count, summed; a failing rank names itself.
int agreed_failures() {
  int total = 0;
  MPI_Allreduce(&g_failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  return total;
}

// An f16 allreduce over the global backend, exact for small integers.
void expect_f16_sum() {
  auto& b = ls::get_distributed_backend<ls::MPIBackend>();
  ls::Tensor x = ls::Tensor::full({9}, 1.0, ls::DType::f16);
  b.allreduce(x, ls::ReduceOp::sum);
  EXPECT(ls::to_float(x.data<ls::half>()[8]) == static_cast<float>(b.size()));
}

int run_owned() {
  expect_uninitialised_state();
  ls::initialize<ls::MPIBackend>();
  EXPECT(mpi_initialized());
  EXPECT(ls::initialized<ls::MPIBackend>());
  EXPECT(ls::is_available());
  int provided = 0;
  MPI_Query_thread(&provided);
  EXPECT(provided == MPI_THREAD_MULTIPLE);
  ls::MPIBackend* first = &ls::get_distributed_backend<ls::MPIBackend>();
  ls::initialize<ls::MPIBackend>();
  EXPECT(first == &ls::get_distributed_backend<ls::MPIBackend>());
  expect_f16_sum();
  if (agreed_failures() != 0) g_failures = 1;
  ls::finalize<ls::MPIBackend>();
  EXPECT(!ls::initialized<ls::MPIBackend>());
  EXPECT(mpi_finalized());  // Lockstep started MPI, so it ended it
  EXPECT(!ls::is_available());
  bool threw = false;
  try {
    ls::initialize<ls::MPIBackend>();
  } catch (const ls::Error&) {
    threw = true;  // MPI cannot be initialised twice in one process
  }
  EXPECT(threw);
  return g_failures;
}

int run_borrowed(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  EXPECT(!ls::initialized<ls::MPIBackend>());
  EXPECT(ls::is_available());
  ls::initialize<ls::MPIBackend>();
  expect_f16_sum();
  ls::finalize<ls::MPIBackend>();
  EXPECT(!ls::initialized<ls::MPIBackend>());
  EXPECT(!mpi_finalized());  // the program owns MPI
  // Again: the backend and its user-defined reduction operators come back.
  ls::initialize<ls::MPIBackend>();
  EXPECT(ls::initialized<ls::MPIBackend>());
  expect_f16_sum();
  {
    auto& b = ls::get_distributed_backend<ls::MPIBackend>();
    ls::Tensor y = ls::Tensor::full({3}, 2.0, ls::DType::bf16);
    b.allreduce(y, ls::ReduceOp::max);
    EXPECT(ls::to_float(y.data<ls::bfloat16>()[0]) == 2.0f);
  }
  if (agreed_failures() != 0) g_failures = 1;
  ls::finalize<ls::MPIBackend>();
  EXPECT(!mpi_finalized());
  MPI_Finalize();  // would fail had Lockstep finalised MPI behind the program's back
  return g_failures;
}

int run_autoinit() {
  expect_uninitialised_state();
  int inits = 0;
  {
    ls::AutoInit guard([&] { ++inits; });
    EXPECT(inits == 1);
    EXPECT(ls::initialized<ls::MPIBackend>());
    EXPECT(ls::world_info().size >= 1);
    expect_f16_sum();
    if (agreed_failures() != 0) g_failures = 1;
  }
  EXPECT(!ls::initialized<ls::MPIBackend>());
  EXPECT(mpi_finalized());
  return g_failures;
}

int run_atexit() {
  ls::initialize<ls::MPIBackend>();
  expect_f16_sum();
  if (agreed_failures() != 0) g_failures = 1;
  return g_failures;  // no finalize: the exit handler calls MPI_Finalize
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  int failures;
  if (mode == "owned") failures = run_owned();
  else if (mode == "borrowed") failures = run_borrowed(argc, argv);
  else if (mode == "autoinit") failures = run_autoinit();
  else if (mode == "atexit") failures = run_atexit();
  else {
    std::fprintf(stderr, "usage: %s owned|borrowed|autoinit|atexit\n", argv[0]);
    return 2;
  }
  if (failures != 0) std::fprintf(stderr, "world_lifecycle %s: %d failures\n", mode.c_str(), failures);
  return failures != 0 ? 1 : 0;
}
