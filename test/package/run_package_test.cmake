# Builds and runs one package test (cmake -P). Variables:
#   MODE          install: `cmake --install` BUILD_DIR into a fresh prefix, then build
#                 downstream/ against it with find_package(lockstep), on a machine made to look
#                 as if it had no CUDA and no NCCL (see "hidden" below), and check the
#                 components: one targets file per built component, CUDA and NCCL not even
#                 looked for unless asked, a missing required component fails with its reason,
#                 an optional one does not; with CUDA, lockstep::nccl links where CUDA is seen;
#                 subdir: build subdir/, which add_subdirectory()s SOURCE_DIR, and check the
#                 configure summary.
#   SOURCE_DIR    Lockstep's source tree.   BUILD_DIR   its (built) build tree (install mode).
#   WORK_DIR      scratch directory, emptied first.
#   CXX_COMPILER, WITH_CUDA, WITH_NCCL    passed on so the test builds what the main build did.
#   HIDE_DIRS     (install mode) ':'-separated CUDA/NCCL installation roots to hide besides
#                 /usr/local/cuda and /usr/local/cuda-*.
cmake_minimum_required(VERSION 3.25)

foreach(var MODE SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_package_test.cmake: -D${var}=... is required")
  endif()
endforeach()

# Runs a command; stops the test with its output when it fails.
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "package test (${MODE}): ${what} failed (${rc})\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

# Runs a command that must fail; its stdout and stderr together in last_output.
function(run_failing_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "package test (${MODE}): ${what} succeeded but should have failed\n${out}\n${err}")
  endif()
  message(STATUS "${what}: failed, as it should")
  set(last_output "${out}\n${err}" PARENT_SCOPE)
endfunction()

# expect_output(what regex...): every regex must match last_output.
function(expect_output what)
  foreach(re IN LISTS ARGN)
    if(NOT last_output MATCHES "${re}")
      message(FATAL_ERROR "package test (${MODE}): ${what}: no match for '${re}' in:\n${last_output}")
    endif()
  endforeach()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(common_args -DCMAKE_BUILD_TYPE=Release)
if(CXX_COMPILER)
  list(APPEND common_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()

if(MODE STREQUAL "install")
  if(NOT DEFINED BUILD_DIR)
    message(FATAL_ERROR "run_package_test.cmake: install mode needs -DBUILD_DIR=...")
  endif()
  set(prefix "${WORK_DIR}/prefix")
  run_step("cmake --install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")
  if(NOT EXISTS "${prefix}/include/lockstep/lockstep.hpp" OR NOT EXISTS "${prefix}/include/lockstep/config.hpp")
    message(FATAL_ERROR "package test: the installed tree lacks include/lockstep/lockstep.hpp or config.hpp")
  endif()
  # lockstep-run, where the build has it, installed under its name and runnable from there.
  if(EXISTS "${BUILD_DIR}/tools/lockstep-run")
    execute_process(COMMAND "${prefix}/bin/lockstep-run" --help RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    if(NOT rc EQUAL 0 OR NOT out MATCHES "^Usage: lockstep-run")
      message(FATAL_ERROR "package test: ${prefix}/bin/lockstep-run --help failed (${rc}): ${out}")
    endif()
  endif()
  file(GLOB_RECURSE config_files "${prefix}/*/lockstepConfig.cmake")
  if(NOT config_files)
    message(FATAL_ERROR "package test: no lockstepConfig.cmake under ${prefix}")
  endif()
  get_filename_component(cmakedir "${config_files}" DIRECTORY)
  # One targets file per component, and only the built ones.
  set(want_files lockstepCoreTargets.cmake)
  set(unwanted_files lockstepTargets.cmake)
  foreach(comp IN ITEMS Cuda Nccl Torch)
    string(TOUPPER "${comp}" upper)
    if(WITH_${upper})
      list(APPEND want_files lockstep${comp}Targets.cmake)
    else()
      list(APPEND unwanted_files lockstep${comp}Targets.cmake)
    endif()
  endforeach()
  foreach(f IN LISTS want_files)
    if(NOT EXISTS "${cmakedir}/${f}")
      message(FATAL_ERROR "package test: ${cmakedir} lacks ${f}")
    endif()
  endforeach()
  foreach(f IN LISTS unwanted_files)
    if(EXISTS "${cmakedir}/${f}")
      message(FATAL_ERROR "package test: ${cmakedir} has ${f}, which this build should not install")
    endif()
  endforeach()
  message(STATUS "targets files: ${want_files}")

  # "Hidden": a machine without CUDA or NCCL, as far as CMake can tell. PATH without its CUDA
  # directories and the CUDA variables unset (as scripts/test.sh's without_cuda does), plus the
  # toolkit's own directories ignored by every find_* call (FindCUDAToolkit also looks in
  # /usr/local/cuda whatever PATH says).
  set(roots /usr/local/cuda)
  file(GLOB versioned /usr/local/cuda-*)
  list(APPEND roots ${versioned})
  if(HIDE_DIRS)
    string(REPLACE ":" ";" extra "${HIDE_DIRS}")
    list(APPEND roots ${extra})
  endif()
  set(ignore "")
  foreach(r IN LISTS roots)
    file(REAL_PATH "${r}" real)
    foreach(d IN ITEMS "${r}" "${real}")
      if(d MATCHES "^/(usr(/local)?|opt)?/?$")  # never a system prefix: MPI lives there
        continue()
      endif()
      list(APPEND ignore "${d}")
      foreach(sub IN ITEMS bin include lib lib64 lib64/stubs lib/x86_64-linux-gnu
                           targets/x86_64-linux/include targets/x86_64-linux/lib)
        list(APPEND ignore "${d}/${sub}")
      endforeach()
    endforeach()
  endforeach()
  # PATH without its CUDA directories, nor any other holding an nvcc (a wrapper script in
  # /usr/local/bin, say), which are ignored by find_program too. An nvcc in a system directory
  # cannot be hidden: then the checks that need CUDA hidden are skipped.
  set(path "")
  set(cuda_hidden TRUE)
  string(REPLACE ":" ";" path_entries "$ENV{PATH}")
  foreach(e IN LISTS path_entries)
    string(TOLOWER "${e}" lower)
    if(lower MATCHES "cuda")
      continue()
    endif()
    if(EXISTS "${e}/nvcc")
      if(e MATCHES "^/(usr/)?s?bin/?$")
        set(cuda_hidden FALSE)
      else()
        list(APPEND ignore "${e}")
        continue()
      endif()
    endif()
    list(APPEND path "${e}")
  endforeach()
  string(REPLACE ";" ":" path "${path}")
  list(REMOVE_DUPLICATES ignore)
  file(WRITE "${WORK_DIR}/hide-cuda.cmake"
    "set(CMAKE_IGNORE_PATH \"${ignore}\" CACHE STRING \"\")\n"
    "set(CMAKE_IGNORE_PREFIX_PATH \"${ignore}\" CACHE STRING \"\")\n")
  set(hidden ${CMAKE_COMMAND} -E env --unset=CUDACXX --unset=CUDA_PATH --unset=CUDA_HOME
      --unset=CUDAToolkit_ROOT --unset=CUDA_ROOT --unset=NCCL_ROOT --unset=LIBRARY_PATH
      --unset=CPATH "PATH=${path}" ${CMAKE_COMMAND} -C "${WORK_DIR}/hide-cuda.cmake")
  set(downstream -S "${SOURCE_DIR}/test/package/downstream" "-DCMAKE_PREFIX_PATH=${prefix}" ${common_args})

  # Components asked for that cannot be had: cuda (not built, or no CUDA here) and torch (not
  # built in this version): the configure fails and says which and why.
  set(missing "")
  set(missing_why "")
  if(NOT WITH_TORCH)
    set(missing torch)
    set(missing_why "torch: not built: this installation was configured with LOCKSTEP_WITH_TORCH=OFF")
  endif()
  if(NOT WITH_CUDA)
    list(PREPEND missing cuda)
    list(APPEND missing_why "cuda: not built: this installation was configured with LOCKSTEP_WITH_CUDA=OFF")
  elseif(cuda_hidden)
    list(PREPEND missing cuda)
    list(APPEND missing_why "cuda: needs the CUDA toolkit, which CMake did not find")
  else()
    message(STATUS "nvcc is in a system directory here, so CUDA cannot be hidden: "
      "not checking that a missing CUDA toolkit is reported")
  endif()
  list(JOIN missing "," missing_arg)
  list(JOIN missing " " missing_names)
  if(missing)
  run_failing_step("hidden: find_package(lockstep COMPONENTS core ${missing_names})" ${hidden} ${downstream}
    -B "${WORK_DIR}/build-missing" "-DLOCKSTEP_TEST_COMPONENTS=core,${missing_arg}")
  string(REPLACE "\n" " " last_output "${last_output}")
  string(REGEX REPLACE " +" " " last_output "${last_output}")
  expect_output("missing components" "set lockstep_FOUND to FALSE" "required component\\(s\\) not available"
    ${missing_why})
  # The same as optional components: found, with lockstep_<comp>_FOUND false.
  run_step("hidden: find_package(lockstep OPTIONAL_COMPONENTS ${missing_names})" ${hidden} ${downstream}
    -B "${WORK_DIR}/build-optional" "-DLOCKSTEP_TEST_OPTIONAL_COMPONENTS=${missing_arg}")
  expect_output("optional components" "lockstep_core_FOUND=TRUE")
  if("torch" IN_LIST missing)
    expect_output("optional components" "lockstep_torch_FOUND=FALSE" "optional component torch not available")
  endif()
  if("cuda" IN_LIST missing)
    expect_output("optional components" "lockstep_cuda_FOUND=FALSE")
  endif()
  endif()

  if(WITH_TORCH)
    # The LibTorch adapter: its component is found (with LibTorch) and a program linking
    # lockstep::torch builds and runs.
    run_step("with LibTorch: find_package(lockstep COMPONENTS torch)" ${CMAKE_COMMAND} ${downstream}
      -B "${WORK_DIR}/build-torch" "-DLOCKSTEP_TEST_COMPONENTS=torch" "-DLOCKSTEP_TEST_LINK=lockstep::torch"
      -DLOCKSTEP_TEST_SOURCE=../app_torch.cpp)
    expect_output("torch component" "lockstep_torch_FOUND=TRUE")
    run_step("with LibTorch: build an app linking lockstep::torch" ${CMAKE_COMMAND} --build "${WORK_DIR}/build-torch" --parallel 2)
    run_step("with LibTorch: run it" "${WORK_DIR}/build-torch/app")
    expect_output("torch app" "torch package test: ok")
  endif()

  if(WITH_CUDA)
    # Where CUDA can be seen, the GPU components are found and lockstep::nccl (or ::cuda) links.
    set(gpu_components cuda)
    set(gpu_link lockstep::cuda)
    if(WITH_NCCL)
      set(gpu_components cuda,nccl)
      set(gpu_link lockstep::nccl)
    endif()
    run_step("with CUDA: find_package(lockstep COMPONENTS ${gpu_components})" ${CMAKE_COMMAND} ${downstream}
      -B "${WORK_DIR}/build-gpu" "-DLOCKSTEP_TEST_COMPONENTS=${gpu_components}" "-DLOCKSTEP_TEST_LINK=${gpu_link}"
      -DLOCKSTEP_TEST_SOURCE=../app_gpu.cpp)
    expect_output("GPU components" "lockstep_cuda_FOUND=TRUE")
    if(WITH_NCCL)
      expect_output("GPU components" "lockstep_nccl_FOUND=TRUE")
    endif()
    run_step("with CUDA: build an app linking ${gpu_link}" ${CMAKE_COMMAND} --build "${WORK_DIR}/build-gpu" --parallel 2)
    run_step("with CUDA: run it" "${WORK_DIR}/build-gpu/app")
    expect_output("GPU app" "cuda devices: [0-9]+" "gpu package test: ok")
  endif()

  # The plain core user, last (it is built and run below), on the hidden machine.
  run_step("hidden: configure downstream (lockstep::core only)" ${hidden} ${downstream} -B "${WORK_DIR}/build")
  expect_output("core only" "lockstep_core_FOUND=TRUE" "lockstep_cuda_FOUND=unset")
  # The package did not even look for CUDA or NCCL: no trace of either in the cache.
  file(STRINGS "${WORK_DIR}/build/CMakeCache.txt" looked REGEX "^(CUDAToolkit|CUDA_|NCCL)[A-Za-z_]*:")
  if(looked)
    message(FATAL_ERROR "package test: find_package(lockstep) looked for CUDA or NCCL without being asked:\n${looked}")
  endif()
elseif(MODE STREQUAL "subdir")
  run_step("configure subdir" ${CMAKE_COMMAND} -S "${SOURCE_DIR}/test/package/subdir"
           -B "${WORK_DIR}/build" "-DLOCKSTEP_SOURCE_DIR=${SOURCE_DIR}"
           "-DLOCKSTEP_WITH_CUDA=${WITH_CUDA}" "-DLOCKSTEP_WITH_NCCL=${WITH_NCCL}" -DLOCKSTEP_WITH_TORCH=OFF
           ${common_args}
           # The whole library is compiled again here; what this test checks (targets, include
           # paths, the summary, linking) does not depend on optimisation, so the compile is at
           # -O0, which halves the test's time.
           "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG")
  # The configure summary, with a line for every component.
  expect_output("configure summary" "Lockstep [0-9.]+ configuration summary" "build type +Release"
    "MPI +" "core +yes" "cuda +(yes|no: )" "nccl +(yes|no: )" "torch +no: turned off" "tests +OFF" "examples +OFF"
    "fault injection +OFF")
else()
  message(FATAL_ERROR "run_package_test.cmake: MODE must be install or subdir, not '${MODE}'")
endif()

run_step("build" ${CMAKE_COMMAND} --build "${WORK_DIR}/build" --parallel 2)
run_step("run app" "${WORK_DIR}/build/app")
if(NOT last_output MATCHES "allreduce ok")
  message(FATAL_ERROR "package test (${MODE}): unexpected output: ${last_output}")
endif()
message(STATUS "${last_output}")

if(MODE STREQUAL "subdir")
  # Without Lockstep's tests there is no fault injection: no fault code in the library, and
  # LOCKSTEP_FAULT is an error at initialisation, not silently ignored.
  file(GLOB_RECURSE libs "${WORK_DIR}/build/lockstep/liblockstep_core.*")
  if(NOT libs)
    message(FATAL_ERROR "package test (subdir): no liblockstep_core under ${WORK_DIR}/build/lockstep")
  endif()
  list(GET libs 0 lib)
  run_step("nm liblockstep_core" nm -C "${lib}")
  if(last_output MATCHES "inject_fault|fault_spec|FaultSpec")
    message(FATAL_ERROR "package test (subdir): the library has fault injection code:\n${CMAKE_MATCH_0}")
  endif()
  run_failing_step("run app with LOCKSTEP_FAULT" ${CMAKE_COMMAND} -E env "LOCKSTEP_FAULT=rank=0,kind=skip,after=0"
    "${WORK_DIR}/build/app")
  expect_output("LOCKSTEP_FAULT refused" "LOCKSTEP_FAULT=\"rank=0,kind=skip,after=0\": this build of Lockstep has no fault injection \\(LOCKSTEP_FAULT_INJECTION=OFF\\); unset LOCKSTEP_FAULT")
endif()
