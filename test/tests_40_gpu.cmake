# GPU tests (label nccl): lockstep::cuda kernels and MPIBackend with cuda tensors, and
# NCCLBackend. They build wherever the extensions build; they run only with DIST_TEST_NCCL=true,
# and report themselves skipped (exit code 77) on a machine without a usable GPU.
# The sources live beside the extensions, in ext/cuda/test and ext/nccl/test.
if(NOT TARGET lockstep::cuda)
  return()
endif()

set(_gpu_test_dir ${PROJECT_SOURCE_DIR}/ext/cuda/test)

# lockstep_gpu_test_executable(target [DEVICE_PER_RANK] [NCCL] sources...): a Catch2 program
# with the test main in its GPU form (main_mpi.cpp with LOCKSTEP_TEST_GPU: skips without a GPU;
# DEVICE_PER_RANK: without one GPU per node-local rank; NCCL: links lockstep::nccl and finalises
# its backend).
function(lockstep_gpu_test_executable target)
  cmake_parse_arguments(G "DEVICE_PER_RANK;NCCL" "" "" ${ARGN})
  add_executable(${target} ${CMAKE_CURRENT_SOURCE_DIR}/main_mpi.cpp ${G_UNPARSED_ARGUMENTS})
  target_compile_definitions(${target} PRIVATE LOCKSTEP_TEST_GPU=1)
  target_link_libraries(${target} PRIVATE lockstep::cuda lockstep::core Catch2::Catch2 lockstep_build_flags)
  target_include_directories(${target} PRIVATE ${_gpu_test_dir})
  # The CPU reference arithmetic in the tests must not be contracted into FMA (the default of
  # g++ on targets that have FMA, e.g. aarch64), or the bitwise comparisons with the kernels
  # (built with --fmad=false) would compare different roundings.
  target_compile_options(${target} PRIVATE -ffp-contract=off)
  if(G_DEVICE_PER_RANK)
    target_compile_definitions(${target} PRIVATE LOCKSTEP_TEST_GPU_DEVICE_PER_RANK=1)
  endif()
  if(G_NCCL)
    target_link_libraries(${target} PRIVATE lockstep::nccl)
    target_compile_definitions(${target} PRIVATE LOCKSTEP_TEST_GPU_WITH_NCCL=1)
  endif()
endfunction()

lockstep_gpu_test_executable(test_cuda_kernels ${_gpu_test_dir}/kernels_test.cpp)
lockstep_add_mpi_test(NAME cuda_kernels TARGET test_cuda_kernels RANKS 1 GATE DIST_TEST_NCCL
  LABELS nccl TIMEOUT 300)

# Two ranks may share one GPU here: MPI does not mind.
lockstep_gpu_test_executable(test_mpi_device ${_gpu_test_dir}/mpi_device_test.cpp)
lockstep_add_mpi_test(NAME mpi_device TARGET test_mpi_device RANKS 1 2 GATE DIST_TEST_NCCL
  LABELS nccl TIMEOUT 300)

if(TARGET lockstep::nccl)
  set(_nccl_test_dir ${PROJECT_SOURCE_DIR}/ext/nccl/test)
  lockstep_gpu_test_executable(test_nccl_backend DEVICE_PER_RANK NCCL ${_nccl_test_dir}/nccl_backend_test.cpp)
  lockstep_add_mpi_test(NAME nccl_backend TARGET test_nccl_backend RANKS 1 2 GATE DIST_TEST_NCCL
    LABELS nccl TIMEOUT 300)
  lockstep_gpu_test_executable(test_nccl_training DEVICE_PER_RANK NCCL ${_nccl_test_dir}/nccl_training_test.cpp)
  lockstep_add_mpi_test(NAME nccl_training TARGET test_nccl_training RANKS 1 2 GATE DIST_TEST_NCCL
    LABELS nccl TIMEOUT 300)
endif()

# What the extensions do on a machine without a GPU (registration, argument checks, clean errors
# on every rank): runs everywhere the extensions are built, under the ordinary MPI gate, so the
# CI machine executes real code of lockstep::cuda and lockstep::nccl. Label nogpu.
if(TARGET lockstep::nccl)
  lockstep_test_executable(test_gpu_ext_no_gpu ${PROJECT_SOURCE_DIR}/ext/nccl/test/no_gpu_test.cpp)
  target_link_libraries(test_gpu_ext_no_gpu PRIVATE lockstep::nccl)
  lockstep_add_mpi_test(NAME gpu_ext_no_gpu TARGET test_gpu_ext_no_gpu RANKS 1 2 LABELS nogpu TIMEOUT 120)
endif()
# gpu_bench's command line (parsed before it looks for a GPU): --help, and bad flags named.
if(TARGET gpu_bench)
  lockstep_add_script_test(NAME gpu_bench.flags SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/examples/gpu_bench_flags.sh
    TARGET gpu_bench PROCESSORS 1 TIMEOUT 120 LABELS nogpu bench)
endif()
