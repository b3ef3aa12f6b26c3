// One instantiation per file, like those cpp/kernels.txt generates: the small-problem path of
// forward_e4m3_d64 in accurate mode, both output types.
#if defined(SDPA_HAVE_CUTLASS)
#include "cutlass/sm90/sm90_small.cuh"

namespace sdpa::cutlass_sm90 {
template bool small_forward<E4m3<cute::half_t, 64>, 64>(const FwdArgs&, const DeviceInfo&,
                                                        cudaStream_t);
template bool small_forward<E4m3<cute::bfloat16_t, 64>, 64>(const FwdArgs&, const DeviceInfo&,
                                                            cudaStream_t);
template void small_attributes<E4m3<cute::half_t, 64>, 64>(std::vector<KernelAttr>&, const char*);
template void small_attributes<E4m3<cute::bfloat16_t, 64>, 64>(std::vector<KernelAttr>&,
                                                               const char*);
}  // namespace sdpa::cutlass_sm90
#endif
