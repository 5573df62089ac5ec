# Foundation tests: tensors (unit), MPIBackend collectives and the world vocabulary (mpi), the
# life cycle of the global backend, messages above 2^31 elements (large), and the package
# (install + find_package, add_subdirectory).

lockstep_add_unit_test(NAME tensor TARGET test_tensor SOURCES core/tensor_test.cpp TIMEOUT 120)
# Deterministic mode's fused exact sum, one test per instruction-set form (baseline, AVX2,
# AVX-512), each against the int64 path bit for bit; a form this CPU lacks is reported skipped.
# It reads the core layer's internal header (the layer's own view of src/, as its sources do).
add_executable(test_exact_kernels core/exact_kernels_test.cpp)
target_link_libraries(test_exact_kernels PRIVATE lockstep::core lockstep_build_flags)
target_include_directories(test_exact_kernels PRIVATE ${PROJECT_BINARY_DIR}/layers/core/src)
foreach(_isa IN ITEMS baseline avx2 avx512)
  add_test(NAME exact_kernels.${_isa} COMMAND test_exact_kernels ${_isa})
  set_tests_properties(exact_kernels.${_isa} PROPERTIES TIMEOUT 120 LABELS unit SKIP_RETURN_CODE 77)
endforeach()
# The collectives at 1 to 4 ranks, and once over TCP, the transport a multi-node job takes.
lockstep_add_mpi_test(NAME collective TARGET test_collective SOURCES mpi/collective_test.cpp RANKS 1 2 3 4
                      TIMEOUT 300)
lockstep_add_mpi_test(NAME collective TARGET test_collective RANKS 2 TCP TIMEOUT 300)
# Label across_hosts: runs that scripts/test.sh's multihost stage repeats on real hosts (4 ranks
# as 2 hosts x 2, TCP between them); the CI core stage leaves them to it, and runs them itself
# only where that stage cannot run (no network namespaces).
set_property(TEST collective.np4 collective.np2.tcp APPEND PROPERTY LABELS across_hosts)
lockstep_add_mpi_test(NAME world TARGET test_world SOURCES mpi/world_test.cpp RANKS 1 2 3 4 TIMEOUT 120)

# Its own main: the shared test main initialises MPI, which is what these scenarios vary.
add_executable(test_world_lifecycle mpi/world_lifecycle_test.cpp)
target_link_libraries(test_world_lifecycle PRIVATE lockstep::core lockstep_build_flags)
foreach(mode IN ITEMS owned borrowed autoinit atexit)
  lockstep_add_mpi_test(NAME world_lifecycle.${mode} TARGET test_world_lifecycle RANKS 1 3
                        ARGS ${mode} TIMEOUT 60)
endforeach()

lockstep_test_executable(test_collective_large mpi/collective_large_test.cpp)
lockstep_add_mpi_test(NAME collective_large TARGET test_collective_large RANKS 2 LABELS large
                      TIMEOUT 180)

# Package tests: a downstream project against the installed tree (find_package, its components,
# with CUDA and NCCL hidden), and one that add_subdirectory()s the source tree. Each builds in
# its own scratch directory. HIDE_DIRS: the CUDA and NCCL this build used, for the hidden runs.
set(_lockstep_hide_dirs "")
foreach(_dir IN ITEMS "${CUDAToolkit_BIN_DIR}" "${NCCL_INCLUDE_DIR}")
  if(_dir AND EXISTS "${_dir}")
    get_filename_component(_dir "${_dir}" DIRECTORY)
    list(APPEND _lockstep_hide_dirs "${_dir}")
  endif()
endforeach()
string(REPLACE ";" ":" _lockstep_hide_dirs "${_lockstep_hide_dirs}")
foreach(mode IN ITEMS install subdir)
  add_test(NAME package.${mode}
    COMMAND ${CMAKE_COMMAND} -DMODE=${mode} -DSOURCE_DIR=${PROJECT_SOURCE_DIR}
            -DBUILD_DIR=${PROJECT_BINARY_DIR} -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/package-${mode}
            -DCXX_COMPILER=${CMAKE_CXX_COMPILER} -DWITH_CUDA=${LOCKSTEP_WITH_CUDA}
            -DWITH_NCCL=${LOCKSTEP_WITH_NCCL} -DWITH_TORCH=${LOCKSTEP_WITH_TORCH} "-DHIDE_DIRS=${_lockstep_hide_dirs}"
            -P ${CMAKE_CURRENT_SOURCE_DIR}/package/run_package_test.cmake)
  set_tests_properties(package.${mode} PROPERTIES LABELS package TIMEOUT 600 PROCESSORS 2
    ENVIRONMENT "${LOCKSTEP_TEST_ENV}")
