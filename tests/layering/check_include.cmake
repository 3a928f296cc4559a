# cmake -DCOMPILER=... -DINCLUDES=a|b -DPROBE=include_probe.cpp -DHEADER=gpumem/x/y.hpp
#       -DEXPECT=compiles|refused -P check_include.cmake
# Compiles PROBE with a layer's include directories (INCLUDES, the layer target's
# INCLUDE_DIRECTORIES joined by '|') and checks that HEADER is reachable (compiles) or
# not found at all (refused): a refusal for any other reason is a failure of this test.
foreach(var COMPILER INCLUDES PROBE HEADER EXPECT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_include.cmake: ${var} is not set")
  endif()
endforeach()
string(REPLACE "|" ";" dirs "${INCLUDES}")
set(flags)
foreach(dir IN LISTS dirs)
  list(APPEND flags -I${dir})
endforeach()
execute_process(
  COMMAND ${COMPILER} -std=c++20 -fsyntax-only ${flags} "-DGPUMEM_PROBE_HEADER=\"${HEADER}\"" ${PROBE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(EXPECT STREQUAL "compiles")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${HEADER} should be visible with these include directories "
                        "(${INCLUDES}) but the probe does not compile:\n${out}")
  endif()
elseif(EXPECT STREQUAL "refused")
  if(rc EQUAL 0)
    message(FATAL_ERROR "${HEADER} belongs to a higher layer, yet the probe compiles with "
                        "these include directories (${INCLUDES})")
  endif()
  string(FIND "${out}" "${HEADER}" at)
  if(at EQUAL -1 OR NOT out MATCHES "[Nn]o such file|file not found")
    message(FATAL_ERROR "the probe fails, but not because ${HEADER} is not found:\n${out}")
  endif()
else()
  message(FATAL_ERROR "check_include.cmake: EXPECT is compiles or refused, not ${EXPECT}")
endif()
