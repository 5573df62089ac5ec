# The layers of lockstep::core (docs/architecture.md, "Layers"). Each layer is an OBJECT library
# built from src/<layer>/*.cpp; lockstep_core is made of all their objects.
#
# Targets: lockstep_layer_<name>. What a layer may include is what its explicit links give it, and nothing else: a layer's
# sources see no include/ and no src/ folder, only, through its links, one staging folder per
# layer below it (and its own), build/layers/<layer>/{include/lockstep/<layer>, src/<layer>},
# which are links to include/lockstep/<layer> and src/<layer>. So an include of a higher layer,
# public ("lockstep/io/checkpoint.hpp") or internal ("mpi/monitor.hpp"), or of a path outside the
# layers' folders ("lockstep/backend.hpp"), fails to build with "No such file or directory".
# The test layers.includes (test/layers/check_includes.sh) catches the one escape the compiler
# cannot see, a relative include that climbs out of its folder ("../mpi/...").
#
# lockstep_add_layer(NAME name [BELOW layers...] [MPI] [LIBS targets...] [DEFINES defs...]
#                    [EXCLUDE files...])
#   BELOW: the layers this one may use (linked PUBLIC, so a layer above gets them too);
#   MPI: the layer (and so every layer linking it) may include <mpi.h>; LIBS: other private
#   dependencies; DEFINES: private compile definitions (LOCKSTEP_FAULT_INJECTION=0|1 for the
#   layers that have fault code); EXCLUDE: sources of src/<name>/ left out of this build
#   (fault.cpp without fault injection). The global property LOCKSTEP_LAYERS lists the layers,
#   bottom first.

function(lockstep_add_layer)
  cmake_parse_arguments(L "MPI" "NAME" "BELOW;LIBS;DEFINES;EXCLUDE" ${ARGN})
  set(name ${L_NAME})
  set(stage ${PROJECT_BINARY_DIR}/layers/${name})
  file(MAKE_DIRECTORY ${stage}/include/lockstep ${stage}/src)
  file(CREATE_LINK ${PROJECT_SOURCE_DIR}/include/lockstep/${name} ${stage}/include/lockstep/${name} SYMBOLIC)
  file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${name} ${stage}/src/${name} SYMBOLIC)

  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${name}/*.cpp)
  foreach(excluded IN LISTS L_EXCLUDE)
    list(REMOVE_ITEM sources ${PROJECT_SOURCE_DIR}/src/${name}/${excluded})
  endforeach()
  add_library(lockstep_layer_${name} OBJECT ${sources})
  set_target_properties(lockstep_layer_${name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  target_compile_features(lockstep_layer_${name} PUBLIC cxx_std_20)
  # The generated lockstep/config.hpp (build/include) is visible to every layer.
  target_include_directories(lockstep_layer_${name}
    PUBLIC ${stage}/include ${stage}/src ${PROJECT_BINARY_DIR}/include)
  foreach(below IN LISTS L_BELOW)
    if(NOT TARGET lockstep_layer_${below})
      message(FATAL_ERROR "layer ${name}: the layer ${below} below it is not defined (yet)")
    endif()
    target_link_libraries(lockstep_layer_${name} PUBLIC lockstep_layer_${below})
  endforeach()
  target_link_libraries(lockstep_layer_${name} PRIVATE lockstep_build_flags ${L_LIBS})
  if(L_DEFINES)
    target_compile_definitions(lockstep_layer_${name} PRIVATE ${L_DEFINES})
  endif()
  if(L_MPI)
    target_link_libraries(lockstep_layer_${name} PUBLIC MPI::MPI_CXX)
  endif()
  # -fno-math-errno lets GCC vectorise sqrt in the optimizer loops (twice the speed of Adam).
  target_compile_options(lockstep_layer_${name} PRIVATE -Wall -Wextra -fno-math-errno)

  set_property(GLOBAL APPEND PROPERTY LOCKSTEP_LAYERS ${name})
  set_property(GLOBAL PROPERTY LOCKSTEP_LAYER_BELOW_${name} ${L_BELOW})
endfunction()
