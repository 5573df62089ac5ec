# Reliability (issue 7): fingerprints, stall timeouts with blame, fault injection, fault handling.
# Each fault test runs test/reliability/fault_program under mpiexec with LOCKSTEP_FAULT and
# friends, then run_fault.sh checks the message every rank reported (not just the exit code).

add_executable(lockstep_fault_program reliability/fault_program.cpp)
target_link_libraries(lockstep_fault_program PRIVATE lockstep::core lockstep_build_flags)

# In-process reliability tests (check_replicas, in-code check levels and deadlines, settings).
lockstep_test_executable(test_reliability reliability/reliability_test.cpp)
lockstep_add_mpi_test(NAME reliability TARGET test_reliability RANKS 1 2 3 4 TIMEOUT 120 LABELS reliability)

set(LOCKSTEP_RUN_FAULT ${CMAKE_CURRENT_SOURCE_DIR}/reliability/run_fault.sh)

# lockstep_add_fault_test(NAME name RANKS 2 3 4 ENV VAR=value... [ABORT] [TIMEOUT s]
#                         [STEPS n] [MODE m] [ENDED_RANK r] [MAX_MS_AFTER_FAULT ms]
#                         [NO_FAULTS] EXPECT pattern...)
#   reliability.<name>.npN: run_fault.sh over fault_program. A test whose ENV sets LOCKSTEP_FAULT
#   is reported skipped in a build without fault injection; NO_FAULTS: one checking such a build.
function(lockstep_add_fault_test)
  cmake_parse_arguments(T "ABORT;NO_FAULTS;REPORT_DIR_MISSING" "NAME;TIMEOUT;STEPS;MAX_MS_AFTER_FAULT;MODE;ENDED_RANK"
                        "RANKS;ENV;EXPECT;LOG_HAS" ${ARGN})
  lockstep_default(T_TIMEOUT 60)
  lockstep_default(T_STEPS 8)
  lockstep_default(T_MODE blocking)
  set(flags "")
  if(T_ABORT)
    list(APPEND flags --abort)
  endif()
  if(DEFINED T_ENDED_RANK)
    list(APPEND flags --ended-rank ${T_ENDED_RANK})
  endif()
  if(T_MAX_MS_AFTER_FAULT)
    list(APPEND flags --max-ms-after-fault ${T_MAX_MS_AFTER_FAULT})
  endif()
  foreach(pat IN LISTS T_LOG_HAS)
    list(APPEND flags --log-has ${pat})
  endforeach()
  if(T_REPORT_DIR_MISSING)
    list(APPEND flags --report-dir-missing)
  endif()
  set(needs "")
  if(T_NO_FAULTS)
    set(needs NO_FAULTS)
  elseif("${T_ENV}" MATCHES "LOCKSTEP_FAULT=")
    set(needs FAULTS)
  endif()
  lockstep_add_rank_tests(NAME reliability.${T_NAME} RANKS ${T_RANKS} TIMEOUT ${T_TIMEOUT} LABELS reliability
    ENV ${T_ENV} ${needs}
    COMMAND ${LOCKSTEP_RUN_FAULT} ${flags} <N> $<TARGET_FILE:lockstep_fault_program> --steps ${T_STEPS}
            --mode ${T_MODE} -- ${T_EXPECT})
endfunction()

# No fault, every check on: the program runs to the end on every rank.
lockstep_add_fault_test(NAME clean
  ENV LOCKSTEP_CHECK=always LOCKSTEP_TIMEOUT=30
  EXPECT "OK" "!Error")

# A rank passes a shorter buffer: MismatchError on every rank, naming rank 1's call.
lockstep_add_fault_test(NAME shape
  ENV LOCKSTEP_CHECK=always "LOCKSTEP_FAULT=rank=1,kind=shape,after=3"
  EXPECT "MismatchError" "disagree on the element count" "rank 1: allreduce #3 (f32 x 15, op sum) at fault_program.cpp"
         "rank 0: allreduce #3 (f32 x 16, op sum)" "No data was exchanged")

# The same for a nonblocking collective: its check travels with it and is completed in wait(),
# which throws on every rank (the operation was already issued: the backend is then unusable).
lockstep_add_fault_test(NAME shape_nonblocking MODE nonblocking
  ENV LOCKSTEP_CHECK=always "LOCKSTEP_FAULT=rank=1,kind=shape,after=3"
  EXPECT "MismatchError" "disagree on the element count" "rank 1: iallreduce #3 (f32 x 15, op sum)"
         "rank 0: iallreduce #3 (f32 x 16, op sum)" "already issued")

# A rank passes another dtype: caught at level first too (collective #2 is the 3rd call of its site).
lockstep_add_fault_test(NAME dtype
  ENV LOCKSTEP_CHECK=first:5 "LOCKSTEP_FAULT=rank=1,kind=dtype,after=2"
  EXPECT "MismatchError" "disagree on the dtype" "rank 1: allreduce #2 (i32 x 16, op sum)"
         "rank 0: allreduce #2 (f32 x 16, op sum)")

