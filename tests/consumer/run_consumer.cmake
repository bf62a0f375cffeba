# Builds and runs tests/consumer in MODE: find_package (tests/consumer/CMakeLists.txt, against an
# install of SOURCE_DIR) or add_subdirectory (tests/consumer/subdir/); any failure fails.
file(REMOVE_RECURSE ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGV}")
  endif()
endfunction()
if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/lib -DMIXATTN_BUILD_TESTS=OFF
      -DMIXATTN_BUILD_BENCHMARKS=OFF -DMIXATTN_BUILD_EXAMPLES=OFF)
  run(${CMAKE_COMMAND} --install ${WORK_DIR}/lib --prefix ${WORK_DIR}/prefix)
  run(${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/app -DCMAKE_BUILD_TYPE=Release
      -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
else()
  run(${CMAKE_COMMAND} -S ${CONSUMER_DIR}/subdir -B ${WORK_DIR}/app -DCMAKE_BUILD_TYPE=Release
      -DMIXATTN_SOURCE_DIR=${SOURCE_DIR})
endif()
run(${CMAKE_COMMAND} --build ${WORK_DIR}/app)
run(${WORK_DIR}/app/app)
