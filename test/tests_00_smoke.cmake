lockstep_test_executable(test_smoke smoke_test.cpp)
lockstep_add_mpi_test(NAME smoke TARGET test_smoke RANKS 2 TIMEOUT 60)
