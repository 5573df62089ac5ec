# Helpers that register Lockstep's tests with CTest.
#
# lockstep_add_unit_test(NAME name TARGET target [LABELS ...] [TIMEOUT s])
#   a single-process test run directly.
# lockstep_add_mpi_test(NAME name TARGET target RANKS 1 2 3 4 [TCP] [GATE VAR] [LABELS ...]
#                       [TIMEOUT s] [ARGS ...])
#   one CTest test per rank count, run under mpiexec, gated by DIST_TEST_MPI (or GATE VAR):
#   without the variable set to "true" the test reports itself skipped. TCP runs it over Open
#   MPI's TCP transport (--mca btl tcp,self), the path a multi-node job takes.

set(LOCKSTEP_TEST_ENV
  "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")

function(lockstep_add_unit_test)
  cmake_parse_arguments(T "" "NAME;TARGET;TIMEOUT" "LABELS;ARGS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  add_test(NAME ${T_NAME} COMMAND $<TARGET_FILE:${T_TARGET}> ${T_ARGS})
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "unit;${T_LABELS}"
    ENVIRONMENT "${LOCKSTEP_TEST_ENV}")
endfunction()

function(lockstep_add_mpi_test)
  cmake_parse_arguments(T "TCP" "NAME;TARGET;TIMEOUT;GATE;COMMAND" "RANKS;LABELS;ARGS;ENV" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 180)
  endif()
  if(NOT T_GATE)
    set(T_GATE DIST_TEST_MPI)
  endif()
  if(NOT T_RANKS)
    set(T_RANKS 2 3 4)
  endif()
  set(extra_flags --oversubscribe --bind-to none)
  set(suffix "")
  set(env ${LOCKSTEP_TEST_ENV} ${T_ENV})
  if(T_TCP)
    list(APPEND extra_flags --mca btl tcp,self --mca btl_tcp_if_include lo)
    set(suffix ".tcp")
    # A multi-node job has no shared-memory path: keep every byte on the TCP transport.
    list(APPEND env LOCKSTEP_SHM=0)
  endif()
  if(T_COMMAND)
    set(exe ${T_COMMAND})
  else()
    set(exe $<TARGET_FILE:${T_TARGET}>)
  endif()
  foreach(n IN LISTS T_RANKS)
    set(test_name ${T_NAME}.np${n}${suffix})
    add_test(NAME ${test_name}
      COMMAND ${LOCKSTEP_GATE_SCRIPT} ${T_GATE}
              ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${n} ${extra_flags} ${MPIEXEC_PREFLAGS}
              ${exe} ${MPIEXEC_POSTFLAGS} ${T_ARGS})
    set_tests_properties(${test_name} PROPERTIES
      PROCESSORS ${n}
      TIMEOUT ${T_TIMEOUT}
      LABELS "mpi;${T_LABELS}"
      SKIP_RETURN_CODE 77
      ENVIRONMENT "${env}")
  endforeach()
endfunction()
