// One instantiation per file so the build compiles them in parallel.
#include "wmma/wmma_fwd.cuh"

namespace sdpa::wmma_backend {
void forward_f16_d64(const FwdArgs& a, cudaStream_t s) { forward<__half, 64>(a, s); }
void attributes_f16_d64(std::vector<KernelAttr>& out) { attributes<__half, 64>(out); }
}  // namespace sdpa::wmma_backend
