# Checkpoints (reader, writer, rank-aware save/resume) and the examples run as a user runs them.
lockstep_test_executable(test_checkpoint checkpoint_test.cpp)
lockstep_add_unit_test(NAME checkpoint TARGET test_checkpoint LABELS checkpoint TIMEOUT 60)
lockstep_test_executable(test_checkpoint_mpi checkpoint_mpi_test.cpp)
lockstep_add_mpi_test(NAME checkpoint_mpi TARGET test_checkpoint_mpi RANKS 2 3 TIMEOUT 60)
