# The optional components beside lockstep::core (ext/cuda, ext/nccl, ext/torch), each a library
# lockstep::<name> with its own headers (ext/<name>/include) and its own targets file, which
# lockstepConfig.cmake loads only when find_package(lockstep COMPONENTS <name>) asks for it.
#
# lockstep_add_component(NAME name SOURCES files...)
#   defines lockstep_<name> (alias lockstep::<name>, exported as <name>) from SOURCES (relative to
#   the calling ext/<name>/CMakeLists.txt), position-independent, with include/ as its public
#   include directory, linked to lockstep::core (and, privately, to the build flags), and installs
#   it, its headers and lockstep<Name>Targets.cmake. The caller adds its other links and options.
function(lockstep_add_component)
  cmake_parse_arguments(C "" "NAME" "SOURCES" ${ARGN})
  set(target lockstep_${C_NAME})
  add_library(${target} ${C_SOURCES})
  add_library(lockstep::${C_NAME} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${C_NAME} POSITION_INDEPENDENT_CODE ON)
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${target} PUBLIC lockstep::core PRIVATE $<BUILD_INTERFACE:lockstep_build_flags>)

  string(SUBSTRING ${C_NAME} 0 1 first)
  string(SUBSTRING ${C_NAME} 1 -1 rest)
  string(TOUPPER ${first} first)
  set(export lockstep${first}${rest}Targets)
  install(TARGETS ${target} EXPORT ${export}
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(DIRECTORY include/lockstep DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.hpp")
  # The component's own targets file: find_package(lockstep COMPONENTS <name>) loads it.
  install(EXPORT ${export} NAMESPACE lockstep:: DESTINATION ${LOCKSTEP_INSTALL_CMAKEDIR})
endfunction()
