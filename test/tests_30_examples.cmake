# Checkpoints (reader, writer, rank-aware save/resume) and the examples run as a user runs them.
lockstep_test_executable(test_checkpoint checkpoint_test.cpp)
lockstep_add_unit_test(NAME checkpoint TARGET test_checkpoint LABELS checkpoint TIMEOUT 60)
