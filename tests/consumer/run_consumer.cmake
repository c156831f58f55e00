# Configures, builds and runs the consumer project (tests/consumer) in a fresh directory.
#
#   cmake -DMODE=find_package|add_subdirectory|fetchcontent
#         -DGRAPHMOE_SOURCE_DIR=<graphmoe source> -DWORK_DIR=<scratch dir under the build tree>
#         [-DGENERATOR=<cmake generator>] [-DCXX_COMPILER=<path>] [-DBUILD_TYPE=Release]
#         -P run_consumer.cmake
#
# find_package first configures graphmoe on its own (tests, benchmarks and examples OFF),
# installs it into WORK_DIR/prefix and points the consumer at that prefix only; it then builds the
# consumer a second time with -DGRAPHMOE_USE_OPENMP=OFF -DGRAPHMOE_USE_BLAS=OFF and checks that the
# program was compiled without OpenMP and OpenBLAS. Every mode checks that the consumer gets
# OpenMP and OpenBLAS by default when graphmoe's configure found them.
#
# When graphmoe's configure reports "graphmoe: MPI=ON", the consumer also builds consumer_mpi
# against graphmoe::mpi (find_package with COMPONENTS mpi in the first find_package build, never
# in the second) and runs it as one process (an MPI singleton, no mpiexec).
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
  set(_graphmoe_configure_output "${step_output}")
  run_step("install graphmoe" ${CMAKE_COMMAND} --install "${WORK_DIR}/graphmoe-build")
  # Nothing but the fresh prefix may provide graphmoe: no user or system package registry.
  list(APPEND _consumer_args -DCMAKE_PREFIX_PATH=${_prefix}
       -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
elseif(NOT MODE MATCHES "^(add_subdirectory|fetchcontent)$")
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}'")
endif()

# OpenMP and OpenBLAS as graphmoe's own configure found them ("graphmoe: OpenMP=ON OpenBLAS=ON"):
# what the consumer gets by default, printed by it as "openmp=1 blas=1".
function(expect_from_graphmoe_configure output)
  string(REGEX MATCH "graphmoe: OpenMP=(ON|OFF) OpenBLAS=(ON|OFF)" _line "${output}")
  if(NOT _line)
    message(FATAL_ERROR "consumer(${MODE}): graphmoe's configure did not report OpenMP/OpenBLAS")
  endif()
  set(_omp 0)
  set(_blas 0)
  if(CMAKE_MATCH_1 STREQUAL "ON")
    set(_omp 1)
  endif()
  if(CMAKE_MATCH_2 STREQUAL "ON")
    set(_blas 1)
  endif()
  set(expected_features "openmp=${_omp} blas=${_blas}" PARENT_SCOPE)
endfunction()
# Whether graphmoe's configure found MPI ("graphmoe: MPI=ON").
function(mpi_from_graphmoe_configure output)
  if(output MATCHES "graphmoe: MPI=ON")
    set(graphmoe_has_mpi ON PARENT_SCOPE)
  else()
    set(graphmoe_has_mpi OFF PARENT_SCOPE)
  endif()
endfunction()
if(MODE STREQUAL "find_package")
  expect_from_graphmoe_configure("${_graphmoe_configure_output}")
  mpi_from_graphmoe_configure("${_graphmoe_configure_output}")
endif()

# Configures, builds and runs the consumer in build folder `bin` with extra cache entries ARGN;
# its output must report `features` ("openmp=.. blas=..", or "" to take graphmoe's configure
# output from this configure step, for add_subdirectory and fetchcontent).
function(build_and_run bin features)
  run_step("configure consumer" ${CMAKE_COMMAND} -S "${_consumer_src}" -B "${bin}"
           ${_common_args} ${_consumer_args} ${ARGN})
  if(features STREQUAL "")
    expect_from_graphmoe_configure("${step_output}")
    set(features "${expected_features}")
    mpi_from_graphmoe_configure("${step_output}")
    set(expect_mpi ${graphmoe_has_mpi})
  endif()
  run_step("build consumer" ${CMAKE_COMMAND} --build "${bin}" --config ${BUILD_TYPE})

  # consumer_mpi: built when graphmoe::mpi was asked for (find_package) or exists (subprojects).
  unset(_mpi_exe CACHE)
  unset(_mpi_exe)
  find_program(_mpi_exe consumer_mpi PATHS "${bin}" "${bin}/${BUILD_TYPE}" NO_DEFAULT_PATH)
  if(expect_mpi AND NOT _mpi_exe)
    message(FATAL_ERROR "consumer(${MODE}): graphmoe has MPI but consumer_mpi was not built")
  elseif(NOT expect_mpi AND _mpi_exe)
    message(FATAL_ERROR "consumer(${MODE}): consumer_mpi was built although not expected")
  endif()
  if(_mpi_exe)
    run_step("run consumer_mpi" "${_mpi_exe}")
    message(STATUS "consumer(${MODE}): ${step_output}")
    if(NOT step_output MATCHES "consumer_mpi: size=1 ok")
      message(FATAL_ERROR "consumer(${MODE}): consumer_mpi printed:\n${step_output}")
    endif()
  endif()

  # The consumer's build tree must hold no graphmoe test, benchmark or example binaries.
  file(GLOB_RECURSE _stray LIST_DIRECTORIES false "${bin}/*test_core*" "${bin}/*bench_gemm*"
       "${bin}/*graphmoe_header_check*")
  if(_stray)
    message(FATAL_ERROR "consumer(${MODE}): graphmoe's own tests/benchmarks were built: ${_stray}")
  endif()

  # find_program keeps what it found in a cache entry, even in script mode: clear it, or the
  # second build folder would be answered with the first one's program.
  unset(_exe CACHE)
  unset(_exe)
  find_program(_exe consumer PATHS "${bin}" "${bin}/${BUILD_TYPE}" NO_DEFAULT_PATH)
  if(NOT _exe)
    message(FATAL_ERROR "consumer(${MODE}): the consumer executable was not built in ${bin}")
  endif()
  run_step("run consumer" "${_exe}")
  message(STATUS "consumer(${MODE}): ${step_output}")
  string(FIND "${step_output}" "${features}" _pos)
  if(_pos EQUAL -1)
    message(FATAL_ERROR "consumer(${MODE}): expected '${features}' from the consumer, got:\n"
                        "${step_output}")
  endif()
endfunction()

if(MODE STREQUAL "find_package")
  set(expect_mpi ${graphmoe_has_mpi})
  build_and_run("${_consumer_bin}" "${expected_features}" -DGRAPHMOE_CONSUMER_MPI=${expect_mpi})
  # The installed package lets a consumer turn OpenMP and OpenBLAS off before find_package; MPI
  # is not asked for, so graphmoe::mpi must not exist.
  set(expect_mpi OFF)
  build_and_run("${WORK_DIR}/consumer-build-plain" "openmp=0 blas=0"
                -DGRAPHMOE_USE_OPENMP=OFF -DGRAPHMOE_USE_BLAS=OFF)
else()
  set(expect_mpi "")  # from the consumer's configure output (graphmoe's messages)
  build_and_run("${_consumer_bin}" "")
endif()
