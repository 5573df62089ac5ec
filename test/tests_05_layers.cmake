# The layers of lockstep::core (cmake/LockstepLayers.cmake, docs/architecture.md "Layers").
get_property(_ls_layers GLOBAL PROPERTY LOCKSTEP_LAYERS)
set(_ls_layer_specs "")
foreach(layer IN LISTS _ls_layers)
  get_property(_below GLOBAL PROPERTY LOCKSTEP_LAYER_BELOW_${layer})
  string(REPLACE ";" "," _below "${_below}")
  list(APPEND _ls_layer_specs "${layer}:${_below}")
endforeach()

# Every #include in src/<layer> and include/lockstep/<layer> names its own layer or one below;
# and the check reports each kind of violation planted in a copy of the tree.
add_test(NAME layers.includes
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/layers/check_includes.sh ${PROJECT_SOURCE_DIR} ${_ls_layer_specs})
set_tests_properties(layers.includes PROPERTIES LABELS unit PASS_REGULAR_EXPRESSION "includes: OK")
add_test(NAME layers.includes_self_test
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/layers/check_includes.sh --self-test ${PROJECT_SOURCE_DIR}
          ${_ls_layer_specs})
set_tests_properties(layers.includes_self_test PROPERTIES LABELS unit PASS_REGULAR_EXPRESSION "self-test: OK")

# Each public header compiles alone with only its layer's links: it includes what it uses, and
# nothing of a higher layer (headers that no source of the layer includes are checked too).
# These are compile checks, so a sanitizer build (CI's sanitize stage, after the core stage has
# made them) leaves them out: instrumenting them finds nothing.
if(NOT LOCKSTEP_SANITIZE)
foreach(layer IN LISTS _ls_layers)
  file(GLOB _headers CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/include/lockstep/${layer}/*.hpp)
  set(_tus "")
  foreach(h IN LISTS _headers)
    get_filename_component(_name ${h} NAME_WE)
    set(_tu ${CMAKE_CURRENT_BINARY_DIR}/layers/${layer}/${_name}.cpp)
    file(CONFIGURE OUTPUT ${_tu} CONTENT "#include \"lockstep/${layer}/${_name}.hpp\"\n")
    list(APPEND _tus ${_tu})
  endforeach()
  add_library(lockstep_headers_${layer} OBJECT ${_tus})
  target_link_libraries(lockstep_headers_${layer} PRIVATE lockstep_layer_${layer} lockstep_build_flags)
  # One translation unit per header even in a unity build (CI's): that is the check.
  set_target_properties(lockstep_headers_${layer} PROPERTIES UNITY_BUILD OFF)
endforeach()

# An upward include fails to build: the train layer's include path finds train's header and
# not io's.
get_property(_below GLOBAL PROPERTY LOCKSTEP_LAYER_BELOW_train)
set(_train_flags -I${PROJECT_BINARY_DIR}/include)
foreach(layer IN ITEMS train ${_below})
  list(APPEND _train_flags -I${PROJECT_BINARY_DIR}/layers/${layer}/include -I${PROJECT_BINARY_DIR}/layers/${layer}/src)
endforeach()
add_test(NAME layers.upward_include_fails
  COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only ${_train_flags}
          ${CMAKE_CURRENT_SOURCE_DIR}/layers/upward_include.cpp)
set_tests_properties(layers.upward_include_fails PROPERTIES LABELS unit
  PASS_REGULAR_EXPRESSION "lockstep/io/checkpoint.hpp: No such file or directory")

# Every installed header compiles alone: the layers' own headers above, and here those in their
# detail/ folders (what the public templates need), with lockstep::core's include path as a user
# has it.
file(GLOB _ls_more_headers CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/include/lockstep/*/detail/*.hpp)
set(_tus "")
foreach(h IN LISTS _ls_more_headers)
  file(RELATIVE_PATH _rel ${PROJECT_SOURCE_DIR}/include ${h})
  string(REPLACE "/" "_" _name "${_rel}")
  set(_tu ${CMAKE_CURRENT_BINARY_DIR}/layers/installed/${_name}.cpp)
  file(CONFIGURE OUTPUT ${_tu} CONTENT "#include \"${_rel}\"\n")
  list(APPEND _tus ${_tu})
endforeach()
add_library(lockstep_headers_installed OBJECT ${_tus})
target_link_libraries(lockstep_headers_installed PRIVATE lockstep::core lockstep_build_flags)
set_target_properties(lockstep_headers_installed PROPERTIES UNITY_BUILD OFF)
# The torch component's installed headers compile alone as well, where this build has it:
# torch.hpp and torch/join.hpp need nothing of LibTorch, torch/sync_batchnorm.hpp includes the
# LibTorch headers it uses.
if(TARGET lockstep_torch)
  set(_torch_tus "")
  foreach(h IN ITEMS torch.hpp torch/join.hpp torch/sync_batchnorm.hpp)
    string(REPLACE "/" "_" _name "${h}")
    set(_tu ${CMAKE_CURRENT_BINARY_DIR}/layers/installed/component_${_name}.cpp)
    file(CONFIGURE OUTPUT ${_tu} CONTENT "#include \"lockstep/${h}\"\n")
    list(APPEND _torch_tus ${_tu})
  endforeach()
  add_library(lockstep_headers_installed_torch OBJECT ${_torch_tus})
  target_link_libraries(lockstep_headers_installed_torch PRIVATE lockstep_torch lockstep_build_flags)
  set_target_properties(lockstep_headers_installed_torch PROPERTIES UNITY_BUILD OFF)
endif()
endif()  # NOT LOCKSTEP_SANITIZE
# No header a user gets holds a test hook (TestHooks, test_hooks(), *_for_test, a `testing`
# namespace, fail_next_*): the tests' hooks live in headers that are not installed
# (src/remote/test_hooks.hpp, ext/torch/src/test_hooks.hpp). The check installs into a scratch
# prefix, so it sees what a user gets of lockstep::core and of the components this build has, and
# reads every component's ext/*/include as well (those this build leaves out: lockstep::nccl
# without CUDA); the self-test plants hooks and sees them refused.
add_test(NAME headers.installed
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/layers/check_installed_headers.sh ${PROJECT_BINARY_DIR}
          ${PROJECT_SOURCE_DIR})
set_tests_properties(headers.installed PROPERTIES LABELS unit PASS_REGULAR_EXPRESSION "installed headers: OK")
add_test(NAME headers.installed_self_test
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/layers/check_installed_headers.sh --self-test)
set_tests_properties(headers.installed_self_test PROPERTIES LABELS unit PASS_REGULAR_EXPRESSION "self-test: OK")