# A rank skips the last allreduce of the loop and goes on to the broadcast.
lockstep_add_fault_test(NAME skip
  ENV LOCKSTEP_CHECK=always "LOCKSTEP_FAULT=rank=1,kind=skip,after=7"
  EXPECT "MismatchError" "disagree on the operation" "rank 1: broadcast #7 (f32 x 8, root 0)"
         "rank 0: allreduce #7 (f32 x 16, op sum)")

# A rank is late (12 s) and the others give up after 2 s: TimeoutError on every other rank,
# blaming rank 1. They then skip MPI_Finalize (it would wait for rank 1), so the job ends
# without waiting for the late rank, which is ended with it (before it could report). The job
# usually ends about 3 s after the fault; the limit, 8 s, leaves room for a loaded CI machine
# (5.1 s was seen there with two tests at a time) and is still well before the late rank wakes.
lockstep_add_fault_test(NAME delay ENDED_RANK 1 MAX_MS_AFTER_FAULT 8000
  ENV LOCKSTEP_TIMEOUT=2 "LOCKSTEP_FAULT=rank=1,kind=delay,after=3,seconds=12"
  EXPECT "TimeoutError" "Behind (not yet in collective #3): rank 1 (host " "allreduce #3 (f32 x 16, op sum)"
         "rank 1 (" "not inside any collective")

# The blame report for lockstep-run where its folder does not exist on this host (a cluster
# without a shared /tmp): the folder is made and the report written there; where it cannot be
# made or written (under /dev/null), each rank that found the stall says so on stderr, with the
# report's content, instead of dropping it in silence.
lockstep_add_fault_test(NAME delay_report_dir_missing ENDED_RANK 1 REPORT_DIR_MISSING
  ENV LOCKSTEP_TIMEOUT=2 "LOCKSTEP_FAULT=rank=1,kind=delay,after=3,seconds=12"
  EXPECT "TimeoutError")
lockstep_add_fault_test(NAME delay_report_unwritable ENDED_RANK 1
  ENV LOCKSTEP_TIMEOUT=2 LOCKSTEP_REPORT_DIR=/dev/null/reports "LOCKSTEP_FAULT=rank=1,kind=delay,after=3,seconds=12"
  LOG_HAS "lockstep: could not write the blame report /dev/null/reports/blame.0" "the report: rank 0;host "
  EXPECT "TimeoutError")
# The report sent to lockstep-run (LOCKSTEP_RUN_ADDR): where nothing listens there, each rank
# that found the stall says so, with the report's content, and ends as it would have. (Heard
# where lockstep-run listens: reliability.lockstep_run, and across hosts, the multihost stage.)
lockstep_add_fault_test(NAME delay_report_unsent ENDED_RANK 1
  ENV LOCKSTEP_TIMEOUT=2 LOCKSTEP_RUN_ADDR=127.0.0.1:1 "LOCKSTEP_FAULT=rank=1,kind=delay,after=3,seconds=12"
  LOG_HAS "lockstep: could not send the blame report to lockstep-run at LOCKSTEP_RUN_ADDR=127.0.0.1:1 (connect: Connection refused" "the report: rank 0;host "
  EXPECT "TimeoutError")

# The same with the nonblocking form (iallreduce + wait, as DistributedOptimizer's buckets): the
# deadline and the blame apply to Request::wait too.
lockstep_add_fault_test(NAME delay_nonblocking MODE nonblocking ENDED_RANK 1 MAX_MS_AFTER_FAULT 8000
  ENV LOCKSTEP_TIMEOUT=2 "LOCKSTEP_FAULT=rank=1,kind=delay,after=3,seconds=12"
  EXPECT "TimeoutError" "the wait for iallreduce #3 (f32 x 16, op sum)" "Behind (not yet in collective #3): rank 1 (host ")

# The same with fingerprint checks on: the others wait in the fingerprint check.
lockstep_add_fault_test(NAME delay_checked RANKS 3 ENDED_RANK 1
  ENV LOCKSTEP_CHECK=always LOCKSTEP_TIMEOUT=2 "LOCKSTEP_FAULT=rank=1,kind=delay,after=5,seconds=6"
  EXPECT "TimeoutError" "Behind (not yet in collective #5): rank 1 (host " "the fingerprint check of allreduce #5")

# A rank's contribution to a gradient bucket turns NaN in transit (kind=nan on collective #7, an
# iallreduce of DistributedOptimizer): every rank skips that step, counts it, and stays in step
# (check_replicas runs after every applied step).
lockstep_add_fault_test(NAME nan_gradient MODE optimizer STEPS 8
  ENV "LOCKSTEP_FAULT=rank=1,kind=nan,after=7"
  EXPECT "OK skipped=1 applied=7" "!Error")

