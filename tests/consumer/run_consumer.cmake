# Configures, builds and runs the consumer project (tests/consumer) in a fresh directory.
#
#   cmake -DMODE=find_package|add_subdirectory|fetchcontent
#         -DGRAPHMOE_SOURCE_DIR=<graphmoe source> -DWORK_DIR=<scratch dir under the build tree>
#         [-DGENERATOR=<cmake generator>] [-DCXX_COMPILER=<path>] [-DBUILD_TYPE=Release]
#         -P run_consumer.cmake
#
# find_package first configures graphmoe on its own (tests, benchmarks and examples OFF),
# installs it into WORK_DIR/prefix and points the consumer at that prefix only.
cmake_minimum_required(VERSION 3.20)

foreach(_var MODE GRAPHMOE_SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: -D${_var}=... is required")
  endif()
endforeach()
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
  message(STATUS "consumer(${MODE}): ${what}: ${_shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "consumer(${MODE}): ${what} failed (${_rc}):\n${_out}")
  endif()
  set(step_output "${_out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(_consumer_src "${CMAKE_CURRENT_LIST_DIR}")
set(_consumer_bin "${WORK_DIR}/consumer-build")
set(_consumer_args -DGRAPHMOE_CONSUMER_MODE=${MODE} -DGRAPHMOE_SOURCE_DIR=${GRAPHMOE_SOURCE_DIR})

if(MODE STREQUAL "find_package")
  set(_prefix "${WORK_DIR}/prefix")
  run_step("configure graphmoe" ${CMAKE_COMMAND} -S "${GRAPHMOE_SOURCE_DIR}"
           -B "${WORK_DIR}/graphmoe-build" ${_common_args}
           -DGRAPHMOE_BUILD_TESTS=OFF -DGRAPHMOE_BUILD_BENCHMARKS=OFF
           -DGRAPHMOE_BUILD_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX=${_prefix})
  run_step("install graphmoe" ${CMAKE_COMMAND} --install "${WORK_DIR}/graphmoe-build")
  # Nothing but the fresh prefix may provide graphmoe: no user or system package registry.
  list(APPEND _consumer_args -DCMAKE_PREFIX_PATH=${_prefix}
       -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
elseif(NOT MODE MATCHES "^(add_subdirectory|fetchcontent)$")
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}'")
endif()

run_step("configure consumer" ${CMAKE_COMMAND} -S "${_consumer_src}" -B "${_consumer_bin}"
         ${_common_args} ${_consumer_args})
run_step("build consumer" ${CMAKE_COMMAND} --build "${_consumer_bin}" --config ${BUILD_TYPE})

# The consumer's build tree must hold no graphmoe test, benchmark or example binaries.
file(GLOB_RECURSE _stray LIST_DIRECTORIES false "${_consumer_bin}/*test_core*"
     "${_consumer_bin}/*bench_gemm*" "${_consumer_bin}/*graphmoe_header_check*")
if(_stray)
  message(FATAL_ERROR "consumer(${MODE}): graphmoe's own tests/benchmarks were built: ${_stray}")
endif()

find_program(_exe consumer PATHS "${_consumer_bin}" "${_consumer_bin}/${BUILD_TYPE}"
             NO_DEFAULT_PATH)
if(NOT _exe)
  message(FATAL_ERROR "consumer(${MODE}): the consumer executable was not built")
endif()
run_step("run consumer" "${_exe}")
message(STATUS "consumer(${MODE}): ${step_output}")
