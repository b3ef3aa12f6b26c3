// One instantiation per file, like those cpp/kernels.txt generates: the small-problem path of
// forward_f16_d64.
#if defined(SDPA_HAVE_CUTLASS)
#include "cutlass/sm90/sm90_small.cuh"

namespace sdpa::cutlass_sm90 {
template bool small_forward<Same<cute::half_t>, 64>(const FwdArgs&, const DeviceInfo&,
                                                    cudaStream_t);
template void small_attributes<Same<cute::half_t>, 64>(std::vector<KernelAttr>&, const char*);
}  // namespace sdpa::cutlass_sm90
#endif