# LOCKSTEP_TIMEOUT_ACTION=abort: the job ends through MPI_Abort with the blame printed.
lockstep_add_fault_test(NAME delay_abort RANKS 2 3 ABORT
  ENV LOCKSTEP_TIMEOUT=2 LOCKSTEP_TIMEOUT_ACTION=abort "LOCKSTEP_FAULT=rank=1,kind=delay,after=3,seconds=20"
  EXPECT "Behind (not yet in collective #3): rank 1 (host " "aborting the job")

# A rank killed with SIGKILL in the middle of training: the job ends within 10 s, and mpiexec
# names the dead rank (Open MPI's runtime does this; the test makes sure it stays so).
lockstep_add_fault_test(NAME sigkill ABORT MAX_MS_AFTER_FAULT 10000 STEPS 200
  ENV "LOCKSTEP_FAULT=rank=1,kind=kill,after=20"
  EXPECT "process rank 1 with PID" "signal 9")

# A bad setting is an InvalidArgument at initialisation on every rank, not a silent default.
lockstep_add_fault_test(NAME bad_setting RANKS 2
  ENV LOCKSTEP_CHECK=sometimes
  EXPECT "InvalidArgument" "LOCKSTEP_CHECK=\"sometimes\": expected off, first, first:N or always")
lockstep_add_fault_test(NAME bad_fault_spec RANKS 2
  ENV "LOCKSTEP_FAULT=rank=1,kind=explode"
  EXPECT "InvalidArgument" "unknown kind 'explode'")
# rank=* (every rank) is for kind=rescue_delay alone: a collective's fault on every rank is refused.
lockstep_add_fault_test(NAME bad_fault_all_ranks RANKS 2
  ENV "LOCKSTEP_FAULT=rank=*,kind=delay,seconds=1"
  EXPECT "InvalidArgument" "rank=* is for kind=rescue_delay only")
# A build without fault injection (LOCKSTEP_FAULT_INJECTION=OFF, a library to install) refuses
# LOCKSTEP_FAULT on every rank at initialisation instead of ignoring it (package.subdir checks
# the same of a vendored build).
lockstep_add_fault_test(NAME fault_injection_off RANKS 2 NO_FAULTS
  ENV "LOCKSTEP_FAULT=rank=1,kind=skip,after=3"
  EXPECT "InvalidArgument" "this build of Lockstep has no fault injection (LOCKSTEP_FAULT_INJECTION=OFF); unset LOCKSTEP_FAULT" "!OK")

# The monitor of a build without fault injection has no fault code (its preprocessed source
# names none of the identifiers that the build with it names), whatever this build chose.
get_property(_below GLOBAL PROPERTY LOCKSTEP_LAYER_BELOW_mpi)
set(_mpi_flags -I${PROJECT_BINARY_DIR}/include)
foreach(layer IN ITEMS mpi ${_below})
  list(APPEND _mpi_flags -I${PROJECT_BINARY_DIR}/layers/${layer}/include -I${PROJECT_BINARY_DIR}/layers/${layer}/src)
endforeach()
foreach(dir IN LISTS MPI_CXX_INCLUDE_DIRS)
  list(APPEND _mpi_flags -I${dir})
endforeach()
# The monitor is several sources (src/mpi/monitor*.cpp): one file that includes them all is checked.
file(GLOB _monitor_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/mpi/monitor*.cpp)
set(_monitor_all "")
foreach(_src IN LISTS _monitor_sources)
  string(APPEND _monitor_all "#include \"${_src}\"\n")
endforeach()
file(CONFIGURE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/reliability/monitor_all.cpp CONTENT "${_monitor_all}")
add_test(NAME reliability.no_fault_code_without_fault_injection
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/reliability/check_no_fault_code.sh ${CMAKE_CXX_COMPILER}
          ${CMAKE_CURRENT_BINARY_DIR}/reliability/monitor_all.cpp ${_mpi_flags})
set_tests_properties(reliability.no_fault_code_without_fault_injection PROPERTIES LABELS "unit;reliability"
  PASS_REGULAR_EXPRESSION "no fault code: OK")

# The checks' cost on a ResNet-50 gradient sync (built, not run as a test: speed is for benches).
add_executable(lockstep_check_cost reliability/check_cost.cpp)
target_link_libraries(lockstep_check_cost PRIVATE lockstep::core lockstep_build_flags)

# The other areas' MPI tests again with every fingerprint checked and a deadline on every
# collective: the checked, polled path must give the same results as the plain one, and correct
# programs must never trip a check.
foreach(_target IN ITEMS test_collective test_world test_training test_synchronize test_data test_checkpoint_mpi)
  if(TARGET ${_target})
    string(REPLACE "test_" "" _area ${_target})
    lockstep_add_mpi_test(NAME reliability.checked.${_area} TARGET ${_target} RANKS 3 TIMEOUT 300
                          LABELS reliability)
    set_property(TEST reliability.checked.${_area}.np3 APPEND PROPERTY ENVIRONMENT
                 LOCKSTEP_CHECK=always LOCKSTEP_TIMEOUT=120)
  endif()
