// FP8 E4M3 conversion on the device with the GPU's own saturating conversion, the reference the
// host codec (crates/sdpa/src/fp8.rs) is held to bit for bit. Used to quantize tensors.
#include <cuda_fp8.h>

#include "common/check.cuh"
#include "sdpa/sdpa.h"

namespace sdpa {
namespace {

__global__ void encode_kernel(const float* __restrict__ x, uint8_t* __restrict__ y, int64_t n,
                              float inv_scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __nv_cvt_float_to_fp8(x[i] * inv_scale, __NV_SATFINITE, __NV_E4M3);
}

}  // namespace

void e4m3_encode(const float* x, uint8_t* y, int64_t n, float inv_scale, void* stream) {
  if (n <= 0) return;
  // Grid-stride loop: 4 CTAs of 256 per SM on the largest parts is plenty for a copy kernel.
  const int64_t blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
  encode_kernel<<<unsigned(blocks), 256, 0, static_cast<cudaStream_t>(stream)>>>(x, y, n,
                                                                                 inv_scale);
  SDPA_LAUNCH_CHECK("e4m3 encode launch");
}

}  // namespace sdpa
