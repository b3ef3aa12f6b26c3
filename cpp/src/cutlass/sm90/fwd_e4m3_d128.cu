// One head dim per file so the build compiles them in parallel (both output types inside).
// Without CUTLASS headers (SDPA_HAVE_CUTLASS unset) the file is empty and the backend is not
// built.
#if defined(SDPA_HAVE_CUTLASS)
#include "cutlass/sm90/sm90_fwd.cuh"

namespace sdpa::cutlass_sm90 {
void forward_e4m3_d128(const FwdArgs& a, cudaStream_t s) { forward_e4m3<128>(a, s); }
void attributes_e4m3_d128(std::vector<KernelAttr>& out) { attributes_e4m3<128>(out); }
}  // namespace sdpa::cutlass_sm90
#endif
