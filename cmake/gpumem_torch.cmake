# PyTorch's C++ package, when this machine has one (only with the CUDA toolkit): used by
# the plug-in (libgpumem_torch.so throws c10::OutOfMemoryError, which PyTorch raises as
# torch.OutOfMemoryError) and by bench/torch_replay_bench. GPUMEM_TORCH_DIR names the torch
# package folder (holding include/ and lib/); unset, python3's torch is asked.
# Sets GPUMEM_HAVE_TORCH, GPUMEM_TORCH_CXX11_ABI (torch's _GLIBCXX_USE_CXX11_ABI) and
# GPUMEM_TORCH_VERSION (torch.__version__, "unknown" where Python cannot tell).
set(GPUMEM_TORCH_DIR "" CACHE PATH "torch package folder (holding include/ and lib/)")
option(GPUMEM_TORCH_ERRORS
       "With libtorch found, the plug-in throws PyTorch's own c10::OutOfMemoryError (and links libc10)" ON)
set(GPUMEM_HAVE_TORCH OFF)
set(GPUMEM_TORCH_CXX11_ABI 1)
set(GPUMEM_TORCH_VERSION "unknown")
if(GPUMEM_HAVE_CUDA)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(NOT GPUMEM_TORCH_DIR AND Python3_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import os, torch; print(os.path.dirname(torch.__file__))"
                    OUTPUT_VARIABLE GPUMEM_TORCH_PROBE OUTPUT_STRIP_TRAILING_WHITESPACE
                    ERROR_QUIET RESULT_VARIABLE GPUMEM_TORCH_PROBE_RC)
    if(GPUMEM_TORCH_PROBE_RC EQUAL 0)
      set(GPUMEM_TORCH_DIR ${GPUMEM_TORCH_PROBE})
    endif()
  endif()
  if(GPUMEM_TORCH_DIR AND EXISTS ${GPUMEM_TORCH_DIR}/lib/libc10.so
     AND EXISTS ${GPUMEM_TORCH_DIR}/include/c10/util/Exception.h)
    set(GPUMEM_HAVE_TORCH ON)
    if(Python3_FOUND)
      execute_process(COMMAND ${Python3_EXECUTABLE} -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
                      OUTPUT_VARIABLE GPUMEM_TORCH_ABI_PROBE OUTPUT_STRIP_TRAILING_WHITESPACE
                      ERROR_QUIET RESULT_VARIABLE GPUMEM_TORCH_ABI_RC)
      if(GPUMEM_TORCH_ABI_RC EQUAL 0 AND GPUMEM_TORCH_ABI_PROBE MATCHES "^[01]$")
        set(GPUMEM_TORCH_CXX11_ABI ${GPUMEM_TORCH_ABI_PROBE})
      endif()
      execute_process(COMMAND ${Python3_EXECUTABLE} -c "import torch; print(torch.__version__)"
                      OUTPUT_VARIABLE GPUMEM_TORCH_VERSION_PROBE OUTPUT_STRIP_TRAILING_WHITESPACE
                      ERROR_QUIET RESULT_VARIABLE GPUMEM_TORCH_VERSION_RC)
      if(GPUMEM_TORCH_VERSION_RC EQUAL 0 AND GPUMEM_TORCH_VERSION_PROBE MATCHES "^[0-9A-Za-z.+_-]+$")
        set(GPUMEM_TORCH_VERSION ${GPUMEM_TORCH_VERSION_PROBE})
      endif()
    endif()
  endif()
endif()
message(STATUS "gpumem: libtorch ${GPUMEM_HAVE_TORCH} ${GPUMEM_TORCH_DIR}")
