# lockstep::torch (ext/torch): real LibTorch models and optimizers under mpiexec at 1-4 ranks,
# and a checkpoint read back by Python (python3-torch). Built when LOCKSTEP_WITH_TORCH is on.
if(TARGET lockstep_torch)
  lockstep_test_executable(test_torch ${PROJECT_SOURCE_DIR}/ext/torch/test/torch_test.cpp)
  target_link_libraries(test_torch PRIVATE lockstep::torch)
  lockstep_add_mpi_test(NAME torch TARGET test_torch RANKS 1 2 3 4 LABELS torch TIMEOUT 600
    ENV OMP_NUM_THREADS=1)
endif()
