# Builds and runs one package test (cmake -P). Variables:
#   MODE          install: `cmake --install` BUILD_DIR into a fresh prefix, then build
#                 downstream/ against it with find_package(lockstep);
#                 subdir: build subdir/, which add_subdirectory()s SOURCE_DIR.
#   SOURCE_DIR    Lockstep's source tree.   BUILD_DIR   its (built) build tree (install mode).
#   WORK_DIR      scratch directory, emptied first.
#   CXX_COMPILER, WITH_CUDA, WITH_NCCL    passed on so the test builds what the main build did.
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
  file(GLOB_RECURSE config_files "${prefix}/*/lockstepConfig.cmake")
  if(NOT config_files)
    message(FATAL_ERROR "package test: no lockstepConfig.cmake under ${prefix}")
  endif()
  run_step("configure downstream" ${CMAKE_COMMAND} -S "${SOURCE_DIR}/test/package/downstream"
           -B "${WORK_DIR}/build" "-DCMAKE_PREFIX_PATH=${prefix}" ${common_args})
elseif(MODE STREQUAL "subdir")
  run_step("configure subdir" ${CMAKE_COMMAND} -S "${SOURCE_DIR}/test/package/subdir"
           -B "${WORK_DIR}/build" "-DLOCKSTEP_SOURCE_DIR=${SOURCE_DIR}"
           "-DLOCKSTEP_WITH_CUDA=${WITH_CUDA}" "-DLOCKSTEP_WITH_NCCL=${WITH_NCCL}" ${common_args})
else()
  message(FATAL_ERROR "run_package_test.cmake: MODE must be install or subdir, not '${MODE}'")
endif()

run_step("build" ${CMAKE_COMMAND} --build "${WORK_DIR}/build" --parallel 2)
run_step("run app" "${WORK_DIR}/build/app")
if(NOT last_output MATCHES "allreduce ok")
  message(FATAL_ERROR "package test (${MODE}): unexpected output: ${last_output}")
endif()
message(STATUS "${last_output}")
