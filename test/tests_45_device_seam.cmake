# MPIBackend and DistributedOptimizer on cuda tensors without a GPU: a DeviceRuntime of guarded
# host memory (host code touching a device pointer crashes) that counts allocations, copies and
# synchronisations, and optimizer kernels that count launches. Built in every configuration.
lockstep_test_executable(test_device_seam core/device_seam_test.cpp)
lockstep_add_mpi_test(NAME device_seam TARGET test_device_seam RANKS 1 2 LABELS nogpu TIMEOUT 120)
