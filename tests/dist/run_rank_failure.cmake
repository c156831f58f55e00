# Runs tests/dist/rank_failure under mpiexec and checks that the job, in which one rank fails
# while the others wait in a collective, stops by itself: non-zero, well before the hard timeout,
# with the launcher's output naming the failure.
#
#   cmake -DMPIEXEC=<mpiexec> -DNUMPROC_FLAG=-n -DNP=3 "-DPREFLAGS=<flags;...>"
#         -DPROGRAM=<rank_failure> -DMODE=kill|throw -DEXPECT=<regex of the launcher's message>
#         -DMAX_SECONDS=<must end within> -DHARD_TIMEOUT=<then killed> -P run_rank_failure.cmake
cmake_minimum_required(VERSION 3.20)
foreach(_var MPIEXEC NUMPROC_FLAG NP PROGRAM MODE EXPECT MAX_SECONDS HARD_TIMEOUT)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "run_rank_failure.cmake: -D${_var}=... is required")
  endif()
endforeach()

string(TIMESTAMP _t0 "%s")
execute_process(
  COMMAND ${MPIEXEC} ${NUMPROC_FLAG} ${NP} ${PREFLAGS} ${PROGRAM} ${MODE}
  TIMEOUT ${HARD_TIMEOUT}
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
string(TIMESTAMP _t1 "%s")
math(EXPR _elapsed "${_t1} - ${_t0}")
message(STATUS "rank_failure ${MODE}: exit ${_rc} after ${_elapsed} s; output:\n${_out}")

if("${_rc}" STREQUAL "0")
  message(FATAL_ERROR "rank_failure ${MODE}: the job exited 0 although rank 1 failed")
endif()
if(NOT "${_rc}" MATCHES "^[0-9]+$")
  message(FATAL_ERROR "rank_failure ${MODE}: the job did not stop by itself (${_rc})")
endif()
if(_elapsed GREATER ${MAX_SECONDS})
  message(FATAL_ERROR "rank_failure ${MODE}: the job took ${_elapsed} s to stop "
                      "(more than ${MAX_SECONDS} s)")
endif()
# The program got as far as the failure, with the others inside the collective ...
if(NOT _out MATCHES "rank_failure: rank 1 fails now" OR
   NOT _out MATCHES "rank_failure: rank 0 enters all_reduce_sum")
  message(FATAL_ERROR "rank_failure ${MODE}: the ranks did not reach the collective")
endif()
# ... and the launcher says what happened.
if(NOT _out MATCHES "${EXPECT}")
  message(FATAL_ERROR "rank_failure ${MODE}: the output does not match '${EXPECT}'")
endif()
