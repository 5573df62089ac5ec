# Helpers that register Lockstep's tests with CTest.
#
# lockstep_add_unit_test(NAME name TARGET target [SOURCES files...] [LABELS ...] [TIMEOUT s])
#   a single-process test run directly. SOURCES: first builds TARGET from them with the test main
#   (lockstep_test_executable, test/CMakeLists.txt); the same for lockstep_add_mpi_test.
# lockstep_add_rank_tests(NAME name RANKS n... COMMAND args... [SUFFIX s] [GATE VAR] [LABELS ...]
#                         [TIMEOUT s] [ENV VAR=value...] [FAULTS] [NO_FAULTS] [DISABLED]
#                         [PROCESSORS p])
#   one CTest test per rank count n, name.np<n><suffix>, running COMMAND with every "<N>" in it
#   replaced by n, behind test/gate.sh: gated by DIST_TEST_MPI (or GATE VAR), and reported
#   skipped (exit code 77) without the variable set to "true". Labelled mpi and LABELS; the
#   environment is LOCKSTEP_TEST_ENV, MPIEXEC and ENV. FAULTS: the test injects faults
#   (LOCKSTEP_FAULT), so it is reported skipped in a build without fault injection; NO_FAULTS:
#   it checks such a build, and is reported skipped in one with it. DISABLED: registered but
#   not run (a known failure). PROCESSORS p: the cores CTest reserves for it, at most p (default:
#   one per rank); for a test that mostly waits (deadlines, sleeping peers), so that CTest runs
#   another beside it.
# lockstep_add_mpi_test(NAME name TARGET target [SOURCES files...] RANKS 1 2 3 4 [TCP] [GATE VAR]
#                       [LABELS ...] [TIMEOUT s] [ARGS ...] [ENV ...] [PROCESSORS p])
#   a program run under mpiexec -n N (lockstep_add_rank_tests). TCP runs it over Open MPI's TCP
#   transport (--mca btl tcp,self), the path a multi-node job takes.
# lockstep_add_script_test(NAME name SCRIPT script TARGET target PROCESSORS n TIMEOUT s
#                          [LABELS ...] [FAULTS])
#   a bash script that starts its own mpiexec runs, called as
#   `script MPIEXEC $<TARGET_FILE:target> WORKDIR`, gated by DIST_TEST_MPI.

# odls_base_sigkill_timeout=0: when a rank exits with an error, mpiexec signals the others and
# then waits odls_base_sigkill_timeout seconds (default 1) before it exits itself, even when
# every process has already ended; the many tests that end a job with an error (bad flags,
# injected faults) then paid 1-2 s each for nothing. No test process handles SIGTERM.
set(LOCKSTEP_TEST_ENV
  "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1"
  "OMPI_MCA_odls_base_sigkill_timeout=0")

# What goes before the command of a test that needs fault injection (FAULTS) or its absence
# (NO_FAULTS): nothing where the build has what the test needs, or gate.sh reporting it skipped.
set(_lockstep_gate ${CMAKE_CURRENT_LIST_DIR}/gate.sh)
if(LOCKSTEP_FAULT_INJECTION)
  set(LOCKSTEP_NEEDS_FAULTS "")
  set(LOCKSTEP_NEEDS_NO_FAULTS ${_lockstep_gate} --skip "this build has fault injection (LOCKSTEP_FAULT_INJECTION=ON)")
else()
  set(LOCKSTEP_NEEDS_FAULTS ${_lockstep_gate} --skip "this build has no fault injection (LOCKSTEP_FAULT_INJECTION=OFF)")
  set(LOCKSTEP_NEEDS_NO_FAULTS "")
endif()

# lockstep_default(VAR value...): sets VAR (in the caller's scope) to value unless VAR is set.
macro(lockstep_default var)
  if(NOT ${var})
    set(${var} ${ARGN})
  endif()
endmacro()

# The properties of every gated multi-process test: its processors, timeout, labels (mpi and
# `labels`), the gate's skip code, and its environment.
function(_lockstep_mpi_test_properties name processors timeout labels env)
  set_tests_properties(${name} PROPERTIES PROCESSORS ${processors} TIMEOUT ${timeout} LABELS "mpi;${labels}"
    SKIP_RETURN_CODE 77 ENVIRONMENT "${env}")
