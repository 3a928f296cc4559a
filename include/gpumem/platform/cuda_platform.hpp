// cuda: the real GPU, through the CUDA runtime (statically linked) and driver entry
// points fetched at run time with cudaGetDriverEntryPointByVersion — libcuda.so.1 is
// never linked, so one binary starts on machines with and without a driver.
//
// Invariants:
//  - every CUDA call's result is checked and reported as a status naming the call;
//  - driver_alloc / driver_free push the device's primary context and pop it again, so
//    the caller's current context is unchanged (the CUDA_ERROR_INVALID_CONTEXT trap);
//  - set_access is one cuMemSetAccess over the whole range it is given.
#pragma once

#include <memory>
#include <string>

#include "gpumem/platform/platform.hpp"

namespace gpumem {

// Was the cuda platform compiled in (CUDA toolkit found at build time)?
bool cuda_platform_compiled() noexcept;

// A cuda platform if the driver loads and at least one device is present; otherwise
// nullptr and `why` says what is missing ("no CUDA driver: ...", "no CUDA device", ...).
std::unique_ptr<platform> make_cuda_platform(std::string* why);

}  // namespace gpumem