endforeach()

# libFuzzer target over the checkpoint reader (scripts/ci-fuzz.sh builds it with clang and runs
# it for a bounded time). Here also a CTest test that replays the seed corpus once.
option(LOCKSTEP_BUILD_FUZZERS "Build the libFuzzer targets (clang only; see scripts/ci-fuzz.sh)" OFF)
if(LOCKSTEP_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "LOCKSTEP_BUILD_FUZZERS=ON needs clang (libFuzzer); use CMAKE_CXX_COMPILER=clang++-14")
  endif()
  add_executable(lockstep_fuzz_checkpoint fuzz/checkpoint_fuzz.cpp)
  target_link_libraries(lockstep_fuzz_checkpoint PRIVATE lockstep::core)
  target_compile_options(lockstep_fuzz_checkpoint PRIVATE -fsanitize=fuzzer)
  target_link_options(lockstep_fuzz_checkpoint PRIVATE -fsanitize=fuzzer)
  add_test(NAME fuzz.checkpoint.corpus
    COMMAND lockstep_fuzz_checkpoint -runs=0 ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/corpus)
  set_tests_properties(fuzz.checkpoint.corpus PROPERTIES TIMEOUT 60 LABELS "unit;fuzz")
endif()

# A checkpoint writer killed at any point leaves the previous checkpoint intact.
add_executable(lockstep_killed_writer reliability/killed_writer.cpp)
target_link_libraries(lockstep_killed_writer PRIVATE lockstep::core lockstep_build_flags)
lockstep_add_unit_test(NAME reliability.killed_checkpoint_writer TARGET lockstep_killed_writer TIMEOUT 120
                       LABELS reliability)

# A rank killed mid-training: the job ends naming it, and the last checkpoint resumes bitwise.
# (examples/ is added after test/: the same condition as tests_30_examples.cmake, not TARGET.)
if(LOCKSTEP_BUILD_EXAMPLES AND (LOCKSTEP_TEST_OPENBLAS_FOUND OR LOCKSTEP_TEST_CBLAS_H))
  lockstep_add_script_test(NAME reliability.kill_resume SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/reliability/kill_resume.sh
    TARGET train PROCESSORS 3 TIMEOUT 300 LABELS reliability examples FAULTS)
  # A lost rank costs one step: the survivors write rescue states, the run resumed at fewer
  # ranks from the freshest (held by a rank other than 0 in one case) ends with the
  # uninterrupted run's model hash (--deterministic); a sharded state writes none and says so.
  lockstep_add_script_test(NAME reliability.rescue_resume SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/reliability/rescue_resume.sh
    TARGET train PROCESSORS 4 TIMEOUT 240 LABELS reliability examples FAULTS)
  # lockstep-run: a killed rank restarted and resumed, shrinking, --max-restarts, --min-ranks, a
  # blame report, a hung job ended, bad arguments, a silent host left out.
  if(TARGET lockstep-run)
    lockstep_add_script_test(NAME reliability.lockstep_run SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/reliability/lockstep_run.sh
      TARGET train PROCESSORS 4 TIMEOUT 400 LABELS reliability examples FAULTS)
    set_property(TEST reliability.lockstep_run APPEND PROPERTY ENVIRONMENT TEST_LOCKSTEP_RUN=$<TARGET_FILE:lockstep-run>)
    # lockstep-run --rescue: a killed rank's survivors kept (--enable-recovery) write their
    # rescue state, and the restart resumes from the step of the fault (about 10 s).
    lockstep_add_script_test(NAME reliability.lockstep_run_rescue
      SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/reliability/lockstep_run_rescue.sh
      TARGET train PROCESSORS 4 TIMEOUT 120 LABELS reliability examples FAULTS)
    set_property(TEST reliability.lockstep_run_rescue APPEND PROPERTY ENVIRONMENT
      TEST_LOCKSTEP_RUN=$<TARGET_FILE:lockstep-run>)
  endif()
endif()