endfunction()

function(lockstep_add_unit_test)
  cmake_parse_arguments(T "" "NAME;TARGET;TIMEOUT" "LABELS;ARGS;SOURCES" ${ARGN})
  if(T_SOURCES)
    lockstep_test_executable(${T_TARGET} ${T_SOURCES})
  endif()
  lockstep_default(T_TIMEOUT 120)
  add_test(NAME ${T_NAME} COMMAND $<TARGET_FILE:${T_TARGET}> ${T_ARGS})
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "unit;${T_LABELS}"
    ENVIRONMENT "${LOCKSTEP_TEST_ENV}")
endfunction()

function(lockstep_add_rank_tests)
  cmake_parse_arguments(T "FAULTS;NO_FAULTS;DISABLED" "NAME;SUFFIX;GATE;TIMEOUT;PROCESSORS" "RANKS;COMMAND;LABELS;ENV" ${ARGN})
  lockstep_default(T_TIMEOUT 180)
  lockstep_default(T_GATE DIST_TEST_MPI)
  lockstep_default(T_RANKS 2 3 4)
  set(needs "")
  if(T_FAULTS)
    set(needs ${LOCKSTEP_NEEDS_FAULTS})
  elseif(T_NO_FAULTS)
    set(needs ${LOCKSTEP_NEEDS_NO_FAULTS})
  endif()
  foreach(n IN LISTS T_RANKS)
    set(test_name ${T_NAME}.np${n}${T_SUFFIX})
    string(REPLACE "<N>" "${n}" command "${T_COMMAND}")
    add_test(NAME ${test_name} COMMAND ${needs} ${_lockstep_gate} ${T_GATE} ${command})
    set(processors ${n})
    if(T_PROCESSORS AND T_PROCESSORS LESS n)
      set(processors ${T_PROCESSORS})
    endif()
    _lockstep_mpi_test_properties(${test_name} ${processors} ${T_TIMEOUT} "${T_LABELS}"
      "${LOCKSTEP_TEST_ENV};MPIEXEC=${MPIEXEC_EXECUTABLE};${T_ENV}")
    if(T_DISABLED)
      set_tests_properties(${test_name} PROPERTIES DISABLED TRUE)
    endif()
  endforeach()
endfunction()

function(lockstep_add_mpi_test)
  cmake_parse_arguments(T "TCP" "NAME;TARGET;TIMEOUT;GATE;COMMAND;PROCESSORS" "RANKS;LABELS;ARGS;ENV;SOURCES" ${ARGN})
  if(T_SOURCES)
    lockstep_test_executable(${T_TARGET} ${T_SOURCES})
  endif()
  set(extra_flags --oversubscribe --bind-to none)
  set(suffix "")
  set(env ${T_ENV})
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
  set(pass "")
  foreach(key IN ITEMS GATE TIMEOUT RANKS LABELS PROCESSORS)
    if(T_${key})
      list(APPEND pass ${key} ${T_${key}})
    endif()
  endforeach()
  lockstep_add_rank_tests(NAME ${T_NAME} SUFFIX "${suffix}" ${pass} ENV ${env}
    COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} <N> ${extra_flags} ${MPIEXEC_PREFLAGS}
            ${exe} ${MPIEXEC_POSTFLAGS} ${T_ARGS})
endfunction()

function(lockstep_add_script_test)
  cmake_parse_arguments(T "FAULTS" "NAME;SCRIPT;TARGET;PROCESSORS;TIMEOUT" "LABELS" ${ARGN})
  set(needs "")
  if(T_FAULTS)
    set(needs ${LOCKSTEP_NEEDS_FAULTS})
  endif()
  add_test(NAME ${T_NAME}
    COMMAND ${needs} ${_lockstep_gate} DIST_TEST_MPI
            bash ${T_SCRIPT} ${MPIEXEC_EXECUTABLE} $<TARGET_FILE:${T_TARGET}>
            ${CMAKE_CURRENT_BINARY_DIR}/examples-work/${T_NAME})
  _lockstep_mpi_test_properties(${T_NAME} ${T_PROCESSORS} ${T_TIMEOUT} "${T_LABELS}" "${LOCKSTEP_TEST_ENV}")
endfunction()
