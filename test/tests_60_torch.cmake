# lockstep::torch (ext/torch): real LibTorch models and optimizers under mpiexec at 1-4 ranks,
# and a checkpoint read back by Python (python3-torch). Built when LOCKSTEP_WITH_TORCH is on.
if(TARGET lockstep_torch)
  # One program for the five LibTorch test files, compiled as one unit (LibTorch's headers are
  # slow to parse: once instead of five times); their helpers are torch_test_support.hpp. Each
  # CTest test below runs one file's test cases (Catch2's -# tags each case with its file name;
  # ~[.] keeps the hidden export case out, torch_checkpoint_python runs it).
  set(torch_test_dir ${PROJECT_SOURCE_DIR}/ext/torch/test)
  lockstep_test_executable(test_torch ${torch_test_dir}/torch_test.cpp ${torch_test_dir}/sync_batchnorm_test.cpp
                           ${torch_test_dir}/deterministic_test.cpp ${torch_test_dir}/sharded_test.cpp
                           ${torch_test_dir}/real_model_test.cpp)
  target_link_libraries(test_torch PRIVATE lockstep::torch)
  set_target_properties(test_torch PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0)
  # The bridge, synchronize, DistributedOptimizer and checkpoints (torch_test.cpp).
  lockstep_add_mpi_test(NAME torch TARGET test_torch RANKS 1 2 3 4 LABELS torch TIMEOUT 600
    ARGS "-#" "[#torch_test]~[.]" ENV OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1)
  # lt::SyncBatchNorm and lt::convert_sync_batchnorm: N ranks equal one process on the global
  # batch (even, uneven, a rank with 0 rows; f64, f16, bf16, channels_last, non-contiguous),
  # collectives counted, one rank's refused input an error on every rank, an input needing a
  # gradient on some ranks only, convert's refusals; lt::Join with 0, 1 and 5 extra batches on
  # one rank, every rank running out at a different step (sharded SGD inside), a SyncBatchNorm
  # error on one rank inside the loop caught on every rank, and a rank that has a batch again
  # refused on every rank; a SyncBatchNorm forward or backward after its backend was destroyed.
  lockstep_add_mpi_test(NAME torch_sync_batchnorm TARGET test_torch RANKS 1 2 3 4 LABELS torch
    TIMEOUT 300 ARGS "-#" "[#sync_batchnorm_test]~[.]" ENV OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1)
  # Deterministic mode (DistributedOptions::deterministic): N ranks on uneven blocks of
  # micro-batches (some none) equal one process bit for bit, in any order; accumulation_steps,
  # skip_non_finite, unused parameters; LibTorch's settings held and restored; every refusal on
  # every rank (sharded, the 16-bit wire, f64, SyncBatchNorm); lt::model_hash.
  lockstep_add_mpi_test(NAME torch_deterministic TARGET test_torch RANKS 1 2 3 4 LABELS torch
    TIMEOUT 300 ARGS "-#" "[#deterministic_test]~[.]" ENV OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1)
  # shard_optimizer_state (ZeroRedundancyOptimizer) and wire_dtype for torch optimizers: the
  # sharded form equals the replicated one, 1/N of the state per rank, the same checkpoint file,
  # read at any N (written at 2, read at 1 and 3); the 16-bit wire rounds and trains close to f32.
  lockstep_add_mpi_test(NAME torch_sharded TARGET test_torch RANKS 1 2 3 LABELS torch
    TIMEOUT 300 ARGS "-#" "[#sharded_test]~[.]" ENV OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1)
  # What a real model (a transformer) brings, against one process with LibTorch alone: a tied weight
  # refused when given twice, reduced once, saved, loaded and hashed once; parameters without a
  # gradient in a step, clipped; the global norm (max_grad_norm) replicated, sharded and
  # deterministic equal to clip_grad_norm_'s.
  lockstep_add_mpi_test(NAME torch_real_model TARGET test_torch RANKS 1 2 3 LABELS torch
    TIMEOUT 300 ARGS "-#" "[#real_model_test]~[.]" ENV OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1)
  # The torch_digits example (examples/torch) as a user runs it: accuracy on the held-out digits,
  # and stop/resume through lt::save_checkpoint/load_checkpoint bitwise equal to one run. The
  # target exists under the same condition examples/torch/CMakeLists.txt uses (zlib found).
  find_package(ZLIB QUIET)
  if(LOCKSTEP_BUILD_EXAMPLES AND ZLIB_FOUND)
    lockstep_add_example_test(NAME torch_digits_accuracy SCRIPT torch_digits_accuracy.sh TARGET torch_digits
                              RANKS 2 TIMEOUT 120)
    lockstep_add_example_test(NAME torch_digits_resume SCRIPT torch_digits_resume.sh TARGET torch_digits
                              RANKS 2 TIMEOUT 120)
    # gpt (tiny preset): the loss falls at -n 1 and 2, one hash with --deterministic; stop/resume
    # continues the uninterrupted curve (ordinary at -n 2, deterministic from -n 2 to -n 1, rotation).
    lockstep_add_example_test(NAME gpt_train SCRIPT gpt_train.sh TARGET gpt RANKS 2 TIMEOUT 240)
    lockstep_add_example_test(NAME gpt_resume SCRIPT gpt_resume.sh TARGET gpt RANKS 2 TIMEOUT 240)
    # torch_digits_bn: a CNN with convert_sync_batchnorm, the same test loss at -n 1, 2 and 4.
    lockstep_add_example_test(NAME torch_digits_bn_scale SCRIPT torch_digits_bn_scale.sh TARGET torch_digits_bn
                              RANKS 4 TIMEOUT 240)
    # --deterministic: one model hash at -n 1, 2 and 4 and after a stop at 4 resumed at 2; without
    # it -n 1 and -n 4 differ.
    lockstep_add_example_test(NAME torch_digits_deterministic SCRIPT torch_digits_deterministic.sh
                              TARGET torch_digits RANKS 4 TIMEOUT 300)
    set_property(TEST torch_digits_accuracy torch_digits_resume torch_digits_bn_scale torch_digits_deterministic
                 gpt_train gpt_resume APPEND PROPERTY LABELS torch)
    set_property(TEST torch_digits_accuracy torch_digits_resume torch_digits_bn_scale torch_digits_deterministic
                 gpt_train gpt_resume APPEND PROPERTY ENVIRONMENT
                 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1)
  endif()
endif()

# A checkpoint written by lockstep::torch (the hidden test "[.export]" of test_torch, as an MPI
# singleton), read back in Python (python3-torch) into the same architecture: same output,
# every name the module's own, Adam's state there. Skipped (77) where Python has no torch.
if(TARGET lockstep_torch)
  add_test(NAME torch_checkpoint_python
    COMMAND bash -c "py=/usr/bin/python3; [ -x \"$py\" ] || py=python3; \"$py\" -c 'import torch' 2>/dev/null || { echo 'skipped: no python3 with torch (apt-get install python3-torch)'; exit 77; }; LOCKSTEP_TORCH_EXPORT_DIR=\"$2\" \"$1\" '[.export]' && \"$py\" \"$3\" \"$2\""
            _ $<TARGET_FILE:test_torch> ${CMAKE_CURRENT_BINARY_DIR}/torch-export
            ${PROJECT_SOURCE_DIR}/ext/torch/test/read_checkpoint.py)
  set_tests_properties(torch_checkpoint_python PROPERTIES LABELS "unit;torch" TIMEOUT 120
    SKIP_RETURN_CODE 77 ENVIRONMENT "${LOCKSTEP_TEST_ENV};OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1")
endif()