# Trust (issue 11): checks above every backend, the shared-memory path agreeing on its calls,
# settings agreed across ranks, and the job ending instead of hanging. In-process cases:
lockstep_test_executable(test_trust reliability/trust_test.cpp)
lockstep_add_mpi_test(NAME trust TARGET test_trust RANKS 1 2 3 4 TIMEOUT 120 LABELS reliability)
# lockstep-run with inputs a user gives it as a matter of course (a reused --report-dir, hostfile
# words in either order); and its own behaviour: INT, TERM, HUP, QUIT end every rank (exit
# 128+N), the summary, --log-dir, printed text not taken for a failure. Trivial programs, so any
# target serves as the binary.
if(TARGET lockstep-run)
  lockstep_add_script_test(NAME reliability.lockstep_run_inputs SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/reliability/lockstep_run_inputs.sh
    TARGET test_trust PROCESSORS 2 TIMEOUT 120 LABELS reliability)
  lockstep_add_script_test(NAME reliability.lockstep_run_signals SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/reliability/lockstep_run_signals.sh
    TARGET test_trust PROCESSORS 3 TIMEOUT 120 LABELS reliability)
  set_property(TEST reliability.lockstep_run_inputs reliability.lockstep_run_signals APPEND PROPERTY
    ENVIRONMENT TEST_LOCKSTEP_RUN=$<TARGET_FILE:lockstep-run>)
endif()
# The same with the shared-memory path off (the calls go to MPI, the checks must not change).
lockstep_add_mpi_test(NAME trust.noshm TARGET test_trust RANKS 2 3 TIMEOUT 120 LABELS reliability
                      ENV LOCKSTEP_SHM=0)

# Cases that end a process or the job: run_trust.sh checks every rank's line and the time taken.
add_executable(lockstep_trust_program reliability/trust_program.cpp)
target_link_libraries(lockstep_trust_program PRIVATE lockstep::core lockstep_build_flags)
target_include_directories(lockstep_trust_program PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
set(LOCKSTEP_RUN_TRUST ${CMAKE_CURRENT_SOURCE_DIR}/reliability/run_trust.sh)

# lockstep_add_trust_test(NAME name SCENARIO s RANKS 2 3 MAX seconds ARGS ... EXPECT pattern...
#                         [PROGRAM target] [PREFIX p] [KNOWN_FAILURE])
#   runs run_trust.sh over PROGRAM (default lockstep_trust_program) as reliability.<p>.<name>.npN
#   (p default trust). KNOWN_FAILURE: a defect left open (described in the scenario's comment):
#   registered, labelled known_failure and disabled, so that `ctest -L known_failure` lists it
#   and CI stays green.
function(lockstep_add_trust_test)
  cmake_parse_arguments(T "KNOWN_FAILURE" "NAME;SCENARIO;MAX;PROGRAM;PREFIX" "RANKS;ARGS;EXPECT" ${ARGN})
  lockstep_default(T_RANKS 2 3)
  lockstep_default(T_PROGRAM lockstep_trust_program)
  lockstep_default(T_PREFIX trust)
  set(labels reliability)
  set(disabled "")
  if(T_KNOWN_FAILURE)
    list(APPEND labels known_failure)
    set(disabled DISABLED)
  endif()
  lockstep_add_rank_tests(NAME reliability.${T_PREFIX}.${T_NAME} RANKS ${T_RANKS} TIMEOUT 120 LABELS ${labels}
    ${disabled} COMMAND ${LOCKSTEP_RUN_TRUST} $<TARGET_FILE:${T_PROGRAM}> ${T_SCENARIO} <N> ${T_MAX} ${T_ARGS}
                        -- ${T_EXPECT})
endfunction()

# A malformed setting on one rank: every rank stops with the same error, nobody waits.
lockstep_add_trust_test(NAME settings_bogus_check SCENARIO settings MAX 20
  ARGS --rank-env 1 LOCKSTEP_CHECK=bogus
  EXPECT "rank {rank}: InvalidArgument: lockstep: a LOCKSTEP_* setting is malformed on rank 1"
         "LOCKSTEP_CHECK=\"bogus\"" "!rank 0: OK")
lockstep_add_trust_test(NAME settings_negative_timeout SCENARIO settings MAX 20
  ARGS --rank-env 0 LOCKSTEP_TIMEOUT=-1
  EXPECT "rank {rank}: InvalidArgument" "LOCKSTEP_TIMEOUT=\"-1\"" "!: OK")
foreach(bad "LOCKSTEP_SHM=maybe" "LOCKSTEP_SHM_MIN_BYTES=lots" "LOCKSTEP_SHM_SLICE_BYTES=1G"
            "LOCKSTEP_CUDA_AWARE_MPI=yes please")
  string(REGEX REPLACE "=.*" "" var "${bad}")
  string(TOLOWER "${var}" lvar)
  lockstep_add_trust_test(NAME settings_${lvar} SCENARIO settings MAX 20 RANKS 2
    ARGS --env "${bad}" EXPECT "rank {rank}: InvalidArgument" "${var}=" "!: OK")
endforeach()
# Settings that differ between ranks (each valid) are refused too.
lockstep_add_trust_test(NAME settings_differ SCENARIO settings MAX 20 RANKS 2
  ARGS --rank-env 1 LOCKSTEP_SHM=0
  EXPECT "rank {rank}: InvalidArgument: lockstep: the ranks disagree on their LOCKSTEP_* settings" "!: OK")

# After a stall, the rank that caught its TimeoutError returns from main and the job ends then
# (MPI_Finalize is skipped), not when the stalled rank comes back 60 s later.
lockstep_add_trust_test(NAME finalize_after_stall SCENARIO finalize_after_stall MAX 25
  ARGS --env LOCKSTEP_TIMEOUT=3
  EXPECT "r0:rank 0: TimeoutError" "not calling MPI_Finalize" "!rank 1: OK")
# An exception that escapes main on one rank ends the job in seconds, naming rank and message.
lockstep_add_trust_test(NAME uncaught_exception SCENARIO uncaught MAX 20
  EXPECT "lockstep: ending the job" "rank 1/" "uncaught exception: cannot open data.bin" "!rank 0: OK")
# SIGSTOP and kill -9 of a rank inside a large shared-memory allreduce.
lockstep_add_trust_test(NAME stop_in_shm SCENARIO stop_in_shm MAX 30
  ARGS --env LOCKSTEP_TIMEOUT=4
  EXPECT "r0:rank 0: TimeoutError" "r0:did not complete within 4 s" "!rank 0: OK")
lockstep_add_trust_test(NAME kill_in_shm SCENARIO kill_in_shm MAX 20
  EXPECT "r1:rank 1: killing myself" "!rank 0: OK")
# Refused arguments on one rank, unchecked: the others are told, nobody hangs (shared memory:
# an exception; MPI without a polled deadline: the job ends).
lockstep_add_trust_test(NAME refused_shm SCENARIO refused MAX 20
  EXPECT "refused its arguments to allreduce" "!: OK")
lockstep_add_trust_test(NAME refused_mpi SCENARIO refused MAX 20 ARGS --env LOCKSTEP_SHM=0
  EXPECT "InvalidArgument: backend.cpp" "null data pointer" "!: OK")
# A rank that returns from main early (a handled rank-local error): it tells the others as it
# finalises, and a rank blocked in a collective ends the job within seconds.
lockstep_add_trust_test(NAME returns_early SCENARIO returns_early MAX 20
  EXPECT "r1:rank 1: returning early" "has left" "!rank 0: OK")
# An MPI error inside a polled nonblocking collective is an exception, not an abort.
lockstep_add_trust_test(NAME nonblocking_mpi_error SCENARIO nonblocking_mpi_error MAX 30 RANKS 2
  ARGS --env LOCKSTEP_TIMEOUT=5 --env LOCKSTEP_SHM=0
  EXPECT "r1:rank 1: MpiError" "!MPI_ERRORS_ARE_FATAL" "!: OK")

# Adversarial tests of the trust mechanisms (h-adv): in-process cases, and scenarios that may end
# the job, run by run_trust.sh.
lockstep_test_executable(test_adversarial reliability/adversarial_test.cpp)
# The default settings at 2, 3 and 4 ranks; the shared-memory path off at 2 ranks; 4 KiB slices
# (the most slices per message) at 4 ranks. (Each run is about 25 s on the 2-core CI machine.)
lockstep_add_mpi_test(NAME adversarial TARGET test_adversarial RANKS 2 3 4 TIMEOUT 120 LABELS reliability)
lockstep_add_mpi_test(NAME adversarial.noshm TARGET test_adversarial RANKS 2 TIMEOUT 120 LABELS reliability
                      ENV LOCKSTEP_SHM=0)
lockstep_add_mpi_test(NAME adversarial.slice4k TARGET test_adversarial RANKS 4 TIMEOUT 120 LABELS reliability
                      ENV LOCKSTEP_SHM_SLICE_BYTES=4k)
add_executable(lockstep_adversarial_program reliability/adversarial_program.cpp)
target_link_libraries(lockstep_adversarial_program PRIVATE lockstep::core lockstep_build_flags)
target_include_directories(lockstep_adversarial_program PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})

