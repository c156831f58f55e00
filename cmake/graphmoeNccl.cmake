# graphmoeNccl.cmake: finds NCCL (nccl.h and libnccl) and defines the imported target
# graphmoe::nccl_library that graphmoe::nccl links. Used by graphmoe's own CMakeLists.txt and,
# installed beside graphmoeConfig.cmake, by find_package(graphmoe COMPONENTS nccl).
#
#   _graphmoe_import_nccl(<include hints> <library hints> <result variable>)
#
# Searches the hints first (the CUDA toolkit's include and library directories, where the CUDA
# containers and the NVIDIA packages put NCCL), then NCCL_ROOT / NCCL_HOME / NCCL_DIR from the
# environment, then CMake's default paths. Sets <result variable> to TRUE when both were found
# (and the target exists), FALSE otherwise, and <result variable>_MISSING to what was not found.
# The paths are the cache entries GRAPHMOE_NCCL_INCLUDE_DIR and GRAPHMOE_NCCL_LIBRARY.
function(_graphmoe_import_nccl include_hints library_hints result)
  if(TARGET graphmoe::nccl_library)
    set(${result} TRUE PARENT_SCOPE)
    set(${result}_MISSING "" PARENT_SCOPE)
    return()
  endif()
  find_path(GRAPHMOE_NCCL_INCLUDE_DIR nccl.h
    HINTS ${include_hints} ENV NCCL_ROOT ENV NCCL_HOME ENV NCCL_DIR
    PATH_SUFFIXES include
    DOC "Directory holding nccl.h (graphmoe::nccl)")
  find_library(GRAPHMOE_NCCL_LIBRARY NAMES nccl
    HINTS ${library_hints} ENV NCCL_ROOT ENV NCCL_HOME ENV NCCL_DIR
    PATH_SUFFIXES lib64 lib
    DOC "The NCCL library, libnccl (graphmoe::nccl)")
  mark_as_advanced(GRAPHMOE_NCCL_INCLUDE_DIR GRAPHMOE_NCCL_LIBRARY)
  set(missing "")
  if(NOT GRAPHMOE_NCCL_INCLUDE_DIR)
    list(APPEND missing "nccl.h")
  endif()
  if(NOT GRAPHMOE_NCCL_LIBRARY)
    list(APPEND missing "libnccl")
  endif()
  if(missing)
    string(REPLACE ";" " and " missing "${missing}")
    set(${result} FALSE PARENT_SCOPE)
    set(${result}_MISSING "${missing}" PARENT_SCOPE)
    return()
  endif()
  add_library(graphmoe::nccl_library UNKNOWN IMPORTED)
  set_target_properties(graphmoe::nccl_library PROPERTIES
    IMPORTED_LOCATION "${GRAPHMOE_NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${GRAPHMOE_NCCL_INCLUDE_DIR}")
  set(${result} TRUE PARENT_SCOPE)
  set(${result}_MISSING "" PARENT_SCOPE)
endfunction()
