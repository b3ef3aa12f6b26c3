// One instantiation per file so the build compiles them in parallel.
#include "wmma/wmma_fwd.cuh"

namespace sdpa::wmma_backend {
void forward_f16_d128(const FwdArgs& a, cudaStream_t s) { forward<__half, 128>(a, s); }
void attributes_f16_d128(std::vector<KernelAttr>& out) { attributes<__half, 128>(out); }
}  // namespace sdpa::wmma_backend
