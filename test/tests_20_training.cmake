# Training core: optimizer rules and traversal (unit), synchronize, DistributedOptimizer and data
# partitioning (mpi, at 1 to 4 ranks).
lockstep_test_executable(test_optimizer_rules optimizer_rules_test.cpp)
lockstep_add_unit_test(NAME optimizer_rules TARGET test_optimizer_rules TIMEOUT 120)

lockstep_test_executable(test_training training_test.cpp)
lockstep_add_mpi_test(NAME training TARGET test_training RANKS 1 2 3 4 TIMEOUT 300)

lockstep_test_executable(test_synchronize synchronize_test.cpp)
lockstep_add_mpi_test(NAME synchronize TARGET test_synchronize RANKS 1 2 3 4 TIMEOUT 120)

lockstep_test_executable(test_data data_test.cpp)
lockstep_add_mpi_test(NAME data TARGET test_data RANKS 1 2 3 4 TIMEOUT 120)
