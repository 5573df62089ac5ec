# Training core: optimizer rules and traversal (unit), synchronize, DistributedOptimizer and data
# partitioning (mpi, at 1 to 4 ranks).
lockstep_add_unit_test(NAME optimizer_rules TARGET test_optimizer_rules SOURCES train/optimizer_rules_test.cpp
                       TIMEOUT 120)
# DistributedOptimizer at 1 to 4 ranks, and at 3 over TCP (a multi-node job's transport).
lockstep_add_mpi_test(NAME training TARGET test_training SOURCES train/training_test.cpp RANKS 1 2 3 4 TIMEOUT 300)
lockstep_add_mpi_test(NAME training TARGET test_training RANKS 3 TCP TIMEOUT 300)
# And at 4 ranks as two "machines" of two (LOCKSTEP_TEST_HOST_SIZE, fault-injection builds): the
# blocking host allreduces take the hierarchical path (tests_10_foundation.cmake).
if(LOCKSTEP_FAULT_INJECTION)
  lockstep_add_mpi_test(NAME training.hierarchical TARGET test_training RANKS 4 ENV LOCKSTEP_TEST_HOST_SIZE=2
                        TIMEOUT 300)
endif()
# Deterministic mode (exact sums): the same bits at 1 to 4 ranks as one process, and at 4 ranks
# as two simulated machines (every host call hierarchical: the placement changes nothing).
lockstep_add_mpi_test(NAME deterministic TARGET test_deterministic SOURCES train/deterministic_test.cpp RANKS 1 2 3 4
                      TIMEOUT 120)
# The fused exact sum (shared memory) over slices of 4 KiB: thousands of slices and shares.
lockstep_add_mpi_test(NAME deterministic.small_slices TARGET test_deterministic RANKS 2
                      ENV LOCKSTEP_SHM_SLICE_BYTES=4096 TIMEOUT 120)
if(LOCKSTEP_FAULT_INJECTION)
  lockstep_add_mpi_test(NAME deterministic.hierarchical TARGET test_deterministic RANKS 4
                        ENV LOCKSTEP_TEST_HOST_SIZE=2 LOCKSTEP_TEST_HIER_MIN_BYTES=0 TIMEOUT 120)
endif()
# micro_batches: the deal of micro-batches by global index (deterministic training), at 1-4 ranks.
foreach(area IN ITEMS synchronize data micro_batches)
  lockstep_add_mpi_test(NAME ${area} TARGET test_${area} SOURCES train/${area}_test.cpp RANKS 1 2 3 4 TIMEOUT 120)
endforeach()

# A type that is not traversable is a compile-time error with Lockstep's message.
get_target_property(_ls_inc lockstep_core INCLUDE_DIRECTORIES)
set(_ls_inc_flags)
foreach(d IN LISTS _ls_inc)
  string(REGEX REPLACE "^\\$<BUILD_INTERFACE:(.*)>$" "\\1" d "${d}")
  if(NOT d MATCHES "^\\$<")
    list(APPEND _ls_inc_flags "-I${d}")
  endif()
endforeach()
add_test(NAME traverse_not_traversable
  COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only ${_ls_inc_flags}
          ${CMAKE_CURRENT_SOURCE_DIR}/core/traverse_not_traversable.cpp)
set_tests_properties(traverse_not_traversable PROPERTIES LABELS unit
  PASS_REGULAR_EXPRESSION "this type is not traversable")
# The scalar allreduce, Request and Future are [[nodiscard]]: dropping one is a warning naming
# why (all three in one compile; the expression needs every message, in source order).
add_test(NAME allreduce_scalar_nodiscard
  COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only -Werror=unused-result ${_ls_inc_flags}
          ${CMAKE_CURRENT_SOURCE_DIR}/train/allreduce_nodiscard.cpp)
set_tests_properties(allreduce_scalar_nodiscard PROPERTIES LABELS unit
  PASS_REGULAR_EXPRESSION "the scalar allreduce returns the reduced value.*a dropped Request waits at once.*a dropped Future abandons the call")

# The optimizer loops vectorise with GCC (the core builds with -O3 -fno-math-errno in Release).
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  foreach(rule IN ITEMS ADAM SGD)
    add_test(NAME optim_math_vectorizes.${rule}
      COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -O3 -fno-math-errno -fopt-info-vec-optimized
              -DPROBE_${rule} ${_ls_inc_flags} -c ${CMAKE_CURRENT_SOURCE_DIR}/train/optim_vectorize_probe.cpp
              -o /dev/null)
    set_tests_properties(optim_math_vectorizes.${rule} PROPERTIES LABELS unit
      PASS_REGULAR_EXPRESSION "optim_math.hpp:[0-9]+:[0-9]+: optimized: loop vectorized")
  endforeach()
endif()

# Scale options: ZeRO-1 sharded optimizer state and 16-bit gradients on the wire, at 1 to 4
# ranks; a sharded checkpoint saved at 4 ranks and resumed at 3 (sharded) and 1 (replicated).
lockstep_test_executable(test_sharded train/sharded_test.cpp)
lockstep_add_mpi_test(NAME sharded TARGET test_sharded RANKS 1 2 3 4 TIMEOUT 300)
# The slices of a tensor far larger than a tiny bucket_bytes, at 3 ranks over MPI (the
# shared-memory path off, as across hosts): 349,526 allreduces a step before kMinSliceBytes (27 s
# over vader and a failed count, minutes over TCP); about a second now.
lockstep_add_mpi_test(NAME sharded_slices_noshm TARGET test_sharded RANKS 3 ARGS "[slices]" ENV LOCKSTEP_SHM=0
                      TIMEOUT 60)
set(_ls_sharded_ckpt ${CMAKE_CURRENT_BINARY_DIR}/sharded_resume.safetensors)
lockstep_add_mpi_test(NAME sharded_ckpt_save TARGET test_sharded RANKS 4 TIMEOUT 120 ARGS "[.ckpt_save]"
  ENV LOCKSTEP_TEST_CKPT=${_ls_sharded_ckpt})
lockstep_add_mpi_test(NAME sharded_ckpt_resume TARGET test_sharded RANKS 3 1 TIMEOUT 120 ARGS "[.ckpt_resume]"
  ENV LOCKSTEP_TEST_CKPT=${_ls_sharded_ckpt})
set_tests_properties(sharded_ckpt_save.np4 PROPERTIES FIXTURES_SETUP sharded_ckpt)
set_tests_properties(sharded_ckpt_resume.np3 sharded_ckpt_resume.np1 PROPERTIES FIXTURES_REQUIRED sharded_ckpt)
