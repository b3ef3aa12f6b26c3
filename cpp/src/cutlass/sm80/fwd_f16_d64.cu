// One instantiation per file so the build compiles them in parallel. Without CUTLASS headers
// (SDPA_HAVE_CUTLASS unset) the file is empty and the backend is not built.
#if defined(SDPA_HAVE_CUTLASS)
#include "cutlass/sm80/sm80_fwd.cuh"

namespace sdpa::cutlass_sm80 {
void forward_f16_d64(const FwdArgs& a, cudaStream_t s) { forward<cute::half_t, 64>(a, s); }
void attributes_f16_d64(std::vector<KernelAttr>& out) { attributes<cute::half_t, 64>(out); }
}  // namespace sdpa::cutlass_sm80
#endif
