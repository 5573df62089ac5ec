# Remote calls (remote.hpp): TorchOpt's driver/worker model over MPI, at 1 to 4 ranks.
lockstep_test_executable(test_remote remote/remote_test.cpp)
lockstep_add_mpi_test(NAME remote TARGET test_remote RANKS 1 2 3 4 TIMEOUT 300)
# Once over TCP, the transport a multi-node job takes.
lockstep_add_mpi_test(NAME remote TARGET test_remote RANKS 3 TCP TIMEOUT 300)