endforeach()

# The shared-memory path of MPIBackend (large host allreduce and broadcast on one machine): the
# default slice; 4 KiB slices and no threshold, so that every call crosses many slices; and the
# MPI path (LOCKSTEP_SHM=0, the [shm] cases left out). The collective suite runs once more with
# small slices, so that every dtype, op and size of it goes through shared memory.
lockstep_test_executable(test_shm_collectives mpi/shm_collectives_test.cpp)
# Its 16-bit cases compute their references element by element in the test itself, so it keeps
# the build type's optimisation where LOCKSTEP_TEST_CXX_FLAGS lowers the others' (the sanitizer
# stage: at -O0 its runs took 2-3x as long, 282 s at 3 ranks).
set_property(TARGET test_shm_collectives PROPERTY COMPILE_OPTIONS "")
lockstep_add_mpi_test(NAME shm_collectives TARGET test_shm_collectives RANKS 2 3 4 TIMEOUT 300)
lockstep_add_mpi_test(NAME shm_collectives.small_slices TARGET test_shm_collectives RANKS 2 3
                      ENV LOCKSTEP_SHM_SLICE_BYTES=4096 LOCKSTEP_SHM_MIN_BYTES=1 TIMEOUT 300)
# A rank that cannot make its segment for a reduce buffer (/dev/shm full): every rank gets
# ordinary memory, the results stay right and nothing goes in place.
lockstep_add_mpi_test(NAME shm_collectives.no_segment TARGET test_shm_collectives RANKS 3
                      ARGS "*allocate_reduce_buffer*" ENV LOCKSTEP_FAULT=rank=1,kind=no_segment TIMEOUT 120)
lockstep_add_mpi_test(NAME shm_collectives.off TARGET test_shm_collectives RANKS 1 2 3
                      ARGS "~[shm]" ENV LOCKSTEP_SHM=0 TIMEOUT 300)
# Reduce buffers (allocate_reduce_buffer) against mixed placements, every dtype and op, mismatched
# calls, freed allocations, the reducer's thread and a backend that is gone: at 2-4 ranks, with
# 4 KiB slices, without the shared-memory path, and at one rank.
lockstep_test_executable(test_reduce_buffers mpi/reduce_buffers_test.cpp)
lockstep_add_mpi_test(NAME reduce_buffers TARGET test_reduce_buffers RANKS 2 3 4 TIMEOUT 120)
lockstep_add_mpi_test(NAME reduce_buffers.small_slices TARGET test_reduce_buffers RANKS 3
                      ENV LOCKSTEP_SHM_SLICE_BYTES=4096 TIMEOUT 120)
lockstep_add_mpi_test(NAME reduce_buffers.off TARGET test_reduce_buffers RANKS 2 ARGS "~[dtypes]~[shm]~[.deadline]" ENV LOCKSTEP_SHM=0
                      TIMEOUT 120)
# A rank 2.5 s late for an in-place allreduce of a reduce buffer, the others giving up after 1 s:
# TimeoutError on every rank, and nobody writes a rank's buffer after its call threw. After a
# stall the ranks skip MPI_Finalize (the job then ends "improperly"), so the verdict is Catch2's
# report: rank 0's combined one, and no rank's failure report.
if(LOCKSTEP_FAULT_INJECTION)
  lockstep_add_mpi_test(NAME reduce_buffers.deadline TARGET test_reduce_buffers RANKS 3 ARGS "[.deadline]"
                        ENV LOCKSTEP_TIMEOUT=1 "LOCKSTEP_FAULT=rank=1,kind=delay,after=3,seconds=2.5" TIMEOUT 60)
  set_tests_properties(reduce_buffers.deadline.np3 PROPERTIES PASS_REGULAR_EXPRESSION "All tests passed"
                       FAIL_REGULAR_EXPRESSION "\\(failed\\);FAILED")
