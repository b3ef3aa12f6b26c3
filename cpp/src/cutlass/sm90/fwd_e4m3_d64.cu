// One head dim per file so the build compiles them in parallel (both output types inside).
// Without CUTLASS headers (SDPA_HAVE_CUTLASS unset) the file is empty and the backend is not
// built.
#if defined(SDPA_HAVE_CUTLASS)
#include "cutlass/sm90/sm90_fwd.cuh"

namespace sdpa::cutlass_sm90 {
void forward_e4m3_d64(const FwdArgs& a, cudaStream_t s) { forward_e4m3<64>(a, s); }
void attributes_e4m3_d64(std::vector<KernelAttr>& out) { attributes_e4m3<64>(out); }
// V as f16 for the D = 128 pre-pass (none at D = 64); for both head dims.
int64_t workspace_e4m3(const FwdArgs& a) { return workspace_e4m3_bytes(a); }
}  // namespace sdpa::cutlass_sm90
#endif
