// One instantiation per file so the build compiles them in parallel.
#include "wmma/wmma_fwd.cuh"

namespace sdpa::wmma_backend {
void forward_bf16_d64(const FwdArgs& a, cudaStream_t s) { forward<__nv_bfloat16, 64>(a, s); }
void attributes_bf16_d64(std::vector<KernelAttr>& out) { attributes<__nv_bfloat16, 64>(out); }
}  // namespace sdpa::wmma_backend
