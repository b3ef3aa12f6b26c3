// The decode path's scratch (split-KV partial outputs and log-sum-exps), for every head dim.
// Without CUTLASS headers the file is empty and the backend is not built.
#if defined(SDPA_HAVE_CUTLASS)
#include "cutlass/sm80/decode.cuh"

namespace sdpa::cutlass_sm80 {
int64_t workspace_decode(const FwdArgs& a, const DeviceInfo& dev) {
  return decode::applies(a) ? decode::workspace_bytes(a, dev) : 0;
}
}  // namespace sdpa::cutlass_sm80
#endif
