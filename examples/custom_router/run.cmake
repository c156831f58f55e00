# Installs graphmoe into a fresh prefix, builds this project against that prefix only
# (find_package) and runs its two programs. Registered by tests/packaging.cmake as the ctest test
# "custom_router: find_package"; by hand:
#
#   cmake -DGRAPHMOE_SOURCE_DIR=<graphmoe source> -DWORK_DIR=<scratch dir>
#         -DDATA_DIR=<folder holding wikitext-2/>
#         [-DGENERATOR=<cmake generator>] [-DCXX_COMPILER=<path>] [-DBUILD_TYPE=Release]
#         -P examples/custom_router/run.cmake
#
# WORK_DIR is removed and recreated; it receives graphmoe-build/, prefix/ and custom-build/.
cmake_minimum_required(VERSION 3.20)

foreach(_var GRAPHMOE_SOURCE_DIR WORK_DIR DATA_DIR)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "custom_router/run.cmake: -D${_var}=... is required")
  endif()
endforeach()
if(NOT EXISTS "${DATA_DIR}/wikitext-2/wiki.valid.tokens")
  message(FATAL_ERROR "custom_router/run.cmake: no WikiText-2 at DATA_DIR=${DATA_DIR} "
                      "(expected ${DATA_DIR}/wikitext-2/wiki.valid.tokens)")
endif()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()

set(_common_args -DCMAKE_BUILD_TYPE=${BUILD_TYPE})
if(GENERATOR)
  list(APPEND _common_args -G "${GENERATOR}")
endif()
if(CXX_COMPILER)
  list(APPEND _common_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()

# Runs a command, echoing it; stops the script with its output on failure.
function(run_step what)
  string(REPLACE ";" " " _shown "${ARGN}")
  message(STATUS "custom_router: ${what}: ${_shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "custom_router: ${what} failed (${_rc}):\n${_out}")
  endif()
  set(step_output "${_out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(_prefix "${WORK_DIR}/prefix")
set(_bin "${WORK_DIR}/custom-build")

run_step("configure graphmoe" ${CMAKE_COMMAND} -S "${GRAPHMOE_SOURCE_DIR}"
         -B "${WORK_DIR}/graphmoe-build" ${_common_args}
         -DGRAPHMOE_BUILD_TESTS=OFF -DGRAPHMOE_BUILD_BENCHMARKS=OFF
         -DGRAPHMOE_BUILD_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX=${_prefix})
run_step("install graphmoe" ${CMAKE_COMMAND} --install "${WORK_DIR}/graphmoe-build")
# Nothing but the fresh prefix may provide graphmoe: no user or system package registry.
run_step("configure custom_router" ${CMAKE_COMMAND} -S "${CMAKE_CURRENT_LIST_DIR}" -B "${_bin}"
         ${_common_args} -DCMAKE_PREFIX_PATH=${_prefix}
         -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
# The headers must come from the prefix, not from the source tree.
file(STRINGS "${_bin}/CMakeCache.txt" _graphmoe_dir REGEX "^graphmoe_DIR:")
string(FIND "${_graphmoe_dir}" "${_prefix}" _pos)
if(_pos EQUAL -1)
  message(FATAL_ERROR "custom_router: graphmoe was not found in ${_prefix}: ${_graphmoe_dir}")
endif()
run_step("build custom_router" ${CMAKE_COMMAND} --build "${_bin}" --config ${BUILD_TYPE})

foreach(_name gradcheck train)
  find_program(_exe_${_name} ${_name} PATHS "${_bin}" "${_bin}/${BUILD_TYPE}" NO_DEFAULT_PATH)
  if(NOT _exe_${_name})
    message(FATAL_ERROR "custom_router: the ${_name} executable was not built")
  endif()
endforeach()
run_step("run gradcheck" "${_exe_gradcheck}")
message(STATUS "custom_router: gradcheck:\n${step_output}")
run_step("run train" "${_exe_train}" "${DATA_DIR}")
message(STATUS "custom_router: train:\n${step_output}")
