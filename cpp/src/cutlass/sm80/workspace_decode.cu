// The decode path's scratch (split-KV partial outputs and log-sum-exps), for every head dim, and
// whether a call takes that path (asked by both cutlass backends). Without CUTLASS headers the
// file is empty and the backends are not built.
#if defined(SDPA_HAVE_CUTLASS)
#include "cutlass/sm80/decode.cuh"

namespace sdpa::cutlass_sm80 {
bool decode_applies(const FwdArgs& a) { return decode::applies(a); }
int64_t workspace_decode(const FwdArgs& a, const DeviceInfo& dev) {
  return decode::applies(a) ? decode::workspace_bytes(a, dev) : 0;
}
}  // namespace sdpa::cutlass_sm80
#endif
