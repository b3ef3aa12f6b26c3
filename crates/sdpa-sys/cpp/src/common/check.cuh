// Error checking shared by every backend: a failed CUDA call becomes an sdpa::Error carrying
// the CUDA error string and the call site, which cxx turns into a Rust Err.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sdpa/sdpa.h"

namespace sdpa {

inline void check_cuda(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess) {
    throw Error(std::string(what) + " failed: " + cudaGetErrorName(e) + " (" +
                cudaGetErrorString(e) + ") at " + file + ":" + std::to_string(line));
  }
}

// After a <<<>>> launch, without synchronizing: cudaGetLastError reports this launch's own
// failure (a bad configuration), but also an error left by earlier asynchronous work of the
// context. A sticky one (a device fault: an illegal address, a trap) may have been any earlier
// kernel's, and leaves the context unusable for the rest of the process: the message says so.
inline void check_launch(const char* what, const char* file, int line) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return;
  // Errors cudaGetLastError cannot clear: the context is lost.
  const bool sticky = cudaPeekAtLastError() != cudaSuccess || e == cudaErrorIllegalAddress ||
                      e == cudaErrorLaunchFailure || e == cudaErrorMisalignedAddress ||
                      e == cudaErrorIllegalInstruction || e == cudaErrorHardwareStackError ||
                      e == cudaErrorInvalidPc || e == cudaErrorAssert;
  std::string msg = std::string(what) + " failed: " + cudaGetErrorName(e) + " (" +
                    cudaGetErrorString(e) + ") at " + file + ":" + std::to_string(line);
  if (sticky)
    msg +=
        "; this is a device fault, which CUDA reports at the next launch: it may come from an "
        "earlier kernel of this context, sdpa's or another's, not this launch, and the context "
        "is unusable for the rest of the process";
  throw Error(msg);
}

}  // namespace sdpa

#define SDPA_CUDA_CHECK(call) ::sdpa::check_cuda((call), #call, __FILE__, __LINE__)
#define SDPA_LAUNCH_CHECK(name) ::sdpa::check_launch(name, __FILE__, __LINE__)
