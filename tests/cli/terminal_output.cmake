# cmake -DEXE=moe-engine -P terminal_output.cmake
# What `moe-engine bench` shows a person and what it writes for programs:
# - piped: the header and the estimate come first, then the results; no progress line (no
#   carriage return or erase sequence anywhere);
# - --json, piped or on a terminal: JSON only, and "fusion" says what ran (the CPU backend fuses
#   nothing);
# - on a terminal (a pseudo-terminal from util-linux's `script`): the in-place progress line.
# - with no GPU visible, the reason names the missing GPU/driver, not the runtime's error text.
cmake_minimum_required(VERSION 3.25)
string(ASCII 13 CR)
string(ASCII 27 ESC)

execute_process(COMMAND ${EXE} bench --device cpu RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "bench failed (${rc}): ${out}${err}")
endif()
if(NOT out MATCHES "^moe-engine bench mlp: case tiny[^\n]*\ndevice: cpu[^\n]*\nestimate: about [^\n]* for 6 runs")
  message(FATAL_ERROR "piped bench does not begin with the header and the estimate:\n${out}")
endif()
if(NOT out MATCHES "fused steps: none \\(the CPU backend runs the steps unfused\\)")
  message(FATAL_ERROR "bench does not say that nothing ran fused on the CPU:\n${out}")
endif()
if("${out}${err}" MATCHES "${CR}|${ESC}")
  message(FATAL_ERROR "piped bench printed a progress line:\n${out}${err}")
endif()

execute_process(COMMAND ${EXE} bench --device cpu --json RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(JSON fusion ERROR_VARIABLE json_error GET "${out}" fusion)
string(JSON requested ERROR_VARIABLE json_error2 GET "${out}" fusion_requested)
if(NOT rc EQUAL 0 OR json_error OR json_error2 OR NOT err STREQUAL "")
  message(FATAL_ERROR "bench --json: exit ${rc}, not JSON only (${json_error}):\n${out}\nstderr: ${err}")
endif()
if(NOT fusion STREQUAL "none" OR NOT requested STREQUAL "forward")
  message(FATAL_ERROR "bench --json on the CPU reports fusion '${fusion}' (requested '${requested}'); expected none (forward)")
endif()

find_program(SCRIPT script)
if(SCRIPT)
  execute_process(COMMAND ${SCRIPT} -qec "${EXE} bench --device cpu" /dev/null
                  RESULT_VARIABLE rc OUTPUT_VARIABLE tty ERROR_VARIABLE tty_err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "bench on a terminal failed (${rc}): ${tty}${tty_err}")
  endif()
  if(NOT tty MATCHES "${CR}${ESC}\\[K(warm-up|timing): [0-9]+/6 runs, ")
    message(FATAL_ERROR "bench on a terminal shows no progress line:\n${tty}")
  endif()
  execute_process(COMMAND ${SCRIPT} -qec "${EXE} bench --device cpu --json" /dev/null
                  RESULT_VARIABLE rc OUTPUT_VARIABLE tty)
  if(NOT rc EQUAL 0 OR tty MATCHES "${ESC}")
    message(FATAL_ERROR "bench --json on a terminal printed a progress line (exit ${rc}):\n${tty}")
  endif()
else()
  message(STATUS "no `script` program: the terminal half is not checked")
endif()

execute_process(COMMAND ${EXE} info OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "info failed (${rc}): ${out}${err}")
endif()
if(out MATCHES "GPUs: none")
  if(NOT out MATCHES "GPUs: none: (no NVIDIA GPU/driver found|no NVIDIA GPU found|built without CUDA|the NVIDIA driver supports CUDA)")
    message(FATAL_ERROR "info does not say why no GPU is visible in words:\n${out}")
  endif()
  execute_process(COMMAND ${EXE} bench --device cuda OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 1 OR NOT err MATCHES "bench: --device cuda: (no NVIDIA GPU|built without CUDA|the NVIDIA driver)")
    message(FATAL_ERROR "bench --device cuda without a GPU (exit ${rc}):\n${out}${err}")
  endif()
endif()
message(STATUS "bench prints for people on a terminal and for programs on pipes")
