# cmake -DEXE=... -DARGS="a;b" -DKEY="check;passed" -DEXPECT=ON -P expect_json.cmake
# Runs EXE ARGS, requires exit code 0, valid JSON on stdout, and the value at KEY to equal EXPECT.
execute_process(COMMAND ${EXE} ${ARGS} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${EXE} ${ARGS} exited with ${rc}\n${out}\n${err}")
endif()
string(JSON value ERROR_VARIABLE json_error GET "${out}" ${KEY})
if(json_error)
  message(FATAL_ERROR "output is not JSON with key '${KEY}': ${json_error}\n${out}")
endif()
if(NOT "${value}" STREQUAL "${EXPECT}")
  message(FATAL_ERROR "${KEY} is '${value}', expected '${EXPECT}'\n${out}")
endif()
message(STATUS "${KEY} = ${value}")