# lockstep_add_adversarial_test(...): lockstep_add_trust_test over lockstep_adversarial_program.
function(lockstep_add_adversarial_test)
  lockstep_add_trust_test(PROGRAM lockstep_adversarial_program PREFIX adversarial ${ARGN})
endfunction()

# Root reduces out of place, the others in place: the result is right and the next broadcast
# carries root's data (it used to receive root's 256-byte verdict: silent wrong data over MPI,
# a MismatchError later on the shared-memory path).
lockstep_add_adversarial_test(NAME mixed_reduce SCENARIO mixed_reduce MAX 20
  EXPECT "rank {rank}: broadcast gave 7" "rank {rank}: OK" "r0:reduce gave")
lockstep_add_adversarial_test(NAME mixed_reduce_noshm SCENARIO mixed_reduce MAX 20 ARGS --env LOCKSTEP_SHM=0
  EXPECT "rank {rank}: broadcast gave 7" "rank {rank}: OK")
# Thousands of refusals of the same call on every rank, then correct collectives (a late notice
# for an early refusal used to mark the backend unusable on every rank).
lockstep_add_adversarial_test(NAME refuse_flood SCENARIO refuse_flood MAX 60 RANKS 2 4
  EXPECT "rank {rank}: OK" "!unusable")
# A refused iallreduce on one rank at a checked call: the others issued theirs, so every rank
# ends unusable (the refusing rank used to stay usable, and its next collective waited for peers
# that throw at every call).
lockstep_add_adversarial_test(NAME refuse_iallreduce_checked SCENARIO refuse_iallreduce_checked MAX 20
  ARGS --env LOCKSTEP_CHECK=always
  EXPECT "rank {rank}: usable 0" "rank {rank}: next allreduce: MismatchError" "rank {rank}: DONE")