endif()
# At 2 ranks: with 4 KiB slices the 3-rank slice layouts are shm_collectives.small_slices.np3's.
lockstep_add_mpi_test(NAME collective.small_slices TARGET test_collective RANKS 2
                      ENV LOCKSTEP_SHM_SLICE_BYTES=4096 LOCKSTEP_SHM_MIN_BYTES=1 TIMEOUT 300)

# The hierarchical allreduce (src/mpi/hierarchical.*), on one machine: LOCKSTEP_TEST_HOST_SIZE=2
# (honoured in builds with fault injection only) makes ranks {0,1} and {2,3} separate "machines".
# At 4 ranks the path is on: with the default 4 MiB chunk and 64 KiB threshold, and with 8 KiB
# chunks, 4 KiB shared-memory slices and no threshold (every call from one element takes it and
# crosses many chunks and slices); at 3 ranks the placement is
# uneven ({0,1} and {2}) and every call takes the flat path. The collective suite and the
# training tests run once more at 4 ranks with the setting.
if(LOCKSTEP_FAULT_INJECTION)
  lockstep_add_mpi_test(NAME hierarchical TARGET test_hierarchical SOURCES mpi/hierarchical_test.cpp mpi/hierarchical_reducer_test.cpp RANKS 4
                        ENV LOCKSTEP_TEST_HOST_SIZE=2 TIMEOUT 300)
  # At 3 ranks every call is flat: the f32 and 16-bit allreduces show it is the flat result; the
  # f64 and integer ones (12.6 of this run's 26 s) would show the same thing again.
  lockstep_add_mpi_test(NAME hierarchical TARGET test_hierarchical RANKS 3
                        ARGS "~allreduce f64*" "~allreduce i32 and i64*"
                        ENV LOCKSTEP_TEST_HOST_SIZE=2 TIMEOUT 300)
  # Its allreduce cases check every element against a reference computed in the test itself,
  # so it keeps the build type's optimisation, as test_shm_collectives does.
  set_property(TARGET test_hierarchical PROPERTY COMPILE_OPTIONS "")
  lockstep_add_mpi_test(NAME hierarchical.small_chunks TARGET test_hierarchical RANKS 4
                        ENV LOCKSTEP_TEST_HOST_SIZE=2 LOCKSTEP_TEST_HIER_CHUNK_BYTES=8192 LOCKSTEP_TEST_HIER_MIN_BYTES=0
                            LOCKSTEP_SHM_SLICE_BYTES=4096
                        TIMEOUT 300)
  # The shared-memory stages declined (LOCKSTEP_SHM_MIN_BYTES above every call): the node stages
  # and the agreement's node step go over MPI on the machine's communicator instead.
  lockstep_add_mpi_test(NAME hierarchical.node_mpi TARGET test_hierarchical RANKS 4
                        ENV LOCKSTEP_TEST_HOST_SIZE=2 LOCKSTEP_TEST_HIER_MIN_BYTES=0 LOCKSTEP_SHM_MIN_BYTES=1G
                            LOCKSTEP_TEST_HIER_CHUNK_BYTES=65536 TIMEOUT 300)
  lockstep_add_mpi_test(NAME collective.hierarchical TARGET test_collective RANKS 4
                        ENV LOCKSTEP_TEST_HOST_SIZE=2 TIMEOUT 300)
  # The multihost stage runs the same suite at 2 hosts x 2 on real hosts (its "collective" run).
  set_property(TEST collective.hierarchical.np4 APPEND PROPERTY LABELS across_hosts)
  # The reducer's split of a bucket's large tensors across machines, on one machine (no
  # LOCKSTEP_TEST_HOST_SIZE): nothing is split there.
  lockstep_add_mpi_test(NAME hierarchical.reducer_one_machine TARGET test_hierarchical RANKS 3
                        ARGS "[reducer_split]" TIMEOUT 120)
endif()
