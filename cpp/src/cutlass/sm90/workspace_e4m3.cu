// The native e4m3 kernel's scratch (V as f16 for the D = 128 pre-pass, none at D = 64), for
// every head dim. Without CUTLASS headers the file is empty and the backend is not built.
#if defined(SDPA_HAVE_CUTLASS)
#include "cutlass/sm90/sm90_fwd.cuh"

namespace sdpa::cutlass_sm90 {
int64_t workspace_e4m3(const FwdArgs& a) { return workspace_e4m3_bytes(a); }
}  // namespace sdpa::cutlass_sm90
#endif