# LOCKSTEP_TIMEOUT=1e300 is accepted; it used to overflow the deadline and time out at once.
lockstep_add_adversarial_test(NAME huge_timeout SCENARIO huge_timeout MAX 20 ARGS --env LOCKSTEP_TIMEOUT=1e300
  EXPECT "rank {rank}: allreduce: no exception" "!TimeoutError")

# Unchecked, the last rank's allreduce #0 is refused; it catches the error and calls allreduce #1
# at once. The others, already inside #0, used to complete it against the refuser's #1 (101 with
# no error on both sides). Now the refuser waits until every rank answered for #0: one accepted
# it, so the refuser's communicator is unusable and its #1 throws.
lockstep_add_adversarial_test(NAME refuse_then_continue SCENARIO refuse_then_continue MAX 20
  EXPECT "!first: no exception value 101" "!second: no exception value 101")
# A user's Backend wrapping MPIBackend forwards refusals with Backend::forward_abandon, so the
# other ranks are told (they used to wait for the default deadline).
lockstep_add_adversarial_test(NAME wrapper_refused SCENARIO wrapper_refused MAX 25
  EXPECT "r0:rank 0: wrapped allreduce: MismatchError" "r0:refused its arguments")

# Trust, round 3 (issue 25): names, order, shapes and micro-step counts agreed before any number
# moves; a difference is a MismatchError on every rank.
lockstep_test_executable(test_agreement reliability/agreement_test.cpp)
lockstep_add_mpi_test(NAME agreement TARGET test_agreement RANKS 1 2 3 4 TIMEOUT 120 LABELS reliability)

# finalize after an initialize refused for a malformed setting on one rank (issue 25, item 7):
# it used to throw the reported InvalidArgument again on that rank and leave MPI unfinalised, so
# mpiexec reported the job as exiting improperly although every rank returned normally.
lockstep_add_trust_test(NAME finalize_after_refused_init SCENARIO finalize_after_refused_init MAX 20
  ARGS --rank-env 1 LOCKSTEP_TIMEOUT=soon
  EXPECT "rank {rank}: InvalidArgument: lockstep: a LOCKSTEP_* setting is malformed on rank 1"
         "rank {rank}: finalize: no exception" "rank {rank}: MPI finalised: yes" "!exiting improperly"
         "!finalize: InvalidArgument")

# An MPI error inside a collective on one rank (counts that differ, 600 against 500, no check
# level; issue 25, item 4): that rank raises MpiError, and the others, told as of a stall, raise
# MpiError naming it and its error within seconds (they used to wait for the default 600 s
# deadline). The nonblocking form without any deadline (Request::wait polls), and the blocking
# form under a deadline far longer than the test (a blocking MPI call without one cannot be
# interrupted: the watchdog ends the job 2 s later, as after a stall).
foreach(shm 0 1)
  lockstep_add_trust_test(NAME mpi_error_iallreduce_shm${shm} SCENARIO mpi_error_iallreduce MAX 20
    ARGS --env LOCKSTEP_SHM=${shm}
    EXPECT "rank {rank}: wait: MpiError" "rank {rank}: raised within 5 s" "rank {rank}: next barrier: MpiError"
           "failed in MPI, so this rank stops too: the wait for iallreduce #0" "MPI_ERR_TRUNCATE"
           "rank {rank}: usable 0" "!TimeoutError")
endforeach()
lockstep_add_trust_test(NAME mpi_error_allreduce SCENARIO mpi_error_allreduce MAX 20
  ARGS --env LOCKSTEP_SHM=0 --env LOCKSTEP_TIMEOUT=60
  EXPECT "rank {rank}: raised within 5 s" "rank {rank}: next barrier: MpiError"
         "failed in MPI, so this rank stops too: allreduce called at" "MPI_ERR_TRUNCATE" "rank {rank}: usable 0"
         "!TimeoutError")

