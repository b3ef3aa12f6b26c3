// Placeholder until the native FP8 kernel lands: the Rust layer reports the native path as
// unsupported (crates/sdpa/src/backend/mod.rs), so this is never reached from the API.
#if defined(SDPA_HAVE_CUTLASS)
#include <cuda_runtime.h>

#include <vector>

#include "sdpa/sdpa.h"

namespace sdpa::cutlass_sm90 {
void forward_e4m3_d128(const FwdArgs&, cudaStream_t) {
  throw Error("cutlass-sm90: the native e4m3 kernel (d128) is not built yet");
}
void attributes_e4m3_d128(std::vector<KernelAttr>&) {}

}  // namespace sdpa::cutlass_sm90
#endif
