// The middle step of the unfused cuBLAS backend: P = softmax(S) row by row, with the causal mask
// (aligned bottom-right), written in the input dtype for the P·V GEMM. Assumes validated arguments:
// S holds rows x seq_k scaled scores (f32, scale folded into the Q·Kᵀ GEMM's alpha), P has the same
// shape, rows = batch * heads * seq_q. One CTA per row on grid x: rows <= 2^31 - 1 (cublas::limits,
// crates/sdpa/src/backend/cublas/mod.rs); row and column indices are 64-bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/check.cuh"
#include "sdpa/sdpa.h"

namespace sdpa::cublas_backend {
namespace {

// 256 threads per row: the longest rows (16k keys) take 64 iterations per thread, the shortest
// we bench (256 keys) one; either way one block per row keeps every load coalesced.
constexpr int kThreads = 256;

template <typename Op>
__device__ float block_reduce(float x, Op op, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from the previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) x = op(x, scratch[w]);
  return x;
}

template <typename T>
__device__ T to(float x);
template <>
__device__ __half to<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __nv_bfloat16 to<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    softmax_kernel(const float* __restrict__ s, T* __restrict__ p, int64_t seq_q, int64_t seq_k,
                   bool causal) {
  __shared__ float scratch[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int64_t i = row % seq_q;
  // Keys this row sees: j <= i + seq_k - seq_q.
  int64_t n = seq_k;
  if (causal) n = max(int64_t(0), min(seq_k, i + 1 + seq_k - seq_q));
  const float* srow = s + row * seq_k;
  T* prow = p + row * seq_k;
  constexpr float kLog2e = 1.4426950408889634f;

  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) m = fmaxf(m, srow[j]);
  m = block_reduce(m, [](float a, float b) { return fmaxf(a, b); }, scratch);
  // No visible key: all p = 0. Products rounded before the subtraction (no FMA contraction):
  // the max's exponent is exactly 0 at any logit size (see wmma_fwd.cuh).
  const float base = m == -INFINITY ? 0.f : __fmul_rn(m, kLog2e);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += kThreads)
    sum += exp2f(__fmul_rn(srow[j], kLog2e) - base);
  sum = block_reduce(sum, [](float a, float b) { return a + b; }, scratch);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int64_t j = threadIdx.x; j < seq_k; j += kThreads)
    prow[j] = to<T>(j < n ? exp2f(__fmul_rn(srow[j], kLog2e) - base) * inv : 0.f);
}

}  // namespace
}  // namespace sdpa::cublas_backend

namespace sdpa {

void masked_softmax(const SoftmaxArgs& a, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  const auto s = device_ptr<const float>(a.s);
  if (a.rows > 0x7fffffff) throw Error("masked_softmax: more than 2^31-1 rows");
  const unsigned grid = unsigned(a.rows);
  using namespace cublas_backend;
  switch (a.dtype) {
    case Dtype::F16:
      softmax_kernel<<<grid, kThreads, 0, st>>>(s, device_ptr<__half>(a.p), a.seq_q, a.seq_k,
                                                a.mask == sdpa::Mask::CausalBottomRight);
      break;
    case Dtype::BF16:
      softmax_kernel<<<grid, kThreads, 0, st>>>(s, device_ptr<__nv_bfloat16>(a.p), a.seq_q, a.seq_k,
                                                a.mask == sdpa::Mask::CausalBottomRight);
      break;
    default:
      throw Error("masked_softmax: unsupported dtype code " + std::to_string(int(a.dtype)));
  }
  SDPA_LAUNCH_CHECK("masked_softmax launch");
}

}  // namespace sdpa