# The hierarchical allreduce (two simulated machines of two ranks, every size on the path): a rank
# late for an allreduce leaves its peers waiting in the path's agreement (over MPI among the
# machines, over shared memory within one); every wait is polled against the deadline, so they
# end with the TimeoutError and the blame of the flat path.
lockstep_add_fault_test(NAME hierarchical_delay RANKS 4 ENDED_RANK 3 MAX_MS_AFTER_FAULT 8000
  ENV LOCKSTEP_TEST_HOST_SIZE=2 LOCKSTEP_TEST_HIER_MIN_BYTES=0 LOCKSTEP_TIMEOUT=2
      "LOCKSTEP_FAULT=rank=3,kind=delay,after=3,seconds=12"
  EXPECT "TimeoutError" "Behind (not yet in collective #3): rank 3 (host " "allreduce #3 (f32 x 16, op sum)")

# Adversarial tests of trust round 3 (issue 25): the ranks' agreement on names, shapes, options,
# nested structures and micro-step counts, attacked with differences a naive signature would hide.
lockstep_test_executable(test_agreement_adversarial reliability/agreement_adversarial_test.cpp)
lockstep_add_mpi_test(NAME agreement_adversarial TARGET test_agreement_adversarial RANKS 2 3 TIMEOUT 120
                      LABELS reliability ENV LOCKSTEP_TIMEOUT=20)

# A late delivery after a timeout (docs/reliability.md, "Memory a request may still use"): one
# rank frozen (SIGSTOP, every thread) for 9 s once its part of a collective is on its way
# (kind=freeze_exchange), the others' deadline 2 s; the survivors then write into their buffers
# while the frozen rank comes back and completes the transfer. Over TCP (no single-copy shared
# memory: the receiver needs the frozen sender to move the data). Flat MPI (no shared-memory
# path) at 2 ranks, and the hierarchical path at 2 machines x 2 (a 4 MiB call). The sanitize
# stage runs both (label mpi): a late write into freed memory fails there too.
add_executable(lockstep_late_delivery reliability/late_delivery.cpp)
target_link_libraries(lockstep_late_delivery PRIVATE lockstep::core lockstep_build_flags)
set(LOCKSTEP_LATE_DELIVERY ${CMAKE_CURRENT_SOURCE_DIR}/reliability/late_delivery.sh)
lockstep_add_rank_tests(NAME reliability.late_delivery.flat RANKS 2 TIMEOUT 90 LABELS reliability FAULTS
  ENV LOCKSTEP_TIMEOUT=2 LOCKSTEP_SHM=0 OMPI_MCA_btl=self,tcp
      "LOCKSTEP_FAULT=rank=1,kind=freeze_exchange,after=1,seconds=9"
  COMMAND ${LOCKSTEP_LATE_DELIVERY} <N> $<TARGET_FILE:lockstep_late_delivery> 1 1048576 40)
lockstep_add_rank_tests(NAME reliability.late_delivery.hierarchical RANKS 4 TIMEOUT 90 LABELS reliability FAULTS
  ENV LOCKSTEP_TIMEOUT=2 LOCKSTEP_TEST_HOST_SIZE=2 OMPI_MCA_btl=self,tcp
      "LOCKSTEP_FAULT=rank=3,kind=freeze_exchange,after=1,seconds=9"
  COMMAND ${LOCKSTEP_LATE_DELIVERY} <N> $<TARGET_FILE:lockstep_late_delivery> 3 1048576 40)

# The micro-step count agreed on one of the step's own calls (issue 41): explicit accumulation a
# different number of times per rank is a MismatchError on every rank, in every form the step's
# collectives take; at 4 ranks also as two simulated machines with every call on the
# hierarchical path (its inter-host 16-bit wire included).
lockstep_test_executable(test_micro_steps reliability/micro_steps_test.cpp)
lockstep_add_mpi_test(NAME micro_steps TARGET test_micro_steps RANKS 1 2 3 4 TIMEOUT 180
                      LABELS reliability ENV LOCKSTEP_TIMEOUT=20)
if(LOCKSTEP_FAULT_INJECTION)
  lockstep_add_mpi_test(NAME micro_steps.hierarchical TARGET test_micro_steps RANKS 4 TIMEOUT 180
                        LABELS reliability
                        ENV LOCKSTEP_TIMEOUT=20 LOCKSTEP_TEST_HOST_SIZE=2 LOCKSTEP_TEST_HIER_MIN_BYTES=0)
endif()

# rescue_buddy: a sharded state's shards each kept on two simulated hosts; a rank killed at -n 4,
# its host's files removed, and the run resumed at -n 2 from the other host's shard rescue files
# ends with the uninterrupted run's model hash (a few seconds).
if(LOCKSTEP_FAULT_INJECTION)
  add_executable(rescue_buddy_main reliability/rescue_buddy_main.cpp)
  target_link_libraries(rescue_buddy_main PRIVATE lockstep::core lockstep_build_flags)
  lockstep_add_script_test(NAME reliability.rescue_buddy SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/reliability/rescue_buddy.sh
    TARGET rescue_buddy_main PROCESSORS 4 TIMEOUT 120 LABELS reliability FAULTS)
endif()
